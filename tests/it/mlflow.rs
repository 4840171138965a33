//! The MLflow export against a real HTTP server on loopback (a small
//! Python server standing in for `mlflow server`: it answers the calls
//! memtrack makes, or streams a reply that never ends): the tracking
//! password never printed, a reply body read up to a cap, and tracking
//! URIs memtrack cannot use leaving the job to run.

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
