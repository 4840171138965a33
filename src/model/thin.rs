//! Bounded time series that never lose a peak.
//!
//! A long run at a short interval produces millions of timer samples. The
//! log keeps at most `cap` of them: new samples fill buckets of `width`
//! samples, and when the buckets outnumber `cap`, neighbours are merged
//! pairwise and `width` doubles. A merged bucket carries the maximum of
//! every figure, so the maximum of the thinned series always equals the
//! maximum of the full one, and resolution stays uniform over the run.
//!
//! Points carry a phase (a log entry's component, span and stage). A
//! bucket never straddles a phase change, and thinning merges neighbours of
//! the same phase first, so a merged entry does not credit one phase with
//! another's peak. Only when phases alternate faster than the log's
//! resolution are neighbours of different phases merged, to keep the
//! bound; the merged point then takes the phase of its heavier side.

use serde::{Deserialize, Serialize};

use crate::model::Entry;

/// A point that can absorb a later neighbour, keeping maxima.
pub(crate) trait Mergeable: Clone {
    fn absorb(&mut self, later: &Self);

    /// Whether `later` belongs to the same phase and may be merged freely.
    fn same_phase(&self, _later: &Self) -> bool {
        true
    }

    /// Merges `later` of another phase: the merged point is labelled with
    /// the phase of the heavier of the two.
    fn absorb_across(&mut self, later: &Self) {
        self.absorb(later);
    }
}

impl Entry {
    /// How much memory the entry shows, to pick a merged entry's phase.
    fn weight(&self) -> f64 {
        self.figures.cpu_ram_used_mb
            + self
                .figures
                .gpu_process_used_mb
                .max(self.figures.gpu_ram_used_mb)
    }
}

impl Mergeable for Entry {
    fn absorb(&mut self, later: &Entry) {
        self.absorb_max(later);
        if later.gpu_source != crate::model::GpuSource::None {
            self.gpu_source = later.gpu_source;
        }
        self.samples = Some(self.samples.unwrap_or(1) + later.samples.unwrap_or(1));
        self.timestamp_end = Some(later.timestamp_end.unwrap_or(later.timestamp));
    }

    fn same_phase(&self, later: &Entry) -> bool {
        self.component == later.component && self.span == later.span && self.stage == later.stage
    }

    fn absorb_across(&mut self, later: &Entry) {
        if later.weight() > self.weight() {
            self.component.clone_from(&later.component);
            self.operation.clone_from(&later.operation);
            self.span.clone_from(&later.span);
            self.stage.clone_from(&later.stage);
        }
        self.absorb(later);
    }
}

/// `[time, a, b]`: a target's series point; merging keeps the later time's
/// start and both maxima.
impl Mergeable for [f64; 3] {
    fn absorb(&mut self, later: &[f64; 3]) {
        self[1] = self[1].max(later[1]);
        self[2] = self[2].max(later[2]);
    }
}

/// The bounded series.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Thinned<T> {
    cap: usize,
    /// Samples per completed bucket.
    width: u64,
    done: Vec<T>,
    /// The bucket being filled and how many samples it holds.
    open: Option<(T, u64)>,
    /// Samples absorbed into another point.
    merged: u64,
}

impl<T: Mergeable> Thinned<T> {
    pub fn new(cap: usize) -> Self {
        Thinned {
            cap: cap.max(2),
            width: 1,
            done: Vec::new(),
            open: None,
            merged: 0,
        }
    }

    pub(crate) fn push(&mut self, point: T) {
        // A phase change closes the open bucket early.
        if let Some((bucket, _)) = &self.open {
            if !bucket.same_phase(&point) {
                if let Some((bucket, _)) = self.open.take() {
                    self.done.push(bucket);
                }
            }
        }
        match &mut self.open {
            Some((bucket, n)) => {
                bucket.absorb(&point);
                *n += 1;
                self.merged += 1;
            }
            None => self.open = Some((point, 1)),
        }
        if let Some((_, n)) = &self.open {
            if *n >= self.width {
                if let Some((bucket, _)) = self.open.take() {
                    self.done.push(bucket);
                }
            }
        }
        if self.done.len() >= self.cap {
            self.halve();
        }
    }

    /// Merges neighbours of the same phase; if that frees too little room
    /// (phases alternate faster than the log's resolution), merges the rest
    /// pairwise across phases.
    fn halve(&mut self) {
        let old = std::mem::take(&mut self.done);
        let mut it = old.into_iter().peekable();
        while let Some(mut a) = it.next() {
            if let Some(b) = it.next_if(|b| a.same_phase(b)) {
                a.absorb(&b);
                self.merged += 1;
            }
            self.done.push(a);
        }
        if self.done.len() > self.cap * 3 / 4 {
            let old = std::mem::take(&mut self.done);
            let mut it = old.into_iter();
            while let Some(mut a) = it.next() {
                if let Some(b) = it.next() {
                    a.absorb_across(&b);
                    self.merged += 1;
                }
                self.done.push(a);
            }
        }
        // Buckets wide enough for the whole run so far to fill half the
        // log: twice the old width when phases are long, and never an
        // overflow when they alternate and buckets close early.
        let samples = self.merged + self.len() as u64;
        self.width = samples.div_ceil((self.cap / 2).max(1) as u64).max(1);
    }

