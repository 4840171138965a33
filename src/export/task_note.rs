//! The files a ClearML run leaves in its run directory for later
//! commands: the spool of unsent points, and the note of the task the run
//! reported into.
//!
//! Both ClearML (which writes them, and `memtrack clearml-resend`, which
//! reads them) and the S3 upload (`memtrack upload` puts a file under its
//! task's key) use them, so they live beside both exporters.

use std::path::Path;

/// File name of the spool in the run directory.
pub const SPOOL_FILE: &str = "clearml-spool.jsonl";

/// The task a run reported into, kept beside the spool so that `memtrack
/// clearml-resend` sends the points to the same task.
pub const TASK_FILE: &str = "clearml-task.json";

/// What [`TASK_FILE`] holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TaskFile {
    pub(crate) id: String,
    #[serde(default)]
    pub(crate) name: String,
    #[serde(default)]
    pub(crate) project: String,
    /// memtrack created the task, so memtrack ends it.
    #[serde(default)]
    pub(crate) created: bool,
}

/// Notes `note` in `run_dir`'s [`TASK_FILE`], unless a note is already
/// there (the reporter's, which knows whether memtrack created the task).
/// Best effort: without it a resend or a later upload needs to be told the
/// task.
pub(crate) fn note_unless_present(run_dir: &Path, note: &TaskFile) {
    let path = run_dir.join(TASK_FILE);
    if path.exists() {
        return;
    }
    write(&path, note);
}

/// Writes `note` to `path` (atomically); a failure is logged, not fatal.
pub(crate) fn write(path: &Path, note: &TaskFile) {
    let written = serde_json::to_vec_pretty(note)
        .map_err(std::io::Error::other)
        .and_then(|bytes| {
            crate::model::json::write_atomic(path, &bytes).map_err(std::io::Error::other)
        });
    if let Err(e) = written {
        tracing::warn!("ClearML: cannot note the task in {}: {e}", path.display());
    }
}

/// A task note is a few hundred bytes; a larger file is not one.
const MAX_NOTE_BYTES: u64 = 1 << 20;

/// Reads a [`TASK_FILE`]; `Ok(None)` when there is none.
pub fn read(path: &Path) -> anyhow::Result<Option<TaskFile>> {
    use anyhow::Context;
    let text = match crate::files::read_capped(path, MAX_NOTE_BYTES) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let note = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not a task note", path.display()))?;
    Ok(Some(note))
}
