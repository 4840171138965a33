//! The event protocol (docs/protocol.md), as pure functions: one line of
//! bytes in, a validated [`Request`] or a [`ProtocolError`] out; replies and
//! notices out as lines. No I/O here, so the parser is unit-tested with
//! inline fixtures and fuzzed (`fuzz/fuzz_targets/protocol.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::Entry;
use crate::model::{Allocator, MAX_DEVICE_BYTES};

/// Protocol version spoken by this daemon.
pub(crate) const VERSION: u64 = 1;
/// Longest line accepted, newline included.
pub const MAX_LINE: usize = 65_536;
const MAX_NAME: usize = 128;
const MAX_LABELS: usize = 16;
const MAX_LABEL_NAME: usize = 64;
const MAX_LABEL_VALUE: usize = 256;
const MAX_STATUS: usize = 32;
const MAX_MESSAGE: usize = 1024;
const MAX_ID: usize = 64;
/// How far back a held-back event's `at` may go: a client holds a message
/// back for milliseconds; an earlier `at` (a clock set back) is recorded
/// this long before it arrived.
pub(crate) const MAX_HELD_S: f64 = 60.0;

/// A request's `id`, echoed in its reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Id {
    Int(i64),
    Str(String),
}

/// A mark, span begin or span end.
#[derive(Debug, Clone, PartialEq)]
pub struct MarkBody {
    pub component: String,
    pub operation: String,
    pub iteration: Option<u64>,
    pub labels: BTreeMap<String, String>,
    pub allocator: Option<Allocator>,
    /// When the event happened (`at`, Unix seconds), for one the client
    /// held back: a client that sends fast steps in batches says when each
    /// happened.
    pub at: Option<f64>,
    /// When the span began (`began`, Unix seconds), on a held-back
    /// `span_end` whose `span_begin` was held with it: the one line stands
    /// for both, so a fast step costs its client one line instead of two.
    pub began: Option<f64>,
}

/// A stage begin or end.
#[derive(Debug, Clone, PartialEq)]
pub struct StageBody {
    pub name: String,
    pub status: Option<String>,
    pub message: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub allocator: Option<Allocator>,
}

/// What a client asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Mark(MarkBody),
    SpanBegin(MarkBody),
    SpanEnd(MarkBody),
    StageBegin(StageBody),
    StageEnd(StageBody),
    Subscribe,
    Status,
    Cleanup,
    Register,
    /// The job hit a CUDA out-of-memory error (the Python client's
    /// `install_oom_hook`), with `torch.cuda.memory_summary()`.
    Oom {
        summary: Option<String>,
        message: Option<String>,
        /// The allocator's figures at the error.
        allocator: Option<Allocator>,
    },
    /// The job's ClearML SDK made (or reused) this task (`Task.init`):
    /// memtrack reports into it instead of creating its own.
    ClearmlTask {
        task: String,
    },
    /// The job's ClearML SDK is closing that task with `status` (at the
    /// job's exit, or `task.close()`): memtrack may set it instead, after
    /// the final `memory_usage` artifact, so the record is the final file's.
    ClearmlClose {
        task: String,
        status: TaskStatus,
        /// Why, as the SDK says it (a failed task's exception).
        reason: Option<String>,
    },
}

/// A ClearML task's final status, as a job's SDK sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskStatus {
    Completed,
    Failed,
    Stopped,
}

impl TaskStatus {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Completed => "completed",
            TaskStatus::Failed => "failed",
            TaskStatus::Stopped => "stopped",
        }
    }
}

impl Message {
    /// Whether the message becomes an entry of the log.
    pub(crate) fn is_recorded(&self) -> bool {
        matches!(
            self,
            Message::Mark(_)
                | Message::SpanBegin(_)
                | Message::SpanEnd(_)
                | Message::StageBegin(_)
                | Message::StageEnd(_)
        )
    }

