//! `cleanup-useless` / `cleanup-helps`: whether the job's cleanup calls
//! (the client's `clear_memory()`, marks named `clear_memory`,
//! `empty_cache` or `cleanup`) freed anything. Each call's figures are
//! compared with the highest since the job's previous mark (a timer sample
//! taken while the call frees must not hide what it freed): PyTorch's
//! reserved pool for the GPU (what `torch.cuda.empty_cache()` gives
//! back), the tree's host memory otherwise.

use super::item::{size, Advice, Severity};
use crate::model::{Entry, EntryKind, GpuSource};

/// Marks that announce a cleanup.
const CLEANUP_OPERATIONS: &[&str] = &["clear_memory", "empty_cache", "cleanup"];

/// A call freeing less than this (MiB) freed nothing worth its time.
const USELESS_MIB: f64 = 16.0;

/// Calls freeing this much on average (MiB) help.
const HELPS_MIB: f64 = 64.0;

/// An entry's GPU pool figure, where it has one.
fn pool(e: &Entry) -> Option<f64> {
    match e.gpu_source {
        GpuSource::Allocator => Some(e.figures.reserved_gpu_ram_mb),
        GpuSource::Nvml | GpuSource::Device => Some(e.figures.gpu_process_used_mb),
        GpuSource::None => None,
    }
}

/// What calls freed of one figure (MiB; negative when it grew).
#[derive(Debug, Default, Clone, Copy)]
struct Freed {
    calls: u64,
    sum: f64,
    most: f64,
}

impl Freed {
    fn add(&mut self, mib: f64) {
        self.most = if self.calls == 0 {
            mib
        } else {
            self.most.max(mib)
        };
        self.calls += 1;
        self.sum += mib;
    }
}

/// What the cleanup calls freed, summed.
#[derive(Debug, Default)]
pub(super) struct Cleanups {
    /// The highest figures since the previous mark: host MiB, GPU
    /// source, GPU pool.
    last: Option<(f64, GpuSource, Option<f64>)>,
    calls: u64,
    gpu_freed: Freed,
    host_freed: Freed,
    gpu_before: f64,
    gpu_after: f64,
}

impl Cleanups {
    pub(super) fn observe(&mut self, e: &Entry) {
        let is_cleanup =
            e.kind == EntryKind::Event && CLEANUP_OPERATIONS.contains(&e.operation.as_str());
        if let (true, Some((host, source, gpu))) = (is_cleanup, self.last) {
            self.calls += 1;
            match (gpu, pool(e)) {
                (Some(b), Some(a)) if source == e.gpu_source && (a > 0.0 || b > 0.0) => {
                    self.gpu_freed.add(b - a);
                    self.gpu_before += b;
                    self.gpu_after += a;
                }
                _ => self.host_freed.add(host - e.figures.cpu_ram_used_mb),
            }
        }
        // What was held before the call: the highest figures since the
        // job's previous mark (a timer sample may land while the call
        // frees, and must not hide what it freed).
        match (e.kind, &mut self.last) {
            (EntryKind::Event, _) | (EntryKind::Timer, None) => {
                self.last = Some((e.figures.cpu_ram_used_mb, e.gpu_source, pool(e)));
            }
            (EntryKind::Timer, Some((host, source, gpu))) => {
                *host = host.max(e.figures.cpu_ram_used_mb);
                if *source == e.gpu_source {
                    *gpu = match (*gpu, pool(e)) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                }
            }
            (EntryKind::System, _) => {}
        }
    }

