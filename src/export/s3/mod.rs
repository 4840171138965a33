//! Uploading `memory_usage.json` to S3 or any S3-compatible store (MinIO),
//! with aws-sdk-s3.
//!
//! The endpoint, region, addressing style and profile are resolved as the
//! AWS CLI resolves them (`aws`): a profile's `endpoint_url` and
//! `region` in `~/.aws/config` work as they do for `aws s3 cp`, and a custom
//! endpoint turns on path-style addressing unless told otherwise.
//! Credentials come from the standard AWS chain (environment, profile files,
//! web identity, instance metadata) and are checked before the first
//! request, so missing ones are reported as such, never as an unreachable
//! server. Every object carries a SHA-256 checksum the server verifies;
//! files above the multipart threshold go up in parts, each with its own
//! checksum. Retries with backoff are the SDK's standard policy with
//! `max_attempts`. A failure never touches the local file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{ChecksumAlgorithm, CompletedMultipartUpload, CompletedPart};
use base64::Engine as _;
use sha2::{Digest, Sha256};

pub(crate) mod aws;
pub(crate) mod run_output;
mod settings;

pub(crate) use settings::S3Config;

/// Where uploads go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BucketPrefix {
    pub(crate) bucket: String,
    /// Key prefix without leading or trailing `/` (may be empty).
    pub(crate) prefix: String,
}

/// Why an upload could not happen, in terms a user can act on. Never
/// contains credentials.
#[derive(Debug, thiserror::Error)]
pub(crate) enum S3Error {
    #[error("`{}` is not an S3 URL like s3://bucket/prefix", shown_url(.0))]
    BadUrl(String),
    #[error(
        "`{}`: an S3 URL carries no credentials (user:password@); the keys come from the \
         environment or the AWS files",
        shown_url(.0)
    )]
    CredentialsInUrl(String),
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("S3 at {endpoint} refused the credentials for bucket `{bucket}`: {code} (credentials from {source_of}; check them){detail}")]
    Credentials {
        endpoint: String,
        bucket: String,
        code: String,
        source_of: String,
        detail: String,
    },
    #[error("no usable AWS credentials for S3 at {endpoint} ({profile}): {cause}")]
    NoCredentials {
        endpoint: String,
        profile: String,
        cause: String,
    },
    #[error("S3 at {endpoint} (bucket `{bucket}`) did not answer within {after} (finish_timeout); gave up")]
    Deadline {
        endpoint: String,
        bucket: String,
        after: String,
    },
    /// A configuration that can never work: reported at once, not
    /// retried.
    #[error("S3 is misconfigured: {0}")]
    Config(String),
    #[error("bucket `{bucket}` does not exist at {endpoint}")]
    NoSuchBucket { endpoint: String, bucket: String },
    #[error(
        "cannot reach S3 at {endpoint} (bucket `{bucket}`) after {attempts} attempts (network): {detail}"
    )]
    Unreachable {
        endpoint: String,
        bucket: String,
        attempts: u32,
        detail: String,
    },
    #[error("S3 at {endpoint} (bucket `{bucket}`) failed: {detail}")]
    Other {
        endpoint: String,
        bucket: String,
        detail: String,
    },
}

/// An S3 URL as messages show it: user information (`user:password@`
/// before the bucket) as `***@`.
fn shown_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

/// Parses `s3://bucket/prefix`.
pub(crate) fn parse_url(url: &str) -> Result<BucketPrefix, S3Error> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| S3Error::BadUrl(url.into()))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.contains('@') {
        return Err(S3Error::CredentialsInUrl(url.into()));
    }
    let valid_bucket = (3..=63).contains(&bucket.len())
        && bucket
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !valid_bucket {
        return Err(S3Error::BadUrl(url.into()));
    }
    Ok(BucketPrefix {
        bucket: bucket.into(),
        prefix: prefix.trim_matches('/').into(),
    })
}

/// A ClearML task the artifact belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TaskKey {
    pub(crate) project: String,
    pub(crate) name: String,
    pub(crate) id: String,
}

