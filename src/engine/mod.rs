//! The engine: one thread that owns the sampler, the store and the journal,
//! and handles the tick, inputs and shutdown in one loop.
//!
//! Everything that changes run state passes through here as a
//! [`Record`]: it is applied to the store, then appended to the journal in
//! the same step, before any output hears of it. Other threads (the job's waiter, signal handling, the
//! socket server, exporters) talk to the engine over a bounded channel and
//! never touch its state, so nothing they do can block a tick for long.
//!
//! Ticks are scheduled on a fixed grid (`start + k·interval`): they do not
//! drift, and a tick that overruns its slot skips the missed slots (and
//! counts them) instead of piling up work.
//!
//! This file holds the loop; beside it, `options` the settings,
//! `translate` what inputs become, `flight` the OOM flight recorder,
//! `persist` the journal and `publish` what readers see. The files that
//! add to `Engine` (`translate`, `persist`, `publish`) are never named
//! here, so no module refers back to one that refers to it.

mod flight;
mod options;
mod persist;
mod publish;
mod translate;

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::event::inbox::Input;
use crate::logging::RateLimited;
use crate::sample::{gpu, Sample, Sampler};
use crate::store::journal::Journal;
use crate::store::snapshot::Histogram;
use crate::store::{Applied, Record, SampleKind, Store};
use crate::units::unix_now;
use flight::{Death, Flight};

pub(crate) use options::{Checkpoint, EndWhen, Ended, EngineOptions, EventLink, Feed, Outputs};

/// Longest wait, once the run is over, for clients to finish sending.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// How often the drain checks whether the clients have gone.
const DRAIN_POLL: Duration = Duration::from_millis(5);
/// Most inputs handled as one batch (sharing one sample).
const BATCH_MAX: usize = 4096;

/// The state owner.
pub(crate) struct Engine {
    sampler: Sampler,
    store: Store,
    journal: Option<Journal>,
    opts: EngineOptions,
    events: Option<EventLink>,
    outputs: Outputs,
    last_publish: Instant,
    /// The leak verdicts snapshots carry, and when they were judged.
    leak: Option<(Instant, crate::model::leak::LeakReport)>,
    tick_seconds: Histogram,
    flight: Option<Flight>,
    gpu_errors: RateLimited,
    journal_errors: RateLimited,
    /// `journal_errors` as last written to the journal itself.
    journal_errors_recorded: u64,
    last_checkpoint: Instant,
    /// An early checkpoint was asked for ([`Input::Checkpoint`]).
    checkpoint_soon: bool,
    /// The last checkpoint handed to the outputs; `seq` is that of the
    /// one being written.
    checkpoint: Checkpoint,
    last_flush: Instant,
    unflushed: bool,
    /// An event was journalled since the last flush: flush at once.
    unflushed_event: bool,
    /// Acks waiting for the batch's journal flush.
    replies: Vec<(oneshot::Sender<Vec<u8>>, Vec<u8>)>,
    /// The sender and time of the last event recorded: a step its sender
    /// held back is never stamped before it.
    last_event: Option<(Option<u32>, f64)>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("sampler", &self.sampler)
            .finish()
    }
}

/// Where the loop stands between two turns.
struct Turn {
    /// The next slot on the tick grid.
    slot: u32,
    /// A second signal: end at once.
    urgent: bool,
    stop_requested: bool,
    /// Once the run is over, marks already sent may still sit in client
    /// connections: reading goes on until every client has hung up (or
    /// [`DRAIN_MAX`] has passed) before the final sample.
    draining: Option<Instant>,
}

