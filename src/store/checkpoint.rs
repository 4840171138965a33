//! The checkpoint's file format (`.memtrack/state.json`), kept apart from
//! the store's state.
//!
//! A checkpoint is one JSON object, `{"v":2,"run":{…},"limits":{…},…}`:
//! [`CheckpointFile`] names each of its keys, and the conversions here move
//! each fold's state into it and back. Renaming a field of the
//! [`Store`] or of a fold's struct therefore does not change the file:
//! the conversions decide it. The values under the keys keep the form
//! their types give them elsewhere: the document's types (`run`, log
//! entries, peaks, targets, GPUs, stages, alerts, counters, flight
//! windows) are `memory_usage.json`'s own, the limits and thresholds
//! those of the configuration, `current` that of the `status` reply, and
//! the event log, the thinned series and the leak rule's series write
//! themselves (see `super::entries`, `model::thin`, `model::leak`).
//!
//! Version 1 (written before the version existed: no `v`) has the same
//! keys, and is read as it always was, so a checkpoint an older memtrack
//! left behind recovers whole. A checkpoint of a later version is
//! refused, never read as this one: [`read`] says which version it is.

use std::collections::BTreeMap;
use std::io::{self, Read, Seek};

use serde::{Deserialize, Serialize};

use super::alerts::AlertsState;
use super::entries::EntryLog;
use super::gpu::GpuState;
use super::host::HostState;
use super::limits::Limits;
use super::marks::MarksState;
use super::peaks::PeaksState;
use super::pressure::{Level, Thresholds};
use super::samples::SamplesState;
use super::snapshot::{AllocatorNow, Current};
use super::spans::{OpenSpan, SpansState};
use super::stages::StagesState;
use super::targets::{LiveTarget, TargetsState};
use super::Store;
use crate::model::leak::LeakSeries;
use crate::model::thin::Thinned;
use crate::model::{
    Alert, Counters, Entry, FlightWindow, Gpu, GpuAttribution, HostInfo, Peaks, RunInfo, Stage,
    Target,
};
use crate::sample::HostMemory;

/// The version of the checkpoints this memtrack writes.
pub(super) const VERSION: u32 = 2;

/// A checkpoint as written and read: every key of the file.
#[derive(Serialize, Deserialize)]
pub(super) struct CheckpointFile {
    /// Absent in version 1.
    #[serde(default = "version_1")]
    v: u32,
    run: RunInfo,
    limits: Limits,
    thresholds: Thresholds,
    events: EntryLog,
    #[serde(default)]
    leak: LeakSeries,
    timer: Thinned<Entry>,
    peaks: Peaks,
    by_component: BTreeMap<String, Peaks>,
    live: BTreeMap<u32, CheckpointTarget>,
    gone: Vec<Target>,
    gpus: BTreeMap<u32, Gpu>,
    #[serde(default)]
    gpu_attribution: Option<GpuAttribution>,
    #[serde(default)]
    nvml_up: bool,
    spans: Vec<CheckpointSpan>,
    stages: Vec<Stage>,
    alerts: Vec<Alert>,
    levels: BTreeMap<String, Level>,
    counters: Counters,
    current: Current,
    last_alive: Option<Current>,
    seq: u64,
    #[serde(default)]
    event_counts: BTreeMap<String, BTreeMap<String, u64>>,
    #[serde(default)]
    event_kinds: usize,
    #[serde(default)]
    allocator_now: BTreeMap<u32, AllocatorNow>,
    #[serde(default)]
    host_memory: HostMemory,
    #[serde(default)]
    host: Option<HostInfo>,
    #[serde(default)]
    host_since: f64,
    #[serde(default)]
    flights: Vec<FlightWindow>,
}

fn version_1() -> u32 {
    1
}

/// A process of the tree while it lives (under `live`, keyed by PID).
#[derive(Serialize, Deserialize)]
struct CheckpointTarget {
    target: Target,
    series: Thinned<[f64; 3]>,
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
    /// Absent in checkpoints written before own-cost reads.
    #[serde(default)]
    own_series: Option<Thinned<[f64; 3]>>,
}

/// An open span (under `spans`, outermost first).
#[derive(Serialize, Deserialize)]
struct CheckpointSpan {
    pid: Option<u32>,
    component: String,
    operation: String,
    started: f64,
}

