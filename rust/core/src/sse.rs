//! A relayed token stream's common read, checked in one call (issue 25: the relay's CPU per
//! event).
//!
//! An OpenAI-style upstream (vLLM, OpenAI) paces a stream one event per HTTP/1.1 chunk, and
//! the gateway reads them one at a time: `HEX CRLF data: {...}\n\n CRLF`. When such a read
//! holds nothing the gateway acts on, it can go to the client exactly as it came (its framing
//! is the client's framing too). `PlainEvents::plain` says whether a read is one: the rest —
//! a chunk cut across reads, several events, a usage or error event, `[DONE]`, anything that
//! is not JSON — is for the gateway's full checker (`gateway.sse.SseChecker`), which this
//! never replaces: it only ever answers "yes, as it came" or "not mine".
//!
//! So the rules are a strict subset of what the full path accepts unchanged: every read this
//! accepts, the full path would have relayed byte for byte. Pure: no I/O, no clock.

use serde::de::IgnoredAny;
use serde::Deserialize;

/// The most hex digits a chunk-size line taken here may have (below 2^60: no overflow).
const MAX_SIZE_DIGITS: usize = 15;

/// The members of an event's JSON object the gateway acts on. Anything else is only checked
/// to be JSON (and skipped).
#[derive(Deserialize)]
struct Acted {
    #[serde(default)]
    usage: Option<IgnoredAny>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

/// The check of one stream's reads (its bounds and the instance's key).
#[derive(Debug, Clone)]
pub struct PlainEvents {
    max_chunk: usize,
    max_event: usize,
    /// The instance's key (empty: none), never passed.
    secret: Vec<u8>,
}

impl PlainEvents {
    /// `max_chunk`: the largest chunk the response may declare (SPEC §16); `max_event`:
    /// `limits.max_event_bytes`; `secret`: the instance's key (empty: none), never passed.
    pub fn new(max_chunk: usize, max_event: usize, secret: &[u8]) -> Self {
        PlainEvents {
            max_chunk,
            max_event,
            secret: secret.to_vec(),
        }
    }

