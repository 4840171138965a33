//! GPU memory behind one small trait, so the rest of memtrack never knows
//! whether NVML is there.
//!
//! The contract: each call either fills a sample, reports "no GPU" (the
//! reason was logged once when the sampler was chosen), or reports an error
//! for this sample only. An error degrades that sample to host-only figures
//! and is counted; it never stops sampling. `crate::sample::open_gpu`
//! picks the NVML sampler when it can, else [`NoGpu`] with a one-line
//! reason.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::model::{GpuAttribution, GpuBackend};

/// GPU (NVML) sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuConfig {
    /// `false` forces host-only mode.
    pub(crate) enabled: bool,
    /// NVML shared library to load. Empty: the system's `libnvidia-ml.so.1`.
    pub(crate) nvml_library: PathBuf,
    /// A procfs of the host (e.g. `/host/proc`), for a memtrack inside a
    /// PID namespace: NVML lists host PIDs, and this maps them to the
    /// tree's. Empty: none, and inside a PID namespace the GPU figures are
    /// device-level.
    pub(crate) host_proc: PathBuf,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            enabled: true,
            nvml_library: PathBuf::new(),
            host_proc: PathBuf::new(),
        }
    }
}

/// A GPU as described once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub index: u32,
    pub uuid: String,
    pub name: String,
}

/// One device's figures (bytes, percent, °C).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct DeviceReading {
    pub(crate) index: u32,
    pub(crate) used: u64,
    pub(crate) free: u64,
    pub(crate) total: u64,
    pub(crate) utilization_pct: Option<u32>,
    pub(crate) memory_utilization_pct: Option<u32>,
    pub(crate) temperature_c: Option<u32>,
}

/// One process's memory on one device. `used: None` is NVML's
/// `UsedGpuMemory::Unavailable` (e.g. without permission).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ProcessReading {
    pub(crate) pid: u32,
    pub(crate) device: u32,
    pub(crate) used: Option<u64>,
}

/// The GPU part of one sample.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GpuSample {
    pub(crate) devices: Vec<DeviceReading>,
    /// Processes by the tree's PIDs (NVML's host PIDs mapped when memtrack
    /// runs in a PID namespace); empty when `device_level`.
    pub(crate) processes: Vec<ProcessReading>,
    /// NVML's PIDs could not be matched to the tree's: the job's figure
    /// is its devices' used memory.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) device_level: bool,
}

impl GpuSample {
    pub fn clear(&mut self) {
        self.devices.clear();
        self.processes.clear();
        self.device_level = false;
    }
}

/// Outcome of one GPU read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Status {
    Sampled,
    /// No GPU in this run (already reported once).
    Unavailable,
    /// This sample has no GPU figures; the next one tries again.
    Error(String),
}

/// A source of GPU figures.
pub trait GpuSampler: Send {
    /// `nvml` or `none: <reason>`, recorded in `run.gpu_backend`.
    fn backend(&self) -> GpuBackend;
    /// The devices this sampler reports on.
    fn devices(&self) -> &[Device];
    /// How the tree's GPU memory is told apart from other processes'
    /// (`None` without GPU figures).
    fn attribution(&self) -> Option<GpuAttribution> {
        None
    }
    /// Fills `out` (cleared first by the caller).
    fn sample(&mut self, out: &mut GpuSample) -> Status;
    /// Fills `out` for a read between ticks (a mark, the flight
    /// recorder): memory figures read now, while what changes slowly or
    /// rarely matters there (utilization, temperature, graphics contexts)
    /// may repeat the last [`GpuSampler::sample`]'s.
    fn sample_memory(&mut self, out: &mut GpuSample) -> Status {
        self.sample(out)
    }
}

/// Host-only mode: GPU figures are 0 and `gpu_source` is `none`.
#[derive(Debug, Clone)]
pub struct NoGpu {
    pub reason: String,
}

impl GpuSampler for NoGpu {
    fn backend(&self) -> GpuBackend {
        GpuBackend::None {
            reason: self.reason.clone(),
        }
    }

    fn devices(&self) -> &[Device] {
        &[]
    }

    fn sample(&mut self, _out: &mut GpuSample) -> Status {
        Status::Unavailable
    }
}

/// Which devices `CUDA_VISIBLE_DEVICES` leaves visible: `None` when unset
/// (all), `Some(vec![])` when set to the empty string (host-only mode).
/// Entries are indices (`0,2`) or UUID prefixes (`GPU-8f3a`).
pub(crate) fn visible_devices(var: Option<&str>) -> Option<Vec<String>> {
    let v = var?;
    Some(
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .take_while(|s| *s != "-1")
            .map(str::to_string)
            .collect(),
    )
}

/// Whether `device` is selected by a `CUDA_VISIBLE_DEVICES` entry list.
pub(crate) fn is_visible(device: &Device, visible: &Option<Vec<String>>) -> bool {
    match visible {
        None => true,
        Some(list) => list.iter().any(|e| match e.parse::<u32>() {
            Ok(i) => i == device.index,
            Err(_) => device.uuid.starts_with(e.as_str()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_visible_devices_forms() {
        assert_eq!(visible_devices(None), None);
        assert_eq!(visible_devices(Some("")), Some(vec![]));
        assert_eq!(
            visible_devices(Some("0,2")),
            Some(vec!["0".into(), "2".into()])
        );
        assert_eq!(visible_devices(Some("1,-1,2")), Some(vec!["1".into()]));
        let d = Device {
            index: 2,
            uuid: "GPU-8f3a-11".into(),
            name: "x".into(),
        };
        assert!(is_visible(&d, &visible_devices(Some("0,2"))));
        assert!(!is_visible(&d, &visible_devices(Some("0"))));
        assert!(is_visible(&d, &visible_devices(Some("GPU-8f3a"))));
        assert!(is_visible(&d, &None));
    }
}
