//! GPU figures from NVML through nvml-wrapper, loaded at run time.
//!
//! Per tick and visible device: memory info, utilization, temperature, and
//! the compute and graphics process lists (a process on both lists is
//! counted once, with the larger figure). Per-process utilization is not
//! read: on an H100 it costs far more than the rest of a tick together
//! (measured once by hand; no bench in the repository repeats it). Between
//! ticks (at a mark, for the flight recorder) only memory info and the
//! compute list are read; utilization, temperature and graphics contexts
//! repeat the last tick's.
//!
//! NVML lists processes by host PID. Inside a PID namespace they are turned
//! into the tree's PIDs through a `PidMap`, or, when that cannot be done,
//! left out and the sample marked device-level.

use std::collections::HashMap;
use std::path::Path;

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use super::gpu::{
    is_visible, Device, DeviceReading, GpuSample, GpuSampler, ProcessReading, Status,
};
use super::pidns::{PidMap, PidOwner};
use crate::model::GpuAttribution;

/// The NVML-backed sampler.
pub struct NvmlSampler {
    nvml: Nvml,
    devices: Vec<Device>,
    per_pid: HashMap<(u32, u32), Option<u64>>,
    /// The last tick's slow figures, by position in `devices`.
    slow: Vec<Slow>,
    /// The last tick's graphics contexts: (pid, device) → used.
    graphics: Vec<(u32, u32, Option<u64>)>,
    /// Whether `slow` and `graphics` hold a read yet.
    read_once: bool,
    pids: PidMap,
    attribution: Option<GpuAttribution>,
}

impl std::fmt::Debug for NvmlSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSampler")
            .field("devices", &self.devices)
            .finish()
    }
}

/// Why NVML gives no GPU figures (the reason for host-only mode).
#[derive(Debug, thiserror::Error)]
pub enum NoNvml {
    #[error("no NVIDIA driver library ({what} cannot be loaded)")]
    NoLibrary { what: String, source: NvmlError },
    #[error("the NVIDIA driver is not loaded")]
    NoDriver,
    #[error("NVML ({what}) failed to start: {source}")]
    Start { what: String, source: NvmlError },
    #[error("NVML cannot count devices: {0}")]
    Count(#[source] NvmlError),
    #[error("NVML cannot open device {index}: {source}")]
    Device { index: u32, source: NvmlError },
    #[error("NVML reports no GPU")]
    NoGpu,
    #[error("CUDA_VISIBLE_DEVICES matches none of the {0} GPUs")]
    NoneVisible(u32),
}

impl NvmlSampler {
    /// Loads NVML and lists the visible devices. The error is the one-line
    /// reason for host-only mode.
    pub fn open(lib: Option<&Path>, visible: &Option<Vec<String>>) -> Result<NvmlSampler, NoNvml> {
        let mut builder = Nvml::builder();
        if let Some(lib) = lib {
            builder.lib_path(lib.as_os_str());
        }
        let nvml = builder.init().map_err(|source| {
            let what = lib.map_or_else(
                || "libnvidia-ml.so.1".to_string(),
                |p| p.display().to_string(),
            );
            match source {
                NvmlError::LibloadingError(_) => NoNvml::NoLibrary { what, source },
                NvmlError::DriverNotLoaded => NoNvml::NoDriver,
                source => NoNvml::Start { what, source },
            }
        })?;
        let count = nvml.device_count().map_err(NoNvml::Count)?;
        let mut devices = Vec::new();
        for index in 0..count {
            let d = nvml
                .device_by_index(index)
                .map_err(|source| NoNvml::Device { index, source })?;
            let device = Device {
                index,
                uuid: d.uuid().unwrap_or_default(),
                name: d.name().unwrap_or_else(|_| "unknown GPU".into()),
            };
            if is_visible(&device, visible) {
                devices.push(device);
            }
        }
        if devices.is_empty() {
            return Err(if count == 0 {
                NoNvml::NoGpu
            } else {
                NoNvml::NoneVisible(count)
            });
        }
        Ok(NvmlSampler {
            nvml,
            slow: vec![Slow::default(); devices.len()],
            devices,
            per_pid: HashMap::new(),
            graphics: Vec::new(),
            read_once: false,
            pids: PidMap::Same,
            attribution: None,
        })
    }

