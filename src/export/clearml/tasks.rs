//! The REST calls on tasks and projects: read or create the task memtrack
//! reports into, register the `memory_usage` artifact, and end a task
//! memtrack created. Each is one async function over [`Api`]; transient
//! failures are retried inside, and a call that creates something looks
//! before it tries again.

use serde_json::{json, Value};

use super::api::{Api, Body, CallError};
use super::outcome::TaskRef;
use super::settings::Settings;
use crate::event::inbox::TaskClose;
use crate::event::protocol::TaskStatus;
use crate::model::RunInfo;

/// The task memtrack reports into, as the setup found or made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TaskCtx {
    pub(crate) task: TaskRef,
    pub(crate) project_id: String,
    /// memtrack created it, so memtrack starts and ends it.
    pub(crate) created: bool,
    /// The job announced it: its own task, on its own iteration axis.
    pub(crate) adopted: bool,
}

/// What an artifact job achieved.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ArtifactRegistered {
    Yes,
    /// The task no longer takes artifacts (its owner closed it).
    Closed(String),
}

/// Why memtrack cannot report into a task (a fatal setup error).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SetupError {
    /// The credentials were refused: the server's own message.
    #[error("{0}")]
    Auth(String),
    #[error("{what}: {source}")]
    Call { what: String, source: CallError },
    #[error("task {id} does not exist on the ClearML server {host}")]
    NoSuchTask { id: String, host: String },
    #[error("task {id} is {status} and locked; memtrack cannot report into it")]
    Locked { id: String, status: String },
}

/// Why a task memtrack created could not be ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StatusError {
    #[error("cannot read task {task} before ending it: {source}")]
    Read { task: String, source: CallError },
    #[error("cannot mark task {task} {status}: {source}")]
    Mark {
        task: String,
        status: &'static str,
        source: CallError,
    },
}

/// A fatal setup error (wrong credentials, locked or unknown task, refused
/// creation); transient ones are retried inside.
pub(crate) async fn setup(api: &Api, s: &Settings, run: &RunInfo) -> Result<TaskCtx, SetupError> {
    match &s.task {
        Some(id) => reuse_task(api, s, id).await,
        None => new_task(api, s, run).await,
    }
}

/// A failed call as a fatal setup error: the credentials' own message, or
/// `what` failed and why.
fn fatal(what: &str, e: CallError) -> SetupError {
    match e {
        CallError::Auth(m) => SetupError::Auth(m),
        source => SetupError::Call {
            what: what.to_string(),
            source,
        },
    }
}

/// Reads the given task `id` (and its project's name); a published task
/// is refused.
async fn reuse_task(api: &Api, s: &Settings, id: &str) -> Result<TaskCtx, SetupError> {
    let data = api
        .call_retrying("tasks.get_by_id", &Body::Json(json!({"task": id})))
        .await
        .map_err(|e| match e {
            CallError::Rejected { subcode: 101, .. } => SetupError::NoSuchTask {
                id: id.to_string(),
                host: api.host().to_string(),
            },
            e => fatal(&format!("cannot read task {id}"), e),
        })?;
    let task = data.get("task").cloned().unwrap_or(Value::Null);
    let status = task.get("status").and_then(Value::as_str).unwrap_or("");
    if status == "published" || status == "publishing" {
        return Err(SetupError::Locked {
            id: id.to_string(),
            status: status.to_string(),
        });
    }
    let name = task
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let project_id = task
        .get("project")
        .and_then(|p| p.as_str().or_else(|| p.get("id").and_then(Value::as_str)))
        .unwrap_or_default()
        .to_string();
    let project = project_name(api, id, &project_id).await?;
    let output_uri = task
        .pointer("/output/destination")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .trim()
        .to_string();
    Ok(TaskCtx {
        task: TaskRef {
            id: id.to_string(),
            name,
            project,
            output_uri,
        },
        project_id,
        // A task an earlier run created and could not end.
        created: s.owns_task && status == "in_progress",
        adopted: false,
    })
}

