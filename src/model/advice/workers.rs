//! `worker-cost` and `copy-on-read`: what a process's workers cost, each
//! alone (its unique memory, USS) and together, and whether that cost
//! grew by copying the parent's data page by page.
//!
//! A forked worker starts sharing every page with its parent. Reading a
//! Python object writes its reference count, which makes the page holding
//! it the worker's own copy: the worker's USS grows while its RSS stays
//! where it was (the page was already mapped). That growth, summed over
//! the workers, is what holding the data as NumPy arrays, tensors or
//! Arrow tables (no per-object header written on read) would save.

use std::collections::BTreeMap;

use super::item::{size, Advice, Level};
use crate::model::{DocumentOf, Target};

/// Workers together costing less than this (MiB) are not worth a line.
const MIN_WORKERS_MIB: f64 = 32.0;

/// Copy-on-read is named when the workers' USS grew by at least this
/// (MiB, all workers)…
const MIN_COPY_MIB: f64 = 64.0;

/// …and their RSS grew by at most this share of it (the rest of the
/// growth turned shared pages private).
const MAX_RSS_SHARE: f64 = 0.5;

/// One worker's figures, MiB.
struct Worker {
    pid: u32,
    /// Unique memory at its peak.
    own: f64,
    /// Unique memory at the first read.
    first_own: Option<f64>,
    /// RSS at the first own-cost read and at the peak.
    first_rss: Option<f64>,
    rss: f64,
}

impl Worker {
    fn of(t: &Target) -> Option<Worker> {
        let own = t.peak_uss_mb.or(t.uss_mb)?;
        let first = t.own_series.first();
        let first_rss = first.and_then(|p| rss_at(t, p[0]));
        Some(Worker {
            pid: t.pid,
            own,
            first_own: first.map(|p| p[1]),
            first_rss,
            rss: t.peak_rss_mb.max(t.last_rss_mb),
        })
    }

    /// USS growth since the first read.
    fn growth(&self) -> f64 {
        self.first_own.map_or(0.0, |f| (self.own - f).max(0.0))
    }

    fn rss_growth(&self) -> f64 {
        self.first_rss.map_or(0.0, |f| (self.rss - f).max(0.0))
    }
}

/// The RSS of `t`'s series point nearest to time `at`.
fn rss_at(t: &Target, at: f64) -> Option<f64> {
    t.series
        .iter()
        .min_by(|a, b| (a[0] - at).abs().total_cmp(&(b[0] - at).abs()))
        .map(|p| p[1])
}

/// The parent with the most children in the tree, and those children.
fn busiest_parent(targets: &[Target]) -> Option<(&Target, Vec<&Target>)> {
    let mut children: BTreeMap<u32, Vec<&Target>> = BTreeMap::new();
    for t in targets {
        if !t.root && t.ppid != 0 && targets.iter().any(|p| p.pid == t.ppid) {
            children.entry(t.ppid).or_default().push(t);
        }
    }
    let (ppid, kids) = children.into_iter().max_by_key(|(_, k)| k.len())?;
    let parent = targets.iter().find(|p| p.pid == ppid)?;
    Some((parent, kids))
}

/// `worker-cost` (and `copy-on-read` when the cost grew by copying).
pub(super) fn advise<L>(doc: &DocumentOf<L>) -> Vec<Advice> {
    let Some((parent, kids)) = busiest_parent(&doc.targets) else {
        return Vec::new();
    };
    let workers: Vec<Worker> = kids.iter().filter_map(|t| Worker::of(t)).collect();
    let total: f64 = workers.iter().map(|w| w.own).sum();
    if workers.is_empty() || total < MIN_WORKERS_MIB {
        return Vec::new();
    }
    let n = workers.len();
    let mean = total / n as f64;
    let (lo, hi) = workers.iter().fold((f64::MAX, 0.0f64), |(lo, hi), w| {
        (lo.min(w.own), hi.max(w.own))
    });
    let shared: f64 = workers
        .iter()
        .map(|w| (w.rss - w.own).max(0.0))
        .sum::<f64>()
        / n as f64;
    let parent_own = parent.peak_uss_mb.or(parent.uss_mb);
    let copies: f64 = workers.iter().map(Worker::growth).sum();
    let rss_growth: f64 = workers.iter().map(Worker::rss_growth).sum();
    let copy_on_read = copies >= MIN_COPY_MIB && rss_growth <= MAX_RSS_SHARE * copies;
    let s = if n == 1 { "" } else { "s" };
    let mut finding = format!(
        "{n} worker{s} of PID {} ({}) cost {} together",
        parent.pid,
        parent.name,
        size(total)
    );
    if copy_on_read {
        finding.push_str(&format!(
            " of which {} is copies of the parent's data",
            size(copies)
        ));
    }
    finding.push_str(&format!(
        "; each alone {} (from {} to {}), sharing {} with the parent",
        size(mean),
        size(lo),
        size(hi),
        size(shared)
    ));
    if let Some(p) = parent_own {
        finding.push_str(&format!(" (the parent alone: {})", size(p)));
    }
    let action = if n > 1 {
        format!(
            "each worker fewer saves about {}; size the machine for the parent plus {} per worker",
            size(mean),
            size(mean)
        )
    } else {
        format!("the worker costs {} on top of the parent", size(mean))
    };
    let mut cost = Advice::new("worker-cost", Level::Info, finding, action)
        .figure("workers", n as f64)
        .figure("workers_uss_mb", total)
        .figure("worker_uss_mean_mb", mean)
        .figure("worker_shared_mean_mb", shared)
        .figure("copies_mb", copies);
    if let Some(p) = parent_own {
        cost = cost.figure("parent_uss_mb", p);
    }
    for w in &workers {
        cost = cost.figure(&format!("worker_{}_uss_mb", w.pid), w.own);
    }
    let mut out = vec![cost];
    if copy_on_read {
        out.push(copy_advice(parent, &workers, copies, rss_growth));
    }
    out
}