    /// Whether `read` — bytes that start at a chunk boundary of a chunked body — is exactly
    /// one whole chunk (`HEX CRLF data CRLF`: 1 to 15 hex digits, no extension, a size from 1
    /// to `max_chunk`, nothing after) whose data is one event: `data:`, a JSON object (UTF-8,
    /// RFC 8259) with neither a non-null `usage` nor a non-null `error` member, then a blank
    /// line (`\n\n`; no other line feed), at most `max_event` bytes before the blank line,
    /// and the key nowhere in the read.
    pub fn plain(&self, read: &[u8]) -> bool {
        // The chunk-size line: hex digits only, then CRLF.
        let digits = read
            .iter()
            .take(MAX_SIZE_DIGITS + 1)
            .take_while(|b| b.is_ascii_hexdigit());
        let nd = digits.count();
        if nd == 0 || nd > MAX_SIZE_DIGITS || read.get(nd..nd + 2) != Some(b"\r\n") {
            return false;
        }
        let mut size = 0usize;
        for &b in &read[..nd] {
            // is_ascii_hexdigit held: to_digit cannot fail
            size = size * 16 + (b as char).to_digit(16).unwrap_or(0) as usize;
        }
        let start = nd + 2;
        if size == 0 || size > self.max_chunk || read.len() != start + size + 2 {
            return false;
        }
        if &read[read.len() - 2..] != b"\r\n" {
            return false;
        }
        let event = &read[start..read.len() - 2];
        // One one-line `data:` event: its only line feeds are those of its blank line.
        let Some(lf) = memchr::memchr(b'\n', event) else {
            return false;
        };
        if lf != event.len() - 2 || event[event.len() - 1] != b'\n' || !event.starts_with(b"data:")
        {
            return false;
        }
        if event.len() - 2 > self.max_event {
            return false;
        }
        if self.holds_secret(read) {
            return false;
        }
        let payload = &event[5..event.len() - 2];
        // An object (not `[DONE]`, an array, a string...): what the full path reads.
        let first = payload.iter().find(|b| !matches!(b, b' ' | b'\t' | b'\r'));
        if first != Some(&b'{') || std::str::from_utf8(payload).is_err() {
            return false;
        }
        match serde_json::from_slice::<Acted>(payload) {
            Ok(acted) => acted.usage.is_none() && acted.error.is_none(),
            Err(_) => false,
        }
    }
}

impl PlainEvents {
    /// Whether the key occurs in `read`: each place its first byte occurs, compared (a key
    /// is a few dozen bytes, a token event a few hundred). Not a stored `memmem::Finder`: it
    /// holds 32-byte-aligned vectors, and this struct lives inside a Python object (16-byte
    /// aligned memory) in the binding.
    fn holds_secret(&self, read: &[u8]) -> bool {
        let Some((&first, rest)) = self.secret.split_first() else {
            return false;
        };
        memchr::memchr_iter(first, read).any(|i| read[i + 1..].starts_with(rest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(event: &[u8]) -> Vec<u8> {
        let mut out = format!("{:x}\r\n", event.len()).into_bytes();
        out.extend_from_slice(event);
        out.extend_from_slice(b"\r\n");
        out
    }

    fn plain(read: &[u8]) -> bool {
        PlainEvents::new(1 << 20, 1 << 20, b"sk-secret").plain(read)
    }

    const EVENT: &[u8] =
        b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";

    #[test]
    fn a_plain_token_event_passes() {
        let p = PlainEvents::new(1 << 20, 1 << 20, b"");
        assert!(p.plain(&chunk(EVENT)));
        assert!(p.plain(&chunk(b"data:{}\n\n")));
        assert!(p.plain(&chunk(b"data: {\"usage\":null,\"error\":null}\n\n")));
        let upper = format!("{:X}\r\n", EVENT.len()).into_bytes();
        assert!(p.plain(&[upper.as_slice(), EVENT, b"\r\n"].concat()));
        let padded = format!("000{:x}\r\n", EVENT.len()).into_bytes();
        assert!(p.plain(&[padded.as_slice(), EVENT, b"\r\n"].concat()));
    }

    #[test]
    fn what_the_gateway_acts_on_is_not_plain() {
        for event in [
            &b"data: [DONE]\n\n"[..],
            b"data: {\"usage\":{\"completion_tokens\":3}}\n\n",
            b"data: {\"usage\":{}}\n\n",
            b"data: {\"error\":{\"message\":\"x\"}}\n\n",
            b"data: {\"error\":\"x\"}\n\n",
            b"data: [1,2]\n\n",
            b"data: \"text\"\n\n",
            b"data: {not json}\n\n",
            b"data: {\"a\":1} trailing\n\n",
            b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\n",
            b"data: {\"a\":1}\r\n\r\n",
            b"event: x\ndata: {\"a\":1}\n\n",
            b": comment\n\n",
            b"data: {\"a\":1}\n",
            b"data: {\"a\":\"\xff\xfe\"}\n\n",
            b"data: {\"a\":\"sk-secret\"}\n\n",
            b"data: {\"a\":1,\"a\":2,\"usage\":null,\"usage\":null}\n\n",
        ] {
            assert!(
                !plain(&chunk(event)),
                "{:?}",
                String::from_utf8_lossy(event)
            );
        }
    }

    #[test]
    fn only_one_whole_strictly_framed_chunk_is_plain() {
        let one = chunk(EVENT);
        assert!(plain(&one));
        assert!(!plain(&one[..one.len() - 1]), "a chunk cut short");
        assert!(
            !plain(&[one.as_slice(), one.as_slice()].concat()),
            "two chunks"
        );
        assert!(
            !plain(&[one.as_slice(), b"0\r\n\r\n"].concat()),
            "with the last chunk"
        );
        let n = EVENT.len();
        for head in [
            format!("{n:x};ext=1\r\n"),
            format!("+{n:x}\r\n"),
            format!("0x{n:x}\r\n"),
            format!(" {n:x}\r\n"),
            format!("{n:x} \r\n"),
            format!("{n:x}\n"),
            format!("{:x}\r\n", n + 1),
            format!("{:x}\r\n", n - 1),
            format!("0000000000000000{n:x}\r\n"),
        ] {
            let read = [head.as_bytes(), EVENT, b"\r\n"].concat();
            assert!(!plain(&read), "{head:?}");
        }
        assert!(!plain(
            &[format!("{n:x}\r\n").as_bytes(), EVENT, b"XY"].concat()
        ));
        assert!(!plain(b"0\r\n\r\n"));
        assert!(!plain(b""));
    }

    #[test]
    fn the_key_is_found_wherever_it_is() {
        let key = b"sk-secret";
        let p = PlainEvents::new(1 << 20, 1 << 20, key);
        for at in 0..40 {
            let mut text = vec![b's'; 40];
            text.splice(at..at, key.iter().copied());
            let event = [&b"data: {\"a\":\""[..], &text, b"\"}\n\n"].concat();
            assert!(!p.plain(&chunk(&event)), "at {at}");
            let cut = &text[..at + key.len() - 1];
            let almost = [&b"data: {\"a\":\""[..], cut, b"\"}\n\n"].concat();
            assert!(p.plain(&chunk(&almost)), "cut at {at}");
        }
    }

    #[test]
    fn the_bounds_hold() {
        let read = chunk(EVENT);
        assert!(!PlainEvents::new(EVENT.len() - 1, 1 << 20, b"").plain(&read));
        assert!(PlainEvents::new(EVENT.len(), 1 << 20, b"").plain(&read));
        assert!(!PlainEvents::new(1 << 20, EVENT.len() - 3, b"").plain(&read));
        assert!(PlainEvents::new(1 << 20, EVENT.len() - 2, b"").plain(&read));
    }
}