/// The artifact's file name: `memory_usage.json`, or with the host and rank
/// when the run is one rank of a multi-node job, so ranks never overwrite
/// each other (`memory_usage.node7.rank3.json`).
pub(crate) fn file_name(labels: &std::collections::BTreeMap<String, String>) -> String {
    let rank = labels.get("rank").or_else(|| labels.get("slurm_nodeid"));
    match (rank, labels.get("host")) {
        (Some(rank), Some(host)) => format!("memory_usage.{}.rank{}.json", safe(host), safe(rank)),
        (Some(rank), None) => format!("memory_usage.rank{}.json", safe(rank)),
        _ => crate::model::json::FILE_NAME.to_string(),
    }
}

fn safe(part: &str) -> String {
    part.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The object key, in the layout ClearML uses for a task's artifacts:
/// `<prefix>/<run>/artifacts/memory_usage/<file>`, or with a ClearML task,
/// `<prefix>/<project>/<task name>.<task id>/artifacts/memory_usage/<file>`.
pub(crate) fn object_key(
    dest: &BucketPrefix,
    run: &str,
    task: Option<&TaskKey>,
    file: &str,
) -> String {
    let folder = match task {
        Some(t) if t.project.is_empty() => format!("{}.{}", t.name, t.id),
        Some(t) => format!("{}/{}.{}", t.project, t.name, t.id),
        None => run.to_string(),
    };
    let mut parts: Vec<&str> = Vec::new();
    if !dest.prefix.is_empty() {
        parts.push(&dest.prefix);
    }
    let tail = format!("{folder}/artifacts/memory_usage/{file}");
    parts.push(&tail);
    parts.join("/")
}

/// The object's content type: the report page is HTML, the rest JSON.
fn content_type(key: &str) -> &'static str {
    if key.ends_with(".html") {
        "text/html; charset=utf-8"
    } else {
        "application/json"
    }
}

/// What was uploaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UploadedObject {
    pub(crate) uri: String,
    pub(crate) size: u64,
    /// Hex SHA-256 of the object (ClearML's artifact `hash`).
    pub(crate) sha256: String,
    pub(crate) parts: usize,
}

/// An S3 client bound to one destination.
#[derive(Debug, Clone)]
pub(crate) struct Uploader {
    client: aws_sdk_s3::Client,
    pub(crate) dest: BucketPrefix,
    /// For messages: the endpoint and where it came from, or
    /// "AWS S3 (`https://s3.REGION.amazonaws.com`)".
    pub(crate) endpoint: String,
    /// What was resolved, for messages and the retry command.
    pub(crate) resolved: aws::Resolved,
    /// The destination as configured (`s3://bucket/prefix`).
    url: String,
    attempts: u32,
    threshold: u64,
    part_size: u64,
    credentials: Option<aws_sdk_s3::config::SharedCredentialsProvider>,
    /// The SDK's first credentials error: some providers say it only once.
    credentials_error: Arc<Mutex<Option<String>>>,
    /// Credentials were had once: later uploads (checkpoints) do not ask
    /// the chain again (an STS or metadata call each); the SDK's own cache
    /// serves them, and a later failure is still classified as credentials.
    credentials_ok: Arc<std::sync::atomic::AtomicBool>,
}

impl Uploader {
    /// Builds the client from `config`, the environment and the AWS
    /// profile files under `$HOME`. Does no I/O beyond reading them.
    pub async fn new(config: &S3Config) -> Result<Uploader, S3Error> {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let resolved = aws::resolve(config, &|v| std::env::var(v).ok(), home.as_deref()).await;
        Uploader::with(config, resolved).await
    }

    /// [`Uploader::new`] with the settings already resolved.
    pub(crate) async fn with(
        config: &S3Config,
        resolved: aws::Resolved,
    ) -> Result<Uploader, S3Error> {
        Uploader::build(config, resolved, None).await
    }

    /// [`Uploader::new`], with `keys` (access key, secret) from `source`
    /// (named in messages, never the keys) when neither the AWS
    /// environment nor the profile gives credentials: theirs win, as the
    /// destination's owner set them for every tool.
    pub(crate) async fn with_keys(
        config: &S3Config,
        keys: Option<(String, String)>,
        source: &str,
    ) -> Result<Uploader, S3Error> {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let mut resolved = aws::resolve(config, &|v| std::env::var(v).ok(), home.as_deref()).await;
        let own = matches!(
            resolved.credentials,
            aws::CredentialSource::Environment | aws::CredentialSource::Profile
        ) || resolved.unknown_profile().is_some();
        let given = match keys {
            Some((key, secret)) if !own => {
                resolved.credentials = aws::CredentialSource::Given(source.to_string());
                Some(aws_sdk_s3::config::Credentials::new(
                    key,
                    secret,
                    None,
                    None,
                    "clearml.conf",
                ))
            }
            _ => None,
        };
        Uploader::build(config, resolved, given).await
    }

