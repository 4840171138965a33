//! After a run that could not deliver: `memtrack clearml-resend` sends
//! what the spool kept into the run's task and ends it; `memtrack upload`
//! uses the task's key.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use memtrack::export::clearml::SPOOL_FILE;
use serde_json::{json, Value};

use super::{agent_run, clearml_env, Server, SECRET};
use crate::common::*;

/// `memtrack clearml-resend DIR` with the credentials ClearML users have.
fn resend(server: &Server, dir: &Path, secret: &str) -> std::process::Output {
    run_to_end(
        clearml_env(
            memtrack()
                .args(["clearml-resend", "--timeout", "30s"])
                .arg(dir),
            dir,
            Some((&server.url(), secret)),
        ),
        Duration::from_secs(60),
    )
}

/// A job that waits for `go`, then records `n` marks of `model` at
/// iterations 0..n (acknowledged, so each is in the log).
fn marking_job(go: &Path, n: u64) -> Vec<String> {
    python(&format!(
        "import os, socket, json, time\n\
         while not os.path.exists({go:?}): time.sleep(0.02)\n\
         s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])\n\
         f = s.makefile('rw')\n\
         for i in range({n}):\n\
         \x20   f.write(json.dumps({{'type': 'mark', 'component': 'model', 'operation': 'step', 'iteration': i, 'ack': True}}) + '\\n'); f.flush(); f.readline()\n",
        go = go.display().to_string()
    ))
}

fn model_iters(points: &[Value]) -> Vec<u64> {
    let mut iters: Vec<u64> = points
        .iter()
        .filter(|p| p["metric"] == "memory/model" && p["variant"] == "cpu_ram_used_mb")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    iters.sort_unstable();
    iters
}

#[test]
fn clearml_resend_delivers_what_an_outage_left_and_ends_the_task() {
    // The task is created, then the server goes away for the rest of the
    // run: the points and the task's final status wait for a resend.
    let server = Server::start();
    let out = scratch();
    let go = out.path().join("go");
    let conf = out.path().join("m.toml");
    // No wait for a task of the job's own: memtrack's is created at once.
    std::fs::write(
        &conf,
        "[clearml]\nfinal_flush_timeout = \"2s\"\njob_task_wait = \"0s\"\n",
    )
    .unwrap();
    let mut child = agent_run(&server, out.path())
        .arg("--config")
        .arg(&conf)
        .job(marking_job(&go, 20))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the task to start", Duration::from_secs(20), || {
        server.state()["tasks"]
            .as_object()
            .is_some_and(|t| t.values().any(|t| t["status"] == "in_progress"))
    });
    server.fault(json!({"refuse_for_s": 600}));
    std::fs::write(&go, "").unwrap();
    let status = child.wait().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    assert_eq!(status.code(), Some(0), "the job's status: {log}");
    let run_dir = out.path().join("job");
    assert!(run_dir.join(SPOOL_FILE).exists(), "{log}");
    assert!(log.contains("memtrack clearml-resend"), "says how: {log}");
    let note: Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("clearml-task.json")).unwrap()).unwrap();
    assert_eq!(note["created"], true, "{note}");

    server.fault(json!({"clear": true}));
    let id = note["id"].as_str().unwrap();
    assert_eq!(server.state()["tasks"][id]["status"], "in_progress");
    let res = resend(&server, &run_dir, SECRET);
    let text = String::from_utf8_lossy(&res.stdout);
    assert_eq!(res.status.code(), Some(0), "{text} {}", stderr(&res));
    assert!(text.contains("task marked completed"), "{text}");
    assert_eq!(model_iters(&server.points(id)), (0..20).collect::<Vec<_>>());
    let state = server.state();
    assert_eq!(state["tasks"].as_object().unwrap().len(), 1, "no new task");
    assert_eq!(state["tasks"][id]["status"], "completed");
    assert!(!run_dir.join(SPOOL_FILE).exists());
    assert!(!run_dir.join("clearml-task.json").exists());
    server.assert_exactly_once();

    // Nothing left: a second resend is a no-op.
    let again = resend(&server, &run_dir, SECRET);
    assert_eq!(again.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to send"));
}

