//! S3 as one of the run's outputs: the document uploaded after
//! checkpoints while the run goes on, and once at the end within the
//! finish deadline, with the report page beside it.
//!
//! When a tracker runs (ClearML), the key follows its task
//! ([`crate::export::output::TaskLink`]) and every upload made for the
//! job's own task is handed to it as an artifact to register
//! ([`Links::artifacts`]); the final uploads are left for its finish
//! ([`Links::set_final`]).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{S3Config, S3Error, UploadedObject, Uploader};
use crate::engine::Feed;
use crate::export::clearml::outcome::{Artifact, TaskRef};
use crate::export::finish::Deadline;
use crate::export::output::{
    absolute, Background, CheckpointWait, FinalUploads, Finished, Links, Output, RunEnd, Start,
};
use crate::model::RunInfo;

/// The S3 output.
pub(crate) struct S3Output {
    config: S3Config,
    uploader: Option<Uploader>,
    /// Failed uploads (checkpoints and the final one).
    errors: Arc<AtomicU64>,
    run: Option<RunInfo>,
    links: Arc<Links>,
    /// The checkpoint uploader.
    checkpoint_uploads: Option<Background>,
}

impl S3Output {
    /// On when `[s3] url` names a bucket (the settings were checked with
    /// the rest of the configuration).
    pub(crate) fn build(config: &S3Config) -> anyhow::Result<Option<S3Output>> {
        if config.url.is_empty() {
            return Ok(None);
        }
        Ok(Some(S3Output {
            config: config.clone(),
            uploader: None,
            errors: Arc::new(AtomicU64::new(0)),
            run: None,
            links: Arc::default(),
            checkpoint_uploads: None,
        }))
    }

    /// The uploader, with a warning now when its credentials will not do.
    fn open(&self, runtime: &tokio::runtime::Runtime) -> anyhow::Result<Uploader> {
        let uploader = runtime.block_on(Uploader::new(&self.config))?;
        if let Some(why) = runtime.block_on(uploader.credentials_problem()) {
            tracing::warn!(
                "no usable AWS credentials ({why}): the upload to {} will fail; \
                 memory_usage.json stays local and `memtrack upload` can send it later",
                self.config.url
            );
        } else if let Some(unknown) = uploader.resolved.unknown_profile() {
            tracing::warn!("{unknown}");
        }
        Ok(uploader)
    }