impl From<Store> for CheckpointFile {
    fn from(s: Store) -> CheckpointFile {
        CheckpointFile {
            v: VERSION,
            run: s.run,
            limits: s.limits,
            thresholds: s.thresholds,
            events: s.events,
            leak: s.leak,
            timer: s.samples.timer,
            peaks: s.peaks.run,
            by_component: s.peaks.by_component,
            live: s
                .targets
                .live
                .into_iter()
                .map(|(pid, l)| (pid, l.into()))
                .collect(),
            gone: s.targets.gone,
            gpus: s.gpu.devices,
            gpu_attribution: s.gpu.attribution,
            nvml_up: s.gpu.nvml_up,
            spans: s.spans.open.into_iter().map(Into::into).collect(),
            stages: s.stages.list,
            alerts: s.alerts.kept,
            levels: s.alerts.levels,
            counters: s.counters,
            current: s.current,
            last_alive: s.last_alive,
            seq: s.seq,
            event_counts: s.marks.event_counts,
            event_kinds: s.marks.event_kinds,
            allocator_now: s.marks.allocator_now,
            host_memory: s.host.memory,
            host: s.host.info,
            host_since: s.host.since,
            flights: s.flights,
        }
    }
}

impl CheckpointFile {
    /// The store this checkpoint holds (of a version this memtrack reads).
    fn into_store(self) -> Store {
        let limits = self.limits;
        Store {
            run: self.run,
            limits,
            thresholds: self.thresholds,
            events: self.events,
            leak: self.leak,
            samples: SamplesState { timer: self.timer },
            peaks: PeaksState {
                run: self.peaks,
                by_component: self.by_component,
            },
            targets: TargetsState {
                live: self
                    .live
                    .into_iter()
                    .map(|(pid, l)| (pid, l.into_live(&limits)))
                    .collect(),
                gone: self.gone,
            },
            gpu: GpuState {
                devices: self.gpus,
                attribution: self.gpu_attribution,
                nvml_up: self.nvml_up,
            },
            spans: SpansState {
                open: self.spans.into_iter().map(Into::into).collect(),
            },
            stages: StagesState { list: self.stages },
            alerts: AlertsState {
                kept: self.alerts,
                levels: self.levels,
            },
            counters: self.counters,
            current: self.current,
            last_alive: self.last_alive,
            seq: self.seq,
            marks: MarksState {
                event_counts: self.event_counts,
                event_kinds: self.event_kinds,
                allocator_now: self.allocator_now,
            },
            host: HostState {
                memory: self.host_memory,
                info: self.host,
                since: self.host_since,
            },
            flights: self.flights,
            forecasts: Default::default(),
        }
    }
}

impl From<LiveTarget> for CheckpointTarget {
    fn from(l: LiveTarget) -> CheckpointTarget {
        CheckpointTarget {
            target: l.target,
            series: l.series,
            rss: l.rss,
            hwm: l.hwm,
            gpu: l.gpu,
            pss: l.pss,
            uss: l.uss,
            own_series: Some(l.own_series),
        }
    }
}

impl CheckpointTarget {
    fn into_live(self, limits: &Limits) -> LiveTarget {
        LiveTarget {
            target: self.target,
            series: self.series,
            rss: self.rss,
            hwm: self.hwm,
            gpu: self.gpu,
            pss: self.pss,
            uss: self.uss,
            own_series: self
                .own_series
                .unwrap_or_else(|| Thinned::new(limits.target_series_points)),
        }
    }
}

impl From<OpenSpan> for CheckpointSpan {
    fn from(s: OpenSpan) -> CheckpointSpan {
        CheckpointSpan {
            pid: s.pid,
            component: s.component,
            operation: s.operation,
            started: s.started,
        }
    }
}

impl From<CheckpointSpan> for OpenSpan {
    fn from(s: CheckpointSpan) -> OpenSpan {
        OpenSpan {
            pid: s.pid,
            component: s.component,
            operation: s.operation,
            started: s.started,
        }
    }
}

/// Writes `store` as a checkpoint of this version.
pub(super) fn write(w: impl io::Write, store: Store) -> serde_json::Result<()> {
    serde_json::to_writer(w, &CheckpointFile::from(store))
}

/// Why a checkpoint was not read.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReadError {
    #[error(
        "a checkpoint of version {0}, later than this memtrack reads (up to {VERSION}): \
         recover it with the memtrack that wrote it"
    )]
    Later(u32),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Only the version of a checkpoint (every other key skipped).
#[derive(Deserialize)]
struct VersionOnly {
    #[serde(default = "version_1")]
    v: u32,
}

