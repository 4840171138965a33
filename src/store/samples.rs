//! Samples: the run's timer entries, thinned. A sample itself is folded
//! phase by phase by `apply` (the tree's changes, GPU memory per process,
//! per-process figures, devices, host and current figures, pressure,
//! forecasts), and a timer sample becomes a timer entry there, counted for
//! the innermost open span's component; the tests of that order are here.

use super::limits::Limits;
use crate::model::thin::Thinned;
use crate::model::Entry;

/// The samples' state: the timer entries, thinned.
#[derive(Debug, Clone)]
pub(super) struct SamplesState {
    pub(super) timer: Thinned<Entry>,
}

impl SamplesState {
    pub(super) fn new(limits: &Limits) -> SamplesState {
        SamplesState {
            timer: Thinned::new(limits.max_timer_entries),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use crate::model::GpuSource;

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
        assert_eq!(doc.peak_usage.figures.cpu_ram_used_mb, 350.0);
        // pid 99 is not ours: its 500 MiB never counts.
        assert_eq!(doc.peak_usage.figures.gpu_process_used_mb, 2000.0);
        assert_eq!(doc.detailed_log.len(), 3);
        assert_eq!(
            doc.detailed_log[2].figures.gpu_ram_peak_mb, 2000.0,
            "running max"
        );
        assert_eq!(doc.detailed_log[2].figures.gpu_ram_used_mb, 1500.0);
        assert_eq!(doc.detailed_log[2].gpu_source, GpuSource::Nvml);
        assert_eq!(doc.gpus[0].peak_tree_used_mb, 2000.0);
        assert_eq!(doc.targets.len(), 2);
        assert_eq!(doc.targets[0].peak_rss_mb, 300.0);
        assert_eq!(doc.summary.min_gpu_mb, 2200.0);
        assert_eq!(doc.peaks_by_component["system"].samples, 3);
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
        assert_eq!(doc.peak_usage.figures.cpu_ram_used_mb, peak as f64);
        assert!(doc.detailed_log.len() <= 257, "{}", doc.detailed_log.len());
        let log_max = doc
            .detailed_log
            .iter()
            .map(|e| e.figures.cpu_ram_used_mb)
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

    #[test]
    fn an_event_sample_updates_the_figures_but_logs_nothing() {
        let mut st = store();
        let out = st.apply(&Record::Sample {
            kind: SampleKind::Event,
            sample: sample(101.0, &[(10, 400)], &[]),
        });
        assert_eq!(out.entry, None);
        assert_eq!(st.current().cpu_used_mb, 400.0);
        assert_eq!(st.counters().event_samples, 1);
        assert_eq!(st.counters().ticks, 0);
        assert_eq!(st.peaks().samples, 0, "no entry, no peak");
        let e = st.apply(&Record::Mark(mark(101.1, "data", "load")));
        assert_eq!(
            e.entry.unwrap().figures.cpu_ram_used_mb,
            400.0,
            "the mark takes it"
        );
    }
}
