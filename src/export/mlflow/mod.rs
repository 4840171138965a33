//! MLflow: the run's memory figures in an MLflow run, through the tracking
//! server's REST API, live while the job runs.
//!
//! Which MLflow run: `mlflow.run_id` or `MLFLOW_RUN_ID` when set, from
//! the start; else the run the job announces (an `mlflow`/`active_run`
//! mark whose `run_id` label names it: memtrack's Python hooks send it the
//! moment the job's `mlflow.start_run` returns), from the moment it
//! arrives; else, at the end, a run memtrack creates, named after the
//! memtrack run and ended with the job's outcome. That run goes into
//! `mlflow.experiment_id`, else the experiment `MLFLOW_EXPERIMENT_NAME`
//! names (created when missing, as the job's own MLflow client does), else
//! `MLFLOW_EXPERIMENT_ID`, else `0`. memtrack never writes into a second
//! run beside the job's, and a run it did not create keeps its status.
//!
//! What goes there: every log entry as the metrics `memtrack/host_mb`,
//! `memtrack/gpu_mb` and `memtrack/gpu_reserved_mb` on the job's iteration
//! axis (`step` = the entry's iteration, a timer sample taking the last
//! iteration seen before it; the entry's time as the timestamp), sent
//! while the job runs in batches of at most `settings::BATCH` values (`live`);
//! at the end the run's peaks as `memtrack/peak_host_mb` and
//! `memtrack/peak_gpu_mb`, and `memory_usage.json` and the report page as
//! artifacts through the server's artifact proxy (`mlflow server`'s
//! default; another artifact store is reported and skipped). What does not
//! arrive is kept in the run directory's `mlflow-spool.jsonl` (`spool`)
//! for `memtrack mlflow-resend` (`resend`). The engine never waits on
//! any of it.

mod api;
mod live;
pub mod resend;
pub(crate) mod run_output;
mod settings;
mod spool;
mod values;

pub use settings::MlflowConfig;
pub(crate) use settings::{resolve, Resolved};
pub(crate) use spool::SPOOL_FILE;
