//! The `memory_usage.json` schema (docs/memory_usage.md): the base layout
//! of the Python memory trackers memtrack replaces (`detailed_log` and
//! `peak_usage`), extended.
//!
//! One set of types serves the writer (the store builds a [`Document`]) and
//! every reader (`report`, `compare`, `merge`, `plot`). Readers must accept
//! files from older schema versions and bare files (only `detailed_log` and
//! `peak_usage`), so every field added by memtrack has a default. The base
//! keys keep their names and meaning exactly.
//!
//! Beside the types: [`json`] reads and writes the file, `thin` keeps a
//! long log bounded while every maximum survives, and [`leak`] is the rule
//! that calls a growing series a leak; `run` holds the run's backend and
//! status vocabularies.

pub mod advice;
mod entry_json;
pub(crate) mod forecast;
pub mod json;
pub mod leak;
mod run;
pub(crate) mod thin;

pub use run::{AttributionMode, GpuAttribution, GpuBackend, PidNamespaceInfo, RunStatus};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Version of the document layout written by this build. Bump it when a
/// field changes meaning; adding a defaulted field does not need a bump.
pub const SCHEMA_VERSION: u32 = 1;

/// The whole `memory_usage.json`, owning its entries.
pub type Document = DocumentOf<Vec<Entry>>;

/// [`Document`] with the log's type open: the entries themselves, or (when
/// memtrack writes its own file) a borrowed view of them that serializes
/// the same way without copying a long event log.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DocumentOf<L> {
    /// 0 for a bare file (no `schema` key), else [`SCHEMA_VERSION`].
    #[serde(default)]
    pub schema: u32,
    #[serde(default)]
    pub run: RunInfo,
    /// Base: one entry per measurement, in time order.
    #[serde(default)]
    pub detailed_log: L,
    /// Base: the maximum of each figure over every sample of the run
    /// (full resolution, including timer samples merged in the log).
    #[serde(default)]
    pub peak_usage: Peaks,
    #[serde(default)]
    pub peaks_by_component: BTreeMap<String, Peaks>,
    #[serde(default)]
    pub stages: Vec<Stage>,
    #[serde(default)]
    pub targets: Vec<Target>,
    #[serde(default)]
    pub gpus: Vec<Gpu>,
    /// Whose memory the GPU figures are: the tree's processes, or (inside a
    /// PID namespace NVML's host PIDs cannot be mapped from) whole devices.
    /// Absent without NVML and in files of older builds (per-process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_attribution: Option<GpuAttribution>,
    #[serde(default)]
    pub alerts: Vec<Alert>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leak: Option<serde_json::Value>,
    /// High-rate samples before a target died (OOM flight recorder).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flight_recorder: Vec<FlightWindow>,
    #[serde(default)]
    pub summary: Summary,
    #[serde(default)]
    pub counters: Counters,
    /// A merged job (`memtrack merge`): one line per rank, and which rank
    /// reached each figure's peak.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankSummary>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub worst_rank: BTreeMap<String, String>,
    /// Where the tree's host figures came from (absent in files written
    /// before memtrack counted shared pages once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostInfo>,
    /// What the run's figures say to change ([`advice`]), written at
    /// the end of the run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub advice: Vec<advice::item::Advice>,
}

impl<L> DocumentOf<L> {
    /// The same document with its log turned into another form (a
    /// borrowed view into owned entries).
    pub(crate) fn map_log<M>(self, f: impl FnOnce(L) -> M) -> DocumentOf<M> {
        DocumentOf {
            schema: self.schema,
            run: self.run,
            detailed_log: f(self.detailed_log),
            peak_usage: self.peak_usage,
            peaks_by_component: self.peaks_by_component,
            stages: self.stages,
            targets: self.targets,
            gpus: self.gpus,
            gpu_attribution: self.gpu_attribution,
            alerts: self.alerts,
            leak: self.leak,
            flight_recorder: self.flight_recorder,
            summary: self.summary,
            counters: self.counters,
            ranks: self.ranks,
            worst_rank: self.worst_rank,
            host: self.host,
            advice: self.advice,
        }
    }
}

