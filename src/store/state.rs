//! The store's state: every field a run has, the accessors exporters and
//! the engine read, and the end of the run. Only
//! [`Store::apply`](super::Store::apply) changes it, through the folds in
//! the files beside this one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::entries::EntryLog;
use super::limits::Limits;
use super::pressure::{Level, Thresholds};
use super::snapshot::{AllocatorNow, Current};
use crate::model::leak::Series;
use crate::model::number_keys;
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
/// owns.
///
/// A checkpoint is this struct serialized, one JSON object: the folds'
/// structs are flattened into it, each of their fields a key of that
/// object under the checkpoint's name for it (`rename` keeps it where the
/// struct's own name is shorter). serde reads flattened fields from a
/// buffered copy, where a map's keys stay strings: maps keyed by a number
/// read them with `model::number_keys`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Store {
    pub(crate) run: RunInfo,
    pub(super) limits: Limits,
    pub(super) thresholds: Thresholds,
    /// Event entries: in memory, or (a daemon's run) in the run's
    /// entries file, read back when the document is written.
    pub(super) events: EntryLog,
    /// The leak rule's series over the event entries, bounded.
    #[serde(default)]
    pub(super) leak: Series,
    #[serde(flatten)]
    pub(super) samples: SamplesState,
    #[serde(flatten)]
    pub(super) peaks: PeaksState,
    #[serde(flatten)]
    pub(super) targets: TargetsState,
    #[serde(flatten)]
    pub(super) gpu: GpuState,
    #[serde(flatten)]
    pub(super) spans: SpansState,
    #[serde(flatten)]
    pub(super) stages: StagesState,
    #[serde(flatten)]
    pub(super) alerts: AlertsState,
    pub(super) counters: Counters,
    pub(super) current: Current,
    /// The figures of the last sample in which the tree was alive: what
    /// `experiment_end` reports (the final sample finds the tree gone).
    pub(super) last_alive: Option<Current>,
    /// Sequence number of the last record applied (journal replay skips
    /// what a checkpoint already holds).
    pub(crate) seq: u64,
    #[serde(flatten)]
    pub(super) marks: MarksState,
    #[serde(flatten)]
    pub(super) host: HostState,
    #[serde(default)]
    pub(super) flights: Vec<FlightWindow>,
    /// Time to OOM, live.
    #[serde(skip)]
    pub(super) forecasts: ForecastState,
}

/// The alerts' state: the alerts kept, and each resource's level.
/// The forecasts' state (not checkpointed: a recovered run starts its
/// series afresh).
#[derive(Debug, Clone, Default)]
pub(super) struct ForecastState {
    pub(super) series: BTreeMap<String, crate::model::forecast::Series>,
    pub(super) now: BTreeMap<String, super::snapshot::Forecast>,
    /// The seconds last announced per resource.
    pub(super) announced: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct AlertsState {
    #[serde(rename = "alerts")]
    pub(super) kept: Vec<Alert>,
    pub(super) levels: BTreeMap<String, Level>,
}

/// The GPUs' state: each device's row, how the tree's share is told
/// apart, and whether NVML answered the latest sample.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct GpuState {
    #[serde(rename = "gpus", deserialize_with = "number_keys::deserialize")]
    pub(super) devices: BTreeMap<u32, Gpu>,
    /// How the tree's GPU memory is told apart (absent without NVML).
    #[serde(default, rename = "gpu_attribution")]
    pub(super) attribution: Option<GpuAttribution>,
    #[serde(default)]
    pub(super) nvml_up: bool,
}

/// The host's state: the machine's memory, the footprint source and what
/// it saw (absent until the first sample), and since when it serves.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct HostState {
    #[serde(default, rename = "host_memory")]
    pub(super) memory: HostMemory,
    #[serde(default, rename = "host")]
    pub(super) info: Option<HostInfo>,
    #[serde(default, rename = "host_since")]
    pub(super) since: f64,
}

/// The marks' state: events per component and operation (and how many
/// kinds that is), and the latest allocator figures each process sent.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct MarksState {
    /// Events per component and operation.
    #[serde(default)]
    pub(super) event_counts: BTreeMap<String, BTreeMap<String, u64>>,
    #[serde(default)]
    pub(super) event_kinds: usize,
    /// The latest allocator figures each process sent.
    #[serde(default, deserialize_with = "number_keys::deserialize")]
    pub(super) allocator_now: BTreeMap<u32, AllocatorNow>,
}

