//! The reporter: one tokio task that owns the queue and talks to ClearML.
//!
//! It drains the engine's entry channel as entries arrive (conversion and
//! queueing are cheap and local, so the engine never waits), and runs at
//! most one network job at a time beside it: first the setup (login, find
//! or create the task), then batches of points, and at the end the
//! artifact and the task's final status. A job is a future the loop polls
//! in the same `select!` as the channel, so a slow or absent server delays
//! only the points, never their intake. A batch stays owned by the loop
//! while it is out, so a job cut short by the final deadline puts its
//! points back, and everything unsent ends in the spool file.
//!
//! **The job's own task.** Without a given task, the reporter first waits
//! up to `clearml.job_task_wait` for the job to announce the task its
//! ClearML SDK made (a `clearml_task` message on the event socket, sent by
//! the Python client once `Task.init` has run), holding the entries
//! meanwhile. Announced, that task is taken up: memtrack reports into it on
//! the job's iteration axis, never changes its status, and registers the
//! `memory_usage` artifact while the task still takes it (after the
//! checkpoint uploads the run hands in, and at the end if the task is still
//! open). Not announced in time, memtrack creates its own task as before.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};

use super::api::{Api, CallError};
use super::machine::{
    Announce, ArtifactVerdict, BatchVerdict, Decided, Due, EndFacts, EndProgress, EndStage,
    EndStep, Machine, Phase, Plan,
};
use super::outcome::{FinishReport, TaskEnd, TaskRef};
use super::points::{Converter, Point};
use super::queue::Queue;
use super::settings::Settings;
use super::state::{Ending, Finish, JobKind, JobOutput, ReporterState, Running, Wake};
use super::tasks::{ArtifactRegistered, TaskCtx};
use crate::event::inbox::JobTask;
use crate::export::output::Uploaded;
use crate::export::task_note::{self, SPOOL_FILE, TASK_FILE};
use crate::logging::RateLimited;
use crate::model::{Entry, RunInfo};

/// A created task is pinged when no request reached the server this long
/// (the server force-stops an `in_progress` task silent for 2 h).
const PING_AFTER: Duration = Duration::from_secs(15 * 60);

/// Entries held at most while only the job's task would do
/// ([`Settings::job_task_only`]) and the job has announced none yet.
const JOB_ONLY_HELD: usize = 4096;

/// How long the end of the run waits for the engine to close the channel.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// Handle on the reporter task.
#[derive(Debug)]
pub struct Reporter {
    task: watch::Receiver<Option<TaskRef>>,
    /// The job's own task, once taken up.
    job_task: watch::Receiver<Option<TaskRef>>,
    /// Uploaded checkpoints of the document (or why an upload failed), to
    /// register on the job's task.
    artifacts: Option<mpsc::UnboundedSender<Uploaded>>,
    /// True once the task is known or reporting is off for good.
    settled: watch::Receiver<bool>,
    /// Set when the run ends: stop waiting for the job's task.
    hurry: watch::Sender<bool>,
    errors: Arc<AtomicU64>,
    finish: Option<oneshot::Sender<Finish>>,
    /// Set when the reporter could not start at all.
    failed: Option<String>,
    /// Where the job's task keeps its artifacts, when the document goes
    /// there (no S3 destination of memtrack's own).
    outputs: Option<super::files::ArtifactStore>,
}

impl Reporter {
    /// Starts the reporter as tokio tasks on the current runtime and
    /// returns at once. It never fails the run: problems are logged,
    /// counted in [`Reporter::errors`] and listed by [`Reporter::finish`].
    ///
    /// `job_tasks` carries the job's announcements of its own task (the
    /// event socket); `None` when the job cannot make any.
    pub fn start(
        settings: Settings,
        run: RunInfo,
        run_dir: PathBuf,
        entries: mpsc::UnboundedReceiver<Entry>,
        job_tasks: Option<mpsc::Receiver<JobTask>>,
    ) -> Reporter {
        let spool = run_dir.join(SPOOL_FILE);
        if spool.exists() {
            tracing::warn!(
                "ClearML: {} holds points an earlier run in this directory left unsent; this \
                 run replaces them (`memtrack clearml-resend` would have sent them)",
                spool.display()
            );
        }
        let queue = Queue::new(settings.queue_max, spool);
        Self::launch(settings, run, &run_dir, queue, entries, job_tasks)
    }

