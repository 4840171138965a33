//! Marks: a mark (or a span or stage boundary) becomes an event entry with
//! the tree's latest figures, the allocator's figures when the job sent
//! them, and a count per (component, operation) bounded by
//! [`Limits::max_event_kinds`](super::limits::Limits::max_event_kinds).

use std::collections::BTreeMap;

use super::limits::{admit, OTHER};
use super::snapshot::{AllocatorNow, Current};
use crate::model::{Allocator, Entry, Figures};

/// The marks' state: events per component and operation (and how many
/// kinds that is), and the latest allocator figures each process sent.
#[derive(Debug, Clone, Default)]
pub(super) struct MarksState {
    /// Events per component and operation.
    pub(super) event_counts: BTreeMap<String, BTreeMap<String, u64>>,
    pub(super) event_kinds: usize,
    /// The latest allocator figures each process sent.
    pub(super) allocator_now: BTreeMap<u32, AllocatorNow>,
}

impl MarksState {
    /// Counts an event of `component` and `operation`; past `max_kinds`
    /// kinds a new one counts under [`OTHER`] (counted in `folded`).
    pub(super) fn count(
        &mut self,
        component: &str,
        operation: &str,
        max_kinds: usize,
        folded: &mut u64,
    ) {
        let known = self
            .event_counts
            .get(component)
            .is_some_and(|ops| ops.contains_key(operation));
        let (c, o) = if admit(known, self.event_kinds, max_kinds) {
            (component, operation)
        } else {
            *folded += 1;
            (OTHER, OTHER)
        };
        let n = self
            .event_counts
            .entry(c.to_string())
            .or_default()
            .entry(o.to_string())
            .or_insert(0);
        if *n == 0 {
            self.event_kinds += 1;
        }
        *n += 1;
    }

    /// The allocator figures `pid` sent at `timestamp`, its latest.
    pub(super) fn note_allocator(&mut self, pid: u32, timestamp: f64, figures: Allocator) {
        self.allocator_now.insert(
            pid,
            AllocatorNow {
                pid,
                timestamp,
                figures,
            },
        );
    }

    /// A process that left sends no more allocator figures.
    pub(super) fn forget(&mut self, pid: u32) {
        self.allocator_now.remove(&pid);
    }
}

