//! MLflow: the run's memory figures in an MLflow run, through the tracking
//! server's REST API, once the run's document is written.
//!
//! Which MLflow run: `mlflow.run_id` when set; else the run the job
//! announced (an `mlflow`/`active_run` mark whose `run_id` label names it:
//! the Python client's framework callbacks send it when the job has an
//! active MLflow run); else `MLFLOW_RUN_ID` from memtrack's environment;
//! else memtrack creates one in `mlflow.experiment_id`, named after the
//! memtrack run, and ends it with the job's outcome. A run memtrack did not
//! create keeps its status.
//!
//! What goes there: every sample of `memory_usage.json` as the metrics
//! `memtrack/host_mb`, `memtrack/gpu_mb` and `memtrack/gpu_reserved_mb`, at
//! the job's iteration axis (`step` = the entry's iteration, a timer sample
//! taking the last iteration seen before it), in batches of at most
//! [`BATCH`] values; the run's peaks as `memtrack/peak_host_mb` and
//! `memtrack/peak_gpu_mb`; and the document itself as the artifact
//! `memory_usage.json`, through the server's artifact proxy
//! (`mlflow server`'s default; another artifact store is reported and
//! skipped). It runs after the job has ended, so it never delays sampling,
//! and holds no more than the document.

mod api;

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub(crate) use api::{Api, Metric, MlflowError};

use crate::model::Document;

/// Most metric values per `runs/log-batch` request (MLflow's limit).
pub(crate) const BATCH: usize = 1000;

/// The component and operation of the mark that announces the job's run.
pub(crate) const ANNOUNCE: (&str, &str) = ("mlflow", "active_run");

/// The `[mlflow]` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlflowConfig {
    /// The tracking server (`http://…` or `https://…`). Empty: the
    /// `MLFLOW_TRACKING_URI` memtrack was started with; neither: off.
    pub(crate) tracking_uri: String,
    /// Report into this MLflow run (default: the job's, see the module).
    pub(crate) run_id: String,
    /// Where a run memtrack creates goes. Empty: `MLFLOW_EXPERIMENT_ID`,
    /// else `0` (MLflow's default experiment).
    pub(crate) experiment_id: String,
    /// One request's time limit.
    #[serde(with = "crate::units::serde_duration")]
    pub(crate) request_timeout: Duration,
}

