//! `worker-cost` and `copy-on-read`: what a process's workers cost, each
//! alone (its unique memory, USS) and together, and whether that cost
//! is copies of the parent's data.
//!
//! A forked worker starts sharing every page with its parent: its RSS is
//! the parent's at the fork. Reading a Python object writes its
//! reference count, which makes the page holding it the worker's own
//! copy: the worker's USS grows while its RSS stays where it was (the
//! page was already mapped). Memory a worker allocates for itself grows
//! both. So a worker's copies are its USS less what its RSS grew beyond
//! the mapping it was forked with — readable whenever it was first seen,
//! which matters for workers that copy in their first second, or live
//! one epoch (PyTorch's default, `persistent_workers=False`: the workers
//! are forked again each epoch). Those copies, summed over the workers
//! alive at once, are what holding the data as NumPy arrays, tensors or
//! Arrow tables (no per-object header written on read) would save.
//!
//! Workers re-forked each epoch are counted once each, and "together"
//! is the most alive at once (the workers of one epoch), not the sum
//! over the run.
//!
//! A worker whose own cost no read reached once it held its size (the
//! reader's budget spent on a busy machine) has an estimate instead: its
//! last read plus what it wrote since. The advice says how many are
//! estimated (`workers_estimated`, and `worker_PID_uss_estimated` for
//! each): an estimate is not a read.

use std::collections::BTreeMap;

use super::item::{size, Advice, Severity};
use crate::model::{DocumentOf, Target};

/// Workers together costing less than this (MiB) are not worth a line.
const MIN_WORKERS_MIB: f64 = 32.0;

/// Copy-on-read is named when the workers alive at once hold at least
/// this much of copies (MiB)…
const MIN_COPY_MIB: f64 = 64.0;

/// …and copies are at least this share of their own memory.
const MIN_COPY_SHARE: f64 = 0.5;

/// One worker's figures, MiB.
struct Worker {
    pid: u32,
    /// Unique memory at its peak (the last reads before an epoch's
    /// workers end).
    own: f64,
    /// RSS at its peak.
    rss: f64,
    /// What it mapped when it was forked: the parent's RSS then (or its
    /// own first RSS, when lower).
    forked_rss: f64,
    /// When it was first and last seen alive.
    start: f64,
    end: f64,
    /// `own` is an estimate, not a read.
    estimated: bool,
}

impl Worker {
    fn of(t: &Target, parent: &Target) -> Option<Worker> {
        let (own, estimated) = match t.peak_uss_mb {
            Some(p) => (p, t.peak_uss_estimated),
            None => (t.uss_mb?, t.own_estimated),
        };
        let rss = t.peak_rss_mb.max(t.last_rss_mb);
        let parent_rss = rss_at(parent, t.first_seen).unwrap_or(parent.peak_rss_mb);
        let first_rss = t.series.first().map_or(rss, |p| p[1]);
        Some(Worker {
            pid: t.pid,
            own,
            rss,
            forked_rss: parent_rss.min(first_rss),
            start: t.first_seen,
            end: t.last_seen.max(t.first_seen),
            estimated,
        })
    }

    /// RSS beyond the mapping it was forked with: memory of its own.
    fn fresh(&self) -> f64 {
        (self.rss - self.forked_rss).max(0.0)
    }

