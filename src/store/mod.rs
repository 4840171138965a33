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
//! Here: the [`Record`] and [`Store::apply`], which hands each record to
//! its fold. The files beside this one, by concern:
//! - `record`: what records carry and what applying one gives;
//!   `limits`: the bounds and the fold into [`OTHER`] past them.
//! - `state`: the [`Store`], its accessors, and the end of the run.
//! - The folds, each with its state in a struct of its own that the
//!   [`Store`] holds: `samples` (phase by phase), `targets`, `gpu`, `host`,
//!   `alerts`, `marks`, `spans`, `stages`, `peaks`.
//! - Views of the state: `status` (status, levels, [`snapshot::Snapshot`]),
//!   `document` (`memory_usage.json`) and `log_view` (`LogView`).
//! - Storage: [`entries`] and `chunked` (the event log), [`journal`]
//!   (records and checkpoints on disk); [`pressure`]: levels and thresholds.

mod alerts;
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

impl Store {
    /// Applies one record: the only way state changes.
    pub fn apply(&mut self, record: &Record) -> Applied {
        self.seq += 1;
        match record {
            Record::Sample { kind, sample } => self.apply_sample(*kind, sample),
            Record::Mark(mark) => Applied {
                entry: Some(self.record_mark(mark, mark.operation.clone(), None)),
                ..Applied::default()
            },
            Record::SpanBegin(b) => self.begin_span(b),
            Record::SpanEnd(b) => self.end_span(b),
            Record::StageBegin(b) => self.begin_stage(b),
            Record::StageEnd(b) => self.end_stage(b),
            Record::Exit { pid, exit, max_rss } => {
                self.exit(*pid, *exit, *max_rss);
                Applied::default()
            }
            Record::Flight(w) => {
                self.keep_flight(w);
                Applied::default()
            }
            Record::JournalErrors { total } => {
                let c = &mut self.counters_mut().journal_errors;
                *c = (*c).max(*total);
                Applied::default()
            }
            Record::Finish { timestamp, exit } => Applied {
                entry: Some(self.finish(*timestamp, *exit)),
                ..Applied::default()
            },
        }
    }
}
