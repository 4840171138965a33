//! Samplers: what memory the followed processes hold right now.
//!
//! [`Sampler`] combines the procfs reader (host RSS and high-water marks of
//! the process tree), the tree's footprint (every page once: a memory
//! cgroup, or Σ Pss), a [`gpu::GpuSampler`] (NVML or none) and host
//! totals, and fills one reusable [`Sample`]. It knows nothing about peaks,
//! logs or exporters: the store folds samples into state.

pub mod cgroup;
pub(crate) mod cost;
pub mod footprint;
pub(crate) mod frames;
pub mod gpu;
pub mod host;
pub mod nvml;
pub(crate) mod own;
pub(crate) mod pages;
pub(crate) mod parse;
pub mod pidns;
pub mod procfs;
pub(crate) mod pss;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::units::unix_now;
use gpu::GpuConfig;

pub(crate) use host::HostSample;
pub(crate) use procfs::ProcTree;

/// Host-wide memory (bytes) from `/proc/meminfo`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    pub(crate) total: u64,
    pub(crate) available: u64,
}

/// Parses `MemTotal` and `MemAvailable` from `/proc/meminfo`.
pub(crate) fn parse_meminfo(text: &str) -> Option<HostMemory> {
    let mut total = None;
    let mut available = None;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let kib = || {
            v.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
                .map(|x| x * 1024)
        };
        match k {
            "MemTotal" => total = kib(),
            "MemAvailable" => available = kib(),
            _ => {}
        }
    }
    Some(HostMemory {
        total: total?,
        available: available?,
    })
}

/// One sample of the tree, the GPUs and the host. It is also what the
/// journal records, so replaying a journal re-runs the same fold.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    #[serde(skip, default = "Instant::now")]
    pub(crate) at: Instant,
    /// Unix seconds when the sample started.
    pub(crate) timestamp: f64,
    pub host: HostSample,
    pub(crate) gpu: gpu::GpuSample,
    pub(crate) gpu_status: gpu::Status,
    pub(crate) memory: HostMemory,
    /// The footprint's source, when it was chosen or changed with this
    /// sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) host_source: Option<footprint::SourceInfo>,
    /// Wall time the sample took.
    #[serde(skip)]
    pub(crate) took: Duration,
}

impl Default for Sample {
    fn default() -> Self {
        Sample {
            at: Instant::now(),
            timestamp: 0.0,
            host: HostSample::default(),
            gpu: gpu::GpuSample::default(),
            gpu_status: gpu::Status::Unavailable,
            memory: HostMemory::default(),
            host_source: None,
            took: Duration::ZERO,
        }
    }
}

/// How often host totals are re-read.
const MEMINFO_EVERY: Duration = Duration::from_secs(1);

/// Takes samples of one process tree.
pub struct Sampler {
    tree: ProcTree,
    footprint: footprint::FootprintReader,
    gpu: Box<dyn gpu::GpuSampler>,
    meminfo: Option<File>,
    meminfo_at: Option<Instant>,
    memory: HostMemory,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("tree", &self.tree)
            .field("gpu", &self.gpu.backend())
            .finish()
    }
}

impl Sampler {
    pub fn new(
        tree: ProcTree,
        footprint: footprint::FootprintReader,
        gpu: Box<dyn gpu::GpuSampler>,
        meminfo: Option<File>,
    ) -> Sampler {
        Sampler {
            tree,
            footprint,
            gpu,
            meminfo,
            meminfo_at: None,
            memory: HostMemory::default(),
            buf: vec![0; 8192],
        }
    }

    /// Fills `out` with a fresh sample (its buffers are reused).
    pub fn sample(&mut self, out: &mut Sample) {
        self.take(out, true);
    }

    /// A sample taken at a mark: the same, except that GPU figures which
    /// change slowly or rarely repeat the last tick's
    /// ([`gpu::GpuSampler::sample_memory`]), so the job waiting for its
    /// acknowledgement pays only for the memory figures.
    pub(crate) fn sample_at_mark(&mut self, out: &mut Sample) {
        self.take(out, false);
    }

    fn take(&mut self, out: &mut Sample, full_gpu: bool) {
        let started = Instant::now();
        out.at = started;
        out.timestamp = unix_now();
        out.host.clear();
        out.gpu.clear();
        self.tree.sample(started, &mut out.host);
        self.footprint
            .sample(started, out.timestamp, &mut self.tree, &mut out.host);
        out.host_source = self.footprint.take_change().map(|mut info| {
            if info.since == 0.0 {
                info.since = out.timestamp;
            }
            info
        });
        out.gpu_status = if full_gpu {
            self.gpu.sample(&mut out.gpu)
        } else {
            self.gpu.sample_memory(&mut out.gpu)
        };
        if self
            .meminfo_at
            .is_none_or(|t| started.duration_since(t) >= MEMINFO_EVERY)
        {
            if let Some(f) = &self.meminfo {
                if let Ok(n) = f.read_at(&mut self.buf, 0) {
                    if let Some(m) = std::str::from_utf8(&self.buf[..n])
                        .ok()
                        .and_then(parse_meminfo)
                    {
                        self.memory = m;
                    }
                }
            }
            self.meminfo_at = Some(started);
        }
        out.memory = self.memory;
        out.took = started.elapsed();
    }

