//! The host: the footprint source the sampler chose (and the ones before
//! it), what that source saw (cgroup breakdown at the peak, PSS reads),
//! the machine's memory, and the tree's current figures each sample.

use super::snapshot::Current;
use super::state::Store;
use crate::model::{CgroupBreakdown, GpuSource, HostInfo, HostSource, HostSourceChange};
use crate::sample::footprint::SourceInfo;
use crate::sample::gpu::Status as GpuStatus;
use crate::sample::Sample;
use crate::units::mib;

impl Store {
    /// Folds a sample's host figures and the tree's GPU memory (`gpu_tree`,
    /// MiB) into the current figures (and the last ones of a live tree).
    pub(super) fn fold_current(&mut self, sample: &Sample, gpu_tree: f64) {
        let sampled = sample.gpu_status == GpuStatus::Sampled;
        if sample.memory.total > 0 {
            self.host.memory = sample.memory;
        }
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
        let charge = sample
            .host
            .footprint
            .as_ref()
            .and_then(|f| f.cgroup.as_ref());
        self.current = Current {
            timestamp: sample.timestamp,
            cpu_used_mb: mib(used),
            cpu_hwm_mb: mib(peak),
            charge_mb: charge.map(|r| mib(r.working_set())),
            charge_hwm_mb: charge.map(|r| {
                mib(r
                    .interval_peak_working_set()
                    .unwrap_or_else(|| r.working_set()))
            }),
            host_source: source,
            gpu_tree_mb: gpu_tree,
            gpu_tree_peak_mb: self.current.gpu_tree_peak_mb.max(gpu_tree),
            gpu_source: match (sampled, sample.gpu.device_level) {
                (true, false) => GpuSource::Nvml,
                (true, true) => GpuSource::Device,
                (false, _) => GpuSource::None,
            },
            processes: sample.host.processes.len(),
        };
        if !sample.host.processes.is_empty() {
            self.last_alive = Some(self.current.clone());
        }
    }

    /// Records the host source the sampler chose (or changed to).
    pub(super) fn set_host_source(&mut self, info: &SourceInfo) {
        let mut earlier = Vec::new();
        if let Some(old) = self.host.info.take() {
            earlier = old.earlier;
            earlier.push(HostSourceChange {
                source: old.source,
                reason: old.reason,
                since: self.host.since,
            });
        }
        self.host.since = info.since;
        self.host.info = Some(HostInfo {
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
    pub(super) fn observe_host(&mut self, sample: &Sample, used_mb: f64) {
        let rss_sum = mib(sample.host.tree_rss());
        let new_peak = used_mb > self.peaks.run.figures.cpu_ram_used_mb;
        let Some(host) = &mut self.host.info else {
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
        if matches!(f.source, HostSource::Pss | HostSource::Pages) {
            host.pss_reads = Some(f.pss_reads);
            host.pss_read_s = Some(f.pss_read_s);
            if new_peak || host.pss_age_at_peak_s.is_none() {
                host.pss_age_at_peak_s = f.age_s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;

    use crate::model::HostSource;
    use crate::sample::footprint::SourceInfo;
    use crate::sample::host::Footprint;

    fn source(source: HostSource, reason: &str, since: f64) -> SourceInfo {
        SourceInfo {
            source,
            reason: reason.into(),
            since,
            ..SourceInfo::default()
        }
    }

    #[test]
    fn a_changed_host_source_keeps_the_earlier_one() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 50)], &[]);
        s.host_source = Some(source(HostSource::Pss, "no cgroup", 100.0));
        timer(&mut st, s);
        let mut s = sample(102.0, &[(10, 100)], &[]);
        s.host_source = Some(source(HostSource::Rss, "PSS too slow", 102.0));
        timer(&mut st, s);
        let host = st.document().host.unwrap();
        assert_eq!(host.source, HostSource::Rss);
        assert_eq!(host.reason, "PSS too slow");
        assert_eq!(host.earlier.len(), 1);
        assert_eq!(host.earlier[0].source, HostSource::Pss);
        assert_eq!(host.earlier[0].since, 100.0);
        assert_eq!(
            host.rss_sum_peak_mb, 100.0,
            "the new source's figures start afresh"
        );
    }

    #[test]
    fn the_footprint_gives_the_current_figures_and_its_pss_age_at_the_peak() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 100)], &[]);
        s.host_source = Some(source(HostSource::Pss, "", 100.0));
        s.host.footprint = Some(Footprint {
            source: HostSource::Pss,
            used: 120 * M,
            peak: 130 * M,
            age_s: Some(0.5),
            pss_reads: 4,
            ..Footprint::default()
        });
        timer(&mut st, s);
        let c = st.current();
        assert_eq!((c.cpu_used_mb, c.cpu_hwm_mb), (120.0, 130.0));
        assert_eq!(c.host_source, HostSource::Pss);
        assert_eq!(st.peaks().figures.cpu_ram_used_mb, 120.0, "not the RSS sum");
        let host = st.document().host.unwrap();
        assert_eq!(host.pss_reads, Some(4));
        assert_eq!(host.pss_age_at_peak_s, Some(0.5));
    }
}
