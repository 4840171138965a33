//! The `[s3]` settings: where `memory_usage.json` goes and how it is sent.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::switch::Switch;
use crate::units::serde_duration;

/// Uploading `memory_usage.json` to S3 / MinIO. Credentials come from the
/// standard AWS chain (environment, profile files, …), never from here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct S3Config {
    /// Destination `s3://bucket/prefix`. Empty: no upload.
    pub(crate) url: String,
    /// Endpoint for MinIO and other S3-compatible stores (else, as the AWS
    /// CLI: `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, the profile's
    /// `endpoint_url`).
    pub(crate) endpoint: String,
    /// Region (else `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's
    /// `region`; else `us-east-1` with a custom endpoint, which MinIO
    /// accepts; else the AWS chain).
    pub(crate) region: String,
    /// `auto` (path-style with a custom endpoint), `true` or `false`.
    pub(crate) path_style: Switch,
    /// Also upload at every checkpoint, not only at the end.
    pub(crate) upload_checkpoints: bool,
    /// Attempts per request, with exponential backoff.
    pub(crate) max_attempts: u32,
    /// Files larger than this go up in parts.
    pub(crate) multipart_threshold_mb: u64,
    pub(crate) part_size_mb: u64,
    /// Per-request timeout.
    #[serde(with = "serde_duration")]
    pub(crate) timeout: Duration,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            url: String::new(),
            endpoint: String::new(),
            region: String::new(),
            path_style: Switch::Auto,
            upload_checkpoints: false,
            max_attempts: 5,
            multipart_threshold_mb: 16,
            part_size_mb: 8,
            timeout: Duration::from_secs(60),
        }
    }
}
