//! What records carry and what applying one gives: the kind of a sample,
//! a mark, a span or stage boundary, and the [`Applied`] of applying a
//! [`Record`](super::Record).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{Alert, Allocator, Entry, EntryKind};

/// Why a sample was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SampleKind {
    /// The periodic timer: becomes a timer entry of the log.
    Timer,
    /// Taken for the marks that follow it in the record stream.
    Event,
}

/// One annotated measurement point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mark {
    /// When the mark arrived (Unix seconds).
    pub(crate) timestamp: f64,
    #[serde(default)]
    pub(crate) pid: Option<u32>,
    pub(crate) component: String,
    pub(crate) operation: String,
    #[serde(default)]
    pub(crate) iteration: Option<u64>,
    #[serde(default)]
    pub(crate) labels: BTreeMap<String, String>,
    #[serde(default)]
    pub(crate) allocator: Option<Allocator>,
    #[serde(default)]
    pub(crate) kind: EntryKind,
}

/// A span or stage boundary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Boundary {
    pub(crate) mark: Mark,
    /// Stage end only: `SUCCESS`, `FAILED`, …
    #[serde(default)]
    pub(crate) status: Option<String>,
    #[serde(default)]
    pub(crate) message: Option<String>,
}

/// What applying a record produced, for those who react to it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    /// The log entry recorded, if any.
    pub(crate) entry: Option<Entry>,
    /// Pressure levels crossed.
    pub(crate) alerts: Vec<Alert>,
    /// Span or stage ends that matched nothing open.
    pub(crate) unmatched: bool,
    /// Forecasts of the time to OOM to announce.
    pub(crate) forecasts: Vec<super::snapshot::Forecast>,
}
