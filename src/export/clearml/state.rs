//! The reporter's state: what its one tokio task owns (the settings, the
//! API client, the converter and the queue, the channels it answers on,
//! the clocks) beside the pure [`Machine`] that makes its decisions, and
//! the messages and jobs its loop handles.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{oneshot, watch};

use super::api::{Api, CallError};
use super::machine::{End, Machine};
use super::outcome::{Artifact, FinishReport, RunEnd, TaskRef};
use super::points::{Converter, Point};
use super::queue::Queue;
use super::settings::Settings;
use super::tasks::{Registered, TaskCtx};
use crate::event::inbox::{JobTask, JobTaskReply};
use crate::logging::RateLimited;
use crate::model::{Entry, RunInfo};

/// The end of the run, as the handle asks for it.
#[derive(Debug)]
pub struct Finish {
    pub outcome: RunEnd,
    pub timeout: Duration,
    pub reply: oneshot::Sender<FinishReport>,
}

pub type JobFuture = Pin<Box<dyn Future<Output = JobOutput> + Send>>;

/// What a network job returns.
pub enum JobOutput {
    Setup(Result<TaskCtx, String>),
    Batch(Result<Value, CallError>),
    Artifact(Result<Registered, CallError>),
    Status(Result<String, String>),
    /// The task's `last_iteration`.
    Axis(Result<u64, CallError>),
    Ping(Result<Value, CallError>),
    Refresh(Result<(), CallError>),
}

pub enum JobKind {
    Setup,
    /// The points out for sending (put back if the job is cut short).
    Batch(Vec<Point>),
    Artifact,
    Status,
    Ping,
    Refresh,
    Axis,
}

/// The network job under way.
pub struct Running {
    pub kind: JobKind,
    pub fut: JobFuture,
}

/// The end of the run under way.
pub struct Ending {
    pub outcome: RunEnd,
    pub end: End,
    pub drain_until: Instant,
    /// Points (and the artifact) must be out by then, leaving time for
    /// the final status.
    pub points_until: Instant,
    pub until: Instant,
    pub reply: oneshot::Sender<FinishReport>,
}

/// What woke the loop.
pub enum Event {
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

/// Everything the reporter's task owns.
pub struct ReporterState {
    pub settings: Settings,
    pub run: RunInfo,
    pub api: Api,
    pub conv: Converter,
    pub queue: Queue,
    /// Where the task is noted for a later `clearml-resend`.
    pub task_file: PathBuf,
    /// The decisions, and the counts and problems they keep.
    pub machine: Machine,
    pub errors: Arc<AtomicU64>,
    pub task_tx: watch::Sender<Option<TaskRef>>,
    pub settled_tx: watch::Sender<bool>,
    pub last_send: Instant,
    pub last_ok: Instant,
    pub partial_logged: RateLimited,
    pub set_aside_logged: RateLimited,
    /// End of the wait for the job's task.
    pub wait_until: Instant,
    /// Entries held while waiting for the job's task.
    pub held: Vec<Entry>,
    /// Announcements waiting for the outcome.
    pub announce_replies: Vec<oneshot::Sender<JobTaskReply>>,
    /// The latest uploaded checkpoint not yet registered.
    pub pending_artifact: Option<Artifact>,
    /// When the task's `last_iteration` was last read (job axis).
    pub last_axis: Instant,
    pub job_task_tx: watch::Sender<Option<TaskRef>>,
    /// Announcements of another task, logged at most once per `LOG_INTERVAL`.
    pub announce_logged: RateLimited,
    /// Why nothing is reported ([`Settings::job_task_only`] and the job
    /// announced no task).
    pub stood_down: Option<String>,
}