    async fn build(
        config: &S3Config,
        resolved: aws::Resolved,
        given: Option<aws_sdk_s3::config::Credentials>,
    ) -> Result<Uploader, S3Error> {
        let dest = parse_url(&config.url)?;
        // A profile file that cannot be read or parsed: what it says is
        // unknown, so nothing is guessed.
        if !resolved.unusable.is_empty() {
            return Err(S3Error::Config(resolved.unusable.join("; ")));
        }
        if let Some(endpoint) = &resolved.endpoint {
            aws::check_endpoint(&endpoint.value).map_err(|why| {
                S3Error::Config(format!("endpoint (from {}): {why}", endpoint.source))
            })?;
        }
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        // The SDK gets the profile files' text as read (capped) here, never
        // the paths: it would read them again without a bound (a FIFO
        // hangs it, `/dev/zero` grows it). The profile name too: it reads
        // AWS_PROFILE itself, not AWS_DEFAULT_PROFILE.
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .http_client(http.clone())
            .profile_files(resolved.profile_files.clone())
            .profile_name(&resolved.profile);
        if let Some(region) = &resolved.region {
            // Known without asking the instance-metadata service.
            loader = loader.region(aws_config::Region::new(region.value.clone()));
        }
        if let Some(endpoint) = &resolved.endpoint {
            loader = loader.endpoint_url(aws::strip_userinfo(&endpoint.value));
        }
        if let Some(given) = given {
            loader = loader.credentials_provider(given);
        } else if !resolved.imds {
            loader = loader.credentials_provider(chain_without_imds(&resolved, http));
        }
        let shared = loader.load().await;
        let mut b = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(resolved.path_style)
            .retry_config(
                aws_config::retry::RetryConfig::standard()
                    .with_max_attempts(config.max_attempts)
                    .with_initial_backoff(Duration::from_millis(200))
                    .with_max_backoff(Duration::from_secs(5)),
            )
            .timeout_config(
                aws_config::timeout::TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .operation_attempt_timeout(config.timeout)
                    .build(),
            );
        let mut resolved = resolved;
        match shared.region() {
            Some(r) if resolved.region.is_none() => {
                resolved.region = Some(aws::Setting {
                    value: r.to_string(),
                    source: "the AWS SDK's chain".into(),
                });
            }
            Some(_) => {}
            None => b = b.region(aws_config::Region::new("us-east-1")),
        }
        if let Some(endpoint) = &resolved.endpoint {
            b = b.endpoint_url(aws::strip_userinfo(&endpoint.value));
        }
        Ok(Uploader {
            credentials: shared.credentials_provider(),
            client: aws_sdk_s3::Client::from_conf(b.build()),
            dest,
            endpoint: resolved.describe_endpoint(),
            resolved,
            url: config.url.clone(),
            attempts: config.max_attempts,
            threshold: config.multipart_threshold_mb << 20,
            part_size: config.part_size_mb << 20,
            credentials_error: Arc::new(Mutex::new(None)),
            credentials_ok: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        })
    }

    /// Why no credentials can be had, if so (checked at start, so a missing
    /// secret is reported before the job runs for hours, and before every
    /// upload, so that it is never reported as a network error).
    pub(crate) async fn credentials_problem(&self) -> Option<String> {
        use aws_sdk_s3::config::ProvideCredentials;
        use std::sync::atomic::Ordering;
        if self.credentials_ok.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(why) = self.resolved.missing_credentials() {
            return Some(why);
        }
        let Some(provider) = &self.credentials else {
            return Some("no credentials provider".into());
        };
        match provider.provide_credentials().await {
            Ok(_) => {
                self.credentials_ok.store(true, Ordering::Relaxed);
                None
            }
            Err(e) => {
                let mut first = self
                    .credentials_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                // What was looked at first, in plain words; the SDK's own
                // text after it.
                Some(
                    first
                        .get_or_insert_with(|| {
                            format!(
                                "no S3 credentials found ({}): {}",
                                self.resolved.looked_in(),
                                chain(&e)
                            )
                        })
                        .clone(),
                )
            }
        }
    }