/// The peaks' state: the run's, and each component's.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct PeaksState {
    #[serde(rename = "peaks")]
    pub(super) run: Peaks,
    pub(super) by_component: BTreeMap<String, Peaks>,
}

/// The samples' state: the timer entries, thinned.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SamplesState {
    pub(super) timer: Thinned<Entry>,
}

/// The spans' state: those open, outermost first.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct SpansState {
    #[serde(rename = "spans")]
    pub(super) open: Vec<OpenSpan>,
}

/// The stages' state: every stage kept, open and closed, in start order.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct StagesState {
    #[serde(rename = "stages")]
    pub(super) list: Vec<Stage>,
}

/// The targets' state: the processes of the tree, live and gone.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct TargetsState {
    #[serde(deserialize_with = "number_keys::deserialize")]
    pub(super) live: BTreeMap<u32, LiveTarget>,
    pub(super) gone: Vec<Target>,
}

/// A process of the tree while it lives: its row and its bounded series.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LiveTarget {
    pub(super) target: Target,
    pub(super) series: Thinned<[f64; 3]>,
    /// Latest figures in bytes, for exporters.
    #[serde(default)]
    pub(super) rss: u64,
    #[serde(default)]
    pub(super) hwm: u64,
    #[serde(default, deserialize_with = "number_keys::deserialize")]
    pub(super) gpu: BTreeMap<u32, u64>,
    #[serde(default)]
    pub(super) pss: Option<u64>,
    #[serde(default)]
    pub(super) uss: Option<u64>,
    /// `[unix seconds, uss MiB, pss MiB]` at each own-cost read.
    #[serde(default = "own_series_default")]
    pub(super) own_series: Thinned<[f64; 3]>,
}

/// The own-cost series of a live row a snapshot of an older memtrack
/// lacks.
fn own_series_default() -> Thinned<[f64; 3]> {
    Thinned::new(super::limits::Limits::default().target_series_points)
}

/// An open span: the process that opened it (when known), its name and
/// when it began.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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
            leak: Series::default(),
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

    /// The folds' state is flattened into the checkpoint, and serde reads
    /// flattened fields from a buffered copy: numbers must come back
    /// exact (u64 past 2^53, floats to the last bit) and maps keyed by
    /// PIDs and GPU indices must read their string keys.
    #[test]
    fn a_checkpoint_reads_back_exactly_what_was_written() {
        let mut st = Store::new(
            every_fold_run_info(),
            Limits::default(),
            Thresholds::default(),
        );
        let (devices, attribution) = every_fold_gpus();
        st.describe_gpus(&devices, attribution);
        let (before, after) = every_fold_records();
        for r in before.iter().chain(&after) {
            st.apply(r);
        }
        let live = st.targets.live.get_mut(&10).unwrap();
        live.rss = u64::MAX;
        live.gpu.insert(1, (1 << 53) + 1);
        st.host.memory.total = u64::MAX - 1;
        st.marks
            .event_counts
            .entry("c0".into())
            .or_default()
            .insert("step".into(), (1 << 60) + 7);
        st.peaks.run.cpu_ram_used_mb = 0.1 + 0.2;
        st.host.since = 5e-324;
        st.gpu.devices.get_mut(&1).unwrap().peak_used_mb = f64::MAX;
        st.alerts.kept[0].used_ratio = 1.0 / 3.0;
        let written = serde_json::to_string(&st).unwrap();
        let back: Store = serde_json::from_str(&written).unwrap();
        assert_eq!(serde_json::to_string(&back).unwrap(), written);
        let live = &back.targets.live[&10];
        assert_eq!((live.rss, live.gpu[&1]), (u64::MAX, (1 << 53) + 1));
        assert_eq!(back.host.memory.total, u64::MAX - 1);
        assert_eq!(back.marks.event_counts["c0"]["step"], (1 << 60) + 7);
        assert_eq!(
            back.peaks.run.cpu_ram_used_mb.to_bits(),
            (0.1f64 + 0.2).to_bits()
        );
        assert_eq!(back.host.since.to_bits(), 5e-324f64.to_bits());
        assert_eq!(back.gpu.devices[&1].peak_used_mb, f64::MAX);
        assert_eq!(
            back.alerts.kept[0].used_ratio.to_bits(),
            (1.0f64 / 3.0).to_bits()
        );
    }

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