/// The name of task `id`'s project (empty when it has none or it cannot
/// be read; refused credentials are fatal).
async fn project_name(api: &Api, id: &str, project_id: &str) -> Result<String, SetupError> {
    if project_id.is_empty() {
        return Ok(String::new());
    }
    match api
        .call_retrying(
            "projects.get_by_id",
            &Body::Json(json!({"project": project_id})),
        )
        .await
    {
        Ok(d) => Ok(d
            .pointer("/project/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()),
        Err(CallError::Auth(m)) => Err(SetupError::Auth(m)),
        Err(e) => {
            tracing::warn!("ClearML: cannot read the project of task {id}: {e}");
            Ok(String::new())
        }
    }
}

/// Finds or creates the project, creates the task and starts it.
async fn new_task(api: &Api, s: &Settings, run: &RunInfo) -> Result<TaskCtx, SetupError> {
    let project_id = project_id(api, &s.project)
        .await
        .map_err(|e| fatal(&format!("cannot find or create project `{}`", s.project), e))?;
    let name = if s.task_name.trim().is_empty() {
        run.name.clone()
    } else {
        s.task_name.clone()
    };
    let id = create_task(api, s, run, &name, &project_id)
        .await
        .map_err(|e| fatal(&format!("cannot create task `{name}`"), e))?;
    api.call_retrying("tasks.started", &Body::Json(json!({"task": id})))
        .await
        .map_err(|e| fatal(&format!("cannot start task {id}"), e))?;
    Ok(TaskCtx {
        task: TaskRef {
            id,
            name,
            project: s.project.clone(),
            output_uri: String::new(),
        },
        project_id,
        created: true,
        adopted: false,
    })
}

/// The comment a created task carries: it names the run, so that a
/// creation whose reply was lost is found again instead of repeated.
pub(crate) fn task_comment(run: &RunInfo) -> String {
    format!("memtrack run {} on {}", run.id, run.host)
}

/// `tasks.create`, never repeated blindly: when a try may have reached the
/// server (a timeout, a 504, a 5xx), the task is looked up by its name,
/// project and comment before the next try.
pub(crate) async fn create_task(
    api: &Api,
    s: &Settings,
    run: &RunInfo,
    name: &str,
    project_id: &str,
) -> Result<String, CallError> {
    let comment = task_comment(run);
    let body = Body::Json(json!({
        "name": name,
        "type": s.task_type,
        "project": project_id,
        "comment": comment,
    }));
    let mut delay = s.backoff_min;
    loop {
        match api.call_creating("tasks.create", &body).await {
            Ok(data) => return created_id(&data, "tasks.create"),
            Err(CallError::Transient { .. }) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(s.backoff_max);
                let found = api
                    .call_retrying(
                        "tasks.get_all",
                        &Body::Json(json!({
                            "name": anchored(name),
                            "project": [project_id],
                            "only_fields": ["id", "comment"],
                        })),
                    )
                    .await?;
                let id = found
                    .get("tasks")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .find(|t| t.get("comment").and_then(Value::as_str) == Some(&comment))
                    .and_then(|t| t.get("id"))
                    .and_then(Value::as_str);
                if let Some(id) = id {
                    tracing::info!("ClearML: task `{name}` was created by an unanswered try");
                    return Ok(id.to_string());
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Registers the artifact (`body`); with `check_status`, only while the
/// task is `created` or `in_progress` (a task closed by its owner refuses
/// it, and memtrack never changes the status of a task it did not create).
pub(crate) async fn register_artifact(
    api: &Api,
    task: &str,
    check_status: bool,
    body: Value,
) -> Result<ArtifactRegistered, CallError> {
    if check_status {
        let data = api
            .call_retrying("tasks.get_by_id", &Body::Json(json!({"task": task})))
            .await?;
        let status = data
            .pointer("/task/status")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !matches!(status, "created" | "in_progress") {
            return Ok(ArtifactRegistered::Closed(status.to_string()));
        }
    }
    api.call_retrying("tasks.add_or_update_artifacts", &Body::Json(body))
        .await?;
    Ok(ArtifactRegistered::Yes)
}

/// `^<name>$` with the regex metacharacters escaped.
pub(crate) fn anchored(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 8);
    out.push('^');
    for c in name.chars() {
        if "\\.^$*+?()[]{}|".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('$');
    out
}

pub(crate) async fn project_id(api: &Api, name: &str) -> Result<String, CallError> {
    let lookup = || async {
        let data = api
            .call_retrying(
                "projects.get_all",
                &Body::Json(json!({"name": anchored(name), "only_fields": ["id"]})),
            )
            .await?;
        Ok::<_, CallError>(
            data.get("projects")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(|p| p.get("id"))
                .and_then(Value::as_str)
                .map(str::to_string),
        )
    };
    if let Some(id) = lookup().await? {
        return Ok(id);
    }
    let mut delay = api.backoff().0;
    let created = loop {
        match api
            .call_creating("projects.create", &Body::Json(json!({"name": name})))
            .await
        {
            // The try may have created it: look before trying again.
            Err(CallError::Transient { .. }) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(api.backoff().1);
                if let Some(id) = lookup().await? {
                    return Ok(id);
                }
            }
            other => break other,
        }
    };
    match created {
        Ok(data) => created_id(&data, "projects.create"),
        // Created by someone else meanwhile.
        Err(CallError::Rejected { subcode: 801, .. }) => {
            lookup().await?.ok_or_else(|| CallError::Rejected {
                status: 400,
                subcode: 801,
                message: format!("project `{name}` exists but cannot be found"),
                error_data: Value::Null,
            })
        }
        Err(e) => Err(e),
    }
}

/// The id a `*.create` call answered with; an answer without one is a
/// rejection, not a retry.
fn created_id(data: &Value, call: &str) -> Result<String, CallError> {
    data.get("id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| CallError::Rejected {
            status: 200,
            subcode: 0,
            message: format!("{call} answered without an id"),
            error_data: Value::Null,
        })
}

/// Marks a task memtrack created completed or failed by the job's exit,
/// or the job's task with the status its SDK left to memtrack (`close`),
/// if it is still `in_progress` (someone may have stopped it from the UI).
pub(crate) async fn final_status(
    api: &Api,
    task: &str,
    exit: Option<crate::model::Exit>,
    close: Option<TaskClose>,
) -> Result<String, StatusError> {
    let current = api
        .call_retrying("tasks.get_by_id", &Body::Json(json!({"task": task})))
        .await
        .map_err(|source| StatusError::Read {
            task: task.to_string(),
            source,
        })?;
    let status = current
        .pointer("/task/status")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if status != "in_progress" {
        tracing::info!(
            "ClearML: task {task} is `{status}` (changed outside memtrack); leaving its status"
        );
        return Ok(status);
    }
    let (endpoint, new, reason, message) = match (close, exit) {
        (Some(close), _) => {
            let new = close.status.as_str();
            let message = "set by memtrack for the job's ClearML SDK, after the final \
                           memory_usage artifact"
                .to_string();
            match close.status {
                TaskStatus::Completed => ("tasks.completed", new, new.to_string(), message),
                TaskStatus::Failed => (
                    "tasks.failed",
                    new,
                    close.reason.unwrap_or_else(|| new.to_string()),
                    message,
                ),
                TaskStatus::Stopped => (
                    "tasks.stopped",
                    new,
                    close.reason.unwrap_or_else(|| new.to_string()),
                    message,
                ),
            }
        }
        (None, exit) => exit_status(exit),
    };
    api.call_retrying(
        endpoint,
        &Body::Json(json!({"task": task, "status_reason": reason, "status_message": message})),
    )
    .await
    .map_err(|source| StatusError::Mark {
        task: task.to_string(),
        status: new,
        source,
    })?;
    tracing::info!("ClearML: task {task} marked {new}");
    Ok(new.to_string())
}

/// The endpoint, status, reason and message for a task memtrack created,
/// by how the job ended.
fn exit_status(exit: Option<crate::model::Exit>) -> (&'static str, &'static str, String, String) {
    match exit {
        Some(x) if x.known && x.code == 0 && x.signal.is_none() => (
            "tasks.completed",
            "completed",
            "completed".to_string(),
            "the job exited with status 0".to_string(),
        ),
        Some(x) if x.known => match x.signal {
            Some(sig) => (
                "tasks.failed",
                "failed",
                format!("killed by signal {sig}"),
                format!(
                    "the job was killed by signal {sig} (exit status {})",
                    x.code
                ),
            ),
            None => (
                "tasks.failed",
                "failed",
                format!("exit code {}", x.code),
                format!("the job exited with status {}", x.code),
            ),
        },
        _ => (
            "tasks.failed",
            "failed",
            "exit status unknown".to_string(),
            "memtrack could not learn how the job ended".to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn project_names_are_anchored_and_escaped() {
        assert_eq!(anchored("memtrack"), "^memtrack$");
        assert_eq!(anchored("a.b/c (x)+"), r"^a\.b/c \(x\)\+$");
    }
}
