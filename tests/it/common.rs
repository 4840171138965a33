//! Helpers shared by the integration tests: the real memtrack binary, real
//! Python jobs, the fake NVML library, and reading what memtrack wrote.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use memtrack::model::Document;

pub const MIB: f64 = 1024.0 * 1024.0;

/// The memtrack binary under test, with a clean environment: no inherited
/// `MEMTRACK_*` settings, no `RUST_LOG`.
pub fn memtrack() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memtrack"));
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") || k == "RUST_LOG" || k == "CUDA_VISIBLE_DEVICES" {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// A scratch directory for one test's outputs.
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("memtrack-it-")
        .tempdir()
        .expect("tempdir")
}

/// Runs memtrack to the end with a deadline, returning its output.
pub fn run_to_end(cmd: &mut Command, timeout: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn memtrack");
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "memtrack did not finish in {timeout:?}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Reads the document of the one run under `output`.
pub fn only_document(output: &Path) -> (PathBuf, Document) {
    let dirs: Vec<PathBuf> = std::fs::read_dir(output)
        .expect("output dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(dirs.len(), 1, "one run directory: {dirs:?}");
    let path = dirs[0].join("memory_usage.json");
    (dirs[0].clone(), read_document(&path))
}

pub fn read_document(path: &Path) -> Document {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A job that holds 400 MiB for 20 ms at 0.3 s, then little until 1.9 s:
/// a spike no 1 s tick sees.
pub const SPIKE_JOB: &str = r#"
import time
time.sleep(0.3)
b = bytearray(400 << 20)
for i in range(0, len(b), 4096): b[i] = 1
time.sleep(0.02)
del b
time.sleep(1.6)
"#;

/// `python3 -c SCRIPT` as argv, naming the interpreter itself: a version
/// manager's `python3` is a shell shim whose own helper processes would
/// join the followed tree for a moment.
pub fn python(script: &str) -> Vec<String> {
    vec![python3().into(), "-c".into(), script.into()]
}

/// The path of the Python interpreter `python3` runs.
pub fn python3() -> &'static str {
    static PY: OnceLock<String> = OnceLock::new();
    PY.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .expect("python3");
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if path.is_empty() {
            "python3".into()
        } else {
            path
        }
    })
}

/// Builds the fake NVML library once per test run (gcc, see
/// tests/fake_nvml/README.md).
pub fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake_nvml");
        std::fs::create_dir_all(&dir).expect("fake nvml dir");
        let out = dir.join("libnvidia-ml-fake.so");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_nvml/fake_nvml.c");
        let status = Command::new("gcc")
            .args([
                "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o",
            ])
            .arg(&out)
            .arg(&src)
            .status()
            .expect("gcc");
        assert!(status.success(), "building the fake NVML library failed");
        out
    })
}

/// Waits until `cond` holds, polling.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `VmRSS` of a live process, bytes.
pub fn vm_rss(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|k| k * 1024)
}

/// Sends a signal with the `kill` command (no unsafe code in tests).
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

