//! The access log's lines, built in one call each (issue 25): `LineBuffer.access` reads a
//! finished exchange's fields and appends its text or JSON line to a buffer the log hands to
//! its writer thread in batches. No decision here: the fields and their formats are
//! `gateway.logs`'s (`ACCESS_FIELDS`, `AccessLog.line`) and `gateway.access`'s
//! (`AccessValues.values`); this is the same line without a Python call per field. Anything
//! outside the common case (a request id the client chose, which is redacted; a string JSON
//! must escape; a value of an unexpected type; a float too large for its short form) is left
//! to that Python code: `access` returns -1 and appends nothing.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyInt, PyString, PyType};

use crate::enums::Priority;

/// Access-log lines (and other log lines, `push`) waiting for the writer, in order.
#[pyclass(module = "gateway._core")]
pub struct LineBuffer {
    buf: Vec<u8>,
    lines: usize,
    /// The wall-clock second `stamp` is for (text lines), and `stamp_of(second)`'s bytes.
    second: i64,
    stamp: Vec<u8>,
    stamp_of: Py<PyAny>,
    /// How the last exchange's type's fields are read (`Slots::of`).
    slots: Option<Slots>,
}

/// `$konst = "name"`: the exchange's fields the line reads, by index into `EXCHANGE_FIELDS`.
macro_rules! fields {
    ($($konst:ident = $name:literal),+ $(,)?) => {
        const EXCHANGE_FIELDS: &[&str] = &[$($name),+];
        fields!(@index 0usize; $($konst),+);
    };
    (@index $n:expr; $head:ident $(, $rest:ident)*) => {
        const $head: usize = $n;
        fields!(@index $n + 1usize; $($rest),*);
    };
    (@index $n:expr;) => {};
}

fields!(
    REQUEST_ID = "request_id",
    POOL = "pool",
    INSTANCE = "instance",
    DECISION = "decision",
    WAITED_AS = "waited_as",
    QUEUE_MS = "queue_ms",
    UPSTREAM_MS = "upstream_ms",
    STATUS = "status",
    ATTEMPTS = "attempts",
    ERROR = "error",
    STARTED = "started",
    SOURCE = "source",
    KEY_NAME = "key_name",
    ATTEMPT = "attempt",
    AFFINITY_KEY = "affinity_key",
    AFFINITY_PREFIX = "affinity_prefix",
    AFFINITY = "affinity",
    AFFINITY_MATCH = "affinity_match",
    SLO_TTFT_MS = "slo_ttft_ms",
    SLO_TPOT_MS = "slo_tpot_ms",
    SLO_RESULT = "slo_result",
);

/// The exchange's fields read through its type's own slot descriptors: what `getattr` finds
/// for them on a slots dataclass (the type is first in its MRO and a member descriptor is a
/// data descriptor), without the type look-up by name per field — about a third of reading
/// them. Made only for a type whose own `__dict__` holds a member descriptor for every field.
struct Slots {
    ty: Py<PyType>,
    get: ffi::descrgetfunc,
    descrs: Vec<Py<PyAny>>,
}

impl Slots {
    fn of(ty: &Bound<'_, PyType>) -> Option<Slots> {
        let dict = ty.getattr(intern!(ty.py(), "__dict__")).ok()?;
        let mut get = None;
        let mut descrs = Vec::with_capacity(EXCHANGE_FIELDS.len());
        for name in EXCHANGE_FIELDS {
            let descr = dict.get_item(name).ok()?;
            let kind = descr.get_type();
            if kind.qualname().ok()?.to_str().ok()? != "member_descriptor" {
                return None;
            }
            // SAFETY: a type object's `tp_descr_get` slot (PyType_GetSlot reads any type's
            // slots since 3.10), non-null: a `descrgetfunc`.
            let f = unsafe { ffi::PyType_GetSlot(kind.as_type_ptr(), ffi::Py_tp_descr_get) };
            if f.is_null() {
                return None;
            }
            get = Some(unsafe { std::mem::transmute::<*mut c_void, ffi::descrgetfunc>(f) });
            descrs.push(descr.unbind());
        }
        Some(Slots {
            ty: ty.clone().unbind(),
            get: get?,
            descrs,
        })
    }

    fn read<'py>(&self, obj: &Bound<'py, PyAny>, field: usize) -> Option<Bound<'py, PyAny>> {
        // SAFETY: `obj` is exactly of type `ty` (checked by the caller), whose own `__dict__`
        // holds `descrs[field]`, a member descriptor, and `get` is member descriptors'
        // `tp_descr_get`: the call `getattr(obj, name)` makes. It returns a new reference, or
        // NULL with an exception set (an unset slot's AttributeError), taken here.
        unsafe {
            let got = (self.get)(self.descrs[field].as_ptr(), obj.as_ptr(), self.ty.as_ptr());
            Bound::from_owned_ptr_or_err(obj.py(), got).ok()
        }
    }
}

