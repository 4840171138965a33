//! The job's SDK closing its own task, left to memtrack: the SDK completes
//! its task at the job's exit, before memtrack's final upload, and a
//! completed task refuses the artifact's registration. When memtrack will
//! register the final file there, it takes the status over and sets it
//! afterwards (`Machine::close_requested`, then the end's status step).

use tokio::sync::oneshot;

use super::outcome::TaskRef;
use super::state::ReporterState;
use crate::event::inbox::{JobTaskReply, TaskClose};

impl ReporterState {
    /// The job's SDK offers the close of task `id`: taken over or not, the
    /// answer goes back at once.
    pub(super) fn close_offered(
        &mut self,
        id: &str,
        close: TaskClose,
        reply: Option<oneshot::Sender<JobTaskReply>>,
    ) {
        let status = close.status.as_str();
        let answer = self.machine.close_requested(id, close);
        if answer.deferred {
            tracing::info!(
                "ClearML: the job's SDK closes task {id} as {status}; memtrack sets that status \
                 after the final memory_usage artifact"
            );
        } else {
            tracing::debug!("ClearML: {}", answer.message);
        }
        if let Some(r) = reply {
            let _ = r.send(answer);
        }
    }

    /// At the end: a close taken over and not carried out leaves the
    /// job's task `in_progress`, which the log and the report say.
    pub(super) fn say_close_left_undone(&mut self, task: Option<&TaskRef>) {
        let (Some(close), None) = (&self.machine.deferred_close, &self.machine.final_status) else {
            return;
        };
        let m = format!(
            "the job's task{} stays in_progress: its SDK left the status ({}) to memtrack, which \
             could not set it; set it in the ClearML web UI (the server stops a task silent for \
             2 hours)",
            task.map_or(String::new(), |t| format!(" {}", t.id)),
            close.status.as_str()
        );
        tracing::error!("ClearML: {m}");
        self.machine.problem(m);
    }
}
