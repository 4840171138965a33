//! ClearML as one of the run's outputs: the reporter (entries as scalars
//! on a task), the `memory_usage` artifact and the task's end.
//!
//! It publishes its task for the outputs that file under it
//! ([`Links::publish_task`]) and, while it reports into the job's own
//! task, asks for their checkpoint uploads to register
//! ([`Links::subscribe_artifacts`]); at the end it registers the final
//! upload an uploader left ([`Links::take_final`]). Without such an
//! uploader, the document goes where the job's task keeps its artifacts
//! (`task_output`).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::outcome::{Artifact, FinishReport, TaskEnd};
use super::reporter::Reporter;
use super::settings::{ClearmlConfig, ClearmlError, NoZeroConfig, Settings};
use super::task_output::TaskOutput;
use crate::engine::Feed;
use crate::export::finish::Deadline;
use crate::export::output::{
    absolute, Background, CheckpointWait, Finished, Links, Output, RunEnd, Start, TaskLink,
};
use crate::export::s3::S3Config;

/// Why a run does not report to ClearML.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClearmlOff {
    /// Nothing asks for ClearML (the reason says what is missing).
    #[error("{0}")]
    Unconfigured(NoZeroConfig),
    /// clearml.conf could not be read.
    #[error(transparent)]
    Conf(ClearmlError),
}

/// The ClearML output.
pub(crate) struct ClearmlOutput {
    settings: Settings,
    /// The settings as resolved (the advice re-reads them).
    resolved: Settings,
    final_flush_timeout: Duration,
    /// The `[s3]` settings: their limits serve an upload to the job's
    /// task's own S3 destination too.
    s3: S3Config,
    reporter: Option<Reporter>,
    links: Arc<Links>,
    /// Another output uploads the document (S3): its uploads are the
    /// artifact, and nothing goes where the task keeps its artifacts.
    document_uploaded: bool,
    /// The checkpoint uploader to the job's task.
    checkpoint_uploads: Option<Background>,
}