/// Why a log streamed entry by entry stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StreamError {
    /// The serializer refused an entry; [`serialize_streamed`] returns the
    /// serializer's own error.
    #[error("an entry could not be written")]
    Refused,
    /// The entries could not be read back.
    #[error(transparent)]
    Read(Box<dyn std::error::Error + Send + Sync>),
}

/// Serializes a log whose entries are produced one at a time by
/// `for_each` (read back from a file, merged from sorted runs), as a JSON
/// array: an entry the serializer refuses stops the walk with that error,
/// a failure of the walk itself becomes a custom error.
pub(crate) fn serialize_streamed<S: serde::Serializer>(
    serializer: S,
    len: Option<usize>,
    for_each: impl FnOnce(&mut dyn FnMut(&Entry) -> Result<(), StreamError>) -> Result<(), StreamError>,
) -> Result<S::Ok, S::Error> {
    use serde::ser::{Error, SerializeSeq};
    let mut seq = serializer.serialize_seq(len)?;
    let mut failed: Option<S::Error> = None;
    let outcome = for_each(&mut |e| {
        seq.serialize_element(e).map_err(|err| {
            failed = Some(err);
            StreamError::Refused
        })
    });
    if let Some(err) = failed {
        return Err(err);
    }
    outcome.map_err(S::Error::custom)?;
    seq.end()
}

/// The last seconds before a target died, sampled faster than the timer:
/// what memory looked like on the way to an OOM.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FlightWindow {
    /// `signal` (killed by a signal), `oom_kill` (the kernel's OOM killer
    /// acted as a target left), or `cuda_oom` (the job reported
    /// `torch.OutOfMemoryError`).
    pub reason: String,
    /// When it happened (Unix seconds).
    pub timestamp: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<Exit>,
    /// Seconds between points.
    #[serde(default)]
    pub interval_s: f64,
    #[serde(default)]
    pub points: Vec<FlightPoint>,
    /// `torch.cuda.memory_summary()` sent with a CUDA OOM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_summary: Option<String>,
}

/// One high-rate sample of the flight recorder (MiB).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FlightPoint {
    pub t: f64,
    pub cpu_mb: f64,
    pub gpu_mb: f64,
    /// `[pid, rss MiB, gpu MiB]` per process.
    #[serde(default)]
    pub processes: Vec<[f64; 3]>,
}

/// One rank of a merged job.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RankSummary {
    /// The `rank` label, else the host.
    pub(crate) rank: String,
    pub(crate) host: String,
    /// How the rank measured its host figures (absent when its file does
    /// not say: an older build summed RSS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) host_source: Option<HostSource>,
    /// Where the rank's file was read from.
    pub(crate) source: String,
    #[serde(default)]
    pub(crate) exit: Option<Exit>,
    pub(crate) peak_usage: Peaks,
    pub(crate) summary: Summary,
}

/// Who ran what, where, and how it ended.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RunInfo {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub host: String,
    /// `run` (memtrack spawned the job) or `attach`.
    #[serde(default)]
    pub mode: String,
    /// The job's argv in `run` mode; the root PIDs' command lines otherwise.
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub start: f64,
    #[serde(default)]
    pub end: Option<f64>,
    /// The job's exit in `run` mode (absent while running or when unknown).
    #[serde(default)]
    pub exit: Option<Exit>,
    /// `running` while checkpointed, `finished` after a clean end,
    /// `recovered` when rebuilt from the journal after memtrack died.
    #[serde(default)]
    pub status: RunStatus,
    /// User labels plus those taken from SLURM / torchrun variables.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub interval_s: f64,
    #[serde(default)]
    pub memtrack_version: String,
    /// Where the GPU figures came from: `nvml` or `none` (with the reason).
    #[serde(default)]
    pub gpu_backend: GpuBackend,
    /// The memory limit the job ran under (`run --memory-limit`), MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit_mb: Option<f64>,
    /// The host's memory (`MemTotal`), MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_mb: Option<f64>,
}

