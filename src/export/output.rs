//! The seam every output goes through: HTTP, MLflow, ClearML, S3 and the
//! run's files each implement [`Output`], built from their own settings and
//! registered with one line in the app's list; the top of the program
//! holds that list and names none of them.
//!
//! An output's life: `build` (a constructor of its own, taking its own
//! settings and validating them; off is `Ok(None)`), [`Output::start`]
//! once the I/O runtime runs (it spawns its own task there and returns
//! the [`Feed`] the engine fans entries and checkpoints out to: the engine
//! thread never waits on an output), and [`Output::finish`] once the
//! engine has stopped and the document is written, all outputs sharing
//! one [`Deadline`]. Outputs start in the order of the list and finish in
//! the reverse order, so an output finishes before those it tells things
//! to (S3's final upload before ClearML registers it).
//!
//! Outputs do not reach into each other: what one tells another goes
//! through [`Links`], a board of explicit messages (the task documents
//! are filed under; the uploads a tracker registers as artifacts; the
//! final files, which the files output, listed last and so finishing
//! first, leaves for the outputs that upload them).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::engine::{Checkpoint, Ended, Feed};
use crate::event::inbox::{Input, JobTask};
use crate::export::clearml::outcome::{Artifact, TaskRef};
use crate::export::finish::Deadline;
use crate::model::RunInfo;
use crate::store::snapshot::Snapshot;
use crate::store::Store;

/// One destination of the run's figures and documents.
pub(crate) trait Output: Send {
    /// The name in logs and in `memtrack_export_errors_total{exporter=…}`.
    fn name(&self) -> &'static str;

    /// Whether this output uploads the run's document to a destination of
    /// its own (known before any output starts).
    fn uploads_document(&self) -> bool {
        false
    }

    /// Starts the output's work on the I/O runtime; returns what the
    /// engine feeds it. Called once, before the engine starts.
    fn start(&mut self, ctx: &Start<'_>) -> anyhow::Result<Feed>;

    /// Where this output serves readers (`/metrics`), once started: for
    /// the discovery file and the start line.
    fn serves(&self) -> Option<std::net::SocketAddr> {
        None
    }

    /// Failures so far, published in `/metrics` (`None`: none counted).
    fn errors(&self) -> Option<Arc<AtomicU64>> {
        None
    }

    /// The end of the run, within `deadline` (shared by every output).
    /// Logs what it did, what failed and how to finish later itself.
    fn finish(self: Box<Self>, end: &RunEnd<'_>, deadline: &Deadline) -> Finished;
}

/// What an output starts with.
pub(crate) struct Start<'a> {
    pub(crate) runtime: &'a tokio::runtime::Runtime,
    pub(crate) run: &'a RunInfo,
    pub(crate) run_dir: &'a Path,
    /// The run's document (`memory_usage.json`), rewritten at checkpoints.
    pub(crate) document: &'a Path,
    /// For an output that needs an early checkpoint ([`Input::Checkpoint`]).
    pub(crate) engine: SyncSender<Input>,
    /// Set when memtrack stops: every task an output spawned ends.
    pub(crate) shutdown: watch::Receiver<bool>,
    /// The engine's snapshots (subscribe to read the latest).
    pub(crate) snapshots: &'a watch::Sender<Arc<Snapshot>>,
    /// The socket's notices (pressure), when the socket is served.
    pub(crate) notices: Option<tokio::sync::broadcast::Sender<crate::event::protocol::Notice>>,
    /// Some output uploads the document ([`Output::uploads_document`]).
    pub(crate) document_uploaded: bool,
    /// The job's announcements of its tracker task (the event socket's);
    /// taken by the output that follows them. Left here, it closes once
    /// every output has started, and the socket answers at once.
    pub(crate) job_tasks: Mutex<Option<mpsc::Receiver<JobTask>>>,
    pub(crate) links: Arc<Links>,
}

/// What an output ends with.
pub(crate) struct RunEnd<'a> {
    pub(crate) runtime: &'a tokio::runtime::Runtime,
    pub(crate) ended: &'a Ended,
    pub(crate) store: &'a Store,
    pub(crate) run_dir: &'a Path,
    /// The run's board of messages between outputs, where the files
    /// output leaves the final files ([`RunEnd::files`]).
    pub(crate) links: &'a Links,
    /// The job failed (a run a tracker created ends as failed).
    pub(crate) job_failed: bool,
}

