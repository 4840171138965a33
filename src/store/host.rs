//! The host: the footprint source the sampler chose (and the ones before
//! it), what that source saw (cgroup breakdown at the peak, PSS reads) and
//! the machine's memory. The tree's current figures, which every entry
//! takes, are `apply`'s.

use crate::model::{CgroupBreakdown, HostInfo, HostSource, HostSourceChange};
use crate::sample::footprint::SourceInfo;
use crate::sample::{HostMemory, Sample};
use crate::units::mib;

/// The host's state: the machine's memory, the footprint source and what
/// it saw (absent until the first sample), and since when it serves.
#[derive(Debug, Clone, Default)]
pub(super) struct HostState {
    pub(super) memory: HostMemory,
    pub(super) info: Option<HostInfo>,
    pub(super) since: f64,
}

impl HostState {
    /// Records the host source the sampler chose (or changed to).
    pub(super) fn set_source(&mut self, info: &SourceInfo) {
        let mut earlier = Vec::new();
        if let Some(old) = self.info.take() {
            earlier = old.earlier;
            earlier.push(HostSourceChange {
                source: old.source,
                reason: old.reason,
                since: self.since,
            });
        }
        self.since = info.since;
        self.info = Some(HostInfo {
            source: info.source,
            reason: info.reason.clone(),
            cgroup: info.cgroup.as_ref().map(|p| p.display().to_string()),
            cgroup_version: info.cgroup_version,
            cgroup_created: info.cgroup_created,
            earlier,
            ..HostInfo::default()
        });
    }

    /// Folds what the host source saw in a sample of `used_mb` into the
    /// run's [`HostInfo`] (its breakdown and reads at the run's peak,
    /// `run_peak_mb` so far), and keeps the machine's memory.
    pub(super) fn observe(&mut self, sample: &Sample, used_mb: f64, run_peak_mb: f64) {
        if sample.memory.total > 0 {
            self.memory = sample.memory;
        }
        let rss_sum = mib(sample.host.tree_rss());
        let new_peak = used_mb > run_peak_mb;
        let Some(host) = &mut self.info else {
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