impl ClearmlOutput {
    /// The run's ClearML output, or why the run does not report to
    /// ClearML (for a job that announces a task anyway). A half
    /// configuration is refused before anything starts; an unreadable
    /// clearml.conf costs only the ClearML reporting, not the run. Without
    /// any trigger, the SDK's own setup (clearml.conf) is enough to report
    /// into a task the job announces.
    pub(crate) fn build(
        config: &ClearmlConfig,
        s3: &S3Config,
    ) -> anyhow::Result<Result<ClearmlOutput, ClearmlOff>> {
        let env = |v: &str| std::env::var(v).ok();
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let settings = match super::resolve(config, &env, home.as_deref()) {
            Ok(Some(settings)) => settings,
            Ok(None) => match super::zero_config(config, &env, home.as_deref()) {
                Ok(settings) => settings,
                Err(e) => return Ok(Err(ClearmlOff::Unconfigured(e))),
            },
            Err(
                e @ (ClearmlError::Conf { .. }
                | ClearmlError::ConfRead { .. }
                | ClearmlError::ConfTooLarge { .. }),
            ) => {
                tracing::error!("ClearML reporting is off for this run: {e}");
                return Ok(Err(ClearmlOff::Conf(e)));
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Ok(ClearmlOutput {
            resolved: settings.clone(),
            settings,
            final_flush_timeout: config.final_flush_timeout,
            s3: s3.clone(),
            reporter: None,
            links: Arc::default(),
            document_uploaded: false,
            checkpoint_uploads: None,
        }))
    }

    /// Starts the reporter; it hears the job's announcements of its own
    /// task. `None` when only the job's task would do and the job cannot
    /// announce one (no socket).
    fn start_reporter(
        &mut self,
        ctx: &Start<'_>,
        entries: mpsc::UnboundedReceiver<crate::model::Entry>,
    ) -> Option<Reporter> {
        let job_tasks = ctx.job_tasks.lock().ok().and_then(|mut j| j.take());
        let mut settings = self.settings.clone();
        if settings.job_task_only {
            // No socket: the job cannot announce a task.
            job_tasks.as_ref()?;
            tracing::debug!(
                "ClearML: {} found; memtrack reports into the task the job announces \
                 (Task.init), if it does",
                settings.host_source
            );
        }
        // The task memtrack may create is named now: a name the server
        // would refuse is adapted for ClearML only, and said once.
        super::fit_task_name(&mut settings, &ctx.run.name);
        if !settings.adapted.is_empty() {
            tracing::warn!(
                "ClearML refuses names shorter than {} characters and unknown task types; \
                 for ClearML only: {}",
                super::MIN_NAME,
                settings.adapted.join("; ")
            );
        }
        // Without S3, the task gets the document where its other artifacts
        // go: its output_uri, clearml.conf's default_output_uri, else the
        // ClearML fileserver (nowhere when none is set: no upload).
        settings.files_upload = !ctx.document_uploaded;
        settings.artifact_expected = ctx.document_uploaded || settings.files_upload;
        let _guard = ctx.runtime.enter();
        Some(Reporter::start(
            settings,
            ctx.run.clone(),
            ctx.run_dir.to_path_buf(),
            entries,
            job_tasks,
        ))
    }

    /// Without an uploader of the document: once memtrack reports into
    /// the job's own task, the document goes where that task keeps its
    /// artifacts after every checkpoint and is registered as its
    /// `memory_usage` artifact while the task takes it (an early
    /// checkpoint is asked for as soon as the task is known). `None` when
    /// there is nowhere to put it.
    fn upload_checkpoints_to_files(
        &mut self,
        ctx: &Start<'_>,
        reporter: &Reporter,
    ) -> Option<tokio::sync::watch::Sender<crate::engine::Checkpoint>> {
        let mut output = TaskOutput::new(reporter.outputs()?, &self.s3, ctx.run);
        let artifacts = reporter.artifacts()?;
        let document = ctx.document.to_path_buf();
        let job_task = Some(reporter.job_task());
        let (uploads, tx) = CheckpointWait::spawn(ctx, job_task, |mut wait| async move {
            while wait.next().await {
                let Some(task) = wait.job_task() else {
                    continue;
                };
                let uploaded = output.upload(&document, &task).await;
                match &uploaded {
                    Err(e) if e.nowhere => {
                        tracing::debug!("ClearML: no artifact upload: {}", e.why);
                    }
                    Err(e) => tracing::warn!(
                        "ClearML: the checkpoint upload for the job's task failed (the final \
                         upload will try again): {}",
                        e.why
                    ),
                    Ok(_) => {}
                }
                // Failed or not meant: the reporter answers the job's
                // announcement without waiting for an artifact.
                let _ = artifacts.send(uploaded.map_err(|e| e.why.into()));
            }
        });
        self.checkpoint_uploads = Some(uploads);
        Some(tx)
    }

    /// A second signal: ClearML's unsent points go to the spool file
    /// without waiting on the network.
    fn stop_at_once(reporter: Reporter, end: &RunEnd<'_>) {
        let last = TaskEnd {
            exit: end.ended.job_exit,
            artifact: None,
            page: None,
        };
        let report = end.runtime.block_on(reporter.finish(last, Duration::ZERO));
        if report.unsent > 0 {
            tracing::warn!(
                "stopping at once: {} points not yet sent to ClearML stay in {}; \
                 to send them, run: memtrack clearml-resend {}",
                report.unsent,
                end.run_dir.join(super::SPOOL_FILE).display(),
                absolute(end.run_dir).display()
            );
        }
    }

    /// The final document where the task keeps its artifacts (no uploader
    /// of memtrack's own): for the job's task, the object the registered
    /// artifact points at, brought up to date; for a task memtrack
    /// created, the artifact it registers at the end. `None` when the
    /// document does not go there, or did not get there (logged, with the
    /// command that uploads it later; `failed` is then set).
    fn upload_to_files(
        &self,
        reporter: &Reporter,
        end: &RunEnd<'_>,
        deadline: &Deadline,
        failed: &mut bool,
    ) -> Option<Artifact> {
        let files = end.files();
        let document = files.document.as_path();
        let mut output = TaskOutput::new(reporter.outputs()?, &self.s3, &end.store.run);
        // The job's task, else the one memtrack created (registered with
        // the end of the run, as an S3 upload is).
        let job_task = reporter.job_task().borrow().clone();
        let task = job_task.or_else(|| reporter.task())?;
        let result = end.runtime.block_on(deadline.bound(
            "the upload where the job's ClearML task keeps its artifacts",
            output.upload(document, &task),
        ));
        match result {
            Some(Ok(a)) => {
                tracing::info!(
                    "uploaded {} ({} bytes) for the ClearML task",
                    super::output::redact_userinfo(&a.uri),
                    a.size
                );
                Some(a)
            }
            Some(Err(e)) if e.nowhere => {
                tracing::debug!("ClearML: no artifact upload: {}", e.why);
                None
            }
            Some(Err(e)) => {
                *failed = true;
                let later = match &e.retry {
                    Some((uploader, note)) => {
                        uploader.record_destination(end.run_dir);
                        format!(
                            "; {} is intact; to upload it later, run: {}{note}",
                            document.display(),
                            uploader.retry_command(&absolute(&crate::files::shown(document)))
                        )
                    }
                    None => format!("; {} is intact", document.display()),
                };
                tracing::error!("ClearML: the artifact upload failed: {}{later}", e.why);
                None
            }
            None => {
                *failed = true;
                tracing::error!(
                    "ClearML: no time was left to upload the artifact; {} is intact",
                    document.display()
                );
                None
            }
        }
    }

    /// Puts the run's advice on its task (its description); a failure
    /// costs only that, and is logged.
    fn advise_task(&self, end: &RunEnd<'_>, task: &str, advice: &str, deadline: &Deadline) {
        let work = super::advice::describe(&self.resolved, task, &end.store.run.id, advice);
        match end
            .runtime
            .block_on(deadline.bound("the advice on the ClearML task", work))
        {
            Some(Ok(())) => tracing::debug!("ClearML: the advice is on task {task}"),
            Some(Err(e)) => tracing::warn!("ClearML: the advice could not be put on the task: {e}"),
            None => tracing::warn!("ClearML: no time was left to put the advice on task {task}"),
        }
    }

    /// The end within the deadline: the final artifact (an uploader's,
    /// else where the task keeps its artifacts), ClearML's last points,
    /// the advice, and the task noted when an upload failed.
    fn finish_within_deadline(
        mut self,
        reporter: Reporter,
        end: &RunEnd<'_>,
        deadline: &Deadline,
    ) -> Finished {
        let uploaded = self.links.take_final();
        let mut task = match &uploaded {
            Some(u) => u.task.clone(),
            // Where the job's task keeps its artifacts: the path follows
            // the task, so give a task still being created a moment.
            None if reporter.outputs().is_some() => {
                let wait = self.final_flush_timeout.min(Duration::from_secs(10));
                end.runtime
                    .block_on(task_link(&reporter, wait).settle(deadline))
            }
            None => None,
        };
        if let Some(uploads) = self.checkpoint_uploads.take() {
            uploads.stop(end.runtime, deadline);
        }
        let mut upload_failed = matches!(
            uploaded.as_ref().and_then(|u| u.document.as_ref()),
            Some(Err(()))
        );
        let mut artifact = uploaded
            .as_ref()
            .and_then(|u| u.document.clone())
            .and_then(Result::ok);
        let page = uploaded.and_then(|u| u.page);
        if artifact.is_none() && end.files().written && !self.document_uploaded {
            artifact = self.upload_to_files(&reporter, end, deadline, &mut upload_failed);
        }
        let last = TaskEnd {
            exit: end.ended.job_exit,
            artifact,
            page,
        };
        // What the deadline leaves; points not sent by then stay in the
        // spool, and the log says how to send them.
        let wait = self.final_flush_timeout.min(deadline.remaining());
        let report = end
            .runtime
            .block_on(deadline.announce("ClearML's last points", reporter.finish(last, wait)));
        let failed = log_clearml(&report);
        if task.is_none() {
            task.clone_from(&report.task);
        }
        let advice = crate::model::advice::render_found(&end.store.document_view().advice);
        if let (Some(reported), false) = (&report.task, advice.is_empty()) {
            self.advise_task(end, &reported.id, &advice, deadline);
        }
        // A failed upload keeps the task noted, so that `memtrack upload`
        // later puts the file under the task's key too.
        if let (true, Some(task)) = (upload_failed, &task) {
            super::note_task(end.run_dir, task, false);
        }
        Finished { failed }
    }
}

/// The reporter's task as the outputs that file under it follow it.
fn task_link(reporter: &Reporter, settle_wait: Duration) -> TaskLink {
    let (task, job_task, settled, hurry) = reporter.link();
    TaskLink {
        task,
        job_task,
        settled,
        hurry,
        settle_wait,
        waiting_for: "the ClearML task to be created",
    }
}

impl Output for ClearmlOutput {
    fn name(&self) -> &'static str {
        "clearml"
    }