    /// Starts a reporter for what an ended run left in `run_dir`: the
    /// points of its spool file (see `Queue::resume`; the number is the
    /// lines that were not points), sent once the task is known.
    /// [`Reporter::finish`] then delivers them.
    pub fn resend(
        settings: Settings,
        run: RunInfo,
        run_dir: PathBuf,
    ) -> std::io::Result<(Reporter, u64)> {
        let (queue, bad) = Queue::resume(settings.queue_max, run_dir.join(SPOOL_FILE))?;
        // No new entries: the channel is closed from the start.
        let (_, entries) = mpsc::unbounded_channel();
        Ok((
            Self::launch(settings, run, &run_dir, queue, entries, None),
            bad,
        ))
    }

    fn launch(
        settings: Settings,
        run: RunInfo,
        run_dir: &std::path::Path,
        queue: Queue,
        entries: mpsc::UnboundedReceiver<Entry>,
        job_tasks: Option<mpsc::Receiver<JobTask>>,
    ) -> Reporter {
        let errors = Arc::new(AtomicU64::new(0));
        let (task_tx, task_rx) = watch::channel(None);
        let (job_task_tx, job_task_rx) = watch::channel(None);
        let (settled_tx, settled_rx) = watch::channel(false);
        let failed = |why: String| {
            tracing::error!("ClearML reporting is off for this run: {why}");
            errors.fetch_add(1, Ordering::Relaxed);
            Reporter {
                task: task_rx.clone(),
                job_task: job_task_rx.clone(),
                artifacts: None,
                settled: watch::channel(true).1,
                hurry: watch::channel(true).0,
                errors: Arc::clone(&errors),
                finish: None,
                failed: Some(why),
                outputs: None,
            }
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return failed("no tokio runtime to run on".into());
        };
        let api = match Api::new(&settings, Arc::clone(&errors)) {
            Ok(a) => a,
            Err(e) => return failed(e.to_string()),
        };
        let outputs = settings.files_upload.then(|| {
            super::files::ArtifactStore::new(
                api.clone(),
                &settings.files_host,
                settings.output.clone(),
            )
        });
        let (finish_tx, finish_rx) = oneshot::channel();
        let (artifacts_tx, artifacts_rx) = mpsc::unbounded_channel();
        let (hurry_tx, hurry_rx) = watch::channel(false);
        // Without a given task, wait a while for the job's own.
        let wait = settings.task.is_none()
            && job_tasks.is_some()
            && (settings.job_task_only || !settings.job_task_wait.is_zero());
        let state = ReporterState {
            conv: Converter::new(settings.timer_every),
            queue,
            task_file: run_dir.join(TASK_FILE),
            api,
            machine: Machine::new(settings.task.clone(), settings.artifact_expected, wait),
            wait_until: Instant::now() + settings.job_task_wait,
            settings,
            run,
            held: Vec::new(),
            announce_replies: Vec::new(),
            pending_artifact: None,
            last_axis: Instant::now(),
            job_task_tx,
            announce_logged: RateLimited::default(),
            stood_down: None,
            errors: Arc::clone(&errors),
            task_tx,
            settled_tx,
            last_send: Instant::now(),
            last_ok: Instant::now(),
            partial_logged: RateLimited::default(),
            set_aside_logged: RateLimited::default(),
        };
        let inputs = Inputs {
            finish: finish_rx,
            finish_open: true,
            entries,
            entries_open: true,
            job_tasks_open: job_tasks.is_some(),
            job_tasks: job_tasks.unwrap_or_else(|| mpsc::channel(1).1),
            artifacts: artifacts_rx,
            artifacts_open: true,
            hurry: hurry_rx,
            hurry_open: true,
            ticker: ticker(state.settings.flush_interval),
        };
        handle.spawn(state.run(inputs));
        Reporter {
            task: task_rx,
            job_task: job_task_rx,
            artifacts: Some(artifacts_tx),
            hurry: hurry_tx,
            settled: settled_rx,
            errors,
            finish: Some(finish_tx),
            failed: None,
            outputs,
        }
    }

    /// Where the document goes for the job's task without an S3
    /// destination of memtrack's own: where the task keeps its artifacts
    /// (`None`: nowhere).
    pub(crate) fn outputs(&self) -> Option<super::files::ArtifactStore> {
        self.outputs.clone()
    }

    /// The task, once known: id, name, project name.
    pub fn task(&self) -> Option<TaskRef> {
        self.task.borrow().clone()
    }

