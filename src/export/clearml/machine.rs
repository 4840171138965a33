//! The reporter's decisions as a pure state machine: given where it stands
//! and what happened (an announcement, a job's result, the clock's facts),
//! the next state and what to do, with no I/O. The reporter
//! ([`super::reporter`]) feeds it events and does what it answers:
//! starting jobs, moving points in the queue, logging, replying.

use serde_json::Value;

use super::api::CallError;
use super::tasks::{ArtifactRegistered, TaskCtx};
use crate::event::inbox::{JobTaskReply, TaskClose};

/// Distinct problems kept for the final report.
pub(crate) const MAX_ERRORS: usize = 32;

/// Where the reporter stands with the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting for the job to announce its own task (entries are held).
    Waiting,
    /// Logging in and finding or creating the task (retrying as needed).
    Starting,
    Ready(TaskCtx),
    /// Reporting is off (wrong credentials, locked task, …).
    Disabled,
}

/// How the wait for the job's task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decided {
    /// Take up the job's task, on the job's iteration axis.
    Adopt,
    /// Set up memtrack's own (or the given) task.
    Own,
}

/// What to do with the job's announcement of its own task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Announce {
    /// The wait is over: take the task up ([`Machine::decide`]); the reply
    /// waits for the outcome.
    Adopt,
    /// The reply waits for the outcome (setup or first artifact).
    Hold,
    /// Answer at once; `warn`: also worth a (rate-limited) warning.
    Answer { reply: JobTaskReply, warn: bool },
}

/// A network job to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Log in, find or create the task.
    Setup,
    /// Refresh the token.
    Refresh,
    /// Register the latest uploaded checkpoint on the job's task.
    Artifact,
    /// Read the job's task's `last_iteration`.
    Axis,
    /// Send a batch of points.
    Batch,
    /// Keep a created task alive.
    Ping,
}

/// What the clock and the queue say is due, for [`Machine::next_job`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Due {
    pub(crate) refresh: bool,
    pub(crate) artifact_pending: bool,
    pub(crate) axis: bool,
    pub(crate) batch: bool,
    pub(crate) ping: bool,
}

/// What became of a batch.
#[derive(Debug)]
pub(crate) enum BatchVerdict {
    /// The server took it; `refused` points of it were refused (`info`
    /// says why). The batch is settled.
    Stored { refused: u64, info: Value },
    /// The credentials were refused: the points go back, reporting stops.
    Stop(String),
    /// Internal errors, attempt after attempt: the batch is set aside and
    /// tried again at the end.
    SetAside(CallError),
    /// Rejected as a whole: dropped so that later batches go on.
    Dropped(CallError),
}

/// What became of an artifact registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ArtifactVerdict {
    /// Registered; `first`: the first time in this run.
    ArtifactRegistered { first: bool },
    /// The task no longer takes artifacts (`status`).
    Closed { status: String, registered: bool },
    /// The registration failed.
    Failed(String),
}

/// Stages of the end of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndStage {
    Drain,
    Setup,
    Artifact,
    Flush,
    Status,
    Done,
}

/// Where the end of the run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EndProgress {
    pub(crate) stage: EndStage,
    pub(crate) status_started: bool,
    pub(crate) artifact_started: bool,
    /// The points set aside during the run went back into the line.
    pub(crate) aside_restored: bool,
}

impl EndProgress {
    pub(crate) fn new() -> EndProgress {
        EndProgress {
            stage: EndStage::Drain,
            status_started: false,
            artifact_started: false,
            aside_restored: false,
        }
    }
}

impl Default for EndProgress {
    fn default() -> Self {
        EndProgress::new()
    }
}

/// What the end of the run finds now, for [`Machine::end_step`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct EndFacts {
    pub(crate) entries_open: bool,
    pub(crate) drain_passed: bool,
    pub(crate) job_running: bool,
    pub(crate) has_artifact: bool,
    pub(crate) queue_empty: bool,
}

