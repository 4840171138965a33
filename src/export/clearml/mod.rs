//! ClearML scalars: memtrack's memory figures as charts of a ClearML task.
//!
//! ClearML is where many ML teams already look at their runs, so memtrack
//! reports each `detailed_log` entry there too, following the server's rules
//! described in docs/clearml.md. The exporter must never cost the job
//! anything: the engine hands entries over an unbounded channel that is
//! drained at once into a bounded queue (spilling to `clearml-spool.jsonl`
//! in the run directory), and all network work — login, task lookup or
//! creation, batched `events.add_batch` with retries — happens on tokio
//! tasks that sampling never waits for.
//!
//! - `settings`: the `[clearml]` section and the settings resolved from
//!   it, the `CLEARML_*` environment and `clearml.conf`;
//! - [`hocon`]: the pure `clearml.conf` reader;
//! - [`points`]: entries → scalar points (timer windows, iteration keys,
//!   collisions), pure;
//! - [`queue`]: the bounded in-memory queue and its spool file;
//! - `api`: the HTTP client (auth, envelopes, retry classification);
//! - `files`: the artifact on the ClearML fileserver (no S3 destination);
//! - `output`: where the job's task keeps its artifacts (`output_uri`,
//!   `clearml.conf`'s `default_output_uri` and `sdk.aws.s3`);
//! - `tasks`: the REST calls on tasks and projects (find, create, end,
//!   register the artifact);
//! - `jobs`: the network jobs the reporter runs, as futures;
//! - `machine`: the reporter's decisions as a pure state machine, kept
//!   in `state`;
//! - `reporter`: the task that owns the queue and drives the server,
//!   doing what the machine decides;
//! - `outcome`: what the reporter and the app tell each other;
//! - [`resend`]: `memtrack clearml-resend`, which sends what an ended run
//!   left and ends a task it created.
//!
//! The run-directory files a later resend or upload reads (the spool, the
//! task note) are in [`crate::export::task_note`].

pub(crate) mod advice;
pub(crate) mod api;
mod close;
pub(crate) mod files;
pub mod hocon;
mod jobs;
pub(crate) mod machine;
pub(crate) mod outcome;
pub(crate) mod output;
pub mod points;
pub mod queue;
pub(crate) mod reporter;
pub mod resend;
pub(crate) mod run_output;
pub(crate) mod settings;
mod state;
pub(crate) mod task_output;
pub(crate) mod tasks;

pub use crate::export::task_note::SPOOL_FILE;
pub(crate) use crate::export::task_note::{read as read_task_note, TASK_FILE};
pub(crate) use files::FileServer;
pub(crate) use outcome::note_task;
pub use outcome::{Artifact, FinishReport, TaskEnd};
pub use reporter::Reporter;
pub(crate) use settings::{fit_task_name, zero_config, MIN_NAME};
pub use settings::{resolve, ClearmlConfig, ClearmlError, Credentials, Settings};
