//! The document: `memory_usage.json` built from the state — targets in
//! the order they were first seen, the leak rule's verdict, and the
//! summary of what a re-run needs (peaks plus [`HEADROOM`]).

use std::collections::BTreeMap;

use super::log_view::LogView;
use super::state::Store;
use crate::model::advice::{Advice, Facts};
use crate::model::leak::{LeakConfig, LeakReport};
use crate::model::{DocumentOf, Entry, RunStatus, Summary, Target, SCHEMA_VERSION};

/// Headroom added to peaks in the "what a re-run needs" summary.
pub(crate) const HEADROOM: f64 = 0.10;

impl Store {
    /// with a warning).
    #[cfg(test)]
    pub(crate) fn document(&self) -> crate::model::Document {
        self.document_view().map_log(|view| view.entries())
    }

    /// The whole `memory_usage.json` as of now, its log read from the
    /// store while it is written: what checkpoints and the final write
    /// use, so the event log is never held whole (entries come one at a
    /// time from the entries file, or are borrowed from memory).
    pub fn document_view(&self) -> DocumentOf<LogView<'_>> {
        let mut targets: Vec<Target> = self.targets.gone.clone();
        targets.extend(self.targets.live.values().map(|l| {
            let mut t = l.target.clone();
            t.series = l.series.iter().copied().collect();
            t.own_series = l.own_series.iter().copied().collect();
            t
        }));
        targets.sort_by(|a, b| {
            a.first_seen
                .total_cmp(&b.first_seen)
                .then(a.pid.cmp(&b.pid))
        });

        let mut counters = self.counters.clone();
        counters.timer_samples_merged = self.samples.timer.merged();

