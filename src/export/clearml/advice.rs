//! The run's advice on its ClearML task: appended to the task's
//! description (`comment`, the INFO tab) once the run has ended, with
//! `tasks.edit` (`force`: the task is running or already closed). A
//! description the job or its author wrote is kept; an earlier memtrack
//! advice block in it is replaced, so a task reported into twice shows
//! the latest.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use serde_json::{json, Value};

use super::api::{Api, Body, CallError, ClientError};
use super::Settings;

/// The line that opens memtrack's block in a task's description.
pub(crate) const HEADING: &str = "memtrack advice";

/// The description `old` with the advice `text` (of run `run_id`) as its
/// last block, in place of an earlier one.
pub(crate) fn described(old: &str, run_id: &str, text: &str) -> String {
    let kept = match old.find(&format!("{HEADING} (run ")) {
        Some(at) => old[..at].trim_end(),
        None => old.trim_end(),
    };
    let block = format!("{HEADING} (run {run_id}):\n{}", text.trim_end());
    if kept.is_empty() {
        block
    } else {
        format!("{kept}\n\n{block}")
    }
}

/// Puts the advice on task `task`.
pub(crate) async fn describe(
    settings: &Settings,
    task: &str,
    run_id: &str,
    text: &str,
) -> Result<(), DescribeError> {
    let api = Api::new(settings, Arc::new(AtomicU64::new(0)))?;
    let data = api
        .call_retrying("tasks.get_by_id", &Body::Json(json!({ "task": task })))
        .await
        .map_err(|source| DescribeError::Read {
            task: task.to_string(),
            source,
        })?;
    let old = data
        .pointer("/task/comment")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let comment = described(old, run_id, text);
    api.call_retrying(
        "tasks.edit",
        &Body::Json(json!({ "task": task, "force": true, "comment": comment })),
    )
    .await
    .map_err(|source| DescribeError::Edit {
        task: task.to_string(),
        source,
    })?;
    Ok(())
}

/// Why the advice is not on the task.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DescribeError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("cannot read task {task}: {source}")]
    Read { task: String, source: CallError },
    #[error("cannot edit task {task}: {source}")]
    Edit { task: String, source: CallError },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_is_appended_once_and_replaced_after() {
        let first = described("memtrack run abc on h", "abc", "[info] x: y\n");
        assert_eq!(
            first,
            "memtrack run abc on h\n\nmemtrack advice (run abc):\n[info] x: y"
        );
        let again = described(&first, "def", "[warning] z: w");
        assert_eq!(
            again,
            "memtrack run abc on h\n\nmemtrack advice (run def):\n[warning] z: w"
        );
        assert_eq!(described("", "r", "t"), "memtrack advice (run r):\nt");
    }
}