    /// Sets how NVML's PIDs become the tree's, and the attribution the
    /// run starts with.
    pub(crate) fn with_pids(mut self, pids: PidMap, attribution: GpuAttribution) -> NvmlSampler {
        self.pids = pids;
        self.attribution = Some(attribution);
        self
    }

    /// Moves the processes read into `out`, by the tree's PIDs.
    fn push_processes(&mut self, out: &mut GpuSample) {
        let readings = self
            .per_pid
            .iter()
            .map(|(&(pid, device), &used)| ProcessReading { pid, device, used });
        match &mut self.pids {
            PidMap::Same => out.processes.extend(readings),
            PidMap::Unmappable => out.device_level = true,
            PidMap::Host(map) => {
                for mut r in readings {
                    match map.resolve(r.pid) {
                        PidOwner::Ours(pid) => {
                            r.pid = pid;
                            out.processes.push(r);
                        }
                        PidOwner::Foreign => {}
                        PidOwner::Unknown => out.device_level = true,
                    }
                }
                if out.device_level {
                    out.processes.clear();
                }
            }
        }
    }
}

impl GpuSampler for NvmlSampler {
    fn backend(&self) -> crate::model::GpuBackend {
        crate::model::GpuBackend::Nvml
    }

    fn devices(&self) -> &[Device] {
        &self.devices
    }

    fn attribution(&self) -> Option<GpuAttribution> {
        self.attribution.clone()
    }

    fn sample(&mut self, out: &mut GpuSample) -> Status {
        self.read(out, true)
    }

    fn sample_memory(&mut self, out: &mut GpuSample) -> Status {
        self.read(out, false)
    }
}

/// What a tick reads and a read between ticks repeats.
#[derive(Debug, Clone, Copy, Default)]
struct Slow {
    utilization_pct: Option<u32>,
    memory_utilization_pct: Option<u32>,
    temperature_c: Option<u32>,
}

impl NvmlSampler {
    /// One read of every visible device; `full`: the slow figures and the
    /// graphics list too, else the last tick's.
    fn read(&mut self, out: &mut GpuSample, full: bool) -> Status {
        let full = full || !self.read_once;
        self.read_once = true;
        self.per_pid.clear();
        if full {
            self.graphics.clear();
        }
        for (at, device) in self.devices.iter().enumerate() {
            let d = match self.nvml.device_by_index(device.index) {
                Ok(d) => d,
                Err(e) => return Status::Error(format!("GPU {}: {e}", device.index)),
            };
            let memory = match d.memory_info() {
                Ok(m) => m,
                Err(e) => return Status::Error(format!("GPU {} memory: {e}", device.index)),
            };
            if full {
                let utilization = d.utilization_rates().ok();
                self.slow[at] = Slow {
                    utilization_pct: utilization.as_ref().map(|u| u.gpu),
                    memory_utilization_pct: utilization.as_ref().map(|u| u.memory),
                    temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
                };
            }
            let slow = self.slow[at];
            out.devices.push(DeviceReading {
                index: device.index,
                used: memory.used,
                free: memory.free,
                total: memory.total,
                utilization_pct: slow.utilization_pct,
                memory_utilization_pct: slow.memory_utilization_pct,
                temperature_c: slow.temperature_c,
            });
            let compute = match d.running_compute_processes() {
                Ok(p) => p,
                Err(e) => return Status::Error(format!("GPU {} processes: {e}", device.index)),
            };
            for p in compute {
                merge(
                    &mut self.per_pid,
                    p.pid,
                    device.index,
                    used(&p.used_gpu_memory),
                );
            }
            // Graphics contexts are rare on compute nodes and the call is
            // unsupported on some boards: its failure is not an error.
            if full {
                for p in d.running_graphics_processes().unwrap_or_default() {
                    self.graphics
                        .push((p.pid, device.index, used(&p.used_gpu_memory)));
                }
            }
        }
        for &(pid, device, used) in &self.graphics {
            merge(&mut self.per_pid, pid, device, used);
        }
        self.push_processes(out);
        Status::Sampled
    }
}

fn used(u: &UsedGpuMemory) -> Option<u64> {
    match u {
        UsedGpuMemory::Used(b) => Some(*b),
        UsedGpuMemory::Unavailable => None,
    }
}

/// A process on both lists is counted once, with the larger figure.
fn merge(per_pid: &mut HashMap<(u32, u32), Option<u64>>, pid: u32, device: u32, used: Option<u64>) {
    let slot = per_pid.entry((pid, device)).or_insert(used);
    *slot = match (*slot, used) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
}
