//! Which task the points land in (one memtrack creates, or one it is
//! given), that each arrives exactly once, and how the task ends.

use std::time::Duration;

use memtrack::export::clearml::{Artifact, TaskEnd};
use memtrack::model::{Entry, EntryKind, Exit};
use serde_json::json;

use super::live::*;
use super::{Server, SECRET};

#[test]
fn marks_and_timer_windows_arrive_exactly_once_into_a_created_task() {
    let server = Server::start();
    let live = Live::start(settings(&server.url(), SECRET), "it-run");
    let mut exp = Expected::new();
    let t0 = unix_now() - 100.0;
    let mut entries = Vec::new();
    // 3 components × 100 marks; `model` has before/after pairs at the same
    // iteration, so the second of each pair goes to `<field>:after_generate`.
    for i in 0..50u64 {
        let before = entry(
            "model",
            "before_generate",
            t0 + i as f64 * 0.1,
            Some(i),
            1000.0 + i as f64,
        );
        let after = entry(
            "model",
            "after_generate",
            t0 + i as f64 * 0.1 + 0.05,
            Some(i),
            2000.0 + i as f64,
        );
        expect(&mut exp, &before, i, None);
        expect(&mut exp, &after, i, Some("after_generate"));
        entries.push(before);
        entries.push(after);
    }
    for (c, base) in [("data", 3000.0), ("optimizer", 4000.0)] {
        for i in 0..100u64 {
            let e = entry(
                c,
                "step",
                t0 + 5.0 + i as f64 * 0.01,
                Some(i),
                base + i as f64,
            );
            expect(&mut exp, &e, i, None);
            entries.push(e);
        }
    }
    // A third `model` point at iteration 3 whose `:after_generate` series
    // is taken too is dropped (counted, not sent).
    entries.push(entry("model", "after_generate", t0 + 7.0, Some(3), 9999.0));
    // A mark without an iteration takes the run counter (301 entries so
    // far: 0…300), and its NaN figure is skipped.
    let mut odd = entry("system", "checkpoint", t0 + 8.0, None, 5.0);
    odd.figures.gpu_ram_used_mb = f64::NAN;
    expect(&mut exp, &odd, 301, None);
    entries.push(odd);
    // Timer samples every 0.25 s for 5 s, windows of 2 s: three windows,
    // each sent once as its maxima, at the counter values 302, 303, 304.
    let mut windows: Vec<Vec<Entry>> = vec![Vec::new(), Vec::new(), Vec::new()];
    for k in 0..20u64 {
        let ts = t0 + 10.0 + k as f64 * 0.25;
        let v = 500.0 + ((k * 7) % 11) as f64;
        let mut e = entry("system", "timer", ts, None, v);
        e.kind = EntryKind::Timer;
        e.figures.cpu_ram_hwm_mb = 900.0 - k as f64;
        windows[(k / 8) as usize].push(e.clone());
        entries.push(e);
    }
    for (w, iter) in windows.iter().zip(302u64..) {
        let mut max = w[0].clone();
        for e in &w[1..] {
            max.figures.cpu_ram_used_mb =
                max.figures.cpu_ram_used_mb.max(e.figures.cpu_ram_used_mb);
            max.figures.gpu_ram_used_mb =
                max.figures.gpu_ram_used_mb.max(e.figures.gpu_ram_used_mb);
            max.figures.gpu_ram_peak_mb =
                max.figures.gpu_ram_peak_mb.max(e.figures.gpu_ram_peak_mb);
            max.figures.reserved_gpu_ram_mb = max
                .figures
                .reserved_gpu_ram_mb
                .max(e.figures.reserved_gpu_ram_mb);
            max.figures.gpu_process_used_mb = max
                .figures
                .gpu_process_used_mb
                .max(e.figures.gpu_process_used_mb);
            max.figures.cpu_ram_hwm_mb = max.figures.cpu_ram_hwm_mb.max(e.figures.cpu_ram_hwm_mb);
        }
        expect(&mut exp, &max, iter, None);
    }
    for e in entries {
        live.push(e);
    }
    let artifact = Artifact {
        uri: "s3://bucket/runs/it-run/memory_usage.json".into(),
        size: 12345,
        sha256: "ab".repeat(32),
    };
    let (report, errors, _dir) = live.finish(
        TaskEnd {
            exit: Some(Exit::code(0)),
            artifact: Some(artifact),
            page: None,
        },
        Duration::from_secs(20),
    );
    let task = report.task.clone().expect("a task");
    let got = stored(&server.points(&task.id));
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!(report.sent, exp.len() as u64, "{report:?}");
    assert_eq!(
        (
            report.unsent,
            report.duplicates_skipped,
            report.non_finite_skipped,
            report.refused
        ),
        (0, 6, 1, 0),
        "{report:?}"
    );
    assert!(report.errors.is_empty(), "{report:?}");
    assert_eq!(errors, 0);
    assert!(report.spool.is_none());

    // The task: created in the named project, started, completed, with the artifact.
    let state = server.state();
    let t = &state["tasks"][&task.id];
    assert_eq!(t["name"], "it-run");
    assert_eq!(t["type"], "training");
    assert_eq!(t["status"], "completed", "{t}");
    assert_eq!(t["status_reason"], "completed");
    assert!(t["started"].is_string());
    assert_eq!(task.project, "memtrack-it");
    assert_eq!(
        state["projects"][t["project"].as_str().unwrap()]["name"],
        "memtrack-it"
    );
    assert_eq!(t["last_iteration"], 304);
    let a = &t["artifacts"][0];
    assert_eq!(
        (a["key"].as_str(), a["type"].as_str(), a["mode"].as_str()),
        (Some("memory_usage"), Some("custom"), Some("output"))
    );
    assert_eq!(a["uri"], "s3://bucket/runs/it-run/memory_usage.json");
    assert_eq!(a["content_size"], 12345);
    assert_eq!(a["hash"], "ab".repeat(32));
    assert_eq!(a["type_data"]["content_type"], "application/json");
    assert!(report.artifact_registered);
    assert_eq!(report.final_status.as_deref(), Some("completed"));
    assert_eq!(state["logins"], 1);
    server.assert_exactly_once();

    // A second run finds the project instead of creating it again.
    let live = Live::start(settings(&server.url(), SECRET), "it-run-2");
    live.push(entry("model", "x", unix_now(), Some(1), 1.0));
    let (report, _, _dir) = live.finish(exit(3), Duration::from_secs(10));
    let t = &server.state()["tasks"][&report.task.unwrap().id];
    assert_eq!(
        (t["status"].as_str(), t["status_reason"].as_str()),
        (Some("failed"), Some("exit code 3"))
    );
    assert_eq!(server.state()["projects"].as_object().unwrap().len(), 1);
    server.assert_exactly_once();
}