/// One line being written: `key=value` pairs joined by spaces (text, `None` left out) or a
/// JSON object's members (`None` as null).
struct Line<'b> {
    buf: &'b mut Vec<u8>,
    json: bool,
    first: bool,
}

impl Line<'_> {
    fn key(&mut self, key: &str) {
        let buf = &mut *self.buf;
        if self.json {
            buf.extend_from_slice(b",\"");
            buf.extend_from_slice(key.as_bytes());
            buf.extend_from_slice(b"\":");
        } else {
            if !self.first {
                buf.push(b' ');
            }
            buf.extend_from_slice(key.as_bytes());
            buf.push(b'=');
        }
        self.first = false;
    }

    fn none(&mut self, key: &str) {
        if self.json {
            self.key(key);
            self.buf.extend_from_slice(b"null");
        }
    }

    /// A string as orjson writes it (JSON) or as `str()` gives it (text); `None` when JSON
    /// would need an escape (left to orjson).
    fn str(&mut self, key: &str, s: &str) -> Option<()> {
        if self.json {
            if s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
                return None;
            }
            self.key(key);
            self.buf.push(b'"');
            self.buf.extend_from_slice(s.as_bytes());
            self.buf.push(b'"');
        } else {
            self.key(key);
            self.buf.extend_from_slice(s.as_bytes());
        }
        Some(())
    }

    fn int(&mut self, key: &str, i: i64) {
        self.key(key);
        if i < 0 {
            self.buf.push(b'-');
        }
        digits(self.buf, i.unsigned_abs(), 1);
    }

    /// `round(x, 1)` as `repr()` (text) and orjson (JSON) write it: exact decimal rounding,
    /// ties to even, as Python's `round`; with at most 15 significant digits the shortest
    /// form of the rounded float is the rounded decimal itself.
    fn float1(&mut self, key: &str, x: f64) -> Option<()> {
        if !x.is_finite() || x.abs() >= 1e13 {
            return None;
        }
        self.key(key);
        fixed(self.buf, x, 1);
        Some(())
    }

    /// An optional string attribute (`None`, or exactly a `str`).
    fn opt_str(&mut self, key: &str, v: &Bound<'_, PyAny>) -> Option<()> {
        if v.is_none() {
            self.none(key);
            return Some(());
        }
        let s = v.cast_exact::<PyString>().ok()?;
        self.str(key, s.to_str().ok()?)
    }

    /// An optional int attribute (`None`, or exactly an `int` that fits in 64 bits).
    fn opt_int(&mut self, key: &str, v: &Bound<'_, PyAny>) -> Option<()> {
        if v.is_none() {
            self.none(key);
            return Some(());
        }
        let i = v.cast_exact::<PyInt>().ok()?.extract::<i64>().ok()?;
        self.int(key, i);
        Some(())
    }

    /// `round(x, 1)` of a float attribute (exactly a `float`).
    fn round1(&mut self, key: &str, v: &Bound<'_, PyAny>) -> Option<()> {
        self.float1(key, v.cast_exact::<PyFloat>().ok()?.value())
    }
}

/// `fmt::Write` into a byte buffer (only ASCII is ever formatted into it).
struct Bytes<'b>(&'b mut Vec<u8>);

impl std::fmt::Write for Bytes<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// `x` with `places` decimals (1 or 3), rounded as Python's `round(x, places)` rounds: on the
/// exact binary value, ties to even; `|x| * 10^places` below 2^53. The rounding is done in
/// integers unless the scaled value is within its own error of a tie, where the exact
/// formatter decides (`format!`'s precision is exact, ties to even).
fn fixed(buf: &mut Vec<u8>, x: f64, places: u32) {
    let scale = 10u64.pow(places);
    let y = x.abs() * scale as f64;
    let whole = y.floor();
    // exact; and |y - the exact product| <= half an ulp of y
    let frac = y - whole;
    if (frac - 0.5).abs() <= y * 2.3e-16 {
        let _ = write!(Bytes(buf), "{x:.prec$}", prec = places as usize);
        return;
    }
    let n = whole as u64 + u64::from(frac > 0.5);
    if x.is_sign_negative() {
        buf.push(b'-');
    }
    digits(buf, n / scale, 1);
    buf.push(b'.');
    digits(buf, n % scale, places as usize);
}

