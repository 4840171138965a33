//! The run's document where the job's ClearML task keeps its artifacts,
//! for a run without an S3 destination of memtrack's own: the task's
//! `output_uri`, else `clearml.conf`'s `default_output_uri`, else the
//! ClearML fileserver.

use std::path::Path;

use super::outcome::{Artifact, TaskRef};
use crate::export::s3::run_output::task_object_key as object_key;
use crate::model::RunInfo;

/// The document where the job's ClearML task keeps its artifacts: the
/// task's `output_uri`, else `clearml.conf`'s `default_output_uri`, else
/// the ClearML fileserver ([`super::output`]). An `s3://` destination
/// goes through memtrack's S3 uploader with the `[s3]` settings' limits,
/// the AWS environment's or profile's credentials, else those of
/// `sdk.aws.s3`; the uploader is kept while the destination stays.
pub(crate) struct TaskOutput {
    outputs: super::files::ArtifactStore,
    s3: crate::export::s3::S3Config,
    run: String,
    file: String,
    uploader: Option<(String, crate::export::s3::Uploader)>,
}

/// A failed upload for the job's task: why, and for S3 the uploader (for
/// the command that uploads the file later) with a note on credentials.
pub(crate) struct TaskUploadError {
    pub(crate) why: NotUploaded,
    pub(crate) retry: Option<(crate::export::s3::Uploader, String)>,
    /// The task names no destination and none is configured: no upload
    /// was meant, nothing failed.
    pub(crate) nowhere: bool,
}

/// Why the document is not where the job's task keeps its artifacts; the
/// destination is named as `super::output::shown` shows it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotUploaded {
    #[error("the task has no output_uri, and no default_output_uri or fileserver is configured")]
    Nowhere,
    #[error(transparent)]
    Destination(#[from] super::output::DestinationError),
    #[error("{source} (to {base}, {chosen})")]
    Files {
        base: String,
        chosen: String,
        source: super::files::FileError,
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
    pub(crate) fn new(
        outputs: super::files::ArtifactStore,
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

    pub(crate) async fn upload(
        &mut self,
        document: &Path,
        task: &TaskRef,
    ) -> Result<Artifact, TaskUploadError> {
        use super::output::Destination;
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
                let path = super::FileServer::path(task, &self.file);
                self.outputs
                    .files(&base)
                    .upload(document, &path)
                    .await
                    .map_err(|source| {
                        said(NotUploaded::Files {
                            base: super::output::shown(&base),
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
        task: &TaskRef,
        chosen: &super::output::Chosen,
        target: super::output::S3Destination,
    ) -> Result<Artifact, TaskUploadError> {
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
                            uri: super::output::shown(&chosen.uri),
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
            Ok(u) => Ok(Artifact {
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
                    crate::export::s3::aws::CredentialSource::Given(source) => format!(
                        " (with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set to the key and \
                         secret of {source})"
                    ),
                    _ => String::new(),
                };
                Err(TaskUploadError {
                    nowhere: false,
                    why: NotUploaded::S3 {
                        chosen: chosen.source.clone(),
                        uri: super::output::shown(&chosen.uri),
                        source,
                    },
                    retry: Some((uploader.clone(), note)),
                })
            }
        }
    }
}
