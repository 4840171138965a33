//! `batch-fit`: the largest batch that fits, from steps that carry their
//! batch size (a `batch_size` label on a span or a mark).
//!
//! A step's peak is the highest figure inside it: a training step frees
//! its activations during backward, before its end mark, so the marks
//! alone miss it. Inside a span that names its batch size count the
//! figures at its start, every timer sample while it is open and the
//! high-water mark the kernel kept between samples, and at its end the
//! same (the allocator's per-step peak for the GPU: the client resets it
//! when such a span starts). Host figures are read on the kernel's charge
//! basis where the job has a memory cgroup: what its limit is enforced
//! on, not library pages another cgroup was charged for.
//!
//! Each batch size's peak is fitted as `fixed + per_sample × batch` (least
//! squares over the sizes seen, at least two; the line then raised to
//! lie on or above every size's peak), and the largest batch whose peak
//! plus the run's headroom stays within the device is named: the GPU's
//! total memory when the steps hold GPU memory, else the job's memory
//! limit (`run --memory-limit`) or the host's memory.

use std::collections::BTreeMap;

use super::item::{size, Advice, Severity};
use crate::model::{DocumentOf, Entry, EntryKind, GpuSource};

/// The label that carries a step's batch size.
pub(crate) const BATCH_LABEL: &str = "batch_size";

/// Batch sizes above this are not read (a typo, not a batch).
const MAX_BATCH: u64 = 100_000_000;

/// A per-sample slope below this (MiB) is no slope: the batch size does
/// not drive the peak.
const MIN_SLOPE_MIB: f64 = 0.001;

/// Open labelled spans followed at once; more are not read.
const MAX_OPEN: usize = 64;

/// The highest figures seen inside one step, MiB.
#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    host: f64,
    gpu: f64,
}

impl Peak {
    fn raise(&mut self, host: f64, gpu: f64) {
        self.host = self.host.max(host);
        self.gpu = self.gpu.max(gpu);
    }
}

/// A step's peaks of one batch size, and whether it ended where the next
/// step had another size (its end sample may then hold the start of that
/// step: the end mark is read when the engine gets to it).
#[derive(Debug, Default)]
struct SizeSteps {
    /// The highest peak of steps followed by a step of the same size (or
    /// none).
    clean: Option<Peak>,
    /// The highest peak of steps followed by a step of another size.
    at_change: Option<Peak>,
}

impl SizeSteps {
    fn add(&mut self, p: Peak, at_change: bool) {
        let slot = if at_change {
            &mut self.at_change
        } else {
            &mut self.clean
        };
        let q = slot.get_or_insert_with(Peak::default);
        q.raise(p.host, p.gpu);
    }

    /// The size's peak: its clean steps', else all of them.
    fn peak(&self) -> Peak {
        self.clean.or(self.at_change).unwrap_or_default()
    }
}

/// A labelled span being read.
#[derive(Debug)]
struct Open {
    pid: Option<u32>,
    component: String,
    operation: String,
    batch: u64,
    started: f64,
    peak: Peak,
    /// The highest GPU figure of the timer samples inside: NVML's, which
    /// counts the allocator's cached blocks and the CUDA context.
    sampled_gpu: f64,
}

/// The steps' peaks by batch size.
#[derive(Debug, Default)]
pub(super) struct Steps {
    by_batch: BTreeMap<u64, SizeSteps>,
    open: Vec<Open>,
    /// The last step ended, not yet filed: filed when the next step
    /// starts (is it a change of size?) or at the end of the log.
    ended: Option<(u64, Peak)>,
    /// The entries carried the job's cgroup charge.
    charged: bool,
}

/// An entry's batch size label.
fn batch_of(e: &Entry) -> Option<u64> {
    e.labels
        .get(BATCH_LABEL)
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|b| (1..=MAX_BATCH).contains(b))
}

