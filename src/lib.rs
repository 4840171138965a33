//! memtrack: a memory telemetry sidecar for machine-learning jobs.
//!
//! Data flows one way: [`sample`] → [`store`] → [`export`] for the
//! figures, [`event`] → [`engine`] → [`store`] for what the job says.
//!
//! - [`target`]: which processes — a spawned job or attached PIDs;
//! - [`event`]: what the job says it is doing — marks, spans and stages
//!   over a Unix socket — and the engine's inbox;
//! - [`sample`]: what they hold now — host memory from procfs and memory
//!   cgroups, GPU memory from NVML (or none);
//! - [`engine`]: the one thread that owns the store, turning ticks, marks
//!   and exits into [`store::Record`]s;
//! - [`store`]: all run state as a pure fold over records, with a journal
//!   for crash recovery;
//! - [`export`]: what leaves memtrack while it runs and at its end —
//!   metrics, ClearML, MLflow, S3, the final files; [`report`]: what reads
//!   a finished run's file (and renders its page).
//!
//! [`model`] is `memory_usage.json`: its schema, reading and writing it,
//! keeping its log bounded, and the leak rule. [`config`] embeds each
//! component's own settings; [`cli`] and [`app`] are the user-facing
//! surface and the wiring of a run.
//!
//! # Layers
//!
//! A module imports only modules of its own folder and of lower layers;
//! modules never import each other in a circle; no function is longer
//! than 150 lines and no file than 1,000 (the HOCON parser excepted). The
//! test `tests/it/layers.rs` holds the code to this table, bottom first:
//!
//! | layer | modules |
//! |---|---|
//! | 0 | [`units`], [`sys`] (the only `unsafe` code), [`logging`], [`switch`] |
//! | 1 | [`files`]: what memtrack writes, private and never through a planted link; what it reads, regular files only and bounded |
//! | 2 | [`model`] |
//! | 3 | [`target`], [`sample`], [`event`] |
//! | 4 | [`store`] |
//! | 5 | [`engine`] |
//! | 6 | [`report`] |
//! | 7 | [`export`] (its files output writes the report page) |
//! | 8 | [`config`], [`shutdown`] |
//! | 9 | [`app`], [`cli`] (and the binary, `main.rs`) |

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