    /// What an output filing under the task follows: the task, the job's
    /// own task, whether the task is settled, and the switch that ends
    /// the wait for the job's task ([`Reporter::settle`] in pieces).
    #[allow(clippy::type_complexity)]
    pub(crate) fn link(
        &self,
    ) -> (
        watch::Receiver<Option<TaskRef>>,
        watch::Receiver<Option<TaskRef>>,
        watch::Receiver<bool>,
        watch::Sender<bool>,
    ) {
        (
            self.task.clone(),
            self.job_task.clone(),
            self.settled.clone(),
            self.hurry.clone(),
        )
    }

    /// Follows the job's own task (announced by the job and taken up).
    pub(crate) fn job_task(&self) -> watch::Receiver<Option<TaskRef>> {
        self.job_task.clone()
    }

    /// Where the run hands in uploaded checkpoints of the document: while
    /// memtrack reports into the job's own task, each is registered as the
    /// `memory_usage` artifact as long as the task takes it.
    pub(crate) fn artifacts(&self) -> Option<mpsc::UnboundedSender<Uploaded>> {
        self.artifacts.clone()
    }

    /// Failed requests and refused points so far.
    pub fn errors(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.errors)
    }

    /// End of the run: drains the entries (the engine has closed the
    /// channel), registers the artifact if given (before completing),
    /// sends every queued and spooled point, then, for a task memtrack
    /// created, marks it completed (exit code 0) or failed. Bounded by
    /// `timeout` overall; whatever stays unsent is left in the spool file.
    pub async fn finish(mut self, outcome: TaskEnd, timeout: Duration) -> FinishReport {
        let Some(tx) = self.finish.take() else {
            return FinishReport {
                errors: self.failed.clone().into_iter().collect(),
                ..FinishReport::default()
            };
        };
        let (reply, rx) = oneshot::channel();
        if tx
            .send(Finish {
                outcome,
                timeout,
                reply,
            })
            .is_err()
        {
            return self.lost("the ClearML reporter task has stopped");
        }
        // The loop keeps its own deadline; this one is only a safety net.
        match tokio::time::timeout(timeout + Duration::from_secs(5), rx).await {
            Ok(Ok(report)) => report,
            _ => self.lost("the ClearML reporter did not answer at the end of the run"),
        }
    }

    fn lost(&self, why: &str) -> FinishReport {
        tracing::error!("{why}");
        FinishReport {
            errors: vec![why.to_string()],
            task: self.task(),
            ..FinishReport::default()
        }
    }
}

/// The channels the reporter's loop listens to, and which are still open.
struct Inputs {
    finish: oneshot::Receiver<Finish>,
    finish_open: bool,
    entries: mpsc::UnboundedReceiver<Entry>,
    entries_open: bool,
    job_tasks: mpsc::Receiver<JobTask>,
    job_tasks_open: bool,
    artifacts: mpsc::UnboundedReceiver<Uploaded>,
    artifacts_open: bool,
    hurry: watch::Receiver<bool>,
    hurry_open: bool,
    ticker: tokio::time::Interval,
}

impl Inputs {
    /// The next thing to handle: a message, the job's result, a tick, or
    /// `deadline`.
    async fn next(&mut self, job: &mut Option<Running>, deadline: Option<Instant>) -> Wake {
        tokio::select! {
            f = &mut self.finish, if self.finish_open => Wake::Finish(f.ok()),
            e = self.entries.recv(), if self.entries_open => Wake::Entry(e),
            t = self.job_tasks.recv(), if self.job_tasks_open => Wake::JobTask(t),
            a = self.artifacts.recv(), if self.artifacts_open => Wake::Checkpoint(a),
            h = self.hurry.changed(), if self.hurry_open => Wake::Hurry(h.is_ok()),
            out = poll_job(job), if job.is_some() => Wake::Job(out),
            _ = self.ticker.tick() => Wake::Tick,
            _ = sleep_until(deadline), if deadline.is_some() => Wake::Deadline,
        }
    }
}

/// Ticks at half the flush interval (20 ms to 1 s).
fn ticker(flush_interval: Duration) -> tokio::time::Interval {
    let period = (flush_interval / 2).clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker
}