    /// Whether the message is recorded with a sample taken as it
    /// arrives. One the client held back (it says when it happened, `at`)
    /// is not: a sample now would not be the memory of its moment; it
    /// carries the last sample's.
    pub(crate) fn needs_sample(&self) -> bool {
        match self {
            Message::Mark(m) | Message::SpanBegin(m) | Message::SpanEnd(m) => m.at.is_none(),
            other => other.is_recorded(),
        }
    }
}

/// A parsed, validated request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub message: Message,
    pub ack: bool,
    pub id: Option<Id>,
}

/// Error codes of docs/protocol.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    Parse,
    Invalid,
    UnknownType,
    UnsupportedVersion,
    TooLong,
    Overloaded,
    Refused,
}

/// A request that could not be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ProtocolError {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    pub(crate) id: Option<Id>,
}

impl ProtocolError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ProtocolError {
            code,
            message: message.into(),
            id: None,
        }
    }
}

/// The wire shape, before validation. Unknown fields are ignored.
#[derive(Deserialize)]
struct Raw {
    v: Option<serde_json::Value>,
    #[serde(rename = "type")]
    kind: Option<String>,
    ack: Option<bool>,
    id: Option<serde_json::Value>,
    component: Option<String>,
    operation: Option<String>,
    iteration: Option<serde_json::Value>,
    labels: Option<BTreeMap<String, String>>,
    allocator: Option<RawAllocator>,
    name: Option<String>,
    status: Option<String>,
    message: Option<String>,
    summary: Option<String>,
    task: Option<String>,
    at: Option<serde_json::Value>,
    began: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawAllocator {
    allocated: u64,
    reserved: u64,
    max_allocated: u64,
    device: Option<u32>,
}

fn invalid(field: &str, rule: &str) -> ProtocolError {
    ProtocolError::new(ErrorCode::Invalid, format!("`{field}` {rule}"))
}

fn text(field: &str, value: Option<String>, max: usize) -> Result<String, ProtocolError> {
    let v = value.ok_or_else(|| invalid(field, "is required"))?;
    check_text(field, &v, max)?;
    Ok(v)
}

fn check_text(field: &str, v: &str, max: usize) -> Result<(), ProtocolError> {
    if v.is_empty() || v.len() > max {
        return Err(invalid(field, &format!("must be 1 to {max} bytes")));
    }
    if v.chars().any(char::is_control) {
        return Err(invalid(field, "must not contain control characters"));
    }
    Ok(())
}

fn labels(
    raw: Option<BTreeMap<String, String>>,
) -> Result<BTreeMap<String, String>, ProtocolError> {
    let labels = raw.unwrap_or_default();
    if labels.len() > MAX_LABELS {
        return Err(invalid(
            "labels",
            &format!("may hold at most {MAX_LABELS} entries"),
        ));
    }
    for (k, v) in &labels {
        if k.len() > MAX_LABEL_NAME || !crate::model::valid_label_name(k) {
            return Err(invalid(
                "labels",
                &format!("has a bad name {:?}: use [a-zA-Z_][a-zA-Z0-9_]*, at most {MAX_LABEL_NAME} bytes", truncated(k)),
            ));
        }
        if v.len() > MAX_LABEL_VALUE || v.chars().any(char::is_control) {
            return Err(invalid(
                "labels",
                &format!("value of `{k}` must be at most {MAX_LABEL_VALUE} bytes without control characters"),
            ));
        }
    }
    Ok(labels)
}

/// A time in Unix seconds (`at`, `began`): a positive finite number.
fn time(field: &str, raw: Option<serde_json::Value>) -> Result<Option<f64>, ProtocolError> {
    match raw {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|t| t.is_finite() && *t > 0.0)
            .map(Some)
            .ok_or_else(|| invalid(field, "must be a time in Unix seconds")),
    }
}

fn truncated(s: &str) -> String {
    s.chars().take(32).collect()
}