    /// Every point, the open bucket last.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.done.iter().chain(self.open.iter().map(|(b, _)| b))
    }

    pub(crate) fn len(&self) -> usize {
        self.done.len() + usize::from(self.open.is_some())
    }

    /// Samples that now live inside another point.
    pub(crate) fn merged(&self) -> u64 {
        self.merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;

    fn entry(t: f64, cpu: f64, gpu: f64) -> Entry {
        Entry {
            timestamp: t,
            figures: Figures {
                cpu_ram_used_mb: cpu,
                gpu_ram_used_mb: gpu,
                ..Figures::default()
            },
            ..Entry::default()
        }
    }

    #[test]
    fn stays_bounded_and_keeps_every_maximum() {
        let mut log = Thinned::new(64);
        let mut max_cpu: f64 = 0.0;
        let mut max_gpu: f64 = 0.0;
        // A million samples with pseudo-random spikes.
        let mut x: u64 = 88172645463325252;
        for i in 0..1_000_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let cpu = (x % 1000) as f64
                + if x.is_multiple_of(99991) {
                    50_000.0
                } else {
                    0.0
                };
            let gpu = ((x >> 20) % 700) as f64;
            max_cpu = max_cpu.max(cpu);
            max_gpu = max_gpu.max(gpu);
            log.push(entry(i as f64, cpu, gpu));
            assert!(log.len() <= 65);
        }
        let got_cpu = log
            .iter()
            .map(|e| e.figures.cpu_ram_used_mb)
            .fold(0.0, f64::max);
        let got_gpu = log
            .iter()
            .map(|e| e.figures.gpu_ram_used_mb)
            .fold(0.0, f64::max);
        assert_eq!((got_cpu, got_gpu), (max_cpu, max_gpu));
        let samples: u64 = log.iter().map(|e| u64::from(e.samples.unwrap_or(1))).sum();
        assert_eq!(samples, 1_000_000, "every sample is accounted for");
        assert_eq!(log.merged() + log.len() as u64, 1_000_000);
        // Buckets are in time order.
        let times: Vec<f64> = log.iter().map(|e| e.timestamp).collect();
        assert!(times.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn short_series_are_untouched() {
        let mut log = Thinned::new(16);
        for i in 0..10 {
            log.push(entry(i as f64, i as f64, 0.0));
        }
        assert_eq!(log.len(), 10);
        assert!(log.iter().all(|e| e.samples.is_none()));
    }

    fn phased(t: f64, component: &str, cpu: f64) -> Entry {
        Entry {
            component: component.into(),
            ..entry(t, cpu, 0.0)
        }
    }

    #[test]
    fn a_merged_entry_never_takes_another_phase_peak() {
        // Regression: a bucket straddling the end of a span gave the
        // model's 900 MiB peak to `system`.
        let mut log = Thinned::new(16);
        let mut t = 0.0;
        for (component, cpu, n) in [
            ("system", 100.0, 500),
            ("model", 900.0, 300),
            ("system", 150.0, 500),
        ] {
            for _ in 0..n {
                log.push(phased(t, component, cpu));
                t += 1.0;
            }
        }
        assert!(log.len() <= 17);
        for e in log.iter() {
            let expected = if e.component == "model" {
                900.0
            } else {
                e.figures.cpu_ram_used_mb
            };
            assert_eq!(e.figures.cpu_ram_used_mb, expected, "{e:?}");
            assert!(
                e.component == "model" || e.figures.cpu_ram_used_mb < 900.0,
                "{e:?}"
            );
        }
        let samples: u64 = log.iter().map(|e| u64::from(e.samples.unwrap_or(1))).sum();
        assert_eq!(samples, 1300);
        let per = |c: &str| -> u64 {
            log.iter()
                .filter(|e| e.component == c)
                .map(|e| u64::from(e.samples.unwrap_or(1)))
                .sum()
        };
        assert_eq!((per("model"), per("system")), (300, 1000));
    }

    #[test]
    fn phases_that_alternate_every_sample_still_stay_bounded() {
        let mut log = Thinned::new(32);
        for i in 0..100_000u32 {
            let (c, cpu) = if i % 2 == 0 { ("a", 10.0) } else { ("b", 20.0) };
            log.push(phased(f64::from(i), c, cpu + f64::from(i % 7)));
            assert!(log.len() <= 33);
        }
        let max = log
            .iter()
            .map(|e| e.figures.cpu_ram_used_mb)
            .fold(0.0, f64::max);
        assert_eq!(max, 26.0);
        // Forced merges take the heavier phase's label.
        assert!(log
            .iter()
            .all(|e| e.samples.unwrap_or(1) == 1 || e.component == "b"));
    }
}
