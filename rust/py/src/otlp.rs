//! The exporter's OTLP/JSON batch written in one call (issue 25): `otlp_spans` takes the
//! finished spans `gateway.telemetry.Tracing` queued (its `_Record` tuples) and writes the
//! same bytes as `Tracing._encode_py`, the Python encoder, which stays the reference and the
//! fallback: anything outside the common case (a value of another type than exactly `str`,
//! `bool`, `int` within 64 bits, `float` or a list or tuple of `str`; a string that is not
//! valid UTF-8; a field of an unexpected type) returns None and the whole batch is left to Python.

use gateway_core::json::{write_float_repr, write_hex, write_int, write_str};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// The OTLP/JSON `ExportTraceServiceRequest` of `batch` (ids in hex, 64-bit integers as
/// strings, enums as numbers) after `prefix` (the resource and scope, up to `"spans":`), or
/// None when Python must encode it.
#[pyfunction]
pub fn otlp_spans<'py>(
    py: Python<'py>,
    batch: &Bound<'py, PyList>,
    prefix: &[u8],
) -> Option<Bound<'py, PyBytes>> {
    let mut out = Vec::with_capacity(prefix.len() + 64 + batch.len() * 1536);
    out.extend_from_slice(b"{\"resourceSpans\":[");
    out.extend_from_slice(prefix);
    out.push(b'[');
    for (i, rec) in batch.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        span(&mut out, rec.cast_exact::<PyTuple>().ok()?)?;
    }
    out.extend_from_slice(b"]}]}]}");
    Some(PyBytes::new(py, &out))
}

/// A string field, exactly a `str` (and valid UTF-8), as JSON.
fn string(out: &mut Vec<u8>, v: &Bound<'_, PyAny>) -> Option<()> {
    write_str(out, v.cast_exact::<PyString>().ok()?.to_str().ok()?);
    Some(())
}

/// One span: trace id, span id, parent span id (0: none), name, kind, start, end, attributes,
/// status (0: unset), tracestate ("": none) — `_SPAN_HEAD` and the rest of `_encode_py`.
fn span(out: &mut Vec<u8>, rec: &Bound<'_, PyTuple>) -> Option<()> {
    if rec.len() != 10 {
        return None;
    }
    let item = |i: usize| rec.get_item(i).ok();
    let trace: u128 = item(0)?.extract().ok()?;
    let sid: u64 = item(1)?.extract().ok()?;
    let parent: u64 = item(2)?.extract().ok()?;
    let kind: i64 = item(4)?.extract().ok()?;
    let start: i64 = item(5)?.extract().ok()?;
    let end: i64 = item(6)?.extract().ok()?;
    let status: i64 = item(8)?.extract().ok()?;
    out.extend_from_slice(b"{\"traceId\":\"");
    write_hex(out, trace, 32);
    out.extend_from_slice(b"\",\"spanId\":\"");
    write_hex(out, u128::from(sid), 16);
    out.extend_from_slice(b"\",\"name\":");
    string(out, &item(3)?)?;
    out.extend_from_slice(b",\"kind\":");
    write_int(out, kind);
    out.extend_from_slice(b",\"startTimeUnixNano\":\"");
    write_int(out, start);
    out.extend_from_slice(b"\",\"endTimeUnixNano\":\"");
    write_int(out, end);
    out.push(b'"');
    if parent != 0 {
        out.extend_from_slice(b",\"parentSpanId\":\"");
        write_hex(out, u128::from(parent), 16);
        out.push(b'"');
    }
    let state = item(9)?;
    let state = state.cast_exact::<PyString>().ok()?.to_str().ok()?;
    if !state.is_empty() {
        out.extend_from_slice(b",\"traceState\":");
        write_str(out, state);
    }
    if status != 0 {
        out.extend_from_slice(b",\"status\":{\"code\":");
        write_int(out, status);
        out.push(b'}');
    }
    out.extend_from_slice(b",\"attributes\":[");
    let attrs = item(7)?;
    let attrs = attrs.cast_exact::<PyDict>().ok()?;
    for (i, (key, v)) in attrs.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"key\":");
        string(out, &key)?;
        out.extend_from_slice(b",\"value\":{");
        if v.is_exact_instance_of::<PyString>() {
            out.extend_from_slice(b"\"stringValue\":");
            string(out, &v)?;
        } else if v.is_exact_instance_of::<PyBool>() {
            out.extend_from_slice(if v.is_truthy().ok()? {
                b"\"boolValue\":true"
            } else {
                b"\"boolValue\":false"
            });
        } else if v.is_exact_instance_of::<PyInt>() {
            // OTLP/JSON: a 64-bit integer as a string (beyond 64 bits: left to Python).
            out.extend_from_slice(b"\"intValue\":\"");
            write_int(out, v.extract::<i64>().ok()?);
            out.push(b'"');
        } else if let Ok(f) = v.cast_exact::<PyFloat>() {
            // OTLP/JSON: a double is a JSON number; NaN and infinities as proto3's strings.
            out.extend_from_slice(b"\"doubleValue\":");
            let x = f.value();
            if !write_float_repr(out, x) {
                out.extend_from_slice(if x.is_nan() {
                    b"\"NaN\""
                } else if x > 0.0 {
                    b"\"Infinity\""
                } else {
                    b"\"-Infinity\""
                });
            }
        } else if v.is_exact_instance_of::<PyList>() || v.is_exact_instance_of::<PyTuple>() {
            // A list of strings (`gen_ai.response.finish_reasons`): an `arrayValue` of
            // `stringValue`s (an item of another type than exactly `str`: left to Python).
            out.extend_from_slice(b"\"arrayValue\":{\"values\":[");
            for (j, x) in v.try_iter().ok()?.enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(b"{\"stringValue\":");
                string(out, &x.ok()?)?;
                out.push(b'}');
            }
            out.extend_from_slice(b"]}");
        } else {
            return None;
        }
        out.extend_from_slice(b"}}");
    }
    out.extend_from_slice(b"]}");
    Some(())
}
