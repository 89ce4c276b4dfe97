//! JSON text as the gateway's Python side writes it, for the encoders the binding runs in one
//! call (the OTLP/JSON span batch, issue 25): a string escaped exactly as orjson escapes it,
//! and a finite float in the form of Python's `repr`. Byte-for-byte equality with those is the
//! contract: the Python encoder is the reference the binding's output is tested against.

/// For each byte below 0x20, and `"` and `\`: its escape, or 0 (none needed).
const fn short_escape(b: u8) -> u8 {
    match b {
        0x08 => b'b',
        0x09 => b't',
        0x0a => b'n',
        0x0c => b'f',
        0x0d => b'r',
        b'"' => b'"',
        b'\\' => b'\\',
        _ => 0,
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The bytes a JSON string escapes: below 0x20, `"` and `\`.
const ESCAPED: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// `s` as a JSON string, quotes included, escaped as orjson escapes it: `"` and `\` with a
/// backslash; `\b \t \n \f \r` in their short forms; any other byte below 0x20 as `\u00xx`
/// (lower-case hex); everything else (DEL, non-ASCII, `/`) as it is.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if !ESCAPED[usize::from(b)] {
            continue;
        }
        out.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        let short = short_escape(b);
        if short != 0 {
            out.extend_from_slice(&[b'\\', short]);
        } else {
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 15)],
            ]);
        }
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// `n` in decimal.
pub fn write_int(out: &mut Vec<u8>, n: i64) {
    if n < 0 {
        out.push(b'-');
    }
    let mut n = n.unsigned_abs();
    let mut tmp = [0u8; 20];
    let mut at = tmp.len();
    loop {
        at -= 1;
        tmp[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&tmp[at..]);
}

/// `n` in lower-case hex, zero-padded to `width` digits (at most 32).
pub fn write_hex(out: &mut Vec<u8>, mut n: u128, width: usize) {
    let mut tmp = [b'0'; 32];
    let mut at = tmp.len();
    while n > 0 {
        at -= 1;
        tmp[at] = HEX[(n & 15) as usize];
        n >>= 4;
    }
    out.extend_from_slice(&tmp[at.min(tmp.len() - width)..]);
}

/// A finite `x` as Python's `repr(x)` writes it: the shortest digits that round-trip, in
/// positional form (with `.0` when whole) when the decimal point falls within 16 digits and
/// after the 4th decimal place, else as `d.ddde±XX` (at least two exponent digits). False
/// (nothing written) for NaN and the infinities.
pub fn write_float_repr(out: &mut Vec<u8>, x: f64) -> bool {
    if !x.is_finite() {
        return false;
    }
    // Rust's `{:e}` writes the shortest round-tripping digits (`d[.ddd]e<exp>`), but where
    // several of that length round-trip, not always the one Python's repr (David Gay's mode
    // 0) chooses: the closest to `x`. That one is `x` correctly rounded to as many digits
    // (`{:.N$e}` is exact), when it round-trips, as it does but at a power of two's edge.
    let short = format!("{:e}", x.abs());
    let n = short
        .split_once('e')
        .map_or(0, |(m, _)| m.bytes().filter(u8::is_ascii_digit).count());
    // With 15 digits or fewer there is only one: decimals of that length are at least 1e-15
    // apart (relatively), a normal double's rounding interval 2^-52 wide (a subnormal's is
    // wider).
    let mut sci = short;
    if n > 15 || x.abs() < f64::MIN_POSITIVE {
        let closest = format!("{:.prec$e}", x.abs(), prec = n - 1);
        if closest.parse::<f64>() == Ok(x.abs()) {
            sci = closest;
        }
    }
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: Vec<u8> = mantissa.bytes().filter(u8::is_ascii_digit).collect();
    let n = digits.len() as i32;
    // value = 0.d1d2...dn × 10^decpt
    let decpt = exp + 1;
    if x.is_sign_negative() {
        out.push(b'-');
    }
    if decpt <= -4 || decpt > 16 {
        out.push(digits[0]);
        if n > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        out.push(b'e');
        out.push(if exp < 0 { b'-' } else { b'+' });
        if exp.unsigned_abs() < 10 {
            out.push(b'0');
        }
        write_int(out, i64::from(exp.unsigned_abs()));
    } else if decpt <= 0 {
        out.extend_from_slice(b"0.");
        out.extend(std::iter::repeat_n(b'0', (-decpt) as usize));
        out.extend_from_slice(&digits);
    } else if decpt < n {
        out.extend_from_slice(&digits[..decpt as usize]);
        out.push(b'.');
        out.extend_from_slice(&digits[decpt as usize..]);
    } else {
        out.extend_from_slice(&digits);
        out.extend(std::iter::repeat_n(b'0', (decpt - n) as usize));
        out.extend_from_slice(b".0");
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr(x: f64) -> String {
        let mut out = Vec::new();
        assert!(write_float_repr(&mut out, x));
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn floats_as_python_repr() {
        for (x, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (-2.0, "-2.0"),
            (1e-7, "1e-07"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1e21, "1e+21"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.30000000000000004, "0.30000000000000004"),
            (1234.5678, "1234.5678"),
            (147123166421314.62, "147123166421314.62"),
        ] {
            assert_eq!(repr(x), want, "{x}");
        }
        assert!(!write_float_repr(&mut Vec::new(), f64::NAN));
        assert!(!write_float_repr(&mut Vec::new(), f64::NEG_INFINITY));
    }

    #[test]
    fn strings_as_orjson() {
        let mut out = Vec::new();
        write_str(
            &mut out,
            "a\"b\\c/\u{7f}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f}é😀",
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\"a\\\"b\\\\c/\u{7f}\\u0001\\b\\t\\n\\u000b\\f\\r\\u001fé😀\""
        );
    }

    #[test]
    fn hex_and_ints() {
        let mut out = Vec::new();
        write_hex(&mut out, 0xabc, 16);
        out.push(b' ');
        write_int(&mut out, i64::MIN);
        out.push(b' ');
        write_int(&mut out, 0);
        out.push(b' ');
        write_int(&mut out, 1_000_000);
        out.push(b' ');
        write_hex(&mut out, u128::MAX, 32);
        out.push(b' ');
        write_hex(&mut out, 0, 16);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "0000000000000abc -9223372036854775808 0 1000000 ffffffffffffffffffffffffffffffff \
             0000000000000000"
        );
    }
}