/// One step of the end of the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EndStep {
    /// Nothing to do until something changes.
    Stay,
    /// Move on to this stage.
    Move(EndStage),
    /// Stop waiting for entries (warn when the channel is still open):
    /// close the converter's windows, then [`EndStage::Setup`].
    CloseIntake { still_open: bool },
    /// Put the points set aside back in the line (once).
    RestoreAside,
    /// Register the run's artifact on `task` (reading its status first
    /// when memtrack did not create it).
    StartArtifact { task: String, check_status: bool },
    /// Send the next batch.
    StartBatch,
    /// Set the final status of the task memtrack created, or of the
    /// job's task whose close the job left to memtrack.
    StartStatus { task: String },
}

/// The reporter's decisions and what they leave behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Machine {
    pub(crate) phase: Phase,
    /// The task memtrack was given (config or environment).
    pub(crate) given_task: Option<String>,
    /// `memory_usage.json` will be uploaded, so an adopted task waits for
    /// its first registration before the job is answered.
    pub(crate) artifact_expected: bool,
    /// The job's task to take up (set when announced).
    pub(crate) adopt: Option<String>,
    /// False once the job's task refused artifacts (closed by its owner).
    pub(crate) artifact_open: bool,
    /// The first registration on the job's task was tried (or its upload
    /// failed): announcements can be answered.
    pub(crate) artifact_settled: bool,
    pub(crate) artifact_registered: bool,
    pub(crate) sent: u64,
    pub(crate) refused: u64,
    pub(crate) problems: Vec<String>,
    pub(crate) final_status: Option<String>,
    /// The job's SDK left its task's final status to memtrack, to be set
    /// once the final artifact is registered.
    pub(crate) deferred_close: Option<TaskClose>,
}

impl Machine {
    /// `wait`: wait for the job's own task first.
    pub(crate) fn new(given_task: Option<String>, artifact_expected: bool, wait: bool) -> Machine {
        Machine {
            phase: if wait {
                Phase::Waiting
            } else {
                Phase::Starting
            },
            given_task,
            artifact_expected,
            adopt: None,
            artifact_open: true,
            artifact_settled: false,
            artifact_registered: false,
            sent: 0,
            refused: 0,
            problems: Vec::new(),
            final_status: None,
            deferred_close: None,
        }
    }

    /// Keeps a problem for the final report (distinct ones, a bounded
    /// number).
    pub(crate) fn problem(&mut self, p: String) {
        if self.problems.len() < MAX_ERRORS && !self.problems.contains(&p) {
            self.problems.push(p);
        }
    }

    /// Stops reporting for this run.
    pub(crate) fn disable(&mut self, why: String) {
        self.problem(why);
        self.phase = Phase::Disabled;
    }

    /// Ends the wait for the job's task: take up `adopt`, or (`None`)
    /// set up memtrack's own. `None` when no longer waiting.
    pub(crate) fn decide(&mut self, adopt: Option<String>) -> Option<Decided> {
        if self.phase != Phase::Waiting {
            return None;
        }
        let decided = if adopt.is_some() {
            Decided::Adopt
        } else {
            Decided::Own
        };
        self.adopt = adopt;
        self.phase = Phase::Starting;
        Some(decided)
    }