impl RunEnd<'_> {
    /// The run's final files, as the files output left them: it finishes
    /// first. Before it has (or without it), the document counts as not
    /// written, so nothing uploads a file nobody vouched for.
    pub(crate) fn files(&self) -> FinalFiles {
        self.links.files().unwrap_or_else(|| FinalFiles {
            document: self.run_dir.join(crate::model::json::FILE_NAME),
            written: false,
            page: None,
        })
    }
}

/// Where the run's final files are (`export::files`' finish says).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FinalFiles {
    /// The final document: the run directory's, or a fallback.
    pub(crate) document: PathBuf,
    /// Whether the final document was written at all.
    pub(crate) written: bool,
    /// The report page written beside the document.
    pub(crate) page: Option<PathBuf>,
}

/// What an output's end came to.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Finished {
    /// Something the output was meant to do failed (already logged, with
    /// how to finish later): the run counts as an export failure.
    pub(crate) failed: bool,
}

/// Explicit messages between outputs; each side takes its end.
#[derive(Debug, Default)]
pub(crate) struct Links {
    /// The tracker's task, which the document's key follows (ClearML).
    tracker: OnceLock<TaskLink>,
    /// Where uploads of checkpoints go for the tracker to register as its
    /// artifact (only while it reports into the job's own task).
    artifacts: OnceLock<mpsc::UnboundedSender<Uploaded>>,
    /// The final uploads: set by the uploader's finish, read by the
    /// tracker's, which runs after it.
    last: Mutex<Option<FinalUploads>>,
    /// The final files: set by the files output's finish, the first.
    files: OnceLock<FinalFiles>,
}

/// The tracker's task as it becomes known, for outputs that file under it.
#[derive(Debug, Clone)]
pub(crate) struct TaskLink {
    /// The task reported into, once known.
    pub(crate) task: watch::Receiver<Option<TaskRef>>,
    /// The job's own task, once taken up (uploads at checkpoints go there).
    pub(crate) job_task: watch::Receiver<Option<TaskRef>>,
    /// True once the task is known or reporting is off for good.
    pub(crate) settled: watch::Receiver<bool>,
    /// Set at the end of the run: stop waiting for the job's task.
    pub(crate) hurry: watch::Sender<bool>,
    /// The longest the end of the run waits for the task to settle.
    pub(crate) settle_wait: Duration,
    /// What that wait is for, in the line a long wait prints.
    pub(crate) waiting_for: &'static str,
}

/// An upload of the run's document, or why it failed.
pub(crate) type Uploaded = Result<Artifact, Box<dyn std::error::Error + Send + Sync>>;

/// The uploader's final uploads, for the tracker's finish.
#[derive(Debug, Default)]
pub(crate) struct FinalUploads {
    /// The document's upload: `None` when none was tried.
    pub(crate) document: Option<Result<Artifact, ()>>,
    pub(crate) page: Option<Artifact>,
    /// The task the uploads were filed under.
    pub(crate) task: Option<TaskRef>,
}

impl Links {
    /// The tracker publishes its task (once).
    pub(crate) fn publish_task(&self, link: TaskLink) {
        let _ = self.tracker.set(link);
    }

    /// The tracker's task, when a tracker runs.
    pub(crate) fn task(&self) -> Option<&TaskLink> {
        self.tracker.get()
    }

    /// The tracker asks for the uploads at checkpoints.
    pub(crate) fn subscribe_artifacts(&self, tx: mpsc::UnboundedSender<Uploaded>) {
        let _ = self.artifacts.set(tx);
    }

    /// Where uploads at checkpoints go, when a tracker asked for them.
    pub(crate) fn artifacts(&self) -> Option<mpsc::UnboundedSender<Uploaded>> {
        self.artifacts.get().cloned()
    }

    /// The uploader's final uploads.
    pub(crate) fn set_final(&self, last: FinalUploads) {
        if let Ok(mut slot) = self.last.lock() {
            *slot = Some(last);
        }
    }

    /// The files output leaves the final files (once).
    pub(crate) fn set_files(&self, files: FinalFiles) {
        let _ = self.files.set(files);
    }

    /// The final files, once the files output has finished.
    pub(crate) fn files(&self) -> Option<FinalFiles> {
        self.files.get().cloned()
    }

    /// The final uploads, once (`None`: no uploader ran).
    pub(crate) fn take_final(&self) -> Option<FinalUploads> {
        self.last.lock().ok().and_then(|mut slot| slot.take())
    }
}

