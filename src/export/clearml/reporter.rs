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

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use super::api::{Api, Body, CallError};
use super::points::{Converter, Point};
use super::queue::Queue;
use super::{
    Artifact, FinishReport, RunEnd, RunInfoLite, Settings, TaskRef, SPOOL_FILE, TASK_FILE,
};
use crate::event::inbox::{JobTask, JobTaskReply};
use crate::logging::RateLimited;
use crate::model::Entry;

/// Largest `events.add_batch` body (the SDK caps at 15 MiB).
const MAX_BATCH_BYTES: usize = 4 << 20;

/// A created task is pinged when no request reached the server this long
/// (the server force-stops an `in_progress` task silent for 2 h).
const PING_AFTER: Duration = Duration::from_secs(15 * 60);

/// How long the end of the run waits for the engine to close the channel.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// Distinct problems kept for the final report.
const MAX_ERRORS: usize = 32;

/// Handle on the reporter task.
#[derive(Debug)]
pub struct Reporter {
    task: watch::Receiver<Option<TaskRef>>,
    /// The job's own task, once taken up.
    job_task: watch::Receiver<Option<TaskRef>>,
    /// Uploaded checkpoints of the document (or why an upload failed), to
    /// register on the job's task.
    artifacts: Option<mpsc::UnboundedSender<Result<Artifact, String>>>,
    /// True once the task is known or reporting is off for good.
    settled: watch::Receiver<bool>,
    /// Set when the run ends: stop waiting for the job's task.
    hurry: watch::Sender<bool>,
    errors: Arc<AtomicU64>,
    finish: Option<oneshot::Sender<Finish>>,
    /// Set when the reporter could not start at all.
    failed: Option<String>,
}