/// Parses and validates one line (without its newline).
pub fn parse(line: &[u8]) -> Result<Request, ProtocolError> {
    if line.len() >= MAX_LINE {
        return Err(ProtocolError::new(
            ErrorCode::TooLong,
            format!("a line may be at most {MAX_LINE} bytes"),
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(line);
    let parsed = serde_path_to_error::deserialize::<_, Raw>(&mut de);
    let mut raw = match parsed.map(|r| (r, de.end())) {
        Ok((r, Ok(()))) => r,
        Ok((_, Err(e))) => {
            return Err(ProtocolError::new(
                ErrorCode::Parse,
                format!("one JSON object per line, nothing after it ({e})"),
            ))
        }
        Err(e) => {
            // Tell "not JSON" apart from "a field of the wrong type", and
            // name the field.
            let path = e.path().to_string();
            let inner = e.into_inner();
            let mut err = if inner.is_data() && path != "." {
                ProtocolError::new(ErrorCode::Invalid, format!("`{path}`: {inner}"))
            } else {
                ProtocolError::new(
                    ErrorCode::Parse,
                    format!("not a JSON object on one line ({inner})"),
                )
            };
            // A readable object with a bad field still gets its id back,
            // so an ack caller can match the error to its request.
            if inner.is_data() {
                err.id = id_of(line);
            }
            return Err(err);
        }
    };
    let id = match raw.id.take() {
        None => None,
        Some(serde_json::Value::String(s)) if s.len() <= MAX_ID => Some(Id::Str(s)),
        Some(serde_json::Value::Number(n)) if n.is_i64() => n.as_i64().map(Id::Int),
        Some(_) => {
            return Err(invalid(
                "id",
                &format!("must be an integer or a string of at most {MAX_ID} bytes"),
            ))
        }
    };
    let with_id = |mut e: ProtocolError| {
        e.id.clone_from(&id);
        e
    };
    match &raw.v {
        None => {}
        Some(v) if v.as_u64() == Some(VERSION) => {}
        Some(v) => {
            return Err(with_id(ProtocolError::new(
                ErrorCode::UnsupportedVersion,
                format!("protocol version {v} is not supported; this daemon speaks {VERSION}"),
            )))
        }
    }
    let ack = raw.ack.unwrap_or(false);
    let message = body(raw).map_err(with_id)?;
    Ok(Request { message, ack, id })
}

/// The `id` of a line that is a JSON object but failed validation.
fn id_of(line: &[u8]) -> Option<Id> {
    #[derive(Deserialize)]
    struct OnlyId {
        id: Option<Id>,
    }
    serde_json::from_slice::<OnlyId>(line)
        .ok()
        .and_then(|o| o.id)
        .filter(|id| !matches!(id, Id::Str(s) if s.len() > MAX_ID))
}

fn body(raw: Raw) -> Result<Message, ProtocolError> {
    let kind = raw.kind.as_deref().unwrap_or("mark");
    let iteration = match raw.iteration {
        None | Some(serde_json::Value::Null) => None,
        // ClearML (and most stores) keep iterations as signed 64-bit
        // integers: a larger one would fail a whole batch there.
        Some(v) => Some(
            v.as_u64()
                .filter(|i| i64::try_from(*i).is_ok())
                .ok_or_else(|| invalid("iteration", "must be an integer from 0 to 2^63-1"))?,
        ),
    };
    if let Some(a) = &raw.allocator {
        for (field, bytes) in [
            ("allocator.allocated", a.allocated),
            ("allocator.reserved", a.reserved),
            ("allocator.max_allocated", a.max_allocated),
        ] {
            if bytes > MAX_DEVICE_BYTES {
                return Err(invalid(
                    field,
                    &format!(
                        "is {bytes} bytes, more than any GPU holds (at most {MAX_DEVICE_BYTES})"
                    ),
                ));
            }
        }
    }
    let at = time("at", raw.at)?;
    let began = time("began", raw.began)?;
    if let Some(b) = began {
        if kind != "span_end" || at.is_none_or(|at| b > at) {
            return Err(invalid(
                "began",
                "goes only on a `span_end` with `at`, and no later than `at`",
            ));
        }
    }
    let allocator = raw.allocator.map(|a| Allocator {
        allocated: a.allocated,
        reserved: a.reserved,
        max_allocated: a.max_allocated,
        device: a.device,
    });
    let mark = |raw_component, raw_operation, raw_labels| -> Result<MarkBody, ProtocolError> {
        Ok(MarkBody {
            component: text("component", raw_component, MAX_NAME)?,
            operation: text("operation", raw_operation, MAX_NAME)?,
            iteration,
            labels: labels(raw_labels)?,
            allocator,
            at,
            began,
        })
    };
    let stage = |raw_name, raw_status: Option<String>, raw_message: Option<String>, raw_labels| {
        let status = match raw_status {
            Some(s) => {
                check_text("status", &s, MAX_STATUS)?;
                Some(s)
            }
            None => None,
        };
        let message = match raw_message {
            Some(m) if m.len() > MAX_MESSAGE => {
                return Err(invalid(
                    "message",
                    &format!("must be at most {MAX_MESSAGE} bytes"),
                ))
            }
            m => m,
        };
        Ok(StageBody {
            name: text("name", raw_name, MAX_NAME)?,
            status,
            message,
            labels: labels(raw_labels)?,
            allocator,
        })
    };
    Ok(match kind {
        "mark" => Message::Mark(mark(raw.component, raw.operation, raw.labels)?),
        "span_begin" => Message::SpanBegin(mark(raw.component, raw.operation, raw.labels)?),
        "span_end" => Message::SpanEnd(mark(raw.component, raw.operation, raw.labels)?),
        "stage_begin" => Message::StageBegin(stage(raw.name, None, None, raw.labels)?),
        "stage_end" => Message::StageEnd(stage(raw.name, raw.status, raw.message, raw.labels)?),
        "subscribe" => Message::Subscribe,
        "status" => Message::Status,
        "cleanup" => Message::Cleanup,
        "register" => Message::Register,
        "oom" => Message::Oom {
            allocator,
            summary: raw.summary.filter(|s| !s.is_empty()),
            message: match raw.message {
                Some(m) if m.len() > MAX_MESSAGE => {
                    return Err(invalid("message", &format!("must be at most {MAX_MESSAGE} bytes")))
                }
                m => m,
            },
        },
        "clearml_task" => Message::ClearmlTask {
            task: task_id(raw.task)?,
        },
        "clearml_close" => Message::ClearmlClose {
            task: task_id(raw.task)?,
            status: match raw.status.as_deref() {
                Some("completed") => TaskStatus::Completed,
                Some("failed") => TaskStatus::Failed,
                Some("stopped") => TaskStatus::Stopped,
                _ => return Err(invalid("status", "must be completed, failed or stopped")),
            },
            reason: match raw.message {
                Some(m) => {
                    check_text("message", &m, MAX_MESSAGE)?;
                    Some(m)
                }
                None => None,
            },
        },
        other => {
            return Err(ProtocolError::new(
                ErrorCode::UnknownType,
                format!(
                    "unknown type {:?}; known: mark, span_begin, span_end, stage_begin, stage_end, subscribe, status, cleanup, register, oom, clearml_task, clearml_close",
                    truncated(other)
                ),
            ))
        }
    })
}

/// A ClearML task id: 1 to [`MAX_ID`] bytes of `[A-Za-z0-9_-]` (the
/// server's ids are 32 hex digits), so it is safe in URLs, keys and logs.
fn task_id(raw: Option<String>) -> Result<String, ProtocolError> {
    let id = raw.ok_or_else(|| invalid("task", "is required"))?;
    if id.is_empty()
        || id.len() > MAX_ID
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(invalid(
            "task",
            &format!(
                "must be a ClearML task id: 1 to {MAX_ID} bytes of letters, digits, `_` or `-`"
            ),
        ));
    }
    Ok(id)
}

/// A notice pushed to subscribers.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Notice {
    Pressure {
        resource: String,
        level: String,
        previous: String,
        used_ratio: f64,
        timestamp: f64,
        message: String,
        /// Level `forecast`: at this rate the resource reaches its limit
        /// in this many seconds.
        #[serde(skip_serializing_if = "Option::is_none")]
        seconds_to_limit: Option<f64>,
    },
    Cleanup {
        reason: String,
        timestamp: f64,
    },
}

fn line(value: &impl Serialize) -> Vec<u8> {
    let mut out = serde_json::to_vec(value)
        .unwrap_or_else(|_| b"{\"ok\":false,\"error\":\"internal\"}".to_vec());
    out.push(b'\n');
    out
}

/// `{"ok":false,"error":CODE,"message":…,"id":…}`.
pub fn error_line(e: &ProtocolError) -> Vec<u8> {
    #[derive(Serialize)]
    struct Out<'a> {
        ok: bool,
        error: ErrorCode,
        message: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        id: &'a Option<Id>,
    }
    line(&Out {
        ok: false,
        error: e.code,
        message: &e.message,
        id: &e.id,
    })
}

