//! The engine's settings and its links to the rest of the process: what
//! the caller configures, and what it gets back when the run ends.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use crate::event::protocol::Notice;
use crate::event::server::Stats;
use crate::model::Exit;

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