/// A memtrack run in the background, with its HTTP address and socket.
pub struct Daemon {
    pub child: std::process::Child,
    pub out: PathBuf,
    pub socket: PathBuf,
    pub http: std::net::SocketAddr,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Daemon {
    /// `memtrack run --listen 127.0.0.1:0 --socket <out>/m.sock
    /// --output <out> EXTRA… -- JOB…`, returned once `/metrics` is up.
    pub fn start(out: &Path, extra: &[&str], job: &[String], env: &[(&str, &str)]) -> Daemon {
        Daemon::start_listening(out, "127.0.0.1:0", extra, job, env)
    }

    /// [`Daemon::start`] with HTTP on `listen` (`[::]:0`: dual-stack).
    pub fn start_listening(
        out: &Path,
        listen: &str,
        extra: &[&str],
        job: &[String],
        env: &[(&str, &str)],
    ) -> Daemon {
        let mut cmd = memtrack();
        cmd.args(["run", "--listen", listen, "--name", "d", "--output"])
            .arg(out)
            .arg("--socket")
            .arg(out.join("m.sock"))
            .args(extra)
            .arg("--")
            .args(job);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Daemon::spawn(cmd, out)
    }

    /// `memtrack attach --listen 127.0.0.1:0 --socket <out>/m.sock
    /// --output <out> EXTRA… --pid PID`, returned once `/metrics` is up.
    pub fn attach(out: &Path, extra: &[&str], pid: u32) -> Daemon {
        let mut cmd = memtrack();
        cmd.args([
            "attach",
            "--listen",
            "127.0.0.1:0",
            "--name",
            "d",
            "--output",
        ])
        .arg(out)
        .arg("--socket")
        .arg(out.join("m.sock"))
        .args(extra)
        .args(["--pid", &pid.to_string()]);
        Daemon::spawn(cmd, out)
    }

    /// Starts `cmd` (a run named `d` under `out`, with HTTP) and waits
    /// for the address it reports.
    fn spawn(mut cmd: Command, out: &Path) -> Daemon {
        use std::io::BufRead;
        let socket = out.join("m.sock");
        cmd.stderr(Stdio::piped()).stdout(Stdio::null());
        let mut child = cmd.spawn().expect("spawn memtrack");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().expect("stderr");
        let sink = std::sync::Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("metrics on http://").nth(1) {
                    let _ = tx.send(addr.trim_end_matches("/metrics").to_string());
                }
                let mut all = sink.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(15))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!(
                    "memtrack did not report its HTTP address:\n{}",
                    lines.lock().unwrap()
                )
            });
        Daemon {
            child,
            out: out.to_path_buf(),
            socket,
            http: addr.parse().expect("address"),
            stderr: lines,
            reader: Some(reader),
        }
    }

    /// An HTTP/1.1 request; returns (status, body).
    pub fn http(&self, method: &str, path: &str) -> (u16, String) {
        http_request(self.http, method, path)
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits for the run to end; returns its exit code and document.
    pub fn finish(self) -> (Option<i32>, Document) {
        let (code, doc, _) = self.finish_logged();
        (code, doc)
    }

    /// As [`Daemon::finish`], with memtrack's whole log.
    pub fn finish_logged(mut self) -> (Option<i32>, Document, String) {
        let status = self.child.wait().expect("wait");
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        (
            status.code(),
            read_document(&self.out.join("d/memory_usage.json")),
            self.stderr(),
        )
    }
}

/// A minimal HTTP/1.1 client (Connection: close), enough for the tests.
pub fn http_request(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("response");
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// A real S3 server that checks signatures (s3s-fs) on loopback, with one
/// bucket. `scripts/test` installs it (`cargo install s3s-fs`).
pub struct S3Server {
    child: Option<std::process::Child>,
    pub root: tempfile::TempDir,
    pub port: u16,
    pub bucket: String,
}

pub const S3_KEY: &str = "memtrack-test-key";
pub const S3_SECRET: &str = "memtrack-test-secret-do-not-log";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl S3Server {
    pub fn start() -> S3Server {
        let root = scratch();
        let bucket = "memtrack-test".to_string();
        std::fs::create_dir_all(root.path().join(&bucket)).unwrap();
        let mut s = S3Server {
            child: None,
            root,
            port: free_port(),
            bucket,
        };
        s.up();
        s
    }

    /// Starts (again) on the same port and root.
    pub fn up(&mut self) {
        let child = Command::new("s3s-fs")
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string(), "--access-key", S3_KEY, "--secret-key", S3_SECRET])
            .arg(self.root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start s3s-fs ({e}); scripts/test installs it: cargo install s3s-fs --version 0.14.1 --features binary"));
        self.child = Some(child);
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", self.port).parse().unwrap();
        wait_for("s3s-fs to listen", Duration::from_secs(10), || {
            std::net::TcpStream::connect(addr).is_ok()
        });
    }

    pub fn down(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The stored bytes of an object (s3s-fs keeps objects as files).
    pub fn object(&self, key: &str) -> Option<Vec<u8>> {
        std::fs::read(self.root.path().join(&self.bucket).join(key)).ok()
    }

    /// Environment for a memtrack talking to this server.
    pub fn env(&self, secret: &str) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", S3_KEY.to_string()),
            ("AWS_SECRET_ACCESS_KEY", secret.to_string()),
            ("AWS_EC2_METADATA_DISABLED", "true".to_string()),
        ]
    }
}