    /// The cheap read between samples (the OOM flight recorder's): each
    /// followed process's RSS from `statm` and NVML's memory figures, no
    /// discovery. `gpu` is cleared first; false when it holds no figures.
    pub(crate) fn peek(&mut self, rss: &mut Vec<(u32, u64)>, gpu: &mut gpu::GpuSample) -> bool {
        self.tree.peek(rss);
        gpu.clear();
        self.gpu.sample_memory(gpu) == gpu::Status::Sampled
    }

    /// Whether `pid` is one of the followed processes.
    pub(crate) fn follows(&self, pid: u32) -> bool {
        self.tree.contains(pid)
    }

    /// Follows `pid` and its descendants from now on.
    pub(crate) fn follow(&mut self, pid: u32) -> Result<(), procfs::RootError> {
        self.tree.add_root(pid)
    }

    /// Whether every followed process has exited.
    pub(crate) fn all_gone(&self) -> bool {
        self.tree.is_empty()
    }

    /// Re-reads every process's high-water mark (before the last sample).
    pub(crate) fn refresh_high_water_marks(&mut self) {
        self.tree.refresh_hwm_all();
    }

    /// The procfs root the tree is read from.
    pub(crate) fn proc_root(&self) -> &std::path::Path {
        self.tree.root()
    }

    /// The file with the job's own OOM-kill counter, when the footprint is
    /// a memory cgroup.
    pub(crate) fn oom_counter(&self) -> Option<std::path::PathBuf> {
        self.footprint.oom_counter()
    }

    /// Reads done off the sampling thread (own cost, page or Σ Pss passes)
    /// and their CPU time.
    pub fn pss_cost(&self) -> (u64, Duration) {
        self.tree.cost().cost()
    }
}

/// Chooses the GPU sampler for a run. Never fails: every problem becomes
/// host-only mode with the reason (logged once by the caller). memtrack's
/// PID namespace is read through `proc_root`, to know whether NVML's host
/// PIDs are the tree's.
pub(crate) fn open_gpu(
    config: &GpuConfig,
    cuda_visible: Option<&str>,
    proc_root: &std::path::Path,
) -> Box<dyn gpu::GpuSampler> {
    if !config.enabled {
        return Box::new(gpu::NoGpu {
            reason: "disabled by configuration".into(),
        });
    }
    let visible = gpu::visible_devices(cuda_visible);
    if matches!(&visible, Some(v) if v.is_empty()) {
        return Box::new(gpu::NoGpu {
            reason: "CUDA_VISIBLE_DEVICES hides every GPU".into(),
        });
    }
    let lib =
        (!config.nvml_library.as_os_str().is_empty()).then_some(config.nvml_library.as_path());
    match nvml::NvmlSampler::open(lib, &visible) {
        Ok(s) => {
            let (pids, attribution) = pidns::plan(proc_root, &config.host_proc);
            Box::new(s.with_pids(pids, attribution))
        }
        Err(reason) => Box::new(gpu::NoGpu {
            reason: reason.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo() {
        let m =
            parse_meminfo("MemTotal:  1000 kB\nMemFree: 10 kB\nMemAvailable:  600 kB\n").unwrap();
        assert_eq!(
            m,
            HostMemory {
                total: 1000 * 1024,
                available: 600 * 1024
            }
        );
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn disabled_and_hidden_mean_host_only() {
        let mut cfg = GpuConfig {
            enabled: false,
            ..GpuConfig::default()
        };
        assert!(open_gpu(&cfg, None, std::path::Path::new("/proc"))
            .backend()
            .to_string()
            .starts_with("none: disabled"));
        cfg.enabled = true;
        assert!(open_gpu(&cfg, Some(""), std::path::Path::new("/proc"))
            .backend()
            .to_string()
            .contains("CUDA_VISIBLE_DEVICES"));
        cfg.nvml_library = "/nonexistent/libnvidia-ml.so.1".into();
        let s = open_gpu(&cfg, None, std::path::Path::new("/proc"));
        assert!(
            s.backend()
                .to_string()
                .starts_with("none: no NVIDIA driver"),
            "{}",
            s.backend()
        );
        assert!(s.devices().is_empty());
    }
}
