//! `memtrack mlflow-resend`: what a run could not deliver to MLflow, sent
//! once the server is back (the output itself is `run_output`).

use std::path::Path;

use crate::export::mlflow::run_output::owed;
use crate::export::mlflow::{self, MlflowConfig};

/// What `memtrack mlflow-resend` achieved.
#[derive(Debug)]
pub struct MlflowResent {
    /// One line for the user.
    pub summary: String,
    /// Nothing is left to send.
    pub complete: bool,
}

/// `memtrack mlflow-resend`: sends what an ended run left in `run_dir`'s
/// `mlflow-spool.jsonl` (values, artifacts, the end of a run memtrack
/// created) within `timeout`. A second resend after a complete one finds
/// nothing to send. A spool file that is malformed, oversized or hostile
/// is refused with the line that broke it, and left as it is.
pub fn mlflow_resend(
    run_dir: &Path,
    config: &MlflowConfig,
    timeout: std::time::Duration,
) -> anyhow::Result<MlflowResent> {
    if crate::store::journal::is_live(run_dir) {
        anyhow::bail!(
            "{} belongs to a live memtrack, which is still sending its values",
            run_dir.display()
        );
    }
    let settings = match mlflow::resolve(config, &|v| std::env::var(v).ok())? {
        mlflow::Resolved::On(s) => Some(s),
        mlflow::Resolved::Off | mlflow::Resolved::Unusable(_) => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(async {
        super::live::resend(
            settings.as_ref(),
            run_dir,
            tokio::time::Instant::now() + timeout,
        )
        .await
    })?;
    let Some(report) = report else {
        return Ok(MlflowResent {
            summary: format!(
                "nothing to send: {} holds no {}",
                run_dir.display(),
                mlflow::SPOOL_FILE
            ),
            complete: true,
        });
    };
    let run = report
        .run_id
        .as_deref()
        .map_or_else(|| "no run".to_string(), |r| format!("run {r}"));
    let mut summary = format!("MLflow ({run}): {} memory values sent", report.sent);
    if report.refused > 0 {
        summary.push_str(&format!(", {} refused by the server", report.refused));
    }
    if !report.complete() {
        summary.push_str(&format!("; {} still owed", owed(&report)));
        if let Some(spool) = &report.spool {
            summary.push_str(&format!(", kept in {}", spool.display()));
        }
        if let Some(e) = &report.spool_error {
            summary.push_str(&format!(", cannot be kept: {e}"));
        }
        if let Some(e) = report.errors.last() {
            summary.push_str(&format!(" ({e})"));
        }
    }
    Ok(MlflowResent {
        complete: report.complete() && report.refused == 0,
        summary,
    })
}
