//! `memtrack run` with ClearML configured the way clearml-agent leaves it
//! (environment only): the task it creates or is given, its name, project
//! and status, the S3 artifact and the advice.

use std::path::Path;
use std::time::Duration;

use memtrack::export::clearml::SPOOL_FILE;
use serde_json::Value;

use super::{agent_run, clearml_env, write_clearml_conf, Server, SECRET};
use crate::common::*;

#[test]
fn memtrack_run_creates_completes_and_fills_a_task_with_the_s3_artifact() {
    let server = Server::start();
    let s3 = S3Server::start();
    let out = scratch();
    let job = python(
        "import os, socket, json\n\
         s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])\n\
         f = s.makefile('rw')\n\
         for i in range(3):\n\
         \x20   f.write(json.dumps({'type': 'mark', 'component': 'model', 'operation': 'step', 'iteration': i, 'ack': True}) + '\\n'); f.flush(); f.readline()\n",
    );
    let res = agent_run(&server, out.path())
        .args(["--clearml-project", "team/memory"])
        .s3(&s3)
        .run(job, Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let state = server.state();
    let tasks: Vec<&Value> = state["tasks"].as_object().unwrap().values().collect();
    assert_eq!(tasks.len(), 1, "one task: {state:#}");
    let task = tasks[0];
    assert_eq!(task["name"], "job");
    assert_eq!(task["status"], "completed", "{task:#}");
    let project = &state["projects"][task["project"].as_str().unwrap()];
    assert_eq!(project["name"], "team/memory");

    // Each mark's figures arrived once, at the job's own iteration.
    let points = server.points(task["id"].as_str().unwrap());
    let rss: Vec<u64> = points
        .iter()
        .filter(|p| p["metric"] == "memory/model" && p["variant"] == "cpu_ram_used_mb")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(rss, vec![0, 1, 2], "{points:#?}");

    // The artifact: the object at ClearML's key layout, byte for byte.
    let key = format!(
        "runs/team/memory/job.{}/artifacts/memory_usage/memory_usage.json",
        task["id"].as_str().unwrap()
    );
    let local = std::fs::read(out.path().join("job/memory_usage.json")).unwrap();
    assert_eq!(s3.object(&key).as_deref(), Some(local.as_slice()), "{log}");
    // The report page beside it, registered as the task's second artifact.
    let page_key = key.replace("memory_usage.json", "memory_report.html");
    let page = std::fs::read(out.path().join("job/memory_report.html")).unwrap();
    assert_eq!(
        s3.object(&page_key).as_deref(),
        Some(page.as_slice()),
        "{log}"
    );
    let artifacts = task["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 2, "{task:#}");
    let named = |k: &str| {
        artifacts
            .iter()
            .find(|a| a["key"] == k)
            .unwrap_or_else(|| panic!("no {k} artifact: {task:#}"))
    };
    assert_eq!(
        named("memory_usage")["uri"],
        format!("s3://{}/{key}", s3.bucket),
        "{task:#}"
    );
    assert_eq!(
        named("memory_report")["uri"],
        format!("s3://{}/{page_key}", s3.bucket),
        "{task:#}"
    );
    assert_eq!(
        named("memory_report")["type_data"]["content_type"],
        "text/html"
    );
    assert!(!out.path().join("job").join(SPOOL_FILE).exists());
    server.assert_exactly_once();
}

#[test]
fn memtrack_run_fails_the_task_of_a_failed_job_and_keeps_its_status() {
    let server = Server::start();
    let out = scratch();
    let res = agent_run(&server, out.path())
        .run(["sh", "-c", "sleep 0.2; exit 3"], Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(3), "{}", stderr(&res));
    let state = server.state();
    let task = state["tasks"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .clone();
    assert_eq!(task["status"], "failed", "{task:#}");
    server.assert_exactly_once();
}

#[test]
fn memtrack_run_reports_into_the_agents_task_without_touching_its_status() {
    let server = Server::start();
    let id = server.task("agent task", "agents", "in_progress");
    let out = scratch();
    let res = agent_run(&server, out.path())
        .env("CLEARML_TASK_ID", &id)
        .run(["sh", "-c", "sleep 0.3"], Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let state = server.state();
    assert_eq!(
        state["tasks"].as_object().unwrap().len(),
        1,
        "no task created"
    );
    assert_eq!(state["tasks"][&id]["status"], "in_progress");
    assert!(
        server
            .points(&id)
            .iter()
            .any(|p| p["metric"] == "memory/system"),
        "timer samples reach the agent's task"
    );
    server.assert_exactly_once();
}

#[test]
fn a_project_name_is_looked_up_as_the_server_stores_it() {
    let server = Server::start();
    // The project exists, stored tidied (as the server stores `team / mem`).
    let existing = server.task("earlier run", "team/mem", "completed");
    let out = scratch();
    let res = agent_run(&server, out.path())
        .args(["--clearml-project", " team /  mem// "])
        .run(["sh", "-c", "sleep 0.2"], Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let state = server.state();
    assert_eq!(state["projects"].as_object().unwrap().len(), 1, "{state:#}");
    assert_eq!(server.calls_to("projects.create"), 0);
    let project = state["tasks"][&existing]["project"].clone();
    let mine: Vec<&Value> = state["tasks"]
        .as_object()
        .unwrap()
        .values()
        .filter(|t| t["name"] == "job")
        .collect();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0]["project"], project);
    server.assert_exactly_once();
}

/// A job that leaves a file behind, to tell whether it ran.
fn marker_job(dir: &Path) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!("touch {}", dir.join("ran").display()),
    ]
}

/// Names and types the server would refuse are adapted for ClearML only
/// and said in one warning: the job always starts.
#[test]
fn short_names_and_unknown_task_types_are_adapted_and_the_job_starts() {
    let server = Server::start();
    for (args, env, said, task_name) in [
        (
            vec!["--clearml-project", " ab "],
            vec![],
            "clearml.project `ab` → `ab_`",
            "",
        ),
        (
            vec!["--clearml-project", "/ a /"],
            vec![],
            "clearml.project `a` → `a__`",
            "",
        ),
        (
            vec!["--name", "xy"],
            vec![],
            "the run name `xy` → task `xy_`",
            "xy_",
        ),
        (
            vec![],
            vec![("MEMTRACK_CLEARML_TASK_NAME", " t ".to_string())],
            "clearml.task_name `t` → `t__`",
            "t__",
        ),
        (
            vec![],
            vec![("MEMTRACK_CLEARML_TASK_TYPE", "trainer".to_string())],
            "clearml.task_type `trainer`",
            "",
        ),
    ] {
        let out = scratch();
        let job = marker_job(out.path());
        let mut cmd = memtrack();
        cmd.args(["run", "--listen", "off", "--output"])
            .arg(out.path())
            .args(&args)
            .arg("--")
            .args(&job);
        clearml_env(&mut cmd, out.path(), Some((&server.url(), SECRET)));
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let res = run_to_end(&mut cmd, Duration::from_secs(60));
        let log = stderr(&res);
        assert_eq!(res.status.code(), Some(0), "{args:?} {env:?}: {log}");
        assert!(out.path().join("ran").exists(), "the job must start: {log}");
        let warnings: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("ClearML refuses names"))
            .collect();
        assert_eq!(warnings.len(), 1, "said once: {log}");
        assert!(warnings[0].contains(said), "{args:?}: {log}");
        if !task_name.is_empty() {
            let state = server.state();
            assert!(
                state["tasks"]
                    .as_object()
                    .unwrap()
                    .values()
                    .any(|t| t["name"] == task_name),
                "{state:#}"
            );
        }
    }
    server.assert_no_violations();

    // With only the SDK's clearml.conf (no trigger), a two-letter run name
    // starts the job too: memtrack creates no task then, so nothing is
    // renamed and nothing said.
    let home = scratch();
    write_clearml_conf(home.path(), &server, "http://127.0.0.1:9");
    let out = scratch();
    let job = marker_job(out.path());
    let res = run_to_end(
        clearml_env(
            memtrack()
                .args(["run", "--listen", "off", "--name", "xy", "--output"])
                .arg(out.path())
                .arg("--")
                .args(&job),
            home.path(),
            None,
        ),
        Duration::from_secs(60),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    assert!(out.path().join("ran").exists(), "the job must start: {log}");
    assert!(out.path().join("xy/memory_usage.json").exists(), "{log}");
}

#[test]
fn the_runs_advice_is_appended_to_its_tasks_description() {
    let server = Server::start();
    let out = scratch();
    // 200 MiB held in a reference cycle, which only the cleanup call's
    // gc.collect() frees: `cleanup-helps`.
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    let job = python(
        "import gc, memtrack\n\
         gc.disable()\n\
         class Holder: pass\n\
         h = Holder(); h.me = h; h.b = bytearray(200 << 20)\n\
         for i in range(0, len(h.b), 4096): h.b[i] = 1\n\
         memtrack.mark('train', 'epoch', ack=True)\n\
         del h\n\
         memtrack.clear_memory('train')\n\
         memtrack.mark('train', 'done', ack=True)\n",
    );
    let res = agent_run(&server, out.path())
        .args(["--clearml-project", "team/memory", "--no-gpu"])
        .env("PYTHONPATH", &client)
        .run(job, Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let doc = read_document(&out.path().join("job/memory_usage.json"));
    assert!(
        doc.advice.iter().any(|a| a.code == "cleanup-helps"),
        "{:#?}\n{log}",
        doc.advice
    );
    let state = server.state();
    let task = state["tasks"].as_object().unwrap().values().next().unwrap();
    let comment = task["comment"].as_str().unwrap_or_default();
    let run_line = format!("memtrack run {} on {}", doc.run.id, doc.run.host);
    assert!(
        comment.starts_with(&format!(
            "{run_line}\n\nmemtrack advice (run {}):\n",
            doc.run.id
        )),
        "the description keeps its first line and gains the advice: {comment:?}\n{log}"
    );
    assert!(comment.contains("[info] cleanup-helps: "), "{comment:?}");
    assert_eq!(task["status"], "completed", "{task:#}");
    server.assert_exactly_once();
}