/// Where the tree's host figure (`cpu_ram_used_mb`) comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostSource {
    /// The tree's distinct resident pages: every physical page any of its
    /// processes maps, counted once (from `/proc/PID/pagemap`, as root),
    /// carried forward between passes by each process's `statm`.
    Pages,
    /// The kernel's charge for a memory cgroup holding only the job, less
    /// cold page cache: every page once, spikes between samples included.
    Cgroup,
    /// Σ Pss: each shared page divided among the processes mapping it,
    /// read within a CPU budget and carried forward with RSS in between.
    Pss,
    /// Σ RSS: a page shared by N processes counts N times.
    #[default]
    Rss,
}

impl HostSource {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HostSource::Pages => "pages",
            HostSource::Cgroup => "cgroup",
            HostSource::Pss => "pss",
            HostSource::Rss => "rss",
        }
    }
}

/// The source of the tree's host figures and what it saw over the run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HostInfo {
    pub source: HostSource,
    /// Why this source and not a better one.
    #[serde(default)]
    pub reason: String,
    /// The memory cgroup read (source `cgroup`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_version: Option<u8>,
    /// memtrack created the cgroup for the job (and removed it after).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cgroup_created: bool,
    /// Sources used earlier in the run, when it had to change (another
    /// process joined the job's cgroup).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub earlier: Vec<HostSourceChange>,
    /// The highest plain RSS sum over the tree: what a sum over processes
    /// would have reported, shared pages counted once per process.
    #[serde(default)]
    pub rss_sum_peak_mb: f64,
    /// The kernel's own peak of the cgroup's charge, page cache included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_peak_mb: Option<f64>,
    /// Processes of the cgroup the kernel's OOM killer ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kills: Option<u64>,
    /// The cgroup's charge, broken down, when `cpu_ram_used_mb` peaked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_peak: Option<CgroupBreakdown>,
    /// `smaps_rollup` reads for Σ Pss and the seconds they took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pss_reads: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pss_read_s: Option<f64>,
    /// Seconds since the last complete pass (pages or Σ Pss) behind the
    /// peak figure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pss_age_at_peak_s: Option<f64>,
}

/// An earlier host source of a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HostSourceChange {
    pub source: HostSource,
    #[serde(default)]
    pub reason: String,
    /// Unix seconds when it took over.
    #[serde(default)]
    pub since: f64,
}

/// A memory cgroup's charge, MiB.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct CgroupBreakdown {
    /// Everything charged, page cache included.
    pub(crate) charged_mb: f64,
    pub(crate) anon_mb: f64,
    /// Page cache, shared memory included.
    pub(crate) file_mb: f64,
    pub(crate) shmem_mb: f64,
    pub(crate) file_mapped_mb: f64,
    /// Cold page cache: left out of `cpu_ram_used_mb`.
    pub(crate) inactive_file_mb: f64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// How a process ended. `code` follows the shell: a signal-killed process
/// reports `128 + signal`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Exit {
    pub code: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// False when the process vanished and its status could not be read.
    #[serde(default = "yes")]
    pub known: bool,
}

fn yes() -> bool {
    true
}

impl Exit {
    pub fn code(code: i32) -> Self {
        Exit {
            code,
            signal: None,
            known: true,
        }
    }

    pub fn signal(signal: i32) -> Self {
        Exit {
            code: 128 + signal,
            signal: Some(signal),
            known: true,
        }
    }

    pub(crate) fn unknown() -> Self {
        Exit {
            code: 0,
            signal: None,
            known: false,
        }
    }

    /// Decodes a `waitpid` status word.
    pub(crate) fn from_wait_status(status: i32) -> Self {
        if libc::WIFSIGNALED(status) {
            Exit::signal(libc::WTERMSIG(status))
        } else {
            Exit::code(libc::WEXITSTATUS(status))
        }
    }
}

/// Largest memory figure a job may report for one GPU, bytes (16 TiB:
/// far above any device made). The protocol refuses allocator figures
/// above it and the report names no card for a peak above it, so a
/// corrupt or hostile figure never becomes "a 18897856103 GB card fits".
pub const MAX_DEVICE_BYTES: u64 = 1 << 44;

/// PyTorch allocator figures sent with a mark (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Allocator {
    pub allocated: u64,
    pub reserved: u64,
    pub max_allocated: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
}