#[test]
fn a_signal_or_unknown_exit_fails_the_created_task() {
    let server = Server::start();
    for (outcome, reason) in [
        (Some(Exit::signal(9)), "killed by signal 9"),
        (None, "exit status unknown"),
    ] {
        let live = Live::start(settings(&server.url(), SECRET), "sig");
        live.push(entry("model", "x", unix_now(), Some(1), 1.0));
        let (report, _, _dir) = live.finish(
            TaskEnd {
                exit: outcome,
                artifact: None,
                page: None,
            },
            Duration::from_secs(10),
        );
        let t = &server.state()["tasks"][&report.task.unwrap().id];
        assert_eq!(
            (t["status"].as_str(), t["status_reason"].as_str()),
            (Some("failed"), Some(reason))
        );
    }
    server.assert_exactly_once();
}

#[test]
fn an_existing_task_gets_points_and_keeps_its_status() {
    let server = Server::start();
    let id = server.task("agent task", "agent-project", "in_progress");
    let mut s = settings(&server.url(), SECRET);
    s.task = Some(id.clone());
    let live = Live::start(s, "ignored-name");
    assert_eq!(live.wait_task(), id);
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..40);
    let (report, _, _dir) = live.finish(
        TaskEnd {
            exit: Some(Exit::code(1)),
            artifact: Some(Artifact {
                uri: "s3://b/k/memory_usage.json".into(),
                size: 7,
                sha256: "cd".repeat(32),
            }),
            page: None,
        },
        Duration::from_secs(10),
    );
    let task = report.task.clone().unwrap();
    assert_eq!(
        (task.name.as_str(), task.project.as_str()),
        ("agent task", "agent-project")
    );
    let got = stored(&server.points(&id));
    assert!(got == exp, "{}", diff(&exp, &got));
    let state = server.state();
    assert_eq!(
        state["tasks"].as_object().unwrap().len(),
        1,
        "no task created"
    );
    let t = &state["tasks"][&id];
    assert_eq!(t["status"], "in_progress", "the agent owns the status");
    assert_eq!(t["artifacts"][0]["key"], "memory_usage");
    assert_eq!(report.final_status, None);
    assert_eq!(
        server.calls_to("tasks.started") + server.calls_to("tasks.failed"),
        0
    );
    assert!(report.errors.is_empty(), "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn a_published_task_is_a_clear_error_not_a_silent_loss() {
    let server = Server::start();
    let id = server.task("done", "p", "published");
    let mut s = settings(&server.url(), SECRET);
    s.task = Some(id.clone());
    let live = Live::start(s, "x");
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..10);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    assert!(
        report.errors[0].contains(&format!(
            "task {id} is published and locked; memtrack cannot report into it"
        )),
        "{report:?}"
    );
    // Kept for a resend into another task, not thrown away.
    assert_eq!(
        (report.sent, report.unsent, report.discarded),
        (0, 60, 0),
        "{report:?}"
    );
    assert!(report.spool.is_some(), "{report:?}");
    assert!(errors >= 1);
    assert!(server.points(&id).is_empty());
    assert_eq!(server.state()["tasks"][&id]["status"], "published");
    assert_eq!(server.calls_to("events.add_batch"), 0);
    server.assert_exactly_once();
}

