//! `memtrack clearml-resend`: sending what an ended run left for ClearML
//! (its spool file), and ending a task it created.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::export::clearml::{self, ClearmlConfig};
use crate::model::Document;
use crate::store::journal;

/// What `memtrack clearml-resend` achieved.
#[derive(Debug)]
pub struct Resent {
    /// One line for the user.
    pub summary: String,
    /// Nothing is left to send and nothing was refused.
    pub complete: bool,
    pub report: clearml::FinishReport,
}

/// Sends what an ended run left for ClearML in `run_dir`: the points of its
/// spool file, into the task it reported into (`clearml-task.json`) unless
/// the configuration names one, or into a task created now when the run
/// never got one. A task that run created and could not end is ended as the
/// job did. What still cannot be sent stays in the spool.
pub fn clearml_resend(
    run_dir: &Path,
    config: &ClearmlConfig,
    timeout: Duration,
) -> anyhow::Result<Resent> {
    if journal::is_live(run_dir) {
        anyhow::bail!(
            "{} belongs to a live memtrack, which is still sending its points",
            run_dir.display()
        );
    }
    let spool = run_dir.join(clearml::SPOOL_FILE);
    let task_file = run_dir.join(clearml::TASK_FILE);
    if !spool.exists() && !task_file.exists() {
        return Ok(Resent {
            summary: format!(
                "nothing to send: {} holds no {}",
                run_dir.display(),
                clearml::SPOOL_FILE
            ),
            complete: true,
            report: clearml::FinishReport::default(),
        });
    }
    let doc = read_run(run_dir)?;
    let settings = resend_settings(config, &task_file)?;
    let (report, bad) = send(settings, &doc, run_dir, &spool, timeout)?;
    if bad > 0 {
        tracing::warn!(
            "{bad} lines of {} were not points (torn by a kill?) and were skipped",
            spool.display()
        );
    }
    Ok(summarize(report, bad, &spool))
}

/// The run's document, for its name and exit.
fn read_run(run_dir: &Path) -> anyhow::Result<Document> {
    let document = run_dir.join(crate::model::json::FILE_NAME);
    crate::report::read::without_log(&document).with_context(|| {
        format!(
            "the run's JSON is needed for its name and exit (after a killed memtrack, run \
             `memtrack recover {}` first)",
            run_dir.display()
        )
    })
}

/// The ClearML settings to resend with: ClearML on unless turned off, and
/// the task the run noted unless the configuration names one.
fn resend_settings(config: &ClearmlConfig, task_file: &Path) -> anyhow::Result<clearml::Settings> {
    // Asking for a resend turns ClearML on unless it is turned off.
    let mut cc = config.clone();
    if cc.enabled == crate::switch::Switch::Auto {
        cc.enabled = crate::switch::Switch::On;
    }
    let mut settings = clearml::resolve(
        &cc,
        &|v| std::env::var(v).ok(),
        std::env::var_os("HOME").map(PathBuf::from).as_deref(),
    )?
    .ok_or_else(|| anyhow::anyhow!("ClearML is turned off (clearml.enabled = false)"))?;
    if settings.task.is_none() {
        if let Some(note) = clearml::read_task_note(task_file)? {
            settings.task = Some(note.id);
            settings.owns_task = note.created;
        }
    }
    Ok(settings)
}

/// Sends the spool's points within `timeout` and ends the task as the job
/// ended. Returns the reporter's account and the spool lines that were not
/// points.
fn send(
    settings: clearml::Settings,
    doc: &Document,
    run_dir: &Path,
    spool: &Path,
    timeout: Duration,
) -> anyhow::Result<(clearml::FinishReport, u64)> {
    let run = doc.run.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let (reporter, bad) = clearml::Reporter::resend(settings, run, run_dir.to_path_buf())
            .with_context(|| format!("cannot read {}", spool.display()))?;
        let end = clearml::TaskEnd {
            exit: doc.run.exit,
            artifact: None,
            page: None,
        };
        anyhow::Ok((reporter.finish(end, timeout).await, bad))
    })
}

/// The one line `memtrack clearml-resend` prints.
fn summarize(report: clearml::FinishReport, bad: u64, spool: &Path) -> Resent {
    let task = report
        .task
        .as_ref()
        .map_or_else(|| "no task".to_string(), |t| format!("task {}", t.id));
    let complete = report.unsent == 0 && report.refused == 0 && report.discarded == 0 && bad == 0;
    let mut summary = format!("ClearML ({task}): {} points sent", report.sent);
    if report.unsent > 0 {
        summary.push_str(&format!(
            ", {} still unsent in {}",
            report.unsent,
            spool.display()
        ));
    }
    if report.refused > 0 {
        summary.push_str(&format!(", {} refused by the server", report.refused));
    }
    if let Some(status) = &report.final_status {
        summary.push_str(&format!("; task marked {status}"));
    }
    if !report.errors.is_empty() {
        summary.push_str(&format!("; {}", report.errors.join("; ")));
    }
    Resent {
        summary,
        complete,
        report,
    }
}