/// Which view the base GPU fields of an entry carry.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GpuSource {
    /// PyTorch's allocator figures sent by the job with the event.
    Allocator,
    /// NVML's per-process used memory, summed over the tree.
    Nvml,
    /// NVML's used memory of the job's whole GPUs, every process on them
    /// included (NVML's PIDs could not be matched to the tree's).
    Device,
    /// No GPU figures: no GPU, no driver, or GPUs hidden.
    #[default]
    None,
}

/// Why an entry was recorded.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A mark sent by the job (or `memtrack mark`).
    #[default]
    Event,
    /// A periodic sample (possibly several merged, see `samples`).
    Timer,
    /// memtrack's own `experiment_start` / `experiment_end`.
    System,
}

/// One `detailed_log` element. Its keys, in the document's order, are
/// `component`, `operation`, `timestamp`, the first four [`Figures`],
/// `gpu_source`, the last two, then the rest as below: the order is kept
/// by its JSON form (`entry_json`), which writes the figures in their
/// places around `gpu_source`. The first eight keys are the base ones.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(from = "entry_json::EntryIn")]
pub struct Entry {
    pub component: String,
    pub operation: String,
    /// Unix seconds.
    pub timestamp: f64,
    /// The six memory figures.
    pub figures: Figures,
    pub gpu_source: GpuSource,
    /// The charge of the job's memory cgroup less cold page cache (what
    /// its limit is enforced on), MiB: only the pages charged to the job,
    /// not library pages another cgroup loaded first. Absent without a
    /// cgroup holding the job.
    pub charge_mb: Option<f64>,
    /// The highest `charge_mb` since the previous sample, as the kernel
    /// saw it, MiB.
    pub charge_hwm_mb: Option<f64>,
    pub kind: EntryKind,
    /// The sender of an event (`SO_PEERCRED`).
    pub pid: Option<u32>,
    pub iteration: Option<u64>,
    pub labels: BTreeMap<String, String>,
    /// The innermost open span a timer sample was attributed to.
    pub span: Option<String>,
    /// The stage open when the sample was taken.
    pub stage: Option<String>,
    /// Timer samples merged into this entry (absent = 1). A merged entry
    /// carries the maximum of each figure over its samples, so no peak is
    /// lost when a long run's log is thinned.
    pub samples: Option<u32>,
    /// The last merged sample's time, for merged entries.
    pub timestamp_end: Option<f64>,
}

/// The six memory figures a log [`Entry`] and a set of [`Peaks`] share
/// (MiB), under the same keys in both.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Figures {
    /// Host memory of the whole process tree, every page once (see
    /// [`HostInfo`] for the source).
    #[serde(default)]
    pub cpu_ram_used_mb: f64,
    /// `memory_allocated` (allocator), per-process NVML used (nvml) or the
    /// job's GPUs' used memory (device).
    #[serde(default)]
    pub gpu_ram_used_mb: f64,
    /// `max_memory_allocated` (allocator) or the highest NVML figure so far.
    #[serde(default)]
    pub gpu_ram_peak_mb: f64,
    /// `memory_reserved` (allocator) or per-process NVML used (nvml).
    #[serde(default)]
    pub reserved_gpu_ram_mb: f64,
    /// NVML per-process used memory summed over the tree, all devices.
    #[serde(default)]
    pub gpu_process_used_mb: f64,
    /// The tree's highest host memory since the previous sample, as the
    /// kernel saw it (the cgroup's peak, or processes' `VmHWM` rises);
    /// with source `rss`, the sum of the processes' `VmHWM`.
    #[serde(default)]
    pub cpu_ram_hwm_mb: f64,
}

impl Figures {
    /// The six figures in order: `cpu_ram_used`, `gpu_ram_used`,
    /// `gpu_ram_peak`, `reserved_gpu_ram`, `gpu_process_used`,
    /// `cpu_ram_hwm`.
    pub(crate) fn as_array(&self) -> [f64; 6] {
        [
            self.cpu_ram_used_mb,
            self.gpu_ram_used_mb,
            self.gpu_ram_peak_mb,
            self.reserved_gpu_ram_mb,
            self.gpu_process_used_mb,
            self.cpu_ram_hwm_mb,
        ]
    }