/// `n` in decimal, zero-padded to `width` digits (no `core::fmt`: this runs once per request
/// field, between requests, where less code is less to fetch).
fn digits(buf: &mut Vec<u8>, mut n: u64, width: usize) {
    let mut tmp = [b'0'; 20];
    let mut at = tmp.len();
    while n > 0 || tmp.len() - at < width {
        at -= 1;
        tmp[at] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    buf.extend_from_slice(&tmp[at..]);
}

/// A token count of the upstream's `usage`: an `int` (not a bool), not negative; else None.
fn tokens(usage: &Bound<'_, PyDict>, key: &Bound<'_, PyString>) -> Option<Option<i64>> {
    match usage.get_item(key).ok()? {
        Some(v) if v.is_exact_instance_of::<PyInt>() => match v.extract::<i64>() {
            Ok(n) => Some((n >= 0).then_some(n)),
            Err(_) => None, // beyond 64 bits: left to Python
        },
        _ => Some(None),
    }
}

/// `time.time()`: the wall clock in seconds, as CPython converts its nanoseconds.
fn wall_now() -> f64 {
    let ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    ns as f64 / 1e9
}

impl LineBuffer {
    /// The access line of `ex` (see `access`), appended to `self.buf`; `None`: left to
    /// Python (the buffer may hold part of it: the caller truncates).
    fn write_access<'py>(
        &mut self,
        py: Python<'py>,
        ex: &Bound<'py, PyAny>,
        mono: f64,
        prefix: &str,
        json: bool,
        wall: f64,
    ) -> Option<()> {
        let slots = self
            .slots
            .as_ref()
            .filter(|s| ex.get_type().is(s.ty.bind(py)));
        let get = |field: usize| match slots {
            Some(slots) => slots.read(ex, field),
            None => ex
                .getattr(PyString::intern(py, EXCHANGE_FIELDS[field]))
                .ok(),
        };
        // SPEC §7: no key in any log line — a request id the client chose is redacted, by
        // Python's redactor; one the gateway made (`prefix` + its ticket) cannot hold one.
        let rid_obj = get(REQUEST_ID)?;
        let rid = rid_obj.cast_exact::<PyString>().ok()?.to_str().ok()?;
        let ticket = rid.strip_prefix(prefix)?;
        if ticket.is_empty() || !ticket.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if json {
            // orjson's `{"ts":round(now, 3),"level":"info",...}`: the shortest form of the
            // rounded float is its 3-decimal form without trailing zeros (13 digits).
            if !wall.is_finite() || !(0.0..1e12).contains(&wall) {
                return None;
            }
            self.buf.extend_from_slice(b"{\"ts\":");
            let at = self.buf.len();
            fixed(&mut self.buf, wall, 3);
            while self.buf.len() > at + 1 && self.buf.ends_with(b"0") {
                if self.buf[self.buf.len() - 2] == b'.' {
                    break;
                }
                self.buf.pop();
            }
            self.buf.extend_from_slice(
                b",\"level\":\"info\",\"logger\":\"gateway.access\",\"msg\":\"request\"",
            );
        } else {
            let second = wall as i64;
            if second != self.second {
                let stamp = self.stamp_of.bind(py).call1((wall,)).ok()?;
                let stamp = stamp.cast_exact::<PyString>().ok()?.to_str().ok()?;
                self.stamp = stamp.as_bytes().to_vec();
                self.second = second;
            }
            self.buf.extend_from_slice(&self.stamp);
        }
        let mut line = Line {
            buf: &mut self.buf,
            json,
            first: true,
        };
        line.str("id", rid)?;
        line.opt_str("pool", &get(POOL)?)?;
        line.opt_str("instance", &get(INSTANCE)?)?;
        // priority, complexity, rule: the decision's (the class it waited as, if it did)
        let decision = get(DECISION)?;
        if decision.is_none() {
            line.none("priority");
            line.none("complexity");
            line.none("rule");
        } else {
            let waited = get(WAITED_AS)?;
            let class = if waited.is_none() {
                decision.getattr(intern!(py, "priority")).ok()?
            } else {
                waited
            };
            let label = match *class.cast::<Priority>().ok()?.get() {
                Priority::HIGH => "high",
                Priority::LOW => "low",
            };
            line.str("priority", label)?;
            line.opt_str(
                "complexity",
                &decision.getattr(intern!(py, "complexity")).ok()?,
            )?;
            line.opt_str(
                "rule",
                &decision.getattr(intern!(py, "complexity_rule")).ok()?,
            )?;
        }
        line.round1("queue_ms", &get(QUEUE_MS)?)?;
        line.round1("upstream_ms", &get(UPSTREAM_MS)?)?;
        line.opt_int("status", &get(STATUS)?)?;
        line.opt_int("attempts", &get(ATTEMPTS)?)?;
        line.opt_str("error", &get(ERROR)?)?;
        let started = get(STARTED)?;
        let started = started.cast_exact::<PyFloat>().ok()?.value();
        line.float1("total_ms", (mono - started) * 1000.0)?;
        line.opt_str("source", &get(SOURCE)?)?;
        // SPEC §9: operators bill and throttle by key — its name, never the key itself.
        line.opt_str("key", &get(KEY_NAME)?)?;
        let attempt = get(ATTEMPT)?;
        let (mut prompt, mut completion) = (None, None);
        if !attempt.is_none() {
            let usage = attempt.getattr(intern!(py, "usage")).ok()?;
            if !usage.is_none() {
                let usage = usage.cast_exact::<PyDict>().ok()?;
                if !usage.is_empty() {
                    prompt = tokens(usage, intern!(py, "prompt_tokens"))?;
                    completion = tokens(usage, intern!(py, "completion_tokens"))?;
                }
            }
        }
        match prompt {
            Some(n) => line.int("prompt_tokens", n),
            None => line.none("prompt_tokens"),
        }
        match completion {
            Some(n) => line.int("completion_tokens", n),
            None => line.none("completion_tokens"),
        }
        // SPEC §15: where the attempt landed relative to its key, for a request placed by one.
        let key = get(AFFINITY_KEY)?;
        let unplaced =
            !key.cast_exact::<PyInt>().ok()?.is_truthy().ok()? && get(AFFINITY_PREFIX)?.is_none();
        if unplaced {
            line.none("affinity");
        } else {
            line.opt_str("affinity", &get(AFFINITY)?)?;
        }
        line.opt_int("affinity_match", &get(AFFINITY_MATCH)?)?;
        // SPEC §17: met, missed or shed (None: no objective).
        if get(SLO_TTFT_MS)?.is_none() && get(SLO_TPOT_MS)?.is_none() {
            line.none("slo");
        } else {
            let result = get(SLO_RESULT)?;
            if result.is_none() {
                line.str("slo", "missed")?;
            } else {
                let s = result.cast_exact::<PyString>().ok()?.to_str().ok()?;
                line.str("slo", if s.is_empty() { "missed" } else { s })?;
            }
        }
        self.buf
            .extend_from_slice(if json { b"}\n" } else { b"\n" });
        Some(())
    }
}

