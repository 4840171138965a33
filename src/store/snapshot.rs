//! What exporters see: an immutable picture of the run after the latest
//! sample. The engine builds it from the store and publishes it on a
//! `watch` channel (at most every 100 ms, and once more at the end); the
//! HTTP server and other readers clone an `Arc` and never touch the store,
//! so a scrape cannot block or slow sampling.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::pressure::Level;
use crate::model::leak::LeakReport;
use crate::model::{
    Allocator, Counters, Gpu, GpuAttribution, GpuBackend, GpuSource, HostSource, Peaks, Summary,
};
use crate::sample::HostMemory;

/// The tree's figures after the latest sample (MiB).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Current {
    pub(crate) timestamp: f64,
    /// The tree's host memory, every page once: the document's headline
    /// name. The `status` reply also gives it as `cpu_rss_mb`, its name
    /// before, for readers that know only that.
    #[serde(rename = "cpu_ram_used_mb", alias = "cpu_rss_mb")]
    pub(crate) cpu_used_mb: f64,
    /// The tree's peak since the previous sample.
    pub(crate) cpu_hwm_mb: f64,
    /// The job's memory cgroup's charge less cold page cache, and its
    /// peak since the previous sample (absent without such a cgroup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) charge_mb: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) charge_hwm_mb: Option<f64>,
    /// Where `cpu_used_mb` comes from.
    #[serde(default)]
    pub(crate) host_source: HostSource,
    pub(crate) gpu_tree_mb: f64,
    /// Highest `gpu_tree_mb` so far: the NVML stand-in for
    /// `max_memory_allocated`.
    pub(crate) gpu_tree_peak_mb: f64,
    pub(crate) gpu_source: GpuSource,
    pub(crate) processes: usize,
}

/// Identity of the run, carried as labels by every metric.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct RunMeta {
    pub id: String,
    pub name: String,
    pub host: String,
    pub mode: String,
    pub start: f64,
    pub interval_s: f64,
    pub gpu_backend: GpuBackend,
    pub labels: BTreeMap<String, String>,
}

/// A live process of the tree (bytes).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ProcessNow {
    pub pid: u32,
    pub ppid: u32,
    pub name: String,
    pub root: bool,
    pub rss_bytes: u64,
    pub hwm_bytes: u64,
    pub peak_rss_bytes: u64,
    /// NVML used memory per device index.
    pub gpu_bytes: BTreeMap<u32, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pss_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uss_bytes: Option<u64>,
    /// `pss_bytes` and `uss_bytes` are an estimate (no read reached it
    /// since it grew: its last read plus what it wrote since), not a read.
    pub own_estimated: bool,
}

/// The latest allocator figures a process sent.
#[derive(Debug, Clone, Copy, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct AllocatorNow {
    pub(crate) pid: u32,
    pub(crate) timestamp: f64,
    #[serde(flatten)]
    pub(crate) figures: Allocator,
}

/// A fixed-bucket histogram (seconds), cumulative like Prometheus's.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Histogram {
    pub(crate) bounds: &'static [f64],
    /// Observations `<= bounds[i]` (cumulative); the last is +Inf.
    pub(crate) cumulative: Vec<u64>,
    pub(crate) sum: f64,
    pub(crate) count: u64,
}

/// Tick-duration bucket bounds: 10 µs … 1 s.
pub(crate) const TICK_BUCKETS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            cumulative: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.cumulative[i] += 1;
            }
        }
        if let Some(inf) = self.cumulative.last_mut() {
            *inf += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new(TICK_BUCKETS)
    }
}

/// The run as exporters see it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Snapshot {
    /// Records applied so far.
    pub seq: u64,
    pub run: RunMeta,
    pub current: Current,
    pub peaks: Peaks,
    pub by_component: BTreeMap<String, Peaks>,
    pub processes: Vec<ProcessNow>,
    pub gpus: Vec<Gpu>,
    /// Whose memory the GPU figures are (absent without NVML).
    pub gpu_attribution: Option<GpuAttribution>,
    pub allocator: Vec<AllocatorNow>,
    /// Events recorded per component and operation.
    pub events: BTreeMap<String, BTreeMap<String, u64>>,
    pub levels: BTreeMap<String, Level>,
    pub open_spans: Vec<String>,
    pub open_stages: Vec<String>,
    pub host_memory: HostMemory,
    pub counters: Counters,
    /// Whether NVML answered at the latest sample (false without a GPU).
    pub nvml_up: bool,
    pub tick_seconds: Histogram,
    /// Failures of each exporter (`checkpoint`, `clearml`, `s3`).
    pub export_errors: BTreeMap<String, u64>,
    pub finished: bool,
    /// The leak rule's latest verdicts (the engine refreshes them every
    /// few seconds: they cost milliseconds); `None` before the first.
    pub leak: Option<LeakReport>,
    /// What a re-run needs, as of this snapshot.
    pub needs: Summary,
    /// Time to OOM: the resources climbing towards their limit.
    pub forecasts: Vec<Forecast>,
}

/// A live forecast: at this rate `resource` reaches its limit in
/// `seconds`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Forecast {
    /// `host` or `gpu<index>`.
    pub resource: String,
    pub seconds: f64,
    pub rate_mib_per_s: f64,
    /// The figure now and the limit, MiB.
    pub used_mb: f64,
    pub limit_mb: f64,
    /// What the limit is: `memory_limit` (the job's cgroup limit),
    /// `host_available` (the host's available memory), `gpu_total`.
    pub limit: String,
    /// The sentence a person reads.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.5, 3.0] {
            h.observe(v);
        }
        assert_eq!(h.cumulative, vec![1, 3, 4]);
        assert_eq!((h.count, h.sum), (4, 6.5));
    }
}
