//! The engine's settings and its links to the rest of the process: what
//! the caller configures, and what it gets back when the run ends.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, watch};

use crate::event::protocol::Notice;
use crate::event::server::Stats;
use crate::model::{Entry, Exit};
use crate::store::snapshot::Snapshot;

/// The engine's link to the event socket.
#[derive(Debug, Clone)]
pub(crate) struct EventLink {
    pub(crate) notices: broadcast::Sender<Notice>,
    pub(crate) stats: Arc<Stats>,
    /// `attach` without PIDs: processes that mark join the tree.
    pub(crate) self_register: bool,
}

/// When the run is over, besides a stop request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndWhen {
    /// `run`: when the spawned job exits.
    JobExits,
    /// `attach --pid`: when every followed process has exited.
    TreeEmpty,
    /// `attach` without PIDs: only on a stop request.
    Stopped,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub(crate) struct EngineOptions {
    pub(crate) interval: Duration,
    pub(crate) checkpoint_interval: Duration,
    /// Buffered journal records are handed to the kernel at least this
    /// often (events are flushed at once).
    pub(crate) journal_flush: Duration,
    pub(crate) end_when: EndWhen,
    /// The OOM flight recorder: `(interval, window)`, or off.
    pub(crate) flight: Option<(Duration, Duration)>,
}

/// Where the engine's results go besides the store and the journal, all
/// given when the engine is made; `Outputs::default()` sends nothing.
#[derive(Debug, Default)]
pub(crate) struct Outputs {
    /// The latest picture of the run, for the exporters (`None`: nobody
    /// reads it, and it is not built).
    pub(crate) snapshots: Option<watch::Sender<Arc<Snapshot>>>,
    /// One feed per output: every log entry and checkpoint is handed to
    /// each of them in turn (a fan-out; no send ever blocks).
    pub(crate) feeds: Vec<Feed>,
    /// Failure counters of exporters running beside the engine, by name,
    /// published as `memtrack_export_errors_total{exporter=name}`.
    pub(crate) export_errors: Vec<(String, Arc<AtomicU64>)>,
}

/// What one output hears from the engine while the run goes on. The
/// output's own task drains the channels, so the engine never waits on it.
#[derive(Debug, Default)]
pub(crate) struct Feed {
    /// Every log entry as it is recorded. The send never blocks: the
    /// receiver drains it into its own bounded queue.
    pub(crate) entries: Option<mpsc::UnboundedSender<Entry>>,
    /// The last checkpoint written (uploads at checkpoints).
    pub(crate) checkpoints: Option<watch::Sender<Checkpoint>>,
}

/// A checkpoint just written: the run's document at `path` holds every
/// record up to `seq`; `count` checkpoints were written so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub(crate) count: u64,
    pub(crate) seq: u64,
    pub(crate) path: std::path::PathBuf,
}

/// How the run ended, for the caller's exit code and report.
#[derive(Debug, Clone)]
pub(crate) struct Ended {
    pub(crate) job_exit: Option<Exit>,
    pub(crate) stopped_by_request: bool,
    /// A second signal: skip everything that can wait on the network.
    pub(crate) urgent: bool,
    /// Problems writing the final files, already logged.
    pub(crate) write_error: Option<String>,
}
