//! `batch-fit`: the largest batch that fits, from step marks that carry
//! their batch size (a `batch_size` label). The peak of each batch size's
//! steps is fitted as `fixed + per_sample × batch` (least squares over the
//! sizes seen, at least two), and the largest batch whose peak plus the
//! run's headroom stays within the device is named: the GPU's total
//! memory when the steps hold GPU memory, else the job's memory limit
//! (`run --memory-limit`) or the host's memory.

use std::collections::BTreeMap;

use super::item::{size, Advice, Level};
use crate::model::{DocumentOf, Entry, EntryKind, GpuSource};

/// The label that carries a step's batch size.
pub(crate) const BATCH_LABEL: &str = "batch_size";

/// Batch sizes above this are not read (a typo, not a batch).
const MAX_BATCH: u64 = 100_000_000;

/// A per-sample slope below this (MiB) is no slope: the batch size does
/// not drive the peak.
const MIN_SLOPE_MIB: f64 = 0.001;

/// The highest figures seen at steps of one batch size, MiB.
#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    host: f64,
    gpu: f64,
}

/// The steps' peaks by batch size.
#[derive(Debug, Default)]
pub(super) struct Steps {
    by_batch: BTreeMap<u64, Peak>,
}

impl Steps {
    pub(super) fn observe(&mut self, e: &Entry) {
        if e.kind != EntryKind::Event {
            return;
        }
        let Some(b) = e
            .labels
            .get(BATCH_LABEL)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|b| (1..=MAX_BATCH).contains(b))
        else {
            return;
        };
        let gpu = match e.gpu_source {
            // Device-level figures hold every process on the job's GPUs:
            // still what the card had to fit.
            GpuSource::Nvml | GpuSource::Device => e.gpu_process_used_mb,
            GpuSource::Allocator => e.reserved_gpu_ram_mb.max(e.gpu_ram_peak_mb),
            GpuSource::None => 0.0,
        };
        let p = self.by_batch.entry(b).or_default();
        p.host = p.host.max(e.cpu_ram_used_mb);
        p.gpu = p.gpu.max(gpu);
    }

    pub(super) fn advise<L>(&self, doc: &DocumentOf<L>) -> Option<Advice> {
        if self.by_batch.len() < 2 {
            return None;
        }
        let on_gpu = self.by_batch.values().any(|p| p.gpu > 0.0);
        let points: Vec<(f64, f64)> = self
            .by_batch
            .iter()
            .map(|(b, p)| (*b as f64, if on_gpu { p.gpu } else { p.host }))
            .collect();
        let (fixed, slope) = fit(&points)?;
        if slope < MIN_SLOPE_MIB {
            return None;
        }
        let (capacity, device) = capacity(doc, on_gpu)?;
        let headroom = if doc.summary.headroom_ratio > 0.0 {
            doc.summary.headroom_ratio
        } else {
            0.10
        };
        let usable = capacity / (1.0 + headroom);
        let largest = ((usable - fixed) / slope).floor();
        let at_limit = ((capacity - fixed) / slope).floor();
        let used = *self.by_batch.keys().last()? as f64;
        Some(verdict(Fit {
            fixed,
            slope,
            capacity,
            device,
            headroom,
            largest,
            at_limit,
            used,
            sizes: points.len(),
        }))
    }
}

/// The fitted line and what it says.
struct Fit {
    fixed: f64,
    slope: f64,
    capacity: f64,
    device: String,
    headroom: f64,
    largest: f64,
    at_limit: f64,
    used: f64,
    sizes: usize,
}

fn verdict(f: Fit) -> Advice {
    let per_sample = if f.slope >= 10.0 {
        size(f.slope)
    } else {
        format!("{:.2} MiB", f.slope)
    };
    let mut finding = format!(
        "each sample of a batch adds {per_sample} to the step's peak above a fixed {} \
         ({} batch sizes); with {:.0} % headroom on {} ({}), ",
        size(f.fixed.max(0.0)),
        f.sizes,
        f.headroom * 100.0,
        f.device,
        size(f.capacity)
    );
    let (level, action) = if f.largest < 1.0 {
        finding.push_str("not even a batch of 1 fits");
        (
            Level::Warning,
            format!(
                "the fixed part alone ({}) leaves no room: shrink the model's footprint \
                 (mixed precision, activation checkpointing) or use a larger device",
                size(f.fixed)
            ),
        )
    } else if f.largest < f.used {
        let steps = (f.used / f.largest).ceil();
        let micro = (f.used / steps).ceil();
        finding.push_str(&format!(
            "the largest batch that fits is {:.0}, below the {:.0} this run used",
            f.largest, f.used
        ));
        (
            Level::Warning,
            format!(
                "use batch {micro:.0} with {steps:.0} gradient accumulation steps to keep the \
                 effective batch of {:.0}",
                f.used
            ),
        )
    } else {
        finding.push_str(&format!(
            "the largest batch that fits is {:.0} (this run used up to {:.0})",
            f.largest, f.used
        ));
        (
            Level::Info,
            format!(
                "batch sizes up to {:.0} fit; above {:.0} the device is full",
                f.largest, f.at_limit
            ),
        )
    };
    Advice::new("batch-fit", level, finding, action)
        .figure("per_sample_mb", f.slope)
        .figure("fixed_mb", f.fixed)
        .figure("capacity_mb", f.capacity)
        .figure("headroom_ratio", f.headroom)
        .figure("largest_batch", f.largest.max(0.0))
        .figure("largest_batch_at_limit", f.at_limit.max(0.0))
        .figure("batch_used", f.used)
}