#[test]
fn iterations_beyond_i64_never_fail_a_batch() {
    let server = Server::start();
    let mut s = settings(&server.url(), SECRET);
    s.timer_every = Duration::ZERO;
    let live = Live::start(s, "huge-iterations");
    let task = live.wait_task();
    let now = unix_now();
    live.push(entry("model", "a", now, Some(u64::MAX), 1.0));
    live.push(entry("model", "b", now + 0.01, Some(3), 2.0));
    let (report, _, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert_eq!(report.unsent, 0, "{report:?}");
    let iters: std::collections::BTreeSet<u64> = server
        .points(&task)
        .iter()
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(iters, [3, i64::MAX as u64].into_iter().collect());
    // The two points may go in one batch or two (the sender may wake
    // between the pushes); none may be refused and sent again.
    let statuses = server.statuses_of("events.add_batch");
    assert!(
        !statuses.is_empty() && statuses.iter().all(|&s| s == 200),
        "no batch failed and was retried: {statuses:?}"
    );
    server.assert_exactly_once();
}

#[test]
fn a_creation_answered_504_is_looked_up_not_repeated() {
    let server = Server::start();
    // The gateway gives up, but the server creates the project and the task.
    for endpoint in ["projects.create", "tasks.create"] {
        server.fault(json!({"status": 504, "count": 1, "endpoint": endpoint, "applied": true}));
    }
    let live = Live::start(settings(&server.url(), SECRET), "gateway-timeout");
    let task = live.wait_task();
    live.push(entry("model", "a", unix_now(), Some(1), 1.0));
    let (report, _, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert!(report.errors.is_empty(), "{report:?}");
    let state = server.state();
    assert_eq!(state["projects"].as_object().unwrap().len(), 1, "{state:#}");
    assert_eq!(state["tasks"].as_object().unwrap().len(), 1, "{state:#}");
    assert_eq!(state["tasks"][&task]["status"], "completed");
    assert_eq!(server.calls_to("tasks.create"), 1, "not repeated");
    assert_eq!(server.calls_to("projects.create"), 1, "not repeated");
    server.assert_exactly_once();
}

#[test]
fn a_creation_refused_with_a_gateway_error_before_the_server_is_tried_again() {
    let server = Server::start();
    // 502/503: the request never reached the server; a 504 that did not
    // take effect either: memtrack looks, finds nothing, and creates once.
    server.fault(json!({"status": 503, "count": 1, "endpoint": "tasks.create"}));
    server.fault(json!({"status": 504, "count": 1, "endpoint": "tasks.create"}));
    let live = Live::start(settings(&server.url(), SECRET), "gateway-refused");
    let task = live.wait_task();
    let (report, _, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert!(report.errors.is_empty(), "{report:?}");
    let state = server.state();
    assert_eq!(state["tasks"].as_object().unwrap().len(), 1, "{state:#}");
    assert_eq!(state["tasks"][&task]["status"], "completed");
    assert_eq!(
        server.calls_to("tasks.get_all"),
        1,
        "looked up once, after the 504"
    );
    server.assert_exactly_once();
}
