//! memtrack: a memory telemetry sidecar for machine-learning jobs.
//!
//! Data flows one way through the folders:
//!
//! - [`target`]: which processes — a spawned job or attached PIDs;
//! - [`event`]: what the job says it is doing — marks, spans and stages
//!   over a Unix socket;
//! - [`sample`]: what they hold now — host RSS/high-water marks from procfs,
//!   GPU memory from NVML (or none);
//! - [`engine`]: the one thread that owns the store, turning ticks, marks
//!   and exits into [`store::Record`]s;
//! - [`store`]: all run state as a pure fold over records, with a journal
//!   for crash recovery;
//! - [`export`]: what leaves memtrack — `memory_usage.json` first.
//!
//! [`model`] is the `memory_usage.json` schema shared by writer and
//! readers; [`config`] and [`cli`] are the user-facing surface; [`app`]
//! wires a run together; [`files`] creates what memtrack writes, private
//! and never through a planted link; [`sys`] is the only `unsafe` code.

pub mod app;
pub mod cli;
pub mod config;
pub mod engine;
pub mod event;
pub mod export;
pub mod files;
pub mod logging;
pub mod model;
pub mod report;
pub mod sample;
pub mod shutdown;
pub mod store;
pub mod switch;
pub mod sys;
pub mod target;
pub mod units;
