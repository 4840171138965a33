//! The network jobs the reporter runs, one at a time: each builds its
//! request from the state and returns a future its loop polls beside the
//! channels, so a slow server delays only the points, never their intake.

use std::time::Instant;

use serde_json::{json, Value};

use super::api::Body;
use super::machine::Phase;
use super::outcome::{Artifact, TaskEnd};
use super::points;
use super::state::{JobKind, JobOutput, ReporterState, Running};
use super::tasks;
use crate::event::inbox::TaskClose;

/// Largest `events.add_batch` body (the SDK caps at 15 MiB).
const MAX_BATCH_BYTES: usize = 4 << 20;

/// One `events.add_batch` line (docs/clearml.md, "The wire").
#[derive(serde::Serialize)]
struct Wire<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    task: &'a str,
    metric: &'a str,
    variant: &'a str,
    value: f64,
    iter: u64,
    timestamp: i64,
    model_event: bool,
}

impl ReporterState {
    pub(crate) fn setup_job(&self) -> Running {
        let api = self.api.clone();
        let mut settings = self.settings.clone();
        let adopted = self.machine.adopt.is_some();
        if let Some(id) = &self.machine.adopt {
            settings.task = Some(id.clone());
            settings.owns_task = false;
        }
        let run = self.run.clone();
        Running {
            kind: JobKind::Setup,
            fut: Box::pin(async move {
                JobOutput::Setup(tasks::setup(&api, &settings, &run).await.map(|mut ctx| {
                    ctx.adopted = adopted;
                    ctx
                }))
            }),
        }
    }

    /// Reads the job's task's `last_iteration`, the axis memtrack's points
    /// stay on.
    pub(crate) fn axis_job(&mut self, task: &str) -> Running {
        self.last_axis = Instant::now();
        let api = self.api.clone();
        let body = json!({"task": task});
        Running {
            kind: JobKind::Axis,
            fut: Box::pin(async move {
                JobOutput::Axis(
                    api.call_retrying("tasks.get_by_id", &Body::Json(body))
                        .await
                        .map(|d| {
                            d.pointer("/task/last_iteration")
                                .and_then(Value::as_u64)
                                .unwrap_or(0)
                        }),
                )
            }),
        }
    }

    pub(crate) fn batch_job(&mut self) -> Option<Running> {
        let Phase::Ready(t) = &self.machine.phase else {
            return None;
        };
        let task = t.task.id.clone();
        let points = self.queue.take(self.settings.batch_max);
        if points.is_empty() {
            return None;
        }
        let mut body: Vec<u8> = Vec::with_capacity(points.len() * 200);
        let mut used = 0;
        for p in &points {
            let start = body.len();
            let wire = Wire {
                kind: "training_stats_scalar",
                task: &task,
                metric: &p.metric,
                variant: &p.variant,
                value: p.value,
                // Spooled points of older runs may exceed what the server stores.
                iter: p.iter.min(points::MAX_ITER),
                timestamp: p.timestamp,
                model_event: false,
            };
            // Writing into a Vec cannot fail; stop the batch if it ever does.
            if serde_json::to_writer(&mut body, &wire).is_err() {
                body.truncate(start);
                break;
            }
            if used > 0 && body.len() + 1 > MAX_BATCH_BYTES {
                body.truncate(start);
                break;
            }
            body.push(b'\n');
            used += 1;
        }
        let body = String::from_utf8(body).unwrap_or_default();
        let mut points = points;
        if used < points.len() {
            let rest = points.split_off(used);
            self.queue.put_back(rest);
        }
        self.last_send = Instant::now();
        let api = self.api.clone();
        Some(Running {
            kind: JobKind::Batch(points),
            fut: Box::pin(async move {
                JobOutput::Batch(
                    api.call_retrying("events.add_batch", &Body::Lines(body))
                        .await,
                )
            }),
        })
    }

    /// Registers `a` (and the report page beside it, when given) on
    /// `task`; a task memtrack did not create is read first, and left
    /// alone once it no longer takes artifacts.
    pub(crate) fn artifact_job(
        &self,
        task: &str,
        check_status: bool,
        a: &Artifact,
        page: Option<&Artifact>,
    ) -> Running {
        let entry = |key: &str, a: &Artifact, content_type: &str| {
            json!({
                "key": key,
                "type": "custom",
                "mode": "output",
                "uri": a.uri,
                "content_size": a.size,
                "hash": a.sha256.to_ascii_lowercase(),
                "timestamp": points::now_ms() / 1000,
                "type_data": {"content_type": content_type},
            })
        };
        let mut artifacts = vec![entry("memory_usage", a, "application/json")];
        if let Some(p) = page {
            artifacts.push(entry("memory_report", p, "text/html"));
        }
        let body = json!({
            "task": task,
            "force": true,
            "artifacts": artifacts,
        });
        let api = self.api.clone();
        let task = task.to_string();
        Running {
            kind: JobKind::Artifact,
            fut: Box::pin(async move {
                JobOutput::Artifact(tasks::register_artifact(&api, &task, check_status, body).await)
            }),
        }
    }

    /// Sets the task's final status: from the job's exit for a task
    /// memtrack created, or the one the job's SDK left to memtrack.
    pub(crate) fn status_job(
        &self,
        task: &str,
        outcome: &TaskEnd,
        close: Option<TaskClose>,
    ) -> Running {
        let api = self.api.clone();
        let task = task.to_string();
        let exit = outcome.exit;
        Running {
            kind: JobKind::Status,
            fut: Box::pin(async move {
                JobOutput::Status(tasks::final_status(&api, &task, exit, close).await)
            }),
        }
    }

    pub(crate) fn ping_job(&mut self, task: &str) -> Running {
        self.last_ok = Instant::now();
        let api = self.api.clone();
        let body = json!({"task": task});
        Running {
            kind: JobKind::Ping,
            fut: Box::pin(async move {
                JobOutput::Ping(api.call_retrying("tasks.ping", &Body::Json(body)).await)
            }),
        }
    }

    pub(crate) fn refresh_job(&self) -> Running {
        let api = self.api.clone();
        Running {
            kind: JobKind::Refresh,
            fut: Box::pin(async move { JobOutput::Refresh(api.refresh().await) }),
        }
    }
}