        let mut run = self.run.clone();
        if run.status.is_empty() {
            run.status = RunStatus::Running;
        }
        let leak = self.leak_of(&targets);
        let mut doc = DocumentOf {
            schema: SCHEMA_VERSION,
            run,
            detailed_log: LogView::new(self),
            peak_usage: self.peaks.run,
            peaks_by_component: self.peaks.by_component.clone(),
            stages: self.stages.list.clone(),
            targets,
            gpus: self.gpu.devices.values().cloned().collect(),
            gpu_attribution: self.gpu.attribution.clone(),
            alerts: self.alerts.kept.clone(),
            leak: Some(leak.to_value()),
            flight_recorder: self.flights.clone(),
            summary: self.summary(),
            counters,
            ranks: Vec::new(),
            worst_rank: BTreeMap::new(),
            host: self.host.info.clone(),
            advice: Vec::new(),
        };
        doc.advice = self.advice_on(&doc);
        doc
    }

    /// The advice on an ended run (none while it runs: checkpoints do
    /// not read the whole log again), the log read once more from the
    /// store.
    fn advice_on(&self, doc: &DocumentOf<LogView<'_>>) -> Vec<Advice> {
        if doc.run.status == RunStatus::Running {
            return Vec::new();
        }
        let mut facts = Facts::default();
        if let Err(e) = doc.detailed_log.try_for_each(|e| {
            facts.observe(e);
            Ok(())
        }) {
            tracing::warn!("advice left out part of the log: {e}");
        }
        facts.conclude(doc)
    }

    /// The leak rule's verdicts as of now (what the document's `leak`
    /// block holds). Costs up to a few milliseconds: callers that ask
    /// often keep the answer a while.
    pub(crate) fn leak_report(&self) -> LeakReport {
        let mut targets: Vec<Target> = self.targets.gone.clone();
        targets.extend(self.targets.live.values().map(|l| {
            let mut t = l.target.clone();
            t.series = l.series.iter().copied().collect();
            t
        }));
        self.leak_of(&targets)
    }

    fn leak_of(&self, targets: &[Target]) -> LeakReport {
        let timers: Vec<&Entry> = self.samples.timer.iter().collect();
        self.leak
            .analyze_beside(&timers, targets, SCHEMA_VERSION, &LeakConfig::default())
    }

    /// What a re-run needs, as of now: the peaks plus [`HEADROOM`].
    pub(crate) fn summary(&self) -> Summary {
        let peak_host = self
            .peaks
            .run
            .figures
            .cpu_ram_used_mb
            .max(self.peaks.run.figures.cpu_ram_hwm_mb);
        let mut by_device: BTreeMap<u32, f64> = self
            .gpu
            .devices
            .values()
            .filter(|g| g.peak_tree_used_mb > 0.0)
            .map(|g| (g.index, g.peak_tree_used_mb))
            .collect();
        if by_device.is_empty() && self.peaks.run.figures.reserved_gpu_ram_mb > 0.0 {
            // Allocator figures only (NVML unavailable): PyTorch's reserved
            // pool, which leaves out the CUDA context.
            by_device.insert(0, self.peaks.run.figures.reserved_gpu_ram_mb);
        }
        let max_gpu = by_device.values().copied().fold(0.0, f64::max);
        let round_up = |mb: f64| (mb * (1.0 + HEADROOM)).ceil();
        Summary {
            peak_host_ram_mb: peak_host,
            peak_gpu_mb_by_device: by_device,
            min_gpu_mb: round_up(max_gpu),
            min_host_ram_mb: round_up(peak_host),
            headroom_ratio: HEADROOM,
            duration_s: self
                .run
                .end
                .unwrap_or(self.current.timestamp)
                .max(self.run.start)
                - self.run.start,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Boundary, Record};
    use crate::model::{Allocator, Exit};

    #[test]
    fn the_borrowed_view_writes_the_same_document_as_the_owned_one() {
        // Checkpoints write `document_view()`; readers and tests use
        // `document()`. Every part a run can have is present here, so a
        // field the view got wrong (or lost) shows as a difference.
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 50)], &[(10, 2000)]);
        join(&mut s, 10);
        join(&mut s, 11);
        timer(&mut st, s);
        st.apply(&Record::StageBegin(stage(101.2, "train", None)));
        let mut m = mark(101.5, "model", "before_generate");
        m.iteration = Some(7);
        m.labels.insert("split".into(), "train".into());
        m.allocator = Some(Allocator {
            allocated: 1024 * M,
            reserved: 2048 * M,
            max_allocated: 1536 * M,
            device: Some(0),
        });
        st.apply(&Record::Mark(m));
        st.apply(&Record::SpanBegin(Boundary {
            mark: mark(101.6, "model", "generate"),
            status: None,
            message: None,
        }));
        for i in 0..40u32 {
            let t = 102.0 + f64::from(i) * 0.5;
            timer(
                &mut st,
                sample(t, &[(10, 100 + 10 * u64::from(i)), (11, 50)], &[(10, 2500)]),
            );
            st.apply(&Record::Mark(mark(t + 0.1, "data", "batch")));
        }
        st.apply(&Record::StageEnd(stage(123.0, "train", Some("SUCCESS"))));
        st.apply(&Record::Exit {
            pid: 11,
            exit: Exit::signal(9),
            max_rss: None,
        });
        st.apply(&Record::Finish {
            timestamp: 124.0,
            exit: Some(Exit::code(0)),
        });
        let owned = st.document();
        assert!(owned.detailed_log.len() > 80 && !owned.stages.is_empty());
        assert!(owned.targets.iter().any(|t| t.exit.is_some()));
        assert_eq!(
            serde_json::to_string_pretty(&st.document_view()).unwrap(),
            serde_json::to_string_pretty(&owned).unwrap()
        );
    }

    #[test]
    fn without_nvml_the_summary_sizes_the_gpu_from_the_allocator_pool() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 1000)], &[]);
        s.gpu_status = crate::sample::gpu::Status::Unavailable;
        s.gpu.devices.clear();
        timer(&mut st, s);
        let mut m = mark(102.0, "model", "step");
        m.allocator = Some(Allocator {
            allocated: 1000 * M,
            reserved: 2000 * M,
            max_allocated: 1200 * M,
            device: Some(0),
        });
        st.apply(&Record::Mark(m));
        let summary = st.document().summary;
        assert_eq!(summary.peak_gpu_mb_by_device[&0], 2000.0);
        assert_eq!(summary.min_gpu_mb, 2200.0);
        assert_eq!(summary.min_host_ram_mb, 1100.0);
        assert_eq!(summary.duration_s, 1.0, "to the latest sample, not mark");
    }
}