/// An entry with the tree's figures `c`; GPU fields from NVML (or none).
pub(super) fn entry_from(c: &Current) -> Entry {
    Entry {
        timestamp: c.timestamp,
        figures: Figures {
            cpu_ram_used_mb: c.cpu_used_mb,
            gpu_ram_used_mb: c.gpu_tree_mb,
            gpu_ram_peak_mb: c.gpu_tree_peak_mb,
            reserved_gpu_ram_mb: c.gpu_tree_mb,
            gpu_process_used_mb: c.gpu_tree_mb,
            cpu_ram_hwm_mb: c.cpu_hwm_mb,
        },
        gpu_source: c.gpu_source,
        charge_mb: c.charge_mb,
        charge_hwm_mb: c.charge_hwm_mb,
        ..Entry::default()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::Record;
    use crate::model::{Allocator, GpuSource};

    #[test]
    fn allocator_figures_take_the_base_fields() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100)], &[(10, 3000)]);
        join(&mut s, 10);
        timer(&mut st, s);
        let mut m = mark(101.5, "model", "before_generate");
        m.allocator = Some(Allocator {
            allocated: 1024 * M,
            reserved: 2048 * M,
            max_allocated: 1536 * M,
            device: Some(0),
        });
        let out = st.apply(&Record::Mark(m));
        let e = out.entry.unwrap();
        assert_eq!(e.gpu_source, GpuSource::Allocator);
        assert_eq!(
            (
                e.figures.gpu_ram_used_mb,
                e.figures.reserved_gpu_ram_mb,
                e.figures.gpu_ram_peak_mb
            ),
            (1024.0, 2048.0, 1536.0)
        );
        assert_eq!(
            e.figures.gpu_process_used_mb, 3000.0,
            "NVML view kept beside"
        );
        assert_eq!(e.figures.cpu_ram_used_mb, 100.0);
    }

    #[test]
    fn invented_names_fold_into_other_and_are_counted() {
        let mut st = Store::new(
            RunInfo::default(),
            Limits {
                max_components: 4,
                max_event_kinds: 6,
                max_open_spans: 3,
                max_stages: 5,
                ..Limits::default()
            },
            Thresholds::default(),
        );
        timer(&mut st, sample(1.0, &[(10, 100)], &[]));
        for i in 0..50 {
            let out = st.apply(&Record::Mark(mark(
                2.0 + f64::from(i),
                &format!("c{i}"),
                "op",
            )));
            // The log entry keeps what the job sent.
            assert_eq!(out.entry.unwrap().component, format!("c{i}"));
        }
        let doc = st.document();
        let names: Vec<&str> = doc.peaks_by_component.keys().map(String::as_str).collect();
        // `system` (the timer) and three of the job's, then the rest as one.
        assert_eq!(names, ["_other", "c0", "c1", "c2", "system"]);
        assert_eq!(doc.peaks_by_component["_other"].samples, 47);
        assert_eq!(doc.counters.components_folded, 47);
        let snap = st.snapshot();
        let kinds: usize = snap.events.values().map(BTreeMap::len).sum();
        assert_eq!(kinds, 7, "six pairs and _other/_other: {:?}", snap.events);
        assert_eq!(snap.events["_other"]["_other"], 44);
        assert_eq!(doc.counters.event_kinds_folded, 44);
        // Known names keep their own series after the limit is reached.
        st.apply(&Record::Mark(mark(60.0, "c1", "op")));
        assert_eq!(st.document().peaks_by_component["c1"].samples, 2);

        for i in 0..10 {
            st.apply(&Record::SpanBegin(Boundary {
                mark: mark(70.0, &format!("s{i}"), "x"),
                status: None,
                message: None,
            }));
        }
        assert_eq!(st.open_spans().count(), 3);
        assert_eq!(st.counters().spans_untracked, 7);

        // Stages: closed ones with the smallest peaks make room; when all
        // are open, new ones are not kept.
        for i in 0..4 {
            let name = format!("done{i}");
            st.apply(&Record::StageBegin(stage(80.0, &name, None)));
            st.apply(&Record::StageEnd(stage(81.0, &name, Some("SUCCESS"))));
        }
        for i in 0..8 {
            st.apply(&Record::StageBegin(stage(90.0, &format!("open{i}"), None)));
        }
        let doc = st.document();
        assert_eq!(doc.stages.len(), 5);
        assert!(doc.stages.iter().all(|s| s.end.is_none()));
        assert_eq!(doc.counters.stages_dropped, 7);
        // Every message is still a log entry.
        assert_eq!(doc.counters.events, 51 + 10 + 12 + 4);
    }

    #[test]
    fn a_stages_boundaries_count_for_its_peak_not_as_a_component() {
        let mut st = store();
        let mut s = sample(100.0, &[(10, 100)], &[]);
        join(&mut s, 10);
        timer(&mut st, s);
        st.apply(&Record::StageBegin(stage(101.0, "build_model", None)));
        st.apply(&Record::Mark(mark(101.5, "model", "loaded")));
        st.apply(&Record::StageEnd(stage(
            102.0,
            "build_model",
            Some("SUCCESS"),
        )));
        let doc = st.document();
        let names: Vec<&str> = doc.peaks_by_component.keys().map(String::as_str).collect();
        assert_eq!(names, ["model", "system"], "no `stage` component");
        assert!(doc.stages[0].peak.samples >= 2, "{:?}", doc.stages[0].peak);
        assert!(doc.peak_usage.samples >= 4, "{:?}", doc.peak_usage);
        let snap = st.snapshot();
        assert!(!snap.events.contains_key("stage"), "{:?}", snap.events);
        assert_eq!(snap.events["model"]["loaded"], 1);
        // The boundaries are still in the log, with their stage.
        let boundaries = doc
            .detailed_log
            .iter()
            .filter(|e| e.operation.starts_with("build_model/"))
            .count();
        assert_eq!(boundaries, 2);
    }
}