impl Engine {
    pub fn new(
        sampler: Sampler,
        store: Store,
        journal: Option<Journal>,
        opts: EngineOptions,
        events: Option<EventLink>,
        outputs: Outputs,
    ) -> Engine {
        let now = Instant::now();
        Engine {
            sampler,
            store,
            journal,
            opts,
            events,
            outputs,
            last_publish: now,
            leak: None,
            tick_seconds: Histogram::default(),
            flight: None,
            gpu_errors: RateLimited::default(),
            journal_errors: RateLimited::default(),
            journal_errors_recorded: 0,
            last_checkpoint: now,
            checkpoint_soon: false,
            checkpoint: Checkpoint::default(),
            last_flush: now,
            unflushed: false,
            unflushed_event: false,
            replies: Vec::new(),
            last_event: None,
        }
    }

    /// Applies a record, journals it, then forwards its entry to the
    /// outputs, announces the pressure it crossed and keeps a flight window
    /// for a death. The order is the store's rule (see `store`): the
    /// journal line carries the sequence number applying gave the record,
    /// and no output hears of an entry the journal does not hold.
    fn commit(&mut self, record: Record) -> Applied {
        let death = self.flight.as_mut().and_then(|f| f.death(&record));
        let outcome = self.store.apply(&record);
        self.journal_append(&record);
        self.record_journal_errors();
        if let Some(entry) = &outcome.entry {
            for tx in self.outputs.feeds.iter().filter_map(|f| f.entries.as_ref()) {
                let _ = tx.send(entry.clone());
            }
        }
        self.announce(&outcome);
        if let Some(death) = death {
            self.record_flight(death, None, None);
        }
        outcome
    }

    /// Takes one sample and commits it.
    fn sample(&mut self, kind: SampleKind) -> Applied {
        let mut sample = Sample::default();
        match kind {
            SampleKind::Timer => self.sampler.sample(&mut sample),
            SampleKind::Event => self.sampler.sample_at_mark(&mut sample),
        }
        self.tick_seconds.observe(sample.took.as_secs_f64());
        if let Some(f) = &mut self.flight {
            f.push_sample(&sample);
        }
        if let gpu::Status::Error(e) = &sample.gpu_status {
            if let Some(n) = self.gpu_errors.hit() {
                tracing::warn!("GPU figures unavailable for this sample ({n} times so far): {e}");
            }
        }
        let outcome = self.commit(Record::Sample {
            kind,
            sample: Box::new(sample),
        });
        self.settle_flight(false);
        outcome
    }

    fn start_flight(&mut self) {
        let proc_root = self.sampler.proc_root().to_path_buf();
        let oom_counter = self.sampler.oom_counter();
        self.flight = self
            .opts
            .flight
            .map(|s| Flight::new(s, self.opts.interval, oom_counter, &proc_root));
    }

    /// One fast read into the flight recorder's ring.
    fn flight_tick(&mut self, now: Instant) {
        if let Some(f) = &mut self.flight {
            f.tick(&mut self.sampler, now);
        }
        self.settle_flight(false);
    }

    /// Keeps the flight recorder's ring as a window (once per PID).
    fn record_flight(&mut self, death: Death, cuda_summary: Option<String>, at: Option<f64>) {
        let name = death
            .pid
            .and_then(|p| self.store.target_name(p))
            .unwrap_or_default();
        let window = self
            .flight
            .as_mut()
            .and_then(|f| f.window(death, name, cuda_summary, at));
        if let Some(window) = window {
            self.commit(Record::Flight(Box::new(window)));
        }
    }

    /// Keeps a pending CUDA OOM window once its tail is recorded, its
    /// process has left, or the run ends (`now`).
    fn settle_flight(&mut self, now: bool) {
        let sampler = &self.sampler;
        let due = self
            .flight
            .as_mut()
            .and_then(|f| f.settle(now, |pid| sampler.follows(pid)));
        if let Some((death, summary, at)) = due {
            self.record_flight(death, summary, Some(at));
        }
    }

    /// Between turns: counters, snapshots, the journal's flush and
    /// checkpoints.
    fn maintain(&mut self, now: Instant) {
        self.sync_counters();
        self.publish(now, false);
        self.flush_if_due(now);
        self.checkpoint_if_due(now);
    }

