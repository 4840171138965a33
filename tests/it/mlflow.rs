//! The MLflow export against real HTTP servers on loopback. A small Python
//! server standing in for `mlflow server` (it answers the calls memtrack
//! makes, or streams a reply that never ends): the tracking password never
//! printed, a reply body read up to a cap, and tracking URIs memtrack
//! cannot use leaving the job to run. A real `mlflow server` (the
//! framework venv's): values live in the job's own run on its steps, an
//! outage survived live or kept in the spool for `mlflow-resend`, and a bad
//! spool refused.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

/// A tracking server: `normal` answers every call memtrack makes (and logs
/// the `Authorization` header of each); `endless` streams spaces as the
/// reply to `runs/create` until the client hangs up, then writes how many
/// bytes it sent to `sent`.
const SERVER: &str = r#"
import http.server, json, os, sys
mode, folder = sys.argv[1], sys.argv[2]

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def note(self):
        with open(os.path.join(folder, "calls"), "a") as f:
            f.write("%s %s %s\n" % (self.command, self.path, self.headers.get("Authorization", "-")))
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if self.command == "PUT":
            with open(os.path.join(folder, "put-" + os.path.basename(self.path)), "wb") as f:
                f.write(body)
    def do_POST(self):
        self.note()
        if mode == "endless" and self.path.endswith("runs/create"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            sent, block = 0, b" " * 65536
            try:
                while True:
                    self.wfile.write(block)
                    sent += len(block)
            except OSError:
                pass
            finally:
                with open(os.path.join(folder, "sent"), "w") as f:
                    f.write(str(sent))
            return
        if self.path.endswith("runs/create"):
            self.reply({"run": {"info": {"run_id": "r1"}}})
        else:
            self.reply({})
    def do_GET(self):
        self.note()
        self.reply({"run": {"info": {"artifact_uri": "mlflow-artifacts:/0/r1/artifacts"}}})
    def do_PUT(self):
        self.note()
        self.reply({})

s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

struct Server {
    child: std::process::Child,
    port: u16,
    folder: tempfile::TempDir,
}

impl Server {
    fn start(mode: &str) -> Server {
        let folder = scratch();
        let mut child = Command::new(python3())
            .args(["-c", SERVER, mode])
            .arg(folder.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line.trim().parse().expect("the server's port");
        Server {
            child,
            port,
            folder,
        }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.folder.path().join(name)
    }

    fn calls(&self) -> String {
        std::fs::read_to_string(self.file("calls")).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `memtrack run` of a job that writes `ran` in `out`, with
/// `MLFLOW_TRACKING_URI=uri` and the config `toml`.
fn run_with(out: &Path, uri: &str, toml: &str) -> std::process::Output {
    let config = out.join("memtrack.toml");
    std::fs::write(&config, toml).unwrap();
    let ran = out.join("ran");
    run_to_end(
        memtrack()
            .args(["run", "--config"])
            .arg(&config)
            .args(["--listen", "off", "--name", "r", "--output"])
            .arg(out)
            .args(["--", "touch"])
            .arg(&ran)
            .env("MLFLOW_TRACKING_URI", uri)
            .env_remove("MLFLOW_RUN_ID")
            .env_remove("MLFLOW_EXPERIMENT_ID"),
        Duration::from_secs(120),
    )
}

/// What once broke: `…logged into run r1 at http://alice:hunter2@127.0.0.1:…`
/// on success.
#[test]
fn the_tracking_password_is_used_and_never_printed() {
    let server = Server::start("normal");
    let out = scratch();
    let uri = format!("http://alice:hunter2@127.0.0.1:{}", server.port);
    let res = run_with(out.path(), &uri, "");
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    assert!(log.contains("logged into run r1"), "{log}");
    assert!(
        log.contains(&format!("http://***@127.0.0.1:{}", server.port)),
        "{log}"
    );
    assert!(!log.contains("hunter2"), "the password is printed: {log}");
    // Still used: every call logged in as alice (HTTP basic authentication).
    let calls = server.calls();
    assert!(calls.contains("PUT /api/2.0/mlflow-artifacts/"), "{calls}");
    // The document and the report page beside it, as artifacts.
    for name in ["memory_usage.json", "memory_report.html"] {
        assert_eq!(
            std::fs::read(server.file(&format!("put-{name}"))).ok(),
            std::fs::read(out.path().join("r").join(name)).ok(),
            "{name} as an artifact: {calls}"
        );
    }
    assert!(
        calls.contains("PUT /api/2.0/mlflow-artifacts/artifacts/0/r1/artifacts/memory_report.html"),
        "{calls}"
    );
    // base64("alice:hunter2")
    assert!(
        calls
            .lines()
            .all(|l| l.ends_with("Basic YWxpY2U6aHVudGVyMg==")),
        "{calls}"
    );
    // And a failing server: the error names the server without the password.
    let down = format!("http://alice:hunter2@127.0.0.1:{}", free_port());
    let out = scratch();
    let res = run_with(out.path(), &down, "[mlflow]\nrequest_timeout = \"5s\"\n");
    let log = stderr(&res);
    assert!(log.contains("MLflow"), "{log}");
    assert!(!log.contains("hunter2"), "the password is printed: {log}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// What once broke: a server streaming a reply without end took memtrack
/// to 4,840 MiB in 20 s. The reply is read up to 8 MiB, then dropped.
#[test]
fn an_endless_reply_is_read_up_to_a_cap() {
    let server = Server::start("endless");
    let out = scratch();
    let uri = format!("http://127.0.0.1:{}", server.port);
    let config = out.path().join("memtrack.toml");
    std::fs::write(&config, "[mlflow]\nrequest_timeout = \"8s\"\n").unwrap();
    let rss = out.path().join("rss");
    let res = run_to_end(
        Command::new("/usr/bin/time")
            .args(["-f", "%M", "-o"])
            .arg(&rss)
            .arg(env!("CARGO_BIN_EXE_memtrack"))
            .args(["run", "--config"])
            .arg(&config)
            .args(["--listen", "off", "--name", "r", "--output"])
            .arg(out.path())
            .args(["--", "true"])
            .env("MLFLOW_TRACKING_URI", &uri)
            .env_remove("MLFLOW_RUN_ID")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null()),
        Duration::from_secs(120),
    );
    let log = stderr(&res);
    assert!(
        log.contains("longer than 8388608 bytes"),
        "the reply is refused at its cap: {log}"
    );
    wait_for(
        "the server to see memtrack hang up",
        Duration::from_secs(30),
        || server.file("sent").exists(),
    );
    let sent: u64 = std::fs::read_to_string(server.file("sent"))
        .unwrap()
        .parse()
        .unwrap();
    // The cap, plus what the sockets' buffers took before memtrack hung up.
    eprintln!("figures: memtrack took {sent} bytes of the endless reply");
    assert!(sent < 64 << 20, "memtrack took {sent} bytes of the reply");
    let peak_kib: u64 = std::fs::read_to_string(&rss)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    eprintln!("figures: memtrack's peak RSS {peak_kib} KiB");
    assert!(peak_kib < 200 << 10, "memtrack's peak RSS {peak_kib} KiB");
}

/// What once broke: `MLFLOW_TRACKING_URI=file:///…` or `databricks://…`
/// (ordinary MLflow settings of the job) made `memtrack run` exit 1
/// without starting the job, and `http://` sent requests to a host named
/// `api`.
#[test]
fn a_tracking_uri_memtrack_cannot_use_leaves_the_job_to_run() {
    for (uri, says) in [
        ("file:///tmp/mlruns", "MLflow's file store"),
        ("databricks://my-profile", "Databricks"),
        ("http://", "names no host"),
    ] {
        let out = scratch();
        let res = run_with(out.path(), uri, "");
        let log = stderr(&res);
        assert_eq!(res.status.code(), Some(0), "{uri}: {log}");
        assert!(out.path().join("ran").exists(), "{uri}: the job ran: {log}");
        assert!(
            log.contains("MLFLOW_TRACKING_URI") && log.contains(says),
            "{uri}: {log}"
        );
        assert!(!log.contains("/api/2.0"), "{uri}: no request: {log}");
        assert!(out.path().join("r/memory_usage.json").is_file(), "{log}");
    }
    // memtrack's own setting is named in the warning; the job still runs.
    let out = scratch();
    let res = run_with(
        out.path(),
        "",
        "[mlflow]\ntracking_uri = \"http://:5000\"\n",
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    assert!(
        log.contains("mlflow.tracking_uri") && log.contains("names no host"),
        "{log}"
    );
    assert!(out.path().join("ran").exists(), "the job ran: {log}");
    assert!(!log.contains("/api/2.0"), "no request: {log}");
}

// -- A real `mlflow server`: live values, outages and the resend ----------

/// The Python that has mlflow: `MEMTRACK_FW_PYTHON`, else the framework
/// venv `scripts/test` makes in `target/fw-venv`. Without one the test
/// fails, unless `MEMTRACK_ALLOW_SKIP` names `mlflow` ([`can_run`]): then
/// `None`, and the caller returns.
fn mlflow_python() -> Option<PathBuf> {
    let path = std::env::var_os("MEMTRACK_FW_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fw-venv/bin/python"));
    let ok = Command::new(&path)
        .args(["-c", "import mlflow"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let why = "no Python with mlflow (scripts/test makes target/fw-venv)";
    can_run("mlflow", ok, why).then_some(path)
}

/// Requests never go through a proxy the machine may set: a proxy would
/// answer for the loopback server.
const NO_PROXY_ENV: [(&str, &str); 6] = [
    ("HTTP_PROXY", "http://127.0.0.1:9"),
    ("HTTPS_PROXY", "http://127.0.0.1:9"),
    ("http_proxy", "http://127.0.0.1:9"),
    ("https_proxy", "http://127.0.0.1:9"),
    ("NO_PROXY", "127.0.0.1,localhost"),
    ("no_proxy", "127.0.0.1,localhost"),
];

/// `mlflow server` on loopback with a SQLite store and proxied artifacts
/// in `folder`, in its own process group (it may start workers), on `port`
/// (0: a free one). Restarted on the same port and store, it serves the
/// same runs.
struct Mlflow {
    child: Option<std::process::Child>,
    python: PathBuf,
    folder: tempfile::TempDir,
    port: u16,
}

impl Mlflow {
    fn start(python: &Path) -> Mlflow {
        let mut m = Mlflow {
            child: None,
            python: python.to_path_buf(),
            folder: scratch(),
            port: free_port(),
        };
        m.up();
        m
    }

    fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn up(&mut self) {
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(self.folder.path().join("server.log")).unwrap();
        let child = Command::new(&self.python)
            .args([
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--workers",
                "1",
            ])
            .args(["--port", &self.port.to_string()])
            .arg("--backend-store-uri")
            .arg(format!(
                "sqlite:///{}",
                self.folder.path().join("mlflow.db").display()
            ))
            .arg("--artifacts-destination")
            .arg(self.folder.path().join("artifacts"))
            .envs(NO_PROXY_ENV)
            .current_dir(self.folder.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("mlflow server");
        self.child = Some(child);
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", self.port).parse().unwrap();
        let log = self.folder.path().join("server.log");
        wait_for("mlflow server to answer", Duration::from_secs(240), || {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!(
                    "mlflow server exited ({status}):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::net::TcpStream::connect(addr).is_ok()
                && http_request(addr, "GET", "/health").0 == 200
        });
    }

    /// Kills the server and every worker it started, and waits for it.
    fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
    }

    /// What the server holds, as JSON: every run of every experiment
    /// (id, experiment, name, status), the experiment named `experiment`,
    /// and for `run` its `memtrack/host_mb` history and artifacts.
    fn query(&self, experiment: &str, run: &str) -> serde_json::Value {
        const QUERY: &str = r#"
import json, sys
from mlflow.tracking import MlflowClient
c = MlflowClient(sys.argv[1])
name, run = sys.argv[2], sys.argv[3]
exps = c.search_experiments()
runs = c.search_runs([e.experiment_id for e in exps], max_results=1000)
out = {
    "runs": [[r.info.run_id, r.info.experiment_id, r.info.run_name, r.info.status] for r in runs],
    "experiment": (c.get_experiment_by_name(name).experiment_id if name and c.get_experiment_by_name(name) else None),
}
if run:
    out["host"] = [[m.timestamp, m.step, m.value] for m in c.get_metric_history(run, "memtrack/host_mb")]
    out["keys"] = sorted(c.get_run(run).data.metrics)
    out["artifacts"] = sorted(f.path for f in c.list_artifacts(run))
print(json.dumps(out))
"#;
        let out = Command::new(&self.python)
            .args(["-c", QUERY, &self.uri(), experiment, run])
            .envs(NO_PROXY_ENV)
            .output()
            .expect("python");
        assert!(
            out.status.success(),
            "query: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("the query's JSON")
    }
}

impl Drop for Mlflow {
    fn drop(&mut self) {
        self.down();
    }
}

/// A job inside `mlflow.start_run()` that marks steps 1..=`first` and
/// waits, polling the server, until memtrack's `memtrack/host_mb` values
/// on those steps are in its own run — while the run is still open, so
/// they came live; it fails (exit 3) when they never do. Then, when
/// `then` names a file, it writes `<then>.ready` and waits for `then`
/// before marking steps up to `last` and leaving without ending its run
/// (the server may be gone by then).
const LIVE_JOB: &str = r#"
import os, sys, time
import mlflow
from mlflow.tracking import MlflowClient
from memtrack import get_client
first, last, then = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
marks = get_client()
keep = []
run = mlflow.start_run(run_name="own run")
rid = run.info.run_id
for i in range(1, first + 1):
    keep.append(bytearray(2 << 20))
    mlflow.log_metric("loss", 1.0 / i, step=i)
    marks.mark("train", "step", iteration=i, ack=True)
client = MlflowClient()
deadline = time.monotonic() + 120
while True:
    steps = {m.step for m in client.get_metric_history(rid, "memtrack/host_mb")}
    if set(range(1, first + 1)) <= steps:
        break
    if time.monotonic() > deadline:
        print("NOT LIVE", sorted(steps), flush=True)
        sys.exit(3)
    time.sleep(0.1)
print("LIVE", rid, run.info.experiment_id, flush=True)
if then:
    open(then + ".ready", "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(then):
        if time.monotonic() > deadline:
            sys.exit(4)
        time.sleep(0.05)
    for i in range(first + 1, last + 1):
        keep.append(bytearray(2 << 20))
        marks.mark("train", "step", iteration=i, ack=True)
    sys.stdout.flush()
    os._exit(0)
mlflow.end_run()
"#;

/// `memtrack run` of [`LIVE_JOB`] (in the background) against `uri`.
fn live_job(python: &Path, out: &Path, uri: &str, args: [&str; 3]) -> std::process::Child {
    let job = out.join("job.py");
    std::fs::write(&job, LIVE_JOB).unwrap();
    let config = out.join("memtrack.toml");
    std::fs::write(&config, "finish_timeout = \"30s\"\n").unwrap();
    memtrack()
        .args(["run", "--config"])
        .arg(&config)
        .args([
            "--listen",
            "off",
            "--name",
            "r",
            "--interval",
            "200ms",
            "--output",
        ])
        .arg(out)
        .arg("--")
        .arg(python)
        .arg(&job)
        .args(args)
        .env("MLFLOW_TRACKING_URI", uri)
        .env("MLFLOW_EXPERIMENT_NAME", "memtrack live")
        .envs(NO_PROXY_ENV)
        .env_remove("MLFLOW_RUN_ID")
        .env_remove("MLFLOW_EXPERIMENT_ID")
        .env_remove("MEMTRACK_AUTO_HOOKS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("memtrack")
}

/// Waits for `child` (bounded) and returns its output.
fn finish(child: std::process::Child) -> std::process::Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(600)) {
        Ok(out) => out.expect("memtrack's output"),
        Err(_) => {
            signal(pid, "KILL");
            panic!("memtrack did not finish");
        }
    }
}

/// The document's samples as the server should hold them: (timestamp ms,
/// step, host MiB), a timer sample at the last iteration seen.
fn expected_host(doc: &memtrack::model::Document) -> Vec<(i64, i64, f64)> {
    let mut step = 0i64;
    let mut out: Vec<(i64, i64, f64)> = doc
        .detailed_log
        .iter()
        .map(|e| {
            if let Some(i) = e.iteration {
                step = i as i64;
            }
            (
                (e.timestamp * 1000.0) as i64,
                step,
                e.figures.cpu_ram_used_mb,
            )
        })
        .collect();
    out.sort_by(|a, b| a.partial_cmp(b).unwrap());
    // MLflow keeps one row per (key, timestamp, step, value): a mark and
    // a sample of the same millisecond with the same figure are one value
    // on the server.
    out.dedup();
    out
}

fn server_host(v: &serde_json::Value) -> Vec<(i64, i64, f64)> {
    let mut out: Vec<(i64, i64, f64)> = v["host"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m[0].as_i64().unwrap(),
                m[1].as_i64().unwrap(),
                m[2].as_f64().unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.partial_cmp(b).unwrap());
    out
}

/// The server holds exactly the document's host series, on its steps; a
/// difference is shown entry by entry (timestamp ms, step, MiB).
fn same_host(held: &serde_json::Value, doc: &memtrack::model::Document, log: &str) {
    let (got, want) = (server_host(held), expected_host(doc));
    if got != want {
        let only = |a: &[(i64, i64, f64)], b: &[(i64, i64, f64)]| -> Vec<(i64, i64, f64)> {
            a.iter().filter(|x| !b.contains(x)).copied().collect()
        };
        panic!(
            "the server holds {} host values, the document {}; only on the server: {:?}; \
             only in the document: {:?}\n{log}",
            got.len(),
            want.len(),
            only(&got, &want),
            only(&want, &got)
        );
    }
}

/// The number in `… N memory values logged into run RUN … (L while the job ran)`.
fn logged(log: &str, run: &str) -> (usize, usize) {
    let line = log
        .lines()
        .find(|l| l.contains(&format!("memory values logged into run {run}")))
        .unwrap_or_else(|| panic!("no `logged into run {run}` line: {log}"));
    let number_before = |text: &str, word: &str| -> usize {
        let at = text.find(word).unwrap();
        text[..at]
            .split_whitespace()
            .last()
            .unwrap()
            .trim_start_matches('(')
            .parse()
            .unwrap()
    };
    (
        number_before(line, " memory values logged"),
        number_before(line, " while the job ran"),
    )
}

/// What once failed: memtrack's values arrived only after the job ended,
/// in a second run in experiment 0, every one at step 0. Now the job sees
/// them in its own run, on its own steps, while it runs: the job itself
/// waits for them and fails if they never come.
#[test]
fn a_script_inside_start_run_sees_its_memory_live_on_its_steps() {
    let Some(python) = mlflow_python() else {
        return;
    };
    let server = Mlflow::start(&python);
    let out = scratch();
    let child = live_job(&python, out.path(), &server.uri(), ["5", "5", ""]);
    let res = finish(child);
    let log = stderr(&res);
    let stdout = String::from_utf8_lossy(&res.stdout).into_owned();
    assert_eq!(res.status.code(), Some(0), "{stdout}\n{log}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("LIVE "))
        .unwrap_or_else(|| panic!("{stdout}\n{log}"));
    let (run, experiment) = {
        let mut w = line.split_whitespace().skip(1);
        (w.next().unwrap().to_string(), w.next().unwrap().to_string())
    };
    let held = server.query("memtrack live", &run);
    assert_eq!(
        held["experiment"].as_str(),
        Some(experiment.as_str()),
        "{held}"
    );
    let runs = held["runs"].as_array().unwrap();
    assert_eq!(
        runs.len(),
        1,
        "the job's run only, none of memtrack's: {held}"
    );
    assert_eq!(runs[0][0].as_str(), Some(run.as_str()));
    assert_eq!(runs[0][1].as_str(), Some(experiment.as_str()));
    assert_eq!(
        runs[0][3].as_str(),
        Some("FINISHED"),
        "the job's status kept"
    );
    // Every sample, on the job's steps, once.
    let doc = read_document(&out.path().join("r/memory_usage.json"));
    same_host(&held, &doc, &log);
    let host = server_host(&held);
    for step in 1..=5 {
        assert!(host.iter().any(|h| h.1 == step), "step {step}: {host:?}");
    }
    let keys = held["keys"].to_string();
    for key in [
        "loss",
        "memtrack/host_mb",
        "memtrack/gpu_mb",
        "memtrack/peak_host_mb",
    ] {
        assert!(keys.contains(key), "{key}: {keys}");
    }
    assert_eq!(
        held["artifacts"],
        serde_json::json!(["memory_report.html", "memory_usage.json"])
    );
    // Nothing sent twice: memtrack delivered each value once (three per
    // sample and the two peaks), part of them while the job ran.
    let (sent, live) = logged(&log, &run);
    assert_eq!(sent, doc.detailed_log.len() * 3 + 2, "{log}");
    assert!(live > 0 && live < sent, "{log}");
    assert!(!out.path().join("r/mlflow-spool.jsonl").exists());
}

/// The server dies while the job runs: the values of the steps after it
/// wait, the run ends, `mlflow-spool.jsonl` keeps what did not arrive and
/// the log prints the command that sends it. Run once the server is back,
/// that command delivers exactly what was missing; run again, it sends
/// nothing.
#[test]
fn what_an_outage_kept_from_mlflow_is_sent_by_the_printed_command_once() {
    let Some(python) = mlflow_python() else {
        return;
    };
    let mut server = Mlflow::start(&python);
    let out = scratch();
    let go = out.path().join("go");
    let child = live_job(
        &python,
        out.path(),
        &server.uri(),
        ["3", "8", go.to_str().unwrap()],
    );
    let ready = out.path().join("go.ready");
    wait_for(
        "the job to see its values live",
        Duration::from_secs(300),
        || ready.exists(),
    );
    server.down();
    std::fs::write(&go, "").unwrap();
    let res = finish(child);
    let log = stderr(&res);
    let stdout = String::from_utf8_lossy(&res.stdout).into_owned();
    let run = stdout
        .lines()
        .find_map(|l| l.strip_prefix("LIVE "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("{stdout}\n{log}"))
        .to_string();
    let run_dir = out.path().join("r");
    let spool = run_dir.join("mlflow-spool.jsonl");
    assert!(spool.is_file(), "{log}");
    let spooled = std::fs::read_to_string(&spool).unwrap().lines().count() - 1;
    let command = log
        .lines()
        .find_map(|l| {
            l.split_once("to send them, run: ")
                .map(|(_, c)| c.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no resend command: {log}"));
    assert_eq!(
        command,
        format!("memtrack mlflow-resend {}", run_dir.display()),
        "{log}"
    );
    let (sent_live, _) = logged(&log, &run);

    server.up();
    let resend = |what: &str| {
        let args: Vec<&str> = command.split_whitespace().skip(1).collect();
        let res = run_to_end(
            memtrack()
                .args(&args)
                .envs(NO_PROXY_ENV)
                .env_remove("MLFLOW_TRACKING_URI"),
            Duration::from_secs(300),
        );
        let said = String::from_utf8_lossy(&res.stdout).into_owned();
        assert_eq!(
            res.status.code(),
            Some(0),
            "{what}: {said}\n{}",
            stderr(&res)
        );
        said
    };
    let said = resend("the resend");
    assert!(
        said.contains(&format!("MLflow (run {run}): {spooled} memory values sent")),
        "exactly what was kept: {said}"
    );
    assert!(!spool.exists(), "{said}");
    let doc = read_document(&run_dir.join("memory_usage.json"));
    assert_eq!(
        sent_live + spooled,
        doc.detailed_log.len() * 3 + 2,
        "every value once, live or resent: {log}"
    );
    let held = server.query("memtrack live", &run);
    same_host(&held, &doc, &format!("{said}\n{log}"));
    assert!(
        server_host(&held).iter().any(|h| h.1 == 8),
        "the steps after the outage"
    );
    assert_eq!(held["runs"].as_array().unwrap().len(), 1, "{held}");
    assert_eq!(
        held["artifacts"],
        serde_json::json!(["memory_report.html", "memory_usage.json"])
    );
    assert!(held["keys"].to_string().contains("memtrack/peak_host_mb"));
    // Again: nothing left, nothing sent.
    let said = resend("the second resend");
    assert!(said.contains("nothing to send"), "{said}");
}

/// A spool file that is not what memtrack writes (hand-edited, cut short,
/// naming a run id made to reach another URL, or far too large) is refused
/// with the line that broke it, and left exactly as it was: nothing is
/// sent, nothing lost.
#[test]
fn a_bad_spool_is_refused_and_kept() {
    let out = scratch();
    let run_dir = out.path().join("r");
    std::fs::create_dir(&run_dir).unwrap();
    let spool = run_dir.join("mlflow-spool.jsonl");
    let head = r#"{"mlflow_spool":1,"tracking_uri":"http://127.0.0.1:9","run_id":"RUN","created":false,"experiment_id":null,"experiment_name":null,"run_name":"r","memtrack_run":"m","artifacts":false,"end":null}"#;
    let value = r#"{"key":"memtrack/host_mb","value":1.0,"timestamp":1,"step":1}"#;
    let big = run_dir.join("big");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            format!("{}\n{value}\n", head.replace("RUN", "x&run_id=y")).into_bytes(),
            "line 1: run_id is not an id",
        ),
        (
            format!("{}\n{value}\n{{\"key\":", head.replace("RUN", "abc")).into_bytes(),
            "line 3: the last line is cut short",
        ),
        (
            format!(
                "{}\n{}\n",
                head.replace("RUN", "abc"),
                value.replace("memtrack/host_mb", "loss")
            )
            .into_bytes(),
            "line 2: `loss` is not a metric memtrack logs",
        ),
        (vec![0xff, 0xfe, b'\n'], "mlflow-spool.jsonl"),
    ];
    for (bytes, says) in cases {
        std::fs::write(&spool, &bytes).unwrap();
        let res = run_to_end(
            memtrack()
                .arg("mlflow-resend")
                .arg(&run_dir)
                .envs(NO_PROXY_ENV)
                .env_remove("MLFLOW_TRACKING_URI"),
            Duration::from_secs(60),
        );
        let log = stderr(&res);
        assert_ne!(res.status.code(), Some(0), "{says}: {log}");
        assert!(log.contains(says), "{says}: {log}");
        assert_eq!(std::fs::read(&spool).unwrap(), bytes, "{says}: untouched");
    }
    // Oversized: refused unread (a sparse file, no disk spent).
    std::fs::File::create(&big).unwrap();
    std::fs::rename(&big, &spool).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&spool)
        .unwrap();
    f.set_len((64 << 20) + 1).unwrap();
    let res = run_to_end(
        memtrack().arg("mlflow-resend").arg(&run_dir),
        Duration::from_secs(60),
    );
    let log = stderr(&res);
    assert_ne!(res.status.code(), Some(0), "{log}");
    assert!(log.contains("larger than"), "{log}");
    assert_eq!(std::fs::metadata(&spool).unwrap().len(), (64 << 20) + 1);
}

/// A job that marks steps 1..=3 while the tracking server is down, writes
/// `<argv[1]>.ready`, then polls the server (waiting through refused
/// connections) until memtrack's values on those steps are in run
/// `MLFLOW_RUN_ID`; it fails (exit 3) when they never come.
const OUTAGE_JOB: &str = r#"
import json, os, sys, time, urllib.request
from memtrack import get_client
marks = get_client()
keep = []
for i in range(1, 4):
    keep.append(bytearray(2 << 20))
    marks.mark("train", "step", iteration=i, ack=True)
open(sys.argv[1] + ".ready", "w").close()
url = "%s/api/2.0/mlflow/metrics/get-history?run_id=%s&metric_key=memtrack/host_mb" % (
    os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_RUN_ID"])
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            steps = {m["step"] for m in json.load(r).get("metrics", [])}
        if {1, 2, 3} <= steps:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.1)
print("LIVE", flush=True)
"#;

/// What once failed: values were sent once, after the job, and a server
/// that was away then lost them. Now values recorded while the server is
/// down wait, are tried again with a backoff, and arrive while the job
/// still runs once the server is back: the job itself waits for them. The
/// run given by `MLFLOW_RUN_ID` keeps its status; nothing is left to resend.
#[test]
fn values_recorded_while_the_server_is_down_arrive_live_once_it_is_back() {
    let Some(python) = mlflow_python() else {
        return;
    };
    let mut server = Mlflow::start(&python);
    let made = Command::new(&python)
        .args([
            "-c",
            "import sys; from mlflow.tracking import MlflowClient as C; \
             c = C(sys.argv[1]); print(c.create_run('0').info.run_id)",
            &server.uri(),
        ])
        .envs(NO_PROXY_ENV)
        .output()
        .expect("python");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let run = String::from_utf8_lossy(&made.stdout).trim().to_string();
    server.down();
    let out = scratch();
    let job = out.path().join("job.py");
    std::fs::write(&job, OUTAGE_JOB).unwrap();
    let flag = out.path().join("flag");
    let child = memtrack()
        .args([
            "run",
            "--listen",
            "off",
            "--name",
            "r",
            "--interval",
            "200ms",
            "--output",
        ])
        .arg(out.path())
        .arg("--")
        .arg(&python)
        .arg(&job)
        .arg(&flag)
        .env("MLFLOW_TRACKING_URI", server.uri())
        .env("MLFLOW_RUN_ID", &run)
        .envs(NO_PROXY_ENV)
        .env_remove("MLFLOW_EXPERIMENT_NAME")
        .env_remove("MLFLOW_EXPERIMENT_ID")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("memtrack");
    let ready = out.path().join("flag.ready");
    wait_for("the job's steps", Duration::from_secs(120), || {
        ready.exists()
    });
    server.up();
    let res = finish(child);
    let log = stderr(&res);
    let stdout = String::from_utf8_lossy(&res.stdout).into_owned();
    assert_eq!(res.status.code(), Some(0), "{stdout}\n{log}");
    assert!(stdout.contains("LIVE"), "{stdout}\n{log}");
    assert!(log.contains("values wait, trying again in"), "{log}");
    assert!(log.contains("the server answers again"), "{log}");
    let doc = read_document(&out.path().join("r/memory_usage.json"));
    let held = server.query("", &run);
    same_host(&held, &doc, &log);
    let (sent, live) = logged(&log, &run);
    assert_eq!(sent, doc.detailed_log.len() * 3 + 2, "{log}");
    assert!(live > 0, "{log}");
    let runs = held["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{held}");
    assert_eq!(
        runs[0][3].as_str(),
        Some("RUNNING"),
        "not memtrack's to end"
    );
    assert!(!out.path().join("r/mlflow-spool.jsonl").exists(), "{log}");
}