/// `{"ok":true,"type":KIND,"id":…, …fields}`.
pub(crate) fn ok_line(
    kind: &str,
    id: &Option<Id>,
    fields: serde_json::Map<String, serde_json::Value>,
) -> Vec<u8> {
    let mut m = serde_json::Map::new();
    m.insert("ok".into(), true.into());
    m.insert("type".into(), kind.into());
    if let Some(id) = id {
        m.insert("id".into(), serde_json::to_value(id).unwrap_or_default());
    }
    m.extend(fields);
    line(&m)
}

/// The reply to a recorded mark, span or stage.
pub(crate) fn recorded_line(id: &Option<Id>, entry: &Entry) -> Vec<u8> {
    let mut fields = serde_json::Map::new();
    fields.insert(
        "entry".into(),
        serde_json::to_value(entry).unwrap_or_default(),
    );
    ok_line("recorded", id, fields)
}

/// A notice as a line.
pub(crate) fn notice_line(n: &Notice) -> Vec<u8> {
    line(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(line: &str) -> Request {
        parse(line.as_bytes()).unwrap_or_else(|e| panic!("{line}: {e}"))
    }

    fn err(line: &str) -> ProtocolError {
        parse(line.as_bytes()).expect_err(line)
    }

    #[test]
    fn a_bare_mark_is_accepted() {
        let r = ok(r#"{"component":"model","operation":"before_generate"}"#);
        assert!(!r.ack);
        match r.message {
            Message::Mark(m) => assert_eq!(
                (m.component.as_str(), m.operation.as_str()),
                ("model", "before_generate")
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn full_mark() {
        let r = ok(r#"{"v":1,"type":"mark","component":"model","operation":"x","iteration":17,
            "labels":{"bs":"128"},"allocator":{"allocated":1,"reserved":2,"max_allocated":3,"device":0},
            "ack":true,"id":"a1","future_field":[1,2]}"#
            .replace('\n', " ")
            .as_str());
        assert!(r.ack);
        assert_eq!(r.id, Some(Id::Str("a1".into())));
        let Message::Mark(m) = r.message else {
            panic!()
        };
        assert_eq!(m.iteration, Some(17));
        assert_eq!(m.labels["bs"], "128");
        assert_eq!(m.allocator.unwrap().max_allocated, 3);
    }

    #[test]
    fn every_type_parses() {
        assert!(matches!(
            ok(r#"{"type":"span_begin","component":"a","operation":"b"}"#).message,
            Message::SpanBegin(_)
        ));
        assert!(matches!(
            ok(r#"{"type":"span_end","component":"a","operation":"b"}"#).message,
            Message::SpanEnd(_)
        ));
        assert!(matches!(
            ok(r#"{"type":"stage_begin","name":"train"}"#).message,
            Message::StageBegin(_)
        ));
        let r = ok(r#"{"type":"stage_end","name":"train","status":"FAILED","message":"boom"}"#);
        let Message::StageEnd(s) = r.message else {
            panic!()
        };
        assert_eq!(
            (s.status.as_deref(), s.message.as_deref()),
            (Some("FAILED"), Some("boom"))
        );
        for t in ["subscribe", "status", "cleanup", "register"] {
            ok(&format!(r#"{{"type":"{t}"}}"#));
        }
    }

    #[test]
    fn malformed_input_is_a_parse_error() {
        for bad in [
            "",
            "not json",
            "[1,2]",
            "\"str\"",
            "{\"component\":",
            "{\"a\":1}\u{0}",
            "null",
        ] {
            let e = err(bad);
            assert!(
                matches!(e.code, ErrorCode::Parse | ErrorCode::Invalid),
                "{bad:?}: {e:?}"
            );
        }
        let e = parse(b"{\"component\":\"\xff\xfe\",\"operation\":\"x\"}").unwrap_err();
        assert_eq!(e.code, ErrorCode::Parse, "invalid UTF-8: {e:?}");
    }

    #[test]
    fn field_rules_name_the_field() {
        let cases = [
            (r#"{"operation":"x"}"#, "component"),
            (r#"{"component":"","operation":"x"}"#, "component"),
            (r#"{"component":"a\u0000b","operation":"x"}"#, "component"),
            (
                r#"{"component":"a","operation":"x","iteration":-1}"#,
                "iteration",
            ),
            (
                r#"{"component":"a","operation":"x","iteration":1.5}"#,
                "iteration",
            ),
            (
                r#"{"component":"a","operation":"x","labels":{"bad-name":"v"}}"#,
                "labels",
            ),
            (
                r#"{"component":"a","operation":"x","labels":{"k":1}}"#,
                "labels",
            ),
            (
                r#"{"component":"a","operation":"x","allocator":{"allocated":-5,"reserved":0,"max_allocated":0}}"#,
                "allocated",
            ),
            (
                r#"{"component":"a","operation":"x","allocator":{"allocated":1}}"#,
                "reserved",
            ),
            (r#"{"component":"a","operation":"x","id":{"x":1}}"#, "id"),
            (
                r#"{"component":"a","operation":"x","allocator":{"allocated":18446744073709551615,"reserved":0,"max_allocated":0}}"#,
                "allocator.allocated",
            ),
            (
                r#"{"type":"oom","allocator":{"allocated":0,"reserved":17592186044417,"max_allocated":0}}"#,
                "allocator.reserved",
            ),
            (r#"{"type":"stage_end","name":"s","status":""}"#, "status"),
            (r#"{"component":"a","operation":"x","ack":"yes"}"#, "ack"),
        ];
        for (line, field) in cases {
            let e = err(line);
            assert_eq!(e.code, ErrorCode::Invalid, "{line}: {e:?}");
            assert!(e.message.contains(field), "{line}: {}", e.message);
        }
        let long = format!(r#"{{"component":"{}","operation":"x"}}"#, "c".repeat(200));
        assert!(err(&long).message.contains("component"));
        let many: String = (0..17)
            .map(|i| format!("\"l{i}\":\"v\""))
            .collect::<Vec<_>>()
            .join(",");
        assert!(err(&format!(
            r#"{{"component":"a","operation":"x","labels":{{{many}}}}}"#
        ))
        .message
        .contains("16"));
    }

    #[test]
    fn iterations_stop_at_the_signed_64_bit_range() {
        let at = |i: &str| format!(r#"{{"component":"a","operation":"x","iteration":{i}}}"#);
        let Message::Mark(m) = ok(&at("9223372036854775807")).message else {
            panic!()
        };
        assert_eq!(m.iteration, Some(i64::MAX as u64));
        for bad in ["9223372036854775808", "18446744073709551615", "1e30"] {
            let e = err(&at(bad));
            assert_eq!(e.code, ErrorCode::Invalid, "{bad}: {e:?}");
            assert!(e.message.contains("2^63-1"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn a_held_back_event_says_when_it_happened() {
        let line = |at: &str| {
            format!(
                r#"{{"type":"span_end","component":"train","operation":"step","iteration":3,"at":{at}}}"#
            )
        };
        let Message::SpanEnd(m) = ok(&line("1700000000.25")).message.clone() else {
            panic!()
        };
        assert_eq!(m.at, Some(1_700_000_000.25));
        // The Python client's form: integer nanoseconds and an exponent.
        let Message::SpanEnd(m) = ok(&line("1700000000250000000e-9")).message.clone() else {
            panic!()
        };
        assert_eq!(m.at, Some(1_700_000_000.25));
        let held = ok(&line("1700000000")).message;
        assert!(held.is_recorded() && !held.needs_sample());
        assert!(ok(&line("null")).message.needs_sample());
        for bad in ["-1", "0", "\"7\"", "true", "[1]", "{}"] {
            let e = err(&line(bad));
            assert_eq!(e.code, ErrorCode::Invalid, "{bad}: {e:?}");
            assert!(e.message.contains("`at`"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn a_held_back_span_end_may_say_when_its_span_began() {
        let line = |kind: &str, rest: &str| {
            format!(
                r#"{{"type":"{kind}","component":"train","operation":"step","iteration":3{rest}}}"#
            )
        };
        let both = line("span_end", r#","at":1700000000.25,"began":1700000000.125"#);
        let Message::SpanEnd(m) = ok(&both).message else {
            panic!()
        };
        assert_eq!(
            (m.began, m.at),
            (Some(1_700_000_000.125), Some(1_700_000_000.25))
        );
        // One instant is a span of no length.
        let Message::SpanEnd(m) = ok(&line("span_end", r#","at":5,"began":5"#)).message else {
            panic!()
        };
        assert_eq!(m.began, Some(5.0));
        for bad in [
            line("span_end", r#","began":1700000000"#),
            line("span_end", r#","at":1700000000,"began":1700000001"#),
            line("span_begin", r#","at":1700000001,"began":1700000000"#),
            line("mark", r#","at":1700000001,"began":1700000000"#),
            line("span_end", r#","at":1700000001,"began":-1"#),
            line("span_end", r#","at":1700000001,"began":"1""#),
        ] {
            let e = err(&bad);
            assert_eq!(e.code, ErrorCode::Invalid, "{bad}: {e:?}");
            assert!(e.message.contains("`began`"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn clearml_task_announcements() {
        let r =
            ok(r#"{"type":"clearml_task","task":"0123456789abcdef0123456789abcdef","ack":true}"#);
        assert!(r.ack);
        assert_eq!(
            r.message,
            Message::ClearmlTask {
                task: "0123456789abcdef0123456789abcdef".into()
            }
        );
        assert!(!r.message.needs_sample() && !r.message.is_recorded());
        for (line, why) in [
            (r#"{"type":"clearml_task"}"#, "required"),
            (r#"{"type":"clearml_task","task":""}"#, "task id"),
            (r#"{"type":"clearml_task","task":"../../etc"}"#, "task id"),
            (r#"{"type":"clearml_task","task":"a b"}"#, "task id"),
            (r#"{"type":"clearml_task","task":"x\u0007b"}"#, "task id"),
            (r#"{"type":"clearml_task","task":7}"#, "task"),
        ] {
            let e = err(line);
            assert_eq!(e.code, ErrorCode::Invalid, "{line}: {e:?}");
            assert!(e.message.contains(why), "{line}: {}", e.message);
        }
        let long = format!(r#"{{"type":"clearml_task","task":"{}"}}"#, "a".repeat(65));
        assert!(err(&long).message.contains("task id"));
    }

    #[test]
    fn clearml_closes_name_the_task_and_a_status() {
        let r = ok(
            r#"{"type":"clearml_close","task":"0123abcd","status":"failed","message":"Exception boom","ack":true}"#,
        );
        assert_eq!(
            r.message,
            Message::ClearmlClose {
                task: "0123abcd".into(),
                status: TaskStatus::Failed,
                reason: Some("Exception boom".into()),
            }
        );
        assert!(!r.message.needs_sample() && !r.message.is_recorded());
        let plain = ok(r#"{"type":"clearml_close","task":"t-1","status":"completed"}"#);
        assert!(matches!(
            plain.message,
            Message::ClearmlClose {
                status: TaskStatus::Completed,
                reason: None,
                ..
            }
        ));
        let long = format!(
            r#"{{"type":"clearml_close","task":"t","status":"failed","message":"{}"}}"#,
            "x".repeat(MAX_MESSAGE + 1)
        );
        for (line, why) in [
            (
                r#"{"type":"clearml_close","status":"completed"}"#.to_string(),
                "required",
            ),
            (
                r#"{"type":"clearml_close","task":"../x","status":"completed"}"#.into(),
                "task id",
            ),
            (
                r#"{"type":"clearml_close","task":"t"}"#.into(),
                "completed, failed or stopped",
            ),
            (
                r#"{"type":"clearml_close","task":"t","status":"published"}"#.into(),
                "completed, failed or stopped",
            ),
            (
                r#"{"type":"clearml_close","task":"t","status":"failed","message":"a\u0000b"}"#
                    .into(),
                "control",
            ),
            (long, "1024 bytes"),
        ] {
            let e = err(&line);
            assert_eq!(e.code, ErrorCode::Invalid, "{line}: {e:?}");
            assert!(e.message.contains(why), "{line}: {}", e.message);
        }
    }

    #[test]
    fn allocator_figures_up_to_the_largest_device_are_accepted() {
        let at = |bytes: u64| {
            parse(format!(r#"{{"component":"a","operation":"x","allocator":{{"allocated":{bytes},"reserved":{bytes},"max_allocated":{bytes}}}}}"#).as_bytes())
        };
        assert!(at(MAX_DEVICE_BYTES).is_ok());
        let e = at(MAX_DEVICE_BYTES + 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid);
        assert!(e.message.contains("more than any GPU"), "{}", e.message);
    }

    #[test]
    fn errors_keep_the_id_when_the_object_is_readable() {
        let e = err(r#"{"component":"a","operation":"b","labels":{"k":1},"ack":true,"id":6}"#);
        assert_eq!((e.code, e.id), (ErrorCode::Invalid, Some(Id::Int(6))));
        let e = err(r#"{"component":"a","operation":"b","iteration":"x","id":"q"}"#);
        assert_eq!(e.id, Some(Id::Str("q".into())));
        assert_eq!(err("{\"id\":6").id, None, "unreadable: no id");
    }

    #[test]
    fn unknown_fields_are_ignored_everywhere() {
        let r = ok(
            r#"{"component":"a","operation":"b","allocator":{"allocated":1,"reserved":2,"max_allocated":3,"stream":7}}"#,
        );
        let Message::Mark(m) = r.message else {
            panic!()
        };
        assert_eq!(m.allocator.unwrap().reserved, 2);
    }

    #[test]
    fn unknown_type_and_version() {
        let e = err(r#"{"type":"launch","id":7}"#);
        assert_eq!((e.code, e.id), (ErrorCode::UnknownType, Some(Id::Int(7))));
        let e = err(r#"{"v":2,"component":"a","operation":"b"}"#);
        assert_eq!(e.code, ErrorCode::UnsupportedVersion);
    }

    #[test]
    fn oversized_line() {
        let line = vec![b' '; MAX_LINE];
        assert_eq!(parse(&line).unwrap_err().code, ErrorCode::TooLong);
    }

    #[test]
    fn replies_are_single_json_lines() {
        let e = ProtocolError {
            code: ErrorCode::Invalid,
            message: "`x` bad\nline".into(),
            id: Some(Id::Int(3)),
        };
        let l = error_line(&e);
        assert_eq!(l.iter().filter(|b| **b == b'\n').count(), 1);
        let v: serde_json::Value = serde_json::from_slice(&l).unwrap();
        assert_eq!(
            (v["ok"].as_bool(), v["error"].as_str(), v["id"].as_i64()),
            (Some(false), Some("invalid"), Some(3))
        );
        let n = notice_line(&Notice::Cleanup {
            reason: "http".into(),
            timestamp: 1.0,
        });
        let v: serde_json::Value = serde_json::from_slice(&n).unwrap();
        assert_eq!(v["type"], "cleanup");
    }
}
