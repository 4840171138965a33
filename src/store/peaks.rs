//! Peaks: every entry folds into the run's peaks, its component's peaks
//! (bounded by [`Limits::max_components`](super::limits::Limits::max_components),
//! the rest under [`OTHER`]) and the peaks of the stages open at the time.

use super::limits::{admit, OTHER};
use super::state::Store;
use crate::model::Entry;
use crate::units::mib;

impl Store {
    /// Folds an entry into the overall, component and open-stage peaks.
    /// The entry keeps the component the job named; its peaks count under
    /// [`OTHER`] once `max_components` others have their own.
    pub(super) fn observe(&mut self, entry: &Entry, n: u64) {
        self.peaks.run.observe_weighted(entry, n);
        let known = self.peaks.by_component.contains_key(&entry.component);
        let component = if admit(
            known,
            self.peaks.by_component.len(),
            self.limits.max_components,
        ) {
            entry.component.as_str()
        } else {
            self.counters.components_folded += 1;
            OTHER
        };
        if let Some(p) = self.peaks.by_component.get_mut(component) {
            p.observe_weighted(entry, n);
        } else {
            self.peaks
                .by_component
                .entry(component.to_string())
                .or_default()
                .observe_weighted(entry, n);
        }
        for stage in self.stages.list.iter_mut().filter(|s| s.end.is_none()) {
            stage.peak.observe_weighted(entry, n);
        }
    }

    /// Folds an entry into the overall and open-stage peaks only (a
    /// stage's boundary: no component of its own).
    pub(super) fn observe_outside_components(&mut self, entry: &Entry, n: u64) {
        self.peaks.run.observe_weighted(entry, n);
        for stage in self.stages.list.iter_mut().filter(|s| s.end.is_none()) {
            stage.peak.observe_weighted(entry, n);
        }
    }

    /// A reaped process's peak RSS from `wait4`, exact even when it died
    /// before a tick read its `VmHWM`: the tree held at least that much.
    pub(super) fn exact_peak(&mut self, max_rss: u64) {
        self.peaks.run.figures.cpu_ram_hwm_mb =
            self.peaks.run.figures.cpu_ram_hwm_mb.max(mib(max_rss));
    }
}
