//! The event log: where event entries are kept (memory, or the run's
//! entries file), and [`LogView`], the document's `detailed_log` read from
//! the store while it is written — the timer log merged in by time, and
//! past [`Limits::max_event_entries`](super::limits::Limits::max_event_entries)
//! thinned to one entry per kind per stretch, keeping every maximum.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use super::entries::EntriesError;
use super::state::Store;
use crate::model::thin::Mergeable;
use crate::model::{Entry, StreamError};

impl Store {
    /// entries already recorded move there first), so memory stays flat
    /// however many marks the run takes.
    pub(crate) fn keep_entries_in(&mut self, path: &Path) -> Result<(), EntriesError> {
        self.events.create_file(path)
    }

    /// Reattaches the entries file of a store read back from a
    /// checkpoint's state (see [`EntryLog::reattach`](super::entries::EntryLog::reattach)).
    pub(crate) fn reattach_entries(
        &mut self,
        path: &Path,
    ) -> Result<super::entries::Salvaged, EntriesError> {
        self.events.reattach(path)
    }

    /// Writes the event entries not yet in their file and makes it
    /// durable (before a state that counts them is written).
    pub(crate) fn sync_entries(&self) -> std::io::Result<()> {
        self.events.sync()
    }

    /// Ends recovery's use of the entries written after the checkpoint
    /// (see [`EntryLog::finish_tail`](super::entries::EntryLog::finish_tail)).
    pub(crate) fn finish_entries_tail(&mut self) -> std::io::Result<(u64, f64)> {
        self.events.finish_tail()
    }

    /// Event entries recorded (marks, spans, stages, memtrack's own).
    pub(crate) fn event_entries(&self) -> u64 {
        self.events.len()
    }

    /// Whether the document's event entries are thinned: more of them than
    /// `log.max_event_entries`. The complete event log is then written
    /// beside the document ([`Store::write_complete_events`]).
    pub(crate) fn events_thinned(&self) -> bool {
        let bound = self.limits.max_event_entries as u64;
        bound > 0 && self.events.len() > bound
    }

    /// Writes every event entry, one JSON line each, oldest first: the
    /// complete event log kept beside a thinned document.
    pub(crate) fn write_complete_events(&self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        self.events.copy_lines(w)
    }
}

/// A document's log read from the store as it is written, in time order:
/// the event entries (memory or file) with the timer log merged in by
/// time. Serializes as the entries themselves would.
#[derive(Debug)]
pub struct LogView<'a> {
    store: &'a Store,
}

impl<'a> LogView<'a> {
    /// The log of `store`.
    pub(super) fn new(store: &'a Store) -> LogView<'a> {
        LogView { store }
    }

    /// Entries in the view.
    pub(crate) fn len(&self) -> usize {
        usize::try_from(self.store.events.len()).unwrap_or(usize::MAX)
            + self.store.samples.timer.len()
    }

    /// Visits every entry in order; stops at the first error.
    pub(crate) fn try_for_each(
        &self,
        mut f: impl FnMut(&Entry) -> Result<(), StreamError>,
    ) -> Result<(), StreamError> {
        let events = self.store.events.read()?;
        let mut timer = self.store.samples.timer.iter().peekable();
        let mut emit = |e: &Entry| -> Result<(), StreamError> {
            while let Some(t) = timer.next_if(|t| t.timestamp <= e.timestamp) {
                f(t)?;
            }
            f(e)
        };
        if self.store.events_thinned() {
            let width = self.chunk_width();
            let mut chunk = Chunk::default();
            for e in events {
                chunk.add(e?);
                if chunk.seen >= width {
                    chunk.drain(&mut emit)?;
                }
            }
            chunk.drain(&mut emit)?;
        } else {
            for e in events {
                emit(&e?)?;
            }
        }
        timer.try_for_each(f)
    }

    /// Event entries per stretch of a thinned log: the bound shared by the
    /// (component, operation) pairs seen, each pair keeping one entry per
    /// stretch.
    fn chunk_width(&self) -> u64 {
        let n = self.store.events.len();
        // Pairs beyond MAX_EVENT_KINDS are not counted apart: a run with
        // that many may exceed the bound.
        let kinds = (self.store.marks.event_kinds as u64).max(1) + 2;
        let stretches = (self.store.limits.max_event_entries as u64 / kinds).max(1);
        n.div_ceil(stretches).max(1)
    }

    /// Every entry, owned (the ones that cannot be read are left out).
    #[cfg(test)]
    pub(crate) fn entries(&self) -> Vec<Entry> {
        let mut out = Vec::with_capacity(self.len());
        if let Err(e) = self.try_for_each(|e| {
            out.push(e.clone());
            Ok(())
        }) {
            tracing::warn!("the log is incomplete: {e}");
        }
        out
    }
}

/// One stretch of a thinned event log: an entry per (component,
/// operation, stage, kind), each the first such entry with the maximum of
/// every figure over the stretch (`samples`: how many it stands for,
/// `timestamp_end`: the last one's time).
#[derive(Default)]
struct Chunk {
    entries: Vec<Entry>,
    index: HashMap<(String, String, Option<String>, u8), usize>,
    seen: u64,
}

impl Chunk {
    fn add(&mut self, e: Entry) {
        self.seen += 1;
        let key = (
            e.component.clone(),
            e.operation.clone(),
            e.stage.clone(),
            e.kind as u8,
        );
        match self.index.get(&key) {
            Some(&i) => self.entries[i].absorb(&e),
            None => {
                self.index.insert(key, self.entries.len());
                self.entries.push(e);
            }
        }
    }