    async fn check_credentials(&self) -> Result<(), S3Error> {
        match self.credentials_problem().await {
            None => Ok(()),
            Some(cause) => Err(self.no_credentials(cause)),
        }
    }

    fn no_credentials(&self, cause: String) -> S3Error {
        S3Error::NoCredentials {
            endpoint: self.endpoint.clone(),
            profile: self.resolved.describe_profile(),
            cause,
        }
    }

    /// Where the credentials in use come from, for a refusal.
    fn credentials_source(&self) -> String {
        match self.resolved.credentials {
            aws::CredentialSource::Environment => {
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY".to_string()
            }
            aws::CredentialSource::Given(ref source) => source.clone(),
            _ => self.resolved.describe_profile(),
        }
    }

    /// The command that sends `file` later, to the same place: destination,
    /// endpoint, region and addressing style as resolved now, so that it
    /// works as printed in a shell without this run's settings.
    pub(crate) fn retry_command(&self, file: &Path) -> String {
        let mut words: Vec<String> = Vec::new();
        if self.resolved.profile_from != "default" {
            words.push(format!(
                "AWS_PROFILE={}",
                shell_quote(&self.resolved.profile)
            ));
        }
        words.extend(["memtrack".into(), "upload".into()]);
        words.push(shell_quote(&file.display().to_string()));
        words.extend(["--s3-url".into(), shell_quote(&self.url)]);
        if let Some(e) = &self.resolved.endpoint {
            // Without a password it may carry: requests are signed with the
            // AWS keys, the password is never used.
            words.extend([
                "--s3-endpoint".into(),
                shell_quote(&aws::strip_userinfo(&e.value)),
            ]);
        }
        if let Some(r) = &self.resolved.region {
            words.extend(["--s3-region".into(), shell_quote(&r.value)]);
        }
        // `auto` gives path style exactly when an endpoint is set.
        if self.resolved.path_style != self.resolved.endpoint.is_some() {
            words.extend([
                "--s3-path-style".into(),
                self.resolved.path_style.to_string(),
            ]);
        }
        words.join(" ")
    }

    fn error<E, R>(&self, e: aws_sdk_s3::error::SdkError<E, R>) -> S3Error
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: std::fmt::Debug,
    {
        use aws_sdk_s3::error::SdkError;
        let (endpoint, bucket) = (self.endpoint.clone(), self.dest.bucket.clone());
        let network = match &e {
            SdkError::TimeoutError(_) => true,
            SdkError::DispatchFailure(d) => d.is_io() || d.is_timeout(),
            _ => false,
        };
        // The endpoint as configured never appears with its password.
        let text = match &self.resolved.endpoint {
            Some(ep) if ep.value != aws::redact_userinfo(&ep.value) => {
                chain(&e).replace(&ep.value, &aws::redact_userinfo(&ep.value))
            }
            _ => chain(&e),
        };
        if let SdkError::DispatchFailure(d) = &e {
            if d.is_user() {
                // A request that cannot even be built: no retry helps.
                return S3Error::Config(format!("{endpoint} (bucket `{bucket}`): {text}"));
            }
        }
        if !network
            && !matches!(e, SdkError::ServiceError(_))
            && text.to_ascii_lowercase().contains("credential")
        {
            return self.no_credentials(text);
        }
        match &e {
            SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => S3Error::Unreachable {
                endpoint,
                bucket,
                attempts: self.attempts,
                detail: text,
            },
            _ => {
                let code = e.code().unwrap_or_default().to_string();
                let detail = e.message().map(|m| format!(": {m}")).unwrap_or_default();
                match code.as_str() {
                    "SignatureDoesNotMatch"
                    | "InvalidAccessKeyId"
                    | "AccessDenied"
                    | "InvalidToken"
                    | "ExpiredToken" => S3Error::Credentials {
                        endpoint,
                        bucket,
                        code,
                        source_of: self.credentials_source(),
                        detail,
                    },
                    "NoSuchBucket" => S3Error::NoSuchBucket { endpoint, bucket },
                    "" => S3Error::Other {
                        endpoint,
                        bucket,
                        detail: text,
                    },
                    _ => S3Error::Other {
                        endpoint,
                        bucket,
                        detail: format!("{code}{detail}"),
                    },
                }
            }
        }
    }

