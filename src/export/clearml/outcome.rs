//! What the reporter and the app tell each other: the task memtrack
//! reports into, how the run ended (for the task's final status and its
//! artifact), and what the end of the run achieved.

use std::path::{Path, PathBuf};

use crate::export::task_note::{self, TaskFile};

/// The task memtrack reports into.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskRef {
    pub id: String,
    pub name: String,
    /// The project's name (empty when the task has none).
    pub project: String,
    /// Where the task keeps its artifacts (`output.destination`, set by
    /// `Task.init(output_uri=...)`); empty when not set or not read.
    pub output_uri: String,
}

/// How the run ended, for the task's final status and its artifact.
#[derive(Debug, Clone, Default)]
pub struct TaskEnd {
    pub exit: Option<crate::model::Exit>,
    pub artifact: Option<Artifact>,
    /// The run's report page where it was uploaded, registered beside
    /// the document as the `memory_report` artifact.
    pub page: Option<Artifact>,
}

/// `memory_usage.json` where it was uploaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub uri: String,
    pub size: u64,
    /// Lowercase hex.
    pub sha256: String,
}

/// What the end of the run achieved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FinishReport {
    /// Nothing was meant to be reported (only a task the job announces
    /// would do, and it announced none): why, in words. Not a failure.
    pub(crate) stood_down: Option<String>,
    /// Points the server stored.
    pub sent: u64,
    /// Points left in the spool file ([`FinishReport::spool`]).
    pub unsent: u64,
    /// Points dropped because their (title, series, iteration) was taken.
    pub duplicates_skipped: u64,
    /// Points dropped because a value was NaN or infinite.
    pub non_finite_skipped: u64,
    /// Points refused by the server (partial errors, rejected batches).
    pub refused: u64,
    /// Points lost because the spool file could not be written.
    pub discarded: u64,
    /// Every problem, in words (no secrets).
    pub errors: Vec<String>,
    pub task: Option<TaskRef>,
    /// The spool file, when points stayed unsent.
    pub spool: Option<PathBuf>,
    /// Whether the artifact was registered on the task.
    pub artifact_registered: bool,
    /// The final status memtrack gave the task it created
    /// (`completed`/`failed`), if any.
    pub final_status: Option<String>,
}

impl TaskRef {
    /// The note a later `clearml-resend` or upload reads.
    pub(crate) fn note(&self, created: bool) -> TaskFile {
        TaskFile {
            id: self.id.clone(),
            name: self.name.clone(),
            project: self.project.clone(),
            created,
        }
    }
}

/// Notes `task` in `run_dir`'s task file, unless a note is already there
/// (the reporter's, which knows whether memtrack created the task). Best
/// effort: without it a resend or a later upload needs to be told the task.
pub(crate) fn note_task(run_dir: &Path, task: &TaskRef, created: bool) {
    task_note::note_unless_present(run_dir, &task.note(created));
}