    /// Keeps in `self` the maximum of each figure of `self` and `other`.
    pub(crate) fn keep_max(&mut self, other: &Figures) {
        let into = [
            &mut self.cpu_ram_used_mb,
            &mut self.gpu_ram_used_mb,
            &mut self.gpu_ram_peak_mb,
            &mut self.reserved_gpu_ram_mb,
            &mut self.gpu_process_used_mb,
            &mut self.cpu_ram_hwm_mb,
        ];
        for (slot, f) in into.into_iter().zip(other.as_array()) {
            *slot = slot.max(f);
        }
    }

    /// Whether any GPU figure is above 0 (PyTorch's allocator figures come
    /// without NVML too).
    pub(crate) fn any_gpu(&self) -> bool {
        [
            self.gpu_ram_used_mb,
            self.gpu_ram_peak_mb,
            self.reserved_gpu_ram_mb,
            self.gpu_process_used_mb,
        ]
        .iter()
        .any(|v| *v > 0.0)
    }
}

/// The peak of each figure. The first four are the base `peak_usage`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Peaks {
    #[serde(flatten)]
    pub figures: Figures,
    /// Samples folded in.
    #[serde(default)]
    pub samples: u64,
}

impl Peaks {
    /// Whether any GPU figure is above 0.
    pub(crate) fn any_gpu(&self) -> bool {
        self.figures.any_gpu()
    }

    /// Folds one measurement in: the pure heart of "keep the peaks".
    pub fn observe(&mut self, e: &Entry) {
        self.observe_weighted(e, 1);
    }

    /// As [`Peaks::observe`] for an entry standing for `n` samples.
    pub(crate) fn observe_weighted(&mut self, e: &Entry, n: u64) {
        self.figures.keep_max(&e.figures);
        self.samples += n;
    }

    /// The element-wise maximum of two peak sets.
    pub(crate) fn merge(&mut self, other: &Peaks) {
        self.figures.keep_max(&other.figures);
        self.samples += other.samples;
    }
}

impl Entry {
    /// Keeps in `self` the maximum of each of the six figures of `self`
    /// and `other`; nothing else changes. One rule for thinning a log,
    /// folding a window of samples and keeping peaks.
    pub(crate) fn absorb_max(&mut self, other: &Entry) {
        self.figures.keep_max(&other.figures);
        self.charge_mb = max_of(self.charge_mb, other.charge_mb);
        self.charge_hwm_mb = max_of(self.charge_hwm_mb, other.charge_hwm_mb);
    }

    /// Whether the entry's figures repeat an earlier reading rather than
    /// being read at its time: `experiment_end` carries the last sample
    /// taken while the tree was alive, stamped with the end. A line drawn
    /// through it would jump back up after the job had freed its memory.
    pub(crate) fn repeats_a_reading(&self) -> bool {
        self.kind == EntryKind::System && self.operation == "experiment_end"
    }

    /// The highest host figure the entry saw, on the kernel's charge
    /// basis when it has one (the job's cgroup), else the headline's.
    pub(crate) fn charge_or_headline_peak(&self) -> f64 {
        match (self.charge_mb, self.charge_hwm_mb) {
            (None, None) => self
                .figures
                .cpu_ram_used_mb
                .max(self.figures.cpu_ram_hwm_mb),
            (a, b) => a.unwrap_or(0.0).max(b.unwrap_or(0.0)),
        }
    }
}

