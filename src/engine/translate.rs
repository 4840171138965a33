//! From what the job and the process say to what the store records: each
//! [`Input`] and protocol [`Message`] becomes a [`Record`] to commit, a
//! reply, or nothing.
//!
//! The functions here are pure; the `impl Engine` part at the bottom runs
//! their verdicts on a batch of inputs (commits, replies once the journal
//! holds the record, the OOM flight window, processes that register
//! themselves).

use std::collections::BTreeMap;

use super::{Ended, Engine};
use crate::event::inbox::{ClientRequest, Input};
use crate::event::protocol::{self, Id, MarkBody, Message};
use crate::model::{EntryKind, Exit};
use crate::store::{Boundary, Mark, Record, SampleKind, SYSTEM};
use crate::sys::Reaped;
use crate::units::unix_now;

/// Longest error message kept from a CUDA OOM report (bytes).
const OOM_MESSAGE_MAX: usize = 256;

/// What a client's message asks of the engine.
#[derive(Debug)]
enum Action {
    /// Commit the record; an `ack` is answered with its entry.
    Commit(Record),
    /// A held-back step in one line: commit its begin, then its end (the
    /// `ack`'s entry).
    Step { begin: Record, end: Record },
    /// A CUDA OOM: commit its `cuda/out_of_memory` mark and keep a flight
    /// window with the allocator's summary.
    Oom {
        mark: Record,
        summary: Option<String>,
    },
    /// Answer with the run's status.
    Status,
    /// Answer whether the sender is followed.
    Register,
    /// Answered by the socket server itself: nothing to do here.
    Nothing,
}

/// The verdict on one message from `pid`, received at `received` (Unix
/// seconds). A mark, span begin or span end the client held back says when
/// it happened (`at`), and is recorded at that moment: never after it
/// arrived, nor more than [`protocol::MAX_HELD_S`] before, nor before
/// `floor` (the time of the sender's previous event: one sent at once is
/// stamped when it arrives, later than it happened, and the steps held
/// after it must not go before it).
fn action(message: Message, pid: Option<u32>, received: f64, floor: f64) -> Action {
    let mark = |component: String, operation: String, iteration, labels, allocator| Mark {
        timestamp: received,
        pid,
        component,
        operation,
        iteration,
        labels,
        allocator,
        kind: EntryKind::Event,
    };
    let held = |at: f64| {
        at.clamp(received - protocol::MAX_HELD_S, received)
            .max(floor.min(received))
    };
    let event = |m: MarkBody| Mark {
        timestamp: m.at.map_or(received, held),
        ..mark(m.component, m.operation, m.iteration, m.labels, m.allocator)
    };
    let boundary = |mark| Boundary {
        mark,
        status: None,
        message: None,
    };
    match message {
        Message::Mark(m) => Action::Commit(Record::Mark(event(m))),
        Message::SpanBegin(m) => Action::Commit(Record::SpanBegin(boundary(event(m)))),
        Message::SpanEnd(m) => match m.began {
            None => Action::Commit(Record::SpanEnd(boundary(event(m)))),
            Some(began) => {
                let end = event(m);
                // The allocator's figures are the end's.
                let begin = Mark {
                    timestamp: held(began).min(end.timestamp),
                    allocator: None,
                    ..end.clone()
                };
                Action::Step {
                    begin: Record::SpanBegin(boundary(begin)),
                    end: Record::SpanEnd(boundary(end)),
                }
            }
        },
        Message::StageBegin(s) => Action::Commit(Record::StageBegin(boundary(mark(
            "stage".into(),
            s.name,
            None,
            s.labels,
            s.allocator,
        )))),
        Message::StageEnd(s) => Action::Commit(Record::StageEnd(Boundary {
            mark: mark("stage".into(), s.name, None, s.labels, s.allocator),
            status: s.status,
            message: s.message,
        })),
        Message::Status => Action::Status,
        Message::Register => Action::Register,
        Message::Oom {
            summary,
            message,
            allocator,
        } => Action::Oom {
            mark: Record::Mark(mark(
                "cuda".into(),
                "out_of_memory".into(),
                None,
                oom_labels(message),
                allocator,
            )),
            summary,
        },
        Message::Subscribe
        | Message::Cleanup
        | Message::ClearmlTask { .. }
        | Message::ClearmlClose { .. } => Action::Nothing,
    }
}

/// The OOM mark's labels: the error's text, without control characters
/// and at most [`OOM_MESSAGE_MAX`] bytes.
fn oom_labels(message: Option<String>) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    if let Some(m) = message {
        let mut m: String = m.chars().filter(|c| !c.is_control()).collect();
        while m.len() > OOM_MESSAGE_MAX {
            m.pop();
        }
        labels.insert("error".to_string(), m);
    }
    labels
}

