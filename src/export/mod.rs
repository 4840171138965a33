//! What leaves memtrack. Exporters read the store's output; none of them
//! ever calls a sampler.

pub mod clearml;
pub(crate) mod files;
pub(crate) mod finish;
pub mod http;
pub(crate) mod http_output;
pub mod mlflow;
pub(crate) mod output;
pub(crate) mod peer;
pub mod prometheus;
pub(crate) mod reached;
pub mod s3;
pub mod task_note;