    /// Its own memory that is not fresh: pages it shared with the parent
    /// and turned private.
    fn copies(&self) -> f64 {
        (self.own - self.fresh()).max(0.0)
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

/// The workers in sets alive at the same time (an epoch's, when they
/// are forked again each epoch): indices into `workers`, in time order.
fn sets(workers: &[Worker]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..workers.len()).collect();
    order.sort_by(|a, b| workers[*a].start.total_cmp(&workers[*b].start));
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut until = f64::NEG_INFINITY;
    for i in order {
        let w = &workers[i];
        match out.last_mut() {
            Some(set) if w.start < until => set.push(i),
            _ => out.push(vec![i]),
        }
        until = if out.last().is_some_and(|s| s.len() == 1) {
            w.end
        } else {
            until.max(w.end)
        };
    }
    out
}

/// The highest sum of `f` over one set of workers alive at once.
fn at_once(workers: &[Worker], sets: &[Vec<usize>], f: impl Fn(&Worker) -> f64) -> f64 {
    sets.iter()
        .map(|s| s.iter().map(|i| f(&workers[*i])).sum::<f64>())
        .fold(0.0, f64::max)
}

/// `worker-cost` (and `copy-on-read` when the cost is copies).
pub(super) fn advise<L>(doc: &DocumentOf<L>) -> Vec<Advice> {
    let Some((parent, kids)) = busiest_parent(&doc.targets) else {
        return Vec::new();
    };
    let workers: Vec<Worker> = kids.iter().filter_map(|t| Worker::of(t, parent)).collect();
    let sets = sets(&workers);
    let total = at_once(&workers, &sets, |w| w.own);
    if workers.is_empty() || total < MIN_WORKERS_MIB {
        return Vec::new();
    }
    let n = workers.len();
    let most = sets.iter().map(Vec::len).max().unwrap_or(0);
    let mean = workers.iter().map(|w| w.own).sum::<f64>() / n as f64;
    let (lo, hi) = workers.iter().fold((f64::MAX, 0.0f64), |(lo, hi), w| {
        (lo.min(w.own), hi.max(w.own))
    });
    let shared: f64 = workers
        .iter()
        .map(|w| (w.rss - w.own).max(0.0))
        .sum::<f64>()
        / n as f64;
    let parent_own = parent.peak_uss_mb.or(parent.uss_mb);
    let copies = at_once(&workers, &sets, Worker::copies);
    let fresh = at_once(&workers, &sets, Worker::fresh);
    let copy_on_read = copies >= MIN_COPY_MIB && copies >= MIN_COPY_SHARE * total;
    let s = if n == 1 { "" } else { "s" };
    let mut finding = if sets.len() > 1 {
        format!(
            "{n} workers of PID {} ({}), forked in {} sets of up to {most} (a set per epoch), \
             cost {} together at once",
            parent.pid,
            parent.name,
            sets.len(),
            size(total)
        )
    } else {
        format!(
            "{n} worker{s} of PID {} ({}) cost {} together",
            parent.pid,
            parent.name,
            size(total)
        )
    };
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
    let estimated = workers.iter().filter(|w| w.estimated).count();
    if estimated > 0 {
        finding.push_str(&format!(
            "; {estimated} of the {n} estimated from what they wrote since their last read \
             (no read came while they held their size)"
        ));
    }
    let action = if most > 1 {
        format!(
            "each worker fewer saves about {}; size the machine for the parent plus {} per worker",
            size(mean),
            size(mean)
        )
    } else {
        format!("the worker costs {} on top of the parent", size(mean))
    };
    let mut cost = Advice::new("worker-cost", Severity::Info, finding, action)
        .figure("workers", n as f64)
        .figure("workers_at_once", most as f64)
        .figure("worker_sets", sets.len() as f64)
        .figure("workers_uss_mb", total)
        .figure("worker_uss_mean_mb", mean)
        .figure("worker_shared_mean_mb", shared)
        .figure("copies_mb", copies)
        .figure("workers_estimated", estimated as f64);
    if let Some(p) = parent_own {
        cost = cost.figure("parent_uss_mb", p);
    }
    for w in &workers {
        cost = cost.figure(&format!("worker_{}_uss_mb", w.pid), w.own);
        if w.estimated {
            cost = cost.figure(&format!("worker_{}_uss_estimated", w.pid), 1.0);
        }
    }
    let mut out = vec![cost];
    if copy_on_read {
        out.push(copy_advice(parent, &workers, most, copies, fresh));
    }
    out
}

fn copy_advice(
    parent: &Target,
    workers: &[Worker],
    most: usize,
    copies: f64,
    fresh: f64,
) -> Advice {
    let each = copies / most.max(1) as f64;
    let finding = format!(
        "the workers alive at once hold {} of copies ({} per worker) beyond {} of memory of \
         their own: reading PID {}'s Python objects turned shared pages into private copies",
        size(copies),
        size(each),
        size(fresh),
        parent.pid
    );
    let action = format!(
        "hold the dataset as NumPy arrays, torch tensors or an Arrow table instead of Python \
         lists/dicts of objects (reading them writes no reference count), which saves about {}; \
         or use fewer workers ({} each)",
        size(copies),
        size(each)
    );
    let mut a = Advice::new("copy-on-read", Severity::Warning, finding, action)
        .figure("workers", workers.len() as f64)
        .figure("copies_mb", copies)
        .figure("copies_per_worker_mb", each)
        .figure("rss_growth_mb", fresh)
        .figure("projected_saving_mb", copies)
        .figure(
            "workers_estimated",
            workers.iter().filter(|w| w.estimated).count() as f64,
        );
    for w in workers {
        a = a.figure(&format!("worker_{}_growth_mb", w.pid), w.copies());
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
        let mut parent = target(100, 1, true, rss);
        parent.peak_uss_mb = Some(1900.0);
        d.targets.push(parent);
        for i in 0..n {
            let mut w = target(200 + i, 100, false, rss);
            w.first_seen = 1010.0;
            w.last_seen = 1050.0;
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
                "8 workers of PID 100 (python3) cost 2.4 GiB together of which 2.4 GiB is copies"
            ),
            "{}",
            a[0].finding
        );
        assert_eq!(a[1].code, "copy-on-read");
        assert_eq!(a[1].level, Severity::Warning);
        assert_eq!(a[1].figures["projected_saving_mb"], 8.0 * 306.0);
        assert!(a[1].action.contains("NumPy"), "{}", a[1].action);
    }