/// The spawned job's end: its exit and the record of it.
fn job_exit(pid: u32, reaped: Reaped) -> (Exit, Record) {
    let exit = Exit::from_wait_status(reaped.status);
    let record = Record::Exit {
        pid,
        exit,
        // 0: not known (the job's peak hid below memtrack's own, which it
        // inherited).
        max_rss: (reaped.max_rss_kib > 0).then(|| reaped.max_rss_kib * 1024),
    };
    (exit, record)
}

/// memtrack's own `system` entry (`experiment_start` / `experiment_end`).
fn system_mark(operation: &str, timestamp: f64) -> Record {
    Record::Mark(Mark {
        timestamp,
        pid: None,
        component: SYSTEM.into(),
        operation: operation.into(),
        iteration: None,
        labels: Default::default(),
        allocator: None,
        kind: EntryKind::System,
    })
}

/// The reply to `status`: the store's status object.
fn status_reply(id: &Option<Id>, status: serde_json::Value) -> Vec<u8> {
    let fields = match status {
        serde_json::Value::Object(m) => m,
        _ => Default::default(),
    };
    protocol::ok_line("status", id, fields)
}

/// The reply to `register`: whether the sender is followed now.
fn register_reply(id: &Option<Id>, following: bool) -> Vec<u8> {
    let mut fields = serde_json::Map::new();
    fields.insert("following".into(), following.into());
    protocol::ok_line("registered", id, fields)
}

/// Whether a message makes its sender join the tree (`attach` without
/// PIDs): anything recorded, and `register`.
fn registers(message: &Message) -> bool {
    message.is_recorded() || *message == Message::Register
}

impl Engine {
    /// Handles a batch of inputs. Every message needing a sample shares one
    /// sample taken after all of them arrived. Returns `Some(urgent)` when a
    /// stop was requested.
    pub(super) fn handle_batch(&mut self, batch: Vec<Input>, ended: &mut Ended) -> Option<bool> {
        if self.admit(&batch) {
            self.sample(SampleKind::Event);
        }
        let mut stop = None;
        for input in batch {
            match input {
                Input::JobExited { pid, reaped } => {
                    let (exit, record) = job_exit(pid, reaped);
                    ended.job_exit = Some(exit);
                    self.commit(record);
                }
                Input::Stop { urgent } => {
                    ended.stopped_by_request = true;
                    stop = Some(stop.unwrap_or(false) || urgent);
                }
                Input::Client(c) => self.client(*c),
                Input::Checkpoint => self.checkpoint_soon = true,
            }
        }
        self.acknowledge();
        stop
    }

    /// Records memtrack's own `system` entry (`experiment_start` /
    /// `experiment_end`).
    pub(super) fn system_mark(&mut self, operation: &str) {
        self.commit(system_mark(operation, unix_now()));
    }

    /// Follows senders that register themselves (when the run allows it);
    /// returns whether any input needs a fresh sample.
    fn admit(&mut self, batch: &[Input]) -> bool {
        let mut needs_sample = false;
        for input in batch {
            let Input::Client(c) = input else {
                continue;
            };
            needs_sample |= c.request.message.needs_sample();
            let self_register = self.events.as_ref().is_some_and(|l| l.self_register);
            if let (Some(pid), true) = (c.pid, self_register) {
                if registers(&c.request.message) && !self.sampler.follows(pid) {
                    match self.sampler.follow(pid) {
                        Ok(()) => tracing::info!("PID {pid} registered itself; following it"),
                        Err(e) => tracing::debug!("cannot follow PID {pid}: {e}"),
                    }
                }
            }
        }
        needs_sample
    }

