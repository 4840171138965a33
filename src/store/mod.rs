//! The store: every piece of run state, owned in one place and changed only
//! by applying [`Record`]s.
//!
//! Records are the store's inputs: samples, marks, spans, stages, exits and
//! the end of the run. The same records are written to the journal before
//! they are applied, so a run rebuilt from its journal after `kill -9` goes
//! through exactly the code that built it live. Peaks, per-component peaks,
//! stage peaks, pressure levels and the summary are all a pure fold over
//! the records, tested here without I/O.

pub mod chunked;
pub mod entries;
pub mod journal;
pub mod pressure;
pub mod snapshot;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::thin::Thinned;
use crate::model::{
    Alert, Allocator, CgroupBreakdown, Counters, Document, DocumentOf, Entry, EntryKind, Exit,
    FlightWindow, Gpu, GpuSource, HostInfo, HostSource, HostSourceChange, Peaks, RunInfo, Stage,
    Summary, Target, SCHEMA_VERSION,
};
use crate::sample::gpu::Status as GpuStatus;
use crate::sample::Sample;
use crate::units::mib;
use pressure::{Level, Thresholds};
pub use snapshot::Current;

/// Component of timer samples taken outside any span, and of memtrack's
/// own entries (`experiment_start` / `experiment_end`).
pub const SYSTEM: &str = "system";

/// Headroom added to peaks in the "what a re-run needs" summary.
pub const HEADROOM: f64 = 0.10;

/// Why a sample was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SampleKind {
    /// The periodic timer: becomes a timer entry of the log.
    Timer,
    /// Taken for the marks that follow it in the record stream.
    Event,
}

/// One annotated measurement point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mark {
    /// When the mark arrived (Unix seconds).
    pub timestamp: f64,
    #[serde(default)]
    pub pid: Option<u32>,
    pub component: String,
    pub operation: String,
    #[serde(default)]
    pub iteration: Option<u64>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub allocator: Option<Allocator>,
    #[serde(default)]
    pub kind: EntryKind,
}

/// A span or stage boundary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Boundary {
    pub mark: Mark,
    /// Stage end only: `SUCCESS`, `FAILED`, …
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
}

/// The store's inputs. The journal is a sequence of these.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Sample {
        kind: SampleKind,
        sample: Box<Sample>,
    },
    Mark(Mark),
    SpanBegin(Boundary),
    SpanEnd(Boundary),
    StageBegin(Boundary),
    StageEnd(Boundary),
    /// A process we reaped ourselves: exact status and peak RSS.
    Exit {
        pid: u32,
        exit: Exit,
        max_rss: Option<u64>,
    },
    /// The run is over: the job's exit (run mode) and the end time.
    Finish {
        timestamp: f64,
        exit: Option<Exit>,
    },
    /// A flight-recorder window kept because a target died.
    Flight(Box<FlightWindow>),
}

/// What applying a record produced, for those who react to it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// The log entry recorded, if any.
    pub entry: Option<Entry>,
    /// Pressure levels crossed.
    pub alerts: Vec<Alert>,
    /// Span or stage ends that matched nothing open.
    pub unmatched: bool,
}

/// Bounds from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Limits {
    pub max_timer_entries: usize,
    /// Event entries written to `detailed_log` before they are thinned
    /// (0: no bound); see [`LogView`].
    #[serde(default)]
    pub max_event_entries: usize,
    pub target_series_points: usize,
    pub max_targets: usize,
    pub max_alerts: usize,
    /// Distinct components with their own `peaks_by_component` entry (and
    /// metric series); beyond it new ones count under [`OTHER`].
    pub max_components: usize,
    /// Distinct (component, operation) pairs counted separately in
    /// `memtrack_events_total`; beyond it new pairs count under
    /// ([`OTHER`], [`OTHER`]).
    pub max_event_kinds: usize,
    /// Spans open at once; a `span_begin` beyond it is logged but opens
    /// nothing.
    pub max_open_spans: usize,
    /// Stages kept in `stages[]`; beyond it the closed stage with the
    /// smallest peak makes room, or, with every stage open, the new one
    /// is logged but not kept.
    pub max_stages: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_timer_entries: 4096,
            max_event_entries: 0,
            target_series_points: 512,
            max_targets: 1024,
            max_alerts: 1000,
            max_components: 256,
            max_event_kinds: 1000,
            max_open_spans: 128,
            max_stages: 1000,
        }
    }
}

/// The bucket that values beyond a dimension's limit count under.
pub const OTHER: &str = "_other";

/// Whether a value gets its own key in a map bounded to `max` keys: known
/// values always, new ones while there is room. One rule for every
/// dimension a job names (components, event kinds).
fn admit(known: bool, keys: usize, max: usize) -> bool {
    known || keys < max
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LiveTarget {
    target: Target,
    series: Thinned<[f64; 3]>,
    /// Latest figures in bytes, for exporters.
    #[serde(default)]
    rss: u64,
    #[serde(default)]
    hwm: u64,
    #[serde(default)]
    gpu: BTreeMap<u32, u64>,
    #[serde(default)]
    pss: Option<u64>,
    #[serde(default)]
    uss: Option<u64>,
}

/// Flight-recorder windows kept in a run; later ones are counted only.
pub const MAX_FLIGHTS: usize = 8;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct OpenSpan {
    pid: Option<u32>,
    component: String,
    operation: String,
    started: f64,
}

/// All run state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Store {
    pub run: RunInfo,
    limits: Limits,
    thresholds: Thresholds,
    /// Event entries: in memory, or (a daemon's run) in the run's
    /// entries file, read back when the document is written.
    events: entries::EntryLog,
    /// The leak rule's series over the event entries, bounded.
    #[serde(default)]
    leak: crate::model::leak::Series,
    timer: Thinned<Entry>,
    peaks: Peaks,
    by_component: BTreeMap<String, Peaks>,
    live: BTreeMap<u32, LiveTarget>,
    gone: Vec<Target>,
    gpus: BTreeMap<u32, Gpu>,
    spans: Vec<OpenSpan>,
    stages: Vec<Stage>,
    alerts: Vec<Alert>,
    levels: BTreeMap<String, Level>,
    counters: Counters,
    current: Current,
    /// The figures of the last sample in which the tree was alive: what
    /// `experiment_end` reports (the final sample finds the tree gone).
    last_alive: Option<Current>,
    /// Sequence number of the last record applied (journal replay skips
    /// what a checkpoint already holds).
    pub seq: u64,
    /// Events per component and operation.
    #[serde(default)]
    event_counts: BTreeMap<String, BTreeMap<String, u64>>,
    #[serde(default)]
    event_kinds: usize,
    /// The latest allocator figures each process sent.
    #[serde(default)]
    allocator_now: BTreeMap<u32, snapshot::AllocatorNow>,
    #[serde(default)]
    host_memory: crate::sample::HostMemory,
    #[serde(default)]
    nvml_up: bool,
    #[serde(default)]
    flights: Vec<FlightWindow>,
    /// The host source and what it saw (absent until the first sample).
    #[serde(default)]
    host: Option<HostInfo>,
    #[serde(default)]
    host_since: f64,
}