    /// The job announced its own task `id`. On [`Announce::Adopt`] the
    /// caller takes it up with [`Machine::decide`].
    pub(crate) fn announced(&self, id: &str) -> Announce {
        let refuse = |message: String, warn: bool| Announce::Answer {
            reply: JobTaskReply {
                reporting: false,
                artifact: false,
                deferred: false,
                message,
            },
            warn,
        };
        match &self.phase {
            Phase::Waiting => Announce::Adopt,
            Phase::Starting if self.adopt.as_deref() == Some(id) => Announce::Hold,
            Phase::Ready(ctx) if ctx.task.id == id => {
                if ctx.adopted && self.artifact_expected && !self.artifact_settled {
                    Announce::Hold
                } else {
                    Announce::Answer {
                        reply: JobTaskReply {
                            reporting: true,
                            artifact: self.artifact_registered,
                            deferred: self.deferred_close.is_some(),
                            message: format!("memtrack reports into task {id}"),
                        },
                        warn: false,
                    }
                }
            }
            Phase::Ready(ctx) => refuse(
                format!(
                    "memtrack already reports into task {} ({}); the job's task {id} is left \
                     alone{}",
                    ctx.task.id,
                    if ctx.adopted {
                        "announced earlier"
                    } else if ctx.created {
                        "created after waiting clearml.job_task_wait for the job's own"
                    } else {
                        "given to memtrack"
                    },
                    if ctx.created {
                        "; call Task.init earlier or raise clearml.job_task_wait"
                    } else {
                        ""
                    }
                ),
                true,
            ),
            Phase::Starting => refuse(
                format!(
                    "memtrack is already setting up {}; the job's task {id} is left alone",
                    match (&self.adopt, &self.given_task) {
                        (Some(a), _) => format!("the job's task {a}"),
                        (None, Some(g)) => format!("task {g}"),
                        (None, None) => "a task of its own (clearml.job_task_wait passed)".into(),
                    },
                ),
                true,
            ),
            Phase::Disabled => refuse(self.off_message(), false),
        }
    }

    /// The job's SDK is closing its task `id` with `close`. memtrack takes
    /// the status over when it reports into that task and will register
    /// the final `memory_usage` artifact there: a completed task refuses
    /// the registration, so the record would keep the last checkpoint's
    /// size and hash. Otherwise the SDK sets it, as without memtrack.
    pub(crate) fn close_requested(&mut self, id: &str, close: TaskClose) -> JobTaskReply {
        let refused = |message: String| JobTaskReply {
            reporting: false,
            artifact: false,
            deferred: false,
            message,
        };
        let Phase::Ready(ctx) = &self.phase else {
            return refused(format!(
                "memtrack does not report into task {id}; its SDK sets its status"
            ));
        };
        if ctx.task.id != id || ctx.created {
            return refused(format!(
                "memtrack reports into task {}, not {id}; the SDK sets its status",
                ctx.task.id
            ));
        }
        if !self.artifact_expected || !self.artifact_open {
            return refused(format!(
                "no memory_usage artifact to register on task {id}; the SDK sets its status"
            ));
        }
        let status = close.status.as_str();
        self.deferred_close = Some(close);
        JobTaskReply {
            reporting: true,
            artifact: self.artifact_registered,
            deferred: true,
            message: format!(
                "memtrack marks task {id} {status} once the final memory_usage artifact is \
                 registered"
            ),
        }
    }

    fn off_message(&self) -> String {
        format!(
            "ClearML reporting is off for this run ({})",
            self.problems
                .last()
                .map_or("see memtrack's log", String::as_str)
        )
    }

    /// The answer to announcements held for the outcome; `None` while it
    /// is not known yet.
    pub(crate) fn answer(&self) -> Option<JobTaskReply> {
        let (reporting, message) = match &self.phase {
            Phase::Ready(ctx) if ctx.adopted => {
                if self.artifact_expected && !self.artifact_settled {
                    return None; // not yet: the first registration is under way
                }
                (
                    true,
                    format!(
                        "memtrack reports into task {}{}",
                        ctx.task.id,
                        if self.artifact_registered {
                            " and registered the memory_usage artifact"
                        } else {
                            ""
                        }
                    ),
                )
            }
            Phase::Waiting | Phase::Starting => return None,
            Phase::Ready(ctx) => (
                false,
                format!("memtrack reports into task {} instead", ctx.task.id),
            ),
            Phase::Disabled => (false, self.off_message()),
        };
        Some(JobTaskReply {
            reporting,
            artifact: self.artifact_registered,
            deferred: self.deferred_close.is_some(),
            message,
        })
    }

