//! The store's state: every field a run has, the accessors exporters and
//! the engine read, and the end of the run. Only
//! [`Store::apply`](super::Store::apply) changes it, through the folds in
//! the files beside this one.

use std::collections::BTreeMap;

use super::entries::EntryLog;
use super::limits::Limits;
use super::pressure::{Level, Thresholds};
use super::snapshot::{AllocatorNow, Current};
use crate::model::leak::LeakSeries;
use crate::model::thin::Thinned;
use crate::model::RunStatus;
use crate::model::{
    Alert, Counters, Entry, EntryKind, Exit, FlightWindow, Gpu, GpuAttribution, HostInfo, Peaks,
    RunInfo, Stage, Target,
};
use crate::sample::HostMemory;

/// Component of timer samples taken outside any span, and of memtrack's
/// own entries (`experiment_start` / `experiment_end`).
pub const SYSTEM: &str = "system";

/// All run state: each fold's in a struct of its own (below; the fold's
/// code is in its file beside this one), and here what no single fold
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

/// The forecasts' state (not checkpointed: a recovered run starts its
/// series afresh).
#[derive(Debug, Clone, Default)]
pub(super) struct ForecastState {
    pub(super) series: BTreeMap<String, crate::model::forecast::ForecastSeries>,
    pub(super) now: BTreeMap<String, super::snapshot::Forecast>,
    /// The seconds last announced per resource.
    pub(super) announced: BTreeMap<String, f64>,
}

/// The alerts' state: the alerts kept, and each resource's level.
#[derive(Debug, Clone, Default)]
pub(super) struct AlertsState {
    pub(super) kept: Vec<Alert>,
    pub(super) levels: BTreeMap<String, Level>,
}

/// The GPUs' state: each device's row, how the tree's share is told
/// apart, and whether NVML answered the latest sample.
#[derive(Debug, Clone, Default)]
pub(super) struct GpuState {
    pub(super) devices: BTreeMap<u32, Gpu>,
    /// How the tree's GPU memory is told apart (absent without NVML).
    pub(super) attribution: Option<GpuAttribution>,
    pub(super) nvml_up: bool,
}

/// The host's state: the machine's memory, the footprint source and what
/// it saw (absent until the first sample), and since when it serves.
#[derive(Debug, Clone, Default)]
pub(super) struct HostState {
    pub(super) memory: HostMemory,
    pub(super) info: Option<HostInfo>,
    pub(super) since: f64,
}

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

/// The peaks' state: the run's, and each component's.
#[derive(Debug, Clone, Default)]
pub(super) struct PeaksState {
    pub(super) run: Peaks,
    pub(super) by_component: BTreeMap<String, Peaks>,
}

/// The samples' state: the timer entries, thinned.
#[derive(Debug, Clone)]
pub(super) struct SamplesState {
    pub(super) timer: Thinned<Entry>,
}

/// The spans' state: those open, outermost first.
#[derive(Debug, Clone, Default)]
pub(super) struct SpansState {
    pub(super) open: Vec<OpenSpan>,
}

/// The stages' state: every stage kept, open and closed, in start order.
#[derive(Debug, Clone, Default)]
pub(super) struct StagesState {
    pub(super) list: Vec<Stage>,
}

/// The targets' state: the processes of the tree, live and gone.
#[derive(Debug, Clone, Default)]
pub(super) struct TargetsState {
    pub(super) live: BTreeMap<u32, LiveTarget>,
    pub(super) gone: Vec<Target>,
}

/// A process of the tree while it lives: its row and its bounded series.
#[derive(Debug, Clone)]
pub(super) struct LiveTarget {
    pub(super) target: Target,
    pub(super) series: Thinned<[f64; 3]>,
    /// Latest figures in bytes, for exporters.
    pub(super) rss: u64,
    pub(super) hwm: u64,
    pub(super) gpu: BTreeMap<u32, u64>,
    pub(super) pss: Option<u64>,
    pub(super) uss: Option<u64>,
    /// `[unix seconds, uss MiB, pss MiB]` at each own-cost read.
    pub(super) own_series: Thinned<[f64; 3]>,
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

    /// Ends the run: open stages are abandoned, open spans dropped, and
    /// `experiment_end` reports the last figures of a live tree.
    pub(super) fn finish(&mut self, timestamp: f64, exit: Option<Exit>) -> Entry {
        self.abandon_open_stages(timestamp);
        self.spans.open.clear();
        let last = self
            .last_alive
            .clone()
            .unwrap_or_else(|| self.current.clone());
        let entry = Entry {
            component: SYSTEM.into(),
            operation: "experiment_end".into(),
            timestamp,
            kind: EntryKind::System,
            ..self.entry_from(&last)
        };
        self.observe(&entry, 1);
        self.push_event(&entry);
        self.run.end = Some(timestamp);
        self.run.exit = exit.or(self.run.exit);
        self.run.status = RunStatus::Finished;
        entry
    }

    /// Keeps a flight-recorder window, up to [`MAX_FLIGHTS`](super::limits::MAX_FLIGHTS).
    pub(super) fn keep_flight(&mut self, w: &FlightWindow) {
        if self.flights.len() < super::limits::MAX_FLIGHTS {
            self.flights.push(w.clone());
        } else {
            self.counters.flights_dropped += 1;
        }
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
