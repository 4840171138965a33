//! What the engine writes: records appended to the journal, its flushes
//! (acks wait for them), checkpoints started on their own thread, and the
//! final document.

use std::time::Instant;

use super::{Ended, Engine};
use crate::store::journal::JournalError;
use crate::store::Record;

impl Engine {
    /// Appends a record the store has just applied.
    pub(super) fn journal_append(&mut self, record: &Record) {
        if let Some(j) = &mut self.journal {
            if let Err(e) = j.append(self.store.seq, record) {
                self.store.counters_mut().journal_errors += 1;
                if let Some(n) = self.journal_errors.hit() {
                    tracing::warn!("cannot append to the journal ({n} times so far): {e}");
                }
            }
            self.unflushed = true;
        }
    }

    /// Journals the count of journal errors when it grew: it lives in the
    /// store, and a checkpoint that could not be written (no inode left)
    /// would otherwise lose it to a `kill -9`, the recovered JSON saying 0
    /// though the failure was logged.
    pub(super) fn record_journal_errors(&mut self) {
        let total = self.store.counters().journal_errors;
        if self.journal.is_some() && total > self.journal_errors_recorded {
            self.journal_errors_recorded = total;
            let record = Record::JournalErrors { total };
            self.store.apply(&record);
            self.journal_append(&record);
        }
    }

    /// Hands the batch's records to the kernel, then sends the acks that
    /// waited for them: an ack means recorded.
    pub(super) fn acknowledge(&mut self) {
        if !self.replies.is_empty() {
            self.flush_journal(Instant::now());
            for (reply, line) in self.replies.drain(..) {
                let _ = reply.send(line);
            }
        }
    }

    /// Flushes when an event waits, or buffered samples are old enough.
    pub(super) fn flush_if_due(&mut self, now: Instant) {
        if self.unflushed_event
            || self.unflushed && now.duration_since(self.last_flush) >= self.opts.journal_flush
        {
            self.flush_journal(now);
        }
    }

    fn flush_journal(&mut self, now: Instant) {
        self.last_flush = now;
        self.unflushed = false;
        self.unflushed_event = false;
        if let Some(j) = &mut self.journal {
            if let Err(e) = j.flush() {
                self.store.counters_mut().journal_errors += 1;
                if let Some(n) = self.journal_errors.hit() {
                    tracing::warn!("cannot write the journal ({n} times so far): {e}");
                }
            }
            // How far the run went, even when the disk refused the records.
            j.note_tally(&self.store);
        }
    }

    /// Checkpoints are written on their own thread; here they are only
    /// started (a clone of the store) and their outcome collected.
    pub(super) fn checkpoint_if_due(&mut self, now: Instant) {
        if let Some(done) = self.journal.as_mut().and_then(|j| j.poll_checkpoint()) {
            self.checkpoint_done(done);
        }
        if self.checkpoint_soon
            || now.duration_since(self.last_checkpoint) >= self.opts.checkpoint_interval
        {
            self.checkpoint_soon = false;
            self.last_checkpoint = now;
            if let Some(j) = &mut self.journal {
                match j.start_checkpoint(self.store.clone()) {
                    Ok(true) => self.checkpoint.seq = self.store.seq,
                    Ok(false) => tracing::debug!(
                        "the previous checkpoint is still being written; skipping this one"
                    ),
                    Err(e @ JournalError::Rotate { .. }) => {
                        self.store.counters_mut().journal_errors += 1;
                        if let Some(n) = self.journal_errors.hit() {
                            tracing::warn!("journal error ({n} so far): {e}");
                        }
                    }
                    Err(e) => self.checkpoint_done(Err(e)),
                }
            }
        }
    }

    fn checkpoint_done(&mut self, result: Result<(), JournalError>) {
        match result {
            Ok(()) => {
                self.checkpoint.count += 1;
                if let Some(j) = &self.journal {
                    self.checkpoint.path = j.document();
                }
                for tx in self
                    .outputs
                    .feeds
                    .iter()
                    .filter_map(|f| f.checkpoints.as_ref())
                {
                    tx.send_replace(self.checkpoint.clone());
                }
            }
            Err(e) => {
                self.store.counters_mut().checkpoint_errors += 1;
                tracing::warn!("checkpoint failed (the journal still holds every record): {e}");
            }
        }
    }

    /// Writes the final document and closes the journal.
    pub(super) fn write_final(&mut self, ended: &mut Ended) {
        if let Some(j) = self.journal.take() {
            if let Err(e) = j.finish(&self.store) {
                tracing::error!("{e}");
                ended.write_error = Some(e.to_string());
            }
        }
    }
}