    /// A missing bucket is a clear error on every store (some S3-compatible
    /// servers create it on the first PutObject instead). A 403 here may
    /// only mean "no ListBucket permission": the upload goes ahead and its
    /// own reply says what is wrong.
    async fn check_bucket(&self) -> Result<(), S3Error> {
        use aws_sdk_s3::error::SdkError;
        match self
            .client
            .head_bucket()
            .bucket(&self.dest.bucket)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(SdkError::ServiceError(e))
                if e.err().is_not_found() || e.raw().status().as_u16() == 404 =>
            {
                Err(S3Error::NoSuchBucket {
                    endpoint: self.endpoint.clone(),
                    bucket: self.dest.bucket.clone(),
                })
            }
            Err(e @ (SdkError::DispatchFailure(_) | SdkError::TimeoutError(_))) => {
                Err(self.error(e))
            }
            Err(_) => Ok(()),
        }
    }

    /// Uploads `path` as `key`; multipart above the threshold.
    pub(crate) async fn upload(&self, path: &Path, key: &str) -> Result<UploadedObject, S3Error> {
        // A regular file, at most the size memtrack's readers accept.
        let owned = path.to_path_buf();
        let bytes = tokio::task::spawn_blocking(move || {
            crate::files::read_capped(&owned, crate::model::json::MAX_DOCUMENT_BYTES)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        .map_err(|source| S3Error::Read {
            path: path.display().to_string(),
            source,
        })?;
        self.check_credentials().await?;
        self.check_bucket().await?;
        let sha256 = hex(&Sha256::digest(&bytes));
        let size = bytes.len() as u64;
        let parts = if size > self.threshold {
            self.multipart(bytes, key).await?
        } else {
            let checksum = b64(&Sha256::digest(&bytes));
            self.client
                .put_object()
                .bucket(&self.dest.bucket)
                .key(key)
                .content_type(content_type(key))
                .checksum_sha256(checksum)
                .body(ByteStream::from(bytes))
                .send()
                .await
                .map_err(|e| self.error(e))?;
            1
        };
        Ok(UploadedObject {
            uri: format!("s3://{}/{key}", self.dest.bucket),
            size,
            sha256,
            parts,
        })
    }

    async fn multipart(&self, bytes: Vec<u8>, key: &str) -> Result<usize, S3Error> {
        let created = self
            .client
            .create_multipart_upload()
            .bucket(&self.dest.bucket)
            .key(key)
            .content_type(content_type(key))
            .checksum_algorithm(ChecksumAlgorithm::Sha256)
            .send()
            .await
            .map_err(|e| self.error(e))?;
        let Some(upload_id) = created.upload_id().map(str::to_string) else {
            return Err(S3Error::Other {
                endpoint: self.endpoint.clone(),
                bucket: self.dest.bucket.clone(),
                detail: "no upload id in the CreateMultipartUpload reply".into(),
            });
        };
        let result = async {
            let mut done = Vec::new();
            for (i, chunk) in bytes.chunks(self.part_size as usize).enumerate() {
                let number = i as i32 + 1;
                let checksum = b64(&Sha256::digest(chunk));
                let part = self
                    .client
                    .upload_part()
                    .bucket(&self.dest.bucket)
                    .key(key)
                    .upload_id(&upload_id)
                    .part_number(number)
                    .checksum_sha256(&checksum)
                    .body(ByteStream::from(chunk.to_vec()))
                    .send()
                    .await
                    .map_err(|e| self.error(e))?;
                done.push(
                    CompletedPart::builder()
                        .part_number(number)
                        .set_e_tag(part.e_tag().map(str::to_string))
                        .checksum_sha256(checksum)
                        .build(),
                );
            }
            let n = done.len();
            self.client
                .complete_multipart_upload()
                .bucket(&self.dest.bucket)
                .key(key)
                .upload_id(&upload_id)
                .multipart_upload(
                    CompletedMultipartUpload::builder()
                        .set_parts(Some(done))
                        .build(),
                )
                .send()
                .await
                .map_err(|e| self.error(e))?;
            Ok(n)
        }
        .await;
        if result.is_err() {
            // Leave no half upload behind (and no storage charges).
            let _ = self
                .client
                .abort_multipart_upload()
                .bucket(&self.dest.bucket)
                .key(key)
                .upload_id(&upload_id)
                .send()
                .await;
        }
        result
    }

    /// Reads an object back (merge from a prefix, tests).
    pub(crate) async fn get(&self, key: &str) -> Result<Vec<u8>, S3Error> {
        let out = self
            .client
            .get_object()
            .bucket(&self.dest.bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| self.error(e))?;
        let body = out.body.collect().await.map_err(|e| S3Error::Other {
            endpoint: self.endpoint.clone(),
            bucket: self.dest.bucket.clone(),
            detail: e.to_string(),
        })?;
        Ok(body.into_bytes().to_vec())
    }

    /// Keys under a prefix (all pages).
    pub(crate) async fn list(&self, prefix: &str) -> Result<Vec<String>, S3Error> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let out = self
                .client
                .list_objects_v2()
                .bucket(&self.dest.bucket)
                .prefix(prefix)
                .set_continuation_token(token.take())
                .send()
                .await
                .map_err(|e| self.error(e))?;
            keys.extend(
                out.contents()
                    .iter()
                    .filter_map(|o| o.key().map(str::to_string)),
            );
            match out.next_continuation_token() {
                Some(t) if out.is_truncated() == Some(true) => token = Some(t.to_string()),
                _ => break,
            }
        }
        Ok(keys)
    }
}

