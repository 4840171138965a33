//! The store: every piece of run state, owned in one place and changed only
//! by applying [`Record`]s.
//!
//! Records are the store's inputs: samples, marks, spans, stages, exits and
//! the end of the run. The one order, kept by the engine's `commit`: a
//! record is applied (which gives it the next `Store::seq`), then written
//! to the journal under that number, then forwarded to the outputs; an ack
//! is answered only once its line is flushed. A run rebuilt from its
//! journal after `kill -9` replays the lines after its checkpoint's number
//! through the same [`Store::apply`], so it goes through exactly the code
//! that built it live. Peaks, per-component peaks,
//! stage peaks, pressure levels and the summary are all a pure fold over
//! the records, tested here without I/O.
//!
//! Here: the [`Record`]. The files beside this one, by concern:
//! - `apply`: [`Store::apply`], the one place a record is handed to the
//!   folds it concerns (a sample phase by phase) and the only code that
//!   changes the store.
//! - `record`: what records carry and what applying one gives;
//!   `limits`: the bounds and the fold into [`OTHER`] past them.
//! - `state`: the [`Store`] and its accessors.
//! - The folds, each a struct of its own that the [`Store`] holds, with
//!   its methods, given what it needs of the others as arguments:
//!   `targets`, `gpu`, `host`, `alerts`, `forecast`, `marks`, `spans`,
//!   `stages`, `peaks`, `samples`.
//! - Views of the state: `status` (status, levels, [`snapshot::Snapshot`]),
//!   `document` (`memory_usage.json`) and `log_view` (`LogView`).
//! - Storage: [`entries`] and `chunked` (the event log), [`journal`]
//!   (records and checkpoints on disk); [`pressure`]: levels and thresholds.

mod alerts;
mod apply;
mod checkpoint;
pub(crate) mod chunked;
mod document;
pub mod entries;
pub(crate) mod forecast;
mod gpu;
mod host;
pub mod journal;
pub(crate) mod limits;
mod log_view;
mod marks;
mod peaks;
pub mod pressure;
pub(crate) mod record;
mod samples;
pub mod snapshot;
mod spans;
mod stages;
mod state;
mod status;
mod targets;
#[cfg(test)]
mod testkit;
mod wire;

pub use limits::{Limits, MAX_FLIGHTS, OTHER};
pub use record::{Applied, Boundary, Mark, SampleKind};
pub use state::{Store, SYSTEM};

use serde::{Deserialize, Serialize};

use crate::model::{Exit, FlightWindow};
use crate::sample::Sample;

/// The store's inputs. The journal is a sequence of these.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Sample {
        kind: SampleKind,
        sample: Box<Sample>,
    },
    Mark(Mark),
    SpanBegin(Boundary),
    SpanEnd(Boundary),
    StageBegin(Boundary),
    StageEnd(Boundary),
    /// A process we reaped ourselves: exact status and peak RSS.
    Exit {
        pid: u32,
        exit: Exit,
        max_rss: Option<u64>,
    },
    /// The run is over: the job's exit (run mode) and the end time.
    Finish {
        timestamp: f64,
        exit: Option<Exit>,
    },
    /// A flight-recorder window kept because a target died.
    Flight(Box<FlightWindow>),
    /// The journal failed `total` times so far (journalled so that a
    /// recovery knows, when no checkpoint could count them).
    JournalErrors {
        total: u64,
    },
}
