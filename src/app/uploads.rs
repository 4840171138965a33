//! Uploading the run's document to S3: after checkpoints while the run
//! goes on, and once at the end within the finish deadline; and the key
//! it goes under.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;

use super::io::Io;
use crate::event::inbox::Input;
use crate::export::clearml;
use crate::export::finish::Deadline;
use crate::model::RunInfo;

impl Io {
    /// Uploads the run's document within the deadline; logs the outcome
    /// and, on failure, the command that uploads it later. `None` when S3
    /// is off.
    pub(super) fn upload(
        &self,
        document: &Path,
        run: &RunInfo,
        task: Option<clearml::TaskRef>,
        deadline: &Deadline,
    ) -> Option<Result<crate::export::s3::Uploaded, crate::export::s3::S3Error>> {
        let s3 = self.s3.as_ref()?;
        let key = object_key(
            s3,
            &run.name,
            task,
            &crate::export::s3::file_name(&run.labels),
        );
        let what = format!("the upload to {}", s3.endpoint);
        let result = self
            .runtime
            .block_on(deadline.bound(&what, s3.upload(document, &key)))
            .unwrap_or_else(|| {
                Err(crate::export::s3::S3Error::Deadline {
                    endpoint: s3.endpoint.clone(),
                    bucket: s3.dest.bucket.clone(),
                    after: crate::units::format_duration(deadline.limit()),
                })
            });
        if result.is_err() {
            self.s3_errors.fetch_add(1, Ordering::Relaxed);
        }
        match &result {
            Ok(u) => tracing::info!(
                "uploaded {} ({} bytes, {} part{})",
                u.uri,
                u.size,
                u.parts,
                if u.parts == 1 { "" } else { "s" }
            ),
            Err(e) => tracing::error!(
                "upload failed: {e}; {} is intact; to upload it later, run: {}",
                document.display(),
                s3.retry_command(&absolute(&crate::files::shown(document)))
            ),
        }
        Some(result)
    }

    /// Uploads the run's report page beside its document's object (the
    /// same folder, the page's name); a failure is a warning, the page
    /// being a convenience. `None` when S3 is off or the page did not go.
    pub(super) fn upload_page(
        &self,
        page: &Path,
        run: &RunInfo,
        task: Option<clearml::TaskRef>,
        deadline: &Deadline,
    ) -> Option<crate::export::s3::Uploaded> {
        let s3 = self.s3.as_ref()?;
        let file = crate::export::s3::file_name(&run.labels);
        let key = page_key(&object_key(s3, &run.name, task, &file));
        let what = format!("the report page's upload to {}", s3.endpoint);
        match self
            .runtime
            .block_on(deadline.bound(&what, s3.upload(page, &key)))
        {
            Some(Ok(u)) => {
                tracing::info!("uploaded {} ({} bytes)", u.uri, u.size);
                Some(u)
            }
            Some(Err(e)) => {
                tracing::warn!("the report page was not uploaded: {e}");
                None
            }
            None => {
                tracing::warn!("no time was left to upload the report page");
                None
            }
        }
    }