/// The file in a run directory that records where the run uploads, so
/// that `memtrack upload RUN_DIR` needs no `--s3-url` later.
pub(crate) const DESTINATION_FILE: &str = "s3-destination.json";

/// What [`DESTINATION_FILE`] holds: the destination and the endpoint,
/// region and addressing style resolved at the start of the run (the
/// endpoint without any password).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Recorded {
    pub(crate) url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) region: Option<String>,
    #[serde(default)]
    pub(crate) path_style: bool,
    /// The AWS profile, when one was chosen by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) profile: Option<String>,
}

impl Uploader {
    /// Records the destination in `run_dir` ([`DESTINATION_FILE`]). Best
    /// effort: without it a later `memtrack upload` needs `--s3-url`.
    pub(crate) fn record_destination(&self, run_dir: &Path) {
        let r = &self.resolved;
        let recorded = Recorded {
            url: self.url.clone(),
            endpoint: r.endpoint.as_ref().map(|e| aws::strip_userinfo(&e.value)),
            region: r.region.as_ref().map(|e| e.value.clone()),
            path_style: r.path_style,
            profile: (r.profile_from != "default").then(|| r.profile.clone()),
        };
        let path = run_dir.join(DESTINATION_FILE);
        let written = serde_json::to_vec_pretty(&recorded)
            .map_err(anyhow::Error::from)
            .and_then(|b| crate::model::json::write_atomic(&path, &b).map_err(anyhow::Error::from));
        if let Err(e) = written {
            tracing::warn!(
                "cannot record the S3 destination in {}: {e}",
                path.display()
            );
        }
    }
}

/// `config` completed with what the run of `file` recorded
/// ([`DESTINATION_FILE`] beside it) when no destination is given: what is
/// given (`--s3-url`, `--s3-endpoint`, …) wins.
fn with_recorded(config: &S3Config, file: &Path) -> anyhow::Result<S3Config> {
    use anyhow::Context;
    let mut config = config.clone();
    if !config.url.is_empty() {
        return Ok(config);
    }
    let path = file
        .parent()
        .unwrap_or(Path::new("."))
        .join(DESTINATION_FILE);
    let bytes = match crate::files::read_capped(&path, 64 * 1024) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
            "no destination: pass --s3-url s3://bucket/prefix (or set s3.url); the run did not \
             record one ({} is missing: it had no S3 upload configured)",
            path.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let rec: Recorded = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a recorded S3 destination", path.display()))?;
    config.url = rec.url;
    if config.endpoint.is_empty() {
        config.endpoint = rec.endpoint.unwrap_or_default();
    }
    if config.region.is_empty() {
        config.region = rec.region.unwrap_or_default();
    }
    if config.path_style == crate::switch::Switch::Auto {
        config.path_style = if rec.path_style {
            crate::switch::Switch::On
        } else {
            crate::switch::Switch::Off
        };
    }
    tracing::info!(
        "uploading to {}, the destination the run recorded in {}{}",
        config.url,
        path.display(),
        rec.profile
            .map(|p| format!(" (it used AWS profile `{p}`)"))
            .unwrap_or_default()
    );
    Ok(config)
}

