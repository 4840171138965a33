//! The job's own task: a script that calls the real ClearML SDK's
//! `Task.init`, under `memtrack run` or followed by `memtrack attach`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{bare_sdk_env, clearml_env, Server, SECRET};
use crate::common::*;

/// The job: `Task.init` with the SDK's defaults except the resource monitor,
/// the argument parser and repository detection (no git, no network), five
/// steps marked with memtrack's client and reported with the SDK's logger,
/// then `task.close()`. With `wait_socket`, it first waits for memtrack's
/// socket (`attach` starts after the job).
pub(super) fn sdk_job(wait_socket: bool) -> String {
    sdk_job_ending(wait_socket, "task.close()")
}

/// The same job, ending with `ending` (a line of Python).
fn sdk_job_ending(wait_socket: bool, ending: &str) -> String {
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    format!(
        r#"import os, sys, time
sys.path.insert(0, {client:?})
if {wait_socket}:
    while not os.path.exists(os.environ["MEMTRACK_SOCKET"]):
        time.sleep(0.02)
import memtrack
from clearml import Task
task = Task.init(project_name="memtrack-it", task_name="sdk job",
                 auto_resource_monitoring=False, auto_connect_arg_parser=False,
                 auto_connect_frameworks={{"detect_repository": False}})
log = task.get_logger()
keep = []
for i in range(5):
    with memtrack.span("model", "step", iteration=i):
        keep.append(bytearray(8 << 20))
    log.report_scalar("loss", "train", value=1.0 / (i + 1), iteration=i)
print("TASK", task.id, flush=True)
{ending}
"#,
        client = client.display().to_string(),
        wait_socket = if wait_socket { "True" } else { "False" },
    )
}

/// What the SDK and memtrack need, with no traffic leaving the machine:
/// ClearML as clearml-agent sets it for the contract server, the proxies at
/// a closed loopback port (only loopback goes direct), the web and files
/// hosts too, and the SDK's home, cache and update check local.
fn sdk_env(cmd: &mut Command, server: &Server, s3: &S3Server, home: &Path) {
    let closed = "http://127.0.0.1:9";
    clearml_env(cmd, home, Some((&server.url(), SECRET)))
        .envs(bare_sdk_env(home))
        .env("CLEARML_WEB_HOST", closed)
        .env("CLEARML_FILES_HOST", closed)
        .envs(s3.env(S3_SECRET));
}

pub(crate) fn require_clearml_sdk() {
    let ok = Command::new("python3")
        .args(["-c", "import clearml"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "the ClearML SDK is missing; scripts/test installs it (python3 -m pip install clearml==2.1.12)"
    );
}

/// The server holds one task, `id`, made by the job's SDK (memtrack made
/// none), and memtrack's memory points in it; those points.
pub(super) fn memory_in_the_scripts_task(server: &Server, id: &str, log: &str) -> Vec<Value> {
    let state = server.state();
    assert_eq!(
        state["tasks"].as_object().unwrap().len(),
        1,
        "one task, the script's: {state:#}"
    );
    assert_eq!(state["task_creators"][id], "sdk", "{state:#}");
    let memory: Vec<Value> = server
        .points(id)
        .into_iter()
        .filter(|p| p["metric"].as_str().unwrap().starts_with("memory/"))
        .collect();
    assert!(
        !memory.is_empty(),
        "memtrack's points in the script's task: {log}"
    );
    // One series per figure: marks and timer samples of an iteration in
    // one point, not `x`, `x:after_step` and `x:timer` beside each other.
    let suffixed: Vec<String> = memory
        .iter()
        .filter(|p| p["variant"].as_str().unwrap().contains(':'))
        .map(|p| format!("{} {} @{}", p["metric"], p["variant"], p["iter"]))
        .collect();
    assert!(
        suffixed.is_empty(),
        "series per operation: {suffixed:?}\nall of memtrack's points: {}\n{log}",
        memory
            .iter()
            .map(|p| format!(
                "{} {} @{} {}",
                p["metric"], p["variant"], p["iter"], p["value"]
            ))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // No GPU here: no series of zeros beside the host's.
    if !Path::new("/dev/nvidiactl").exists() {
        let gpu: Vec<&Value> = memory
            .iter()
            .filter(|p| p["variant"].as_str().unwrap().contains("gpu"))
            .collect();
        assert!(
            gpu.is_empty(),
            "GPU series on a machine without one: {gpu:?}"
        );
    }
    memory
}

/// memtrack's `memory` points in the task of [`sdk_job`] are on the job's
/// iteration axis: a `model` point at each of its five steps, none past
/// the last, and the task's last iteration the job's.
pub(super) fn assert_on_the_jobs_axis(memory: &[&Value], task: &Value) {
    let steps: std::collections::BTreeSet<u64> = memory
        .iter()
        .filter(|p| p["metric"] == "memory/model" && p["variant"] == "cpu_ram_used_mb")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..5).collect(), "{memory:#?}");
    assert!(
        memory.iter().all(|p| p["iter"].as_u64().unwrap() <= 4),
        "memtrack's points stay on the job's axis, no time axis: {memory:#?}"
    );
    assert_eq!(task["last_iteration"], 4, "the task's axis is the job's");
}

