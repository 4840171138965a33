//! Spans: `span_begin` opens a span (bounded by
//! [`Limits::max_open_spans`](super::limits::Limits::max_open_spans)) whose
//! component timer samples count for; `span_end` closes the innermost
//! match, the same process's first.

use super::record::{Applied, Boundary};
use super::state::{OpenSpan, Store};

impl Store {
    /// Logs a span's start and opens it when there is room.
    pub(super) fn begin_span(&mut self, b: &Boundary) -> Applied {
        let entry = self.record_mark(&b.mark, format!("before_{}", b.mark.operation), None);
        if self.spans.open.len() < self.limits.max_open_spans {
            self.spans.open.push(OpenSpan {
                pid: b.mark.pid,
                component: b.mark.component.clone(),
                operation: b.mark.operation.clone(),
                started: b.mark.timestamp,
            });
        } else {
            self.counters.spans_untracked += 1;
        }
        Applied {
            entry: Some(entry),
            ..Applied::default()
        }
    }

    /// Closes the innermost open span of the same component and operation
    /// (of the same process if there is one) and logs its end.
    pub(super) fn end_span(&mut self, b: &Boundary) -> Applied {
        let m = &b.mark;
        let found = self
            .spans
            .open
            .iter()
            .rposition(|s| {
                s.component == m.component && s.operation == m.operation && s.pid == m.pid
            })
            .or_else(|| {
                self.spans
                    .open
                    .iter()
                    .rposition(|s| s.component == m.component && s.operation == m.operation)
            });
        if let Some(i) = found {
            self.spans.open.remove(i);
        }
        let entry = self.record_mark(m, format!("after_{}", m.operation), None);
        Applied {
            entry: Some(entry),
            unmatched: found.is_none(),
            ..Applied::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::Store;
    use super::super::testkit::*;
    use super::super::{Boundary, Record};
    use crate::model::EntryKind;

    #[test]
    fn timer_samples_inside_a_span_count_for_its_component() {
        let mut st = store();
        timer(&mut st, sample(101.0, &[(10, 100)], &[]));
        st.apply(&Record::SpanBegin(Boundary {
            mark: mark(101.1, "model", "generate"),
            status: None,
            message: None,
        }));
        timer(&mut st, sample(102.0, &[(10, 600)], &[]));
        timer(&mut st, sample(103.0, &[(10, 100)], &[]));
        st.apply(&Record::SpanEnd(Boundary {
            mark: mark(103.1, "model", "generate"),
            status: None,
            message: None,
        }));
        timer(&mut st, sample(104.0, &[(10, 700)], &[]));
        let doc = st.document();
        assert_eq!(
            doc.peaks_by_component["model"].figures.cpu_ram_used_mb,
            600.0
        );
        assert_eq!(
            doc.peaks_by_component["system"].figures.cpu_ram_used_mb,
            700.0
        );
        let ops: Vec<&str> = doc
            .detailed_log
            .iter()
            .map(|e| e.operation.as_str())
            .collect();
        assert_eq!(
            ops,
            [
                "timer",
                "before_generate",
                "timer",
                "timer",
                "after_generate",
                "timer"
            ]
        );
        assert_eq!(doc.detailed_log[2].span.as_deref(), Some("model/generate"));
    }

    #[test]
    fn nested_spans_give_timer_samples_to_the_innermost_then_the_outer() {
        let mut st = store();
        let span = |st: &mut Store, begin: bool, t: f64, c: &str, op: &str| {
            let b = Boundary {
                mark: mark(t, c, op),
                status: None,
                message: None,
            };
            st.apply(&if begin {
                Record::SpanBegin(b)
            } else {
                Record::SpanEnd(b)
            });
        };
        span(&mut st, true, 100.0, "train", "epoch");
        timer(&mut st, sample(101.0, &[(10, 200)], &[]));
        span(&mut st, true, 101.5, "eval", "validate");
        timer(&mut st, sample(102.0, &[(10, 900)], &[]));
        span(&mut st, false, 102.5, "eval", "validate");
        timer(&mut st, sample(103.0, &[(10, 300)], &[]));
        span(&mut st, false, 103.5, "train", "epoch");
        timer(&mut st, sample(104.0, &[(10, 50)], &[]));
        let doc = st.document();
        assert_eq!(
            doc.peaks_by_component["eval"].figures.cpu_ram_used_mb,
            900.0
        );
        assert_eq!(
            doc.peaks_by_component["train"].figures.cpu_ram_used_mb,
            300.0
        );
        assert_eq!(
            doc.peaks_by_component["system"].figures.cpu_ram_used_mb,
            50.0
        );
        let timers: Vec<Option<&str>> = doc
            .detailed_log
            .iter()
            .filter(|e| e.kind == EntryKind::Timer)
            .map(|e| e.span.as_deref())
            .collect();
        assert_eq!(
            timers,
            [
                Some("train/epoch"),
                Some("eval/validate"),
                Some("train/epoch"),
                None
            ]
        );
    }

    #[test]
    fn a_span_end_closes_the_same_process_span_first() {
        let mut st = store();
        let boundary = |t: f64, pid: u32| {
            let mut m = mark(t, "model", "step");
            m.pid = Some(pid);
            Boundary {
                mark: m,
                status: None,
                message: None,
            }
        };
        st.apply(&Record::SpanBegin(boundary(1.0, 10)));
        st.apply(&Record::SpanBegin(boundary(2.0, 11)));
        let out = st.apply(&Record::SpanEnd(boundary(3.0, 10)));
        assert!(!out.unmatched);
        assert_eq!(out.entry.unwrap().operation, "after_step");
        assert_eq!(st.spans.open.len(), 1);
        assert_eq!(
            st.spans.open[0].pid,
            Some(11),
            "pid 11's span is still open"
        );
        // No span of that pid: the innermost of the same name closes.
        assert!(!st.apply(&Record::SpanEnd(boundary(4.0, 12))).unmatched);
        assert!(st.apply(&Record::SpanEnd(boundary(5.0, 11))).unmatched);
    }
}