/// An entry's GPU figure for a step's peak.
fn gpu_of(e: &Entry) -> f64 {
    match e.gpu_source {
        // Device-level figures hold every process on the job's GPUs:
        // still what the card had to fit.
        GpuSource::Nvml | GpuSource::Device => e.figures.gpu_process_used_mb,
        // The highest allocated since the client's reset at the step's
        // start (with an older client: since the process started).
        GpuSource::Allocator => e.figures.gpu_ram_peak_mb.max(e.figures.gpu_ram_used_mb),
        GpuSource::None => 0.0,
    }
}

impl Steps {
    pub(super) fn observe(&mut self, e: &Entry) {
        self.charged |= e.charge_mb.is_some();
        match e.kind {
            EntryKind::Timer => {
                // A sample inside the open steps: the figure now and the
                // kernel's high-water mark since the previous sample.
                for o in &mut self.open {
                    if e.timestamp >= o.started {
                        o.peak.raise(e.charge_or_headline_peak(), 0.0);
                        o.sampled_gpu = o.sampled_gpu.max(gpu_of(e));
                    }
                }
            }
            EntryKind::Event => self.event(e),
            EntryKind::System => {}
        }
    }

    fn event(&mut self, e: &Entry) {
        if let Some(op) = e.operation.strip_prefix("before_") {
            let Some(batch) = batch_of(e) else { return };
            self.file_ended(Some(batch));
            if self.open.len() < MAX_OPEN {
                // At the start only the figure now: the high-water mark
                // covers the time before the step.
                let host = e.charge_mb.unwrap_or(e.figures.cpu_ram_used_mb);
                let mut peak = Peak::default();
                // The allocator's figures at the start are the previous
                // step's peak until the reset: only NVML's count.
                let gpu = if e.gpu_source == GpuSource::Allocator {
                    e.figures.gpu_ram_used_mb
                } else {
                    gpu_of(e)
                };
                peak.raise(host, gpu);
                self.open.push(Open {
                    pid: e.pid,
                    component: e.component.clone(),
                    operation: op.to_string(),
                    batch,
                    started: e.timestamp,
                    peak,
                    sampled_gpu: 0.0,
                });
            }
        } else if let Some(op) = e.operation.strip_prefix("after_") {
            let found = self
                .open
                .iter()
                .rposition(|o| o.component == e.component && o.operation == op && o.pid == e.pid)
                .or_else(|| {
                    self.open
                        .iter()
                        .rposition(|o| o.component == e.component && o.operation == op)
                });
            let Some(i) = found else { return };
            let mut o = self.open.remove(i);
            // The allocator's peak since the step's start is what the
            // step needed; NVML's samples also hold the blocks the
            // allocator keeps cached from earlier steps, which it frees
            // and retries with before it runs out.
            let sampled = if e.gpu_source == GpuSource::Allocator {
                0.0
            } else {
                o.sampled_gpu
            };
            o.peak
                .raise(e.charge_or_headline_peak(), gpu_of(e).max(sampled));
            self.file_ended(None);
            self.ended = Some((o.batch, o.peak));
        } else if let Some(batch) = batch_of(e) {
            // A plain mark with its batch size: its own figures.
            self.file_ended(Some(batch));
            // PyTorch's pool there: without a span, no per-step reset.
            let gpu = match e.gpu_source {
                GpuSource::Allocator => {
                    e.figures.reserved_gpu_ram_mb.max(e.figures.gpu_ram_peak_mb)
                }
                _ => gpu_of(e),
            };
            let mut peak = Peak::default();
            peak.raise(e.charge_mb.unwrap_or(e.figures.cpu_ram_used_mb), gpu);
            self.ended = Some((batch, peak));
        }
    }

    /// Files the last ended step, knowing the next step's size (`None`:
    /// not known).
    fn file_ended(&mut self, next: Option<u64>) {
        if let Some((batch, peak)) = self.ended.take() {
            let at_change = next.is_some_and(|n| n != batch);
            self.by_batch.entry(batch).or_default().add(peak, at_change);
        }
    }