    pub(super) fn advise(&self) -> Option<Advice> {
        if self.calls == 0 {
            return None;
        }
        let on_gpu = self.gpu_freed.calls > 0;
        let (freed, what) = if on_gpu {
            (self.gpu_freed, "PyTorch's reserved GPU memory")
        } else {
            (self.host_freed, "host memory")
        };
        let n = freed.calls as f64;
        let mean = freed.sum / n;
        let most = freed.most;
        let s = if self.calls == 1 { "" } else { "s" };
        let calls = self.calls;
        let advice = if most < USELESS_MIB {
            Advice::new(
                "cleanup-useless",
                Severity::Info,
                format!(
                    "{calls} cleanup call{s} freed at most {} of {what} ({} on average)",
                    size(most.max(0.0)),
                    size(mean)
                ),
                "the calls free nothing here: drop them (torch.cuda.empty_cache() in a loop \
                 costs time and the allocator reserves the memory again at once)"
                    .to_string(),
            )
        } else if mean >= HELPS_MIB {
            let mut finding = format!(
                "{calls} cleanup call{s} freed {} of {what} on average (at most {})",
                size(mean),
                size(most)
            );
            if on_gpu {
                finding.push_str(&format!(
                    "; reserved before {} → after {}",
                    size(self.gpu_before / n),
                    size(self.gpu_after / n)
                ));
            }
            Advice::new(
                "cleanup-helps",
                Severity::Info,
                finding,
                "keep the calls where they are: the memory they free is what the next phase \
                 gets"
                    .to_string(),
            )
        } else {
            return None;
        };
        Some(
            advice
                .figure("calls", calls as f64)
                .figure("freed_mean_mb", mean)
                .figure("freed_max_mb", most),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    fn gpu(mut e: Entry, reserved: f64) -> Entry {
        e.gpu_source = GpuSource::Allocator;
        e.figures.reserved_gpu_ram_mb = reserved;
        e
    }

    #[test]
    fn calls_that_return_nothing_are_useless() {
        let mut d = doc();
        for i in 0..5 {
            let t = 1000.0 + 10.0 * i as f64;
            d.detailed_log
                .push(gpu(entry(t, "train", "step", 900.0), 8000.0));
            d.detailed_log
                .push(gpu(entry(t + 1.0, "system", "clear_memory", 900.0), 7996.0));
        }
        let a = super::super::advise(&d);
        assert_eq!(a.len(), 1, "{a:#?}");
        assert_eq!(a[0].code, "cleanup-useless");
        assert_eq!(a[0].figures["calls"], 5.0);
        assert_eq!(a[0].figures["freed_max_mb"], 4.0);
    }

    #[test]
    fn calls_that_return_the_pool_help() {
        let mut d = doc();
        d.detailed_log
            .push(gpu(entry(1000.0, "eval", "end", 900.0), 12_000.0));
        d.detailed_log
            .push(gpu(entry(1001.0, "system", "clear_memory", 900.0), 4_000.0));
        let a = super::super::advise(&d);
        assert_eq!(a[0].code, "cleanup-helps");
        assert_eq!(a[0].figures["freed_mean_mb"], 8000.0);
        assert!(
            a[0].finding
                .contains("reserved before 11.7 GiB → after 3.9 GiB"),
            "{}",
            a[0].finding
        );
    }

    #[test]
    fn a_sample_taken_while_the_call_frees_does_not_hide_it() {
        let mut d = doc();
        d.detailed_log.push(entry(1000.0, "train", "epoch", 216.0));
        d.detailed_log.push(timer(1000.05, 180.0));
        d.detailed_log.push(timer(1000.10, 18.0));
        d.detailed_log
            .push(entry(1000.12, "train", "clear_memory", 18.0));
        let a = super::super::advise(&d);
        assert_eq!(a[0].code, "cleanup-helps");
        assert_eq!(a[0].figures["freed_max_mb"], 198.0);
    }

    #[test]
    fn host_only_cleanups_use_the_host_figure_and_middling_ones_stay_silent() {
        let mut d = doc();
        d.detailed_log.push(entry(1000.0, "a", "b", 900.0));
        d.detailed_log
            .push(entry(1001.0, "system", "clear_memory", 600.0));
        assert_eq!(super::super::advise(&d)[0].code, "cleanup-helps");
        let mut d = doc();
        d.detailed_log.push(entry(1000.0, "a", "b", 900.0));
        d.detailed_log
            .push(entry(1001.0, "system", "clear_memory", 870.0));
        assert!(super::super::advise(&d).is_empty());
    }
}