impl Store {
    pub fn new(run: RunInfo, limits: Limits, thresholds: Thresholds) -> Store {
        Store {
            run,
            limits,
            thresholds,
            events: entries::EntryLog::new(),
            leak: crate::model::leak::Series::default(),
            timer: Thinned::new(limits.max_timer_entries),
            peaks: Peaks::default(),
            by_component: BTreeMap::new(),
            live: BTreeMap::new(),
            gone: Vec::new(),
            gpus: BTreeMap::new(),
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

    /// Records the GPUs' static description (index, UUID, name). Called
    /// before the first checkpoint, so the journal's state holds it.
    pub fn describe_gpus(&mut self, devices: &[crate::sample::gpu::Device]) {
        for d in devices {
            let g = self.gpus.entry(d.index).or_insert_with(|| Gpu {
                index: d.index,
                ..Gpu::default()
            });
            g.uuid.clone_from(&d.uuid);
            g.name.clone_from(&d.name);
        }
    }

    /// The name of a process of the tree, live or gone.
    pub fn target_name(&self, pid: u32) -> Option<String> {
        self.live
            .get(&pid)
            .map(|l| l.target.name.clone())
            .or_else(|| {
                self.gone
                    .iter()
                    .rev()
                    .find(|t| t.pid == pid)
                    .map(|t| t.name.clone())
            })
    }

    /// The tree's figures after the latest sample.
    pub fn current(&self) -> &Current {
        &self.current
    }

    pub fn peaks(&self) -> &Peaks {
        &self.peaks
    }

    pub fn peaks_by_component(&self) -> &BTreeMap<String, Peaks> {
        &self.by_component
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    pub fn gpus(&self) -> impl Iterator<Item = &Gpu> {
        self.gpus.values()
    }

    pub fn live_targets(&self) -> impl Iterator<Item = &Target> {
        self.live.values().map(|l| &l.target)
    }

    pub fn levels(&self) -> &BTreeMap<String, Level> {
        &self.levels
    }

    /// Open spans as `component/operation`, outermost first.
    pub fn open_spans(&self) -> impl Iterator<Item = String> + '_ {
        self.spans
            .iter()
            .map(|s| format!("{}/{}", s.component, s.operation))
    }

    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    pub fn is_finished(&self) -> bool {
        self.run.end.is_some()
    }

    /// Applies one record: the only way state changes.
    pub fn apply(&mut self, record: &Record) -> Outcome {
        self.seq += 1;
        match record {
            Record::Sample { kind, sample } => self.apply_sample(*kind, sample),
            Record::Mark(mark) => {
                let entry = self.record_mark(mark, mark.operation.clone(), None);
                Outcome {
                    entry: Some(entry),
                    ..Outcome::default()
                }
            }
            Record::SpanBegin(b) => {
                let entry = self.record_mark(&b.mark, format!("before_{}", b.mark.operation), None);
                if self.spans.len() < self.limits.max_open_spans {
                    self.spans.push(OpenSpan {
                        pid: b.mark.pid,
                        component: b.mark.component.clone(),
                        operation: b.mark.operation.clone(),
                        started: b.mark.timestamp,
                    });
                } else {
                    self.counters.spans_untracked += 1;
                }
                Outcome {
                    entry: Some(entry),
                    ..Outcome::default()
                }
            }
            Record::SpanEnd(b) => {
                let m = &b.mark;
                let found = self
                    .spans
                    .iter()
                    .rposition(|s| {
                        s.component == m.component && s.operation == m.operation && s.pid == m.pid
                    })
                    .or_else(|| {
                        self.spans
                            .iter()
                            .rposition(|s| s.component == m.component && s.operation == m.operation)
                    });
                if let Some(i) = found {
                    self.spans.remove(i);
                }
                let entry = self.record_mark(m, format!("after_{}", m.operation), None);
                Outcome {
                    entry: Some(entry),
                    unmatched: found.is_none(),
                    ..Outcome::default()
                }
            }
            Record::StageBegin(b) => {
                let name = b.mark.operation.clone();
                if self.make_room_for_a_stage() {
                    self.stages.push(Stage {
                        name: name.clone(),
                        status: "RUNNING".into(),
                        start: b.mark.timestamp,
                        pid: b.mark.pid,
                        labels: b.mark.labels.clone(),
                        ..Stage::default()
                    });
                }
                let entry = self.record_mark(&b.mark, format!("{name}/begin"), Some(name));
                Outcome {
                    entry: Some(entry),
                    ..Outcome::default()
                }
            }
            Record::StageEnd(b) => {
                let name = b.mark.operation.clone();
                // The end's own sample belongs to the stage it closes.
                let entry = self.record_mark(&b.mark, format!("{name}/end"), Some(name.clone()));
                let open = self
                    .stages
                    .iter_mut()
                    .rev()
                    .find(|s| s.name == name && s.end.is_none());
                let unmatched = open.is_none();
                if let Some(stage) = open {
                    stage.end = Some(b.mark.timestamp);
                    stage.duration_s = Some((b.mark.timestamp - stage.start).max(0.0));
                    stage.status = b.status.clone().unwrap_or_else(|| "SUCCESS".into());
                    stage.message.clone_from(&b.message);
                }
                Outcome {
                    entry: Some(entry),
                    unmatched,
                    ..Outcome::default()
                }
            }
            Record::Exit { pid, exit, max_rss } => {
                let target = match self.live.get_mut(pid) {
                    Some(l) => Some(&mut l.target),
                    None => self.gone.iter_mut().rev().find(|t| t.pid == *pid),
                };
                if let Some(t) = target {
                    t.exit = Some(*exit);
                    if let Some(b) = max_rss {
                        t.hwm_mb = t.hwm_mb.max(mib(*b));
                    }
                }
                if let Some(b) = max_rss {
                    self.exact_peak(*b);
                }
                Outcome::default()
            }
            Record::Flight(w) => {
                if self.flights.len() < MAX_FLIGHTS {
                    self.flights.push((**w).clone());
                } else {
                    self.counters.flights_dropped += 1;
                }
                Outcome::default()
            }
            Record::Finish { timestamp, exit } => Outcome {
                entry: Some(self.finish(*timestamp, *exit)),
                ..Outcome::default()
            },
        }
    }

    fn finish(&mut self, timestamp: f64, exit: Option<Exit>) -> Entry {
        for stage in self.stages.iter_mut().filter(|s| s.end.is_none()) {
            stage.end = Some(timestamp);
            stage.duration_s = Some((timestamp - stage.start).max(0.0));
            stage.status = "ABANDONED".into();
        }
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
        self.run.status = "finished".into();
        entry
    }

    /// An entry with the tree's figures; GPU fields from NVML (or none).
    fn entry_from(&self, c: &Current) -> Entry {
        Entry {
            timestamp: c.timestamp,
            cpu_ram_used_mb: c.cpu_used_mb,
            gpu_ram_used_mb: c.gpu_tree_mb,
            gpu_ram_peak_mb: c.gpu_tree_peak_mb,
            reserved_gpu_ram_mb: c.gpu_tree_mb,
            gpu_source: c.gpu_source,
            gpu_process_used_mb: c.gpu_tree_mb,
            cpu_ram_hwm_mb: c.cpu_hwm_mb,
            ..Entry::default()
        }
    }

    fn record_mark(&mut self, mark: &Mark, operation: String, stage: Option<String>) -> Entry {
        let mut entry = Entry {
            component: mark.component.clone(),
            operation,
            timestamp: mark.timestamp,
            kind: mark.kind,
            pid: mark.pid,
            iteration: mark.iteration,
            labels: mark.labels.clone(),
            stage: stage.or_else(|| self.open_stage()),
            ..self.entry_from(&self.current.clone())
        };
        if let Some(a) = mark.allocator {
            entry.gpu_ram_used_mb = mib(a.allocated);
            entry.reserved_gpu_ram_mb = mib(a.reserved);
            entry.gpu_ram_peak_mb = mib(a.max_allocated);
            entry.gpu_source = GpuSource::Allocator;
        }
        if mark.kind == EntryKind::Event {
            self.counters.events += 1;
            self.count_event(&entry.component, &entry.operation);
        }
        if let (Some(a), Some(pid)) = (mark.allocator, mark.pid) {
            self.allocator_now.insert(
                pid,
                snapshot::AllocatorNow {
                    pid,
                    timestamp: mark.timestamp,
                    figures: a,
                },
            );
        }
        self.observe(&entry, 1);
        self.push_event(&entry);
        entry
    }

    /// Keeps an event entry: in the log (memory or file) and in the leak
    /// rule's bounded series.
    fn push_event(&mut self, entry: &Entry) {
        self.leak.push_untimed(entry);
        if self.events.push(entry).is_err() {
            // Kept in memory and written with the next batch.
            self.counters.journal_errors += 1;
        }
    }

    /// Keeps the event log in a new file at `path` from now on (the
    /// entries already recorded move there first), so memory stays flat
    /// however many marks the run takes.
    pub fn keep_entries_in(&mut self, path: &std::path::Path) -> Result<(), entries::EntriesError> {
        self.events.create_file(path)
    }

    /// Reattaches the entries file of a store read back from a
    /// checkpoint's state (see [`entries::EntryLog::reattach`]).
    pub fn reattach_entries(
        &mut self,
        path: &std::path::Path,
    ) -> Result<(), entries::EntriesError> {
        self.events.reattach(path)
    }

    /// Writes the event entries not yet in their file and makes it
    /// durable (before a state that counts them is written).
    pub fn sync_entries(&self) -> std::io::Result<()> {
        self.events.sync()
    }

    /// Event entries recorded (marks, spans, stages, memtrack's own).
    pub fn event_entries(&self) -> u64 {
        self.events.len()
    }

    /// Whether the document's event entries are thinned: more of them than
    /// `log.max_event_entries`. The complete event log is then written
    /// beside the document ([`Store::write_complete_events`]).
    pub fn events_thinned(&self) -> bool {
        let bound = self.limits.max_event_entries as u64;
        bound > 0 && self.events.len() > bound
    }

    /// Writes every event entry, one JSON line each, oldest first: the
    /// complete event log kept beside a thinned document.
    pub fn write_complete_events(&self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        self.events.copy_lines(w)
    }

    /// Whether `stages[]` has room for one more: at the limit, the closed
    /// stage with the smallest peak goes (counted); with every stage
    /// open, the new one is not kept (counted).
    fn make_room_for_a_stage(&mut self) -> bool {
        if self.stages.len() < self.limits.max_stages {
            return true;
        }
        self.counters.stages_dropped += 1;
        let smallest = self
            .stages
            .iter()
            .enumerate()
            .filter(|(_, s)| s.end.is_some())
            .min_by(|a, b| {
                let peak = |s: &Stage| s.peak.cpu_ram_used_mb.max(s.peak.gpu_ram_peak_mb);
                peak(a.1).total_cmp(&peak(b.1))
            })
            .map(|(i, _)| i);
        match smallest {
            Some(i) => {
                self.stages.remove(i);
                true
            }
            None => false,
        }
    }

    fn count_event(&mut self, component: &str, operation: &str) {
        let known = self
            .event_counts
            .get(component)
            .is_some_and(|ops| ops.contains_key(operation));
        let (c, o) = if admit(known, self.event_kinds, self.limits.max_event_kinds) {
            (component, operation)
        } else {
            self.counters.event_kinds_folded += 1;
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

    fn open_stage(&self) -> Option<String> {
        self.stages
            .iter()
            .rev()
            .find(|s| s.end.is_none())
            .map(|s| s.name.clone())
    }

    /// Folds an entry into the overall, component and open-stage peaks.
    /// The entry keeps the component the job named; its peaks count under
    /// [`OTHER`] once `max_components` others have their own.
    fn observe(&mut self, entry: &Entry, n: u64) {
        self.peaks.observe_weighted(entry, n);
        let known = self.by_component.contains_key(&entry.component);
        let component = if admit(known, self.by_component.len(), self.limits.max_components) {
            entry.component.as_str()
        } else {
            self.counters.components_folded += 1;
            OTHER
        };
        if let Some(p) = self.by_component.get_mut(component) {
            p.observe_weighted(entry, n);
        } else {
            self.by_component
                .entry(component.to_string())
                .or_default()
                .observe_weighted(entry, n);
        }
        for stage in self.stages.iter_mut().filter(|s| s.end.is_none()) {
            stage.peak.observe_weighted(entry, n);
        }
    }

    fn apply_sample(&mut self, kind: SampleKind, sample: &Sample) -> Outcome {
        let ts = sample.timestamp;
        if let Some(info) = &sample.host_source {
            self.set_host_source(info);
        }
        for j in &sample.host.joined {
            // The same process (PID and start time) seen again — a zombie
            // found by a later scan — keeps its one row.
            if let Some(i) = self
                .gone
                .iter()
                .position(|t| t.pid == j.id.pid && t.start_time == j.start_time)
            {
                let target = self.gone.remove(i);
                let mut series = Thinned::new(self.limits.target_series_points);
                for point in &target.series {
                    series.push(*point);
                }
                self.live.insert(
                    j.id.pid,
                    LiveTarget {
                        target: Target {
                            exited_at: None,
                            series: Vec::new(),
                            ..target
                        },
                        series,
                        rss: 0,
                        hwm: 0,
                        gpu: BTreeMap::new(),
                        pss: None,
                        uss: None,
                    },
                );
                continue;
            }
            if self
                .live
                .get(&j.id.pid)
                .is_some_and(|l| l.target.start_time == j.start_time)
            {
                continue;
            }
            self.counters.targets_seen += 1;
            let target = Target {
                pid: j.id.pid,
                ppid: j.ppid,
                start_time: j.start_time,
                name: j.name.clone(),
                cmdline: j.cmdline.clone(),
                root: j.root,
                first_seen: ts,
                last_seen: ts,
                ..Target::default()
            };
            let series = Thinned::new(self.limits.target_series_points);
            self.live.insert(
                j.id.pid,
                LiveTarget {
                    target,
                    series,
                    rss: 0,
                    hwm: 0,
                    gpu: BTreeMap::new(),
                    pss: None,
                    uss: None,
                },
            );
        }
        for d in &sample.host.described {
            if let Some(live) = self.live.get_mut(&d.pid) {
                live.target.name.clone_from(&d.name);
                live.target.cmdline.clone_from(&d.cmdline);
            }
        }
        for left in &sample.host.left {
            self.leave(left, ts);
        }
        self.counters.proc_errors += u64::from(sample.host.errors);
        self.counters.fd_fallbacks += u64::from(sample.host.fd_fallbacks);

        // GPU memory of the tree, per process and per device.
        let sampled = sample.gpu_status == GpuStatus::Sampled;
        if let GpuStatus::Error(_) = sample.gpu_status {
            self.counters.nvml_errors += 1;
        }
        let mut tree_by_device: BTreeMap<u32, u64> = BTreeMap::new();
        let mut gpu_by_pid: BTreeMap<u32, u64> = BTreeMap::new();
        for live in self.live.values_mut() {
            live.gpu.clear();
        }
        for p in &sample.gpu.processes {
            let Some(live) = self.live.get_mut(&p.pid) else {
                continue;
            };
            let used = p.used.unwrap_or(0);
            *live.gpu.entry(p.device).or_default() += used;
            *tree_by_device.entry(p.device).or_default() += used;
            *gpu_by_pid.entry(p.pid).or_default() += used;
            let peak = live
                .target
                .peak_gpu_mb_by_device
                .entry(p.device)
                .or_default();
            *peak = peak.max(mib(used));
        }

        for r in &sample.host.processes {
            let Some(live) = self.live.get_mut(&r.pid) else {
                continue;
            };
            live.rss = r.rss;
            live.hwm = r.hwm.max(r.rss);
            if r.pss.is_some() {
                live.pss = r.pss;
                live.uss = r.uss;
            }
            let t = &mut live.target;
            let gpu = gpu_by_pid.get(&r.pid).copied().unwrap_or(0);
            t.last_seen = ts;
            t.last_rss_mb = mib(r.rss);
            t.peak_rss_mb = t.peak_rss_mb.max(t.last_rss_mb);
            t.hwm_mb = t.hwm_mb.max(mib(r.hwm.max(r.rss)));
            t.last_gpu_mb = mib(gpu);
            t.peak_gpu_mb = t.peak_gpu_mb.max(t.last_gpu_mb);
            if r.pss.is_some() {
                t.pss_mb = r.pss.map(mib);
                t.uss_mb = r.uss.map(mib);
            }
            live.series.push([ts, mib(r.rss), mib(gpu)]);
        }

        for d in &sample.gpu.devices {
            let g = self.gpus.entry(d.index).or_insert_with(|| Gpu {
                index: d.index,
                ..Gpu::default()
            });
            g.total_mb = mib(d.total);
            g.used_mb = mib(d.used);
            g.peak_used_mb = g.peak_used_mb.max(g.used_mb);
            g.tree_used_mb = mib(tree_by_device.get(&d.index).copied().unwrap_or(0));
            g.peak_tree_used_mb = g.peak_tree_used_mb.max(g.tree_used_mb);
            if let Some(u) = d.utilization_pct {
                g.utilization_pct = f64::from(u);
                g.peak_utilization_pct = g.peak_utilization_pct.max(g.utilization_pct);
            }
            if let Some(t) = d.temperature_c {
                g.temperature_c = f64::from(t);
                g.peak_temperature_c = g.peak_temperature_c.max(g.temperature_c);
            }
        }

        if sample.memory.total > 0 {
            self.host_memory = sample.memory;
        }
        self.nvml_up = sampled;
        let gpu_tree = mib(tree_by_device.values().sum());
        let (used, peak, source) = match &sample.host.footprint {
            Some(f) => (f.used, f.peak.max(f.used), f.source),
            // Journals of older builds: the RSS sum, as it was then.
            None => (
                sample.host.tree_rss(),
                sample.host.tree_hwm(),
                HostSource::Rss,
            ),
        };
        self.observe_host(sample, mib(used));
        self.current = Current {
            timestamp: ts,
            cpu_used_mb: mib(used),
            cpu_hwm_mb: mib(peak),
            host_source: source,
            gpu_tree_mb: gpu_tree,
            gpu_tree_peak_mb: self.current.gpu_tree_peak_mb.max(gpu_tree),
            gpu_source: if sampled {
                GpuSource::Nvml
            } else {
                GpuSource::None
            },
            processes: sample.host.processes.len(),
        };
        if !sample.host.processes.is_empty() {
            self.last_alive = Some(self.current.clone());
        }

        let alerts = self.pressure(sample);
        let entry = match kind {
            SampleKind::Timer => {
                self.counters.ticks += 1;
                let span = self.spans.last();
                let entry = Entry {
                    component: span.map_or_else(|| SYSTEM.to_string(), |s| s.component.clone()),
                    operation: "timer".into(),
                    kind: EntryKind::Timer,
                    span: span.map(|s| format!("{}/{}", s.component, s.operation)),
                    stage: self.open_stage(),
                    ..self.entry_from(&self.current.clone())
                };
                self.observe(&entry, 1);
                self.timer.push(entry.clone());
                Some(entry)
            }
            SampleKind::Event => {
                self.counters.event_samples += 1;
                None
            }
        };
        Outcome {
            entry,
            alerts,
            unmatched: false,
        }
    }

    /// Records the host source the sampler chose (or changed to).
    fn set_host_source(&mut self, info: &crate::sample::footprint::SourceInfo) {
        let mut earlier = Vec::new();
        if let Some(old) = self.host.take() {
            earlier = old.earlier;
            earlier.push(HostSourceChange {
                source: old.source,
                reason: old.reason,
                since: self.host_since,
            });
        }
        self.host_since = info.since;
        self.host = Some(HostInfo {
            source: info.source,
            reason: info.reason.clone(),
            cgroup: info.cgroup.as_ref().map(|p| p.display().to_string()),
            cgroup_version: info.cgroup_version,
            cgroup_created: info.cgroup_created,
            earlier,
            ..HostInfo::default()
        });
    }

    /// Folds what the host source saw into the run's [`HostInfo`].
    fn observe_host(&mut self, sample: &Sample, used_mb: f64) {
        let rss_sum = mib(sample.host.tree_rss());
        let new_peak = used_mb > self.peaks.cpu_ram_used_mb;
        let Some(host) = &mut self.host else {
            return;
        };
        host.rss_sum_peak_mb = host.rss_sum_peak_mb.max(rss_sum);
        let Some(f) = &sample.host.footprint else {
            return;
        };
        if let Some(r) = &f.cgroup {
            if let Some(p) = r.kernel_peak {
                host.kernel_peak_mb = Some(host.kernel_peak_mb.unwrap_or(0.0).max(mib(p)));
            }
            if r.oom_kills.is_some() {
                host.oom_kills = r.oom_kills;
            }
            if new_peak || host.at_peak.is_none() {
                host.at_peak = Some(CgroupBreakdown {
                    charged_mb: mib(r.usage),
                    anon_mb: mib(r.stat.anon),
                    file_mb: mib(r.stat.file),
                    shmem_mb: mib(r.stat.shmem),
                    file_mapped_mb: mib(r.stat.file_mapped),
                    inactive_file_mb: mib(r.stat.inactive_file),
                });
            }
        }
        if f.source == HostSource::Pss {
            host.pss_reads = Some(f.pss_reads);
            host.pss_read_s = Some(f.pss_read_s);
            if new_peak || host.pss_age_at_peak_s.is_none() {
                host.pss_age_at_peak_s = f.age_s;
            }
        }
    }

    /// A reaped process's peak RSS from `wait4`, exact even when it died
    /// before a tick read its `VmHWM`: the tree held at least that much.
    fn exact_peak(&mut self, max_rss: u64) {
        self.peaks.cpu_ram_hwm_mb = self.peaks.cpu_ram_hwm_mb.max(mib(max_rss));
    }

    fn leave(&mut self, left: &crate::sample::host::Left, ts: f64) {
        let Some(live) = self.live.remove(&left.id.pid) else {
            return;
        };
        let mut t = live.target;
        t.series = live.series.iter().copied().collect();
        t.exited_at = Some(ts);
        if t.exit.is_none() {
            t.exit = Some(left.exit.unwrap_or_else(Exit::unknown));
        }
        if let Some(b) = left.max_rss {
            t.hwm_mb = t.hwm_mb.max(mib(b));
            self.exact_peak(b);
        }
        // Spans a dead process left open can never be closed by it.
        self.spans.retain(|s| s.pid != Some(t.pid));
        self.allocator_now.remove(&t.pid);
        self.gone.push(t);
        if self.gone.len() + self.live.len() > self.limits.max_targets {
            if let Some(i) = self
                .gone
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.root)
                .min_by(|a, b| a.1.peak_rss_mb.total_cmp(&b.1.peak_rss_mb))
                .map(|(i, _)| i)
            {
                self.gone.remove(i);
                self.counters.targets_pruned += 1;
            }
        }
    }

    fn pressure(&mut self, sample: &Sample) -> Vec<Alert> {
        let mut ratios: Vec<(String, f64)> = Vec::new();
        let m = sample.memory;
        if m.total > 0 {
            ratios.push(("host".into(), 1.0 - m.available as f64 / m.total as f64));
        }
        for d in &sample.gpu.devices {
            if d.total > 0 {
                ratios.push((format!("gpu{}", d.index), d.used as f64 / d.total as f64));
            }
        }
        let mut alerts = Vec::new();
        for (resource, ratio) in ratios {
            let previous = self.levels.get(&resource).copied().unwrap_or_default();
            let level = self.thresholds.level(ratio, previous);
            if level == previous {
                continue;
            }
            self.levels.insert(resource.clone(), level);
            let what = if resource == "host" {
                "host RAM".to_string()
            } else {
                format!("GPU {}", &resource[3..])
            };
            let alert = Alert {
                timestamp: sample.timestamp,
                resource,
                level: level.as_str().into(),
                previous: previous.as_str().into(),
                used_ratio: ratio,
                message: format!(
                    "{what} at {:.1}% used: {} → {}",
                    ratio * 100.0,
                    previous.as_str(),
                    level.as_str()
                ),
            };
            if self.alerts.len() < self.limits.max_alerts {
                self.alerts.push(alert.clone());
            }
            alerts.push(alert);
        }
        alerts
    }

    /// What the daemon sees now, for `status` (socket and CLI) and live
    /// views: run identity, current figures, peaks, live processes, open
    /// spans and stages, pressure levels, GPUs, counters.
    pub fn status(&self) -> serde_json::Value {
        let processes: Vec<serde_json::Value> = self
            .live
            .values()
            .map(|l| {
                let t = &l.target;
                serde_json::json!({
                    "pid": t.pid, "ppid": t.ppid, "name": t.name, "root": t.root,
                    "rss_mb": t.last_rss_mb, "peak_rss_mb": t.peak_rss_mb, "hwm_mb": t.hwm_mb,
                    "gpu_mb": t.last_gpu_mb, "peak_gpu_mb": t.peak_gpu_mb,
                })
            })
            .collect();
        let open_stages: Vec<&str> = self
            .stages
            .iter()
            .filter(|s| s.end.is_none())
            .map(|s| s.name.as_str())
            .collect();
        serde_json::json!({
            "run": {
                "id": self.run.id, "name": self.run.name, "mode": self.run.mode, "host": self.run.host,
                "start": self.run.start, "labels": self.run.labels, "gpu_backend": self.run.gpu_backend,
            },
            "current": self.current,
            "peak_usage": self.peaks,
            "peaks_by_component": self.by_component,
            "processes": processes,
            "open_spans": self.open_spans().collect::<Vec<_>>(),
            "open_stages": open_stages,
            "levels": self.levels,
            "gpus": self.gpus.values().collect::<Vec<_>>(),
            "counters": self.counters,
        })
    }

    /// The level of every resource seen (host RAM and each GPU), normal
    /// included, so exporters have a series from the start.
    pub fn all_levels(&self) -> BTreeMap<String, Level> {
        let mut levels = self.levels.clone();
        if self.host_memory.total > 0 {
            levels.entry("host".into()).or_default();
        }
        for g in self.gpus.values() {
            levels.entry(format!("gpu{}", g.index)).or_default();
        }
        levels
    }

    /// The picture exporters read (see [`snapshot::Snapshot`]).
    pub fn snapshot(&self) -> snapshot::Snapshot {
        snapshot::Snapshot {
            seq: self.seq,
            run: snapshot::RunMeta {
                id: self.run.id.clone(),
                name: self.run.name.clone(),
                host: self.run.host.clone(),
                mode: self.run.mode.clone(),
                start: self.run.start,
                interval_s: self.run.interval_s,
                gpu_backend: self.run.gpu_backend.clone(),
                labels: self.run.labels.clone(),
            },
            current: self.current.clone(),
            peaks: self.peaks,
            by_component: self.by_component.clone(),
            processes: self
                .live
                .values()
                .map(|l| snapshot::ProcessNow {
                    pid: l.target.pid,
                    ppid: l.target.ppid,
                    name: l.target.name.clone(),
                    root: l.target.root,
                    rss_bytes: l.rss,
                    hwm_bytes: l.hwm,
                    peak_rss_bytes: (l.target.peak_rss_mb * crate::units::MIB) as u64,
                    gpu_bytes: l.gpu.clone(),
                    pss_bytes: l.pss,
                    uss_bytes: l.uss,
                })
                .collect(),
            gpus: self.gpus.values().cloned().collect(),
            allocator: self.allocator_now.values().copied().collect(),
            events: self.event_counts.clone(),
            levels: self.all_levels(),
            open_spans: self.open_spans().collect(),
            open_stages: self
                .stages
                .iter()
                .filter(|s| s.end.is_none())
                .map(|s| s.name.clone())
                .collect(),
            host_memory: self.host_memory,
            counters: self.counters.clone(),
            nvml_up: self.nvml_up,
            finished: self.is_finished(),
            ..snapshot::Snapshot::default()
        }
    }

    /// The whole `memory_usage.json` as of now, owning its entries (an
    /// entry that cannot be read back from the entries file is left out,
    /// with a warning).
    pub fn document(&self) -> Document {
        self.document_view().map_log(|view| view.entries())
    }

    /// The whole `memory_usage.json` as of now, its log read from the
    /// store while it is written: what checkpoints and the final write
    /// use, so the event log is never held whole (entries come one at a
    /// time from the entries file, or are borrowed from memory).
    pub fn document_view(&self) -> DocumentOf<LogView<'_>> {
        let mut targets: Vec<Target> = self.gone.clone();
        targets.extend(self.live.values().map(|l| {
            let mut t = l.target.clone();
            t.series = l.series.iter().copied().collect();
            t
        }));
        targets.sort_by(|a, b| {
            a.first_seen
                .total_cmp(&b.first_seen)
                .then(a.pid.cmp(&b.pid))
        });

        let mut counters = self.counters.clone();
        counters.timer_samples_merged = self.timer.merged();

        let mut run = self.run.clone();
        if run.status.is_empty() {
            run.status = "running".into();
        }
        let timers: Vec<&Entry> = self.timer.iter().collect();
        let leak = self.leak.analyze_beside(
            &timers,
            &targets,
            SCHEMA_VERSION,
            &crate::model::leak::LeakConfig::default(),
        );
        DocumentOf {
            schema: SCHEMA_VERSION,
            run,
            detailed_log: LogView { store: self },
            peak_usage: self.peaks,
            peaks_by_component: self.by_component.clone(),
            stages: self.stages.clone(),
            targets,
            gpus: self.gpus.values().cloned().collect(),
            alerts: self.alerts.clone(),
            leak: Some(leak.to_value()),
            flight_recorder: self.flights.clone(),
            summary: self.summary(),
            counters,
            ranks: Vec::new(),
            worst_rank: BTreeMap::new(),
            host: self.host.clone(),
        }
    }

    fn summary(&self) -> Summary {
        let peak_host = self.peaks.cpu_ram_used_mb.max(self.peaks.cpu_ram_hwm_mb);
        let mut by_device: BTreeMap<u32, f64> = self
            .gpus
            .values()
            .filter(|g| g.peak_tree_used_mb > 0.0)
            .map(|g| (g.index, g.peak_tree_used_mb))
            .collect();
        if by_device.is_empty() && self.peaks.reserved_gpu_ram_mb > 0.0 {
            // Allocator figures only (NVML unavailable): PyTorch's reserved
            // pool, which leaves out the CUDA context.
            by_device.insert(0, self.peaks.reserved_gpu_ram_mb);
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

/// A document's log read from the store as it is written, in time order:
/// the event entries (memory or file) with the timer log merged in by
/// time. Serializes as the entries themselves would.
#[derive(Debug)]
pub struct LogView<'a> {
    store: &'a Store,
}

impl LogView<'_> {
    /// Entries in the view.
    pub fn len(&self) -> usize {
        usize::try_from(self.store.events.len()).unwrap_or(usize::MAX) + self.store.timer.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Visits every entry in order; stops at the first error.
    pub fn try_for_each(
        &self,
        mut f: impl FnMut(&Entry) -> Result<(), String>,
    ) -> Result<(), String> {
        let events = self.store.events.read().map_err(|e| e.to_string())?;
        let mut timer = self.store.timer.iter().peekable();
        let mut emit = |e: &Entry| -> Result<(), String> {
            while let Some(t) = timer.next_if(|t| t.timestamp <= e.timestamp) {
                f(t)?;
            }
            f(e)
        };
        if self.store.events_thinned() {
            let width = self.chunk_width();
            let mut chunk = Chunk::default();
            for e in events {
                chunk.add(e.map_err(|e| e.to_string())?);
                if chunk.seen >= width {
                    chunk.drain(&mut emit)?;
                }
            }
            chunk.drain(&mut emit)?;
        } else {
            for e in events {
                emit(&e.map_err(|e| e.to_string())?)?;
            }
        }
        timer.try_for_each(f)
    }

    /// Event entries per stretch of a thinned log: the bound shared by the
    /// (component, operation) pairs seen, each pair keeping one entry per
    /// stretch.
    fn chunk_width(&self) -> u64 {
        let n = self.store.events.len();
        // Pairs beyond MAX_EVENT_KINDS are not counted apart: a run with
        // that many may exceed the bound.
        let kinds = (self.store.event_kinds as u64).max(1) + 2;
        let stretches = (self.store.limits.max_event_entries as u64 / kinds).max(1);
        n.div_ceil(stretches).max(1)
    }

    /// Every entry, owned (the ones that cannot be read are left out).
    pub fn entries(&self) -> Vec<Entry> {
        let mut out = Vec::with_capacity(self.len());
        if let Err(e) = self.try_for_each(|e| {
            out.push(e.clone());
            Ok(())
        }) {
            tracing::warn!("the log is incomplete: {e}");
        }
        out
    }
}

/// One stretch of a thinned event log: an entry per (component,
/// operation, stage, kind), each the first such entry with the maximum of
/// every figure over the stretch (`samples`: how many it stands for,
/// `timestamp_end`: the last one's time).
#[derive(Default)]
struct Chunk {
    entries: Vec<Entry>,
    index: std::collections::HashMap<(String, String, Option<String>, u8), usize>,
    seen: u64,
}

impl Chunk {
    fn add(&mut self, e: Entry) {
        use crate::model::thin::Mergeable;
        self.seen += 1;
        let key = (
            e.component.clone(),
            e.operation.clone(),
            e.stage.clone(),
            e.kind as u8,
        );
        match self.index.get(&key) {
            Some(&i) => self.entries[i].absorb(&e),
            None => {
                self.index.insert(key, self.entries.len());
                self.entries.push(e);
            }
        }
    }

    fn drain(&mut self, emit: &mut impl FnMut(&Entry) -> Result<(), String>) -> Result<(), String> {
        self.index.clear();
        self.seen = 0;
        for e in self.entries.drain(..) {
            emit(&e)?;
        }
        Ok(())
    }
}

impl Serialize for LogView<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let len = (!self.store.events_thinned()).then(|| self.len());
        crate::model::serialize_streamed(serializer, len, |f| self.try_for_each(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::gpu::{DeviceReading, GpuSample, ProcessReading};
    use crate::sample::host::{HostSample, Identity, Joined, Left, Reading};
    use crate::sample::HostMemory;

    const M: u64 = 1024 * 1024;

    fn store() -> Store {
        Store::new(
            RunInfo {
                start: 100.0,
                ..RunInfo::default()
            },
            Limits::default(),
            Thresholds::default(),
        )
    }

    fn sample(ts: f64, procs: &[(u32, u64)], gpu: &[(u32, u64)]) -> Box<Sample> {
        let mut s = Sample {
            timestamp: ts,
            host: HostSample {
                processes: procs
                    .iter()
                    .map(|&(pid, rss)| Reading {
                        pid,
                        rss: rss * M,
                        hwm: rss * M,
                        ..Reading::default()
                    })
                    .collect(),
                ..HostSample::default()
            },
            gpu: GpuSample {
                devices: vec![DeviceReading {
                    index: 0,
                    used: gpu.iter().map(|g| g.1).sum::<u64>() * M,
                    total: 80_000 * M,
                    free: 0,
                    ..DeviceReading::default()
                }],
                processes: gpu
                    .iter()
                    .map(|&(pid, used)| ProcessReading {
                        pid,
                        device: 0,
                        used: Some(used * M),
                    })
                    .collect(),
            },
            gpu_status: GpuStatus::Sampled,
            memory: HostMemory {
                total: 1000 * M,
                available: 900 * M,
            },
            ..Sample::default()
        };
        s.host.joined = Vec::new();
        Box::new(s)
    }

    fn join(s: &mut Sample, pid: u32) {
        s.host.joined.push(Joined {
            id: Identity {
                pid,
                start_ticks: u64::from(pid),
            },
            ppid: 1,
            start_time: 0.0,
            name: format!("p{pid}"),
            cmdline: vec![],
            root: pid == 10,
        });
    }

    fn timer(st: &mut Store, s: Box<Sample>) -> Outcome {
        st.apply(&Record::Sample {
            kind: SampleKind::Timer,
            sample: s,
        })
    }

    fn stage(ts: f64, name: &str, status: Option<&str>) -> Boundary {
        Boundary {
            mark: mark(ts, "stage", name),
            status: status.map(str::to_string),
            message: None,
        }
    }

    fn mark(ts: f64, component: &str, operation: &str) -> Mark {
        Mark {
            timestamp: ts,
            pid: Some(10),
            component: component.into(),
            operation: operation.into(),
            iteration: None,
            labels: BTreeMap::new(),
            allocator: None,
            kind: EntryKind::Event,
        }
    }

    #[test]
    fn tree_figures_sum_over_processes_and_peaks_fold() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 50)], &[(10, 2000), (99, 500)]);
        join(&mut s, 10);
        join(&mut s, 11);
        timer(&mut st, s);
        timer(
            &mut st,
            sample(102.0, &[(10, 300), (11, 50)], &[(10, 1000)]),
        );
        timer(
            &mut st,
            sample(103.0, &[(10, 100), (11, 10)], &[(10, 1500)]),
        );
        let doc = st.document();
        assert_eq!(doc.peak_usage.cpu_ram_used_mb, 350.0);
        // pid 99 is not ours: its 500 MiB never counts.
        assert_eq!(doc.peak_usage.gpu_process_used_mb, 2000.0);
        assert_eq!(doc.detailed_log.len(), 3);
        assert_eq!(doc.detailed_log[2].gpu_ram_peak_mb, 2000.0, "running max");
        assert_eq!(doc.detailed_log[2].gpu_ram_used_mb, 1500.0);
        assert_eq!(doc.detailed_log[2].gpu_source, GpuSource::Nvml);
        assert_eq!(doc.gpus[0].peak_tree_used_mb, 2000.0);
        assert_eq!(doc.targets.len(), 2);
        assert_eq!(doc.targets[0].peak_rss_mb, 300.0);
        assert_eq!(doc.summary.min_gpu_mb, 2200.0);
        assert_eq!(doc.peaks_by_component["system"].samples, 3);
    }

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

    /// A run with every kind of entry: samples inside and outside spans,
    /// a stage, marks with allocator figures, an exit and the finish.
    fn busy_run(st: &mut Store, marks: u32) {
        let mut s = sample(101.0, &[(10, 100), (11, 50)], &[(10, 2000)]);
        join(&mut s, 10);
        join(&mut s, 11);
        timer(st, s);
        st.apply(&Record::StageBegin(stage(101.2, "train", None)));
        for i in 0..marks {
            let t = 101.5 + f64::from(i) * 0.013;
            if i % 97 == 0 {
                timer(
                    st,
                    sample(t, &[(10, 100 + u64::from(i % 50)), (11, 50)], &[(10, 2500)]),
                );
            }
            let mut m = mark(t + 0.001, &format!("c{}", i % 8), "step");
            m.iteration = Some(u64::from(i));
            if i % 3 == 0 {
                m.allocator = Some(Allocator {
                    allocated: (1024 + u64::from(i % 100)) * M,
                    reserved: 2048 * M,
                    max_allocated: 1536 * M,
                    device: Some(0),
                });
            }
            if i % 100 == 0 {
                m.labels.insert("split".into(), format!("s{i}"));
                st.apply(&Record::SpanBegin(Boundary {
                    mark: m.clone(),
                    status: None,
                    message: None,
                }));
                st.apply(&Record::SpanEnd(Boundary {
                    mark: m,
                    status: None,
                    message: None,
                }));
            } else {
                st.apply(&Record::Mark(m));
            }
        }
        let end = 102.0 + f64::from(marks) * 0.013;
        st.apply(&Record::StageEnd(stage(end, "train", Some("SUCCESS"))));
        st.apply(&Record::Exit {
            pid: 11,
            exit: Exit::signal(9),
            max_rss: None,
        });
        st.apply(&Record::Finish {
            timestamp: end + 1.0,
            exit: Some(Exit::code(0)),
        });
    }

    #[test]
    fn a_store_whose_entries_live_in_a_file_writes_the_same_document() {
        let dir = tempfile::tempdir().unwrap();
        let mut mem = store();
        let mut file = store();
        file.keep_entries_in(&dir.path().join(entries::FILE))
            .unwrap();
        busy_run(&mut mem, 3000);
        busy_run(&mut file, 3000);
        let a = serde_json::to_string_pretty(&mem.document_view()).unwrap();
        let b = serde_json::to_string_pretty(&file.document_view()).unwrap();
        assert!(a.len() > 1_000_000, "{}", a.len());
        assert!(a == b, "the documents differ");
        assert_eq!(file.document(), mem.document());
    }

    #[test]
    fn past_the_bound_event_entries_are_thinned_keeping_every_maximum() {
        let bounded = |bound: usize| {
            let mut st = Store::new(
                RunInfo {
                    start: 100.0,
                    ..RunInfo::default()
                },
                Limits {
                    max_event_entries: bound,
                    ..Limits::default()
                },
                Thresholds::default(),
            );
            busy_run(&mut st, 20_000);
            st
        };
        let full = bounded(0).document();
        // Under the bound: the same document as without one.
        assert_eq!(bounded(50_000).document(), full);
        let st = bounded(1024);
        assert!(st.events_thinned());
        let thin = st.document();
        let events = |d: &Document| -> Vec<Entry> {
            d.detailed_log
                .iter()
                .filter(|e| e.kind != EntryKind::Timer)
                .cloned()
                .collect()
        };
        let (all, kept) = (events(&full), events(&thin));
        assert!(kept.len() <= 1024, "{} entries", kept.len());
        assert!(
            kept.len() > 512,
            "{} entries: the bound is used",
            kept.len()
        );
        let stands_for: u64 = kept.iter().map(|e| u64::from(e.samples.unwrap_or(1))).sum();
        assert_eq!(stands_for, all.len() as u64, "every entry is accounted for");
        // Per component and operation, every figure's maximum is kept.
        let maxima = |v: &[Entry]| {
            let mut m: BTreeMap<(String, String), [u64; 4]> = BTreeMap::new();
            for e in v {
                let x = m
                    .entry((e.component.clone(), e.operation.clone()))
                    .or_default();
                for (slot, f) in x.iter_mut().zip([
                    e.cpu_ram_used_mb,
                    e.gpu_ram_used_mb,
                    e.reserved_gpu_ram_mb,
                    e.gpu_process_used_mb,
                ]) {
                    *slot = (*slot).max(f.to_bits());
                }
            }
            m
        };
        assert_eq!(maxima(&kept), maxima(&all));
        // The timer log, peaks and everything else are untouched.
        let timers = |d: &Document| {
            d.detailed_log
                .iter()
                .filter(|e| e.kind == EntryKind::Timer)
                .count()
        };
        assert_eq!(timers(&thin), timers(&full));
        assert_eq!(
            Document {
                detailed_log: Vec::new(),
                ..thin.clone()
            },
            Document {
                detailed_log: Vec::new(),
                ..full.clone()
            }
        );
        // The complete event log beside it holds every entry.
        let mut lines = Vec::new();
        st.write_complete_events(&mut lines).unwrap();
        let back: Vec<Entry> = lines
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(back, all);
    }

    #[test]
    fn a_store_with_an_entries_file_holds_no_entries_in_memory() {
        // The store's state is everything it holds in memory: with the
        // entries in a file it stays small however many marks there are.
        let dir = tempfile::tempdir().unwrap();
        let mut st = store();
        st.keep_entries_in(&dir.path().join(entries::FILE)).unwrap();
        busy_run(&mut st, 100_000);
        assert_eq!(st.event_entries(), 100_000 + 1000 + 3);
        let state = serde_json::to_vec(&st).unwrap();
        assert!(state.len() < 3 << 20, "{} bytes", state.len());
        let mut n = 0u64;
        st.document_view()
            .detailed_log
            .try_for_each(|e| {
                n += u64::from(e.kind != EntryKind::Timer);
                Ok(())
            })
            .unwrap();
        assert_eq!(n, st.event_entries(), "every entry reads back");
    }

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
            (e.gpu_ram_used_mb, e.reserved_gpu_ram_mb, e.gpu_ram_peak_mb),
            (1024.0, 2048.0, 1536.0)
        );
        assert_eq!(e.gpu_process_used_mb, 3000.0, "NVML view kept beside");
        assert_eq!(e.cpu_ram_used_mb, 100.0);
    }

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
        assert_eq!(doc.peaks_by_component["model"].cpu_ram_used_mb, 600.0);
        assert_eq!(doc.peaks_by_component["system"].cpu_ram_used_mb, 700.0);
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
        assert_eq!(doc.peaks_by_component["eval"].cpu_ram_used_mb, 900.0);
        assert_eq!(doc.peaks_by_component["train"].cpu_ram_used_mb, 300.0);
        assert_eq!(doc.peaks_by_component["system"].cpu_ram_used_mb, 50.0);
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
    fn stages_record_status_duration_and_peak() {
        let mut st = store();
        timer(&mut st, sample(101.0, &[(10, 100)], &[]));
        st.apply(&Record::StageBegin(stage(101.0, "train", None)));
        timer(&mut st, sample(102.0, &[(10, 900)], &[]));
        st.apply(&Record::StageEnd(stage(105.0, "train", Some("SUCCESS"))));
        st.apply(&Record::StageBegin(stage(105.0, "eval", None)));
        timer(&mut st, sample(106.0, &[(10, 200)], &[]));
        st.apply(&Record::StageEnd(stage(106.5, "eval", Some("FAILED"))));
        st.apply(&Record::StageBegin(stage(107.0, "export", None)));
        st.apply(&Record::Finish {
            timestamp: 108.0,
            exit: Some(Exit::code(1)),
        });
        let doc = st.document();
        let s: Vec<(&str, &str, f64, f64)> = doc
            .stages
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.status.as_str(),
                    s.duration_s.unwrap(),
                    s.peak.cpu_ram_used_mb,
                )
            })
            .collect();
        assert_eq!(
            s,
            [
                ("train", "SUCCESS", 4.0, 900.0),
                ("eval", "FAILED", 1.5, 900.0),
                ("export", "ABANDONED", 1.0, 200.0)
            ]
        );
    }

    #[test]
    fn exits_are_recorded_and_dead_processes_close_their_spans() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 100)], &[]);
        join(&mut s, 10);
        join(&mut s, 11);
        timer(&mut st, s);
        let mut m = mark(101.5, "data", "load");
        m.pid = Some(11);
        st.apply(&Record::SpanBegin(Boundary {
            mark: m,
            status: None,
            message: None,
        }));
        let mut s = sample(102.0, &[(10, 100)], &[]);
        s.host.left.push(Left {
            id: Identity {
                pid: 11,
                start_ticks: 11,
            },
            exit: None,
            max_rss: Some(400 * M),
        });
        timer(&mut st, s);
        st.apply(&Record::Exit {
            pid: 10,
            exit: Exit::signal(9),
            max_rss: None,
        });
        let doc = st.document();
        let t11 = doc.targets.iter().find(|t| t.pid == 11).unwrap();
        assert_eq!(t11.exit, Some(Exit::unknown()));
        assert_eq!(t11.hwm_mb, 400.0, "wait4's peak");
        assert_eq!(
            doc.peak_usage.cpu_ram_hwm_mb, 400.0,
            "the tree held at least what one process did"
        );
        assert_eq!(doc.summary.peak_host_ram_mb, 400.0);
        assert_eq!(t11.series.len(), 1);
        let t10 = doc.targets.iter().find(|t| t.pid == 10).unwrap();
        assert_eq!(t10.exit.unwrap().code, 137);
        assert_eq!(
            doc.detailed_log.last().unwrap().component,
            "system",
            "span closed"
        );
    }

    #[test]
    fn experiment_end_reports_the_last_live_figures() {
        let mut st = store();
        timer(&mut st, sample(101.0, &[(10, 250)], &[]));
        timer(&mut st, sample(102.0, &[], &[]));
        st.apply(&Record::Finish {
            timestamp: 102.5,
            exit: Some(Exit::code(0)),
        });
        let doc = st.document();
        let end = doc.detailed_log.last().unwrap();
        assert_eq!(
            (end.operation.as_str(), end.cpu_ram_used_mb, end.timestamp),
            ("experiment_end", 250.0, 102.5)
        );
        assert_eq!(doc.run.status, "finished");
        assert_eq!(doc.run.exit, Some(Exit::code(0)));
    }

    #[test]
    fn pressure_crossings_become_alerts() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 1)], &[(10, 70_000)]);
        s.memory.available = 100 * M; // host 90 % used
        let out = timer(&mut st, s);
        let levels: Vec<(&str, &str)> = out
            .alerts
            .iter()
            .map(|a| (a.resource.as_str(), a.level.as_str()))
            .collect();
        assert_eq!(levels, [("host", "emergency"), ("gpu0", "critical")]);
        let out = timer(&mut st, sample(102.0, &[(10, 1)], &[(10, 70_000)]));
        assert_eq!(out.alerts.len(), 1, "host back to normal");
        assert_eq!(out.alerts[0].level, "normal");
        assert_eq!(st.document().alerts.len(), 3);
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
    fn a_million_samples_stay_bounded_with_exact_peaks() {
        let mut st = Store::new(
            RunInfo::default(),
            Limits {
                max_timer_entries: 256,
                target_series_points: 64,
                ..Limits::default()
            },
            Thresholds::default(),
        );
        let mut s = sample(0.0, &[(10, 1)], &[]);
        join(&mut s, 10);
        timer(&mut st, s);
        let mut peak = 0u64;
        for i in 1..1_000_000u64 {
            let rss = (i * 7919) % 1000 + if i == 777_777 { 5000 } else { 0 };
            peak = peak.max(rss);
            timer(&mut st, sample(i as f64, &[(10, rss)], &[]));
        }
        let doc = st.document();
        assert_eq!(doc.peak_usage.cpu_ram_used_mb, peak as f64);
        assert!(doc.detailed_log.len() <= 257, "{}", doc.detailed_log.len());
        let log_max = doc
            .detailed_log
            .iter()
            .map(|e| e.cpu_ram_used_mb)
            .fold(0.0, f64::max);
        assert_eq!(log_max, peak as f64, "the thinned log keeps the peak");
        assert!(doc.targets[0].series.len() <= 65);
        assert_eq!(
            doc.targets[0]
                .series
                .iter()
                .map(|p| p[1])
                .fold(0.0, f64::max),
            peak as f64
        );
        let json = serde_json::to_vec(&doc).unwrap();
        assert!(json.len() < 200_000, "{} bytes", json.len());
    }
}