    /// The next network job, when none is running.
    pub(crate) fn next_job(&self, due: Due) -> Option<Plan> {
        match &self.phase {
            Phase::Waiting | Phase::Disabled => None,
            Phase::Starting => Some(Plan::Setup),
            Phase::Ready(t) => {
                if due.refresh {
                    Some(Plan::Refresh)
                } else if t.adopted && self.artifact_open && due.artifact_pending {
                    // Registered while the job's task still takes it.
                    Some(Plan::Artifact)
                } else if t.adopted && due.axis {
                    Some(Plan::Axis)
                } else if due.batch {
                    Some(Plan::Batch)
                } else if t.created && due.ping {
                    Some(Plan::Ping)
                } else {
                    None
                }
            }
        }
    }

    /// The setup found or made the task.
    pub(crate) fn setup_done(&mut self, ctx: TaskCtx) {
        self.phase = Phase::Ready(ctx);
    }

    /// A batch of `n` points came back.
    pub(crate) fn batch_done(&mut self, n: u64, res: Result<Value, CallError>) -> BatchVerdict {
        match res {
            Ok(data) => {
                let refused = data
                    .get("errors")
                    .and_then(Value::as_u64)
                    .unwrap_or(0)
                    .min(n);
                self.sent += n - refused;
                let mut info = Value::Null;
                if refused > 0 {
                    info = data.get("errors_info").cloned().unwrap_or(Value::Null);
                    self.refused += refused;
                    self.problem(format!("the server refused points: {info}"));
                }
                BatchVerdict::Stored { refused, info }
            }
            Err(CallError::Auth(m)) => BatchVerdict::Stop(m),
            Err(e @ CallError::Transient { .. }) => BatchVerdict::SetAside(e),
            Err(e) => {
                self.refused += n;
                self.problem(format!("a batch of points was refused: {e}"));
                BatchVerdict::Dropped(e)
            }
        }
    }

    /// An artifact registration came back.
    pub(crate) fn artifact_done(
        &mut self,
        res: Result<ArtifactRegistered, CallError>,
    ) -> ArtifactVerdict {
        self.artifact_settled = true;
        match res {
            Ok(ArtifactRegistered::Yes) => {
                let first = !self.artifact_registered;
                self.artifact_registered = true;
                ArtifactVerdict::ArtifactRegistered { first }
            }
            Ok(ArtifactRegistered::Closed(status)) => {
                self.artifact_open = false;
                if !self.artifact_registered {
                    self.problem(format!(
                        "the task was `{status}` before the memory_usage artifact could be \
                         registered"
                    ));
                }
                ArtifactVerdict::Closed {
                    status,
                    registered: self.artifact_registered,
                }
            }
            Err(e) => {
                let m = format!("cannot register the memory_usage artifact: {e}");
                self.problem(m.clone());
                // Answer a waiting job rather than keep it waiting.
                self.artifact_open = false;
                ArtifactVerdict::Failed(m)
            }
        }
    }

    /// The upload of the checkpoint to register failed: the job is
    /// answered without waiting for a registration. `true` the first time.
    pub(crate) fn checkpoint_failed(&mut self, why: &str) -> bool {
        if self.artifact_settled {
            return false;
        }
        self.artifact_settled = true;
        self.problem(format!(
            "the checkpoint to register as the job's task's artifact could not be uploaded: {why}"
        ));
        true
    }

    /// Whether memtrack sets the task's final status (so the end of the
    /// run keeps time for it).
    pub(crate) fn owns_status(&self) -> bool {
        match &self.phase {
            Phase::Waiting => true,
            Phase::Starting => self.given_task.is_none() && self.adopt.is_none(),
            Phase::Ready(t) => t.created || self.deferred_close.is_some(),
            Phase::Disabled => false,
        }
    }