    fn drain(
        &mut self,
        emit: &mut impl FnMut(&Entry) -> Result<(), StreamError>,
    ) -> Result<(), StreamError> {
        self.index.clear();
        self.seen = 0;
        for e in self.entries.drain(..) {
            emit(&e)?;
        }
        Ok(())
    }
}

impl Serialize for LogView<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let len = (!self.store.events_thinned()).then(|| self.len());
        crate::model::serialize_streamed(serializer, len, |f| self.try_for_each(f))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use std::collections::BTreeMap;

    use super::super::entries;
    use super::super::limits::Limits;
    use super::super::pressure::Thresholds;
    use super::super::state::Store;
    use crate::model::{Document, Entry, EntryKind, RunInfo};

    #[test]
    fn a_store_whose_entries_live_in_a_file_writes_the_same_document() {
        let dir = tempfile::tempdir().unwrap();
        let mut mem = store();
        let mut file = store();
        file.keep_entries_in(&dir.path().join(entries::FILE))
            .unwrap();
        busy_run(&mut mem, 3000);
        busy_run(&mut file, 3000);
        let a = serde_json::to_string_pretty(&mem.document_view()).unwrap();
        let b = serde_json::to_string_pretty(&file.document_view()).unwrap();
        assert!(a.len() > 1_000_000, "{}", a.len());
        assert!(a == b, "the documents differ");
        assert_eq!(file.document(), mem.document());
    }

    #[test]
    fn past_the_bound_event_entries_are_thinned_keeping_every_maximum() {
        let bounded = |bound: usize| {
            let mut st = Store::new(
                RunInfo {
                    start: 100.0,
                    ..RunInfo::default()
                },
                Limits {
                    max_event_entries: bound,
                    ..Limits::default()
                },
                Thresholds::default(),
            );
            busy_run(&mut st, 20_000);
            st
        };
        let full = bounded(0).document();
        // Under the bound: the same document as without one.
        assert_eq!(bounded(50_000).document(), full);
        let st = bounded(1024);
        assert!(st.events_thinned());
        let thin = st.document();
        let events = |d: &Document| -> Vec<Entry> {
            d.detailed_log
                .iter()
                .filter(|e| e.kind != EntryKind::Timer)
                .cloned()
                .collect()
        };
        let (all, kept) = (events(&full), events(&thin));
        assert!(kept.len() <= 1024, "{} entries", kept.len());
        assert!(
            kept.len() > 512,
            "{} entries: the bound is used",
            kept.len()
        );
        let stands_for: u64 = kept.iter().map(|e| u64::from(e.samples.unwrap_or(1))).sum();
        assert_eq!(stands_for, all.len() as u64, "every entry is accounted for");
        // Per component and operation, every figure's maximum is kept.
        let maxima = |v: &[Entry]| {
            let mut m: BTreeMap<(String, String), [u64; 4]> = BTreeMap::new();
            for e in v {
                let x = m
                    .entry((e.component.clone(), e.operation.clone()))
                    .or_default();
                for (slot, f) in x.iter_mut().zip([
                    e.figures.cpu_ram_used_mb,
                    e.figures.gpu_ram_used_mb,
                    e.figures.reserved_gpu_ram_mb,
                    e.figures.gpu_process_used_mb,
                ]) {
                    *slot = (*slot).max(f.to_bits());
                }
            }
            m
        };
        assert_eq!(maxima(&kept), maxima(&all));
        // The timer log, peaks and everything else are untouched.
        let timers = |d: &Document| {
            d.detailed_log
                .iter()
                .filter(|e| e.kind == EntryKind::Timer)
                .count()
        };
        assert_eq!(timers(&thin), timers(&full));
        assert_eq!(
            Document {
                detailed_log: Vec::new(),
                ..thin.clone()
            },
            Document {
                detailed_log: Vec::new(),
                ..full.clone()
            }
        );
        // The complete event log beside it holds every entry.
        let mut lines = Vec::new();
        st.write_complete_events(&mut lines).unwrap();
        let back: Vec<Entry> = lines
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(back, all);
    }

    #[test]
    fn a_store_with_an_entries_file_holds_no_entries_in_memory() {
        // The store's state is everything it holds in memory: with the
        // entries in a file it stays small however many marks there are.
        let dir = tempfile::tempdir().unwrap();
        let mut st = store();
        st.keep_entries_in(&dir.path().join(entries::FILE)).unwrap();
        busy_run(&mut st, 100_000);
        assert_eq!(st.event_entries(), 100_000 + 1000 + 3);
        let mut state = Vec::new();
        super::super::checkpoint::write(&mut state, st.clone()).unwrap();
        assert!(state.len() < 3 << 20, "{} bytes", state.len());
        let mut n = 0u64;
        st.document_view()
            .detailed_log
            .try_for_each(|e| {
                n += u64::from(e.kind != EntryKind::Timer);
                Ok(())
            })
            .unwrap();
        assert_eq!(n, st.event_entries(), "every entry reads back");
    }
}
