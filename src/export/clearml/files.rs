//! The artifact on the ClearML fileserver: where a job's task keeps its
//! artifacts when memtrack has no S3 destination. The fileserver takes a
//! multipart POST whose file field is named after the object's path, as
//! the SDK uploads (`clearml/storage/helper.py`, `_HttpDriver`), with the
//! API server's bearer token; the object is then at `<files host>/<path>`.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::api::{Api, PostError};
use super::outcome::{Artifact, TaskRef};

/// Uploads documents to the fileserver of a ClearML setup.
#[derive(Debug, Clone)]
pub struct FileServer {
    api: Api,
    /// `http(s)://host[:port][/path]`, without a trailing `/`.
    base: String,
}

impl FileServer {
    pub(crate) fn new(api: Api, base: &str) -> FileServer {
        FileServer {
            api,
            base: base.trim_end_matches('/').to_string(),
        }
    }

    /// Where the SDK keeps `task`'s artifact `memory_usage`:
    /// `<project>/<task name>.<task id>/artifacts/memory_usage/<file>`.
    pub(crate) fn path(task: &TaskRef, file: &str) -> String {
        let folder = if task.project.is_empty() {
            format!("{}.{}", task.name, task.id)
        } else {
            format!("{}/{}.{}", task.project, task.name, task.id)
        };
        format!("{folder}/artifacts/memory_usage/{file}")
    }

    /// The object's URL: the base and the path, each part percent-encoded.
    pub(crate) fn url(&self, path: &str) -> String {
        let parts: Vec<String> = path.split('/').map(encode).collect();
        format!("{}/{}", self.base, parts.join("/"))
    }

    /// Uploads `document` as `path`; the artifact to register.
    pub(crate) async fn upload(&self, document: &Path, path: &str) -> Result<Artifact, FileError> {
        // A regular file, read to at most the largest document, off the
        // runtime's threads.
        let owned = document.to_path_buf();
        let data = tokio::task::spawn_blocking(move || {
            crate::files::read_capped(&owned, crate::model::json::MAX_DOCUMENT_BYTES)
        })
        .await
        .map_err(|source| FileError::Reader {
            path: document.to_path_buf(),
            source,
        })?
        .map_err(|source| FileError::Read {
            path: document.to_path_buf(),
            source,
        })?;
        let size = data.len() as u64;
        let sha256 = hex(&Sha256::digest(&data));
        let boundary = format!("memtrack-{}", &sha256[..24]);
        let (content_type, body) = multipart(&boundary, path, &data);
        self.api
            .post_upload(&format!("{}/", self.base), &content_type, body)
            .await?;
        Ok(Artifact {
            uri: self.url(path),
            size,
            sha256,
        })
    }
}

/// Why a document did not reach the fileserver.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FileError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// The blocking read's task panicked or was cancelled.
    #[error("cannot read {}: {source}", path.display())]
    Reader {
        path: std::path::PathBuf,
        source: tokio::task::JoinError,
    },
    #[error(transparent)]
    Post(#[from] PostError),
}

/// What the run needs to put the document where the job's task keeps its
/// artifacts: the settings, and the API client a fileserver upload
/// authenticates with.
#[derive(Debug, Clone)]
pub(crate) struct ArtifactStore {
    api: Api,
    files_host: String,
    conf: super::output::OutputConf,
}

impl ArtifactStore {
    pub(crate) fn new(
        api: Api,
        files_host: &str,
        conf: super::output::OutputConf,
    ) -> ArtifactStore {
        ArtifactStore {
            api,
            files_host: files_host.trim_end_matches('/').to_string(),
            conf,
        }
    }

    /// Where `task`'s artifact goes and what chose it; `None`: nowhere
    /// (no output_uri, no default_output_uri, no fileserver).
    pub(crate) fn for_task(
        &self,
        task: &TaskRef,
    ) -> Option<(
        super::output::Chosen,
        Result<super::output::Destination, super::output::DestinationError>,
    )> {
        let chosen = super::output::choose(&task.output_uri, &self.conf, &self.files_host)?;
        let dest = super::output::destination(&chosen, &self.conf);
        Some((chosen, dest))
    }

    /// An uploader to the fileserver (or http store) at `base`.
    pub(crate) fn files(&self, base: &str) -> FileServer {
        FileServer::new(self.api.clone(), base)
    }
}

/// One file field named (and with the file name) `path`.
fn multipart(boundary: &str, path: &str, data: &[u8]) -> (String, Vec<u8>) {
    // Quotes and line breaks cannot stand in a quoted header value.
    let name: String = path
        .chars()
        .map(|c| match c {
            '"' => "%22".to_string(),
            '\r' => "%0D".to_string(),
            '\n' => "%0A".to_string(),
            c => c.to_string(),
        })
        .collect();
    let mut body = Vec::with_capacity(data.len() + 512);
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\n\
             Content-Type: application/json\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(data);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// Percent-encodes one path segment (unreserved characters stay).
fn encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_the_sdks_layout_and_urls_are_encoded() {
        let task = TaskRef {
            id: "abc".into(),
            name: "zero config".into(),
            project: "team/mem".into(),
            output_uri: String::new(),
        };
        let path = FileServer::path(&task, "memory_usage.json");
        assert_eq!(
            path,
            "team/mem/zero config.abc/artifacts/memory_usage/memory_usage.json"
        );
        assert_eq!(encode("zero config.abc"), "zero%20config.abc");
        let (ct, body) = multipart("B", "a\"b/c.json", b"{}");
        assert_eq!(ct, "multipart/form-data; boundary=B");
        let text = String::from_utf8(body).unwrap();
        assert!(text.starts_with("--B\r\nContent-Disposition: form-data; name=\"a%22b/c.json\""));
        assert!(text.ends_with("\r\n\r\n{}\r\n--B--\r\n"), "{text}");
    }
}