fn copy_advice(parent: &Target, workers: &[Worker], copies: f64, rss_growth: f64) -> Advice {
    let n = workers.len();
    let each = copies / n as f64;
    let finding = format!(
        "the workers' own memory grew by {} ({} per worker) while their RSS grew by {}: \
         reading PID {}'s Python objects turned shared pages into private copies",
        size(copies),
        size(each),
        size(rss_growth),
        parent.pid
    );
    let action = format!(
        "hold the dataset as NumPy arrays, torch tensors or an Arrow table instead of Python \
         lists/dicts of objects (reading them writes no reference count), which saves about {}; \
         or use fewer workers ({} each)",
        size(copies),
        size(each)
    );
    let mut a = Advice::new("copy-on-read", Level::Warning, finding, action)
        .figure("workers", n as f64)
        .figure("copies_mb", copies)
        .figure("copies_per_worker_mb", each)
        .figure("rss_growth_mb", rss_growth)
        .figure("projected_saving_mb", copies);
    for w in workers {
        a = a.figure(&format!("worker_{}_growth_mb", w.pid), w.growth());
    }
    a
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// A parent with `n` workers whose USS went from `from` to `to` MiB
    /// while RSS stayed at `rss`.
    fn forked(n: u32, from: f64, to: f64, rss: f64) -> crate::model::Document {
        let mut d = doc();
        let mut parent = target(100, 1, true, 2000.0);
        parent.peak_uss_mb = Some(1900.0);
        d.targets.push(parent);
        for i in 0..n {
            let mut w = target(200 + i, 100, false, rss);
            w.series = vec![[1010.0, rss, 0.0], [1050.0, rss, 0.0]];
            w.own_series = vec![[1010.0, from, 0.0], [1050.0, to, 0.0]];
            w.uss_mb = Some(to);
            w.peak_uss_mb = Some(to);
            d.targets.push(w);
        }
        d
    }

    #[test]
    fn workers_copying_the_parents_objects_get_both_rules() {
        // Recorded shape: 8 workers, each 6 → 306 MiB own, RSS flat at 2 GiB.
        let d = forked(8, 6.0, 306.0, 2048.0);
        let a = advise(&d);
        assert_eq!(a.len(), 2, "{a:#?}");
        assert_eq!(a[0].code, "worker-cost");
        assert_eq!(a[0].figures["workers"], 8.0);
        assert_eq!(a[0].figures["workers_uss_mb"], 8.0 * 306.0);
        assert_eq!(a[0].figures["worker_203_uss_mb"], 306.0);
        assert_eq!(a[0].figures["worker_shared_mean_mb"], 2048.0 - 306.0);
        assert!(
            a[0].finding.starts_with(
                "8 workers of PID 100 (python3) cost 2.4 GiB together of which 2.3 GiB is copies"
            ),
            "{}",
            a[0].finding
        );
        assert_eq!(a[1].code, "copy-on-read");
        assert_eq!(a[1].level, Level::Warning);
        assert_eq!(a[1].figures["projected_saving_mb"], 8.0 * 300.0);
        assert!(a[1].action.contains("NumPy"), "{}", a[1].action);
    }

    #[test]
    fn workers_allocating_their_own_memory_are_not_copy_on_read() {
        // The USS growth came with as much RSS growth: new allocations.
        let mut d = forked(4, 6.0, 306.0, 2048.0);
        for w in d.targets.iter_mut().filter(|t| !t.root) {
            w.series = vec![[1010.0, 1748.0, 0.0], [1050.0, 2048.0, 0.0]];
        }
        let a = advise(&d);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].code, "worker-cost");
        assert!(!a[0].finding.contains("copies"), "{}", a[0].finding);
    }

    #[test]
    fn small_or_unmeasured_workers_stay_silent() {
        assert!(advise(&forked(2, 3.0, 8.0, 40.0)).is_empty());
        let mut d = forked(3, 6.0, 306.0, 2048.0);
        for w in &mut d.targets {
            w.uss_mb = None;
            w.peak_uss_mb = None;
        }
        assert!(advise(&d).is_empty());
        let mut lone = doc();
        lone.targets.push(target(100, 1, true, 2000.0));
        assert!(advise(&lone).is_empty());
    }
}
