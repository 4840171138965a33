//! The store's bounds: how many entries, targets, alerts, components,
//! event kinds, spans and stages a run keeps, and the one rule by which a
//! dimension a job names folds into [`OTHER`] past its bound.

use serde::{Deserialize, Serialize};

/// How much a run keeps: the `[log]` section of the configuration, and
/// the store's bounds (one type, one default).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Timer entries kept in `detailed_log`; beyond it neighbours are merged
    /// (keeping every maximum).
    pub max_timer_entries: usize,
    /// Event entries (marks, spans, stages) written to `detailed_log`;
    /// beyond it they are merged per component and operation over
    /// stretches of the run (keeping every maximum), and the complete event
    /// log goes beside the JSON, gzip'd (see
    /// `LogView`). 0: no bound.
    pub max_event_entries: usize,
    /// Points kept in each target's `series`.
    pub target_series_points: usize,
    /// Processes kept in `targets`; beyond it the exited ones with the
    /// smallest peak are dropped (and counted).
    pub max_targets: usize,
    /// Alerts kept in a run; later ones are counted only. Not a setting:
    /// fixed at its default.
    #[serde(skip)]
    pub max_alerts: usize,
    /// Distinct components with their own `peaks_by_component` entry (and
    /// metric series); beyond it new ones count under [`OTHER`]. Log
    /// entries keep the name the job sent.
    pub max_components: usize,
    /// Distinct (component, operation) pairs counted separately in
    /// `memtrack_events_total`; beyond it new pairs count under
    /// ([`OTHER`], [`OTHER`]).
    pub max_event_kinds: usize,
    /// Spans open at once; a `span_begin` beyond it is logged but opens
    /// nothing.
    pub max_open_spans: usize,
    /// Stages kept in `stages[]`; beyond it the closed stage with the
    /// smallest peak makes room, or, with every stage open, the new one
    /// is logged but not kept.
    pub max_stages: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_timer_entries: 4096,
            max_event_entries: 250_000,
            target_series_points: 512,
            max_targets: 1024,
            max_alerts: 1000,
            max_components: 256,
            max_event_kinds: 1000,
            max_open_spans: 128,
            max_stages: 1000,
        }
    }
}

/// The bucket that values beyond a dimension's limit count under.
pub const OTHER: &str = "_other";

/// Whether a value gets its own key in a map bounded to `max` keys: known
/// values always, new ones while there is room. One rule for every
/// dimension a job names (components, event kinds).
pub(super) fn admit(known: bool, keys: usize, max: usize) -> bool {
    known || keys < max
}

/// Flight-recorder windows kept in a run; later ones are counted only.
pub const MAX_FLIGHTS: usize = 8;