    /// The next step of the end of the run.
    pub(crate) fn end_step(&self, end: &EndProgress, f: EndFacts) -> EndStep {
        match end.stage {
            EndStage::Drain if !f.entries_open || f.drain_passed => EndStep::CloseIntake {
                still_open: f.entries_open,
            },
            EndStage::Drain | EndStage::Done => EndStep::Stay,
            EndStage::Setup => match &self.phase {
                Phase::Waiting | Phase::Starting => EndStep::Stay,
                Phase::Ready(_) => EndStep::Move(EndStage::Artifact),
                Phase::Disabled => EndStep::Move(EndStage::Done),
            },
            EndStage::Artifact => match &self.phase {
                Phase::Ready(t) if f.has_artifact && self.artifact_open => {
                    if !end.artifact_started {
                        if f.job_running {
                            EndStep::Stay
                        } else {
                            EndStep::StartArtifact {
                                task: t.task.id.clone(),
                                check_status: !t.created,
                            }
                        }
                    } else if f.job_running {
                        EndStep::Stay
                    } else {
                        EndStep::Move(EndStage::Flush)
                    }
                }
                _ => EndStep::Move(EndStage::Flush),
            },
            EndStage::Flush => {
                if !end.aside_restored {
                    // One more try for batches the server failed with
                    // internal errors: it may be back.
                    EndStep::RestoreAside
                } else if self.phase == Phase::Disabled {
                    EndStep::Move(EndStage::Done)
                } else if f.job_running {
                    EndStep::Stay
                } else if f.queue_empty {
                    EndStep::Move(EndStage::Status)
                } else {
                    EndStep::StartBatch
                }
            }
            EndStage::Status => {
                if end.status_started {
                    if f.job_running {
                        EndStep::Stay
                    } else {
                        EndStep::Move(EndStage::Done)
                    }
                } else {
                    match &self.phase {
                        Phase::Ready(t) if self.owns_status() && !f.job_running => {
                            EndStep::StartStatus {
                                task: t.task.id.clone(),
                            }
                        }
                        Phase::Ready(_) if self.owns_status() => EndStep::Stay,
                        _ => EndStep::Move(EndStage::Done),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::protocol::TaskStatus;
    use crate::export::clearml::outcome::TaskRef;
    use serde_json::json;

    fn ctx(id: &str, created: bool, adopted: bool) -> TaskCtx {
        TaskCtx {
            task: TaskRef {
                id: id.into(),
                name: "run".into(),
                project: "memtrack".into(),
                output_uri: String::new(),
            },
            project_id: "p1".into(),
            created,
            adopted,
        }
    }

    fn transient() -> CallError {
        CallError::Transient {
            reason: "HTTP 500".into(),
            retry_after: None,
            server_error: true,
            maybe_applied: false,
        }
    }

    fn ready(created: bool, adopted: bool) -> Machine {
        let mut m = Machine::new(None, false, false);
        m.setup_done(ctx("t1", created, adopted));
        m
    }

    fn facts() -> EndFacts {
        EndFacts {
            entries_open: false,
            drain_passed: false,
            job_running: false,
            has_artifact: false,
            queue_empty: true,
        }
    }

    #[test]
    fn the_first_job_sets_up_the_task() {
        let m = Machine::new(None, false, false);
        assert_eq!(m.phase, Phase::Starting);
        assert_eq!(m.next_job(Due::default()), Some(Plan::Setup));
        // Even with points due, nothing is sent before the task is known.
        let due = Due {
            batch: true,
            ..Due::default()
        };
        assert_eq!(m.next_job(due), Some(Plan::Setup));
    }

    #[test]
    fn waiting_for_the_job_task_starts_nothing_until_decided() {
        let mut m = Machine::new(None, false, true);
        assert_eq!(m.phase, Phase::Waiting);
        assert_eq!(m.next_job(Due::default()), None);
        assert_eq!(m.answer(), None);
        assert_eq!(m.decide(None), Some(Decided::Own));
        assert_eq!(m.phase, Phase::Starting);
        assert_eq!(m.adopt, None);
        // Deciding twice does nothing.
        assert_eq!(m.decide(Some("late".into())), None);
        assert_eq!(m.adopt, None);
    }

    #[test]
    fn the_jobs_own_task_from_the_socket_is_adopted() {
        let mut m = Machine::new(None, false, true);
        assert_eq!(m.announced("job-task"), Announce::Adopt);
        assert_eq!(m.decide(Some("job-task".into())), Some(Decided::Adopt));
        assert_eq!(m.adopt.as_deref(), Some("job-task"));
        // A repeat of the same announcement waits for the setup.
        assert_eq!(m.announced("job-task"), Announce::Hold);
        assert_eq!(m.answer(), None);
        m.setup_done(ctx("job-task", false, true));
        let reply = m.answer().unwrap();
        assert!(reply.reporting);
        assert!(!reply.artifact);
        assert_eq!(reply.message, "memtrack reports into task job-task");
        // Memtrack never ends a task it did not create.
        assert!(!m.owns_status());
    }

    #[test]
    fn an_adopted_task_waits_for_its_first_artifact_before_answering() {
        let mut m = Machine::new(None, true, true);
        m.decide(Some("job-task".into()));
        m.setup_done(ctx("job-task", false, true));
        assert_eq!(m.answer(), None);
        assert_eq!(m.announced("job-task"), Announce::Hold);
        let due = Due {
            artifact_pending: true,
            batch: true,
            ..Due::default()
        };
        assert_eq!(m.next_job(due), Some(Plan::Artifact));
        assert_eq!(
            m.artifact_done(Ok(ArtifactRegistered::Yes)),
            ArtifactVerdict::ArtifactRegistered { first: true }
        );
        let reply = m.answer().unwrap();
        assert!(reply.reporting && reply.artifact);
        assert!(reply
            .message
            .ends_with("and registered the memory_usage artifact"));
        assert_eq!(
            m.artifact_done(Ok(ArtifactRegistered::Yes)),
            ArtifactVerdict::ArtifactRegistered { first: false }
        );
    }

    #[test]
    fn another_task_announced_later_is_refused_with_the_reason() {
        let m = ready(true, false);
        match m.announced("other") {
            Announce::Answer { reply, warn } => {
                assert!(warn);
                assert!(!reply.reporting);
                assert!(reply.message.contains("already reports into task t1"));
                assert!(reply.message.contains("the job's task other is left alone"));
                assert!(reply.message.contains("raise clearml.job_task_wait"));
            }
            other => panic!("{other:?}"),
        }
        let given = Machine::new(Some("given".into()), false, false);
        match given.announced("other") {
            Announce::Answer { reply, .. } => {
                assert!(reply.message.contains("setting up task given"), "{reply:?}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_stored_batch_counts_what_the_server_refused() {
        let mut m = ready(true, false);
        let data = json!({"added": 3, "errors": 2, "errors_info": {"bad": 2}});
        match m.batch_done(5, Ok(data)) {
            BatchVerdict::Stored { refused, info } => {
                assert_eq!(refused, 2);
                assert_eq!(info, json!({"bad": 2}));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!((m.sent, m.refused), (3, 2));
        assert_eq!(m.problems.len(), 1);
        // More errors than points cannot count more than the batch.
        m.batch_done(1, Ok(json!({"errors": 9})));
        assert_eq!((m.sent, m.refused), (3, 3));
    }

    #[test]
    fn a_retryable_failure_keeps_the_points_for_later() {
        let mut m = ready(true, false);
        let v = m.batch_done(4, Err(transient()));
        assert!(matches!(v, BatchVerdict::SetAside(_)), "{v:?}");
        assert_eq!((m.sent, m.refused), (0, 0));
        assert!(m.problems.is_empty());
        assert!(matches!(m.phase, Phase::Ready(_)));
        // Reporting goes on with the next batch.
        let due = Due {
            batch: true,
            ..Due::default()
        };
        assert_eq!(m.next_job(due), Some(Plan::Batch));
    }

    #[test]
    fn a_permanent_failure_stops_reporting() {
        let mut m = ready(true, false);
        let v = m.batch_done(4, Err(CallError::Auth("credentials refused".into())));
        let BatchVerdict::Stop(why) = v else {
            panic!("{v:?}");
        };
        m.disable(why);
        assert_eq!(m.phase, Phase::Disabled);
        let due = Due {
            batch: true,
            refresh: true,
            ping: true,
            ..Due::default()
        };
        assert_eq!(m.next_job(due), None);
        let reply = m.answer().unwrap();
        assert!(!reply.reporting);
        assert_eq!(
            reply.message,
            "ClearML reporting is off for this run (credentials refused)"
        );
        // A batch rejected as a whole is dropped and counted, not retried.
        let mut m = ready(true, false);
        let rejected = CallError::Rejected {
            status: 400,
            subcode: 0,
            message: "bad".into(),
            error_data: Value::Null,
        };
        assert!(matches!(
            m.batch_done(7, Err(rejected)),
            BatchVerdict::Dropped(_)
        ));
        assert_eq!(m.refused, 7);
    }

    #[test]
    fn ready_jobs_come_in_order_of_urgency() {
        let created = ready(true, false);
        let all = Due {
            refresh: true,
            artifact_pending: true,
            axis: true,
            batch: true,
            ping: true,
        };
        assert_eq!(created.next_job(all), Some(Plan::Refresh));
        let no_refresh = Due {
            refresh: false,
            ..all
        };
        // A created task has no job axis and no checkpoint artifacts.
        assert_eq!(created.next_job(no_refresh), Some(Plan::Batch));
        let idle = Due {
            ping: true,
            ..Due::default()
        };
        assert_eq!(created.next_job(idle), Some(Plan::Ping));
        let adopted = ready(false, true);
        assert_eq!(adopted.next_job(no_refresh), Some(Plan::Artifact));
        let axis = Due {
            artifact_pending: false,
            ..no_refresh
        };
        assert_eq!(adopted.next_job(axis), Some(Plan::Axis));
        // Only a task memtrack created is pinged.
        assert_eq!(adopted.next_job(idle), None);
    }

    #[test]
    fn closing_flushes_every_point_then_ends_a_created_task() {
        let m = ready(true, false);
        let mut end = EndProgress::new();
        let open = EndFacts {
            entries_open: true,
            ..facts()
        };
        assert_eq!(m.end_step(&end, open), EndStep::Stay);
        assert_eq!(
            m.end_step(&end, facts()),
            EndStep::CloseIntake { still_open: false }
        );
        end.stage = EndStage::Setup;
        assert_eq!(m.end_step(&end, facts()), EndStep::Move(EndStage::Artifact));
        end.stage = EndStage::Artifact;
        assert_eq!(m.end_step(&end, facts()), EndStep::Move(EndStage::Flush));
        end.stage = EndStage::Flush;
        assert_eq!(m.end_step(&end, facts()), EndStep::RestoreAside);
        end.aside_restored = true;
        let queued = EndFacts {
            queue_empty: false,
            ..facts()
        };
        assert_eq!(m.end_step(&end, queued), EndStep::StartBatch);
        let sending = EndFacts {
            job_running: true,
            ..queued
        };
        assert_eq!(m.end_step(&end, sending), EndStep::Stay);
        assert_eq!(m.end_step(&end, facts()), EndStep::Move(EndStage::Status));
        end.stage = EndStage::Status;
        assert_eq!(
            m.end_step(&end, facts()),
            EndStep::StartStatus { task: "t1".into() }
        );
        end.status_started = true;
        assert_eq!(m.end_step(&end, facts()), EndStep::Move(EndStage::Done));
    }

    #[test]
    fn closing_registers_the_artifact_and_leaves_a_given_task_open() {
        let m = ready(false, false);
        let mut end = EndProgress {
            stage: EndStage::Artifact,
            ..EndProgress::new()
        };
        let with = EndFacts {
            has_artifact: true,
            ..facts()
        };
        assert_eq!(
            m.end_step(&end, with),
            EndStep::StartArtifact {
                task: "t1".into(),
                check_status: true
            }
        );
        end.artifact_started = true;
        assert_eq!(m.end_step(&end, with), EndStep::Move(EndStage::Flush));
        end.stage = EndStage::Status;
        assert_eq!(m.end_step(&end, facts()), EndStep::Move(EndStage::Done));
        assert!(!m.owns_status());
    }

    #[test]
    fn the_jobs_close_is_taken_over_only_for_its_task_with_an_artifact_coming() {
        let close = |status| TaskClose {
            status,
            reason: None,
        };
        // No artifact to register: the SDK keeps its close.
        let mut m = ready(false, true);
        let r = m.close_requested("t1", close(TaskStatus::Completed));
        assert!(
            !r.deferred && r.message.contains("no memory_usage artifact"),
            "{r:?}"
        );
        // Another task, or one memtrack created: the SDK keeps it too.
        let mut m = Machine::new(None, true, false);
        m.setup_done(ctx("t1", false, true));
        assert!(
            !m.close_requested("t2", close(TaskStatus::Completed))
                .deferred
        );
        let mut own = Machine::new(None, true, false);
        own.setup_done(ctx("t1", true, false));
        assert!(
            !own.close_requested("t1", close(TaskStatus::Completed))
                .deferred
        );
        // A task that refused artifacts already (closed by its owner).
        let mut shut = Machine::new(None, true, false);
        shut.setup_done(ctx("t1", false, true));
        shut.artifact_open = false;
        assert!(
            !shut
                .close_requested("t1", close(TaskStatus::Completed))
                .deferred
        );
        assert!(!m.owns_status());

        let r = m.close_requested(
            "t1",
            TaskClose {
                status: TaskStatus::Failed,
                reason: Some("Exception boom".into()),
            },
        );
        assert!(r.deferred && r.reporting, "{r:?}");
        assert!(r.message.contains("marks task t1 failed"), "{}", r.message);
        assert!(m.owns_status());
        // The end registers the final artifact (the task is still open),
        // flushes, then sets the status the SDK left.
        let with = EndFacts {
            has_artifact: true,
            ..facts()
        };
        let mut end = EndProgress {
            stage: EndStage::Artifact,
            ..EndProgress::new()
        };
        assert_eq!(
            m.end_step(&end, with),
            EndStep::StartArtifact {
                task: "t1".into(),
                check_status: true
            }
        );
        end.stage = EndStage::Status;
        let running = EndFacts {
            job_running: true,
            ..facts()
        };
        assert_eq!(m.end_step(&end, running), EndStep::Stay);
        assert_eq!(
            m.end_step(&end, facts()),
            EndStep::StartStatus { task: "t1".into() }
        );
    }

    #[test]
    fn closing_while_disabled_keeps_the_points_and_sends_nothing() {
        let mut m = ready(true, false);
        m.disable("task locked".into());
        let mut end = EndProgress {
            stage: EndStage::Setup,
            ..EndProgress::new()
        };
        assert_eq!(m.end_step(&end, facts()), EndStep::Move(EndStage::Done));
        end.stage = EndStage::Flush;
        end.aside_restored = true;
        let queued = EndFacts {
            queue_empty: false,
            ..facts()
        };
        assert_eq!(m.end_step(&end, queued), EndStep::Move(EndStage::Done));
    }

    #[test]
    fn a_closed_job_task_takes_no_more_artifacts() {
        let mut m = ready(false, true);
        let v = m.artifact_done(Ok(ArtifactRegistered::Closed("completed".into())));
        assert_eq!(
            v,
            ArtifactVerdict::Closed {
                status: "completed".into(),
                registered: false
            }
        );
        assert!(!m.artifact_open);
        assert!(m.problems[0].contains("`completed` before the memory_usage artifact"));
        let due = Due {
            artifact_pending: true,
            ..Due::default()
        };
        assert_eq!(m.next_job(due), None);
    }

    #[test]
    fn problems_are_kept_once_and_bounded() {
        let mut m = Machine::new(None, false, false);
        m.problem("same".into());
        m.problem("same".into());
        assert_eq!(m.problems.len(), 1);
        for i in 0..100 {
            m.problem(format!("p{i}"));
        }
        assert_eq!(m.problems.len(), MAX_ERRORS);
        assert!(m.checkpoint_failed("network down"));
        assert!(!m.checkpoint_failed("again"));
    }
}
