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

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, oneshot, watch};

use crate::event::inbox::{ClientRequest, Input};
use crate::event::protocol::{self, Message, Notice};
use crate::event::server::Stats;
use crate::logging::RateLimited;
use crate::model::{EntryKind, Exit, FlightPoint, FlightWindow};
use crate::sample::{gpu, Sample, Sampler};
use crate::store::journal::Journal;
use crate::store::snapshot::{Histogram, Snapshot};
use crate::store::{Boundary, Mark, Outcome, Record, SampleKind, Store, SYSTEM};
use crate::sys;
use crate::units::{unix_now, MIB};

/// The engine's link to the event socket.
#[derive(Debug, Clone)]
pub struct EventLink {
    pub notices: broadcast::Sender<Notice>,
    pub stats: Arc<Stats>,
    /// `attach` without PIDs: processes that mark join the tree.
    pub self_register: bool,
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
    /// The OOM flight recorder: `(interval, window)`, or off.
    pub flight: Option<(Duration, Duration)>,
}

/// How the run ended, for the caller's exit code and report.
#[derive(Debug, Clone)]
pub struct Ended {
    pub job_exit: Option<Exit>,
    pub stopped_by_request: bool,
    /// A second signal: skip everything that can wait on the network.
    pub urgent: bool,
    /// Problems writing the final files, already logged.
    pub write_error: Option<String>,
}

/// Longest wait, once the run is over, for clients to finish sending.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// How often the drain checks whether the clients have gone.
const DRAIN_POLL: Duration = Duration::from_millis(5);

/// The flight recorder's ring of recent points. Between timer ticks that
/// are slower than its interval it reads on its own, through the cheap
/// paths only: a `statm` read per followed process and NVML's stateless
/// sample, no discovery (the next timer sample handles joins and exits).
struct Flight {
    interval: Duration,
    capacity: usize,
    ring: std::collections::VecDeque<FlightPoint>,
    fast: bool,
    next: Instant,
    /// `/proc/vmstat`, for the kernel's `oom_kill` counter.
    vmstat: Option<std::fs::File>,
    /// Recent readings of that counter, oldest first, about a second
    /// apart and at most [`OOM_LOOKBACK`] old (the counter is host-wide:
    /// only a kill close to a target's death is blamed for it).
    oom_seen: std::collections::VecDeque<(Instant, u64)>,
    /// PIDs a window was already kept for (a death is seen twice: by the
    /// waiter and by the sampler).
    recorded: std::collections::BTreeSet<u32>,
    rss: Vec<(u32, u64)>,
    gpu: gpu::GpuSample,
    /// A CUDA OOM window waiting for its tail.
    pending: Option<PendingWindow>,
}

/// A reported CUDA OOM whose window is kept once its tail is recorded.
struct PendingWindow {
    /// When the report arrived (Unix seconds): the window's moment.
    at: f64,
    pid: Option<u32>,
    summary: Option<String>,
    until: Instant,
}

/// How long a CUDA OOM window keeps recording after the report (or until
/// the process leaves, if sooner).
const OOM_TAIL: Duration = Duration::from_secs(1);

impl Flight {
    fn push(&mut self, point: FlightPoint) {
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(point);
    }

    /// The kernel's `oom_kill` counter now.
    fn read_oom_kills(&self) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let f = self.vmstat.as_ref()?;
        let mut buf = vec![0u8; 16 * 1024];
        let n = f.read_at(&mut buf, 0).ok()?;
        std::str::from_utf8(&buf[..n])
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))?
            .trim()
            .parse()
            .ok()
    }

    /// Keeps the counter's history fresh: a reading a second, the oldest
    /// dropped once a newer one is itself [`OOM_LOOKBACK`] old.
    fn note_oom_kills(&mut self, now: Instant) {
        if self
            .oom_seen
            .back()
            .is_some_and(|(at, _)| now.duration_since(*at) < Duration::from_secs(1))
        {
            return;
        }
        let Some(v) = self.read_oom_kills() else {
            return;
        };
        self.oom_seen.push_back((now, v));
        while self.oom_seen.len() > 2
            && self
                .oom_seen
                .get(1)
                .is_some_and(|(at, _)| now.duration_since(*at) >= OOM_LOOKBACK)
        {
            self.oom_seen.pop_front();
        }
    }

    /// Whether the kernel's OOM killer acted in the last few seconds. A
    /// kill is blamed once: the history restarts from now.
    fn oom_killed(&mut self, now: Instant) -> bool {
        let Some(current) = self.read_oom_kills() else {
            return false;
        };
        let killed = self.oom_seen.front().is_some_and(|&(_, v)| current > v);
        if killed {
            self.oom_seen.clear();
            self.oom_seen.push_back((now, current));
        }
        killed
    }
}

