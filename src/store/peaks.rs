//! Peaks: every entry folds into the run's peaks, its component's peaks
//! (bounded by [`Limits::max_components`](super::limits::Limits::max_components),
//! the rest under [`OTHER`]) and the peaks of the stages open at the time.

use std::collections::BTreeMap;

use super::limits::{admit, OTHER};
use crate::model::{Entry, Peaks};
use crate::units::mib;

/// The peaks' state: the run's, and each component's.
#[derive(Debug, Clone, Default)]
pub(super) struct PeaksState {
    pub(super) run: Peaks,
    pub(super) by_component: BTreeMap<String, Peaks>,
}

impl PeaksState {
    /// Folds an entry into the run's and its component's peaks. The
    /// entry keeps the component the job named; its peaks count under
    /// [`OTHER`] once `max_components` others have their own (counted in
    /// `folded`).
    pub(super) fn observe(
        &mut self,
        entry: &Entry,
        n: u64,
        max_components: usize,
        folded: &mut u64,
    ) {
        self.run.observe_weighted(entry, n);
        let known = self.by_component.contains_key(&entry.component);
        let component = if admit(known, self.by_component.len(), max_components) {
            entry.component.as_str()
        } else {
            *folded += 1;
            OTHER
        };
        if let Some(p) = self.by_component.get_mut(component) {
            p.observe_weighted(entry, n);
        } else {
            self.by_component
                .entry(component.to_string())
                .or_default()
                .observe_weighted(entry, n);
        }
    }

    /// A reaped process's peak RSS from `wait4`, exact even when it died
    /// before a tick read its `VmHWM`: the tree held at least that much.
    pub(super) fn exact_peak(&mut self, max_rss: u64) {
        let hwm = &mut self.run.figures.cpu_ram_hwm_mb;
        *hwm = hwm.max(mib(max_rss));
    }
}