/// The larger of two optional figures (either alone when the other is
/// absent).
fn max_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// A pipeline stage: `SUCCESS` / `FAILED`, duration and peak.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Stage {
    pub name: String,
    /// `RUNNING` until ended; then what the job reported (`SUCCESS`,
    /// `FAILED`, …) or `ABANDONED` when the run ended with it open.
    pub status: String,
    pub start: f64,
    #[serde(default)]
    pub end: Option<f64>,
    #[serde(default)]
    pub duration_s: Option<f64>,
    #[serde(default)]
    pub peak: Peaks,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One process of the followed tree.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Target {
    pub pid: u32,
    #[serde(default)]
    pub ppid: u32,
    /// Process start as Unix seconds (with `pid`, the process's identity).
    #[serde(default)]
    pub start_time: f64,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub cmdline: Vec<String>,
    /// A root of the tree (spawned, attached, or self-registered).
    #[serde(default)]
    pub root: bool,
    #[serde(default)]
    pub first_seen: f64,
    #[serde(default)]
    pub last_seen: f64,
    #[serde(default)]
    pub exit: Option<Exit>,
    #[serde(default)]
    pub exited_at: Option<f64>,
    #[serde(default)]
    pub last_rss_mb: f64,
    #[serde(default)]
    pub peak_rss_mb: f64,
    /// The kernel's `VmHWM`: a true peak no sampling interval can miss.
    #[serde(default)]
    pub hwm_mb: f64,
    #[serde(default)]
    pub peak_gpu_mb: f64,
    /// NVML used memory at the last sample, all devices.
    #[serde(default)]
    pub last_gpu_mb: f64,
    /// Peak NVML used memory per GPU index.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub peak_gpu_mb_by_device: BTreeMap<u32, f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pss_mb: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uss_mb: Option<f64>,
    /// The run's peak of `uss_mb`: memory this process alone holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_uss_mb: Option<f64>,
    /// The run's peak of `pss_mb`: this process's proportional share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_pss_mb: Option<f64>,
    /// `uss_mb` and `pss_mb` are an estimate, not a read: the process grew
    /// and held its size with no own-cost read since (its last read USS
    /// plus what it wrote since: the anonymous memory it gained or, as
    /// root, a page per page fault, whichever is larger).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub own_estimated: bool,
    /// `peak_uss_mb` is such an estimate.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peak_uss_estimated: bool,
    /// `[unix seconds, uss MiB, pss MiB]` at each own-cost read, thinned like `series`
    /// (maxima kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub own_series: Vec<[f64; 3]>,
    /// `[unix seconds, rss MiB, gpu MiB]`, thinned like the log (maxima kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub series: Vec<[f64; 3]>,
}

impl Target {
    /// A name a table can show: the command name with what it runs — a
    /// spawned multiprocessing worker says so, an interpreter names its
    /// script or module.
    pub(crate) fn display_name(&self) -> String {
        let args: Vec<&str> = self.cmdline.iter().map(String::as_str).collect();
        if args.contains(&"--multiprocessing-fork") {
            return format!("{} (spawn worker)", self.name);
        }
        // An interpreter that kept its name (a worker that renamed itself
        // has a name of its own).
        let is_interpreter = |s: &str| {
            let base = s.rsplit('/').next().unwrap_or(s);
            base.starts_with("python") || base == "node" || base == "ruby" || base == "perl"
        };
        let interpreter =
            is_interpreter(&self.name) && args.first().is_some_and(|a| is_interpreter(a));
        if !interpreter {
            return self.name.clone();
        }
        let mut rest = args.iter().skip(1);
        while let Some(a) = rest.next() {
            match *a {
                "-m" => {
                    if let Some(m) = rest.next() {
                        return format!("{} -m {m}", self.name);
                    }
                }
                "-c" => return format!("{} -c", self.name),
                a if a.starts_with('-') => {}
                script => {
                    let base = script.rsplit('/').next().unwrap_or(script);
                    return format!("{} {base}", self.name);
                }
            }
        }
        self.name.clone()
    }
}

/// One GPU as NVML describes it, with the run's extremes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Gpu {
    pub index: u32,
    /// The host, in a merged job (indices repeat across hosts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default)]
    pub uuid: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub total_mb: f64,
    /// Device-wide used memory (every process, not only ours): the last
    /// value and the run's peak.
    #[serde(default)]
    pub used_mb: f64,
    #[serde(default)]
    pub peak_used_mb: f64,
    /// The followed tree's memory on this device: last and peak. With
    /// device-level attribution (see [`GpuAttribution`]) the device's used
    /// memory, every process on it included.
    #[serde(default)]
    pub tree_used_mb: f64,
    #[serde(default)]
    pub peak_tree_used_mb: f64,
    #[serde(default)]
    pub utilization_pct: f64,
    #[serde(default)]
    pub peak_utilization_pct: f64,
    #[serde(default)]
    pub temperature_c: f64,
    #[serde(default)]
    pub peak_temperature_c: f64,
}

/// A pressure level crossed (75 / 85 / 90 % by default).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Alert {
    pub timestamp: f64,
    /// `host` or `gpu<index>`.
    pub resource: String,
    /// `normal`, `high`, `critical` or `emergency`.
    pub level: String,
    pub previous: String,
    pub used_ratio: f64,
    #[serde(default)]
    pub message: String,
}