/// Reads a checkpoint from `file` (parsed as it is read, at most `max`
/// bytes): the store it holds, or why not. A file that is not a checkpoint
/// of this version is read a second time for its version alone, so that a
/// later version is named as such rather than reported as whatever key
/// this memtrack does not know.
pub(super) fn read<F: Read + Seek>(mut file: F, max: u64) -> Result<Store, ReadError> {
    let parsed = serde_json::from_reader::<_, CheckpointFile>(reader(&mut file, max));
    let err = match parsed {
        Ok(c) if c.v > VERSION => return Err(ReadError::Later(c.v)),
        Ok(c) => return Ok(c.into_store()),
        Err(e) => e,
    };
    file.rewind()?;
    match serde_json::from_reader::<_, VersionOnly>(reader(&mut file, max)) {
        Ok(VersionOnly { v }) if v > VERSION => Err(ReadError::Later(v)),
        _ => Err(err.into()),
    }
}

/// The checkpoint of `store`, as JSON (for tests that compare files).
#[cfg(test)]
pub(super) fn to_value(store: &Store) -> serde_json::Value {
    serde_json::to_value(CheckpointFile::from(store.clone())).unwrap_or_default()
}

fn reader<F: Read>(file: F, max: u64) -> io::BufReader<io::Take<F>> {
    io::BufReader::with_capacity(64 * 1024, file.take(max))
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// The store of [`every_fold_records`], written as a checkpoint.
    fn every_fold_store() -> Store {
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
        st
    }

    fn written(st: &Store) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out, st.clone()).unwrap();
        out
    }

    fn read_back(bytes: &[u8]) -> Result<Store, ReadError> {
        read(io::Cursor::new(bytes), u64::MAX)
    }

    /// Numbers come back exact (u64 past 2^53, floats to the last bit)
    /// and maps keyed by PIDs and GPU indices read their string keys.
    #[test]
    fn a_checkpoint_reads_back_exactly_what_was_written() {
        let mut st = every_fold_store();
        let live = st.targets.live.get_mut(&10).unwrap();
        live.rss = u64::MAX;
        live.gpu.insert(1, (1 << 53) + 1);
        st.host.memory.total = u64::MAX - 1;
        st.marks
            .event_counts
            .entry("c0".into())
            .or_default()
            .insert("step".into(), (1 << 60) + 7);
        st.peaks.run.figures.cpu_ram_used_mb = 0.1 + 0.2;
        st.host.since = 5e-324;
        st.gpu.devices.get_mut(&1).unwrap().peak_used_mb = f64::MAX;
        st.alerts.kept[0].used_ratio = 1.0 / 3.0;
        let bytes = written(&st);
        let back = read_back(&bytes).unwrap();
        assert_eq!(written(&back), bytes);
        let live = &back.targets.live[&10];
        assert_eq!((live.rss, live.gpu[&1]), (u64::MAX, (1 << 53) + 1));
        assert_eq!(back.host.memory.total, u64::MAX - 1);
        assert_eq!(back.marks.event_counts["c0"]["step"], (1 << 60) + 7);
        assert_eq!(
            back.peaks.run.figures.cpu_ram_used_mb.to_bits(),
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
    fn a_checkpoint_says_its_version_first_and_one_without_is_version_1() {
        let st = every_fold_store();
        let bytes = written(&st);
        assert!(bytes.starts_with(b"{\"v\":2,\"run\":"), "version first");
        // The same checkpoint without its version: as version 1 wrote it.
        let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v.as_object_mut().unwrap().remove("v"), Some(2.into()));
        let old = read_back(&serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(written(&old), bytes);
    }

    /// A later memtrack may write anything under a later version: the
    /// version is named, whether or not the rest reads as this version.
    #[test]
    fn a_checkpoint_of_a_later_version_is_refused_by_its_version() {
        let bytes = written(&every_fold_store());
        let mut same_keys: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        same_keys["v"] = 3.into();
        let other_keys = serde_json::json!({"renamed": {}, "seq": "x", "v": 7});
        for (v, json) in [(3, same_keys), (7, other_keys)] {
            let err = read_back(&serde_json::to_vec(&json).unwrap()).unwrap_err();
            assert!(matches!(err, ReadError::Later(n) if n == v), "{err}");
            let text = err.to_string();
            assert!(
                text.contains(&format!("version {v}, later than")) && text.contains("up to 2"),
                "{text}"
            );
        }
        // Damage in a checkpoint of this version is a parse error.
        let err = read_back(b"{\"v\":2,\"run\":[]}").unwrap_err();
        assert!(matches!(err, ReadError::Json(_)), "{err}");
    }

    #[test]
    fn a_checkpoint_is_read_no_further_than_its_bound() {
        let bytes = written(&every_fold_store());
        let err = read(io::Cursor::new(&bytes), bytes.len() as u64 - 1).unwrap_err();
        assert!(matches!(err, ReadError::Json(ref e) if e.is_eof()), "{err}");
    }
}