#[derive(Debug)]
struct Finish {
    outcome: RunEnd,
    timeout: Duration,
    reply: oneshot::Sender<FinishReport>,
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
        run: RunInfoLite,
        run_dir: PathBuf,
        entries: mpsc::UnboundedReceiver<Entry>,
        job_tasks: Option<mpsc::UnboundedReceiver<JobTask>>,
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
    /// points of its spool file (see [`Queue::resume`]; the number is the
    /// lines that were not points), sent once the task is known.
    /// [`Reporter::finish`] then delivers them.
    pub fn resend(
        settings: Settings,
        run: RunInfoLite,
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
        run: RunInfoLite,
        run_dir: &std::path::Path,
        queue: Queue,
        entries: mpsc::UnboundedReceiver<Entry>,
        job_tasks: Option<mpsc::UnboundedReceiver<JobTask>>,
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
            }
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return failed("no tokio runtime to run on".into());
        };
        let api = match Api::new(&settings, Arc::clone(&errors)) {
            Ok(a) => a,
            Err(e) => return failed(e),
        };
        let (finish_tx, finish_rx) = oneshot::channel();
        let (artifacts_tx, artifacts_rx) = mpsc::unbounded_channel();
        let (hurry_tx, hurry_rx) = watch::channel(false);
        // Without a given task, wait a while for the job's own.
        let phase = match (&settings.task, &job_tasks) {
            (None, Some(_)) if !settings.job_task_wait.is_zero() => Phase::Waiting,
            _ => Phase::Starting,
        };
        let wait_until = Instant::now() + settings.job_task_wait;
        let state = State {
            conv: Converter::new(settings.timer_every),
            queue,
            task_file: run_dir.join(TASK_FILE),
            api,
            settings,
            run,
            phase,
            wait_until,
            adopt: None,
            held: Vec::new(),
            announce_replies: Vec::new(),
            pending_artifact: None,
            artifact_open: true,
            artifact_settled: false,
            last_axis: Instant::now(),
            job_task_tx,
            announce_logged: RateLimited::default(),
            errors: Arc::clone(&errors),
            problems: Vec::new(),
            task_tx,
            settled_tx,
            sent: 0,
            refused: 0,
            last_send: Instant::now(),
            last_ok: Instant::now(),
            partial_logged: RateLimited::default(),
            set_aside_logged: RateLimited::default(),
            artifact_registered: false,
            final_status: None,
        };
        handle.spawn(state.run(entries, finish_rx, job_tasks, artifacts_rx, hurry_rx));
        Reporter {
            task: task_rx,
            job_task: job_task_rx,
            artifacts: Some(artifacts_tx),
            hurry: hurry_tx,
            settled: settled_rx,
            errors,
            finish: Some(finish_tx),
            failed: None,
        }
    }

    /// The task, once known: id, name, project name.
    pub fn task(&self) -> Option<TaskRef> {
        self.task.borrow().clone()
    }

    /// Waits until the task is known or reporting is off, at most
    /// `timeout`; then [`Reporter::task`]. Called when the run has ended:
    /// a reporter still waiting for the job's own task stops waiting and
    /// creates its own.
    pub async fn settle(&self, timeout: Duration) -> Option<TaskRef> {
        let _ = self.hurry.send(true);
        let mut settled = self.settled.clone();
        let _ = tokio::time::timeout(timeout, settled.wait_for(|s| *s)).await;
        self.task()
    }

    /// Follows the job's own task (announced by the job and taken up).
    pub fn job_task(&self) -> watch::Receiver<Option<TaskRef>> {
        self.job_task.clone()
    }

    /// Where the run hands in uploaded checkpoints of the document: while
    /// memtrack reports into the job's own task, each is registered as the
    /// `memory_usage` artifact as long as the task takes it.
    pub fn artifacts(&self) -> Option<mpsc::UnboundedSender<Result<Artifact, String>>> {
        self.artifacts.clone()
    }

    /// Follows the task as it becomes known (for keys computed later).
    pub fn task_updates(&self) -> watch::Receiver<Option<TaskRef>> {
        self.task.clone()
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
    pub async fn finish(mut self, outcome: RunEnd, timeout: Duration) -> FinishReport {
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

/// Waits for the job's task ([`Reporter::job_task`]) to change; `false`
/// (and no more waiting) once the reporter is gone.
pub async fn job_task_changed(rx: &mut Option<watch::Receiver<Option<TaskRef>>>) -> bool {
    let Some(r) = rx.as_mut() else {
        return std::future::pending().await;
    };
    if r.changed().await.is_ok() {
        return true;
    }
    *rx = None;
    false
}

/// Whether memtrack reports into the job's own task.
pub fn job_task_known(rx: &Option<watch::Receiver<Option<TaskRef>>>) -> bool {
    rx.as_ref().is_some_and(|r| r.borrow().is_some())
}

/// Where the reporter stands with the server.
#[derive(Debug, Clone)]
enum Phase {
    /// Waiting for the job to announce its own task (entries are held).
    Waiting,
    /// Logging in and finding or creating the task (retrying as needed).
    Starting,
    Ready(TaskCtx),
    /// Reporting is off (wrong credentials, locked task, …).
    Disabled,
}

#[derive(Debug, Clone)]
struct TaskCtx {
    task: TaskRef,
    project_id: String,
    /// memtrack created it, so memtrack starts and ends it.
    created: bool,
    /// The job announced it: its own task, on its own iteration axis.
    adopted: bool,
}

type JobFuture = Pin<Box<dyn Future<Output = JobOutput> + Send>>;

enum JobOutput {
    Setup(Result<TaskCtx, String>),
    Batch(Result<Value, CallError>),
    Artifact(Result<Registered, CallError>),
    Status(Result<String, String>),
    /// The task's `last_iteration`.
    Axis(Result<u64, CallError>),
    Ping(Result<Value, CallError>),
    Refresh(Result<(), CallError>),
}

enum JobKind {
    Setup,
    /// The points out for sending (put back if the job is cut short).
    Batch(Vec<Point>),
    Artifact,
    Status,
    Ping,
    Refresh,
    Axis,
}

/// What an artifact job achieved.
#[derive(Debug)]
enum Registered {
    Yes,
    /// The task no longer takes artifacts (its owner closed it).
    Closed(String),
}

struct Running {
    kind: JobKind,
    fut: JobFuture,
}

/// Stages of the end of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Drain,
    Setup,
    Artifact,
    Flush,
    Status,
    Done,
}

struct Ending {
    outcome: RunEnd,
    stage: Stage,
    drain_until: Instant,
    /// Points (and the artifact) must be out by then, leaving time for
    /// the final status.
    points_until: Instant,
    until: Instant,
    reply: oneshot::Sender<FinishReport>,
    status_started: bool,
    artifact_started: bool,
    /// The points set aside during the run went back into the line.
    aside_restored: bool,
}

enum Event {
    Finish(Option<Finish>),
    Entry(Option<Entry>),
    JobTask(Option<JobTask>),
    /// The run ended (`false`: the handle is gone).
    Hurry(bool),
    Checkpoint(Option<Result<Artifact, String>>),
    Job(JobOutput),
    Tick,
    Deadline,
}

struct State {
    settings: Settings,
    run: RunInfoLite,
    api: Api,
    conv: Converter,
    queue: Queue,
    /// Where the task is noted for a later `clearml-resend`.
    task_file: PathBuf,
    phase: Phase,
    errors: Arc<AtomicU64>,
    problems: Vec<String>,
    task_tx: watch::Sender<Option<TaskRef>>,
    settled_tx: watch::Sender<bool>,
    sent: u64,
    refused: u64,
    last_send: Instant,
    last_ok: Instant,
    partial_logged: RateLimited,
    set_aside_logged: RateLimited,
    artifact_registered: bool,
    final_status: Option<String>,
    /// End of [`Phase::Waiting`].
    wait_until: Instant,
    /// The job's task to take up (set when announced).
    adopt: Option<String>,
    /// Entries held while waiting for the job's task.
    held: Vec<Entry>,
    /// Announcements waiting for the outcome.
    announce_replies: Vec<oneshot::Sender<JobTaskReply>>,
    /// The latest uploaded checkpoint not yet registered.
    pending_artifact: Option<Artifact>,
    /// False once the job's task refused artifacts (closed by its owner).
    artifact_open: bool,
    /// The first registration on the job's task was tried (or its upload
    /// failed): announcements can be answered.
    artifact_settled: bool,
    /// When the task's `last_iteration` was last read (job axis).
    last_axis: Instant,
    job_task_tx: watch::Sender<Option<TaskRef>>,
    /// Announcements of another task, logged at most every 100th.
    announce_logged: RateLimited,
}

/// One `events.add_batch` line (docs/clearml.md, "The wire").
#[derive(serde::Serialize)]
struct Wire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    task: &'a str,
    metric: &'a str,
    variant: &'a str,
    value: f64,
    iter: u64,
    timestamp: i64,
    model_event: bool,
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

impl State {
    async fn run(
        mut self,
        mut entries: mpsc::UnboundedReceiver<Entry>,
        mut finish_rx: oneshot::Receiver<Finish>,
        job_tasks: Option<mpsc::UnboundedReceiver<JobTask>>,
        mut artifacts: mpsc::UnboundedReceiver<Result<Artifact, String>>,
        mut hurry: watch::Receiver<bool>,
    ) {
        let mut hurry_open = true;
        let mut job_tasks_open = job_tasks.is_some();
        let mut job_tasks = job_tasks.unwrap_or_else(|| mpsc::unbounded_channel().1);
        let mut artifacts_open = true;
        let period = (self.settings.flush_interval / 2)
            .clamp(Duration::from_millis(20), Duration::from_secs(1));
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut job: Option<Running> = None;
        let mut ending: Option<Ending> = None;
        let mut entries_open = true;
        let mut finish_open = true;
        let mut pending: Vec<Point> = Vec::new();
        loop {
            self.advance(&mut job, &mut ending, entries_open);
            if ending.as_ref().is_some_and(|e| e.stage == Stage::Done) {
                break;
            }
            let deadline = ending.as_ref().map(|e| match e.stage {
                Stage::Drain => e.drain_until,
                Stage::Setup | Stage::Artifact | Stage::Flush => e.points_until,
                Stage::Status | Stage::Done => e.until,
            });
            let deadline = match (&self.phase, deadline) {
                (Phase::Waiting, None) => Some(self.wait_until),
                (_, d) => d,
            };
            let event = tokio::select! {
                f = &mut finish_rx, if finish_open => Event::Finish(f.ok()),
                e = entries.recv(), if entries_open => Event::Entry(e),
                t = job_tasks.recv(), if job_tasks_open => Event::JobTask(t),
                a = artifacts.recv(), if artifacts_open => Event::Checkpoint(a),
                h = hurry.changed(), if hurry_open => Event::Hurry(h.is_ok()),
                out = poll_job(&mut job), if job.is_some() => Event::Job(out),
                _ = ticker.tick() => Event::Tick,
                _ = sleep_until(deadline), if deadline.is_some() => Event::Deadline,
            };
            match event {
                Event::Finish(f) => {
                    finish_open = false;
                    match f {
                        Some(f) => ending = Some(self.begin_end(f)),
                        None => {
                            // The handle was dropped without finish(): keep
                            // the points on disk and stop.
                            if let Some(r) = job.take() {
                                self.cancel(r);
                            }
                            self.drain_now(&mut entries, &mut pending);
                            self.decide(None, &mut pending);
                            self.conv.close_all(&mut pending);
                            self.queue.extend(pending.drain(..));
                            let _ = self.persist();
                            return;
                        }
                    }
                }
                Event::Entry(Some(e)) => {
                    let now = Instant::now();
                    self.intake(e, now, &mut pending);
                    // Take what else is already there in one go.
                    for _ in 0..1024 {
                        match entries.try_recv() {
                            Ok(e) => self.intake(e, now, &mut pending),
                            Err(_) => break,
                        }
                    }
                    self.accept(&mut pending);
                }
                Event::Entry(None) => entries_open = false,
                Event::JobTask(None) => job_tasks_open = false,
                Event::JobTask(Some(t)) => {
                    self.announced(t, &mut pending);
                    self.accept(&mut pending);
                }
                Event::Hurry(alive) => {
                    hurry_open = false;
                    if alive && matches!(self.phase, Phase::Waiting) {
                        tracing::info!(
                            "ClearML: the run ended before the job announced a task of its own; \
                             memtrack creates one"
                        );
                        self.decide(None, &mut pending);
                        self.accept(&mut pending);
                    }
                }
                Event::Checkpoint(None) => artifacts_open = false,
                Event::Checkpoint(Some(Ok(a))) => self.pending_artifact = Some(a),
                Event::Checkpoint(Some(Err(why))) => {
                    if !self.artifact_settled {
                        self.artifact_settled = true;
                        self.problem(format!(
                            "the checkpoint to register as the job's task's artifact could not be \
                             uploaded: {why}"
                        ));
                        self.answer_announcements();
                    }
                }
                Event::Job(out) => {
                    let kind = job.take().map(|r| r.kind);
                    self.on_job(kind, out);
                }
                Event::Tick => {
                    self.conv
                        .close_passed(f64::NEG_INFINITY, Instant::now(), &mut pending);
                    self.accept(&mut pending);
                }
                Event::Deadline if matches!(self.phase, Phase::Waiting) && ending.is_none() => {
                    if Instant::now() >= self.wait_until {
                        tracing::info!(
                            "ClearML: the job announced no task of its own within {:?} \
                             (clearml.job_task_wait); memtrack creates one",
                            self.settings.job_task_wait
                        );
                        self.decide(None, &mut pending);
                        self.accept(&mut pending);
                    }
                }
                Event::Deadline => {
                    if let Some(e) = ending.as_mut() {
                        match e.stage {
                            Stage::Drain => {} // advance() moves on
                            Stage::Setup | Stage::Artifact | Stage::Flush => {
                                if let Some(r) = job.take() {
                                    self.cancel(r);
                                }
                                let left = self.queue.len() + self.queue.aside() as u64;
                                let m = match (&self.phase, self.api.last_error()) {
                                    (Phase::Starting, Some(last)) => format!(
                                        "the ClearML server {} could not be reached before the \
                                         end of the run ({last}); {left} points stay unsent",
                                        self.api.host()
                                    ),
                                    _ => format!(
                                        "the final flush ran out of time with {left} points unsent"
                                    ),
                                };
                                self.problem(m);
                                e.stage = Stage::Status;
                            }
                            Stage::Status | Stage::Done => {
                                if let Some(r) = job.take() {
                                    self.cancel(r);
                                }
                                if e.status_started {
                                    self.problem(
                                        "the task's final status could not be set before the timeout"
                                            .into(),
                                    );
                                }
                                e.stage = Stage::Done;
                            }
                        }
                    }
                }
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

    /// An entry in: held while waiting for the job's task, else converted.
    fn intake(&mut self, e: Entry, now: Instant, pending: &mut Vec<Point>) {
        if matches!(self.phase, Phase::Waiting) {
            self.held.push(e);
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
        if !matches!(self.phase, Phase::Waiting) {
            return;
        }
        if adopt.is_some() {
            self.conv.use_job_axis();
        }
        self.adopt = adopt;
        self.phase = Phase::Starting;
        let now = Instant::now();
        for e in std::mem::take(&mut self.held) {
            self.conv.push(e, now, pending);
        }
    }

    /// The job announced its own task.
    fn announced(&mut self, t: JobTask, pending: &mut Vec<Point>) {
        let answer = |reply: Option<oneshot::Sender<JobTaskReply>>, reporting, message: String| {
            if let Some(r) = reply {
                let _ = r.send(JobTaskReply {
                    reporting,
                    artifact: false,
                    message,
                });
            }
        };
        match &self.phase {
            Phase::Waiting => {
                tracing::info!(
                    "ClearML: the job announced its task {}; reporting into it",
                    t.id
                );
                self.decide(Some(t.id), pending);
                self.announce_replies.extend(t.reply);
            }
            Phase::Starting if self.adopt.as_deref() == Some(&t.id) => {
                self.announce_replies.extend(t.reply);
            }
            Phase::Ready(ctx) if ctx.task.id == t.id => {
                if ctx.adopted && self.artifact_expected() && !self.artifact_settled {
                    self.announce_replies.extend(t.reply);
                } else if let Some(r) = t.reply {
                    let _ = r.send(JobTaskReply {
                        reporting: true,
                        artifact: self.artifact_registered,
                        message: format!("memtrack reports into task {}", t.id),
                    });
                }
            }
            Phase::Ready(ctx) => {
                let m = format!(
                    "memtrack already reports into task {} ({}); the job's task {} is left alone{}",
                    ctx.task.id,
                    if ctx.adopted {
                        "announced earlier"
                    } else if ctx.created {
                        "created after waiting clearml.job_task_wait for the job's own"
                    } else {
                        "given to memtrack"
                    },
                    t.id,
                    if ctx.created {
                        "; call Task.init earlier or raise clearml.job_task_wait"
                    } else {
                        ""
                    }
                );
                if self.announce_logged.hit(100).is_some() {
                    tracing::warn!("ClearML: {m}");
                }
                answer(t.reply, false, m);
            }
            Phase::Starting => {
                let m = format!(
                    "memtrack is already setting up {}; the job's task {} is left alone",
                    match &self.adopt {
                        Some(id) => format!("the job's task {id}"),
                        None => match &self.settings.task {
                            Some(id) => format!("task {id}"),
                            None => "a task of its own (clearml.job_task_wait passed)".into(),
                        },
                    },
                    t.id
                );
                if self.announce_logged.hit(100).is_some() {
                    tracing::warn!("ClearML: {m}");
                }
                answer(t.reply, false, m);
            }
            Phase::Disabled => {
                let m = format!(
                    "ClearML reporting is off for this run ({})",
                    self.problems
                        .last()
                        .map_or("see memtrack's log", String::as_str)
                );
                answer(t.reply, false, m);
            }
        }
    }

    /// Whether a `memory_usage` artifact will be registered (S3 is on).
    fn artifact_expected(&self) -> bool {
        self.settings.artifact_expected
    }

    /// Answers the announcements waiting for the outcome, once it is known.
    fn answer_announcements(&mut self) {
        if self.announce_replies.is_empty() {
            return;
        }
        let (reporting, message) = match &self.phase {
            Phase::Ready(ctx) if ctx.adopted => {
                if self.artifact_expected() && !self.artifact_settled {
                    return; // not yet: the first registration is under way
                }
                (
                    true,
                    format!(
                        "memtrack reports into task {}{}",
                        ctx.task.id,
                        if self.artifact_registered {
                            " and registered the memory_usage artifact"
                        } else {
                            ""
                        }
                    ),
                )
            }
            Phase::Waiting | Phase::Starting => return,
            Phase::Ready(ctx) => (
                false,
                format!("memtrack reports into task {} instead", ctx.task.id),
            ),
            Phase::Disabled => (
                false,
                format!(
                    "ClearML reporting is off for this run ({})",
                    self.problems
                        .last()
                        .map_or("see memtrack's log", String::as_str)
                ),
            ),
        };
        for r in self.announce_replies.drain(..) {
            let _ = r.send(JobTaskReply {
                reporting,
                artifact: self.artifact_registered,
                message: message.clone(),
            });
        }
    }

    fn begin_end(&mut self, f: Finish) -> Ending {
        let now = Instant::now();
        let until = now + f.timeout;
        let owns_status = match &self.phase {
            Phase::Waiting => true,
            Phase::Starting => self.settings.task.is_none() && self.adopt.is_none(),
            Phase::Ready(t) => t.created,
            Phase::Disabled => false,
        };
        let reserve = if owns_status {
            self.settings.request_timeout.min(f.timeout / 4)
        } else {
            Duration::ZERO
        };
        Ending {
            outcome: f.outcome,
            stage: Stage::Drain,
            drain_until: now + DRAIN_WAIT.min(f.timeout / 4),
            points_until: until - reserve,
            until,
            reply: f.reply,
            status_started: false,
            artifact_started: false,
            aside_restored: false,
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
        self.queue.extend(pending.drain(..));
    }

    fn problem(&mut self, p: String) {
        if self.problems.len() < MAX_ERRORS && !self.problems.contains(&p) {
            self.problems.push(p);
        }
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
        self.problem(why);
        self.phase = Phase::Disabled;
        let _ = self.settled_tx.send(true);
    }

    /// Notes the task beside the spool, for a later resend.
    fn write_task_file(&self, ctx: &TaskCtx) {
        super::write_task_note(&self.task_file, &ctx.task, ctx.created);
    }

    /// Starts the next job and moves the end of the run along.
    fn advance(
        &mut self,
        job: &mut Option<Running>,
        ending: &mut Option<Ending>,
        entries_open: bool,
    ) {
        if let Some(e) = ending.as_mut() {
            let now = Instant::now();
            loop {
                let before = e.stage;
                match e.stage {
                    Stage::Drain => {
                        if !entries_open || now >= e.drain_until {
                            if entries_open {
                                tracing::warn!(
                                    "ClearML: the entry channel is still open at the end of the \
                                     run; going on without waiting"
                                );
                            }
                            let mut pending = Vec::new();
                            // No announcement came: memtrack's own task.
                            self.decide(None, &mut pending);
                            self.conv.close_all(&mut pending);
                            self.accept(&mut pending);
                            e.stage = Stage::Setup;
                        }
                    }
                    Stage::Setup => match &self.phase {
                        Phase::Waiting | Phase::Starting => {}
                        Phase::Ready(_) => e.stage = Stage::Artifact,
                        Phase::Disabled => e.stage = Stage::Done,
                    },
                    Stage::Artifact => {
                        if e.outcome.artifact.is_none()
                            || !matches!(self.phase, Phase::Ready(_))
                            || !self.artifact_open
                        {
                            e.stage = Stage::Flush;
                        } else if !e.artifact_started {
                            if job.is_none() {
                                if let (Phase::Ready(t), Some(a)) =
                                    (&self.phase, e.outcome.artifact.as_ref())
                                {
                                    *job = Some(self.artifact_job(&t.task.id, !t.created, a));
                                    e.artifact_started = true;
                                }
                            }
                        } else if job.is_none() {
                            e.stage = Stage::Flush;
                        }
                    }
                    Stage::Flush => {
                        if !e.aside_restored {
                            // One more try for batches the server failed
                            // with internal errors: it may be back.
                            self.queue.restore_aside();
                            e.aside_restored = true;
                        }
                        if matches!(self.phase, Phase::Disabled) {
                            e.stage = Stage::Done;
                        } else if job.is_none() {
                            if self.queue.is_empty() {
                                e.stage = Stage::Status;
                            } else {
                                *job = self.batch_job();
                            }
                        }
                    }
                    Stage::Status => {
                        if !e.status_started {
                            match &self.phase {
                                Phase::Ready(t) if t.created && job.is_none() => {
                                    *job = Some(self.status_job(&t.task.id, &e.outcome));
                                    e.status_started = true;
                                }
                                Phase::Ready(t) if t.created => {}
                                _ => e.stage = Stage::Done,
                            }
                        } else if job.is_none() {
                            e.stage = Stage::Done;
                        }
                    }
                    Stage::Done => {}
                }
                if e.stage == before {
                    break;
                }
            }
            if e.stage != Stage::Setup || job.is_some() || !matches!(self.phase, Phase::Starting) {
                return;
            }
        }
        if job.is_some() {
            return;
        }
        match &self.phase {
            Phase::Waiting => {}
            Phase::Starting => *job = Some(self.setup_job()),
            Phase::Ready(t) => {
                let due = self.queue.len() >= self.settings.batch_max as u64
                    || (!self.queue.is_empty()
                        && self.last_send.elapsed() >= self.settings.flush_interval);
                let (id, created, adopted) = (t.task.id.clone(), t.created, t.adopted);
                if self.api.refresh_due() {
                    *job = Some(self.refresh_job());
                } else if adopted && self.artifact_open && self.pending_artifact.is_some() {
                    // Registered while the job's task still takes it.
                    if let Some(a) = self.pending_artifact.take() {
                        *job = Some(self.artifact_job(&id, true, &a));
                    }
                } else if adopted && self.last_axis.elapsed() >= self.settings.flush_interval {
                    *job = Some(self.axis_job(&id));
                } else if due {
                    *job = self.batch_job();
                } else if created && self.last_ok.elapsed() >= PING_AFTER {
                    *job = Some(self.ping_job(&id));
                }
            }
            Phase::Disabled => {}
        }
    }

    fn setup_job(&self) -> Running {
        let api = self.api.clone();
        let mut settings = self.settings.clone();
        let adopted = self.adopt.is_some();
        if let Some(id) = &self.adopt {
            settings.task = Some(id.clone());
            settings.owns_task = false;
        }
        let run = self.run.clone();
        Running {
            kind: JobKind::Setup,
            fut: Box::pin(async move {
                JobOutput::Setup(setup(&api, &settings, &run).await.map(|mut ctx| {
                    ctx.adopted = adopted;
                    ctx
                }))
            }),
        }
    }

    /// Reads the job's task's `last_iteration`, the axis memtrack's points
    /// stay on.
    fn axis_job(&mut self, task: &str) -> Running {
        self.last_axis = Instant::now();
        let api = self.api.clone();
        let body = json!({"task": task});
        Running {
            kind: JobKind::Axis,
            fut: Box::pin(async move {
                JobOutput::Axis(
                    api.call_retrying("tasks.get_by_id", &Body::Json(body))
                        .await
                        .map(|d| {
                            d.pointer("/task/last_iteration")
                                .and_then(Value::as_u64)
                                .unwrap_or(0)
                        }),
                )
            }),
        }
    }

    fn batch_job(&mut self) -> Option<Running> {
        let Phase::Ready(t) = &self.phase else {
            return None;
        };
        let task = t.task.id.clone();
        let points = self.queue.take(self.settings.batch_max);
        if points.is_empty() {
            return None;
        }
        let mut body: Vec<u8> = Vec::with_capacity(points.len() * 200);
        let mut used = 0;
        for p in &points {
            let start = body.len();
            let wire = Wire {
                kind: "training_stats_scalar",
                task: &task,
                metric: &p.metric,
                variant: &p.variant,
                value: p.value,
                // Spooled points of older runs may exceed what the server stores.
                iter: p.iter.min(super::points::MAX_ITER),
                timestamp: p.timestamp,
                model_event: false,
            };
            // Writing into a Vec cannot fail; stop the batch if it ever does.
            if serde_json::to_writer(&mut body, &wire).is_err() {
                body.truncate(start);
                break;
            }
            if used > 0 && body.len() + 1 > MAX_BATCH_BYTES {
                body.truncate(start);
                break;
            }
            body.push(b'\n');
            used += 1;
        }
        let body = String::from_utf8(body).unwrap_or_default();
        let mut points = points;
        if used < points.len() {
            let rest = points.split_off(used);
            self.queue.put_back(rest);
        }
        self.last_send = Instant::now();
        let api = self.api.clone();
        Some(Running {
            kind: JobKind::Batch(points),
            fut: Box::pin(async move {
                JobOutput::Batch(
                    api.call_retrying("events.add_batch", &Body::Lines(body))
                        .await,
                )
            }),
        })
    }

    /// Registers `a` on `task`; a task memtrack did not create is read
    /// first, and left alone once it no longer takes artifacts.
    fn artifact_job(&self, task: &str, check_status: bool, a: &Artifact) -> Running {
        let body = json!({
            "task": task,
            "force": true,
            "artifacts": [{
                "key": "memory_usage",
                "type": "custom",
                "mode": "output",
                "uri": a.uri,
                "content_size": a.size,
                "hash": a.sha256.to_ascii_lowercase(),
                "timestamp": super::points::now_ms() / 1000,
                "type_data": {"content_type": "application/json"},
            }],
        });
        let api = self.api.clone();
        let task = task.to_string();
        Running {
            kind: JobKind::Artifact,
            fut: Box::pin(async move {
                JobOutput::Artifact(register_artifact(&api, &task, check_status, body).await)
            }),
        }
    }

    fn status_job(&self, task: &str, outcome: &RunEnd) -> Running {
        let api = self.api.clone();
        let task = task.to_string();
        let exit = outcome.exit;
        Running {
            kind: JobKind::Status,
            fut: Box::pin(async move { JobOutput::Status(final_status(&api, &task, exit).await) }),
        }
    }

    fn ping_job(&mut self, task: &str) -> Running {
        self.last_ok = Instant::now();
        let api = self.api.clone();
        let body = json!({"task": task});
        Running {
            kind: JobKind::Ping,
            fut: Box::pin(async move {
                JobOutput::Ping(api.call_retrying("tasks.ping", &Body::Json(body)).await)
            }),
        }
    }

    fn refresh_job(&self) -> Running {
        let api = self.api.clone();
        Running {
            kind: JobKind::Refresh,
            fut: Box::pin(async move { JobOutput::Refresh(api.refresh().await) }),
        }
    }

    fn on_job(&mut self, kind: Option<JobKind>, out: JobOutput) {
        match (kind, out) {
            (_, JobOutput::Setup(Ok(ctx))) => {
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
                self.write_task_file(&ctx);
                let _ = self.task_tx.send(Some(ctx.task.clone()));
                if ctx.adopted {
                    let _ = self.job_task_tx.send(Some(ctx.task.clone()));
                }
                let _ = self.settled_tx.send(true);
                self.phase = Phase::Ready(ctx);
                self.answer_announcements();
            }
            (_, JobOutput::Setup(Err(why))) => {
                self.disable(why);
                self.answer_announcements();
            }
            (_, JobOutput::Axis(res)) => match res {
                Ok(n) => self.conv.raise_axis(n),
                Err(CallError::Auth(m)) => self.disable(m),
                Err(e) => tracing::debug!("ClearML: cannot read the task's iteration: {e}"),
            },
            (Some(JobKind::Batch(points)), JobOutput::Batch(res)) => {
                let n = points.len() as u64;
                match res {
                    Ok(data) => {
                        self.last_ok = Instant::now();
                        let errors = data
                            .get("errors")
                            .and_then(Value::as_u64)
                            .unwrap_or(0)
                            .min(n);
                        self.sent += n - errors;
                        if errors > 0 {
                            self.refused += errors;
                            self.errors.fetch_add(errors, Ordering::Relaxed);
                            let info = data.get("errors_info").cloned().unwrap_or(Value::Null);
                            if self.partial_logged.hit(100).is_some() {
                                tracing::warn!(
                                    "ClearML refused {errors} of {n} points in a batch: {info}"
                                );
                            }
                            self.problem(format!("the server refused points: {info}"));
                        }
                        self.queue.settle(points.len());
                    }
                    Err(CallError::Auth(m)) => {
                        self.queue.put_back(points);
                        self.disable(m);
                    }
                    Err(e @ CallError::Transient { .. }) => {
                        // Internal errors, attempt after attempt: the server
                        // may choke on this batch, or its storage may be
                        // down. Later batches go on; this one is kept and
                        // tried again at the end, then left for a resend.
                        self.queue.set_aside(points);
                        if self.set_aside_logged.hit(100).is_some() {
                            tracing::warn!(
                                "ClearML failed a batch of {n} points with server errors ({e}); \
                                 it is kept and tried again at the end of the run"
                            );
                        }
                    }
                    Err(e) => {
                        // Rejected as a whole: drop it so later batches go on.
                        self.refused += n;
                        self.errors.fetch_add(n, Ordering::Relaxed);
                        tracing::error!(
                            "ClearML refused a batch of {n} points; it is dropped: {e}"
                        );
                        self.problem(format!("a batch of points was refused: {e}"));
                        self.queue.settle(points.len());
                    }
                }
            }
            (_, JobOutput::Artifact(res)) => {
                self.artifact_settled = true;
                match res {
                    Ok(Registered::Yes) => {
                        if !self.artifact_registered {
                            tracing::info!("ClearML: registered the memory_usage artifact");
                        }
                        self.artifact_registered = true;
                    }
                    Ok(Registered::Closed(status)) => {
                        self.artifact_open = false;
                        tracing::info!(
                            "ClearML: the task is `{status}` and takes no more artifacts; {}",
                            if self.artifact_registered {
                                "memory_usage stays registered as of its latest checkpoint, and \
                                 the object it points at is brought up to date by the final \
                                 upload"
                            } else {
                                "memory_usage could not be registered on it"
                            }
                        );
                        if !self.artifact_registered {
                            self.problem(format!(
                                "the task was `{status}` before the memory_usage artifact could \
                                 be registered"
                            ));
                        }
                    }
                    Err(e) => {
                        let m = format!("cannot register the memory_usage artifact: {e}");
                        tracing::error!("ClearML: {m}");
                        self.problem(m);
                        // Answer a waiting job rather than keep it waiting.
                        self.artifact_open = false;
                    }
                }
                self.answer_announcements();
            }
            (_, JobOutput::Status(res)) => match res {
                Ok(s) => self.final_status = Some(s),
                Err(m) => {
                    tracing::error!("ClearML: {m}");
                    self.problem(m);
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

    fn persist(&mut self) -> u64 {
        match self.queue.persist() {
            Ok(n) => n,
            Err(e) => {
                let m = format!(
                    "cannot write the unsent points to {}: {e}",
                    self.queue.path().display()
                );
                tracing::error!("ClearML: {m}");
                self.problem(m);
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
            self.problem(m);
        }
        if self.conv.dropped.duplicates > 0 {
            tracing::info!(
                "ClearML: {} points repeated a (title, series, iteration) already sent and were \
                 skipped",
                self.conv.dropped.duplicates
            );
        }
        let task = match &self.phase {
            Phase::Ready(t) => Some(t.task.clone()),
            _ => None,
        };
        FinishReport {
            sent: self.sent,
            unsent,
            duplicates_skipped: self.conv.dropped.duplicates,
            non_finite_skipped: self.conv.dropped.non_finite,
            refused: self.refused,
            discarded: self.queue.lost,
            errors: self.problems.clone(),
            task,
            spool: (unsent > 0).then(|| self.queue.path().to_path_buf()),
            artifact_registered: self.artifact_registered,
            final_status: self.final_status.clone(),
        }
    }
}

/// A fatal setup error in words (wrong credentials, locked or unknown
/// task, refused creation); transient ones are retried inside.
async fn setup(api: &Api, s: &Settings, run: &RunInfoLite) -> Result<TaskCtx, String> {
    let fatal = |what: &str, e: CallError| match e {
        CallError::Auth(m) => m,
        other => format!("{what}: {other}"),
    };
    match &s.task {
        Some(id) => {
            let data = api
                .call_retrying("tasks.get_by_id", &Body::Json(json!({"task": id})))
                .await
                .map_err(|e| match e {
                    CallError::Rejected { subcode: 101, .. } => format!(
                        "task {id} does not exist on the ClearML server {}",
                        api.host()
                    ),
                    e => fatal(&format!("cannot read task {id}"), e),
                })?;
            let task = data.get("task").cloned().unwrap_or(Value::Null);
            let status = task.get("status").and_then(Value::as_str).unwrap_or("");
            if status == "published" || status == "publishing" {
                return Err(format!(
                    "task {id} is {status} and locked; memtrack cannot report into it"
                ));
            }
            let name = task
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let project_id = task
                .get("project")
                .and_then(|p| p.as_str().or_else(|| p.get("id").and_then(Value::as_str)))
                .unwrap_or_default()
                .to_string();
            let project = if project_id.is_empty() {
                String::new()
            } else {
                match api
                    .call_retrying(
                        "projects.get_by_id",
                        &Body::Json(json!({"project": project_id})),
                    )
                    .await
                {
                    Ok(d) => d
                        .pointer("/project/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    Err(CallError::Auth(m)) => return Err(m),
                    Err(e) => {
                        tracing::warn!("ClearML: cannot read the project of task {id}: {e}");
                        String::new()
                    }
                }
            };
            Ok(TaskCtx {
                task: TaskRef {
                    id: id.clone(),
                    name,
                    project,
                },
                project_id,
                // A task an earlier run created and could not end.
                created: s.owns_task && status == "in_progress",
                adopted: false,
            })
        }
        None => {
            let project_id = project_id(api, &s.project)
                .await
                .map_err(|e| fatal(&format!("cannot find or create project `{}`", s.project), e))?;
            let name = if s.task_name.trim().is_empty() {
                run.name.clone()
            } else {
                s.task_name.clone()
            };
            let id = create_task(api, s, run, &name, &project_id)
                .await
                .map_err(|e| fatal(&format!("cannot create task `{name}`"), e))?;
            api.call_retrying("tasks.started", &Body::Json(json!({"task": id})))
                .await
                .map_err(|e| fatal(&format!("cannot start task {id}"), e))?;
            Ok(TaskCtx {
                task: TaskRef {
                    id,
                    name,
                    project: s.project.clone(),
                },
                project_id,
                created: true,
                adopted: false,
            })
        }
    }
}

/// The comment a created task carries: it names the run, so that a
/// creation whose reply was lost is found again instead of repeated.
pub fn task_comment(run: &RunInfoLite) -> String {
    format!("memtrack run {} on {}", run.id, run.host)
}

/// `tasks.create`, never repeated blindly: when a try may have reached the
/// server (a timeout, a 504, a 5xx), the task is looked up by its name,
/// project and comment before the next try.
async fn create_task(
    api: &Api,
    s: &Settings,
    run: &RunInfoLite,
    name: &str,
    project_id: &str,
) -> Result<String, CallError> {
    let comment = task_comment(run);
    let body = Body::Json(json!({
        "name": name,
        "type": s.task_type,
        "project": project_id,
        "comment": comment,
    }));
    let mut delay = s.backoff_min;
    loop {
        match api.call_creating("tasks.create", &body).await {
            Ok(data) => {
                return data
                    .get("id")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| CallError::Rejected {
                        status: 200,
                        subcode: 0,
                        message: "tasks.create answered without an id".into(),
                        error_data: Value::Null,
                    })
            }
            Err(CallError::Transient { .. }) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(s.backoff_max);
                let found = api
                    .call_retrying(
                        "tasks.get_all",
                        &Body::Json(json!({
                            "name": anchored(name),
                            "project": [project_id],
                            "only_fields": ["id", "comment"],
                        })),
                    )
                    .await?;
                let id = found
                    .get("tasks")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .find(|t| t.get("comment").and_then(Value::as_str) == Some(&comment))
                    .and_then(|t| t.get("id"))
                    .and_then(Value::as_str);
                if let Some(id) = id {
                    tracing::info!("ClearML: task `{name}` was created by an unanswered try");
                    return Ok(id.to_string());
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Registers the artifact (`body`); with `check_status`, only while the
/// task is `created` or `in_progress` (a task closed by its owner refuses
/// it, and memtrack never changes the status of a task it did not create).
async fn register_artifact(
    api: &Api,
    task: &str,
    check_status: bool,
    body: Value,
) -> Result<Registered, CallError> {
    if check_status {
        let data = api
            .call_retrying("tasks.get_by_id", &Body::Json(json!({"task": task})))
            .await?;
        let status = data
            .pointer("/task/status")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !matches!(status, "created" | "in_progress") {
            return Ok(Registered::Closed(status.to_string()));
        }
    }
    api.call_retrying("tasks.add_or_update_artifacts", &Body::Json(body))
        .await?;
    Ok(Registered::Yes)
}

/// `^<name>$` with the regex metacharacters escaped.
pub fn anchored(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 8);
    out.push('^');
    for c in name.chars() {
        if "\\.^$*+?()[]{}|".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('$');
    out
}

async fn project_id(api: &Api, name: &str) -> Result<String, CallError> {
    let lookup = || async {
        let data = api
            .call_retrying(
                "projects.get_all",
                &Body::Json(json!({"name": anchored(name), "only_fields": ["id"]})),
            )
            .await?;
        Ok::<_, CallError>(
            data.get("projects")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(|p| p.get("id"))
                .and_then(Value::as_str)
                .map(str::to_string),
        )
    };
    if let Some(id) = lookup().await? {
        return Ok(id);
    }
    let mut delay = api.backoff().0;
    let created = loop {
        match api
            .call_creating("projects.create", &Body::Json(json!({"name": name})))
            .await
        {
            // The try may have created it: look before trying again.
            Err(CallError::Transient { .. }) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(api.backoff().1);
                if let Some(id) = lookup().await? {
                    return Ok(id);
                }
            }
            other => break other,
        }
    };
    match created {
        Ok(data) => data
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| CallError::Rejected {
                status: 200,
                subcode: 0,
                message: "projects.create answered without an id".into(),
                error_data: Value::Null,
            }),
        // Created by someone else meanwhile.
        Err(CallError::Rejected { subcode: 801, .. }) => {
            lookup().await?.ok_or_else(|| CallError::Rejected {
                status: 400,
                subcode: 801,
                message: format!("project `{name}` exists but cannot be found"),
                error_data: Value::Null,
            })
        }
        Err(e) => Err(e),
    }
}

/// Marks a task memtrack created completed or failed, if it is still
/// `in_progress` (someone may have stopped it from the UI).
async fn final_status(
    api: &Api,
    task: &str,
    exit: Option<crate::model::Exit>,
) -> Result<String, String> {
    let current = api
        .call_retrying("tasks.get_by_id", &Body::Json(json!({"task": task})))
        .await
        .map_err(|e| format!("cannot read task {task} before ending it: {e}"))?;
    let status = current
        .pointer("/task/status")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if status != "in_progress" {
        tracing::info!(
            "ClearML: task {task} is `{status}` (changed outside memtrack); leaving its status"
        );
        return Ok(status);
    }
    let (endpoint, new, reason, message) = match exit {
        Some(x) if x.known && x.code == 0 && x.signal.is_none() => (
            "tasks.completed",
            "completed",
            "completed".to_string(),
            "the job exited with status 0".to_string(),
        ),
        Some(x) if x.known => match x.signal {
            Some(sig) => (
                "tasks.failed",
                "failed",
                format!("killed by signal {sig}"),
                format!(
                    "the job was killed by signal {sig} (exit status {})",
                    x.code
                ),
            ),
            None => (
                "tasks.failed",
                "failed",
                format!("exit code {}", x.code),
                format!("the job exited with status {}", x.code),
            ),
        },
        _ => (
            "tasks.failed",
            "failed",
            "exit status unknown".to_string(),
            "memtrack could not learn how the job ended".to_string(),
        ),
    };
    api.call_retrying(
        endpoint,
        &Body::Json(json!({"task": task, "status_reason": reason, "status_message": message})),
    )
    .await
    .map_err(|e| format!("cannot mark task {task} {new}: {e}"))?;
    tracing::info!("ClearML: task {task} marked {new}");
    Ok(new.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn project_names_are_anchored_and_escaped() {
        assert_eq!(anchored("memtrack"), "^memtrack$");
        assert_eq!(anchored("a.b/c (x)+"), r"^a\.b/c \(x\)\+$");
    }
}