/// How far back an OOM kill counts as the cause of a target's death.
const OOM_LOOKBACK: Duration = Duration::from_secs(3);

/// Keeps one empty point after the last one with processes: it marks the
/// death; more only repeat it while the kernel tears the process down.
fn trim_after_death(mut points: Vec<FlightPoint>) -> Vec<FlightPoint> {
    if let Some(last) = points.iter().rposition(|p| !p.processes.is_empty()) {
        points.truncate((last + 2).min(points.len()));
    }
    points
}

/// Snapshots for exporters are published at most this often.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// The state owner.
pub struct Engine {
    sampler: Sampler,
    store: Store,
    journal: Option<Journal>,
    opts: EngineOptions,
    events: Option<EventLink>,
    /// Where exporters get the latest picture of the run.
    snapshots: Option<watch::Sender<Arc<Snapshot>>>,
    last_publish: Instant,
    tick_seconds: Histogram,
    entries: Option<tokio::sync::mpsc::UnboundedSender<crate::model::Entry>>,
    checkpoints: Option<watch::Sender<u64>>,
    /// Failure counters of exporters running beside the engine, by name.
    export_errors: Vec<(String, Arc<std::sync::atomic::AtomicU64>)>,
    flight: Option<Flight>,
    gpu_errors: RateLimited,
    journal_errors: RateLimited,
    last_checkpoint: Instant,
    /// An early checkpoint was asked for ([`Input::Checkpoint`]).
    checkpoint_soon: bool,
    last_flush: Instant,
    unflushed: bool,
    /// An event was journalled since the last flush: flush at once.
    unflushed_event: bool,
    /// Acks waiting for the batch's journal flush.
    replies: Vec<(oneshot::Sender<Vec<u8>>, Vec<u8>)>,
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
        events: Option<EventLink>,
        snapshots: Option<watch::Sender<Arc<Snapshot>>>,
    ) -> Engine {
        let now = Instant::now();
        Engine {
            sampler,
            store,
            journal,
            opts,
            events,
            snapshots,
            last_publish: now,
            tick_seconds: Histogram::default(),
            entries: None,
            checkpoints: None,
            export_errors: Vec::new(),
            flight: None,
            gpu_errors: RateLimited::default(),
            journal_errors: RateLimited::default(),
            last_checkpoint: now,
            checkpoint_soon: false,
            last_flush: now,
            unflushed: false,
            unflushed_event: false,
            replies: Vec::new(),
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    fn start_flight(&mut self, proc_root: &std::path::Path) {
        let Some((interval, window)) = self.opts.flight else {
            return;
        };
        let mut f = Flight {
            interval,
            capacity: ((window.as_secs_f64() / interval.as_secs_f64()).ceil() as usize).max(1),
            ring: std::collections::VecDeque::new(),
            fast: interval < self.opts.interval,
            next: Instant::now() + interval,
            // The job's own cgroup counts only its OOM kills; else the
            // host-wide counter, blamed only for a death close to a kill.
            vmstat: self
                .sampler
                .footprint
                .oom_counter()
                .and_then(|p| std::fs::File::open(p).ok())
                .or_else(|| std::fs::File::open(proc_root.join("vmstat")).ok()),
            oom_seen: Default::default(),
            recorded: Default::default(),
            rss: Vec::new(),
            gpu: Default::default(),
            pending: None,
        };
        f.note_oom_kills(Instant::now());
        self.flight = Some(f);
    }

    /// One fast read into the ring.
    fn flight_tick(&mut self, now: Instant) {
        let Some(f) = &mut self.flight else {
            return;
        };
        self.sampler.tree.peek(&mut f.rss);
        f.gpu.clear();
        let gpu_ok = self.sampler.gpu.sample(&mut f.gpu) == gpu::Status::Sampled;
        let mut point = FlightPoint {
            t: unix_now(),
            ..FlightPoint::default()
        };
        for &(pid, rss) in &f.rss {
            let gpu: u64 = if gpu_ok {
                f.gpu
                    .processes
                    .iter()
                    .filter(|p| p.pid == pid)
                    .filter_map(|p| p.used)
                    .sum()
            } else {
                0
            };
            point.cpu_mb += rss as f64 / MIB;
            point.gpu_mb += gpu as f64 / MIB;
            point
                .processes
                .push([f64::from(pid), rss as f64 / MIB, gpu as f64 / MIB]);
        }
        f.push(point);
        f.next = f.next.max(now) + f.interval;
        self.settle_flight(false);
    }

    /// What a record says about a death worth a flight window:
    /// `(reason, pid, exit)`.
    fn death(&mut self, record: &Record) -> Option<(&'static str, Option<u32>, Option<Exit>)> {
        let f = self.flight.as_mut()?;
        match record {
            Record::Exit { pid, exit, .. } if exit.signal.is_some() => {
                Some(("signal", Some(*pid), Some(*exit)))
            }
            Record::Sample { sample, .. } if !sample.host.left.is_empty() => {
                let left = &sample.host.left;
                let by_signal = left.iter().find_map(|l| {
                    l.exit
                        .filter(|e| e.signal.is_some())
                        .map(|e| ("signal", Some(l.id.pid), Some(e)))
                });
                // The kernel's OOM killer leaves no exit status we can read
                // for a grandchild, but it counts its kills (host-wide: only
                // a recent kill, and only a target whose end is unknown).
                by_signal.or_else(|| {
                    let victim = left.iter().find(|l| l.exit.is_none())?;
                    f.oom_killed(Instant::now()).then_some((
                        "oom_kill",
                        Some(victim.id.pid),
                        victim.exit,
                    ))
                })
            }
            _ => None,
        }
    }

    /// Keeps the ring as a flight window (once per PID).
    fn record_flight(
        &mut self,
        reason: &str,
        pid: Option<u32>,
        exit: Option<Exit>,
        cuda_summary: Option<String>,
        at: Option<f64>,
    ) {
        let Some(f) = &mut self.flight else {
            return;
        };
        if let Some(p) = pid {
            if !f.recorded.insert(p) {
                return;
            }
        }
        let window = FlightWindow {
            reason: reason.into(),
            timestamp: at.unwrap_or_else(unix_now),
            pid,
            name: pid
                .and_then(|p| self.store.target_name(p))
                .unwrap_or_default(),
            exit,
            interval_s: f.interval.as_secs_f64(),
            points: trim_after_death(f.ring.iter().cloned().collect()),
            cuda_summary,
        };
        let what = match reason {
            "signal" => format!(
                "PID {} died by {}",
                pid.unwrap_or(0),
                exit.and_then(|e| e.signal)
                    .map(sys::signal_name)
                    .unwrap_or_default()
            ),
            "oom_kill" => format!(
                "the kernel's OOM killer acted as PID {} left",
                pid.unwrap_or(0)
            ),
            _ => format!(
                "PID {} reported a CUDA out-of-memory error",
                pid.unwrap_or(0)
            ),
        };
        tracing::warn!(
            "{what}: kept the last {:.1} s of memory ({} points) in the flight recorder",
            window.points.len() as f64 * window.interval_s,
            window.points.len()
        );
        self.commit(Record::Flight(Box::new(window)));
    }

    /// Applies a record and journals it.
    /// Bumped after every successful checkpoint (uploads at checkpoints).
    pub fn notify_checkpoints(&mut self, tx: watch::Sender<u64>) {
        self.checkpoints = Some(tx);
    }

    /// Publishes `counter` as `memtrack_export_errors_total{exporter=name}`.
    pub fn count_export_errors(&mut self, name: &str, counter: Arc<std::sync::atomic::AtomicU64>) {
        self.export_errors.push((name.to_string(), counter));
    }

    /// Every log entry recorded from now on is also sent here (the ClearML
    /// reporter). The send never blocks: the receiver drains it into its
    /// own bounded queue and spool file.
    pub fn forward_entries(&mut self, tx: tokio::sync::mpsc::UnboundedSender<crate::model::Entry>) {
        self.entries = Some(tx);
    }

    fn commit(&mut self, record: Record) -> Outcome {
        let death = self.death(&record);
        let outcome = self.store.apply(&record);
        if let (Some(tx), Some(entry)) = (&self.entries, &outcome.entry) {
            let _ = tx.send(entry.clone());
        }
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
            if let Some(link) = &self.events {
                let _ = link.notices.send(Notice::Pressure {
                    resource: alert.resource.clone(),
                    level: alert.level.clone(),
                    previous: alert.previous.clone(),
                    used_ratio: alert.used_ratio,
                    timestamp: alert.timestamp,
                    message: alert.message.clone(),
                });
            }
        }
        if let Some((reason, pid, exit)) = death {
            self.record_flight(reason, pid, exit, None, None);
        }
        outcome
    }

    /// Takes one sample and commits it.
    fn sample(&mut self, kind: SampleKind) -> Outcome {
        let mut sample = Sample::default();
        self.sampler.sample(&mut sample);
        self.tick_seconds.observe(sample.took.as_secs_f64());
        if let Some(f) = &mut self.flight {
            f.note_oom_kills(Instant::now());
            let mut point = FlightPoint {
                t: sample.timestamp,
                ..FlightPoint::default()
            };
            for r in &sample.host.processes {
                let gpu: u64 = sample
                    .gpu
                    .processes
                    .iter()
                    .filter(|p| p.pid == r.pid)
                    .filter_map(|p| p.used)
                    .sum();
                point.cpu_mb += r.rss as f64 / MIB;
                point.gpu_mb += gpu as f64 / MIB;
                point
                    .processes
                    .push([f64::from(r.pid), r.rss as f64 / MIB, gpu as f64 / MIB]);
            }
            f.push(point);
        }
        if let gpu::Status::Error(e) = &sample.gpu_status {
            if let Some(n) = self.gpu_errors.hit(100) {
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

    /// Keeps a pending CUDA OOM window once its tail is recorded, its
    /// process has left, or the run ends (`now`).
    fn settle_flight(&mut self, now: bool) {
        let Some(f) = &mut self.flight else {
            return;
        };
        let Some(p) = &f.pending else {
            return;
        };
        let gone = p.pid.is_some_and(|pid| !self.sampler.tree.contains(pid));
        if now || gone || Instant::now() >= p.until {
            if let Some(p) = f.pending.take() {
                self.record_flight("cuda_oom", p.pid, None, p.summary, Some(p.at));
            }
        }
    }

    /// Records memtrack's own `system` entry (`experiment_start` / `experiment_end`).
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

    /// Copies the socket server's counters into the run's.
    fn sync_counters(&mut self) {
        if let Some(link) = &self.events {
            let c = self.store.counters_mut();
            c.protocol_errors = link.stats.protocol_errors.load(Ordering::Relaxed);
            c.dropped_events = link.stats.dropped.load(Ordering::Relaxed);
            c.refused_peers = link.stats.refused.load(Ordering::Relaxed);
            c.rejected_connections = link.stats.rejected_connections.load(Ordering::Relaxed);
            c.slow_clients = link.stats.slow_clients.load(Ordering::Relaxed);
        }
    }

    /// Publishes a snapshot for exporters, at most every 100 ms unless
    /// `force`d.
    fn publish(&mut self, now: Instant, force: bool) {
        let Some(tx) = &self.snapshots else {
            return;
        };
        // Nobody reads snapshots (HTTP off): do not build them.
        if tx.receiver_count() == 0
            || !force && now.duration_since(self.last_publish) < PUBLISH_EVERY
        {
            return;
        }
        self.last_publish = now;
        let mut snap = self.store.snapshot();
        snap.tick_seconds = self.tick_seconds.clone();
        for (name, counter) in &self.export_errors {
            snap.export_errors.insert(
                name.clone(),
                counter.load(std::sync::atomic::Ordering::Relaxed),
            );
        }
        tx.send_replace(Arc::new(snap));
    }

    fn maintain(&mut self, now: Instant) {
        self.sync_counters();
        self.publish(now, false);
        if self.unflushed_event
            || self.unflushed && now.duration_since(self.last_flush) >= self.opts.journal_flush
        {
            self.flush_journal(now);
        }
        // Checkpoints are written on their own thread; here they are only
        // started (a clone of the store) and their outcome collected.
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
                    Ok(true) => {}
                    Ok(false) => tracing::debug!(
                        "the previous checkpoint is still being written; skipping this one"
                    ),
                    Err(e @ crate::store::journal::JournalError::Rotate { .. }) => {
                        self.store.counters_mut().journal_errors += 1;
                        if let Some(n) = self.journal_errors.hit(1000) {
                            tracing::warn!("journal error ({n} so far): {e}");
                        }
                    }
                    Err(e) => self.checkpoint_done(Err(e)),
                }
            }
        }
    }

    fn checkpoint_done(&mut self, result: Result<(), crate::store::journal::JournalError>) {
        match result {
            Ok(()) => {
                if let Some(tx) = &self.checkpoints {
                    tx.send_modify(|n| *n += 1);
                }
            }
            Err(e) => {
                self.store.counters_mut().checkpoint_errors += 1;
                tracing::warn!("checkpoint failed (the journal still holds every record): {e}");
            }
        }
    }

    fn flush_journal(&mut self, now: Instant) {
        self.last_flush = now;
        self.unflushed = false;
        self.unflushed_event = false;
        if let Some(j) = &mut self.journal {
            if let Err(e) = j.flush() {
                self.store.counters_mut().journal_errors += 1;
                if let Some(n) = self.journal_errors.hit(1000) {
                    tracing::warn!("cannot write the journal ({n} times so far): {e}");
                }
            }
        }
    }

    fn run_over(&self, ended: &Ended) -> bool {
        match self.opts.end_when {
            EndWhen::JobExits => ended.job_exit.is_some(),
            EndWhen::TreeEmpty => self.sampler.tree.is_empty(),
            EndWhen::Stopped => false,
        }
    }

    /// Whether every socket client has hung up (all they sent is queued).
    fn clients_gone(&self) -> bool {
        self.events
            .as_ref()
            .is_none_or(|l| l.stats.connections.load(Ordering::Relaxed) == 0)
    }

    /// Handles a batch of inputs. Every message needing a sample shares one
    /// sample taken after all of them arrived. Returns `Some(urgent)` when a
    /// stop was requested.
    fn handle_batch(&mut self, batch: Vec<Input>, ended: &mut Ended) -> Option<bool> {
        let mut needs_sample = false;
        for input in &batch {
            if let Input::Client(c) = input {
                needs_sample |= c.request.message.needs_sample();
                let registers =
                    c.request.message.needs_sample() || c.request.message == Message::Register;
                if let (Some(pid), Some(link)) = (c.pid, &self.events) {
                    if link.self_register && registers && !self.sampler.tree.contains(pid) {
                        match self.sampler.tree.add_root(pid) {
                            Ok(()) => tracing::info!("PID {pid} registered itself; following it"),
                            Err(e) => tracing::debug!("cannot follow PID {pid}: {e}"),
                        }
                    }
                }
            }
        }
        if needs_sample {
            self.sample(SampleKind::Event);
        }
        let mut stop = None;
        for input in batch {
            match input {
                Input::JobExited { pid, reaped } => {
                    let exit = Exit::from_wait_status(reaped.status);
                    ended.job_exit = Some(exit);
                    self.commit(Record::Exit {
                        pid,
                        exit,
                        // 0: not known (the job's peak hid below
                        // memtrack's own, which it inherited).
                        max_rss: (reaped.max_rss_kib > 0).then(|| reaped.max_rss_kib * 1024),
                    });
                }
                Input::Stop { urgent } => {
                    ended.stopped_by_request = true;
                    stop = Some(stop.unwrap_or(false) || urgent);
                }
                Input::Client(c) => self.client(*c),
                Input::Checkpoint => self.checkpoint_soon = true,
            }
        }
        if !self.replies.is_empty() {
            self.flush_journal(Instant::now());
            for (reply, line) in self.replies.drain(..) {
                let _ = reply.send(line);
            }
        }
        stop
    }

    fn client(&mut self, c: ClientRequest) {
        let mark = |component: String, operation: String, iteration, labels, allocator| Mark {
            timestamp: c.received,
            pid: c.pid,
            component,
            operation,
            iteration,
            labels,
            allocator,
            kind: EntryKind::Event,
        };
        let record = match c.request.message {
            Message::Mark(m) => Record::Mark(mark(
                m.component,
                m.operation,
                m.iteration,
                m.labels,
                m.allocator,
            )),
            Message::SpanBegin(m) => Record::SpanBegin(Boundary {
                mark: mark(m.component, m.operation, m.iteration, m.labels, m.allocator),
                status: None,
                message: None,
            }),
            Message::SpanEnd(m) => Record::SpanEnd(Boundary {
                mark: mark(m.component, m.operation, m.iteration, m.labels, m.allocator),
                status: None,
                message: None,
            }),
            Message::StageBegin(s) => Record::StageBegin(Boundary {
                mark: mark("stage".into(), s.name, None, s.labels, s.allocator),
                status: None,
                message: None,
            }),
            Message::StageEnd(s) => Record::StageEnd(Boundary {
                mark: mark("stage".into(), s.name, None, s.labels, s.allocator),
                status: s.status,
                message: s.message,
            }),
            Message::Status => {
                if let Some(reply) = c.reply {
                    let fields = match self.store.status() {
                        serde_json::Value::Object(m) => m,
                        _ => Default::default(),
                    };
                    let _ = reply.send(protocol::ok_line("status", &c.request.id, fields));
                }
                return;
            }
            Message::Register => {
                if let Some(reply) = c.reply {
                    let mut fields = serde_json::Map::new();
                    fields.insert(
                        "following".into(),
                        c.pid.is_some_and(|p| self.sampler.tree.contains(p)).into(),
                    );
                    let _ = reply.send(protocol::ok_line("registered", &c.request.id, fields));
                }
                return;
            }
            Message::Oom {
                summary,
                message,
                allocator,
            } => {
                let mut labels = std::collections::BTreeMap::new();
                if let Some(m) = message {
                    let mut m: String = m.chars().filter(|c| !c.is_control()).collect();
                    while m.len() > 256 {
                        m.pop();
                    }
                    labels.insert("error".to_string(), m);
                }
                let outcome = self.commit(Record::Mark(mark(
                    "cuda".into(),
                    "out_of_memory".into(),
                    None,
                    labels,
                    allocator,
                )));
                self.unflushed_event = true;
                // The process still holds its memory while the error
                // unwinds, and NVML's per-process figures lag allocations by
                // a tick or two: the window stays open a moment longer.
                if let Some(f) = &mut self.flight {
                    f.pending = Some(PendingWindow {
                        at: unix_now(),
                        pid: c.pid,
                        summary,
                        until: Instant::now() + OOM_TAIL,
                    });
                }
                if let (Some(reply), Some(entry)) = (c.reply, outcome.entry) {
                    self.replies
                        .push((reply, protocol::recorded_line(&c.request.id, &entry)));
                }
                return;
            }
            // Answered by the socket server itself.
            Message::Subscribe | Message::Cleanup | Message::ClearmlTask { .. } => return,
        };
        let outcome = self.commit(record);
        self.unflushed_event = true;
        if let (Some(reply), Some(entry)) = (c.reply, outcome.entry) {
            // Sent once the batch is in the journal: an ack means recorded.
            self.replies
                .push((reply, protocol::recorded_line(&c.request.id, &entry)));
        }
    }

    /// Runs until the run ends; writes the final document.
    ///
    /// The first sample is published at once, so `/metrics` has data
    /// from the start.
    pub fn run(mut self, rx: &Receiver<Input>) -> (Ended, Store) {
        let start = Instant::now();
        let proc_root = self.sampler.tree.root().to_path_buf();
        self.start_flight(&proc_root);
        self.sample(SampleKind::Event);
        self.system_mark("experiment_start");
        self.publish(Instant::now(), true);
        let mut ended = Ended {
            job_exit: None,
            stopped_by_request: false,
            urgent: false,
            write_error: None,
        };
        let mut slot: u32 = 1;
        let mut urgent = false;
        let mut stop_requested = false;
        // Once the run is over, marks already sent may still sit in client
        // connections: keep reading until every client has hung up (or
        // DRAIN_MAX has passed) before the final sample.
        let mut draining: Option<Instant> = None;
        'run: loop {
            let now = Instant::now();
            if draining.is_none() && (stop_requested || self.run_over(&ended)) {
                draining = Some(now);
            }
            if let Some(since) = draining {
                if self.clients_gone() || now.duration_since(since) >= DRAIN_MAX {
                    let rest: Vec<Input> = rx.try_iter().collect();
                    if !rest.is_empty() && self.handle_batch(rest, &mut ended) == Some(true) {
                        urgent = true;
                    }
                    break 'run;
                }
            }
            let next = start + self.opts.interval * slot;
            let fast = self.flight.as_ref().filter(|f| f.fast).map(|f| f.next);
            if fast.is_some_and(|at| now >= at && at < next) {
                self.flight_tick(now);
                continue;
            }
            if now >= next {
                self.sample(SampleKind::Timer);
                // Skip the slots this tick overran instead of catching up.
                let after = Instant::now();
                let behind = (after.duration_since(start).as_nanos()
                    / self.opts.interval.as_nanos().max(1)) as u32;
                let next_slot = behind.max(slot) + 1;
                self.store.counters_mut().missed_ticks += u64::from(next_slot - slot - 1);
                slot = next_slot;
                self.maintain(after);
                continue;
            }
            let until = fast.map_or(next, |at| at.min(next));
            let wait = until.saturating_duration_since(now);
            let wait = if draining.is_some() {
                wait.min(DRAIN_POLL)
            } else {
                wait
            };
            match rx.recv_timeout(wait) {
                Ok(input) => {
                    let mut batch = vec![input];
                    batch.extend(rx.try_iter().take(4095));
                    match self.handle_batch(batch, &mut ended) {
                        Some(true) => {
                            urgent = true;
                            break 'run;
                        }
                        Some(false) => stop_requested = true,
                        None => {}
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break 'run,
            }
            self.maintain(Instant::now());
        }

        ended.urgent = urgent;
        if !urgent {
            self.sampler.tree.refresh_hwm_all();
            self.sample(SampleKind::Timer);
        }
        self.settle_flight(true);
        self.sync_counters();
        self.commit(Record::Finish {
            timestamp: unix_now(),
            exit: ended.job_exit,
        });
        self.publish(Instant::now(), true);
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
    fn an_input_stays_small_because_the_queue_preallocates_its_slots() {
        assert!(
            std::mem::size_of::<Input>() <= 48,
            "{}",
            std::mem::size_of::<Input>()
        );
    }

    #[test]
    fn a_flight_window_ends_one_point_after_the_death() {
        let point = |n: usize| FlightPoint {
            processes: vec![[1.0, 1.0, 0.0]; n],
            ..FlightPoint::default()
        };
        let kept = trim_after_death(vec![point(1), point(1), point(0), point(0), point(0)]);
        assert_eq!(kept.len(), 3);
        assert_eq!(
            trim_after_death(vec![point(0), point(0)]).len(),
            2,
            "nothing to anchor on"
        );
    }

    #[test]
    fn only_a_recent_oom_kill_is_blamed_and_only_once() {
        let dir = tempfile::tempdir().unwrap();
        let vmstat = dir.path().join("vmstat");
        let set = |n: u64| std::fs::write(&vmstat, format!("pgfault 1\noom_kill {n}\n")).unwrap();
        set(5);
        let mut f = Flight {
            interval: Duration::from_millis(100),
            capacity: 10,
            ring: Default::default(),
            fast: true,
            next: Instant::now(),
            vmstat: std::fs::File::open(&vmstat).ok(),
            oom_seen: Default::default(),
            recorded: Default::default(),
            rss: Vec::new(),
            gpu: Default::default(),
            pending: None,
        };
        let t0 = Instant::now();
        f.note_oom_kills(t0);
        assert!(!f.oom_killed(t0), "nothing happened");
        // A kill elsewhere on the host, long before a target ends.
        set(6);
        for s in 1..=10 {
            f.note_oom_kills(t0 + Duration::from_secs(s));
        }
        assert!(
            !f.oom_killed(t0 + Duration::from_secs(10)),
            "a kill 10 s before is not this death's cause"
        );
        // A kill just before a target vanishes: blamed, once.
        set(7);
        f.note_oom_kills(t0 + Duration::from_secs(11));
        assert!(f.oom_killed(t0 + Duration::from_millis(11_200)));
        assert!(!f.oom_killed(t0 + Duration::from_millis(11_300)));
    }
}