    fn run_over(&self, ended: &Ended) -> bool {
        match self.opts.end_when {
            EndWhen::JobExits => ended.job_exit.is_some(),
            EndWhen::TreeEmpty => self.sampler.all_gone(),
            EndWhen::Stopped => false,
        }
    }

    /// Whether every socket client has hung up (all they sent is queued).
    fn clients_gone(&self) -> bool {
        self.events.as_ref().is_none_or(|l| l.stats.clients_gone())
    }

    /// Runs until the run ends; writes the final document.
    ///
    /// The first sample is published at once, so `/metrics` has data
    /// from the start.
    pub(crate) fn run(mut self, rx: &Receiver<Input>) -> (Ended, Store) {
        let start = Instant::now();
        self.start_flight();
        self.sample(SampleKind::Event);
        self.system_mark("experiment_start");
        self.publish(Instant::now(), true);
        let mut ended = Ended {
            job_exit: None,
            stopped_by_request: false,
            urgent: false,
            write_error: None,
        };
        let mut turn = Turn {
            slot: 1,
            urgent: false,
            stop_requested: false,
            draining: None,
        };
        while self.turn(start, rx, &mut turn, &mut ended) {}
        ended.urgent = turn.urgent;
        self.finish(&mut ended);
        (ended, self.store)
    }

    /// One turn of the loop: a fast flight read, a tick, or a batch of
    /// inputs. False when the loop is over.
    fn turn(
        &mut self,
        start: Instant,
        rx: &Receiver<Input>,
        t: &mut Turn,
        ended: &mut Ended,
    ) -> bool {
        let now = Instant::now();
        if t.draining.is_none() && (t.stop_requested || self.run_over(ended)) {
            t.draining = Some(now);
        }
        if let Some(since) = t.draining {
            if self.clients_gone() || now.duration_since(since) >= DRAIN_MAX {
                let rest: Vec<Input> = rx.try_iter().collect();
                if !rest.is_empty() && self.handle_batch(rest, ended) == Some(true) {
                    t.urgent = true;
                }
                return false;
            }
        }
        let next = start + self.opts.interval * t.slot;
        let fast = self.flight.as_ref().filter(|f| f.fast).map(|f| f.next);
        if fast.is_some_and(|at| now >= at && at < next) {
            self.flight_tick(now);
            return true;
        }
        if now >= next {
            self.sample(SampleKind::Timer);
            // Skip the slots this tick overran instead of catching up.
            let after = Instant::now();
            let behind = (after.duration_since(start).as_nanos()
                / self.opts.interval.as_nanos().max(1)) as u32;
            let next_slot = behind.max(t.slot) + 1;
            self.store.counters_mut().missed_ticks += u64::from(next_slot - t.slot - 1);
            t.slot = next_slot;
            self.maintain(after);
            return true;
        }
        let until = fast.map_or(next, |at| at.min(next));
        let wait = until.saturating_duration_since(now);
        let wait = if t.draining.is_some() {
            wait.min(DRAIN_POLL)
        } else {
            wait
        };
        match rx.recv_timeout(wait) {
            Ok(input) => {
                let mut batch = vec![input];
                batch.extend(rx.try_iter().take(BATCH_MAX - 1));
                match self.handle_batch(batch, ended) {
                    Some(true) => {
                        t.urgent = true;
                        return false;
                    }
                    Some(false) => t.stop_requested = true,
                    None => {}
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return false,
        }
        self.maintain(Instant::now());
        true
    }

    /// The end: a last sample (unless urgent), pending flight windows, the
    /// finish record and the final document.
    fn finish(&mut self, ended: &mut Ended) {
        if !ended.urgent {
            self.sampler.refresh_high_water_marks();
            self.sample(SampleKind::Timer);
        }
        self.settle_flight(true);
        self.sync_counters();
        self.commit(Record::Finish {
            timestamp: unix_now(),
            exit: ended.job_exit,
        });
        self.publish(Instant::now(), true);
        self.write_final(ended);
    }
}

#[cfg(test)]
mod tests;
