//! The ClearML exporter against the strict contract server
//! (tests/servers/clearml_server.py): the reporter is driven through the
//! library with a real tokio runtime and real HTTP on loopback, and every
//! test ends by checking the server recorded no contract violation.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use memtrack::config::ClearmlConfig;
use memtrack::export::clearml::{
    resolve, Artifact, Credentials, FinishReport, Reporter, RunEnd, Settings, SPOOL_FILE,
};
use memtrack::model::{Entry, EntryKind, Exit, RunInfo};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;

use crate::common::*;

pub(crate) const KEY: &str = "memtrack-test-key";
pub(crate) const SECRET: &str = "memtrack-test-secret";

/// The contract server as a child process, killed on drop.
pub(crate) struct Server {
    child: Child,
    api: u16,
    admin: u16,
    _dir: tempfile::TempDir,
}

impl Server {
    pub(crate) fn start(extra: &[&str]) -> Server {
        let dir = scratch();
        let ports = dir.path().join("ports.json");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/servers/clearml_server.py");
        let mut child = Command::new("python3")
            .arg(&script)
            .arg("--port-file")
            .arg(&ports)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the ClearML contract server");
        let deadline = Instant::now() + Duration::from_secs(15);
        let v: Value = loop {
            if let Ok(text) = std::fs::read_to_string(&ports) {
                if let Ok(v) = serde_json::from_str(&text) {
                    break v;
                }
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the ClearML contract server exited: {status}");
            }
            assert!(Instant::now() < deadline, "no port file from the server");
            std::thread::sleep(Duration::from_millis(20));
        };
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
        self.admin("GET", "/calls", None)["calls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["endpoint"] == endpoint)
            .count()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Settings as `resolve` makes them from the environment, with the short
/// timings the tests need.
fn settings(host: &str, secret: &str) -> Settings {
    let env = |k: &str| match k {
        "CLEARML_API_HOST" => Some(host.to_string()),
        "CLEARML_API_ACCESS_KEY" => Some(KEY.to_string()),
        "CLEARML_API_SECRET_KEY" => Some(secret.to_string()),
        "CLEARML_WORKER_NAME" => Some("it-worker".to_string()),
        _ => None,
    };
    let config = ClearmlConfig {
        project: "memtrack-it".into(),
        timer_every: Duration::from_secs(2),
        batch_max: 50,
        flush_interval: Duration::from_millis(100),
        request_timeout: Duration::from_secs(3),
        ..ClearmlConfig::default()
    };
    let mut s = resolve(&config, &env, None).unwrap().unwrap();
    s.backoff_min = Duration::from_millis(50);
    s.backoff_max = Duration::from_millis(500);
    s
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn run_info(name: &str) -> RunInfo {
    RunInfo {
        name: name.into(),
        id: "run-1".into(),
        host: "it-host".into(),
        ..RunInfo::default()
    }
}

/// A started reporter and the sending end of its channel.
struct Live {
    rt: tokio::runtime::Runtime,
    reporter: Reporter,
    tx: UnboundedSender<Entry>,
    dir: tempfile::TempDir,
}

impl Live {
    fn start(settings: Settings, name: &str) -> Live {
        // The reporter's log, shown when a test fails.
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("memtrack=debug")
            .try_init();
        let rt = runtime();
        let dir = scratch();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let run_dir = dir.path().join("run");
        let reporter =
            rt.block_on(async { Reporter::start(settings, run_info(name), run_dir, rx, None) });
        Live {
            rt,
            reporter,
            tx,
            dir,
        }
    }

    fn spool(&self) -> PathBuf {
        self.dir.path().join("run").join(SPOOL_FILE)
    }

    fn push(&self, e: Entry) {
        self.tx.send(e).unwrap();
    }

    fn wait_task(&self) -> String {
        wait_for("the task", Duration::from_secs(10), || {
            self.reporter.task().is_some()
        });
        self.reporter.task().unwrap().id
    }

    fn finish(self, outcome: RunEnd, timeout: Duration) -> (FinishReport, u64, tempfile::TempDir) {
        let Live {
            rt,
            reporter,
            tx,
            dir,
        } = self;
        drop(tx);
        let errors = reporter.errors();
        let report = rt.block_on(reporter.finish(outcome, timeout));
        (report, errors.load(Ordering::Relaxed), dir)
    }
}

fn exit(code: i32) -> RunEnd {
    RunEnd {
        exit: Some(Exit::code(code)),
        artifact: None,
        page: None,
    }
}

fn entry(component: &str, op: &str, ts: f64, iteration: Option<u64>, v: f64) -> Entry {
    Entry {
        component: component.into(),
        operation: op.into(),
        timestamp: ts,
        cpu_ram_used_mb: v,
        gpu_ram_used_mb: v + 0.5,
        gpu_ram_peak_mb: v + 1.0,
        reserved_gpu_ram_mb: v + 2.0,
        gpu_process_used_mb: v + 3.0,
        cpu_ram_hwm_mb: v + 4.0,
        kind: EntryKind::Event,
        iteration,
        ..Entry::default()
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

const FIELDS: [&str; 6] = [
    "cpu_ram_used_mb",
    "gpu_ram_used_mb",
    "gpu_ram_peak_mb",
    "reserved_gpu_ram_mb",
    "gpu_process_used_mb",
    "cpu_ram_hwm_mb",
];

/// (metric, variant, iter) → (value, timestamp ms).
type Expected = BTreeMap<(String, String, u64), (f64, i64)>;

/// The six points of an entry, as the README documents them.
fn expect(exp: &mut Expected, e: &Entry, iter: u64, suffix: Option<&str>) {
    let values = [
        e.cpu_ram_used_mb,
        e.gpu_ram_used_mb,
        e.gpu_ram_peak_mb,
        e.reserved_gpu_ram_mb,
        e.gpu_process_used_mb,
        e.cpu_ram_hwm_mb,
    ];
    for (f, v) in FIELDS.iter().zip(values) {
        if !v.is_finite() {
            continue;
        }
        let variant = suffix.map_or_else(|| f.to_string(), |s| format!("{f}:{s}"));
        let key = (format!("memory/{}", e.component), variant, iter);
        let ts = (e.timestamp * 1000.0).round() as i64;
        assert!(
            exp.insert(key, (v, ts)).is_none(),
            "the test expects a point twice"
        );
    }
}

fn stored(points: &[Value]) -> Expected {
    let mut out = Expected::new();
    for p in points {
        let key = (
            p["metric"].as_str().unwrap().to_string(),
            p["variant"].as_str().unwrap().to_string(),
            p["iter"].as_u64().unwrap(),
        );
        let v = (
            p["value"].as_f64().unwrap(),
            p["timestamp"].as_i64().unwrap(),
        );
        assert!(out.insert(key, v).is_none(), "the server holds a key twice");
    }
    out
}

/// Where two sets differ, shortly.
fn diff(want: &Expected, got: &Expected) -> String {
    let missing: Vec<_> = want
        .keys()
        .filter(|k| !got.contains_key(*k))
        .take(5)
        .collect();
    let extra: Vec<_> = got
        .keys()
        .filter(|k| !want.contains_key(*k))
        .take(5)
        .collect();
    let wrong: Vec<_> = want
        .iter()
        .filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v))
        .take(5)
        .collect();
    format!(
        "want {} got {}; missing {missing:?}; extra {extra:?}; different {wrong:?}",
        want.len(),
        got.len()
    )
}

/// Marks with iterations: `n` per component, keyed by iteration.
fn steady_marks(live: &Live, exp: &mut Expected, component: &str, range: std::ops::Range<u64>) {
    for i in range {
        let e = entry(component, "step", unix_now(), Some(i), 100.0 + i as f64);
        expect(exp, &e, i, None);
        live.push(e);
    }
}

// ---------------------------------------------------------------- 1 and 4

#[test]
fn marks_and_timer_windows_arrive_exactly_once_into_a_created_task() {
    let server = Server::start(&[]);
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
    odd.gpu_ram_used_mb = f64::NAN;
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
        e.cpu_ram_hwm_mb = 900.0 - k as f64;
        windows[(k / 8) as usize].push(e.clone());
        entries.push(e);
    }
    for (w, iter) in windows.iter().zip(302u64..) {
        let mut max = w[0].clone();
        for e in &w[1..] {
            max.cpu_ram_used_mb = max.cpu_ram_used_mb.max(e.cpu_ram_used_mb);
            max.gpu_ram_used_mb = max.gpu_ram_used_mb.max(e.gpu_ram_used_mb);
            max.gpu_ram_peak_mb = max.gpu_ram_peak_mb.max(e.gpu_ram_peak_mb);
            max.reserved_gpu_ram_mb = max.reserved_gpu_ram_mb.max(e.reserved_gpu_ram_mb);
            max.gpu_process_used_mb = max.gpu_process_used_mb.max(e.gpu_process_used_mb);
            max.cpu_ram_hwm_mb = max.cpu_ram_hwm_mb.max(e.cpu_ram_hwm_mb);
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
        RunEnd {
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
    let server = Server::start(&[]);
    for (outcome, reason) in [
        (Some(Exit::signal(9)), "killed by signal 9"),
        (None, "exit status unknown"),
    ] {
        let live = Live::start(settings(&server.url(), SECRET), "sig");
        live.push(entry("model", "x", unix_now(), Some(1), 1.0));
        let (report, _, _dir) = live.finish(
            RunEnd {
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
    let server = Server::start(&[]);
    let id = server.task("agent task", "agent-project", "in_progress");
    let mut s = settings(&server.url(), SECRET);
    s.task = Some(id.clone());
    let live = Live::start(s, "ignored-name");
    assert_eq!(live.wait_task(), id);
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..40);
    let (report, _, _dir) = live.finish(
        RunEnd {
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
    let server = Server::start(&[]);
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

// ---------------------------------------------------------------- 2, 3, 6, 7

#[test]
fn a_twenty_second_outage_loses_and_repeats_nothing() {
    let server = Server::start(&[]);
    let live = Live::start(settings(&server.url(), SECRET), "outage");
    let task = live.wait_task();
    let mut exp = Expected::new();
    let start = Instant::now();
    let mut i = 0u64;
    let mut outage = false;
    // 25 marks a second for 24 s; the server refuses connections for 10 s
    // from t = 2 s, then answers 503 for 10 more.
    while start.elapsed() < Duration::from_secs(24) {
        if !outage && start.elapsed() >= Duration::from_secs(2) {
            outage = true;
            server.fault(json!({"status": 503, "for_s": 20}));
            server.fault(json!({"refuse_for_s": 10}));
        }
        let e = entry("train", "step", unix_now(), Some(i), i as f64);
        expect(&mut exp, &e, i, None);
        live.push(e);
        i += 1;
        std::thread::sleep(Duration::from_millis(40));
    }
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(30));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!(
        (report.sent, report.unsent),
        (exp.len() as u64, 0),
        "{report:?}"
    );
    assert!(errors > 0, "failed attempts are counted");
    // That the daemon's sampling never waits on this is shown with the
    // binary: sampling_stays_on_schedule_while_clearml_stalls_then_refuses.
    let calls = server.admin("GET", "/calls", None);
    let faults = calls["calls"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == 503)
        .count();
    assert!(faults > 0, "the 503 phase was seen");
    assert_eq!(server.state()["tasks"][&task]["status"], "completed");
    server.assert_exactly_once();
}

#[test]
fn an_expired_token_costs_one_login_and_no_point() {
    let server = Server::start(&[]);
    let live = Live::start(settings(&server.url(), SECRET), "token");
    let task = live.wait_task();
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..50);
    wait_for("the first points", Duration::from_secs(10), || {
        server.points(&task).len() == 300
    });
    server.fault(json!({"expire_tokens": true}));
    steady_marks(&live, &mut exp, "model", 50..100);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    let state = server.state();
    assert_eq!(state["logins"], 2, "one login, one re-login");
    assert_eq!(state["login_kinds"]["basic"], 2);
    assert!(state["auth_failures"].as_u64().unwrap() >= 1);
    assert_eq!((report.sent, errors), (600, 0), "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn a_bearer_token_alone_is_used_and_refreshed_with_itself() {
    let server = Server::start(&[]);
    let token = server.admin("POST", "/token", Some(json!({"expiration_sec": 3})))["token"]
        .as_str()
        .unwrap()
        .to_string();
    let mut s = settings(&server.url(), SECRET);
    s.credentials = Credentials::Token(token);
    let live = Live::start(s, "token-only");
    let task = live.wait_task();
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..10);
    // Past the token's refresh point (a tenth of its life before expiry),
    // memtrack refreshes it with itself: the server counts a bearer login.
    wait_for("the token refreshed", Duration::from_secs(15), || {
        server.state()["login_kinds"]["bearer"].as_u64() >= Some(1)
    });
    steady_marks(&live, &mut exp, "model", 10..20);
    let (report, _, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    let state = server.state();
    assert_eq!(state["login_kinds"]["basic"], 0);
    assert!(state["login_kinds"]["bearer"].as_u64().unwrap() >= 1);
    assert!(report.errors.is_empty(), "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn a_small_queue_spills_to_the_spool_and_drains_in_order() {
    let server = Server::start(&[]);
    let mut s = settings(&server.url(), SECRET);
    s.queue_max = 30;
    s.batch_max = 10;
    let live = Live::start(s, "spill");
    let task = live.wait_task();
    server.fault(json!({"refuse_for_s": 3}));
    let mut exp = Expected::new();
    let mut order = Vec::new();
    for i in 0..100u64 {
        let e = entry("model", "step", unix_now(), Some(i), i as f64);
        expect(&mut exp, &e, i, None);
        order.push(i);
        live.push(e);
    }
    let spool = live.spool();
    wait_for("the spool file", Duration::from_secs(3), || {
        std::fs::read_to_string(&spool).is_ok_and(|t| t.lines().count() >= 500)
    });
    let (report, _, _dir) = live.finish(exit(0), Duration::from_secs(20));
    let points = server.points(&task);
    let got = stored(&points);
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!((report.sent, report.unsent), (600, 0), "{report:?}");
    assert!(!spool.exists(), "an emptied spool is removed");
    // In order: the request that stored a point never precedes the one
    // that stored an earlier point.
    let mut request_of: BTreeMap<(u64, String), u64> = BTreeMap::new();
    for p in &points {
        request_of.insert(
            (
                p["iter"].as_u64().unwrap(),
                p["variant"].as_str().unwrap().to_string(),
            ),
            p["request"].as_u64().unwrap(),
        );
    }
    let mut last = 0;
    for i in order {
        for f in FIELDS {
            let r = request_of[&(i, f.to_string())];
            assert!(
                r >= last,
                "point {i}/{f} stored by request {r} after request {last}"
            );
            last = r;
        }
    }
    server.assert_exactly_once();
}

#[test]
fn a_flapping_server_is_retried_and_every_point_arrives_once() {
    // 429 with Retry-After, then 502, 503 and 504 (one raw gateway page),
    // one after another on the batch endpoint: every one is retried.
    let server = Server::start(&[]);
    let live = Live::start(settings(&server.url(), SECRET), "flap");
    let task = live.wait_task();
    for (status, extra) in [
        (429, json!({"retry_after": 1})),
        (502, json!({"raw": true})),
        (503, json!({})),
        (504, json!({})),
    ] {
        let mut f = json!({"status": status, "count": 1, "endpoint": "events.add_batch"});
        f.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        server.fault(f);
    }
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..30);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(20));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!(
        (report.sent, report.refused, report.unsent),
        (180, 0, 0),
        "{report:?}"
    );
    // Each failed attempt counts as an export error; none is a problem
    // for the report.
    assert_eq!(errors, 4, "{report:?}");
    assert!(report.errors.is_empty(), "{report:?}");
    assert!(server.calls_to("events.add_batch") >= 5);
    assert_eq!(server.state()["faults"]["status"], json!([]), "all used");
    server.assert_exactly_once();
}

#[test]
fn partial_errors_are_counted_and_the_rest_delivered() {
    let server = Server::start(&[]);
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 500;
    s.flush_interval = Duration::from_millis(300);
    let live = Live::start(s, "partial");
    let task = live.wait_task();
    server.fault(json!({"partial_errors": 3}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..20);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert_eq!(got.len(), 117);
    assert!(got.iter().all(|(k, v)| exp.get(k) == Some(v)));
    assert_eq!(
        (report.sent, report.refused, report.unsent),
        (117, 3, 0),
        "{report:?}"
    );
    assert_eq!(errors, 3);
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.contains("Error when indexing events batch")),
        "{report:?}"
    );
    server.assert_exactly_once();
}

#[test]
fn a_batch_refused_as_a_whole_is_dropped_and_later_ones_go_on() {
    let server = Server::start(&[]);
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 6;
    let live = Live::start(s, "refused");
    let task = live.wait_task();
    server.fault(json!({"status": 400, "count": 1, "endpoint": "events.add_batch"}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..5);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert_eq!((report.sent, report.refused), (24, 6), "{report:?}");
    assert_eq!(server.points(&task).len(), 24);
    assert!(errors >= 6);
    assert_eq!(report.errors.len(), 1, "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn a_batch_failed_with_server_errors_is_set_aside_then_delivered_at_the_end() {
    // Six 500s in a row exhaust one batch's attempts: later batches go on,
    // and the set-aside one is tried again at the end instead of dropped.
    let server = Server::start(&[]);
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 6;
    let live = Live::start(s, "aside");
    let task = live.wait_task();
    server.fault(json!({"status": 500, "count": 6, "endpoint": "events.add_batch"}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..5);
    wait_for("the later batches", Duration::from_secs(20), || {
        server.points(&task).len() >= 24
    });
    assert_eq!(server.points(&task).len(), 24, "one batch is held back");
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!(
        (report.sent, report.refused, report.unsent),
        (30, 0, 0),
        "{report:?}"
    );
    assert!(errors >= 6);
    assert!(report.errors.is_empty(), "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn batches_a_server_keeps_failing_stay_in_the_spool_for_a_resend() {
    // ClearML answers 500 while its storage is down: nothing can be
    // delivered during the run, and nothing is thrown away.
    let server = Server::start(&[]);
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 6;
    let live = Live::start(s.clone(), "down");
    let task = live.wait_task();
    server.fault(json!({"status": 500, "for_s": 600, "endpoint": "events.add_batch"}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..5);
    let (report, _errors, dir) = live.finish(exit(0), Duration::from_secs(4));
    assert_eq!(
        (report.sent, report.refused, report.discarded, report.unsent),
        (0, 0, 0, 30),
        "{report:?}"
    );
    assert!(
        report.spool.as_deref().is_some_and(Path::exists),
        "{report:?}"
    );
    assert!(server.points(&task).is_empty());

    server.fault(json!({"clear": true}));
    s.task = Some(task.clone());
    let rt = runtime();
    let report = rt.block_on(async {
        let (reporter, bad) =
            Reporter::resend(s, run_info("down"), dir.path().join("run")).unwrap();
        assert_eq!(bad, 0);
        reporter.finish(exit(0), Duration::from_secs(20)).await
    });
    assert_eq!((report.sent, report.unsent), (30, 0), "{report:?}");
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    server.assert_exactly_once();
}

// ---------------------------------------------------------------- 5

#[test]
fn wrong_credentials_are_one_clear_error_without_the_secret() {
    let server = Server::start(&[]);
    let live = Live::start(settings(&server.url(), "not-the-secret"), "badcreds");
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..10);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    let msg = &report.errors[0];
    assert!(msg.contains("refused the credentials"), "{msg}");
    assert!(
        msg.contains("CLEARML_API_ACCESS_KEY"),
        "names the source: {msg}"
    );
    assert!(msg.contains(&server.url()), "{msg}");
    assert!(!format!("{report:?}").contains("not-the-secret"));
    // Kept in the spool for `memtrack clearml-resend` with the right ones.
    assert_eq!((report.sent, report.unsent, report.discarded), (0, 60, 0));
    assert!(report.spool.as_deref().is_some_and(Path::exists));
    assert!(errors >= 1);
    assert_eq!(server.calls_to("auth.login"), 1, "not retried");
    assert_eq!(server.state()["tasks"], json!({}));
    server.assert_exactly_once();
}

#[test]
fn an_unreachable_host_keeps_the_points_in_the_spool() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let live = Live::start(
        settings(&format!("http://127.0.0.1:{port}"), SECRET),
        "down",
    );
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..10);
    let spool = live.spool();
    let started = Instant::now();
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_millis(1500));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "bounded by the timeout"
    );
    assert_eq!((report.sent, report.unsent), (0, 60), "{report:?}");
    assert_eq!(report.spool.as_deref(), Some(spool.as_path()));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    assert!(
        report.errors[0].contains("could not be reached")
            && report.errors[0].contains(&port.to_string()),
        "{report:?}"
    );
    assert!(errors > 0);
    let lines: Vec<Value> = std::fs::read_to_string(&spool)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 60);
    assert_eq!(lines[0]["metric"], "memory/model");
    assert_eq!(lines[6]["iter"], 1);
}

#[test]
fn a_malformed_clearml_conf_is_named_with_its_line() {
    let dir = scratch();
    let conf = dir.path().join("clearml.conf");
    std::fs::write(
        &conf,
        "api {\n    api_server: http://localhost:8008\n    credentials {\"access_key\": \"K\", \"secret_key\": \"S3CR3T}\n}\n",
    )
    .unwrap();
    let config = ClearmlConfig {
        enabled: memtrack::switch::Switch::On,
        config_file: conf.clone(),
        ..ClearmlConfig::default()
    };
    let err = resolve(&config, &|_| None, None).unwrap_err().to_string();
    assert!(err.contains(&conf.display().to_string()), "{err}");
    assert!(
        err.contains("line 3") && err.contains("unterminated quoted string"),
        "{err}"
    );
    assert!(!err.contains("S3CR3T"), "{err}");
}

/// `memtrack run` with ClearML configured the way clearml-agent leaves it
/// (environment only) and S3 on: the binary end to end.
fn run_with_clearml(
    server: &Server,
    out: &Path,
    extra_env: &[(&str, String)],
    args: &[&str],
    job: &[&str],
) -> std::process::Output {
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out);
    if !args.contains(&"--interval") {
        cmd.args(["--interval", "50ms"]);
    }
    cmd.args(args)
        .arg("--")
        .args(job)
        .env("HOME", out)
        .env("CLEARML_API_HOST", server.url())
        .env("CLEARML_API_ACCESS_KEY", KEY)
        .env("CLEARML_API_SECRET_KEY", SECRET);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    run_to_end(&mut cmd, Duration::from_secs(120))
}

#[test]
fn memtrack_run_creates_completes_and_fills_a_task_with_the_s3_artifact() {
    let server = Server::start(&[]);
    let s3 = S3Server::start();
    let out = scratch();
    let env: Vec<(&str, String)> = s3.env(S3_SECRET);
    let res = run_with_clearml(
        &server,
        out.path(),
        &env,
        &[
            "--clearml-project",
            "team/memory",
            "--s3-url",
            &format!("s3://{}/runs", s3.bucket),
            "--s3-endpoint",
            &s3.endpoint(),
        ],
        &python(
            "import os, socket, json\n\
             s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])\n\
             f = s.makefile('rw')\n\
             for i in range(3):\n\
             \x20   f.write(json.dumps({'type': 'mark', 'component': 'model', 'operation': 'step', 'iteration': i, 'ack': True}) + '\\n'); f.flush(); f.readline()\n",
        )
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
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
    let server = Server::start(&[]);
    let out = scratch();
    let res = run_with_clearml(
        &server,
        out.path(),
        &[],
        &[],
        &["sh", "-c", "sleep 0.2; exit 3"],
    );
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
    let server = Server::start(&[]);
    let id = server.task("agent task", "agents", "in_progress");
    let out = scratch();
    let res = run_with_clearml(
        &server,
        out.path(),
        &[("CLEARML_TASK_ID", id.clone())],
        &[],
        &["sh", "-c", "sleep 0.3"],
    );
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
fn a_clearml_host_without_credentials_stops_memtrack_before_the_job() {
    let out = scratch();
    let marker = out.path().join("job-ran");
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--output"])
            .arg(out.path())
            .args(["--", "touch"])
            .arg(&marker)
            .env("HOME", out.path())
            .env("CLEARML_API_HOST", "http://127.0.0.1:9")
            .env_remove("CLEARML_API_ACCESS_KEY")
            .env_remove("CLEARML_API_SECRET_KEY")
            .env_remove("CLEARML_AUTH_TOKEN"),
        Duration::from_secs(30),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(2), "{log}");
    assert!(
        log.contains("CLEARML_API_HOST") && log.contains("credentials"),
        "{log}"
    );
    assert!(!marker.exists(), "the job must not start");
}

#[test]
fn the_server_down_for_the_whole_run_leaves_every_point_in_the_spool() {
    let server = Server::start(&[]);
    server.fault(json!({"refuse_for_s": 600}));
    let out = scratch();
    let res = run_with_clearml(
        &server,
        out.path(),
        &[],
        &["--config", &{
            let p = out.path().join("m.toml");
            std::fs::write(&p, "[clearml]\nfinal_flush_timeout = \"2s\"\n").unwrap();
            p.display().to_string()
        }],
        &["sh", "-c", "sleep 0.3"],
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "the job's status wins: {log}");
    let spool = std::fs::read_to_string(out.path().join("job").join(SPOOL_FILE)).unwrap();
    assert!(spool.lines().count() > 0, "{log}");
    assert!(log.contains("unsent"), "{log}");
    assert!(out.path().join("job/memory_usage.json").exists());
}

#[test]
fn sampling_stays_on_schedule_while_clearml_stalls_then_refuses() {
    // Every call answers 1.5 s late for 2 s, then connections are refused:
    // the daemon's timer must not notice.
    let server = Server::start(&[]);
    server.fault(json!({"delay_ms": 1500, "for_s": 2}));
    let out = scratch();
    let conf = out.path().join("m.toml");
    std::fs::write(
        &conf,
        "[clearml]\nfinal_flush_timeout = \"2s\"\ntimer_every = \"0s\"\n",
    )
    .unwrap();
    let res = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_secs(2));
            server.fault(json!({"refuse_for_s": 600}));
        });
        run_with_clearml(
            &server,
            out.path(),
            &[],
            &[
                "--interval",
                "100ms",
                "--config",
                &conf.display().to_string(),
            ],
            &["sh", "-c", "sleep 4"],
        )
    });
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let doc = read_document(&out.path().join("job/memory_usage.json"));
    // A timer that waited on the stalled server would stop for 1.5 s.
    assert_sampling_went_on(&doc, 1.4);
    // Every timer sample became points, and those not sent are kept.
    assert!(out.path().join("job").join(SPOOL_FILE).exists(), "{log}");
}

#[test]
fn a_malformed_clearml_conf_costs_only_the_reporting_not_the_run() {
    let out = scratch();
    let conf = out.path().join("clearml.conf");
    std::fs::write(
        &conf,
        "api {\n  api_server: http://127.0.0.1:9\n  credentials {\"access_key\": \n",
    )
    .unwrap();
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--name", "job", "--output"])
            .arg(out.path())
            .args(["--", "sh", "-c", "sleep 0.2; exit 4"])
            .env("HOME", out.path())
            .env("CLEARML_API_HOST", "http://127.0.0.1:9")
            .env("CLEARML_CONFIG_FILE", &conf)
            .env_remove("CLEARML_API_ACCESS_KEY")
            .env_remove("CLEARML_API_SECRET_KEY")
            .env_remove("CLEARML_AUTH_TOKEN"),
        Duration::from_secs(60),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(4), "the job ran: {log}");
    assert!(log.contains("ClearML reporting is off"), "{log}");
    assert!(
        log.contains(&conf.display().to_string()),
        "names the file: {log}"
    );
    assert!(out.path().join("job/memory_usage.json").exists());
}

// ---------------------------------------------------------------- resend

/// `memtrack clearml-resend DIR` with the credentials ClearML users have.
fn resend(server: &Server, dir: &Path, secret: &str) -> std::process::Output {
    run_to_end(
        memtrack()
            .args(["clearml-resend", "--timeout", "30s"])
            .arg(dir)
            .env("HOME", dir)
            .env("CLEARML_API_HOST", server.url())
            .env("CLEARML_API_ACCESS_KEY", KEY)
            .env("CLEARML_API_SECRET_KEY", secret)
            .env_remove("CLEARML_TASK_ID"),
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
    let server = Server::start(&[]);
    let out = scratch();
    let go = out.path().join("go");
    let conf = out.path().join("m.toml");
    // No wait for a task of the job's own: memtrack's is created at once.
    std::fs::write(
        &conf,
        "[clearml]\nfinal_flush_timeout = \"2s\"\njob_task_wait = \"0s\"\n",
    )
    .unwrap();
    let mut child = memtrack()
        .args([
            "run",
            "--listen",
            "off",
            "--name",
            "job",
            "--interval",
            "50ms",
        ])
        .arg("--output")
        .arg(out.path())
        .arg("--config")
        .arg(&conf)
        .arg("--")
        .args(marking_job(&go, 20))
        .env("HOME", out.path())
        .env("CLEARML_API_HOST", server.url())
        .env("CLEARML_API_ACCESS_KEY", KEY)
        .env("CLEARML_API_SECRET_KEY", SECRET)
        .env_remove("CLEARML_TASK_ID")
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
    let server = Server::start(&[]);
    let out = scratch();
    let go = out.path().join("go");
    std::fs::write(&go, "").unwrap();
    let res = run_with_clearml(
        &server,
        out.path(),
        &[("CLEARML_API_SECRET_KEY", "not-the-secret".to_string())],
        &[],
        &marking_job(&go, 5)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
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
    let res = run_to_end(
        memtrack()
            .arg("clearml-resend")
            .arg(&run_dir)
            .env("CLEARML_API_HOST", "http://127.0.0.1:9")
            .env("CLEARML_API_ACCESS_KEY", KEY)
            .env("CLEARML_API_SECRET_KEY", SECRET),
        Duration::from_secs(20),
    );
    assert_eq!(res.status.code(), Some(1));
    assert!(stderr(&res).contains("live memtrack"), "{}", stderr(&res));
    drop(lock);

    // No server configured anywhere: a usage error naming what to set.
    let res = run_to_end(
        memtrack()
            .arg("clearml-resend")
            .arg(&run_dir)
            .env("HOME", out.path())
            .env_remove("CLEARML_API_HOST")
            .env_remove("CLEARML_CONFIG_FILE")
            .env_remove("CLEARML_API_ACCESS_KEY")
            .env_remove("CLEARML_API_SECRET_KEY"),
        Duration::from_secs(20),
    );
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
    let res = run_to_end(
        memtrack()
            .arg("clearml-resend")
            .arg(&run_dir)
            .env("HOME", out.path())
            .env_remove("CLEARML_API_HOST")
            .env_remove("CLEARML_CONFIG_FILE")
            .env_remove("CLEARML_API_ACCESS_KEY")
            .env_remove("CLEARML_API_SECRET_KEY"),
        Duration::from_secs(20),
    );
    assert_eq!(res.status.code(), Some(2), "{}", stderr(&res));
    assert!(
        stderr(&res).contains("CLEARML_API_HOST"),
        "{}",
        stderr(&res)
    );

    // A damaged task note is named, and nothing is sent anywhere.
    let note = run_dir.join("clearml-task.json");
    std::fs::write(&note, "{\"id\": 7").unwrap();
    let res = run_to_end(
        memtrack()
            .arg("clearml-resend")
            .arg(&run_dir)
            .env("CLEARML_API_HOST", "http://127.0.0.1:9")
            .env("CLEARML_API_ACCESS_KEY", KEY)
            .env("CLEARML_API_SECRET_KEY", SECRET)
            .env_remove("CLEARML_TASK_ID"),
        Duration::from_secs(20),
    );
    assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
    assert!(
        stderr(&res).contains(&note.display().to_string()),
        "{}",
        stderr(&res)
    );
}

#[test]
fn a_failed_upload_keeps_the_task_so_memtrack_upload_uses_its_key() {
    let server = Server::start(&[]);
    let mut s3 = S3Server::start();
    s3.down();
    let out = scratch();
    let env: Vec<(&str, String)> = s3.env(S3_SECRET);
    let res = run_with_clearml(
        &server,
        out.path(),
        &env,
        &[
            "--clearml-project",
            "team/memory",
            "--s3-url",
            &format!("s3://{}/runs", s3.bucket),
            "--s3-endpoint",
            &s3.endpoint(),
        ],
        &["true"],
    );
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

// ---------------------------------------------------------------------------
// The job's own task: a script that calls the real ClearML SDK's `Task.init`.

/// The job: `Task.init` with the SDK's defaults except the resource monitor,
/// the argument parser and repository detection (no git, no network), five
/// steps marked with memtrack's client and reported with the SDK's logger,
/// then `task.close()`. With `wait_socket`, it first waits for memtrack's
/// socket (`attach` starts after the job).
fn sdk_job(wait_socket: bool) -> String {
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
task.close()
"#,
        client = client.display().to_string(),
        wait_socket = if wait_socket { "True" } else { "False" },
    )
}

/// What the SDK and memtrack need, with no traffic leaving the machine: the
/// proxies point at a closed loopback port (only loopback goes direct), the
/// web and files hosts too, and the SDK's home, cache and update check stay
/// local.
fn sdk_env(server: &Server, s3: &S3Server, home: &Path) -> Vec<(&'static str, String)> {
    let closed = "http://127.0.0.1:9".to_string();
    let mut env = vec![
        ("HOME", home.display().to_string()),
        ("CLEARML_API_HOST", server.url()),
        ("CLEARML_WEB_HOST", closed.clone()),
        ("CLEARML_FILES_HOST", closed.clone()),
        ("CLEARML_API_ACCESS_KEY", KEY.to_string()),
        ("CLEARML_API_SECRET_KEY", SECRET.to_string()),
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
    ];
    env.extend(s3.env(S3_SECRET));
    env
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
fn memory_in_the_scripts_task(server: &Server, id: &str, log: &str) -> Vec<Value> {
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
    assert!(suffixed.is_empty(), "series per operation: {suffixed:?}");
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

/// Checks the outcome of an SDK job run under memtrack: one task, the
/// script's; only the SDK changed its status; every memory point in it, on
/// the job's iteration axis; the SDK's scalars too; the artifact registered
/// while the task was open, pointing at the uploaded object.
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
            ("completed".to_string(), "sdk".to_string())
        ],
        "only the SDK changes the task's status"
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
    let steps: std::collections::BTreeSet<u64> = memory
        .iter()
        .filter(|p| p["metric"] == "memory/model" && p["variant"] == "cpu_ram_used_mb")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..5).collect(), "{memory:#?}");
    assert!(
        memory.iter().all(|p| p["iter"].as_u64().unwrap() <= 4),
        "memtrack's points stay on the job's axis: {memory:#?}"
    );
    assert_eq!(task["last_iteration"], 4, "the task's axis is the job's");
    let sdk_steps: Vec<u64> = all
        .iter()
        .filter(|p| p["metric"] == "loss" && p["variant"] == "train")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(sdk_steps, vec![0, 1, 2, 3, 4], "the SDK's own scalars");

    let key = format!("runs/memtrack-it/sdk job.{id}/artifacts/memory_usage/memory_usage.json");
    let uri = format!("s3://{}/{key}", s3.bucket);
    let artifacts = task["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 1, "{task:#}\n{log}");
    assert_eq!(artifacts[0]["key"], "memory_usage");
    assert_eq!(artifacts[0]["uri"], uri.as_str());
    let registered = state["artifact_log"].as_array().unwrap();
    assert!(!registered.is_empty());
    for a in registered {
        assert_eq!(a["task_status"], "in_progress", "{a}");
        assert_eq!(a["by"], "memtrack", "{a}");
    }
    // The object is the final document.
    let local = std::fs::read(document).unwrap();
    assert_eq!(s3.object(&key).as_deref(), Some(local.as_slice()), "{log}");
    server.assert_exactly_once();
}

#[test]
fn a_task_init_job_under_run_gets_the_points_and_the_artifact_in_its_own_task() {
    require_clearml_sdk();
    let server = Server::start(&[]);
    let s3 = S3Server::start();
    let out = scratch();
    let mut cmd = memtrack();
    cmd.args([
        "run",
        "--listen",
        "off",
        "--name",
        "sdk-run",
        "--interval",
        "50ms",
    ])
    .args(["--checkpoint-interval", "1s", "--output"])
    .arg(out.path())
    .args(["--s3-url", &format!("s3://{}/runs", s3.bucket)])
    .args(["--s3-endpoint", &s3.endpoint()])
    .args(["--", "python3", "-c", &sdk_job(false)]);
    for (k, v) in sdk_env(&server, &s3, out.path()) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(180));
    let log = format!("{}\n{}", String::from_utf8_lossy(&res.stdout), stderr(&res));
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
    let server = Server::start(&[]);
    let s3 = S3Server::start();
    let out = scratch();
    let socket = out.path().join("memtrack.sock");
    let env = sdk_env(&server, &s3, out.path());
    let mut job = Command::new("python3");
    job.args(["-c", &sdk_job(true)])
        .env("MEMTRACK_SOCKET", &socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in &env {
        job.env(k, v);
    }
    let job = job.spawn().unwrap();
    let pid = job.id();
    // Reaped as soon as it exits, so that memtrack sees it gone.
    let job = std::thread::spawn(move || job.wait_with_output().unwrap());
    let mut cmd = memtrack();
    cmd.args(["attach", "--pid", &pid.to_string(), "--socket"])
        .arg(&socket)
        .args([
            "--listen",
            "off",
            "--name",
            "sdk-attach",
            "--interval",
            "50ms",
        ])
        .args(["--checkpoint-interval", "1s", "--output"])
        .arg(out.path())
        .args(["--s3-url", &format!("s3://{}/runs", s3.bucket)])
        .args(["--s3-endpoint", &s3.endpoint()]);
    for (k, v) in &env {
        cmd.env(k, v);
    }
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

// ---------------------------------------------------------------------------
// The server's rules, each at its root.

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
    let server = Server::start(&[]);
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
            .args(&job)
            .env("HOME", out.path())
            .env("CLEARML_API_HOST", server.url())
            .env("CLEARML_API_ACCESS_KEY", KEY)
            .env("CLEARML_API_SECRET_KEY", SECRET);
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
        memtrack()
            .args(["run", "--listen", "off", "--name", "xy", "--output"])
            .arg(out.path())
            .arg("--")
            .args(&job)
            .env("HOME", home.path())
            .env_remove("CLEARML_API_HOST")
            .env_remove("CLEARML_CONFIG_FILE")
            .env_remove("CLEARML_API_ACCESS_KEY")
            .env_remove("CLEARML_API_SECRET_KEY"),
        Duration::from_secs(60),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    assert!(out.path().join("ran").exists(), "the job must start: {log}");
    assert!(out.path().join("xy/memory_usage.json").exists(), "{log}");
}

#[test]
fn a_project_name_is_looked_up_as_the_server_stores_it() {
    let server = Server::start(&[]);
    // The project exists, stored tidied (as the server stores `team / mem`).
    let existing = server.task("earlier run", "team/mem", "completed");
    let out = scratch();
    let res = run_with_clearml(
        &server,
        out.path(),
        &[],
        &["--clearml-project", " team /  mem// "],
        &["sh", "-c", "sleep 0.2"],
    );
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

#[test]
fn iterations_beyond_i64_never_fail_a_batch() {
    let server = Server::start(&[]);
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
    assert_eq!(
        server.calls_to("events.add_batch"),
        1,
        "no batch failed and was retried"
    );
    server.assert_exactly_once();
}

#[test]
fn a_creation_answered_504_is_looked_up_not_repeated() {
    let server = Server::start(&[]);
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
    let server = Server::start(&[]);
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

#[test]
fn clearml_auth_token_wins_over_keys_as_in_the_sdk() {
    let server = Server::start(&[]);
    let token = server.admin("POST", "/token", Some(json!({})))["token"]
        .as_str()
        .unwrap()
        .to_string();
    let out = scratch();
    // Keys in clearml.conf and in the environment, both wrong: the token wins.
    std::fs::write(
        out.path().join("clearml.conf"),
        format!(
            "api {{\n  api_server: {}\n  credentials {{\"access_key\": \"CONFKEY\", \"secret_key\": \"CONFSECRET\"}}\n}}\n",
            server.url()
        ),
    )
    .unwrap();
    let mut cmd = memtrack();
    cmd.args([
        "run",
        "--listen",
        "off",
        "--name",
        "job",
        "--interval",
        "50ms",
    ])
    .args(["--clearml-project", "memtrack-it", "--output"])
    .arg(out.path())
    .args(["--", "sh", "-c", "sleep 0.2"])
    .env("HOME", out.path())
    .env("CLEARML_AUTH_TOKEN", &token)
    .env("CLEARML_API_ACCESS_KEY", "WRONGKEY")
    .env("CLEARML_API_SECRET_KEY", "WRONGSECRET");
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let state = server.state();
    assert_eq!(state["auth_failures"], 0, "{log}");
    assert_eq!(state["login_kinds"]["basic"], 0, "{log}");
    assert_eq!(state["tasks"].as_object().unwrap().len(), 1, "{log}");
    server.assert_exactly_once();
}

#[test]
fn announcements_of_other_tasks_and_malformed_ones_change_nothing() {
    let server = Server::start(&[]);
    // A task the job "made" (as the SDK would), already running.
    let id = server.task("job task", "memtrack-it", "in_progress");
    let out = scratch();
    let script = format!(
        "import os, socket, json\n\
         s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])\n\
         f = s.makefile('rw')\n\
         def ask(obj):\n\
         \x20   f.write(json.dumps(obj) + '\\n'); f.flush(); return json.loads(f.readline())\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True, 'id': 1}})\n\
         assert r['ok'] and r['clearml'] and r['reporting'], r\n\
         for i in range(300):\n\
         \x20   r = ask({{'type': 'clearml_task', 'task': 'other%d' % i, 'ack': True, 'id': i}})\n\
         \x20   assert r['ok'] and not r['reporting'] and {id:?} in r['message'], r\n\
         for bad in ['', 'a b', '../x', 'x' * 65, 7, None]:\n\
         \x20   r = ask({{'type': 'clearml_task', 'task': bad, 'ack': True}})\n\
         \x20   assert not r['ok'] and r['error'] == 'invalid', r\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True}})\n\
         assert r['reporting'], r\n\
         for i in range(3):\n\
         \x20   ask({{'type': 'mark', 'component': 'model', 'operation': 'step', 'iteration': i, 'ack': True}})\n"
    );
    let res = run_with_clearml(&server, out.path(), &[], &[], &["python3", "-c", &script]);
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let state = server.state();
    assert_eq!(state["tasks"].as_object().unwrap().len(), 1, "{state:#}");
    assert_eq!(
        state["tasks"][&id]["status"], "in_progress",
        "its status stays"
    );
    assert!(
        state["status_log"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["by"] != "memtrack"),
        "{state:#}"
    );
    let steps: std::collections::BTreeSet<u64> = server
        .points(&id)
        .iter()
        .filter(|p| p["metric"] == "memory/model")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..3).collect());
    let noted = log.matches("is left alone").count();
    assert!(
        (1..=5).contains(&noted),
        "rate-limited log: {noted} lines\n{log}"
    );
    server.assert_exactly_once();
}

#[test]
fn the_runs_advice_is_appended_to_its_tasks_description() {
    let server = Server::start(&[]);
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
    let res = run_with_clearml(
        &server,
        out.path(),
        &[("PYTHONPATH", client.display().to_string())],
        &["--clearml-project", "team/memory", "--no-gpu"],
        &job.iter().map(String::as_str).collect::<Vec<_>>(),
    );
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

// ---------------------------------------------------------------------------
// Zero configuration: what `clearml-init` leaves is enough.

/// The fileserver stand-in (tests/servers/clearml_fileserver.py), killed
/// on drop.
pub(crate) struct FileServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl FileServer {
    pub(crate) fn start() -> FileServer {
        let dir = scratch();
        let ports = dir.path().join("port.json");
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/servers/clearml_fileserver.py");
        let mut child = Command::new("python3")
            .arg(&script)
            .arg("--port-file")
            .arg(&ports)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the fileserver stand-in");
        let deadline = Instant::now() + Duration::from_secs(15);
        let port = loop {
            if let Some(p) = std::fs::read_to_string(&ports)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            {
                break p["port"].as_u64().unwrap() as u16;
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the fileserver stand-in exited: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "no port file from the fileserver"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        FileServer {
            child,
            port,
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
    let mut cmd = memtrack();
    cmd.args([
        "run",
        "--listen",
        "off",
        "--name",
        name,
        "--interval",
        "50ms",
        "--output",
    ])
    .arg(out)
    .args(["--", "python3", "-c", script])
    .env("MEMTRACK_CLEARML_TIMER_EVERY", "1s")
    .env("MEMTRACK_CLEARML_TIME_AXIS_AFTER", "1s")
    .env("MEMTRACK_CLEARML_FLUSH_INTERVAL", "200ms");
    for var in [
        "CLEARML_API_HOST",
        "CLEARML_TASK_ID",
        "CLEARML_API_ACCESS_KEY",
        "CLEARML_API_SECRET_KEY",
        "CLEARML_CONFIG_FILE",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(180));
    (
        res.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&res.stdout).into_owned(),
        stderr(&res),
    )
}

#[test]
fn a_task_init_job_with_only_clearml_conf_gets_memory_charts_on_a_time_axis() {
    require_clearml_sdk();
    let server = Server::start(&[]);
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
    let reply: Value = serde_json::from_str(
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("REPLY "))
            .unwrap_or_else(|| panic!("no reply: {all}")),
    )
    .unwrap();
    assert_eq!(reply["clearml"], true, "{all}");
    assert_eq!(reply["reporting"], true, "{reply}\n{all}");
    let id = stdout
        .lines()
        .find_map(|l| l.strip_prefix("TASK "))
        .unwrap_or_else(|| panic!("no task: {all}"))
        .to_string();
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
    let server = Server::start(&[]);
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
    let id = stdout
        .lines()
        .find_map(|l| l.strip_prefix("TASK "))
        .unwrap_or_else(|| panic!("no task: {all}"))
        .to_string();
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
    let reply: Value = serde_json::from_str(
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("REPLY "))
            .unwrap_or_else(|| panic!("no reply: {all}")),
    )
    .unwrap();
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
    let server = Server::start(&[]);
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
    let memory: Vec<Value> = server
        .points(id)
        .into_iter()
        .filter(|p| p["metric"].as_str().unwrap().starts_with("memory/"))
        .collect();
    let steps: std::collections::BTreeSet<u64> = memory
        .iter()
        .filter(|p| p["metric"] == "memory/model" && p["variant"] == "cpu_ram_used_mb")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..5).collect(), "{memory:#?}");
    assert!(
        memory.iter().all(|p| p["iter"].as_u64().unwrap() <= 4),
        "the job reports iterations: no time axis: {memory:#?}"
    );
    assert_eq!(task["last_iteration"], 4, "the task's axis is the job's");
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

/// What once broke: two million fire-and-forget announcements of other
/// tasks wrote 20,000 WARN lines (one per hundred) and grew memtrack to
/// 60.7 MiB (an unbounded queue).
#[test]
fn a_flood_of_announcements_costs_a_few_lines_and_bounded_memory() {
    let server = Server::start(&[]);
    let id = server.task("job task", "memtrack-it", "in_progress");
    let out = scratch();
    let figures = out.path().join("rss");
    let script = format!(
        "import os, socket, json\n\
         s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])\n\
         f = s.makefile('rwb')\n\
         def ask(obj):\n\
         \x20   f.write((json.dumps(obj) + '\\n').encode()); f.flush(); return json.loads(f.readline())\n\
         def kib(key):\n\
         \x20   for l in open('/proc/%d/status' % os.getppid()):\n\
         \x20       if l.startswith(key): return int(l.split()[1])\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True}})\n\
         assert r['reporting'], r\n\
         before = kib('VmHWM:')\n\
         burst = b''.join(b'{{\"type\":\"clearml_task\",\"task\":\"other%d\"}}\\n' % i for i in range(10000))\n\
         for _ in range(100):\n\
         \x20   f.write(burst)\n\
         f.flush()\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True}})\n\
         assert r['reporting'], r\n\
         open({figures:?}, 'w').write('%d %d' % (before, kib('VmHWM:')))\n",
        figures = figures.display().to_string()
    );
    let res = run_with_clearml(&server, out.path(), &[], &[], &["python3", "-c", &script]);
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let noted = log.matches("is left alone").count();
    assert!(
        (1..=6).contains(&noted),
        "a million announcements: {noted} lines, {} bytes of log",
        log.len()
    );
    let text = std::fs::read_to_string(&figures).unwrap();
    let kib: Vec<u64> = text.split(' ').map(|v| v.parse().unwrap()).collect();
    let grew_mib = kib[1].saturating_sub(kib[0]) as f64 / 1024.0;
    eprintln!(
        "{noted} warning lines; memtrack's peak RSS before the flood {} KiB, after {} KiB",
        kib[0], kib[1]
    );
    // At most 64 announcements wait for the reporter: the flood costs
    // parsing buffers, not a queue of a million.
    assert!(
        grew_mib < 16.0,
        "memtrack grew {grew_mib:.1} MiB during the flood"
    );
}
