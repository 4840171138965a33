//! Fuzzes the event protocol parser: any bytes a client can send. The
//! parser must never panic, must accept only what the documented rules
//! allow, and every error must become one valid JSON reply line.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memtrack::event::protocol::{error_line, parse, Message, MAX_LINE};
use memtrack::model::MAX_DEVICE_BYTES;

fuzz_target!(|data: &[u8]| {
    match parse(data) {
        Ok(req) => {
            assert!(data.len() < MAX_LINE);
            let names: Vec<&str> = match &req.message {
                Message::Mark(m) | Message::SpanBegin(m) | Message::SpanEnd(m) => {
                    assert!(m.labels.len() <= 16);
                    vec![&m.component, &m.operation]
                }
                Message::StageBegin(s) | Message::StageEnd(s) => vec![&s.name],
                _ => vec![],
            };
            for n in names {
                assert!(!n.is_empty() && n.len() <= 128 && !n.chars().any(char::is_control));
            }
            let allocator = match &req.message {
                Message::Mark(m) | Message::SpanBegin(m) | Message::SpanEnd(m) => m.allocator,
                Message::StageBegin(s) | Message::StageEnd(s) => s.allocator,
                Message::Oom { allocator, .. } => *allocator,
                _ => None,
            };
            if let Some(a) = allocator {
                // No figure above the largest device gets in.
                assert!([a.allocated, a.reserved, a.max_allocated]
                    .iter()
                    .all(|b| *b <= MAX_DEVICE_BYTES));
            }
        }
        Err(e) => {
            let line = error_line(&e);
            assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
            let v: serde_json::Value = serde_json::from_slice(&line).expect("error reply is JSON");
            assert_eq!(v["ok"], false);
        }
    }
});