/// `memtrack run` (or `attach`) as the tests of the exporters start it,
/// for the test to add what it tests: no HTTP (`--listen off`), the run
/// `--name NAME` under `--output OUT`, sampled every 50 ms (`interval`
/// sets another period). Options (`arg`, `args`), an upload to an
/// [`S3Server`] (`s3`) and the environment (`env`, `envs`, `with`) go on
/// in the order given; `job` ends the command line with `-- JOB`,
/// `command` without one (`attach`), `run` runs the job to the end.
pub struct MemtrackRun {
    cmd: Command,
    interval: String,
}

impl MemtrackRun {
    /// `memtrack run --listen off --name NAME --output OUT --interval 50ms`.
    pub fn new(name: &str, out: &Path) -> MemtrackRun {
        MemtrackRun::of(&["run"], name, out)
    }

    /// `memtrack attach --pid PID` with the same options.
    pub fn attach(pid: u32, name: &str, out: &Path) -> MemtrackRun {
        MemtrackRun::of(&["attach", "--pid", &pid.to_string()], name, out)
    }

    fn of(head: &[&str], name: &str, out: &Path) -> MemtrackRun {
        let mut cmd = memtrack();
        cmd.args(head)
            .args(["--listen", "off", "--name", name, "--output"])
            .arg(out);
        MemtrackRun {
            cmd,
            interval: "50ms".into(),
        }
    }

    /// `--interval INTERVAL` instead of 50 ms.
    pub fn interval(mut self, interval: &str) -> Self {
        self.interval = interval.into();
        self
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.cmd.arg(arg);
        self
    }

    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.cmd.args(args);
        self
    }

    /// Uploads to `s3`: `--s3-url s3://BUCKET/runs`, `--s3-endpoint`, and
    /// the store's keys in the environment ([`S3Server::env`] with
    /// [`S3_SECRET`]).
    pub fn s3(self, s3: &S3Server) -> Self {
        self.args([
            "--s3-url",
            &format!("s3://{}/runs", s3.bucket),
            "--s3-endpoint",
            &s3.endpoint(),
        ])
        .envs(s3.env(S3_SECRET))
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.cmd.env(key, value);
        self
    }

    pub fn envs<K, V>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        self.cmd.envs(vars);
        self
    }

    /// `setup` applied to the command: an environment a helper sets up
    /// (ClearML's, for one).
    pub fn with(mut self, setup: impl FnOnce(&mut Command)) -> Self {
        setup(&mut self.cmd);
        self
    }

    /// The command, its line ended with `-- JOB`.
    pub fn job<S: AsRef<OsStr>>(self, job: impl IntoIterator<Item = S>) -> Command {
        let mut cmd = self.command();
        cmd.arg("--").args(job);
        cmd
    }

    /// The command, with no job (`attach` follows a running one).
    pub fn command(mut self) -> Command {
        self.cmd.args(["--interval", &self.interval]);
        self.cmd
    }

    /// `job` run to the end, within `timeout`: its output.
    pub fn run<S: AsRef<OsStr>>(
        self,
        job: impl IntoIterator<Item = S>,
        timeout: Duration,
    ) -> Output {
        run_to_end(&mut self.job(job), timeout)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.down();
    }
}