    fn start(&mut self, ctx: &Start<'_>) -> anyhow::Result<Feed> {
        let (entries_tx, entries_rx) = mpsc::unbounded_channel();
        let Some(reporter) = self.start_reporter(ctx, entries_rx) else {
            return Ok(Feed::default());
        };
        self.links = Arc::clone(&ctx.links);
        self.document_uploaded = ctx.document_uploaded;
        let wait = self.final_flush_timeout.min(Duration::from_secs(10));
        ctx.links.publish_task(task_link(&reporter, wait));
        if let Some(artifacts) = reporter.artifacts() {
            ctx.links.subscribe_artifacts(artifacts);
        }
        let checkpoints = if ctx.document_uploaded {
            None
        } else {
            self.upload_checkpoints_to_files(ctx, &reporter)
        };
        self.reporter = Some(reporter);
        Ok(Feed {
            entries: Some(entries_tx),
            checkpoints,
        })
    }

    fn errors(&self) -> Option<Arc<AtomicU64>> {
        self.reporter.as_ref().map(Reporter::errors)
    }

    fn finish(mut self: Box<Self>, end: &RunEnd<'_>, deadline: &Deadline) -> Finished {
        let Some(reporter) = self.reporter.take() else {
            return Finished::default();
        };
        if end.ended.urgent {
            Self::stop_at_once(reporter, end);
            return Finished::default();
        }
        self.finish_within_deadline(reporter, end, deadline)
    }
}