#[pymethods]
impl LineBuffer {
    /// `stamp_of(wall)`: a text line's head for the wall-clock second of `wall` (called
    /// once a second at most).
    #[new]
    fn new(stamp_of: Py<PyAny>) -> Self {
        Self {
            buf: Vec::new(),
            lines: 0,
            second: i64::MIN,
            stamp: Vec::new(),
            stamp_of,
            slots: None,
        }
    }

    /// Appends one finished line (ending in a newline). Returns the lines buffered.
    fn push(&mut self, line: &[u8]) -> usize {
        self.buf.extend_from_slice(line);
        self.lines += 1;
        self.lines
    }

    /// Appends the access line of the finished exchange `ex` (`gateway.exchange.Exchange`)
    /// at monotonic time `mono` and wall-clock time `wall` (default: now), as JSON or text:
    /// what `AccessLog.line(AccessValues(prefix, ...).values(ex, mono), wall)` makes. Returns
    /// the lines buffered, or -1 (nothing appended) where that Python code must build it.
    #[pyo3(signature = (ex, mono, prefix, json, wall=None))]
    fn access(
        &mut self,
        py: Python<'_>,
        ex: &Bound<'_, PyAny>,
        mono: f64,
        prefix: &str,
        json: bool,
        wall: Option<f64>,
    ) -> isize {
        let start = self.buf.len();
        let ty = ex.get_type();
        if !matches!(&self.slots, Some(s) if ty.is(s.ty.bind(py))) {
            self.slots = Slots::of(&ty);
        }
        let wall = wall.unwrap_or_else(wall_now);
        if self
            .write_access(py, ex, mono, prefix, json, wall)
            .is_none()
        {
            self.buf.truncate(start);
            return -1;
        }
        self.lines += 1;
        self.lines as isize
    }

    /// The buffered lines and their count, emptying the buffer; None when it is empty.
    fn take<'py>(&mut self, py: Python<'py>) -> Option<(Bound<'py, PyBytes>, usize)> {
        if self.lines == 0 && self.buf.is_empty() {
            return None;
        }
        let data = PyBytes::new(py, &self.buf);
        let n = self.lines;
        self.buf.clear();
        self.lines = 0;
        if self.buf.capacity() > 1 << 20 {
            self.buf.shrink_to(1 << 20); // a burst's buffer is not kept for ever
        }
        Some((data, n))
    }

    /// The lines buffered.
    fn __len__(&self) -> usize {
        self.lines
    }
}