/// Largest gap between consecutive timer samples, seconds.
pub fn largest_timer_gap(doc: &Document) -> f64 {
    let t: Vec<f64> = doc
        .detailed_log
        .iter()
        .filter(|e| e.kind == memtrack::model::EntryKind::Timer)
        .map(|e| e.timestamp)
        .collect();
    t.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max)
}

/// Sampling went on through a disturbance. A sampler the disturbance
/// blocked would show a gap between timer samples of at least `stall`
/// seconds and a run of missed ticks; a loaded machine (CI's 2 cores, other
/// builds) legitimately delays a few ticks (docs/soak.md counts them). So:
/// every gap shorter than `stall`, and at most a tenth of the run's ticks
/// missed (two, for a run too short for a tenth to be one).
pub fn assert_sampling_went_on(doc: &Document, stall: f64) {
    let gap = largest_timer_gap(doc);
    assert!(
        gap < stall,
        "largest gap between timer samples {gap:.3}s: sampling stalled (bound {stall}s)"
    );
    let ticks = doc
        .detailed_log
        .iter()
        .filter(|e| e.kind == memtrack::model::EntryKind::Timer)
        .count() as u64;
    let missed = doc.counters.missed_ticks;
    assert!(
        missed <= (ticks / 10).max(2),
        "{missed} missed ticks in a run of {ticks}: more than a loaded machine explains"
    );
}

/// Whether a test that needs `need` (a short name: `root`, `cgroup`,
/// `setpriv`, …) may go on. When it cannot, the test fails — a skipped test
/// would show as passed — unless `MEMTRACK_ALLOW_SKIP` (comma-separated)
/// names `need`: then it says why and the caller returns. CI leaves the
/// variable unset, so every test runs there.
#[must_use]
pub fn can_run(need: &str, available: bool, why: &str) -> bool {
    if available {
        return true;
    }
    let allowed = std::env::var("MEMTRACK_ALLOW_SKIP").unwrap_or_default();
    if allowed.split(',').any(|n| n.trim() == need) {
        eprintln!("skipped, as MEMTRACK_ALLOW_SKIP names `{need}`: {why}");
        return false;
    }
    panic!("cannot run here: {why} (set MEMTRACK_ALLOW_SKIP={need} to skip knowingly)");
}

/// Why memtrack cannot create a memory cgroup here (`None`: it can), found
/// by creating and removing one. Each call has its own name: tests probing
/// at once in one test process must not collide on one cgroup.
pub fn cgroup_unavailable() -> Option<String> {
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    match memtrack::sample::footprint::job_cgroup(Path::new("/proc"), &format!("probe{n}")) {
        Ok(cg) => {
            cg.remove().expect("remove the probe cgroup");
            None
        }
        Err(why) => Some(why.to_string()),
    }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    memtrack::sys::uid() == 0
}

/// A real `memory_usage.json` of more than 50 MiB (made large by a long
/// event log) in `dir`: its path and bytes, for the multipart uploads.
pub fn fifty_mb_document(dir: &Path) -> (PathBuf, Vec<u8>) {
    let mut doc = memtrack::model::Document {
        schema: memtrack::model::SCHEMA_VERSION,
        ..Default::default()
    };
    doc.run.name = "big".into();
    let entry = memtrack::model::Entry {
        component: "model".into(),
        operation: "step".into(),
        timestamp: 1_795_000_000.25,
        figures: memtrack::model::Figures {
            cpu_ram_used_mb: 1024.5,
            ..Default::default()
        },
        ..Default::default()
    };
    doc.detailed_log = vec![entry; 170_000];
    let file = dir.join("memory_usage.json");
    memtrack::model::json::write_document(&file, &doc).unwrap();
    let local = std::fs::read(&file).unwrap();
    assert!(local.len() > 50 << 20, "{} bytes", local.len());
    (file, local)
}