/// Logs what the reporter achieved; true when something was lost or
/// left unsent.
fn log_clearml(report: &FinishReport) -> bool {
    if let Some(why) = &report.stood_down {
        tracing::debug!("ClearML: nothing reported: {why}");
        return false;
    }
    let task = report
        .task
        .as_ref()
        .map_or_else(|| "no task".to_string(), |t| format!("task {}", t.id));
    let failed = report.unsent > 0 || report.refused > 0 || report.task.is_none();
    if failed {
        tracing::error!(
            "ClearML ({task}): {} points sent, {} unsent{}, {} refused; {}",
            report.sent,
            report.unsent,
            report
                .spool
                .as_ref()
                .map(|p| format!(
                    " (kept in {}; `memtrack clearml-resend {}` sends them)",
                    p.display(),
                    p.parent().unwrap_or(Path::new(".")).display()
                ))
                .unwrap_or_default(),
            report.refused,
            report.errors.join("; ")
        );
    } else {
        tracing::info!(
            "ClearML ({task}): {} points sent{}{}",
            report.sent,
            if report.artifact_registered {
                ", artifact registered"
            } else {
                ""
            },
            report
                .final_status
                .as_ref()
                .map(|s| format!(", task {s}"))
                .unwrap_or_default()
        );
    }
    failed
}
