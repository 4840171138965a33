//! The ClearML exporter against the strict contract server
//! (tests/servers/clearml_server.py), and memtrack's ClearML commands end
//! to end. Every test ends by checking the server recorded no contract
//! violation.
//!
//! - `live`: the reporter driven through the library (a real tokio runtime,
//!   real HTTP on loopback) and what the tests expect of its points;
//! - `tasks`: which task the points land in, created or given, and how it
//!   ends; `outages`: refusals, errors and outages lose and repeat nothing;
//!   `credentials`: keys, tokens and `clearml.conf` as the SDK reads them;
//! - `run`: `memtrack run` with ClearML configured as clearml-agent leaves
//!   it; `announce`: a job naming its own task over the socket; `resend`:
//!   `memtrack clearml-resend` and `memtrack upload` after a failed run;
//! - `sdk`: a job that calls the real SDK's `Task.init`; `zero_config`:
//!   what `clearml-init` leaves is enough.
//!
//! A memtrack command gets its ClearML settings in one place,
//! [`clearml_env`] ([`MemtrackRun::clearml`] for a run built up by a test).

mod announce;
mod credentials;
mod live;
mod outages;
mod resend;
mod run;
mod sdk;
mod tasks;
mod zero_config;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::*;

pub(crate) use sdk::require_clearml_sdk;
pub(crate) use zero_config::{bare_sdk_env, run_python_job, write_clearml_conf, FileServer};

pub(crate) const KEY: &str = "memtrack-test-key";

pub(crate) const SECRET: &str = "memtrack-test-secret";

/// Starts `tests/servers/SCRIPT`, a stand-in that writes the ports it
/// listens on to the JSON file named by `--port-file`, and waits for that
/// file: the child, the ports, and the folder holding the file.
fn start_stand_in(script: &str, what: &str) -> (Child, Value, tempfile::TempDir) {
    let dir = scratch();
    let ports = dir.path().join("ports.json");
    let mut child = Command::new("python3")
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/servers")
                .join(script),
        )
        .arg("--port-file")
        .arg(&ports)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("start {what}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(15);
    let v: Value = loop {
        if let Some(v) = std::fs::read_to_string(&ports)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
        {
            break v;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{what} exited: {status}");
        }
        assert!(Instant::now() < deadline, "no port file from {what}");
        std::thread::sleep(Duration::from_millis(20));
    };
    (child, v, dir)
}

/// The contract server as a child process, killed on drop.
pub(crate) struct Server {
    child: Child,
    api: u16,
    admin: u16,
    _dir: tempfile::TempDir,
}

impl Server {
    pub(crate) fn start() -> Server {
        let (child, v, dir) = start_stand_in("clearml_server.py", "the ClearML contract server");
        Server {
            child,
            api: v["api"].as_u64().unwrap() as u16,
            admin: v["admin"].as_u64().unwrap() as u16,
            _dir: dir,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.api)
    }

    fn admin(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.admin)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (_, body) = raw.split_once("\r\n\r\n").unwrap();
        serde_json::from_str(body).unwrap_or_else(|e| panic!("admin {path}: {e}: {body}"))
    }

    fn fault(&self, body: Value) {
        let r = self.admin("POST", "/fault", Some(body));
        assert_eq!(r["ok"], true, "{r}");
    }

    pub(crate) fn state(&self) -> Value {
        self.admin("GET", "/state", None)
    }

    /// Creates a task behind memtrack's back (as an agent would).
    fn task(&self, name: &str, project: &str, status: &str) -> String {
        let r = self.admin(
            "POST",
            "/task",
            Some(json!({"name": name, "project": project, "type": "training", "status": status})),
        );
        r["id"].as_str().unwrap().to_string()
    }

    pub(crate) fn points(&self, task: &str) -> Vec<Value> {
        self.admin("GET", &format!("/points?task={task}"), None)["points"]
            .as_array()
            .unwrap()
            .clone()
    }

    fn assert_no_violations(&self) {
        let v = self.admin("GET", "/violations", None);
        assert_eq!(v["violations"], json!([]), "contract violations");
    }

    /// No violation, and no point sent twice on the wire either (an
    /// identical resend is legal, and harmless in ClearML, but means a
    /// batch went out again).
    pub(crate) fn assert_exactly_once(&self) {
        self.assert_no_violations();
        assert_eq!(self.state()["resends"], 0, "points sent twice");
    }

    fn calls_to(&self, endpoint: &str) -> usize {
        self.statuses_of(endpoint).len()
    }

    /// The HTTP status the server answered each call to `endpoint` with,
    /// in order.
    fn statuses_of(&self, endpoint: &str) -> Vec<u64> {
        self.admin("GET", "/calls", None)["calls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["endpoint"] == endpoint)
            .map(|c| c["status"].as_u64().unwrap_or(0))
            .collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What ClearML `cmd` (memtrack, or a job) sees; the one place a test sets
/// it. Every `CLEARML_*` variable of the test's own environment is
/// removed; `HOME` (where `clearml.conf` is looked for) is `home`; with
/// `api`, the server and keys as clearml-agent or a user exports them
/// (`CLEARML_API_HOST`, `CLEARML_API_ACCESS_KEY`, `CLEARML_API_SECRET_KEY`
/// with the given secret). A test adds what it tests after this.
pub(crate) fn clearml_env<'c>(
    cmd: &'c mut Command,
    home: &Path,
    api: Option<(&str, &str)>,
) -> &'c mut Command {
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("CLEARML_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("HOME", home);
    if let Some((host, secret)) = api {
        cmd.env("CLEARML_API_HOST", host)
            .env("CLEARML_API_ACCESS_KEY", KEY)
            .env("CLEARML_API_SECRET_KEY", secret);
    }
    cmd
}

impl MemtrackRun {
    /// With ClearML's environment as [`clearml_env`] sets it; before any
    /// variable of the test's own, which it would remove.
    pub(crate) fn clearml(self, home: &Path, api: Option<(&str, &str)>) -> Self {
        self.with(|cmd| {
            clearml_env(cmd, home, api);
        })
    }
}

/// `memtrack run --name job --output OUT` with ClearML configured the way
/// clearml-agent leaves it (environment only: the server and its keys,
/// `HOME` at `out`): the binary end to end, for a test to add its options,
/// S3 and variables to.
fn agent_run(server: &Server, out: &Path) -> MemtrackRun {
    MemtrackRun::new("job", out).clearml(out, Some((&server.url(), SECRET)))
}