    pub(super) fn advise<L>(mut self, doc: &DocumentOf<L>) -> Option<Advice> {
        self.file_ended(None);
        if self.by_batch.len() < 2 {
            return None;
        }
        let peaks: Vec<(u64, Peak)> = self.by_batch.iter().map(|(b, s)| (*b, s.peak())).collect();
        let on_gpu = peaks.iter().any(|(_, p)| p.gpu > 0.0);
        let points: Vec<(f64, f64)> = peaks
            .iter()
            .map(|(b, p)| (*b as f64, if on_gpu { p.gpu } else { p.host }))
            .collect();
        let (fixed, slope) = fit(&points)?;
        if slope < MIN_SLOPE_MIB {
            return None;
        }
        // The line on or above every size's peak: a batch it names must
        // fit as well as the sizes that ran.
        let fixed = points
            .iter()
            .map(|(b, p)| p - slope * b)
            .fold(fixed, f64::max);
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
        let basis = if on_gpu {
            "the allocator's per-step peak"
        } else if self.charged {
            "the job's cgroup charge"
        } else {
            "the tree's host memory"
        };
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
            basis,
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
    /// Which figure the peaks are.
    basis: &'static str,
}

fn verdict(f: Fit) -> Advice {
    let per_sample = if f.slope >= 10.0 {
        size(f.slope)
    } else {
        format!("{:.2} MiB", f.slope)
    };
    let mut finding = format!(
        "each sample of a batch adds {per_sample} to the step's peak above a fixed {} \
         ({} batch sizes, {}); with {:.0} % headroom on {} ({}), ",
        size(f.fixed.max(0.0)),
        f.sizes,
        f.basis,
        f.headroom * 100.0,
        f.device,
        size(f.capacity)
    );
    let (level, action) = if f.largest < 1.0 {
        finding.push_str("not even a batch of 1 fits");
        (
            Severity::Warning,
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
            Severity::Warning,
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
            Severity::Info,
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
        assert_eq!(a[0].level, Severity::Info);
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
        assert_eq!(a[0].level, Severity::Warning);
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
            e.figures.reserved_gpu_ram_mb = 2000.0 + 500.0 * *b as f64;
            d.detailed_log.push(e);
        }
        let a = super::super::advise(&d);
        assert_eq!(a[0].figures["capacity_mb"], 81_559.0);
        assert_eq!(a[0].figures["per_sample_mb"], 500.0);
        // (81559 / 1.1 - 2000) / 500 = 144.
        assert_eq!(a[0].figures["largest_batch"], 144.0);
        assert!(a[0].finding.contains("GPU 0 H100"), "{}", a[0].finding);
    }

    /// A span step of `batch`: low at both marks, its peak seen only by a
    /// timer sample's high-water marks inside (the headline's `cpu`, the
    /// cgroup's `charge`).
    fn span_step(d: &mut Document, t: f64, batch: u64, cpu: f64, charge: f64) {
        let mut begin = step(t, batch, 50.0);
        begin.operation = "before_step".into();
        begin.charge_mb = Some(40.0);
        d.detailed_log.push(begin);
        let mut inside = timer(t + 0.2, 60.0);
        inside.figures.cpu_ram_hwm_mb = cpu;
        inside.charge_mb = Some(45.0);
        inside.charge_hwm_mb = Some(charge);
        d.detailed_log.push(inside);
        let mut end = step(t + 0.4, batch, 50.0);
        end.operation = "after_step".into();
        end.charge_mb = Some(40.0);
        end.charge_hwm_mb = Some(45.0);
        d.detailed_log.push(end);
    }

    #[test]
    fn a_step_that_frees_before_its_end_is_fitted_from_its_peak_on_the_charge_basis() {
        let mut d = doc();
        d.run.memory_limit_mb = Some(600.0);
        d.summary.headroom_ratio = 0.10;
        // The headline counts 300 MiB of library pages another cgroup was
        // charged for; the charge has 40 MiB fixed + 4 MiB per sample.
        for (i, b) in [16u64, 32, 64].iter().enumerate() {
            let charge = 40.0 + 4.0 * *b as f64;
            span_step(&mut d, 1000.0 + i as f64, *b, charge + 300.0, charge);
        }
        let a = super::super::advise(&d);
        assert_eq!(a.len(), 1, "{a:#?}");
        assert_eq!(a[0].figures["per_sample_mb"], 4.0);
        assert_eq!(a[0].figures["fixed_mb"], 40.0);
        // (600 / 1.1 - 40) / 4 = 126; at the limit (600 - 40) / 4 = 140.
        assert_eq!(a[0].figures["largest_batch"], 126.0);
        assert_eq!(a[0].figures["largest_batch_at_limit"], 140.0);
        assert!(
            a[0].finding.contains("the job's cgroup charge"),
            "{}",
            a[0].finding
        );
    }

    #[test]
    fn the_end_of_a_step_read_as_the_next_size_starts_does_not_lower_the_slope() {
        let mut d = doc();
        d.run.memory_limit_mb = Some(2048.0);
        d.summary.headroom_ratio = 0.10;
        let mut t = 1000.0;
        for b in [16u64, 32] {
            for _ in 0..3 {
                span_step(&mut d, t, b, 0.0, 100.0 + 4.0 * b as f64);
                t += 1.0;
            }
            if b == 16 {
                // The last step of the size: its end sample was read while
                // the next, larger step allocated.
                let end = d.detailed_log.last_mut().unwrap();
                end.charge_hwm_mb = Some(100.0 + 4.0 * 64.0);
            }
        }
        let a = super::super::advise(&d);
        assert_eq!(a[0].figures["per_sample_mb"], 4.0, "{a:#?}");
    }

    #[test]
    fn the_allocators_per_step_peak_is_the_gpu_figure_not_nvmls_samples() {
        let mut d = doc();
        d.gpus.push(Gpu {
            index: 0,
            name: "H100".into(),
            total_mb: 81_559.0,
            peak_tree_used_mb: 30_000.0,
            ..Gpu::default()
        });
        for (i, b) in [16u64, 32, 64].iter().enumerate() {
            let t = 1000.0 + i as f64;
            // The pool stays reserved from the larger steps; the peak
            // allocated since the step's start is its own.
            let mut begin = step(t, *b, 3000.0);
            begin.operation = "before_step".into();
            begin.gpu_source = GpuSource::Allocator;
            begin.figures.gpu_ram_used_mb = 2000.0;
            begin.figures.gpu_ram_peak_mb = 30_000.0;
            begin.figures.reserved_gpu_ram_mb = 40_000.0;
            d.detailed_log.push(begin);
            // NVML's sample inside: the pool the allocator keeps cached
            // (on an H200, 1.4 GiB per sample where the steps allocated
            // 0.7) and the CUDA context.
            let mut inside = timer(t + 0.25, 3000.0);
            inside.gpu_source = GpuSource::Nvml;
            inside.figures.gpu_process_used_mb = 500.0 + 2.0 * (2000.0 + 400.0 * *b as f64);
            d.detailed_log.push(inside);
            let mut end = step(t + 0.5, *b, 3000.0);
            end.operation = "after_step".into();
            end.gpu_source = GpuSource::Allocator;
            end.figures.gpu_ram_used_mb = 2000.0;
            end.figures.gpu_ram_peak_mb = 2000.0 + 400.0 * *b as f64;
            end.figures.reserved_gpu_ram_mb = 40_000.0;
            d.detailed_log.push(end);
        }
        let a = super::super::advise(&d);
        assert_eq!(a[0].figures["per_sample_mb"], 400.0, "{a:#?}");
        // (81559 / 1.1 - 2000) / 400 = 180.
        assert_eq!(a[0].figures["largest_batch"], 180.0);
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