/// What a re-run needs: the answer to "which GPU does this job fit on?".
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    /// Peak host RAM of the tree (RSS or, if higher, the summed VmHWM).
    #[serde(default)]
    pub peak_host_ram_mb: f64,
    /// Peak GPU memory of the tree per device (NVML view, or allocator
    /// `reserved` when higher and only one device is in use).
    #[serde(default)]
    pub peak_gpu_mb_by_device: BTreeMap<u32, f64>,
    /// The largest per-device need: the smallest GPU that fits the job.
    #[serde(default)]
    pub min_gpu_mb: f64,
    /// Peak host RAM with headroom.
    #[serde(default)]
    pub min_host_ram_mb: f64,
    #[serde(default)]
    pub headroom_ratio: f64,
    #[serde(default)]
    pub duration_s: f64,
}

/// memtrack's own health over the run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Counters {
    #[serde(default)]
    pub ticks: u64,
    /// Timer ticks skipped because a tick overran its slot.
    #[serde(default)]
    pub missed_ticks: u64,
    #[serde(default)]
    pub events: u64,
    #[serde(default)]
    pub event_samples: u64,
    #[serde(default)]
    pub protocol_errors: u64,
    #[serde(default)]
    pub dropped_events: u64,
    /// Socket peers of another user, refused.
    #[serde(default)]
    pub refused_peers: u64,
    /// Connections beyond `socket.max_connections`, closed at once.
    #[serde(default)]
    pub rejected_connections: u64,
    /// Clients that stopped reading their replies: they get no more, and
    /// what they send is still recorded.
    #[serde(default)]
    pub slow_clients: u64,
    #[serde(default)]
    pub nvml_errors: u64,
    #[serde(default)]
    pub proc_errors: u64,
    /// Processes followed by path because memtrack ran out of file
    /// descriptors (each read then also checks the process's identity).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub fd_fallbacks: u64,
    #[serde(default)]
    pub journal_errors: u64,
    /// Log entries `memtrack recover` found damaged or missing in the
    /// entries file (cut short, overwritten) and could not put back.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub entries_lost: u64,
    /// Journal records (samples, marks, exits, …) `memtrack recover` found
    /// missing: gaps in the journal's numbering, and records past its end
    /// that the run's tally counted (appends a full disk refused, a journal
    /// cut short). What they carried is not in the document.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub records_lost: u64,
    #[serde(default)]
    pub checkpoint_errors: u64,
    #[serde(default)]
    pub targets_seen: u64,
    /// Exited targets dropped from `targets` to keep the file bounded.
    #[serde(default)]
    pub targets_pruned: u64,
    /// Timer log entries merged away (their maxima live on in the merge).
    #[serde(default)]
    pub timer_samples_merged: u64,
    /// Flight-recorder windows beyond the ones kept.
    #[serde(default)]
    pub flights_dropped: u64,
    /// Entries whose component counted under `_other` in
    /// `peaks_by_component` (`log.max_components` others had their own).
    #[serde(default)]
    pub components_folded: u64,
    /// Events counted under `_other`/`_other` (`log.max_event_kinds`).
    #[serde(default)]
    pub event_kinds_folded: u64,
    /// `span_begin`s logged but not opened (`log.max_open_spans` were open).
    #[serde(default)]
    pub spans_untracked: u64,
    /// Stages dropped from `stages[]` (`log.max_stages`).
    #[serde(default)]
    pub stages_dropped: u64,
}

