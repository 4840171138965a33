//! MLflow as one of the run's outputs: live from the start of the run
//! ([`Live`]), the rest at its end within the shared deadline, and what
//! did not arrive kept for `memtrack mlflow-resend`.

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::live::{DeliveryReport, End, Live};
use super::settings::{resolve, MlflowConfig, Resolved, Settings};
use crate::engine::Feed;
use crate::export::finish::Deadline;
use crate::export::output::{Finished, Output, RunEnd, Start};

/// The MLflow output.
pub(crate) struct MlflowOutput {
    settings: Settings,
    live: Option<Live>,
}

impl MlflowOutput {
    /// On when a tracking server is configured (`mlflow.tracking_uri`, else
    /// `MLFLOW_TRACKING_URI`). A server that cannot be used is said once
    /// and costs the MLflow report, never the run.
    pub(crate) fn build(config: &MlflowConfig) -> anyhow::Result<Option<MlflowOutput>> {
        let resolved = match resolve(config, &|v| std::env::var(v).ok()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("MLflow reporting is off for this run: {e:#}");
                return Ok(None);
            }
        };
        Ok(match resolved {
            Resolved::Off => None,
            Resolved::Unusable(why) => {
                tracing::warn!("MLflow: {why}");
                None
            }
            Resolved::On(settings) => Some(MlflowOutput {
                settings,
                live: None,
            }),
        })
    }
}

impl Output for MlflowOutput {
    fn name(&self) -> &'static str {
        "mlflow"
    }

    fn start(&mut self, ctx: &Start<'_>) -> anyhow::Result<Feed> {
        let _guard = ctx.runtime.enter();
        match Live::start(&self.settings, &ctx.run.name, &ctx.run.id, ctx.run_dir) {
            Ok(live) => {
                let feed = Feed {
                    entries: Some(live.entries()),
                    checkpoints: None,
                };
                self.live = Some(live);
                Ok(feed)
            }
            Err(e) => {
                // Costs MLflow only.
                tracing::warn!("MLflow reporting is off for this run: {e}");
                Ok(Feed::default())
            }
        }
    }

    fn errors(&self) -> Option<Arc<AtomicU64>> {
        self.live.as_ref().map(Live::errors)
    }

    /// Delivers what is left within the deadline (nothing waits when the
    /// stop is urgent: all is kept for the resend) and says how it went.
    fn finish(mut self: Box<Self>, end: &RunEnd<'_>, deadline: &Deadline) -> Finished {
        let Some(live) = self.live.take() else {
            return Finished::default();
        };
        let files = end.files();
        if !files.written {
            tracing::error!("MLflow: memory_usage.json was not written; it is not attached");
        }
        let peaks = end.store.peaks();
        let last = End {
            document: files.written.then_some(files.document),
            page: files.page,
            peaks: (
                peaks
                    .figures
                    .cpu_ram_used_mb
                    .max(peaks.figures.cpu_ram_hwm_mb),
                peaks.figures.gpu_ram_used_mb,
            ),
            failed: end.job_failed,
        };
        let wait = if end.ended.urgent {
            std::time::Duration::ZERO
        } else {
            deadline.remaining()
        };
        let report = end
            .runtime
            .block_on(async { live.finish(last, tokio::time::Instant::now() + wait).await });
        Finished {
            failed: say(&report, &self.settings.shown(), end.run_dir),
        }
    }
}

/// The end-of-run lines; true when something is owed.
fn say(report: &DeliveryReport, shown_uri: &str, run_dir: &Path) -> bool {
    if let (Some(run), true) = (&report.run_id, report.sent > 0 || report.complete()) {
        tracing::info!(
            "MLflow: {} memory values logged into run {run} at {shown_uri} ({} while the job ran)",
            report.sent,
            report.sent_live
        );
    }
    if let Some(why) = &report.artifact_skipped {
        tracing::warn!("MLflow: memory_usage.json not attached: {why}");
    }
    if let Some(why) = &report.page_skipped {
        tracing::warn!("MLflow: the report page not attached: {why}");
    }
    if report.dropped > 0 {
        tracing::warn!(
            "MLflow: {} memory values were dropped while the server did not take them \
             (memory_usage.json has them)",
            report.dropped
        );
    }
    if report.refused > 0 {
        tracing::error!(
            "MLflow: the server refused {} memory values",
            report.refused
        );
    }
    if report.complete() {
        return report.refused > 0;
    }
    let owed = owed(report);
    let why = report
        .errors
        .last()
        .map_or(String::new(), |e| format!(": {e}"));
    match (&report.spool, &report.spool_error) {
        (Some(spool), _) => tracing::error!(
            "MLflow: {owed} did not arrive{why}; kept in {}; to send them, run: memtrack \
             mlflow-resend {}",
            crate::files::shown(spool).display(),
            crate::export::s3::shell_quote(&crate::files::shown(run_dir).display().to_string())
        ),
        (None, Some(e)) => {
            tracing::error!("MLflow: {owed} did not arrive{why}, and cannot be kept: {e}");
        }
        (None, None) => tracing::error!("MLflow: {owed} did not arrive{why}"),
    }
    true
}

/// What is owed, in words: "12 memory values and the artifacts".
pub(crate) fn owed(report: &DeliveryReport) -> String {
    let mut parts = Vec::new();
    if report.unsent > 0 {
        parts.push(format!("{} memory values", report.unsent));
    }
    parts.extend(report.owed.iter().map(ToString::to_string));
    match parts.len() {
        0 => "nothing".into(),
        1 => parts.remove(0),
        _ => {
            let last = parts.pop().unwrap_or_default();
            format!("{} and {last}", parts.join(", "))
        }
    }
}
