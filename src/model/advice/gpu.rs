//! `foreign-gpu-memory`: memory on the job's GPUs held by processes
//! outside the followed tree (device used − the tree's use), which the
//! job cannot have.

use super::item::{size, Advice, Severity};
use crate::model::{AttributionMode, DocumentOf, Gpu};

/// Less than this (MiB, and 5 % of the card) is not named: a card's used
/// memory includes the driver's own few hundred MiB even when the job is
/// alone on it.
pub(super) const MIN_FOREIGN_MIB: f64 = 1024.0;

/// A card's memory held by others at the last sample, MiB.
fn foreign_on(g: &Gpu) -> f64 {
    (g.used_mb - g.tree_used_mb).max(0.0)
}

/// The job's GPUs: those its processes used.
fn jobs_gpus<L>(doc: &DocumentOf<L>) -> impl Iterator<Item = &Gpu> {
    doc.gpus.iter().filter(|g| g.peak_tree_used_mb > 0.0)
}

/// Others' memory on the job's GPUs at the last sample, MiB.
pub(super) fn foreign_mb<L>(doc: &DocumentOf<L>) -> f64 {
    jobs_gpus(doc).map(foreign_on).sum()
}

pub(super) fn foreign<L>(doc: &DocumentOf<L>) -> Vec<Advice> {
    // Device-level figures (memtrack in a PID namespace that could not map
    // NVML's host PIDs) count every process on the card as the job's: the
    // others' share is unknown there, not zero, so nothing is said.
    if doc
        .gpu_attribution
        .as_ref()
        .is_some_and(|a| a.mode != AttributionMode::PerProcess)
    {
        return Vec::new();
    }
    jobs_gpus(doc)
        .filter(|g| {
            let f = foreign_on(g);
            f >= MIN_FOREIGN_MIB && f >= 0.05 * g.total_mb
        })
        .map(|g| {
            let f = foreign_on(g);
            Advice::new(
                "foreign-gpu-memory",
                Severity::Warning,
                format!(
                    "GPU {} ({}) had {} used of {}, {} of it held outside this job by other \
                     processes and the driver (the job's own: {}, at most {})",
                    g.index,
                    g.name,
                    size(g.used_mb),
                    size(g.total_mb),
                    size(f),
                    size(g.tree_used_mb),
                    size(g.peak_tree_used_mb)
                ),
                format!(
                    "the job can count on {} of this card, not {}: give it a card of its own \
                     (CUDA_VISIBLE_DEVICES) or stop the other processes (nvidia-smi lists them)",
                    size(g.total_mb - f),
                    size(g.total_mb)
                ),
            )
            .figure("gpu", g.index as f64)
            .figure("foreign_mb", f)
            .figure("used_mb", g.used_mb)
            .figure("total_mb", g.total_mb)
            .figure("tree_used_mb", g.tree_used_mb)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    fn card(used: f64, tree: f64) -> Gpu {
        Gpu {
            index: 1,
            name: "A100".into(),
            total_mb: 40_960.0,
            used_mb: used,
            peak_used_mb: used,
            tree_used_mb: tree,
            peak_tree_used_mb: tree,
            ..Gpu::default()
        }
    }

    #[test]
    fn another_process_on_the_card_is_named_with_its_share() {
        let mut d = doc();
        d.gpus.push(card(30_000.0, 20_000.0));
        let a = super::super::advise(&d);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].code, "foreign-gpu-memory");
        assert_eq!(a[0].figures["foreign_mb"], 10_000.0);
        assert!(
            a[0].finding
                .contains("9.8 GiB of it held outside this job by other processes"),
            "{}",
            a[0].finding
        );
    }

    #[test]
    fn the_drivers_small_reservations_and_unused_cards_stay_silent() {
        let mut d = doc();
        d.gpus.push(card(20_600.0, 20_000.0));
        d.gpus.push(Gpu {
            index: 2,
            ..card(30_000.0, 0.0)
        });
        assert!(super::super::advise(&d).is_empty());
    }
}