/// Checks the outcome of an SDK job run under memtrack: one task, the
/// script's; the SDK started it, and memtrack completed it for the SDK
/// after the final artifact; every memory point in it, on the job's
/// iteration axis; the SDK's scalars too; the artifact registered while
/// the task was open, pointing at the uploaded object, with the final
/// file's size and hash.
fn check_sdk_task(server: &Server, s3: &S3Server, document: &Path, log: &str) {
    let state = server.state();
    let tasks = state["tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), 1, "one task, the script's: {state:#}\n{log}");
    let (id, task) = tasks.iter().next().unwrap();
    assert_eq!(state["task_creators"][id], "sdk", "{state:#}");
    assert_eq!(task["name"], "sdk job");
    assert_eq!(task["status"], "completed", "{task:#}");
    let changes: Vec<(String, String)> = state["status_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["to"].as_str().unwrap().to_string(),
                c["by"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        changes,
        vec![
            ("in_progress".to_string(), "sdk".to_string()),
            ("completed".to_string(), "memtrack".to_string())
        ],
        "the SDK starts the task; its close is left to memtrack\n{log}"
    );

    let all = server.admin("GET", "/points", None)["points"]
        .as_array()
        .unwrap()
        .clone();
    let memory: Vec<&Value> = all
        .iter()
        .filter(|p| p["metric"].as_str().unwrap().starts_with("memory/"))
        .collect();
    assert!(!memory.is_empty(), "memtrack's points: {log}");
    assert!(memory.iter().all(|p| p["task"] == *id), "{memory:#?}");
    assert_on_the_jobs_axis(&memory, task);
    let sdk_steps: Vec<u64> = all
        .iter()
        .filter(|p| p["metric"] == "loss" && p["variant"] == "train")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(sdk_steps, vec![0, 1, 2, 3, 4], "the SDK's own scalars");

    let key = format!("runs/memtrack-it/sdk job.{id}/artifacts/memory_usage/memory_usage.json");
    let uri = format!("s3://{}/{key}", s3.bucket);
    // The memory_usage file, and the page registered beside it at the end
    // (the task is still open then).
    let artifacts = task["artifacts"].as_array().unwrap();
    let mut keys: Vec<&str> = artifacts
        .iter()
        .map(|a| a["key"].as_str().unwrap())
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["memory_report", "memory_usage"], "{task:#}\n{log}");
    let artifact = artifact_of(task, "memory_usage");
    assert_eq!(artifact["uri"], uri.as_str());
    let registered = state["artifact_log"].as_array().unwrap();
    assert!(!registered.is_empty());
    for a in registered {
        assert_eq!(a["task_status"], "in_progress", "{a}");
        assert_eq!(a["by"], "memtrack", "{a}");
    }
    // The object is the final document, and the record says so.
    let local = std::fs::read(document).unwrap();
    assert_eq!(s3.object(&key).as_deref(), Some(local.as_slice()), "{log}");
    assert_eq!(artifact["content_size"], local.len(), "{task:#}");
    let sha256: String = Sha256::digest(&local)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(artifact["hash"], sha256.as_str(), "{task:#}");
    server.assert_exactly_once();
}

/// `memtrack run --name NAME` of the Python `job`, uploading to `s3`, in
/// the SDK's environment: its output, and its stdout and stderr together.
fn run_sdk_job(
    server: &Server,
    s3: &S3Server,
    out: &Path,
    name: &str,
    job: &str,
) -> (std::process::Output, String) {
    let res = MemtrackRun::new(name, out)
        .args(["--checkpoint-interval", "1s"])
        .s3(s3)
        .with(|cmd| sdk_env(cmd, server, s3, out))
        .run(["python3", "-c", job], Duration::from_secs(180));
    let log = format!("{}\n{}", String::from_utf8_lossy(&res.stdout), stderr(&res));
    (res, log)
}

#[test]
fn a_task_init_job_under_run_gets_the_points_and_the_artifact_in_its_own_task() {
    require_clearml_sdk();
    let server = Server::start();
    let s3 = S3Server::start();
    let out = scratch();
    let (res, log) = run_sdk_job(&server, &s3, out.path(), "sdk-run", &sdk_job(false));
    assert_eq!(res.status.code(), Some(0), "{log}");
    check_sdk_task(
        &server,
        &s3,
        &out.path().join("sdk-run/memory_usage.json"),
        &log,
    );
}

#[test]
fn a_task_init_job_followed_by_attach_gets_the_points_and_the_artifact_in_its_own_task() {
    require_clearml_sdk();
    let server = Server::start();
    let s3 = S3Server::start();
    let out = scratch();
    let socket = out.path().join("memtrack.sock");
    let mut job = Command::new("python3");
    job.args(["-c", &sdk_job(true)])
        .env("MEMTRACK_SOCKET", &socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    sdk_env(&mut job, &server, &s3, out.path());
    let job = job.spawn().unwrap();
    let pid = job.id();
    // Reaped as soon as it exits, so that memtrack sees it gone.
    let job = std::thread::spawn(move || job.wait_with_output().unwrap());
    let mut cmd = MemtrackRun::attach(pid, "sdk-attach", out.path())
        .arg("--socket")
        .arg(&socket)
        .args(["--checkpoint-interval", "1s"])
        .s3(&s3)
        .with(|cmd| sdk_env(cmd, &server, &s3, out.path()))
        .command();
    let res = run_to_end(&mut cmd, Duration::from_secs(180));
    let job = job.join().unwrap();
    let log = format!(
        "job: {}\n{}\nmemtrack: {}",
        String::from_utf8_lossy(&job.stdout),
        String::from_utf8_lossy(&job.stderr),
        stderr(&res)
    );
    assert!(job.status.success(), "{log}");
    assert_eq!(res.status.code(), Some(0), "{log}");
    check_sdk_task(
        &server,
        &s3,
        &out.path().join("sdk-attach/memory_usage.json"),
        &log,
    );
}

/// The task's artifact of `key`.
fn artifact_of<'a>(task: &'a Value, key: &str) -> &'a Value {
    task["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["key"] == key)
        .unwrap_or_else(|| panic!("no {key} artifact: {task:#}"))
}

/// A job whose script fails after `Task.init`: the SDK's exit hook marks
/// its task failed with the exception; memtrack takes that over, registers
/// the final artifact first, and marks the task failed with the SDK's
/// reason.
#[test]
fn a_failing_task_init_job_gets_its_final_artifact_then_the_sdks_failed_status() {
    require_clearml_sdk();
    let server = Server::start();
    let s3 = S3Server::start();
    let out = scratch();
    let job = sdk_job_ending(false, "raise RuntimeError('boom\\nat step 5')");
    let (res, log) = run_sdk_job(&server, &s3, out.path(), "sdk-fail", &job);
    assert_eq!(res.status.code(), Some(1), "the job's exit status: {log}");
    let state = server.state();
    let (id, task) = state["tasks"].as_object().unwrap().iter().next().unwrap();
    let changes: Vec<(&str, &str)> = state["status_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["to"].as_str().unwrap(), c["by"].as_str().unwrap()))
        .collect();
    assert_eq!(
        changes,
        [("in_progress", "sdk"), ("failed", "memtrack")],
        "{log}"
    );
    let reason = task["status_reason"].as_str().unwrap();
    assert!(
        reason.contains("boom at step 5"),
        "the SDK's reason: {reason:?}"
    );
    let local = std::fs::read(out.path().join("sdk-fail/memory_usage.json")).unwrap();
    let key = format!("runs/memtrack-it/sdk job.{id}/artifacts/memory_usage/memory_usage.json");
    assert_eq!(s3.object(&key).as_deref(), Some(local.as_slice()), "{log}");
    assert_eq!(
        artifact_of(task, "memory_usage")["content_size"],
        local.len(),
        "{task:#}"
    );
    server.assert_exactly_once();
}