/// Least squares `y = a + b x`; `None` when the x are all equal.
fn fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let b = sxy / sxx;
    Some((my - b * mx, b))
}

/// What the steps must fit in, MiB, and its name.
fn capacity<L>(doc: &DocumentOf<L>, on_gpu: bool) -> Option<(f64, String)> {
    if on_gpu {
        let used: Vec<_> = doc.gpus.iter().filter(|g| g.total_mb > 0.0).collect();
        let g = used
            .iter()
            .filter(|g| g.peak_tree_used_mb > 0.0)
            .chain(used.iter())
            .min_by(|a, b| a.total_mb.total_cmp(&b.total_mb))?;
        return Some((
            g.total_mb,
            format!("GPU {} {}", g.index, g.name).trim().to_string(),
        ));
    }
    match (doc.run.memory_limit_mb, doc.run.host_memory_mb) {
        (Some(l), _) if l > 0.0 => Some((l, "the memory limit".into())),
        (_, Some(h)) if h > 0.0 => Some((h, "the host's memory".into())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use crate::model::{Document, Gpu};

    fn step(t: f64, batch: u64, cpu: f64) -> Entry {
        let mut e = entry(t, "train", "step", cpu);
        e.labels.insert(BATCH_LABEL.into(), batch.to_string());
        e
    }

    fn stepped(limit: f64, sizes: &[u64], fixed: f64, per: f64) -> Document {
        let mut d = doc();
        d.run.memory_limit_mb = Some(limit);
        d.summary.headroom_ratio = 0.10;
        for (i, b) in sizes.iter().enumerate() {
            d.detailed_log
                .push(step(1000.0 + i as f64, *b, fixed + per * *b as f64));
        }
        d
    }

    #[test]
    fn the_largest_batch_under_a_host_limit_follows_the_fitted_line() {
        // 100 MiB fixed + 4 MiB per sample under 2 GiB: at the limit,
        // (2048 - 100) / 4 = 487; with 10 % headroom (1861.8 - 100) / 4 = 440.
        let d = stepped(2048.0, &[8, 16, 32, 64], 100.0, 4.0);
        let a = super::super::advise(&d);
        assert_eq!(a.len(), 1, "{a:#?}");
        assert_eq!(a[0].code, "batch-fit");
        assert_eq!(a[0].level, Level::Info);
        assert_eq!(a[0].figures["per_sample_mb"], 4.0);
        assert_eq!(a[0].figures["largest_batch"], 440.0);
        assert_eq!(a[0].figures["largest_batch_at_limit"], 487.0);
        assert!(
            a[0].finding.contains("largest batch that fits is 440"),
            "{}",
            a[0].finding
        );
    }

    #[test]
    fn a_batch_too_large_gets_gradient_accumulation() {
        let d = stepped(1024.0, &[64, 256], 100.0, 4.0);
        // (930.9 - 100) / 4 = 207 fits; 256 needs 2 steps of 128.
        let a = super::super::advise(&d);
        assert_eq!(a[0].level, Level::Warning);
        assert_eq!(a[0].figures["largest_batch"], 207.0);
        assert_eq!(
            a[0].action,
            "use batch 128 with 2 gradient accumulation steps to keep the effective batch of 256"
        );
    }

    #[test]
    fn gpu_steps_are_fitted_against_the_cards_total() {
        let mut d = doc();
        d.gpus.push(Gpu {
            index: 0,
            name: "H100".into(),
            total_mb: 81_559.0,
            peak_tree_used_mb: 30_000.0,
            ..Gpu::default()
        });
        for (i, b) in [16u64, 32, 48].iter().enumerate() {
            let mut e = step(1000.0 + i as f64, *b, 3000.0);
            e.gpu_source = GpuSource::Allocator;
            e.reserved_gpu_ram_mb = 2000.0 + 500.0 * *b as f64;
            d.detailed_log.push(e);
        }
        let a = super::super::advise(&d);
        assert_eq!(a[0].figures["capacity_mb"], 81_559.0);
        assert_eq!(a[0].figures["per_sample_mb"], 500.0);
        // (81559 / 1.1 - 2000) / 500 = 144.
        assert_eq!(a[0].figures["largest_batch"], 144.0);
        assert!(a[0].finding.contains("GPU 0 H100"), "{}", a[0].finding);
    }

    #[test]
    fn silent_without_two_sizes_a_slope_or_a_capacity() {
        assert!(super::super::advise(&stepped(2048.0, &[32, 32, 32], 100.0, 4.0)).is_empty());
        assert!(super::super::advise(&stepped(2048.0, &[8, 64], 300.0, 0.0)).is_empty());
        let mut d = stepped(2048.0, &[8, 64], 100.0, 4.0);
        d.run.memory_limit_mb = None;
        assert!(super::super::advise(&d).is_empty());
        d.run.host_memory_mb = Some(16_000.0);
        assert_eq!(super::super::advise(&d).len(), 1);
    }
}