impl Default for MlflowConfig {
    fn default() -> Self {
        MlflowConfig {
            tracking_uri: String::new(),
            run_id: String::new(),
            experiment_id: String::new(),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// The settings a run uses, from the configuration and the environment.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Settings {
    pub(crate) uri: String,
    pub(crate) run_id: Option<String>,
    pub(crate) experiment_id: String,
    pub(crate) request_timeout: Duration,
}

/// The run's MLflow settings, or None when MLflow is not configured. An
/// address that is not HTTP is an error (MLflow's file store cannot be
/// written through REST).
pub(crate) fn resolve(
    config: &MlflowConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Settings>, MlflowError> {
    let pick = |set: &str, var: &str| {
        Some(set.trim().to_string())
            .filter(|s| !s.is_empty())
            .or_else(|| {
                env(var)
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
            })
    };
    let Some(uri) = pick(&config.tracking_uri, "MLFLOW_TRACKING_URI") else {
        return Ok(None);
    };
    if !(uri.starts_with("http://") || uri.starts_with("https://")) {
        return Err(MlflowError::Config(format!(
            "MLflow tracking URI `{uri}` is not an http(s) server; memtrack reports to MLflow through its REST API"
        )));
    }
    Ok(Some(Settings {
        uri: uri.trim_end_matches('/').to_string(),
        run_id: pick(&config.run_id, "MLFLOW_RUN_ID"),
        experiment_id: pick(&config.experiment_id, "MLFLOW_EXPERIMENT_ID")
            .unwrap_or_else(|| "0".into()),
        request_timeout: config.request_timeout,
    }))
}

/// The run the job announced: the last `mlflow`/`active_run` mark's
/// `run_id` label.
pub(crate) fn announced_run(doc: &Document) -> Option<String> {
    doc.detailed_log
        .iter()
        .rev()
        .filter(|e| e.component == ANNOUNCE.0 && e.operation == ANNOUNCE.1)
        .find_map(|e| e.labels.get("run_id").cloned())
        .filter(|id| !id.is_empty())
}

/// The document's samples as metric values on the job's iteration axis,
/// then the run's peaks (at the last step).
pub(crate) fn metrics(doc: &Document) -> Vec<Metric> {
    let mut out = Vec::with_capacity(doc.detailed_log.len() * 3 + 2);
    let mut step = 0i64;
    let mut last_ms = 0i64;
    for e in &doc.detailed_log {
        if let Some(i) = e.iteration {
            step = i64::try_from(i).unwrap_or(i64::MAX);
        }
        let timestamp = (e.timestamp * 1000.0) as i64;
        last_ms = last_ms.max(timestamp);
        for (key, value) in [
            ("memtrack/host_mb", e.cpu_ram_used_mb),
            ("memtrack/gpu_mb", e.gpu_ram_used_mb),
            ("memtrack/gpu_reserved_mb", e.reserved_gpu_ram_mb),
        ] {
            out.push(Metric {
                key,
                value,
                timestamp,
                step,
            });
        }
    }
    for (key, value) in [
        (
            "memtrack/peak_host_mb",
            // The kernel's high-water mark when it saw a higher peak than the samples.
            doc.peak_usage
                .cpu_ram_used_mb
                .max(doc.peak_usage.cpu_ram_hwm_mb),
        ),
        ("memtrack/peak_gpu_mb", doc.peak_usage.gpu_ram_used_mb),
    ] {
        out.push(Metric {
            key,
            value,
            timestamp: last_ms,
            step,
        });
    }
    out
}

/// What the export did, for the end-of-run line.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Exported {
    pub(crate) run_id: String,
    pub(crate) metrics: usize,
    /// Why the artifact is not there, if it is not.
    pub(crate) artifact_skipped: Option<String>,
}

/// Puts the finished run's document into MLflow: the metrics, the peaks
/// and the `memory_usage.json` artifact. `failed` says how the job ended,
/// for a run memtrack created.
pub(crate) async fn export(
    settings: &Settings,
    document: &Path,
    run_name: &str,
    failed: bool,
) -> Result<Exported, MlflowError> {
    let doc = crate::model::json::read_document(document)
        .map_err(|e| MlflowError::Config(format!("{e:#}")))?;
    let api = Api::new(&settings.uri, settings.request_timeout)?;
    let chosen = settings.run_id.clone().or_else(|| announced_run(&doc));
    let (run_id, created) = match chosen {
        Some(id) => (id, false),
        None => (
            api.create_run(&settings.experiment_id, run_name, &doc.run.id)
                .await?,
            true,
        ),
    };
    let metrics = metrics(&doc);
    for batch in metrics.chunks(BATCH) {
        api.log_batch(&run_id, batch).await?;
    }
    let artifact_skipped = match api.artifact_path(&run_id).await? {
        Ok(path) => {
            let body = std::fs::read(document).map_err(|e| MlflowError::Config(e.to_string()))?;
            api.put_artifact(&path, crate::model::json::FILE_NAME, body)
                .await?;
            None
        }
        Err(why) => Some(why.to_string()),
    };
    if created {
        api.end_run(&run_id, failed).await?;
    }
    Ok(Exported {
        run_id,
        metrics: metrics.len(),
        artifact_skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_without_a_uri_and_refused_for_a_file_store() {
        let none = |_: &str| None;
        assert_eq!(resolve(&MlflowConfig::default(), &none).unwrap(), None);
        let file = |v: &str| (v == "MLFLOW_TRACKING_URI").then(|| "file:///tmp/mlruns".to_string());
        assert!(resolve(&MlflowConfig::default(), &file).is_err());
        let env = |v: &str| match v {
            "MLFLOW_TRACKING_URI" => Some("http://127.0.0.1:5000/".to_string()),
            "MLFLOW_RUN_ID" => Some("abc".to_string()),
            _ => None,
        };
        let s = resolve(&MlflowConfig::default(), &env).unwrap().unwrap();
        assert_eq!(s.uri, "http://127.0.0.1:5000");
        assert_eq!(s.run_id.as_deref(), Some("abc"));
        assert_eq!(s.experiment_id, "0");
    }

    #[test]
    fn timer_samples_take_the_last_iteration() {
        let mut doc = Document::default();
        for (iteration, mb) in [(None, 1.0), (Some(7), 2.0), (None, 3.0)] {
            doc.detailed_log.push(crate::model::Entry {
                component: "train".into(),
                operation: "timer".into(),
                iteration,
                cpu_ram_used_mb: mb,
                ..Default::default()
            });
        }
        let host: Vec<(i64, f64)> = metrics(&doc)
            .iter()
            .filter(|m| m.key == "memtrack/host_mb")
            .map(|m| (m.step, m.value))
            .collect();
        assert_eq!(host, vec![(0, 1.0), (7, 2.0), (7, 3.0)]);
    }
}