async fn poll_job(job: &mut Option<Running>) -> JobOutput {
    match job {
        Some(r) => (&mut r.fut).await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

impl ReporterState {
    /// The loop: move the machine along, wait for the next event, handle
    /// it; at the end, answer the finish.
    async fn run(mut self, mut inputs: Inputs) {
        let mut job: Option<Running> = None;
        let mut ending: Option<Ending> = None;
        let mut pending: Vec<Point> = Vec::new();
        loop {
            self.advance(&mut job, &mut ending, inputs.entries_open);
            if ending
                .as_ref()
                .is_some_and(|e| e.end.stage == EndStage::Done)
            {
                break;
            }
            let deadline = self.deadline(ending.as_ref());
            match inputs.next(&mut job, deadline).await {
                Wake::Finish(Some(f)) => {
                    inputs.finish_open = false;
                    ending = Some(self.begin_end(f));
                }
                Wake::Finish(None) => {
                    self.abandon(job.take(), &mut inputs.entries, &mut pending);
                    return;
                }
                Wake::Entry(Some(e)) => self.entries_in(e, &mut inputs.entries, &mut pending),
                Wake::Entry(None) => inputs.entries_open = false,
                Wake::JobTask(None) => inputs.job_tasks_open = false,
                Wake::JobTask(Some(t)) => {
                    self.announced(t, &mut pending);
                    self.accept(&mut pending);
                }
                Wake::Hurry(alive) => {
                    inputs.hurry_open = false;
                    self.hurried(alive, &mut pending);
                }
                Wake::Checkpoint(None) => inputs.artifacts_open = false,
                Wake::Checkpoint(Some(c)) => self.checkpoint(c),
                Wake::Job(out) => {
                    let kind = job.take().map(|r| r.kind);
                    self.on_job(kind, out);
                }
                Wake::Tick => {
                    self.conv
                        .close_passed(f64::NEG_INFINITY, Instant::now(), &mut pending);
                    self.accept(&mut pending);
                }
                Wake::Deadline => self.on_deadline(&mut job, ending.as_mut(), &mut pending),
            }
        }
        if let Some(r) = job.take() {
            self.cancel(r);
        }
        self.answer_announcements();
        if let Some(e) = ending {
            let report = self.report();
            let _ = e.reply.send(report);
        }
    }

    /// When the loop must wake up even if nothing arrives.
    fn deadline(&self, ending: Option<&Ending>) -> Option<Instant> {
        let deadline = ending.map(|e| match e.end.stage {
            EndStage::Drain => e.drain_until,
            EndStage::Setup | EndStage::Artifact | EndStage::Flush => e.points_until,
            EndStage::Status | EndStage::Done => e.until,
        });
        match (&self.machine.phase, deadline) {
            // Only the job's task will do: wait for it as long as the run.
            (Phase::Waiting, None) if self.settings.job_task_only => None,
            (Phase::Waiting, None) => Some(self.wait_until),
            (_, d) => d,
        }
    }

    /// The handle was dropped without finish(): keep the points on disk
    /// and stop.
    fn abandon(
        &mut self,
        job: Option<Running>,
        entries: &mut mpsc::UnboundedReceiver<Entry>,
        pending: &mut Vec<Point>,
    ) {
        if let Some(r) = job {
            self.cancel(r);
        }
        self.drain_now(entries, pending);
        self.decide(None, pending);
        self.conv.close_all(pending);
        self.queue.extend(pending.drain(..));
        let _ = self.persist();
    }

    /// An entry arrived: take it and what else is already there in one go.
    fn entries_in(
        &mut self,
        e: Entry,
        entries: &mut mpsc::UnboundedReceiver<Entry>,
        pending: &mut Vec<Point>,
    ) {
        let now = Instant::now();
        self.intake(e, now, pending);
        for _ in 0..1024 {
            match entries.try_recv() {
                Ok(e) => self.intake(e, now, pending),
                Err(_) => break,
            }
        }
        self.accept(pending);
    }

    /// The run ended: stop waiting for the job's task.
    fn hurried(&mut self, alive: bool, pending: &mut Vec<Point>) {
        if alive && matches!(self.machine.phase, Phase::Waiting) {
            if self.settings.job_task_only {
                self.decide(None, pending);
                return;
            }
            tracing::info!(
                "ClearML: the run ended before the job announced a task of its own; memtrack \
                 creates one"
            );
            self.decide(None, pending);
            self.accept(pending);
        }
    }

    /// An uploaded checkpoint to register, or why its upload failed.
    fn checkpoint(&mut self, c: Uploaded) {
        match c {
            Ok(a) => self.pending_artifact = Some(a),
            Err(why) => {
                if self.machine.checkpoint_failed(&why.to_string()) {
                    self.answer_announcements();
                }
            }
        }
    }

    /// A deadline passed: the wait for the job's task, or a stage of the
    /// end of the run.
    fn on_deadline(
        &mut self,
        job: &mut Option<Running>,
        ending: Option<&mut Ending>,
        pending: &mut Vec<Point>,
    ) {
        let Some(e) = ending else {
            if matches!(self.machine.phase, Phase::Waiting) && Instant::now() >= self.wait_until {
                tracing::info!(
                    "ClearML: the job announced no task of its own within {:?} \
                     (clearml.job_task_wait); memtrack creates one",
                    self.settings.job_task_wait
                );
                self.decide(None, pending);
                self.accept(pending);
            }
            return;
        };
        match e.end.stage {
            EndStage::Drain => {} // advance() moves on
            EndStage::Setup | EndStage::Artifact | EndStage::Flush => {
                if let Some(r) = job.take() {
                    self.cancel(r);
                }
                let left = self.queue.len() + self.queue.aside() as u64;
                let m = match (&self.machine.phase, self.api.last_error()) {
                    (Phase::Starting, Some(last)) => format!(
                        "the ClearML server {} could not be reached before the end of the run \
                         ({last}); {left} points stay unsent",
                        self.api.host()
                    ),
                    _ => format!("the final flush ran out of time with {left} points unsent"),
                };
                self.machine.problem(m);
                e.end.stage = EndStage::Status;
            }
            EndStage::Status | EndStage::Done => {
                if let Some(r) = job.take() {
                    self.cancel(r);
                }
                if e.end.status_started {
                    self.machine.problem(
                        "the task's final status could not be set before the timeout".into(),
                    );
                }
                e.end.stage = EndStage::Done;
            }
        }
    }

    /// An entry in: held while waiting for the job's task, else converted.
    fn intake(&mut self, e: Entry, now: Instant, pending: &mut Vec<Point>) {
        if matches!(self.machine.phase, Phase::Waiting) {
            self.held.push(e);
            if self.settings.job_task_only && self.held.len() >= JOB_ONLY_HELD {
                // Most jobs that report announce at once; one that never
                // does must not cost memory for the whole run: the oldest
                // half goes, and the wait goes on.
                self.held.drain(..JOB_ONLY_HELD / 2);
                tracing::debug!(
                    "ClearML: no task announced yet; the oldest held entries are dropped"
                );
                return;
            }
            if self.held.len() >= self.settings.queue_max {
                tracing::info!(
                    "ClearML: {} entries arrived before the job announced a task of its own; \
                     memtrack creates one",
                    self.held.len()
                );
                self.decide(None, pending);
            }
            return;
        }
        self.conv.push(e, now, pending);
    }

    /// Ends the wait for the job's task: take up `adopt`, or (`None`)
    /// create memtrack's own task. The held entries go through the
    /// converter on the axis this decides.
    fn decide(&mut self, adopt: Option<String>, pending: &mut Vec<Point>) {
        if adopt.is_none()
            && self.settings.job_task_only
            && matches!(self.machine.phase, Phase::Waiting)
        {
            self.stand_down();
            return;
        }
        let Some(decided) = self.machine.decide(adopt) else {
            return;
        };
        if decided == Decided::Adopt {
            // A job that reports no iteration gets a time axis.
            self.conv.use_job_axis(Some(super::points::TimeAxis {
                from: self.run.start,
                after: super::points::now_ms() as f64 / 1000.0
                    + self.settings.time_axis_after.as_secs_f64(),
            }));
        }
        let now = Instant::now();
        for e in std::mem::take(&mut self.held) {
            self.conv.push(e, now, pending);
        }
    }

    /// Only the job's own task would do and it announced none: nothing
    /// is reported, nothing kept for a resend, nothing counted as failed.
    fn stand_down(&mut self) {
        let why = "the job announced no ClearML task (Task.init)".to_string();
        tracing::debug!("ClearML: {why}; nothing was reported");
        self.held.clear();
        self.machine.phase = Phase::Disabled;
        self.machine.problem(why.clone());
        self.stood_down = Some(why);
        let _ = self.settled_tx.send(true);
    }

    /// The job announced its own task.
    fn announced(&mut self, t: JobTask, pending: &mut Vec<Point>) {
        if let Some(close) = t.close {
            return self.close_offered(&t.id, close, t.reply);
        }
        match self.machine.announced(&t.id) {
            Announce::Adopt => {
                tracing::info!(
                    "ClearML: the job announced its task {}; reporting into it",
                    t.id
                );
                self.decide(Some(t.id), pending);
                self.announce_replies.extend(t.reply);
            }
            Announce::Hold => {
                // Clients that gave up waiting leave nothing behind.
                self.announce_replies.retain(|r| !r.is_closed());
                self.announce_replies.extend(t.reply);
            }
            Announce::Answer { reply, warn } => {
                if warn {
                    if let Some(n) = self.announce_logged.hit() {
                        tracing::warn!(
                            "ClearML: {} ({n} such announcements so far)",
                            reply.message
                        );
                    }
                }
                if let Some(r) = t.reply {
                    let _ = r.send(reply);
                }
            }
        }
    }

    /// Answers the announcements waiting for the outcome, once it is known.
    fn answer_announcements(&mut self) {
        if self.announce_replies.is_empty() {
            return;
        }
        let Some(reply) = self.machine.answer() else {
            return;
        };
        for r in self.announce_replies.drain(..) {
            let _ = r.send(reply.clone());
        }
    }

    fn begin_end(&mut self, f: Finish) -> Ending {
        let now = Instant::now();
        let until = now + f.timeout;
        let reserve = if self.machine.owns_status() {
            self.settings.request_timeout.min(f.timeout / 4)
        } else {
            Duration::ZERO
        };
        Ending {
            outcome: f.outcome,
            end: EndProgress::new(),
            drain_until: now + DRAIN_WAIT.min(f.timeout / 4),
            points_until: until - reserve,
            until,
            reply: f.reply,
        }
    }

    /// Everything already in the channel, without waiting.
    fn drain_now(&mut self, entries: &mut mpsc::UnboundedReceiver<Entry>, out: &mut Vec<Point>) {
        let now = Instant::now();
        while let Ok(e) = entries.try_recv() {
            self.conv.push(e, now, out);
        }
    }

    /// New points into the queue. With reporting off they are kept too
    /// (spilling to the spool file), for a later `clearml-resend`.
    fn accept(&mut self, pending: &mut Vec<Point>) {
        if pending.is_empty() {
            return;
        }
        if self.stood_down.is_some() {
            pending.clear();
            return;
        }
        self.queue.extend(pending.drain(..));
    }

    /// Stops a job early; its batch goes back to the queue.
    fn cancel(&mut self, r: Running) {
        drop(r.fut);
        if let JobKind::Batch(points) = r.kind {
            self.queue.put_back(points);
        }
    }

    /// Stops reporting for this run (wrong credentials, a locked task, …).
    /// The points are kept: they stay in the spool file at the end, and
    /// `memtrack clearml-resend` sends them once the cause is fixed.
    fn disable(&mut self, why: String) {
        tracing::error!(
            "ClearML reporting is off for this run: {why}; its points are kept for \
             `memtrack clearml-resend`"
        );
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.machine.disable(why);
        let _ = self.settled_tx.send(true);
    }

    /// Starts the next job and moves the end of the run along.
    fn advance(
        &mut self,
        job: &mut Option<Running>,
        ending: &mut Option<Ending>,
        entries_open: bool,
    ) {
        if let Some(e) = ending.as_mut() {
            self.advance_end(job, e, entries_open);
            if e.end.stage != EndStage::Setup
                || job.is_some()
                || !matches!(self.machine.phase, Phase::Starting)
            {
                return;
            }
        }
        if job.is_some() {
            return;
        }
        let due = Due {
            refresh: self.api.refresh_due(),
            artifact_pending: self.pending_artifact.is_some(),
            axis: self.last_axis.elapsed() >= self.settings.flush_interval,
            batch: self.queue.len() >= self.settings.batch_max as u64
                || (!self.queue.is_empty()
                    && self.last_send.elapsed() >= self.settings.flush_interval),
            ping: self.last_ok.elapsed() >= PING_AFTER,
        };
        let Some(plan) = self.machine.next_job(due) else {
            return;
        };
        let Phase::Ready(t) = &self.machine.phase else {
            *job = Some(self.setup_job());
            return;
        };
        let id = t.task.id.clone();
        *job = match plan {
            Plan::Setup => Some(self.setup_job()),
            Plan::Refresh => Some(self.refresh_job()),
            Plan::Artifact => self
                .pending_artifact
                .take()
                .map(|a| self.artifact_job(&id, true, &a, None)),
            Plan::Axis => Some(self.axis_job(&id)),
            Plan::Batch => self.batch_job(),
            Plan::Ping => Some(self.ping_job(&id)),
        };
    }

    /// Moves the end of the run along as far as it goes now.
    fn advance_end(&mut self, job: &mut Option<Running>, e: &mut Ending, entries_open: bool) {
        let now = Instant::now();
        loop {
            let facts = EndFacts {
                entries_open,
                drain_passed: now >= e.drain_until,
                job_running: job.is_some(),
                has_artifact: e.outcome.artifact.is_some(),
                queue_empty: self.queue.is_empty(),
            };
            match self.machine.end_step(&e.end, facts) {
                EndStep::Stay => break,
                EndStep::Move(stage) => e.end.stage = stage,
                EndStep::CloseIntake { still_open } => {
                    if still_open {
                        tracing::warn!(
                            "ClearML: the entry channel is still open at the end of the run; \
                             going on without waiting"
                        );
                    }
                    let mut pending = Vec::new();
                    // No announcement came: memtrack's own task.
                    self.decide(None, &mut pending);
                    self.conv.close_all(&mut pending);
                    self.accept(&mut pending);
                    e.end.stage = EndStage::Setup;
                }
                EndStep::RestoreAside => {
                    self.queue.restore_aside();
                    e.end.aside_restored = true;
                }
                EndStep::StartArtifact { task, check_status } => {
                    if let Some(a) = e.outcome.artifact.as_ref() {
                        let page = e.outcome.page.as_ref();
                        *job = Some(self.artifact_job(&task, check_status, a, page));
                    }
                    e.end.artifact_started = true;
                    break;
                }
                EndStep::StartBatch => {
                    *job = self.batch_job();
                    break;
                }
                EndStep::StartStatus { task } => {
                    let close = self.machine.deferred_close.clone();
                    *job = Some(self.status_job(&task, &e.outcome, close));
                    e.end.status_started = true;
                    break;
                }
            }
        }
    }

    /// A job came back: the machine decides, this does what it says.
    fn on_job(&mut self, kind: Option<JobKind>, out: JobOutput) {
        match (kind, out) {
            (_, JobOutput::Setup(Ok(ctx))) => self.setup_done(ctx),
            (_, JobOutput::Setup(Err(why))) => {
                self.disable(why.to_string());
                self.answer_announcements();
            }
            (_, JobOutput::Axis(res)) => match res {
                Ok(n) => self.conv.raise_axis(n),
                Err(CallError::Auth(m)) => self.disable(m),
                Err(e) => tracing::debug!("ClearML: cannot read the task's iteration: {e}"),
            },
            (Some(JobKind::Batch(points)), JobOutput::Batch(res)) => self.batch_done(points, res),
            (_, JobOutput::Artifact(res)) => self.artifact_done(res),
            (_, JobOutput::Status(res)) => match res {
                Ok(s) => self.machine.final_status = Some(s),
                Err(m) => {
                    tracing::error!("ClearML: {m}");
                    self.machine.problem(m.to_string());
                }
            },
            (_, JobOutput::Refresh(res)) => match res {
                Ok(()) => {}
                Err(CallError::Auth(m)) => self.disable(m),
                Err(e) => tracing::warn!("ClearML: cannot refresh the token: {e}"),
            },
            (_, JobOutput::Ping(res)) => {
                if let Err(e) = res {
                    tracing::warn!("ClearML: tasks.ping failed: {e}");
                }
            }
            (kind, JobOutput::Batch(_)) => {
                // A batch result without its batch cannot happen; keep the
                // points safe anyway.
                if let Some(JobKind::Batch(points)) = kind {
                    self.queue.put_back(points);
                }
            }
        }
    }

    /// The task is known: say so, note it, and tell whoever waits.
    fn setup_done(&mut self, ctx: TaskCtx) {
        self.last_ok = Instant::now();
        let link = if self.settings.web_host.is_empty() || ctx.project_id.is_empty() {
            String::new()
        } else {
            format!(
                ": {}/projects/{}/experiments/{}/output/execution",
                self.settings.web_host, ctx.project_id, ctx.task.id
            )
        };
        tracing::info!(
            "ClearML: reporting memory scalars into task `{}` ({}) of project `{}`{}{link}",
            ctx.task.name,
            ctx.task.id,
            ctx.task.project,
            if ctx.created {
                ", created by memtrack"
            } else {
                ""
            },
        );
        task_note::write(&self.task_file, &ctx.task.note(ctx.created));
        let _ = self.task_tx.send(Some(ctx.task.clone()));
        if ctx.adopted {
            let _ = self.job_task_tx.send(Some(ctx.task.clone()));
        }
        let _ = self.settled_tx.send(true);
        self.machine.setup_done(ctx);
        self.answer_announcements();
    }

    fn batch_done(&mut self, points: Vec<Point>, res: Result<Value, CallError>) {
        let n = points.len() as u64;
        match self.machine.batch_done(n, res) {
            BatchVerdict::Stored { refused, info } => {
                self.last_ok = Instant::now();
                if refused > 0 {
                    self.errors.fetch_add(refused, Ordering::Relaxed);
                    if self.partial_logged.hit().is_some() {
                        tracing::warn!(
                            "ClearML refused {refused} of {n} points in a batch: {info}"
                        );
                    }
                }
                self.queue.settle(points.len());
            }
            BatchVerdict::Stop(m) => {
                self.queue.put_back(points);
                self.disable(m);
            }
            BatchVerdict::SetAside(e) => {
                // Internal errors, attempt after attempt: the server may
                // choke on this batch, or its storage may be down. Later
                // batches go on; this one is kept and tried again at the
                // end, then left for a resend.
                self.queue.set_aside(points);
                if self.set_aside_logged.hit().is_some() {
                    tracing::warn!(
                        "ClearML failed a batch of {n} points with server errors ({e}); it is \
                         kept and tried again at the end of the run"
                    );
                }
            }
            BatchVerdict::Dropped(e) => {
                self.errors.fetch_add(n, Ordering::Relaxed);
                tracing::error!("ClearML refused a batch of {n} points; it is dropped: {e}");
                self.queue.settle(points.len());
            }
        }
    }

    fn artifact_done(&mut self, res: Result<ArtifactRegistered, CallError>) {
        match self.machine.artifact_done(res) {
            ArtifactVerdict::ArtifactRegistered { first } => {
                if first {
                    tracing::info!("ClearML: registered the memory_usage artifact");
                }
            }
            ArtifactVerdict::Closed { status, registered } => {
                tracing::info!(
                    "ClearML: the task is `{status}` and takes no more artifacts; {}",
                    if registered {
                        "memory_usage stays registered as of its latest checkpoint, and the \
                         object it points at is brought up to date by the final upload"
                    } else {
                        "memory_usage could not be registered on it"
                    }
                );
            }
            ArtifactVerdict::Failed(m) => tracing::error!("ClearML: {m}"),
        }
        self.answer_announcements();
    }

    fn persist(&mut self) -> u64 {
        match self.queue.persist() {
            Ok(n) => n,
            Err(e) => {
                let m = format!(
                    "cannot write the unsent points to {}: {e}",
                    crate::files::shown(self.queue.path()).display()
                );
                tracing::error!("ClearML: {m}");
                self.machine.problem(m);
                0
            }
        }
    }

    fn report(&mut self) -> FinishReport {
        let unsent = self.persist();
        if unsent == 0 {
            // Nothing left for a resend: the note has served.
            match std::fs::remove_file(&self.task_file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!("ClearML: cannot remove {}: {e}", self.task_file.display())
                }
            }
        }
        if self.queue.lost > 0 {
            let m = format!(
                "{} points were lost because the spool file could not be written",
                self.queue.lost
            );
            self.machine.problem(m);
        }
        if self.conv.dropped.duplicates > 0 {
            tracing::info!(
                "ClearML: {} points repeated a (title, series, iteration) already sent and were \
                 skipped",
                self.conv.dropped.duplicates
            );
        }
        let task = match &self.machine.phase {
            Phase::Ready(t) => Some(t.task.clone()),
            _ => None,
        };
        self.say_close_left_undone(task.as_ref());
        FinishReport {
            stood_down: self.stood_down.clone(),
            sent: self.machine.sent,
            unsent,
            duplicates_skipped: self.conv.dropped.duplicates,
            non_finite_skipped: self.conv.dropped.non_finite,
            refused: self.machine.refused,
            discarded: self.queue.lost,
            errors: self.machine.problems.clone(),
            task,
            spool: (unsent > 0).then(|| self.queue.path().to_path_buf()),
            artifact_registered: self.machine.artifact_registered,
            final_status: self.machine.final_status.clone(),
        }
    }
}
