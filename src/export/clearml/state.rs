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
use super::machine::{EndProgress, Machine};
use super::outcome::{Artifact, FinishReport, TaskEnd, TaskRef};
use super::points::{Converter, Point};
use super::queue::Queue;
use super::settings::Settings;
use super::tasks::{ArtifactRegistered, TaskCtx};
use crate::event::inbox::{JobTask, JobTaskReply};
use crate::logging::RateLimited;
use crate::model::{Entry, RunInfo};

/// The end of the run, as the handle asks for it.
#[derive(Debug)]
pub(crate) struct Finish {
    pub(crate) outcome: TaskEnd,
    pub(crate) timeout: Duration,
    pub(crate) reply: oneshot::Sender<FinishReport>,
}

pub(crate) type JobFuture = Pin<Box<dyn Future<Output = JobOutput> + Send>>;

/// What a network job returns.
pub(crate) enum JobOutput {
    Setup(Result<TaskCtx, super::tasks::SetupError>),
    Batch(Result<Value, CallError>),
    Artifact(Result<ArtifactRegistered, CallError>),
    Status(Result<String, super::tasks::StatusError>),
    /// The task's `last_iteration`.
    Axis(Result<u64, CallError>),
    Ping(Result<Value, CallError>),
    Refresh(Result<(), CallError>),
}

pub(crate) enum JobKind {
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
pub(crate) struct Running {
    pub(crate) kind: JobKind,
    pub(crate) fut: JobFuture,
}

/// The end of the run under way.
pub(crate) struct Ending {
    pub(crate) outcome: TaskEnd,
    pub(crate) end: EndProgress,
    pub(crate) drain_until: Instant,
    /// Points (and the artifact) must be out by then, leaving time for
    /// the final status.
    pub(crate) points_until: Instant,
    pub(crate) until: Instant,
    pub(crate) reply: oneshot::Sender<FinishReport>,
}

/// What woke the loop.
pub(crate) enum Wake {
    Finish(Option<Finish>),
    Entry(Option<Entry>),
    JobTask(Option<JobTask>),
    /// The run ended (`false`: the handle is gone).
    Hurry(bool),
    /// A checkpoint's upload for the job's task: the artifact to register,
    /// or why there is none.
    Checkpoint(Option<crate::export::output::Uploaded>),
    Job(JobOutput),
    Tick,
    Deadline,
}

/// Everything the reporter's task owns.
pub(crate) struct ReporterState {
    pub(crate) settings: Settings,
    pub(crate) run: RunInfo,
    pub(crate) api: Api,
    pub(crate) conv: Converter,
    pub(crate) queue: Queue,
    /// Where the task is noted for a later `clearml-resend`.
    pub(crate) task_file: PathBuf,
    /// The decisions, and the counts and problems they keep.
    pub(crate) machine: Machine,
    pub(crate) errors: Arc<AtomicU64>,
    pub(crate) task_tx: watch::Sender<Option<TaskRef>>,
    pub(crate) settled_tx: watch::Sender<bool>,
    pub(crate) last_send: Instant,
    pub(crate) last_ok: Instant,
    pub(crate) partial_logged: RateLimited,
    pub(crate) set_aside_logged: RateLimited,
    /// End of the wait for the job's task.
    pub(crate) wait_until: Instant,
    /// Entries held while waiting for the job's task.
    pub(crate) held: Vec<Entry>,
    /// Announcements waiting for the outcome.
    pub(crate) announce_replies: Vec<oneshot::Sender<JobTaskReply>>,
    /// The latest uploaded checkpoint not yet registered.
    pub(crate) pending_artifact: Option<Artifact>,
    /// When the task's `last_iteration` was last read (job axis).
    pub(crate) last_axis: Instant,
    pub(crate) job_task_tx: watch::Sender<Option<TaskRef>>,
    /// Announcements of another task, logged at most once per `LOG_INTERVAL`.
    pub(crate) announce_logged: RateLimited,
    /// Why nothing is reported ([`Settings::job_task_only`] and the job
    /// announced no task).
    pub(crate) stood_down: Option<String>,
}