    /// Uploads the document after every checkpoint: always with
    /// `s3.upload_checkpoints` (`always`), else once memtrack reports into
    /// the job's own ClearML task, where each upload is handed to the
    /// reporter to register as the `memory_usage` artifact while the task
    /// takes it. When that task becomes known, an early checkpoint is asked
    /// of the engine, so the artifact is there long before the job's SDK
    /// closes the task.
    pub(super) fn upload_checkpoints(
        &mut self,
        document: PathBuf,
        run: &RunInfo,
        always: bool,
        engine: SyncSender<Input>,
    ) -> Option<tokio::sync::watch::Sender<u64>> {
        let Some(s3) = self.s3.clone() else {
            return self.upload_checkpoints_to_files(document, run, engine);
        };
        let (tx, mut rx) = tokio::sync::watch::channel(0u64);
        let run = run.clone();
        let task = self.clearml.as_ref().map(|r| r.task_updates());
        let mut job_task = self.clearml.as_ref().map(|r| r.job_task());
        let artifacts = self.clearml.as_ref().and_then(|r| r.artifacts());
        let mut shutdown = self.shutdown.subscribe();
        let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
        let errors = Arc::clone(&self.s3_errors);
        let handle = self.runtime.spawn(async move {
            loop {
                // An upload under way is never cut: stopping waits for it.
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = stop.changed() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                    changed = clearml::reporter::job_task_changed(&mut job_task) => {
                        if changed && clearml::reporter::job_task_known(&job_task) {
                            let _ = engine.try_send(Input::Checkpoint);
                        }
                        continue;
                    }
                }
                let for_job_task = clearml::reporter::job_task_known(&job_task);
                if !always && !for_job_task {
                    continue;
                }
                let key = object_key(
                    &s3,
                    &run.name,
                    task.as_ref().and_then(|t| t.borrow().clone()),
                    &crate::export::s3::file_name(&run.labels),
                );
                let uploaded = s3.upload(&document, &key).await;
                if let Err(e) = &uploaded {
                    errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "checkpoint upload failed (the final upload will try again): {e}"
                    );
                }
                if let (true, Some(a)) = (for_job_task, &artifacts) {
                    let _ = a.send(
                        uploaded
                            .map(|u| clearml::Artifact {
                                uri: u.uri,
                                size: u.size,
                                sha256: u.sha256,
                            })
                            .map_err(Into::into),
                    );
                }
            }
        });
        self.checkpoint_uploads = Some((stop_tx, handle));
        Some(tx)
    }

    /// Without an S3 destination of memtrack's own: once memtrack reports
    /// into the job's own ClearML task, the document goes where that task
    /// keeps its artifacts ([`TaskOutput`]) after every checkpoint and is
    /// registered as its `memory_usage` artifact while the task takes it
    /// (as with S3, an early checkpoint is asked for as soon as the task is
    /// known). `None` when there is nowhere to put it.
    fn upload_checkpoints_to_files(
        &mut self,
        document: PathBuf,
        run: &RunInfo,
        engine: SyncSender<Input>,
    ) -> Option<tokio::sync::watch::Sender<u64>> {
        let reporter = self.clearml.as_ref()?;
        let mut output = TaskOutput::new(reporter.outputs()?, &self.s3_config, run);
        let artifacts = reporter.artifacts()?;
        let mut job_task = Some(reporter.job_task());
        let (tx, mut rx) = tokio::sync::watch::channel(0u64);
        let mut shutdown = self.shutdown.subscribe();
        let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
        let handle = self.runtime.spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = stop.changed() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                    changed = clearml::reporter::job_task_changed(&mut job_task) => {
                        if changed && clearml::reporter::job_task_known(&job_task) {
                            let _ = engine.try_send(Input::Checkpoint);
                        }
                        continue;
                    }
                }
                let Some(task) = job_task.as_ref().and_then(|t| t.borrow().clone()) else {
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
        self.checkpoint_uploads = Some((stop_tx, handle));
        Some(tx)
    }

    /// The final document where the task keeps its artifacts (no S3
    /// destination of memtrack's own): for the job's task, the object the
    /// registered artifact points at, brought up to date; for a task
    /// memtrack created, the artifact it registers at the end. `None` when the document does not go
    /// there, or did not get there (logged, with the command that uploads
    /// it later; `failed` is then set).
    pub(super) fn upload_to_files(
        &self,
        reporter: &clearml::Reporter,
        document: &Path,
        (run, run_dir): (&RunInfo, &Path),
        deadline: &Deadline,
        failed: &mut bool,
    ) -> Option<clearml::Artifact> {
        if self.s3.is_some() {
            return None;
        }
        let mut output = TaskOutput::new(reporter.outputs()?, &self.s3_config, run);
        // The job's task, else the one memtrack created (registered with
        // the end of the run, as an S3 upload is).
        let job_task = reporter.job_task().borrow().clone();
        let task = job_task.or_else(|| reporter.task())?;
        let result = self.runtime.block_on(deadline.bound(
            "the upload where the job's ClearML task keeps its artifacts",
            output.upload(document, &task),
        ));
        match result {
            Some(Ok(a)) => {
                tracing::info!(
                    "uploaded {} ({} bytes) for the ClearML task",
                    clearml::output::redact_userinfo(&a.uri),
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
                        uploader.record_destination(run_dir);
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

    /// Stops the checkpoint uploader, waiting for an upload under way, so
    /// that no checkpoint lands on the object after the final document.
    /// Past the deadline the upload under way is abandoned (the final
    /// upload then has no time left either).
    pub(super) fn stop_checkpoint_uploads(&mut self, deadline: &Deadline) {
        if let Some((stop, mut handle)) = self.checkpoint_uploads.take() {
            let _ = stop.send(true);
            let done = self
                .runtime
                .block_on(deadline.bound("a checkpoint upload under way", &mut handle));
            if done.is_none() {
                handle.abort();
            }
        }
    }
}

/// `path` made absolute (for a command printed to be run elsewhere).
pub(super) fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The document's S3 key: ClearML's artifact layout
/// (`<project>/<task name>.<task id>/…`) once a ClearML task is known,
/// else `<run>/…`.
fn object_key(
    s3: &crate::export::s3::Uploader,
    run: &str,
    task: Option<clearml::TaskRef>,
    file: &str,
) -> String {
    let task = task.map(|t| crate::export::s3::TaskKey {
        project: t.project,
        name: t.name,
        id: t.id,
    });
    crate::export::s3::object_key(&s3.dest, run, task.as_ref(), file)
}

/// The report page's key beside the document's: the same folder, the
/// document's name with `memory_usage` → `memory_report` and `.html`
/// (`memory_report.html`; per rank `memory_report.rank1.html`).
fn page_key(document_key: &str) -> String {
    let (folder, file) = match document_key.rsplit_once('/') {
        Some((folder, file)) => (Some(folder), file),
        None => (None, document_key),
    };
    let stem = file.strip_suffix(".json").unwrap_or(file);
    let stem = stem.replacen("memory_usage", "memory_report", 1);
    let name = format!("{stem}.html");
    match folder {
        Some(f) => format!("{f}/{name}"),
        None => name,
    }
}

/// The document where the job's ClearML task keeps its artifacts: the
/// task's `output_uri`, else `clearml.conf`'s `default_output_uri`, else
/// the ClearML fileserver ([`clearml::output`]). An `s3://` destination
/// goes through memtrack's S3 uploader with the `[s3]` settings' limits,
/// the AWS environment's or profile's credentials, else those of
/// `sdk.aws.s3`; the uploader is kept while the destination stays.
struct TaskOutput {
    outputs: clearml::files::Outputs,
    s3: crate::export::s3::S3Config,
    run: String,
    file: String,
    uploader: Option<(String, crate::export::s3::Uploader)>,
}

/// A failed upload for the job's task: why, and for S3 the uploader (for
/// the command that uploads the file later) with a note on credentials.
struct TaskUploadError {
    why: NotUploaded,
    retry: Option<(crate::export::s3::Uploader, String)>,
    /// The task names no destination and none is configured: no upload
    /// was meant, nothing failed.
    nowhere: bool,
}

/// Why the document is not where the job's task keeps its artifacts; the
/// destination is named as `clearml::output::shown` shows it.
#[derive(Debug, thiserror::Error)]
enum NotUploaded {
    #[error("the task has no output_uri, and no default_output_uri or fileserver is configured")]
    Nowhere,
    #[error(transparent)]
    Destination(#[from] clearml::output::DestinationError),
    #[error("{source} (to {base}, {chosen})")]
    Files {
        base: String,
        chosen: String,
        source: clearml::files::FileError,
    },
    #[error("{source} ({chosen} `{uri}`)")]
    S3 {
        chosen: String,
        uri: String,
        source: crate::export::s3::S3Error,
    },
    #[error("no S3 uploader")]
    NoUploader,
}

impl TaskOutput {
    fn new(
        outputs: clearml::files::Outputs,
        s3: &crate::export::s3::S3Config,
        run: &RunInfo,
    ) -> TaskOutput {
        TaskOutput {
            outputs,
            s3: s3.clone(),
            run: run.name.clone(),
            file: crate::export::s3::file_name(&run.labels),
            uploader: None,
        }
    }

    async fn upload(
        &mut self,
        document: &Path,
        task: &clearml::TaskRef,
    ) -> Result<clearml::Artifact, TaskUploadError> {
        use clearml::output::Destination;
        let said = |why: NotUploaded| TaskUploadError {
            why,
            retry: None,
            nowhere: false,
        };
        let Some((chosen, dest)) = self.outputs.for_task(task) else {
            return Err(TaskUploadError {
                why: NotUploaded::Nowhere,
                retry: None,
                nowhere: true,
            });
        };
        match dest.map_err(|e| said(e.into()))? {
            Destination::Files(base) => {
                let path = clearml::FileServer::path(task, &self.file);
                self.outputs
                    .files(&base)
                    .upload(document, &path)
                    .await
                    .map_err(|source| {
                        said(NotUploaded::Files {
                            base: clearml::output::shown(&base),
                            chosen: chosen.source.clone(),
                            source,
                        })
                    })
            }
            Destination::S3(target) => self.upload_s3(document, task, &chosen, target).await,
        }
    }

    async fn upload_s3(
        &mut self,
        document: &Path,
        task: &clearml::TaskRef,
        chosen: &clearml::output::Chosen,
        target: clearml::output::S3Target,
    ) -> Result<clearml::Artifact, TaskUploadError> {
        let id = format!("{}|{:?}|{}", target.url, target.endpoint, target.region);
        if self.uploader.as_ref().is_none_or(|(k, _)| *k != id) {
            let mut config = self.s3.clone();
            config.url = target.url.clone();
            if let Some(e) = &target.endpoint {
                config.endpoint = e.clone();
            }
            if !target.region.is_empty() {
                config.region = target.region.clone();
            }
            let keys = target.keys.clone().map(|k| (k.key, k.secret));
            let uploader =
                crate::export::s3::Uploader::with_keys(&config, keys, &target.keys_source)
                    .await
                    .map_err(|source| TaskUploadError {
                        nowhere: false,
                        why: NotUploaded::S3 {
                            chosen: chosen.source.clone(),
                            uri: clearml::output::shown(&chosen.uri),
                            source,
                        },
                        retry: None,
                    })?;
            self.uploader = Some((id, uploader));
        }
        let Some((_, uploader)) = &self.uploader else {
            return Err(TaskUploadError {
                why: NotUploaded::NoUploader,
                retry: None,
                nowhere: false,
            });
        };
        let key = object_key(uploader, &self.run, Some(task.clone()), &self.file);
        match uploader.upload(document, &key).await {
            Ok(u) => Ok(clearml::Artifact {
                // As the SDK writes it: with the store's host when the
                // destination names one.
                uri: match &target.host {
                    Some(host) => format!("s3://{host}/{}/{key}", uploader.dest.bucket),
                    None => u.uri,
                },
                size: u.size,
                sha256: u.sha256,
            }),
            Err(source) => {
                let note = match &uploader.resolved.credentials {
                    crate::export::s3::aws::Credentials::Given(source) => format!(
                        " (with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set to the key and \
                         secret of {source})"
                    ),
                    _ => String::new(),
                };
                Err(TaskUploadError {
                    nowhere: false,
                    why: NotUploaded::S3 {
                        chosen: chosen.source.clone(),
                        uri: clearml::output::shown(&chosen.uri),
                        source,
                    },
                    retry: Some((uploader.clone(), note)),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::page_key;

    #[test]
    fn the_page_goes_beside_the_document_under_its_own_name() {
        assert_eq!(
            page_key("runs/job/artifacts/memory_usage/memory_usage.json"),
            "runs/job/artifacts/memory_usage/memory_report.html"
        );
        assert_eq!(
            page_key("p/t.1/artifacts/memory_usage/memory_usage.h1.rank3.json"),
            "p/t.1/artifacts/memory_usage/memory_report.h1.rank3.html"
        );
        assert_eq!(page_key("memory_usage.json"), "memory_report.html");
    }
}
