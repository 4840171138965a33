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
    #[serde(default)]
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

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(super) struct OpenSpan {
    pub(super) pid: Option<u32>,
    pub(super) component: String,
    pub(super) operation: String,
    pub(super) started: f64,
}

/// All run state.
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
    pub(super) timer: Thinned<Entry>,
    pub(super) peaks: Peaks,
    pub(super) by_component: BTreeMap<String, Peaks>,
    pub(super) live: BTreeMap<u32, LiveTarget>,
    pub(super) gone: Vec<Target>,
    pub(super) gpus: BTreeMap<u32, Gpu>,
    /// How the tree's GPU memory is told apart (absent without NVML).
    #[serde(default)]
    pub(super) gpu_attribution: Option<GpuAttribution>,
    pub(super) spans: Vec<OpenSpan>,
    pub(super) stages: Vec<Stage>,
    pub(super) alerts: Vec<Alert>,
    pub(super) levels: BTreeMap<String, Level>,
    pub(super) counters: Counters,
    pub(super) current: Current,
    /// The figures of the last sample in which the tree was alive: what
    /// `experiment_end` reports (the final sample finds the tree gone).
    pub(super) last_alive: Option<Current>,
    /// Sequence number of the last record applied (journal replay skips
    /// what a checkpoint already holds).
    pub(crate) seq: u64,
    /// Events per component and operation.
    #[serde(default)]
    pub(super) event_counts: BTreeMap<String, BTreeMap<String, u64>>,
    #[serde(default)]
    pub(super) event_kinds: usize,
    /// The latest allocator figures each process sent.
    #[serde(default)]
    pub(super) allocator_now: BTreeMap<u32, AllocatorNow>,
    #[serde(default)]
    pub(super) host_memory: HostMemory,
    #[serde(default)]
    pub(super) nvml_up: bool,
    #[serde(default)]
    pub(super) flights: Vec<FlightWindow>,
    /// The host source and what it saw (absent until the first sample).
    #[serde(default)]
    pub(super) host: Option<HostInfo>,
    #[serde(default)]
    pub(super) host_since: f64,
}

impl Store {
    pub fn new(run: RunInfo, limits: Limits, thresholds: Thresholds) -> Store {
        Store {
            run,
            limits,
            thresholds,
            events: EntryLog::new(),
            leak: Series::default(),
            timer: Thinned::new(limits.max_timer_entries),
            peaks: Peaks::default(),
            by_component: BTreeMap::new(),
            live: BTreeMap::new(),
            gone: Vec::new(),
            gpus: BTreeMap::new(),
            gpu_attribution: None,
            spans: Vec::new(),
            stages: Vec::new(),
            alerts: Vec::new(),
            levels: BTreeMap::new(),
            counters: Counters::default(),
            current: Current::default(),
            last_alive: None,
            seq: 0,
            event_counts: BTreeMap::new(),
            event_kinds: 0,
            allocator_now: BTreeMap::new(),
            host_memory: Default::default(),
            nvml_up: false,
            flights: Vec::new(),
            host: None,
            host_since: 0.0,
        }
    }

    /// The tree's figures after the latest sample.
    pub(crate) fn current(&self) -> &Current {
        &self.current
    }

    pub(crate) fn peaks(&self) -> &Peaks {
        &self.peaks
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    pub(crate) fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    #[cfg(test)]
    pub(crate) fn gpus(&self) -> impl Iterator<Item = &Gpu> {
        self.gpus.values()
    }

    #[cfg(test)]
    pub(crate) fn live_targets(&self) -> impl Iterator<Item = &Target> {
        self.live.values().map(|l| &l.target)
    }

    #[cfg(test)]
    pub(crate) fn levels(&self) -> &BTreeMap<String, Level> {
        &self.levels
    }

    /// Open spans as `component/operation`, outermost first.
    pub(crate) fn open_spans(&self) -> impl Iterator<Item = String> + '_ {
        self.spans
            .iter()
            .map(|s| format!("{}/{}", s.component, s.operation))
    }

    #[cfg(test)]
    pub(crate) fn stages(&self) -> &[Stage] {
        &self.stages
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.run.end.is_some()
    }

    /// Ends the run: open stages are abandoned, open spans dropped, and
    /// `experiment_end` reports the last figures of a live tree.
    pub(super) fn finish(&mut self, timestamp: f64, exit: Option<Exit>) -> Entry {
        self.abandon_open_stages(timestamp);
        self.spans.clear();
        self.spans.clear();
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