/// `memtrack upload FILE`: uploads a document to the key its own run would
/// have used (run name and labels read from the file; a bare file
/// without a run name is named after its directory).
pub fn upload_file(config: &S3Config, file: &Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let config = &with_recorded(config, file)?;
    let doc = crate::model::json::read_document(file)?;
    let run = if doc.run.name.is_empty() {
        file.canonicalize()
            .ok()
            .and_then(|p| {
                p.parent()?
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "run".into())
    } else {
        doc.run.name.clone()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    // A run that reported to ClearML and could not upload left its task
    // noted beside the file: the key follows the task's layout.
    let note_path = file
        .parent()
        .unwrap_or(Path::new("."))
        .join(crate::export::task_note::TASK_FILE);
    let task = crate::export::task_note::read(&note_path)?.map(|t| {
        tracing::info!(
            "the key follows ClearML task {} ({})",
            t.id,
            note_path.display()
        );
        TaskKey {
            project: t.project,
            name: t.name,
            id: t.id,
        }
    });
    runtime.block_on(async {
        let uploader = Uploader::new(config).await?;
        let key = object_key(
            &uploader.dest,
            &run,
            task.as_ref(),
            &file_name(&doc.run.labels),
        );
        let uploaded = uploader.upload(file, &key).await?;
        tracing::info!(
            "uploaded {} ({} bytes, {} part{})",
            uploaded.uri,
            uploaded.size,
            uploaded.parts,
            if uploaded.parts == 1 { "" } else { "s" }
        );
        // The note has served unless ClearML points still wait for it.
        let spool = note_path.with_file_name(crate::export::task_note::SPOOL_FILE);
        if task.is_some() && !spool.exists() {
            let _ = std::fs::remove_file(&note_path);
        }
        Ok(uploaded.uri)
    })
}

/// Every `memory_usage*.json` under an `s3://bucket/prefix/` (for
/// `memtrack merge`), as `(uri, document)`.
pub fn download_documents(
    config: &S3Config,
    url: &str,
) -> anyhow::Result<Vec<(String, crate::model::Document)>> {
    use anyhow::Context;
    let mut config = config.clone();
    config.url = url.to_string();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    runtime.block_on(async {
        let uploader = Uploader::new(&config).await?;
        let prefix = if uploader.dest.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", uploader.dest.prefix)
        };
        let mut docs = Vec::new();
        for key in uploader.list(&prefix).await? {
            let name = key.rsplit('/').next().unwrap_or("");
            if !(name.starts_with("memory_usage") && name.ends_with(".json")) {
                continue;
            }
            let bytes = uploader.get(&key).await?;
            anyhow::ensure!(
                bytes.len() as u64 <= crate::model::json::MAX_DOCUMENT_BYTES,
                "s3://{}/{key} is too large to merge",
                uploader.dest.bucket
            );
            let uri = format!("s3://{}/{key}", uploader.dest.bucket);
            let doc = serde_json::from_slice(&bytes)
                .with_context(|| format!("{uri} is not a memory_usage.json document"))?;
            docs.push((uri, doc));
        }
        anyhow::ensure!(!docs.is_empty(), "no memory_usage*.json under {url}");
        Ok(docs)
    })
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}

/// The SDK's credentials chain less the instance-metadata service
/// (environment, profile, web identity, container), for a custom endpoint
/// or with `AWS_EC2_METADATA_DISABLED`: nothing is ever sent to
/// 169.254.169.254.
fn chain_without_imds(
    resolved: &aws::Resolved,
    http: aws_sdk_s3::config::SharedHttpClient,
) -> aws_config::meta::credentials::CredentialsProviderChain {
    use aws_config::provider_config::ProviderConfig;
    let region = resolved
        .region
        .as_ref()
        .map(|r| aws_config::Region::new(r.value.clone()));
    let conf = ProviderConfig::default()
        .with_http_client(http)
        .with_region(region)
        .with_behavior_version(Some(aws_config::BehaviorVersion::latest()));
    let profile = aws_config::profile::ProfileFileCredentialsProvider::builder()
        .configure(&conf)
        .profile_files(resolved.profile_files.clone())
        .profile_name(&resolved.profile);
    aws_config::meta::credentials::CredentialsProviderChain::first_try(
        "Environment",
        aws_config::environment::EnvironmentVariableCredentialsProvider::new(),
    )
    .or_else("Profile", profile.build())
    .or_else(
        "WebIdentityToken",
        aws_config::web_identity_token::WebIdentityTokenCredentialsProvider::builder()
            .configure(&conf)
            .build(),
    )
    .or_else(
        "EcsContainer",
        aws_config::ecs::EcsCredentialsProvider::builder()
            .configure(&conf)
            .build(),
    )
}

/// `word` as one POSIX shell word.
pub(crate) fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("s3://clearml-artifacts/runs/").unwrap(),
            BucketPrefix {
                bucket: "clearml-artifacts".into(),
                prefix: "runs".into()
            }
        );
        assert_eq!(parse_url("s3://bucket").unwrap().prefix, "");
        for bad in [
            "http://x/y",
            "s3://",
            "s3://Upper/x",
            "s3://ab",
            "s3://-bucket/x",
            "s3://bu_cket",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_follow_the_clearml_layout() {
        let d = parse_url("s3://clearml-artifacts/team").unwrap();
        assert_eq!(
            object_key(&d, "train-1", None, "memory_usage.json"),
            "team/train-1/artifacts/memory_usage/memory_usage.json"
        );
        let t = TaskKey {
            project: "rag".into(),
            name: "smollm".into(),
            id: "abc123".into(),
        };
        assert_eq!(
            object_key(
                &parse_url("s3://b-1").unwrap(),
                "x",
                Some(&t),
                "memory_usage.json"
            ),
            "rag/smollm.abc123/artifacts/memory_usage/memory_usage.json"
        );
    }

    #[test]
    fn shell_words() {
        assert_eq!(
            shell_quote("outputs/a-1/memory_usage.json"),
            "outputs/a-1/memory_usage.json"
        );
        assert_eq!(shell_quote("http://h:9000"), "http://h:9000");
        assert_eq!(shell_quote("my run"), "'my run'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$(rm -rf ~)"), "'$(rm -rf ~)'");
    }

    #[test]
    fn the_retry_command_carries_what_was_resolved() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let config = S3Config {
            url: "s3://b-1/team".into(),
            ..S3Config::default()
        };
        let env = |k: &str| (k == "AWS_PROFILE").then(|| "minio".to_string());
        let resolved = aws::resolve_texts(
            &config,
            &env,
            "[profile minio]\nendpoint_url = http://minio:9000\nregion = eu-west-3\n",
            "",
        );
        let up = runtime.block_on(Uploader::with(&config, resolved)).unwrap();
        assert_eq!(
            up.retry_command(Path::new("/data/out/my run/memory_usage.json")),
            "AWS_PROFILE=minio memtrack upload '/data/out/my run/memory_usage.json' \
             --s3-url s3://b-1/team --s3-endpoint http://minio:9000 --s3-region eu-west-3"
        );
        assert!(
            up.endpoint.contains("http://minio:9000") && up.endpoint.contains("profile `minio`")
        );
        // Path style turned off against the endpoint's default is carried too.
        let config = S3Config {
            path_style: crate::switch::Switch::Off,
            endpoint: "http://minio:9000".into(),
            ..config
        };
        let resolved = aws::resolve_texts(&config, &|_| None, "", "");
        let up = runtime.block_on(Uploader::with(&config, resolved)).unwrap();
        assert!(
            up.retry_command(Path::new("/f.json")).ends_with(
                "--s3-endpoint http://minio:9000 --s3-region us-east-1 --s3-path-style false"
            ),
            "{}",
            up.retry_command(Path::new("/f.json"))
        );
    }

    #[test]
    fn ranks_never_share_a_file_name() {
        let mut labels = std::collections::BTreeMap::new();
        labels.insert("host".to_string(), "node7".to_string());
        assert_eq!(file_name(&labels), "memory_usage.json");
        labels.insert("rank".to_string(), "3".to_string());
        assert_eq!(file_name(&labels), "memory_usage.node7.rank3.json");
        labels.insert("host".to_string(), "a/b".to_string());
        assert_eq!(file_name(&labels), "memory_usage.a_b.rank3.json");
    }
}
