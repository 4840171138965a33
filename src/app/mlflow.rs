//! The run's figures into MLflow (see `export::mlflow`): off unless a
//! tracking server is configured; live from the start of the run, the rest
//! at its end, and what did not arrive kept for `memtrack mlflow-resend`.

use std::path::Path;

use crate::config::Config;
pub(super) use crate::export::mlflow::Live;
use crate::export::mlflow::{self, End, Report, Settings};
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

/// Starts live reporting on `runtime` before the job starts; `None`
/// (said) when it cannot, which costs MLflow only.
pub(super) fn start(
    runtime: &tokio::runtime::Runtime,
    settings: Option<&Settings>,
    run: &RunInfo,
    run_dir: &Path,
) -> Option<Live> {
    let settings = settings?;
    let _guard = runtime.enter();
    match Live::start(settings, &run.name, &run.id, run_dir) {
        Ok(live) => Some(live),
        Err(e) => {
            tracing::warn!("MLflow reporting is off for this run: {e}");
            None
        }
    }
}

/// How the run ended, for [`finish`].
pub(super) struct Ending<'a> {
    pub(super) document: &'a Path,
    pub(super) page: Option<&'a Path>,
    /// `memory_usage.json` was written.
    pub(super) written: bool,
    pub(super) peaks: &'a crate::model::Peaks,
    pub(super) job_failed: bool,
    /// A second signal: nothing waits on the network, all is spooled.
    pub(super) urgent: bool,
    pub(super) run_dir: &'a Path,
}

/// Delivers what is left within `finish_timeout` (nothing waits when the
/// stop is urgent) and says how it went; true when something is owed,
/// with the command that sends it.
pub(super) fn finish(
    runtime: &tokio::runtime::Runtime,
    live: Option<Live>,
    config: &Config,
    ending: &Ending<'_>,
    shown_uri: &str,
) -> bool {
    let Some(live) = live else {
        return false;
    };
    if !ending.written {
        tracing::error!("MLflow: memory_usage.json was not written; it is not attached");
    }
    let end = End {
        document: ending.written.then(|| ending.document.to_path_buf()),
        page: ending.page.map(Path::to_path_buf),
        peaks: (
            ending
                .peaks
                .cpu_ram_used_mb
                .max(ending.peaks.cpu_ram_hwm_mb),
            ending.peaks.gpu_ram_used_mb,
        ),
        failed: ending.job_failed,
    };
    let wait = if ending.urgent {
        std::time::Duration::ZERO
    } else {
        config.finish_timeout
    };
    let report =
        runtime.block_on(async { live.finish(end, tokio::time::Instant::now() + wait).await });
    say(&report, shown_uri, ending.run_dir)
}

/// The end-of-run lines; true when something is owed.
fn say(report: &Report, shown_uri: &str, run_dir: &Path) -> bool {
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
fn owed(report: &Report) -> String {
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
    config: &Config,
    timeout: std::time::Duration,
) -> anyhow::Result<MlflowResent> {
    if crate::store::journal::is_live(run_dir) {
        anyhow::bail!(
            "{} belongs to a live memtrack, which is still sending its values",
            run_dir.display()
        );
    }
    let settings = match mlflow::resolve(&config.mlflow, &|v| std::env::var(v).ok())? {
        mlflow::Resolved::On(s) => Some(s),
        mlflow::Resolved::Off | mlflow::Resolved::Unusable(_) => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(async {
        mlflow::resend(
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
