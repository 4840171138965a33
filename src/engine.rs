//! The engine: one thread that owns the sampler, the store and the journal,
//! and handles the tick, inputs and shutdown in one loop.
//!
//! Everything that changes run state passes through here as a
//! [`Record`]: it is applied to the store and appended to the journal in
//! the same step. Other threads (the job's waiter, signal handling, the
//! socket server, exporters) talk to the engine over a bounded channel and
//! never touch its state, so nothing they do can block a tick for long.
//!
//! Ticks are scheduled on a fixed grid (`start + k·interval`): they do not
//! drift, and a tick that overruns its slot skips the missed slots (and
//! counts them) instead of piling up work.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use crate::model::{EntryKind, Exit};
use crate::sample::{gpu, Sample, Sampler};
use crate::store::journal::Journal;
use crate::store::{Mark, Outcome, Record, SampleKind, Store, SYSTEM};
use crate::sys;
use crate::units::unix_now;

/// Messages to the engine.
#[derive(Debug)]
pub enum Input {
    /// The job spawned by `run` ended (reaped by its waiter thread).
    JobExited { pid: u32, reaped: sys::Reaped },
    /// Finish the run: a final sample and every flush. `urgent` (a second
    /// signal) skips the final sample.
    Stop { urgent: bool },
}

/// When the run is over, besides a stop request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndWhen {
    /// `run`: when the spawned job exits.
    JobExits,
    /// `attach --pid`: when every followed process has exited.
    TreeEmpty,
    /// `attach` without PIDs: only on a stop request.
    Stopped,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub interval: Duration,
    pub checkpoint_interval: Duration,
    /// Buffered journal records are handed to the kernel at least this
    /// often (events are flushed at once).
    pub journal_flush: Duration,
    pub end_when: EndWhen,
}

/// How the run ended, for the caller's exit code and report.
#[derive(Debug, Clone)]
pub struct Ended {
    pub job_exit: Option<Exit>,
    pub stopped_by_request: bool,
    /// Problems writing the final files, already logged.
    pub write_error: Option<String>,
}

/// Logs a repeated problem once, then every `every`-th time.
#[derive(Debug, Default)]
struct RateLimited {
    count: u64,
}

impl RateLimited {
    fn hit(&mut self, every: u64) -> Option<u64> {
        self.count += 1;
        (self.count == 1 || self.count.is_multiple_of(every)).then_some(self.count)
    }
}

/// The state owner.
pub struct Engine {
    sampler: Sampler,
    store: Store,
    journal: Option<Journal>,
    opts: EngineOptions,
    gpu_errors: RateLimited,
    journal_errors: RateLimited,
    last_checkpoint: Instant,
    last_flush: Instant,
    unflushed: bool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("sampler", &self.sampler)
            .finish()
    }
}