impl TaskLink {
    /// Waits until the task is known or reporting is off, at most
    /// `settle_wait` and what `deadline` leaves; then the task. Ends a
    /// wait for the job's own task (the tracker creates its own).
    pub(crate) async fn settle(&self, deadline: &Deadline) -> Option<TaskRef> {
        let _ = self.hurry.send(true);
        let wait = self.settle_wait.min(deadline.remaining());
        let mut settled = self.settled.clone();
        let work = async {
            let _ = tokio::time::timeout(wait, settled.wait_for(|s| *s)).await;
        };
        deadline.announce(self.waiting_for, work).await;
        self.task.borrow().clone()
    }
}

/// Waits for the job's task ([`TaskLink::job_task`]) to change; `false`
/// (and no more waiting) once the tracker is gone.
async fn job_task_changed(rx: &mut Option<watch::Receiver<Option<TaskRef>>>) -> bool {
    let Some(r) = rx.as_mut() else {
        return std::future::pending().await;
    };
    if r.changed().await.is_ok() {
        return true;
    }
    *rx = None;
    false
}

/// Whether the tracker reports into the job's own task.
fn job_task_known(rx: &Option<watch::Receiver<Option<TaskRef>>>) -> bool {
    rx.as_ref().is_some_and(|r| r.borrow().is_some())
}

/// A task an output runs beside the engine (uploads at checkpoints),
/// stopped at the end of the run once the work under way is done.
#[derive(Debug)]
pub(crate) struct Background {
    stop: watch::Sender<bool>,
    handle: tokio::task::JoinHandle<()>,
}

impl Background {
    /// Spawns `work`, which ends when the receiver it is given changes.
    pub(crate) fn spawn<F>(
        runtime: &tokio::runtime::Runtime,
        work: impl FnOnce(watch::Receiver<bool>) -> F,
    ) -> Background
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (stop, stopped) = watch::channel(false);
        Background {
            stop,
            handle: runtime.spawn(work(stopped)),
        }
    }

    /// Stops the task, waiting for an upload under way, so that no
    /// checkpoint lands after the final document. Past the deadline the
    /// work under way is abandoned.
    pub(crate) fn stop(self, runtime: &tokio::runtime::Runtime, deadline: &Deadline) {
        let Background { stop, mut handle } = self;
        let _ = stop.send(true);
        let done = runtime.block_on(deadline.bound("a checkpoint upload under way", &mut handle));
        if done.is_none() {
            handle.abort();
        }
    }
}

/// What an uploader at checkpoints waits on: the engine's checkpoints,
/// the job's own task (when it becomes known an early checkpoint is asked
/// of the engine, so the artifact is there long before the job's SDK
/// closes the task), and the end of the run.
pub(crate) struct CheckpointWait {
    checkpoints: watch::Receiver<Checkpoint>,
    job_task: Option<watch::Receiver<Option<TaskRef>>>,
    engine: SyncSender<Input>,
    shutdown: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
}

impl CheckpointWait {
    /// Starts `work` on the runtime, given what it waits on; returns its
    /// handle and the sender the engine signals checkpoints on.
    pub(crate) fn spawn<F>(
        ctx: &Start<'_>,
        job_task: Option<watch::Receiver<Option<TaskRef>>>,
        work: impl FnOnce(CheckpointWait) -> F,
    ) -> (Background, watch::Sender<Checkpoint>)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (tx, checkpoints) = watch::channel(Checkpoint::default());
        let (engine, shutdown) = (ctx.engine.clone(), ctx.shutdown.clone());
        let background = Background::spawn(ctx.runtime, |stop| {
            work(CheckpointWait {
                checkpoints,
                job_task,
                engine,
                shutdown,
                stop,
            })
        });
        (background, tx)
    }

    /// Waits for the next checkpoint; `false` once the run stops. An
    /// upload under way is never cut: stopping waits for it.
    pub(crate) async fn next(&mut self) -> bool {
        loop {
            tokio::select! {
                _ = self.shutdown.changed() => return false,
                _ = self.stop.changed() => return false,
                changed = self.checkpoints.changed() => return changed.is_ok(),
                changed = job_task_changed(&mut self.job_task) => {
                    if changed && job_task_known(&self.job_task) {
                        let _ = self.engine.try_send(Input::Checkpoint);
                    }
                }
            }
        }
    }

    /// The job's own task, once the tracker reports into it.
    pub(crate) fn job_task(&self) -> Option<TaskRef> {
        self.job_task.as_ref().and_then(|t| t.borrow().clone())
    }
}

/// `path` made absolute (for a command printed to be run elsewhere).
pub(crate) fn absolute(path: &Path) -> std::path::PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}
