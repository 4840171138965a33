//! Zero configuration: what `clearml-init` leaves (`~/clearml.conf`) is
//! enough for a job that calls `Task.init`, with or without memtrack's
//! client; without it, a job announcing a task hears why nothing happens.

use std::path::Path;
use std::process::Child;
use std::time::Duration;

use memtrack::export::clearml::SPOOL_FILE;
use serde_json::{json, Value};

use super::sdk::{
    assert_on_the_jobs_axis, memory_in_the_scripts_task, require_clearml_sdk, sdk_job,
};
use super::{start_stand_in, Server, KEY, SECRET};
use crate::common::*;

/// The fileserver stand-in (tests/servers/clearml_fileserver.py), killed
/// on drop.
pub(crate) struct FileServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl FileServer {
    pub(crate) fn start() -> FileServer {
        let (child, ports, dir) =
            start_stand_in("clearml_fileserver.py", "the fileserver stand-in");
        FileServer {
            child,
            port: ports["port"].as_u64().unwrap() as u16,
            _dir: dir,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub(crate) fn get(&self, path: &str) -> (u16, String) {
        http_request(([127, 0, 0, 1], self.port).into(), "GET", path)
    }

    pub(crate) fn state(&self) -> Value {
        serde_json::from_str(&self.get("/__state").1).unwrap()
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `clearml.conf` as `clearml-init` writes it, for the contract server
/// and `files` as the fileserver; the web host at a closed loopback port.
pub(crate) fn write_clearml_conf(home: &Path, server: &Server, files: &str) {
    let closed = "http://127.0.0.1:9";
    std::fs::write(
        home.join("clearml.conf"),
        format!(
            "api {{\n    web_server: {closed}\n    api_server: {}\n    files_server: {files}\n    \
             credentials {{\n        \"access_key\" = \"{KEY}\"\n        \"secret_key\"  = \"{SECRET}\"\n    }}\n}}\n",
            server.url()
        ),
    )
    .unwrap();
}

/// The SDK's environment with nothing of ClearML in it but what keeps the
/// traffic on this machine: no `CLEARML_API_HOST`, no keys.
pub(crate) fn bare_sdk_env(home: &Path) -> Vec<(&'static str, String)> {
    let closed = "http://127.0.0.1:9".to_string();
    vec![
        ("HOME", home.display().to_string()),
        (
            "CLEARML_CACHE_DIR",
            home.join("cache").display().to_string(),
        ),
        ("CLEARML_SUPPRESS_UPDATE_MESSAGE", "1".to_string()),
        ("CLEARML_TASK_NO_REUSE", "1".to_string()),
        ("HTTP_PROXY", closed.clone()),
        ("HTTPS_PROXY", closed.clone()),
        ("http_proxy", closed.clone()),
        ("https_proxy", closed),
        ("NO_PROXY", "127.0.0.1,localhost".to_string()),
        ("no_proxy", "127.0.0.1,localhost".to_string()),
        ("PYTHONDONTWRITEBYTECODE", "1".to_string()),
        ("AWS_EC2_METADATA_DISABLED", "true".to_string()),
    ]
}

/// What the job printed after `TAG ` on its first such line (`all`, the
/// job's output and memtrack's log, shown when there is none).
fn printed(stdout: &str, tag: &str, all: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(tag)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {tag} line: {all}"))
        .to_string()
}

/// `memtrack run` of `script` (Python, memtrack's client importable) with
/// `env` only for ClearML, S3 off.
pub(crate) fn run_python_job(
    name: &str,
    out: &Path,
    env: &[(&'static str, String)],
    script: &str,
) -> (i32, String, String) {
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    let script = format!(
        "import sys\nsys.path.insert(0, {:?})\n{script}",
        client.display().to_string()
    );
    run_plain_python_job(name, out, env, &script)
}

/// `memtrack run` of `script` as it is (only memtrack's automatic hooks
/// give it the client) with `env` only for ClearML, S3 off.
pub(crate) fn run_plain_python_job(
    name: &str,
    out: &Path,
    env: &[(&'static str, String)],
    script: &str,
) -> (i32, String, String) {
    // `env` names the job's `HOME` (`bare_sdk_env`); `out` until then.
    let res = MemtrackRun::new(name, out)
        .clearml(out, None)
        .env("MEMTRACK_CLEARML_TIMER_EVERY", "1s")
        .env("MEMTRACK_CLEARML_TIME_AXIS_AFTER", "1s")
        .env("MEMTRACK_CLEARML_FLUSH_INTERVAL", "200ms")
        .envs(env.iter().cloned())
        .run(["python3", "-c", script], Duration::from_secs(180));
    (
        res.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&res.stdout).into_owned(),
        stderr(&res),
    )
}

#[test]
fn a_task_init_job_with_only_clearml_conf_gets_memory_charts_on_a_time_axis() {
    require_clearml_sdk();
    let server = Server::start();
    let files = FileServer::start();
    let out = scratch();
    write_clearml_conf(out.path(), &server, &files.url());
    let script = r#"import json, time
import memtrack
from clearml import Task
task = Task.init(project_name="memtrack-it", task_name="zero config",
                 auto_resource_monitoring=False, auto_connect_arg_parser=False,
                 auto_connect_frameworks={"detect_repository": False})
reply = memtrack.clearml_announce(wait=True)
print("REPLY", json.dumps(reply), flush=True)
keep = []
start = time.time()
while time.time() - start < 4.5:
    with memtrack.span("model", "step"):
        keep.append(bytearray(4 << 20))
    time.sleep(0.3)
print("TASK", task.id, flush=True)
task.close()
"#;
    let (code, stdout, log) = run_python_job("zero", out.path(), &bare_sdk_env(out.path()), script);
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "{all}");
    let reply: Value = serde_json::from_str(&printed(&stdout, "REPLY", &all)).unwrap();
    assert_eq!(reply["clearml"], true, "{all}");
    assert_eq!(reply["reporting"], true, "{reply}\n{all}");
    let id = printed(&stdout, "TASK", &all);
    // One task, the script's: memtrack made none.
    let memory = memory_in_the_scripts_task(&server, &id, &all);
    let state = server.state();
    // No iteration from the job: seconds since the start, as ClearML's
    // own monitor does; never more than the run lasted.
    let iters: std::collections::BTreeSet<u64> =
        memory.iter().map(|p| p["iter"].as_u64().unwrap()).collect();
    assert!(
        iters.len() >= 3,
        "a time axis, not one iteration: {iters:?}"
    );
    let lasted = serde_json::from_str::<Value>(
        &std::fs::read_to_string(out.path().join("zero/memory_usage.json")).unwrap(),
    )
    .unwrap()["summary"]["duration_s"]
        .as_f64()
        .unwrap();
    assert!(
        iters.iter().all(|&i| (i as f64) <= lasted.ceil()),
        "{iters:?} within {lasted} s"
    );
    // No S3: the artifact is on the task's fileserver, registered while
    // the task was open, and the object is the final document.
    let task = &state["tasks"][&id];
    let artifacts = task["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 1, "{task:#}\n{all}");
    let path = format!("memtrack-it/zero%20config.{id}/artifacts/memory_usage/memory_usage.json");
    assert_eq!(artifacts[0]["key"], "memory_usage");
    assert_eq!(artifacts[0]["uri"], format!("{}/{path}", files.url()));
    for a in state["artifact_log"].as_array().unwrap() {
        assert_eq!(a["task_status"], "in_progress", "{a}");
    }
    let local = std::fs::read_to_string(out.path().join("zero/memory_usage.json")).unwrap();
    let (code, object) = files.get(&format!("/{path}"));
    assert_eq!(code, 200, "{:#}", files.state());
    assert!(
        object == local,
        "the object is the final document: {} bytes vs {}",
        object.len(),
        local.len()
    );
    assert_eq!(
        files.state()["violations"],
        json!([]),
        "{:#}",
        files.state()
    );
    server.assert_exactly_once();
}

/// What once failed: a script that calls `Task.init` and `report_scalar`
/// and never imports memtrack, with only `~/clearml.conf`, got nothing
/// (memtrack waited for an announcement nobody sent). The automatic hooks
/// announce the task as `Task.init` returns it.
#[test]
fn a_plain_task_init_script_gets_memory_series_in_its_own_task_without_memtrack_code() {
    require_clearml_sdk();
    let server = Server::start();
    let files = FileServer::start();
    let out = scratch();
    write_clearml_conf(out.path(), &server, &files.url());
    let script = r#"import time
from clearml import Task
task = Task.init(project_name="memtrack-it", task_name="plain script",
                 auto_resource_monitoring=False, auto_connect_arg_parser=False,
                 auto_connect_frameworks={"detect_repository": False})
log = task.get_logger()
keep = []
for i in range(8):
    keep.append(bytearray(4 << 20))
    log.report_scalar("loss", "train", value=1.0 / (i + 1), iteration=i)
    time.sleep(0.3)
print("TASK", task.id, flush=True)
task.close()
"#;
    let (code, stdout, log) =
        run_plain_python_job("plain", out.path(), &bare_sdk_env(out.path()), script);
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "{all}");
    let id = printed(&stdout, "TASK", &all);
    memory_in_the_scripts_task(&server, &id, &all);
    let state = server.state();
    let loss: Vec<u64> = server
        .points(&id)
        .into_iter()
        .filter(|p| p["metric"] == "loss")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(loss, (0..8).collect::<Vec<_>>(), "the script's own scalars");
    assert_eq!(
        state["tasks"][&id]["artifacts"].as_array().unwrap().len(),
        1,
        "the memory_usage artifact on the script's task: {all}"
    );
    server.assert_exactly_once();
}

#[test]
fn without_any_clearml_setup_a_job_announcing_a_task_hears_why_and_nothing_changes() {
    let out = scratch();
    let script = r#"import json
import memtrack
with memtrack.span("model", "step"):
    pass
print("REPLY", json.dumps(memtrack.clearml_announce("abc123", wait=True)), flush=True)
"#;
    let (code, stdout, log) = run_python_job("bare", out.path(), &bare_sdk_env(out.path()), script);
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "{all}");
    let reply: Value = serde_json::from_str(&printed(&stdout, "REPLY", &all)).unwrap();
    assert_eq!(reply["clearml"], false, "{reply}");
    let message = reply["message"].as_str().unwrap();
    assert!(
        message.contains("clearml.conf") && message.contains("clearml-init"),
        "the reply says why: {message}"
    );
    // memtrack's log says it too, once, and nothing is left behind.
    let notices: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("announced its task abc123"))
        .collect();
    assert_eq!(notices.len(), 1, "{log}");
    assert!(notices[0].contains("clearml-init"), "{log}");
    assert!(!out.path().join("bare").join(SPOOL_FILE).exists());
}

#[test]
fn a_task_init_job_with_iterations_and_only_clearml_conf_keeps_its_axis_and_gets_the_artifact() {
    require_clearml_sdk();
    let server = Server::start();
    let files = FileServer::start();
    let out = scratch();
    write_clearml_conf(out.path(), &server, &files.url());
    let (code, stdout, log) = run_python_job(
        "iters",
        out.path(),
        &bare_sdk_env(out.path()),
        &sdk_job(false),
    );
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "{all}");
    let state = server.state();
    let tasks = state["tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), 1, "one task, the script's: {state:#}");
    let (id, task) = tasks.iter().next().unwrap();
    assert_eq!(state["task_creators"][id], "sdk");
    let points = server.points(id);
    let memory: Vec<&Value> = points
        .iter()
        .filter(|p| p["metric"].as_str().unwrap().starts_with("memory/"))
        .collect();
    assert_on_the_jobs_axis(&memory, task);
    let artifacts = task["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 1, "{task:#}\n{all}");
    assert_eq!(
        artifacts[0]["uri"],
        format!(
            "{}/memtrack-it/sdk%20job.{id}/artifacts/memory_usage/memory_usage.json",
            files.url()
        )
    );
    assert_eq!(files.state()["violations"], json!([]));
    server.assert_exactly_once();
}
