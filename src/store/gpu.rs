//! GPUs: each device's static description, its figures and peaks, and
//! the GPU memory of the tree's own processes, per process and per device
//! (other processes on the same GPU never count). When NVML's PIDs could
//! not be matched to the tree's (a device-level sample), the tree's figure
//! per device is the device's used memory, and the run's
//! [`GpuAttribution`] says so.

use std::collections::BTreeMap;

use crate::model::{Gpu, GpuAttribution};
use crate::sample::gpu::{Device, Status as GpuStatus};
use crate::sample::Sample;
use crate::units::mib;

/// The GPUs' state: each device's row, how the tree's share is told
/// apart, and whether NVML answered the latest sample.
#[derive(Debug, Clone, Default)]
pub(super) struct GpuState {
    pub(super) devices: BTreeMap<u32, Gpu>,
    /// How the tree's GPU memory is told apart (absent without NVML).
    pub(super) attribution: Option<GpuAttribution>,
    pub(super) nvml_up: bool,
}

/// GPU memory of the tree in one sample, in bytes.
#[derive(Debug, Default)]
pub(super) struct TreeGpu {
    pub(super) by_device: BTreeMap<u32, u64>,
    pub(super) by_pid: BTreeMap<u32, u64>,
    /// Each process's use of each device: `(pid, device, bytes)`.
    pub(super) by_process: Vec<(u32, u32, u64)>,
}

impl GpuState {
    /// Records the GPUs' static description (index, UUID, name) and how
    /// the tree's share of them is told apart.
    pub(super) fn describe(&mut self, devices: &[Device], attribution: Option<GpuAttribution>) {
        self.attribution = attribution;
        for d in devices {
            let g = self.row(d.index);
            g.uuid.clone_from(&d.uuid);
            g.name.clone_from(&d.name);
        }
    }

    fn row(&mut self, index: u32) -> &mut Gpu {
        self.devices.entry(index).or_insert_with(|| Gpu {
            index,
            ..Gpu::default()
        })
    }

    /// The tree's GPU memory in a sample, per device, per process and per
    /// both, counting only the processes `followed` says are the tree's;
    /// notes whether NVML answered and counts its errors in
    /// `nvml_errors`.
    pub(super) fn tree_share(
        &mut self,
        sample: &Sample,
        followed: impl Fn(u32) -> bool,
        nvml_errors: &mut u64,
    ) -> TreeGpu {
        if let GpuStatus::Error(_) = sample.gpu_status {
            *nvml_errors += 1;
        }
        self.nvml_up = sample.gpu_status == GpuStatus::Sampled;
        let mut tree = TreeGpu::default();
        if sample.gpu_status == GpuStatus::Sampled {
            if let Some(a) = &mut self.attribution {
                a.count(sample.gpu.device_level);
            }
            if sample.gpu.device_level {
                // Whole devices, labelled: no process's share is known.
                for d in &sample.gpu.devices {
                    tree.by_device.insert(d.index, d.used);
                }
                return tree;
            }
        }
        for p in sample.gpu.processes.iter().filter(|p| followed(p.pid)) {
            let used = p.used.unwrap_or(0);
            *tree.by_device.entry(p.device).or_default() += used;
            *tree.by_pid.entry(p.pid).or_default() += used;
            tree.by_process.push((p.pid, p.device, used));
        }
        tree
    }

    /// Folds each device's reading (and the tree's share of it,
    /// `tree_by_device`) into its row and peaks.
    pub(super) fn fold_devices(&mut self, sample: &Sample, tree_by_device: &BTreeMap<u32, u64>) {
        for d in &sample.gpu.devices {
            let g = self.row(d.index);
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
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use crate::model::{AttributionMode, GpuAttribution, GpuSource};
    use crate::sample::gpu::{Device, Status};

    #[test]
    fn devices_keep_their_description_figures_and_peaks() {
        let mut st = store();
        st.describe_gpus(
            &[Device {
                index: 0,
                uuid: "GPU-1".into(),
                name: "H100".into(),
            }],
            None,
        );
        let mut s = sample(101.0, &[(10, 100)], &[(10, 3000)]);
        join(&mut s, 10);
        s.gpu.devices[0].utilization_pct = Some(90);
        s.gpu.devices[0].temperature_c = Some(70);
        timer(&mut st, s);
        let mut s = sample(102.0, &[(10, 100)], &[(10, 1000)]);
        s.gpu.devices[0].utilization_pct = Some(20);
        timer(&mut st, s);
        let g = st.gpus().next().unwrap();
        assert_eq!((g.uuid.as_str(), g.name.as_str()), ("GPU-1", "H100"));
        assert_eq!((g.used_mb, g.peak_used_mb), (1000.0, 3000.0));
        assert_eq!((g.tree_used_mb, g.peak_tree_used_mb), (1000.0, 3000.0));
        assert_eq!((g.utilization_pct, g.peak_utilization_pct), (20.0, 90.0));
        assert_eq!(
            (g.temperature_c, g.peak_temperature_c),
            (70.0, 70.0),
            "no reading keeps the last"
        );
        let t = &st.document().targets[0];
        assert_eq!((t.last_gpu_mb, t.peak_gpu_mb), (1000.0, 3000.0));
        assert_eq!(t.peak_gpu_mb_by_device[&0], 3000.0);
    }

    #[test]
    fn a_device_level_sample_is_the_devices_use_labelled_and_no_process_share() {
        let mut st = store();
        let start = GpuAttribution {
            mode: AttributionMode::DeviceLevel,
            ..GpuAttribution::default()
        };
        st.describe_gpus(&[], Some(start));
        // Per-process first: only pid 10 counts, not the stranger (99).
        let mut s = sample(101.0, &[(10, 100)], &[(10, 1000), (99, 4000)]);
        join(&mut s, 10);
        timer(&mut st, s);
        assert_eq!(st.current().gpu_tree_mb, 1000.0);
        // Then NVML's PIDs cannot be matched: the device's 5000, labelled.
        let mut s = sample(102.0, &[(10, 100)], &[(10, 1000), (99, 4000)]);
        s.gpu.processes.clear();
        s.gpu.device_level = true;
        timer(&mut st, s);
        assert_eq!(st.current().gpu_tree_mb, 5000.0);
        assert_eq!(st.current().gpu_source, GpuSource::Device);
        let doc = st.document();
        let a = doc.gpu_attribution.as_ref().unwrap();
        assert_eq!(
            (a.mode, a.per_process_samples, a.device_level_samples),
            (AttributionMode::Mixed, 1, 1)
        );
        assert_eq!(doc.gpus[0].peak_tree_used_mb, 5000.0);
        assert_eq!(doc.targets[0].last_gpu_mb, 0.0, "no process share");
        assert_eq!(doc.targets[0].peak_gpu_mb, 1000.0);
        assert_eq!(
            doc.detailed_log.last().unwrap().gpu_source,
            GpuSource::Device
        );
    }

    #[test]
    fn an_nvml_error_is_counted_and_leaves_the_tree_without_gpu_figures() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100)], &[]);
        s.gpu_status = Status::Error("busy".into());
        s.gpu.processes.clear();
        timer(&mut st, s);
        assert_eq!(st.counters().nvml_errors, 1);
        assert_eq!(st.current().gpu_source, crate::model::GpuSource::None);
        assert!(!st.snapshot().nvml_up);
    }
}