/// Prometheus label-name rules, applied to every label memtrack records.
pub(crate) fn valid_label_name(k: &str) -> bool {
    let mut chars = k.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !k.starts_with("__")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_named_for_what_they_run() {
        let t = |name: &str, cmd: &[&str]| Target {
            name: name.into(),
            cmdline: cmd.iter().map(|s| s.to_string()).collect(),
            ..Target::default()
        };
        let spawn = t(
            "python3",
            &[
                "/usr/bin/python3",
                "-c",
                "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
                "--multiprocessing-fork",
            ],
        );
        assert_eq!(spawn.display_name(), "python3 (spawn worker)");
        assert_eq!(
            t("python", &["python", "-u", "/x/train.py", "--lr", "1"]).display_name(),
            "python train.py"
        );
        assert_eq!(
            t("python", &["python", "-m", "torch.distributed.run"]).display_name(),
            "python -m torch.distributed.run"
        );
        assert_eq!(t("sh", &["sh", "-c", "x"]).display_name(), "sh");
    }

    #[test]
    fn reads_a_bare_file() {
        let bare = r#"{
          "detailed_log": [
            {"component": "model", "operation": "before_generate",
             "timestamp": 1234567890.123, "cpu_ram_used_mb": 1024.5,
             "gpu_ram_used_mb": 8192.3, "gpu_ram_peak_mb": 8500.1,
             "reserved_gpu_ram_mb": 10240.0}
          ],
          "peak_usage": {"cpu_ram_used_mb": 1200.0, "gpu_ram_used_mb": 10240.0,
                         "gpu_ram_peak_mb": 12000.0, "reserved_gpu_ram_mb": 14000.0}
        }"#;
        let doc: Document = serde_json::from_str(bare).unwrap();
        assert_eq!(doc.schema, 0);
        assert_eq!(doc.detailed_log[0].component, "model");
        assert_eq!(doc.detailed_log[0].gpu_source, GpuSource::None);
        assert_eq!(doc.peak_usage.figures.gpu_ram_peak_mb, 12000.0);
    }

    #[test]
    fn peaks_fold_is_an_elementwise_max() {
        let mut p = Peaks::default();
        let a = Entry {
            figures: Figures {
                cpu_ram_used_mb: 10.0,
                gpu_ram_used_mb: 5.0,
                ..Figures::default()
            },
            ..Entry::default()
        };
        let b = Entry {
            figures: Figures {
                cpu_ram_used_mb: 3.0,
                gpu_ram_used_mb: 9.0,
                ..Figures::default()
            },
            ..Entry::default()
        };
        p.observe(&a);
        p.observe(&b);
        assert_eq!(
            (
                p.figures.cpu_ram_used_mb,
                p.figures.gpu_ram_used_mb,
                p.samples
            ),
            (10.0, 9.0, 2)
        );
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(Exit::signal(9).code, 137);
        assert_eq!(Exit::from_wait_status(7 << 8), Exit::code(7));
        assert_eq!(Exit::from_wait_status(libc::SIGKILL), Exit::signal(9));
    }

    #[test]
    fn absorb_max_keeps_each_figures_maximum_and_nothing_else() {
        let mut a = Entry {
            operation: "a".into(),
            figures: Figures {
                cpu_ram_used_mb: 10.0,
                gpu_ram_used_mb: 5.0,
                gpu_ram_peak_mb: f64::NAN,
                reserved_gpu_ram_mb: 7.0,
                gpu_process_used_mb: 1.0,
                cpu_ram_hwm_mb: 30.0,
            },
            ..Entry::default()
        };
        let b = Entry {
            operation: "b".into(),
            timestamp: 9.0,
            figures: Figures {
                cpu_ram_used_mb: 20.0,
                gpu_ram_used_mb: 1.0,
                gpu_ram_peak_mb: 3.0,
                reserved_gpu_ram_mb: 7.0,
                gpu_process_used_mb: 2.0,
                cpu_ram_hwm_mb: 25.0,
            },
            ..Entry::default()
        };
        a.absorb_max(&b);
        assert_eq!(a.figures.as_array(), [20.0, 5.0, 3.0, 7.0, 2.0, 30.0]);
        assert_eq!((a.operation.as_str(), a.timestamp), ("a", 0.0));
        let mut p = Peaks::default();
        p.observe(&a);
        p.observe_weighted(&b, 4);
        assert_eq!(p.figures, a.figures);
        assert_eq!(p.samples, 5);
        let mut q = Peaks {
            figures: Figures {
                cpu_ram_used_mb: 99.0,
                ..Figures::default()
            },
            samples: 1,
        };
        q.merge(&p);
        assert_eq!(q.figures.as_array(), [99.0, 5.0, 3.0, 7.0, 2.0, 30.0]);
        assert_eq!(q.samples, 6);
    }
}
