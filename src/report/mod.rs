//! After the run: reading `memory_usage.json` files back — the report, the
//! configuration comparison, merging ranks, the timeline plot and leak
//! detection.

pub mod compare;
pub mod leak;
pub mod merge;
pub mod plot;
pub mod read;
pub mod text;