impl Engine {
    pub fn new(
        sampler: Sampler,
        store: Store,
        journal: Option<Journal>,
        opts: EngineOptions,
    ) -> Engine {
        let now = Instant::now();
        Engine {
            sampler,
            store,
            journal,
            opts,
            gpu_errors: RateLimited::default(),
            journal_errors: RateLimited::default(),
            last_checkpoint: now,
            last_flush: now,
            unflushed: false,
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Applies a record and journals it.
    fn commit(&mut self, record: Record) -> Outcome {
        let outcome = self.store.apply(&record);
        if let Some(j) = &mut self.journal {
            if let Err(e) = j.append(self.store.seq, &record) {
                self.store.counters_mut().journal_errors += 1;
                if let Some(n) = self.journal_errors.hit(1000) {
                    tracing::warn!("cannot append to the journal ({n} times so far): {e}");
                }
            }
            self.unflushed = true;
        }
        for alert in &outcome.alerts {
            tracing::warn!(resource = %alert.resource, level = %alert.level, "{}", alert.message);
        }
        outcome
    }

    /// Takes one sample and commits it.
    fn sample(&mut self, kind: SampleKind) -> Outcome {
        let mut sample = Sample::default();
        self.sampler.sample(&mut sample);
        if let gpu::Status::Error(e) = &sample.gpu_status {
            if let Some(n) = self.gpu_errors.hit(100) {
                tracing::warn!("GPU figures unavailable for this sample ({n} times so far): {e}");
            }
        }
        self.commit(Record::Sample {
            kind,
            sample: Box::new(sample),
        })
    }

    /// Records memtrack's own `system` entry (seed 002's experiment_start).
    fn system_mark(&mut self, operation: &str) {
        self.commit(Record::Mark(Mark {
            timestamp: unix_now(),
            pid: None,
            component: SYSTEM.into(),
            operation: operation.into(),
            iteration: None,
            labels: Default::default(),
            allocator: None,
            kind: EntryKind::System,
        }));
    }

    fn maintain(&mut self, now: Instant) {
        if self.unflushed && now.duration_since(self.last_flush) >= self.opts.journal_flush {
            self.flush_journal(now);
        }
        if now.duration_since(self.last_checkpoint) >= self.opts.checkpoint_interval {
            self.last_checkpoint = now;
            if let Some(j) = &mut self.journal {
                if let Err(e) = j.checkpoint(&self.store) {
                    self.store.counters_mut().checkpoint_errors += 1;
                    tracing::warn!("checkpoint failed (the journal still holds every record): {e}");
                }
            }
        }
    }

    fn flush_journal(&mut self, now: Instant) {
        self.last_flush = now;
        self.unflushed = false;
        if let Some(j) = &mut self.journal {
            if let Err(e) = j.flush() {
                self.store.counters_mut().journal_errors += 1;
                if let Some(n) = self.journal_errors.hit(1000) {
                    tracing::warn!("cannot write the journal ({n} times so far): {e}");
                }
            }
        }
    }

    /// Runs until the run ends; writes the final document.
    pub fn run(mut self, rx: &Receiver<Input>) -> (Ended, Store) {
        let start = Instant::now();
        self.sample(SampleKind::Event);
        self.system_mark("experiment_start");
        let mut ended = Ended {
            job_exit: None,
            stopped_by_request: false,
            write_error: None,
        };
        let mut slot: u32 = 1;
        let mut urgent = false;
        'run: loop {
            let next = start + self.opts.interval * slot;
            let now = Instant::now();
            if now >= next {
                self.sample(SampleKind::Timer);
                // Skip the slots this tick overran instead of catching up.
                let after = Instant::now();
                let behind = (after.duration_since(start).as_nanos()
                    / self.opts.interval.as_nanos().max(1)) as u32;
                let next_slot = behind.max(slot) + 1;
                self.store.counters_mut().missed_ticks += u64::from(next_slot - slot - 1);
                slot = next_slot;
                if self.opts.end_when == EndWhen::TreeEmpty && self.sampler.tree.is_empty() {
                    break 'run;
                }
                self.maintain(after);
                continue;
            }
            match rx.recv_timeout(next - now) {
                Ok(input) => {
                    let mut batch = vec![input];
                    while batch.len() < 4096 {
                        match rx.try_recv() {
                            Ok(i) => batch.push(i),
                            Err(_) => break,
                        }
                    }
                    for input in batch {
                        match input {
                            Input::JobExited { pid, reaped } => {
                                ended.job_exit = Some(reaped.exit);
                                self.commit(Record::Exit {
                                    pid,
                                    exit: reaped.exit,
                                    max_rss: Some(reaped.max_rss_kib * 1024),
                                });
                                if self.opts.end_when == EndWhen::JobExits {
                                    break 'run;
                                }
                            }
                            Input::Stop { urgent: u } => {
                                ended.stopped_by_request = true;
                                urgent = u;
                                break 'run;
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break 'run,
            }
            self.maintain(Instant::now());
        }

        if !urgent {
            self.sampler.tree.refresh_hwm_all();
            self.sample(SampleKind::Timer);
        }
        self.commit(Record::Finish {
            timestamp: unix_now(),
            exit: ended.job_exit,
        });
        if let Some(j) = self.journal.take() {
            if let Err(e) = j.finish(&self.store) {
                tracing::error!("{e}");
                ended.write_error = Some(e.to_string());
            }
        }
        (ended, self.store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limited_logs_first_and_every_nth() {
        let mut r = RateLimited::default();
        let hits: Vec<u64> = (0..250).filter_map(|_| r.hit(100)).collect();
        assert_eq!(hits, [1, 100, 200]);
    }
}