    #[test]
    fn workers_forked_again_each_epoch_are_all_counted_and_summed_per_epoch() {
        // Three epochs of 4 workers, each first read after it copied
        // (its USS never grew between reads).
        let mut d = forked(0, 0.0, 0.0, 0.0);
        d.targets[0].last_rss_mb = 2048.0;
        d.targets[0].peak_rss_mb = 2048.0;
        for epoch in 0..3u32 {
            for i in 0..4u32 {
                let t0 = 1000.0 + 20.0 * epoch as f64;
                let mut w = target(300 + 10 * epoch + i, 100, false, 2050.0);
                w.first_seen = t0 + 0.5;
                w.last_seen = t0 + 15.0;
                w.exited_at = Some(t0 + 15.2);
                w.series = vec![[t0 + 0.5, 2050.0, 0.0]];
                w.own_series = vec![[t0 + 0.5, 120.0, 0.0]];
                w.uss_mb = Some(120.0);
                w.peak_uss_mb = Some(120.0);
                d.targets.push(w);
            }
        }
        let a = advise(&d);
        assert_eq!(a.len(), 2, "{a:#?}");
        assert_eq!(a[0].figures["workers"], 12.0);
        assert_eq!(a[0].figures["workers_at_once"], 4.0);
        assert_eq!(a[0].figures["worker_sets"], 3.0);
        assert_eq!(a[0].figures["workers_uss_mb"], 480.0);
        assert_eq!(a[0].figures["worker_uss_mean_mb"], 120.0);
        assert!(
            a[0].finding
                .starts_with("12 workers of PID 100 (python3), forked in 3 sets of up to 4 (a set per epoch), cost 480 MiB together at once"),
            "{}",
            a[0].finding
        );
        assert_eq!(a[1].code, "copy-on-read");
        // Each worker's RSS is 2 MiB past the parent's at the fork.
        assert_eq!(a[1].figures["copies_mb"], 4.0 * 118.0);
        assert_eq!(a[1].figures["copies_per_worker_mb"], 118.0);
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
    fn workers_whose_cost_was_estimated_are_named_as_such() {
        let mut d = forked(4, 6.0, 306.0, 2048.0);
        for w in d.targets.iter_mut().filter(|t| t.pid >= 202) {
            w.peak_uss_estimated = true;
        }
        let a = advise(&d);
        assert_eq!(a[0].figures["workers_estimated"], 2.0);
        assert_eq!(a[0].figures["worker_202_uss_estimated"], 1.0);
        assert!(!a[0].figures.contains_key("worker_201_uss_estimated"));
        assert!(
            a[0].finding
                .contains("2 of the 4 estimated from what they wrote since"),
            "{}",
            a[0].finding
        );
        assert_eq!(a[1].figures["workers_estimated"], 2.0);
        let read = advise(&forked(4, 6.0, 306.0, 2048.0));
        assert_eq!(read[0].figures["workers_estimated"], 0.0);
        assert!(
            !read[0].finding.contains("estimated"),
            "{}",
            read[0].finding
        );
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
