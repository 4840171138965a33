//! The store's state: every field a run has, and the accessors exporters
//! and the engine read. Only [`Store::apply`](super::Store::apply)
//! changes it (`apply.rs`), through the folds in the files beside this
//! one.

use super::alerts::AlertsState;
use super::entries::EntryLog;
use super::forecast::ForecastState;
use super::gpu::GpuState;
use super::host::HostState;
use super::limits::Limits;
use super::marks::MarksState;
use super::peaks::PeaksState;
use super::pressure::Thresholds;
use super::samples::SamplesState;
use super::snapshot::{Current, Forecast};
use super::spans::SpansState;
use super::stages::StagesState;
use super::targets::TargetsState;
use crate::model::leak::LeakSeries;
use crate::model::{Counters, FlightWindow, GpuAttribution, Peaks, RunInfo};
use crate::sample::gpu::Device;

/// Component of timer samples taken outside any span, and of memtrack's
/// own entries (`experiment_start` / `experiment_end`).
pub const SYSTEM: &str = "system";

/// All run state: each fold's in a struct of its own, defined with its
/// methods in its file beside this one, and here what no single fold
/// owns. A checkpoint is not this struct's form: `super::checkpoint`
/// converts it to the checkpoint's file format and back.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) run: RunInfo,
    pub(super) limits: Limits,
    pub(super) thresholds: Thresholds,
    /// Event entries: in memory, or (a daemon's run) in the run's
    /// entries file, read back when the document is written.
    pub(super) events: EntryLog,
    /// The leak rule's series over the event entries, bounded.
    pub(super) leak: LeakSeries,
    pub(super) samples: SamplesState,
    pub(super) peaks: PeaksState,
    pub(super) targets: TargetsState,
    pub(super) gpu: GpuState,
    pub(super) spans: SpansState,
    pub(super) stages: StagesState,
    pub(super) alerts: AlertsState,
    pub(super) counters: Counters,
    pub(super) current: Current,
    /// The figures of the last sample in which the tree was alive: what
    /// `experiment_end` reports (the final sample finds the tree gone).
    pub(super) last_alive: Option<Current>,
    /// Sequence number of the last record applied (journal replay skips
    /// what a checkpoint already holds).
    pub(crate) seq: u64,
    pub(super) marks: MarksState,
    pub(super) host: HostState,
    pub(super) flights: Vec<FlightWindow>,
    /// Time to OOM, live.
    pub(super) forecasts: ForecastState,
}

impl Store {
    pub fn new(run: RunInfo, limits: Limits, thresholds: Thresholds) -> Store {
        Store {
            run,
            limits,
            thresholds,
            events: EntryLog::new(),
            leak: LeakSeries::default(),
            samples: SamplesState::new(&limits),
            peaks: PeaksState::default(),
            targets: TargetsState::default(),
            gpu: GpuState::default(),
            spans: SpansState::default(),
            stages: StagesState::default(),
            alerts: AlertsState::default(),
            counters: Counters::default(),
            current: Current::default(),
            last_alive: None,
            seq: 0,
            marks: MarksState::default(),
            host: HostState::default(),
            flights: Vec::new(),
            forecasts: Default::default(),
        }
    }

    /// The tree's figures after the latest sample.
    pub(crate) fn current(&self) -> &Current {
        &self.current
    }

    pub(crate) fn peaks(&self) -> &Peaks {
        &self.peaks.run
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    pub(crate) fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    #[cfg(test)]
    pub(crate) fn gpus(&self) -> impl Iterator<Item = &crate::model::Gpu> {
        self.gpu.devices.values()
    }

    #[cfg(test)]
    pub(crate) fn live_targets(&self) -> impl Iterator<Item = &crate::model::Target> {
        self.targets.live.values().map(|l| &l.target)
    }

    #[cfg(test)]
    pub(crate) fn levels(&self) -> &std::collections::BTreeMap<String, super::pressure::Level> {
        &self.alerts.levels
    }

    /// Open spans as `component/operation`, outermost first.
    pub(crate) fn open_spans(&self) -> impl Iterator<Item = String> + '_ {
        self.spans
            .open
            .iter()
            .map(|s| format!("{}/{}", s.component, s.operation))
    }

    #[cfg(test)]
    pub(crate) fn stages(&self) -> &[crate::model::Stage] {
        &self.stages.list
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.run.end.is_some()
    }

    /// Records the GPUs' static description (index, UUID, name) and how
    /// the tree's share of them is told apart. Called before the first
    /// checkpoint, so the journal's state holds it.
    pub fn describe_gpus(&mut self, devices: &[Device], attribution: Option<GpuAttribution>) {
        self.gpu.describe(devices, attribution);
    }
    /// How the tree's GPU memory is told apart (absent without NVML).
    pub(crate) fn gpu_attribution(&self) -> Option<&GpuAttribution> {
        self.gpu.attribution.as_ref()
    }
    /// The name of a process of the tree, live or gone.
    pub(crate) fn target_name(&self, pid: u32) -> Option<String> {
        self.targets.name(pid)
    }
    /// The live forecasts, by resource.
    pub(crate) fn forecasts(&self) -> Vec<Forecast> {
        self.forecasts.live().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::limits::MAX_FLIGHTS;
    use super::super::testkit::*;

    #[test]
    fn flight_windows_past_the_bound_are_counted_only() {
        let mut st = store();
        for _ in 0..MAX_FLIGHTS + 2 {
            st.apply(&Record::Flight(Box::default()));
        }
        assert_eq!(st.document().flight_recorder.len(), MAX_FLIGHTS);
        assert_eq!(st.counters().flights_dropped, 2);
        assert_eq!(st.seq, MAX_FLIGHTS as u64 + 2, "every record counted");
    }

    #[test]
    fn finish_abandons_stages_drops_spans_and_keeps_an_earlier_exit() {
        let mut st = store();
        st.run.exit = Some(Exit::signal(15));
        st.apply(&Record::StageBegin(stage(101.0, "train", None)));
        st.apply(&Record::SpanBegin(Boundary {
            mark: mark(101.0, "model", "step"),
            status: None,
            message: None,
        }));
        let out = st.apply(&Record::Finish {
            timestamp: 103.0,
            exit: None,
        });
        let e = out.entry.unwrap();
        assert_eq!(
            (e.component.as_str(), e.kind),
            ("system", EntryKind::System)
        );
        assert_eq!(st.open_spans().count(), 0);
        assert_eq!(st.stages()[0].status, "ABANDONED");
        assert_eq!(st.stages()[0].duration_s, Some(2.0));
        assert!(st.is_finished());
        assert_eq!(st.run.exit, Some(Exit::signal(15)));
    }
}
