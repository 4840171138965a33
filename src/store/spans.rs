//! Spans: `span_begin` opens a span (bounded by
//! [`Limits::max_open_spans`](super::limits::Limits::max_open_spans)) whose
//! component timer samples count for; `span_end` closes the innermost
//! match, the same process's first.

use super::record::Mark;

/// The spans' state: those open, outermost first.
#[derive(Debug, Clone, Default)]
pub(super) struct SpansState {
    pub(super) open: Vec<OpenSpan>,
}

/// An open span: the process that opened it (when known), its name and
/// when it began.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct OpenSpan {
    pub(super) pid: Option<u32>,
    pub(super) component: String,
    pub(super) operation: String,
    pub(super) started: f64,
}

impl SpansState {
    /// Opens the span `m` begins when fewer than `max_open` are open;
    /// otherwise counts it in `untracked`.
    pub(super) fn open(&mut self, m: &Mark, max_open: usize, untracked: &mut u64) {
        if self.open.len() < max_open {
            self.open.push(OpenSpan {
                pid: m.pid,
                component: m.component.clone(),
                operation: m.operation.clone(),
                started: m.timestamp,
            });
        } else {
            *untracked += 1;
        }
    }

    /// Closes the innermost open span of `m`'s component and operation
    /// (of the same process if there is one); false when none is open.
    pub(super) fn close(&mut self, m: &Mark) -> bool {
        let same = |s: &OpenSpan| s.component == m.component && s.operation == m.operation;
        let found = self
            .open
            .iter()
            .rposition(|s| same(s) && s.pid == m.pid)
            .or_else(|| self.open.iter().rposition(same));
        if let Some(i) = found {
            self.open.remove(i);
        }
        found.is_some()
    }

    /// The innermost open span, whose component timer samples count for.
    pub(super) fn innermost(&self) -> Option<&OpenSpan> {
        self.open.last()
    }

    /// Spans a dead process left open can never be closed by it.
    pub(super) fn close_those_of(&mut self, pid: u32) {
        self.open.retain(|s| s.pid != Some(pid));
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
