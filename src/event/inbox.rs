//! What reaches the engine and the reporters from other threads: the
//! engine's inbox ([`Input`]) and a job's announcement of its own ClearML
//! task ([`JobTask`]). The socket server, the job's waiter and signal
//! handling send these; they live here, below the engine, so that senders
//! need not know the engine.

use tokio::sync::oneshot;

use super::protocol::{Request, TaskStatus};
use crate::sys;

/// Messages to the engine.
#[derive(Debug)]
pub(crate) enum Input {
    /// The job spawned by `run` ended (reaped by its waiter thread).
    JobExited { pid: u32, reaped: sys::Reaped },
    /// Finish the run: a final sample and every flush. `urgent` (a second
    /// signal) skips the final sample.
    Stop { urgent: bool },
    /// A request from the event socket. Boxed: the engine's queue holds
    /// up to 65,536 inputs and preallocates its slots, so an `Input` must
    /// stay a few words wide.
    Client(Box<ClientRequest>),
    /// Write a checkpoint at the next maintenance instead of waiting for
    /// the interval (the run must upload the document now).
    Checkpoint,
}

/// A request read from a client, with where to send the reply line.
#[derive(Debug)]
pub(crate) struct ClientRequest {
    /// The sender (`SO_PEERCRED`).
    pub(crate) pid: Option<u32>,
    /// When the line arrived (Unix seconds).
    pub(crate) received: f64,
    pub(crate) request: Request,
    pub(crate) reply: Option<oneshot::Sender<Vec<u8>>>,
}

/// Announcements of the job's ClearML task waiting for the reporter: a
/// job that announces faster than the reporter answers waits (its socket
/// buffer fills) instead of growing memtrack's memory.
pub(crate) const JOB_TASK_QUEUE: usize = 64;

/// The job's announcement of its own ClearML task, or of its closing.
#[derive(Debug)]
pub struct JobTask {
    pub(crate) id: String,
    /// The job's SDK is closing the task: memtrack may set this status
    /// itself once the final artifact is registered.
    pub(crate) close: Option<TaskClose>,
    /// Answered once the task is taken up (and the artifact registered,
    /// when one is expected) or turned down; for a close, at once.
    pub(crate) reply: Option<oneshot::Sender<JobTaskReply>>,
}

/// The status a job's SDK was about to give its task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskClose {
    pub(crate) status: TaskStatus,
    pub(crate) reason: Option<String>,
}

/// What became of a [`JobTask`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobTaskReply {
    /// memtrack reports into the announced task.
    pub(crate) reporting: bool,
    /// The `memory_usage` artifact is registered on it.
    pub(crate) artifact: bool,
    /// memtrack sets the task's final status (a close it took over).
    pub(crate) deferred: bool,
    /// In words, for the job's log.
    pub(crate) message: String,
}
