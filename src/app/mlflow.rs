//! The run's figures into MLflow once its document is written (see
//! `export::mlflow`): off unless a tracking server is configured.

use crate::config::Config;
use crate::export::mlflow::{self, Settings};
use crate::model::RunInfo;

/// The MLflow settings, read before anything starts: a tracking URI in
/// memtrack's own configuration that cannot be used refuses the run; one
/// from `MLFLOW_TRACKING_URI` (the job's MLflow setting too) is said once
/// and MLflow output is off.
pub(super) fn settings(config: &Config) -> anyhow::Result<Option<Settings>> {
    match mlflow::resolve(&config.mlflow, &|v| std::env::var(v).ok())? {
        mlflow::Resolved::Off => Ok(None),
        mlflow::Resolved::Unusable(why) => {
            tracing::warn!("MLflow: {why}");
            Ok(None)
        }
        mlflow::Resolved::On(settings) => Ok(Some(settings)),
    }
}

/// Puts the finished run into MLflow within `finish_timeout`; true when
/// that failed (the local file is kept either way).
pub(super) fn finish(
    runtime: &tokio::runtime::Runtime,
    settings: Option<Settings>,
    config: &Config,
    (document, page): (&std::path::Path, Option<&std::path::Path>),
    written: bool,
    run: &RunInfo,
    job_failed: bool,
) -> bool {
    let Some(settings) = settings else {
        return false;
    };
    if !written {
        tracing::error!("MLflow: nothing to report, memory_usage.json was not written");
        return true;
    }
    let work = mlflow::export(&settings, document, page, &run.name, job_failed);
    match runtime.block_on(async { tokio::time::timeout(config.finish_timeout, work).await }) {
        Ok(Ok(done)) => {
            tracing::info!(
                "MLflow: {} memory values logged into run {} at {}",
                done.metrics,
                done.run_id,
                settings.shown()
            );
            if let Some(why) = done.page_skipped {
                tracing::warn!(
                    "MLflow: the report page not attached to run {}: {why}",
                    done.run_id
                );
            }
            if let Some(why) = done.artifact_skipped {
                tracing::warn!(
                    "MLflow: memory_usage.json not attached to run {}: {why}",
                    done.run_id
                );
            }
            false
        }
        Ok(Err(e)) => {
            tracing::error!("MLflow: the report failed: {e}; memory_usage.json is kept locally");
            true
        }
        Err(_) => {
            tracing::error!(
                "MLflow: no answer within finish_timeout ({}); memory_usage.json is kept locally",
                humantime::format_duration(config.finish_timeout)
            );
            true
        }
    }
}