#[test]
fn wrong_credentials_keep_the_points_for_a_resend_with_the_right_ones() {
    let server = Server::start();
    let out = scratch();
    let go = out.path().join("go");
    std::fs::write(&go, "").unwrap();
    let res = agent_run(&server, out.path())
        .env("CLEARML_API_SECRET_KEY", "not-the-secret")
        .run(marking_job(&go, 5), Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "the job ran: {log}");
    assert!(log.contains("refused the credentials"), "{log}");
    assert!(!log.contains("not-the-secret"), "{log}");
    let run_dir = out.path().join("job");
    assert!(run_dir.join("memory_usage.json").exists());
    assert!(run_dir.join(SPOOL_FILE).exists(), "{log}");
    assert_eq!(server.state()["tasks"], json!({}));

    // Still wrong: nothing sent, the spool kept, a clear error.
    let res = resend(&server, &run_dir, "not-the-secret");
    assert_eq!(res.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&res.stdout).contains("still unsent"));
    assert!(run_dir.join(SPOOL_FILE).exists());

    let res = resend(&server, &run_dir, SECRET);
    let text = String::from_utf8_lossy(&res.stdout);
    assert_eq!(res.status.code(), Some(0), "{text} {}", stderr(&res));
    let state = server.state();
    let tasks: Vec<&Value> = state["tasks"].as_object().unwrap().values().collect();
    assert_eq!(tasks.len(), 1, "{state:#}");
    assert_eq!(tasks[0]["name"], "job");
    assert_eq!(tasks[0]["status"], "completed", "ended as the job did");
    let id = tasks[0]["id"].as_str().unwrap();
    assert_eq!(model_iters(&server.points(id)), (0..5).collect::<Vec<_>>());
    assert!(!run_dir.join(SPOOL_FILE).exists());
    server.assert_exactly_once();
}

#[test]
fn clearml_resend_refuses_a_live_run_and_a_missing_configuration() {
    let out = scratch();
    let run_dir = out.path().join("r");
    std::fs::create_dir_all(run_dir.join(".memtrack")).unwrap();
    std::fs::write(run_dir.join(SPOOL_FILE), "").unwrap();
    // Hold the run's lock as a live memtrack does.
    let lock = std::fs::File::create(run_dir.join(".memtrack/lock")).unwrap();
    lock.try_lock().unwrap();
    // `clearml-resend` of the run, with ClearML as `api` says (no server
    // behind the one named: nothing may be sent).
    let resend = |api: Option<(&str, &str)>| {
        run_to_end(
            clearml_env(
                memtrack().arg("clearml-resend").arg(&run_dir),
                out.path(),
                api,
            ),
            Duration::from_secs(20),
        )
    };
    let unreachable = Some(("http://127.0.0.1:9", SECRET));
    let res = resend(unreachable);
    assert_eq!(res.status.code(), Some(1));
    assert!(stderr(&res).contains("live memtrack"), "{}", stderr(&res));
    drop(lock);

    // No server configured anywhere: a usage error naming what to set.
    let res = resend(None);
    // The JSON is read first: without it, the message says what to run.
    assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
    assert!(
        stderr(&res).contains("memtrack recover"),
        "{}",
        stderr(&res)
    );
    let doc = memtrack::model::Document::default();
    std::fs::write(
        run_dir.join("memory_usage.json"),
        serde_json::to_vec(&doc).unwrap(),
    )
    .unwrap();
    let res = resend(None);
    assert_eq!(res.status.code(), Some(2), "{}", stderr(&res));
    assert!(
        stderr(&res).contains("CLEARML_API_HOST"),
        "{}",
        stderr(&res)
    );

    // A damaged task note is named, and nothing is sent anywhere.
    let note = run_dir.join("clearml-task.json");
    std::fs::write(&note, "{\"id\": 7").unwrap();
    let res = resend(unreachable);
    assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
    assert!(
        stderr(&res).contains(&note.display().to_string()),
        "{}",
        stderr(&res)
    );
}

#[test]
fn a_failed_upload_keeps_the_task_so_memtrack_upload_uses_its_key() {
    let server = Server::start();
    let mut s3 = S3Server::start();
    s3.down();
    let out = scratch();
    let res = agent_run(&server, out.path())
        .args(["--clearml-project", "team/memory"])
        .s3(&s3)
        .run(["true"], Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let run_dir = out.path().join("job");
    let note: Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("clearml-task.json")).unwrap()).unwrap();
    let id = note["id"].as_str().unwrap().to_string();
    assert_eq!(server.state()["tasks"][&id]["status"], "completed");

    s3.up();
    let file = run_dir.join("memory_usage.json");
    let mut cmd = memtrack();
    cmd.arg("upload").arg(&file).args([
        "--s3-url",
        &format!("s3://{}/runs", s3.bucket),
        "--s3-endpoint",
        &s3.endpoint(),
    ]);
    for (k, v) in s3.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let key = format!("runs/team/memory/job.{id}/artifacts/memory_usage/memory_usage.json");
    assert_eq!(
        String::from_utf8_lossy(&res.stdout).trim(),
        format!("s3://{}/{key}", s3.bucket)
    );
    assert_eq!(s3.object(&key), Some(std::fs::read(&file).unwrap()));
    assert!(
        !run_dir.join("clearml-task.json").exists(),
        "the note has served"
    );
    server.assert_exactly_once();
}