    /// Runs one client's message.
    fn client(&mut self, c: ClientRequest) {
        let id = c.request.id;
        let floor = match self.last_event {
            Some((pid, at)) if pid == c.pid => at,
            _ => f64::NEG_INFINITY,
        };
        let record = match action(c.request.message, c.pid, c.received, floor) {
            Action::Commit(record) => record,
            Action::Step { begin, end } => {
                self.commit(begin);
                end
            }
            Action::Oom { mark, summary } => {
                let outcome = self.commit(mark);
                self.unflushed_event = true;
                if let Some(f) = &mut self.flight {
                    f.expect_cuda_oom(c.pid, summary);
                }
                if let (Some(reply), Some(entry)) = (c.reply, outcome.entry) {
                    self.replies
                        .push((reply, protocol::recorded_line(&id, &entry)));
                }
                return;
            }
            Action::Status => {
                if let Some(reply) = c.reply {
                    let _ = reply.send(status_reply(&id, self.store.status()));
                }
                return;
            }
            Action::Register => {
                if let Some(reply) = c.reply {
                    let following = c.pid.is_some_and(|p| self.sampler.follows(p));
                    let _ = reply.send(register_reply(&id, following));
                }
                return;
            }
            Action::Nothing => return,
        };
        if let Record::Mark(m)
        | Record::SpanBegin(Boundary { mark: m, .. })
        | Record::SpanEnd(Boundary { mark: m, .. })
        | Record::StageBegin(Boundary { mark: m, .. })
        | Record::StageEnd(Boundary { mark: m, .. }) = &record
        {
            self.last_event = Some((c.pid, m.timestamp));
        }
        let outcome = self.commit(record);
        self.unflushed_event = true;
        if let (Some(reply), Some(entry)) = (c.reply, outcome.entry) {
            // Sent once the batch is in the journal: an ack means recorded.
            self.replies
                .push((reply, protocol::recorded_line(&id, &entry)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(line: &str) -> Message {
        protocol::parse(line.as_bytes()).unwrap().message
    }

    fn act(line: &str) -> Action {
        action(message(line), Some(42), 1000.5, f64::NEG_INFINITY)
    }

    #[test]
    fn a_mark_becomes_a_record_with_its_fields() {
        let a = act(
            r#"{"type":"mark","component":"model","operation":"generate","iteration":17,"labels":{"bs":"128"}}"#,
        );
        let Action::Commit(Record::Mark(m)) = a else {
            panic!("{a:?}")
        };
        assert_eq!(
            (m.component.as_str(), m.operation.as_str(), m.iteration),
            ("model", "generate", Some(17))
        );
        assert_eq!((m.pid, m.timestamp), (Some(42), 1000.5));
        assert_eq!(m.labels.get("bs").map(String::as_str), Some("128"));
        assert_eq!(m.kind, EntryKind::Event);
        assert_eq!(m.allocator, None);
    }

    #[test]
    fn spans_open_and_close_under_their_component() {
        for (kind, begin) in [("span_begin", true), ("span_end", false)] {
            let a = act(&format!(
                r#"{{"type":"{kind}","component":"model","operation":"generate"}}"#
            ));
            let b = match (a, begin) {
                (Action::Commit(Record::SpanBegin(b)), true)
                | (Action::Commit(Record::SpanEnd(b)), false) => b,
                (a, _) => panic!("{kind}: {a:?}"),
            };
            assert_eq!(b.mark.component, "model");
            assert_eq!(b.mark.operation, "generate");
            assert_eq!((b.status, b.message), (None, None));
        }
    }

    #[test]
    fn a_held_back_step_is_recorded_when_it_happened() {
        let a = act(
            r#"{"type":"span_begin","component":"train","operation":"step","iteration":9,"at":1000.496}"#,
        );
        let Action::Commit(Record::SpanBegin(b)) = a else {
            panic!("{a:?}")
        };
        assert_eq!(b.mark.timestamp, 1000.496);
        // A clock that says later than the arrival, or long before it.
        for (at, stamped) in [("1001.5", 1000.5), ("1.0", 940.5)] {
            let a = act(&format!(
                r#"{{"type":"span_end","component":"t","operation":"s","at":{at}}}"#
            ));
            let Action::Commit(Record::SpanEnd(b)) = a else {
                panic!("{a:?}")
            };
            assert_eq!(b.mark.timestamp, stamped, "{at}");
        }
        let a = act(r#"{"type":"mark","component":"m","operation":"x"}"#);
        let Action::Commit(Record::Mark(m)) = a else {
            panic!("{a:?}")
        };
        assert_eq!(m.timestamp, 1000.5);
        // Never before the sender's previous event.
        let line = r#"{"type":"span_begin","component":"t","operation":"s","at":1000.2}"#;
        let a = action(message(line), Some(42), 1000.5, 1000.3);
        let Action::Commit(Record::SpanBegin(b)) = a else {
            panic!("{a:?}")
        };
        assert_eq!(b.mark.timestamp, 1000.3);
    }

    #[test]
    fn a_held_back_step_in_one_line_is_its_begin_and_its_end() {
        let line = r#"{"type":"span_end","component":"train","operation":"step","iteration":9,"labels":{"batch_size":"4"},"at":1000.496,"began":1000.4}"#;
        // The step's begin and end, from the sender's previous event `floor`.
        let step = |floor: f64| match action(message(line), Some(42), 1000.5, floor) {
            Action::Step {
                begin: Record::SpanBegin(b),
                end: Record::SpanEnd(e),
            } => (b.mark, e.mark),
            a => panic!("{a:?}"),
        };
        let (b, e) = step(f64::NEG_INFINITY);
        assert_eq!((b.timestamp, e.timestamp), (1000.4, 1000.496));
        for m in [&b, &e] {
            assert_eq!(
                (m.component.as_str(), m.operation.as_str(), m.iteration),
                ("train", "step", Some(9))
            );
            assert_eq!(m.labels.get("batch_size").map(String::as_str), Some("4"));
        }
        // Both stay within what a held-back event may say, and the begin
        // never after the end: here the sender's previous event is later
        // than both.
        let (b, e) = step(1000.45);
        assert_eq!((b.timestamp, e.timestamp), (1000.45, 1000.496));
    }

    #[test]
    fn a_stage_opens_and_closes_with_its_status() {
        let a = act(r#"{"type":"stage_begin","name":"train","labels":{"epoch":"1"}}"#);
        let Action::Commit(Record::StageBegin(b)) = a else {
            panic!("{a:?}")
        };
        assert_eq!(
            (b.mark.component.as_str(), b.mark.operation.as_str()),
            ("stage", "train")
        );
        assert_eq!(b.status, None);
        let a = act(r#"{"type":"stage_end","name":"train","status":"FAILED","message":"boom"}"#);
        let Action::Commit(Record::StageEnd(b)) = a else {
            panic!("{a:?}")
        };
        assert_eq!(
            (b.mark.component.as_str(), b.mark.operation.as_str()),
            ("stage", "train")
        );
        assert_eq!(
            (b.status.as_deref(), b.message.as_deref()),
            (Some("FAILED"), Some("boom"))
        );
    }

    #[test]
    fn a_cuda_oom_is_a_bounded_clean_mark_and_keeps_its_summary() {
        let long = "x".repeat(300);
        let a = act(&format!(
            r#"{{"type":"oom","summary":"|| allocated ||","message":"CUDA out of memory\n{long}"}}"#
        ));
        let Action::Oom {
            mark: Record::Mark(m),
            summary,
        } = a
        else {
            panic!("{a:?}")
        };
        assert_eq!(
            (m.component.as_str(), m.operation.as_str()),
            ("cuda", "out_of_memory")
        );
        let error = &m.labels["error"];
        assert!(error.starts_with("CUDA out of memoryxxx"), "{error}");
        assert_eq!(error.len(), OOM_MESSAGE_MAX);
        assert_eq!(summary.as_deref(), Some("|| allocated ||"));
        assert!(oom_labels(None).is_empty());
    }

    #[test]
    fn requests_without_a_record_record_nothing() {
        assert!(matches!(act(r#"{"type":"status"}"#), Action::Status));
        assert!(matches!(act(r#"{"type":"register"}"#), Action::Register));
        for t in ["subscribe", "cleanup"] {
            let a = act(&format!(r#"{{"type":"{t}"}}"#));
            assert!(matches!(a, Action::Nothing), "{t}: {a:?}");
        }
        assert!(matches!(
            act(r#"{"type":"clearml_task","task":"0123abcd"}"#),
            Action::Nothing
        ));
    }

    #[test]
    fn a_job_exit_keeps_its_status_and_a_known_peak() {
        let (exit, record) = job_exit(
            7,
            Reaped {
                status: 3 << 8,
                max_rss_kib: 10,
            },
        );
        assert_eq!(exit, Exit::code(3));
        let Record::Exit { pid, max_rss, .. } = record else {
            panic!("{record:?}")
        };
        assert_eq!((pid, max_rss), (7, Some(10 * 1024)));
        let (_, record) = job_exit(
            7,
            Reaped {
                status: libc::SIGKILL,
                max_rss_kib: 0,
            },
        );
        let Record::Exit { exit, max_rss, .. } = record else {
            panic!()
        };
        assert_eq!((exit, max_rss), (Exit::signal(9), None), "0 KiB: unknown");
    }

    #[test]
    fn replies_carry_the_request_id() {
        let id = protocol::parse(br#"{"type":"register","id":"r1"}"#)
            .unwrap()
            .id;
        let line = String::from_utf8(register_reply(&id, true)).unwrap();
        assert_eq!(
            line.trim_end(),
            r#"{"following":true,"id":"r1","ok":true,"type":"registered"}"#
        );
        let line = String::from_utf8(status_reply(&None, serde_json::json!({"a": 1}))).unwrap();
        assert_eq!(line.trim_end(), r#"{"a":1,"ok":true,"type":"status"}"#);
        let line = String::from_utf8(status_reply(&None, serde_json::json!(3))).unwrap();
        assert_eq!(line.trim_end(), r#"{"ok":true,"type":"status"}"#);
    }

    #[test]
    fn only_recorded_messages_and_register_make_a_sender_join() {
        assert!(registers(&message(r#"{"component":"a","operation":"b"}"#)));
        assert!(registers(&message(r#"{"type":"register"}"#)));
        assert!(!registers(&message(r#"{"type":"status"}"#)));
        assert!(!registers(&message(r#"{"type":"oom"}"#)));
    }
}