    /// Uploads the document after every checkpoint: always with
    /// `s3.upload_checkpoints`, else once the tracker reports into the
    /// job's own task, where each upload is handed to it to register as
    /// the `memory_usage` artifact while the task takes it
    /// ([`CheckpointWait`] asks for an early checkpoint then).
    fn upload_checkpoints(&mut self, ctx: &Start<'_>, s3: Uploader, run: RunInfo) -> Feed {
        let always = self.config.upload_checkpoints;
        let tracker = ctx.links.task().cloned();
        if !always && tracker.is_none() {
            return Feed::default();
        }
        let task = tracker.as_ref().map(|t| t.task.clone());
        let job_task = tracker.map(|t| t.job_task);
        let artifacts = ctx.links.artifacts();
        let document = ctx.document.to_path_buf();
        let errors = Arc::clone(&self.errors);
        let (uploads, tx) = CheckpointWait::spawn(ctx, job_task, |mut wait| async move {
            while wait.next().await {
                let for_job_task = wait.job_task().is_some();
                if !always && !for_job_task {
                    continue;
                }
                let key = object_key(&s3, &run, task.as_ref().and_then(|t| t.borrow().clone()));
                let uploaded = s3.upload(&document, &key).await;
                if let Err(e) = &uploaded {
                    errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "checkpoint upload failed (the final upload will try again): {e}"
                    );
                }
                if let (true, Some(a)) = (for_job_task, &artifacts) {
                    let _ = a.send(uploaded.map(artifact).map_err(Into::into));
                }
            }
        });
        self.checkpoint_uploads = Some(uploads);
        Feed {
            entries: None,
            checkpoints: Some(tx),
        }
    }

    /// Uploads the run's document within the deadline; logs the outcome
    /// and, on failure, the command that uploads it later.
    fn upload(
        &self,
        s3: &Uploader,
        (end, document): (&RunEnd<'_>, &Path),
        task: Option<TaskRef>,
        deadline: &Deadline,
    ) -> Result<UploadedObject, S3Error> {
        let run = &end.store.run;
        let key = object_key(s3, run, task);
        let what = format!("the upload to {}", s3.endpoint);
        let result = end
            .runtime
            .block_on(deadline.bound(&what, s3.upload(document, &key)))
            .unwrap_or_else(|| {
                Err(S3Error::Deadline {
                    endpoint: s3.endpoint.clone(),
                    bucket: s3.dest.bucket.clone(),
                    after: crate::units::format_duration(deadline.limit()),
                })
            });
        if result.is_err() {
            self.errors.fetch_add(1, Ordering::Relaxed);
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
        result
    }

    /// Uploads the run's report page beside its document's object (the
    /// same folder, the page's name); a failure is a warning, the page
    /// being a convenience.
    fn upload_page(
        s3: &Uploader,
        page: &Path,
        end: &RunEnd<'_>,
        task: Option<TaskRef>,
        deadline: &Deadline,
    ) -> Option<UploadedObject> {
        let key = page_key(&object_key(s3, &end.store.run, task));
        let what = format!("the report page's upload to {}", s3.endpoint);
        match end
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
}

impl Output for S3Output {
    fn name(&self) -> &'static str {
        "s3"
    }

    fn uploads_document(&self) -> bool {
        true
    }

    fn start(&mut self, ctx: &Start<'_>) -> anyhow::Result<Feed> {
        let uploader = self.open(ctx.runtime)?;
        uploader.record_destination(ctx.run_dir);
        self.links = Arc::clone(&ctx.links);
        self.run = Some(ctx.run.clone());
        self.uploader = Some(uploader.clone());
        Ok(self.upload_checkpoints(ctx, uploader, ctx.run.clone()))
    }

    fn errors(&self) -> Option<Arc<AtomicU64>> {
        Some(Arc::clone(&self.errors))
    }

    fn finish(mut self: Box<Self>, end: &RunEnd<'_>, deadline: &Deadline) -> Finished {
        let Some(s3) = self.uploader.clone() else {
            return Finished::default();
        };
        let files = end.files();
        if end.ended.urgent {
            tracing::warn!(
                "stopping at once: the upload was skipped; to upload it later, run: {}",
                s3.retry_command(&absolute(&files.document))
            );
            return Finished::default();
        }
        // The key follows the tracker's task: give a task still being
        // created a moment.
        let tracker = self.links.task().cloned();
        let task = match &tracker {
            Some(t) => end.runtime.block_on(t.settle(deadline)),
            None => None,
        };
        if let Some(uploads) = self.checkpoint_uploads.take() {
            uploads.stop(end.runtime, deadline);
        }
        if !files.written {
            self.links.set_final(FinalUploads {
                document: None,
                page: None,
                task,
            });
            return Finished::default();
        }
        let uploaded = self.upload(&s3, (end, &files.document), task.clone(), deadline);
        let failed = uploaded.is_err();
        // The report page beside the document's object.
        let page = match (&uploaded, files.page.as_deref()) {
            (Ok(_), Some(page)) => Self::upload_page(&s3, page, end, task.clone(), deadline),
            _ => None,
        };
        self.links.set_final(FinalUploads {
            document: Some(uploaded.map(artifact).map_err(|_| ())),
            page: page.map(artifact),
            task,
        });
        Finished { failed }
    }
}

/// An upload as the artifact a tracker registers.
fn artifact(u: UploadedObject) -> Artifact {
    Artifact {
        uri: u.uri,
        size: u.size,
        sha256: u.sha256,
    }
}

/// The document's S3 key: ClearML's artifact layout
/// (`<project>/<task name>.<task id>/…`) once a task is known, else
/// `<run>/…`.
pub(crate) fn object_key(s3: &Uploader, run: &RunInfo, task: Option<TaskRef>) -> String {
    task_object_key(s3, &run.name, task, &super::file_name(&run.labels))
}

/// [`object_key`] for a file name of the caller's.
pub(crate) fn task_object_key(
    s3: &Uploader,
    run: &str,
    task: Option<TaskRef>,
    file: &str,
) -> String {
    let task = task.map(|t| super::TaskKey {
        project: t.project,
        name: t.name,
        id: t.id,
    });
    super::object_key(&s3.dest, run, task.as_ref(), file)
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
