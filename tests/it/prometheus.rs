//! The Grafana dashboard and the Prometheus alerting rules of dashboards/,
//! against real servers: promtool checks and unit-tests the rules and lints
//! a real scrape; a real Prometheus scraping a real daemon (fake NVML, a
//! Python job sending marks with allocator figures) must answer every panel
//! query of the dashboard with data, and evaluate every rule without error.
//!
//! Needs `prometheus` and `promtool` (Prometheus 2.x) in PATH: scripts/test
//! installs the Debian package `prometheus`. Missing tools fail the tests
//! rather than skip them, so a broken dashboard cannot pass unnoticed.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memtrack::export::prometheus::{Kind, METRICS};
use serde_json::Value;

use crate::common::*;

const DASHBOARD: &str = "dashboards/memtrack.json";
const RULES: &str = "dashboards/alerts.yml";
const RULE_TESTS: &str = "dashboards/alerts.test.yml";

/// What Grafana puts for `$__rate_interval` with a data source whose scrape
/// interval is left at 15 s: max(4 × 15 s, $__interval + 15 s) ≥ 1 m. The
/// run below is scraped every second, so a minute holds every point of it
/// (at least 3 are awaited before any query).
const RATE_INTERVAL: &str = "1m";

/// Families a rich run (below, with `--smaps`) may lack. Empty: every
/// family of `METRICS` must be in the scrape that `promtool check metrics`
/// lints. A new family that only some runs export goes here, with why.
const NOT_IN_SCRAPE: &[&str] = &[
    // The leak rule judges a run after 20 s of samples; the rich run is
    // scraped before. `memtracks_verdicts_are_metrics_during_a_short_leaking_run`
    // scrapes them.
    "memtrack_leak_suspected",
    "memtrack_leak_growth_bytes",
    "memtrack_process_leak_suspected",
    // Served only while memory climbs steadily towards a limit;
    // `a_job_growing_to_its_limit_is_forecast_on_metrics_and_to_its_subscribers`
    // (tests/it/advice.rs) scrapes it.
    "memtrack_seconds_to_limit",
];

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `prometheus` or `promtool` from PATH, or a failure saying how to get it.
pub(crate) fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is not in PATH. The dashboard and alert tests need Prometheus 2.x \
                 (`prometheus` and `promtool`) and do not skip without it: scripts/test installs \
                 the Debian package `prometheus` (CI runs scripts/test); by hand: \
                 `sudo apt-get install prometheus`."
            )
        })
}

fn run_tool(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

// ---------------------------------------------------------------- rules

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let promtool = tool("promtool");
    let (ok, text) = run_tool(
        Command::new(&promtool)
            .args(["check", "rules"])
            .arg(repo(RULES)),
    );
    println!("promtool check rules {RULES}:\n{text}");
    assert!(ok, "promtool check rules failed:\n{text}");
    assert!(!text.contains("WARNING"), "promtool warned:\n{text}");

    let (ok, text) = run_tool(
        Command::new(&promtool)
            .args(["test", "rules"])
            .arg(repo(RULE_TESTS)),
    );
    println!("promtool test rules {RULE_TESTS}:\n{text}");
    assert!(ok, "promtool test rules failed:\n{text}");

    // Every alert has labels.severity, a summary and a description, and
    // unit tests that expect it to fire somewhere and not to fire elsewhere.
    let rules = std::fs::read_to_string(repo(RULES)).unwrap();
    let tests = std::fs::read_to_string(repo(RULE_TESTS)).unwrap();
    let alerts = rule_blocks(&rules);
    assert!(alerts.len() >= 9, "{alerts:?}");
    for (name, block) in &alerts {
        for key in ["severity:", "summary:", "description:", "expr:"] {
            assert!(block.contains(key), "alert {name} has no `{key}`:\n{block}");
        }
        let cases = test_cases(&tests, name);
        assert!(
            cases.iter().any(|firing| *firing),
            "no test of {RULE_TESTS} expects {name} to fire"
        );
        assert!(
            cases.iter().any(|firing| !*firing),
            "no test of {RULE_TESTS} expects {name} to stay quiet"
        );
    }
    let known: BTreeSet<&str> = alerts.iter().map(|(n, _)| n.as_str()).collect();
    for line in tests.lines() {
        if let Some(name) = line.trim().strip_prefix("alertname:") {
            assert!(
                known.contains(name.trim()),
                "{RULE_TESTS} tests an unknown alert {name}"
            );
        }
    }
    for metric in metric_names(&rules) {
        assert!(
            is_exported(&metric),
            "{RULES} uses {metric}, which /metrics does not serve"
        );
    }
}

/// (alert name, its text) for every `- alert:` of a rules file.
fn rule_blocks(rules: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in rules.lines() {
        let t = line.trim_start();
        if t.starts_with("- alert:") || t.starts_with("- record:") || t.starts_with("- name:") {
            out.extend(current.take());
            current = t
                .strip_prefix("- alert:")
                .map(|n| (n.trim().to_string(), String::new()));
        }
        if let Some((_, block)) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
        }
    }
    out.extend(current);
    out
}

/// For each `alertname: NAME` case of the unit tests: whether it expects
/// alerts (`exp_alerts:` followed by entries) or none (`exp_alerts: []`).
fn test_cases(tests: &str, name: &str) -> Vec<bool> {
    let lines: Vec<&str> = tests.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().strip_prefix("alertname:").map(str::trim) != Some(name) {
            continue;
        }
        let exp = lines[i + 1..]
            .iter()
            .find(|l| l.trim().starts_with("exp_alerts:"))
            .unwrap();
        out.push(exp.trim() != "exp_alerts: []");
    }
    out
}

// ---------------------------------------------------------------- dashboard, statically

fn dashboard() -> Value {
    let text = std::fs::read_to_string(repo(DASHBOARD)).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

/// Panels that query (rows do not), nested rows' panels included.
fn query_panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten());
        } else {
            out.push(p);
        }
    }
    out
}

/// (panel title, refId, expr, legendFormat) of every target.
fn targets(dash: &Value) -> Vec<(String, String, String, String)> {
    let mut out = Vec::new();
    for p in query_panels(dash) {
        for t in p["targets"].as_array().unwrap() {
            out.push((
                p["title"].as_str().unwrap().to_string(),
                t["refId"].as_str().unwrap().to_string(),
                t["expr"].as_str().unwrap().to_string(),
                t["legendFormat"].as_str().unwrap_or("").to_string(),
            ));
        }
    }
    out
}

/// `memtrack_*` metric names in a text, each once.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("memtrack_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let before = start.checked_sub(1).map(|b| bytes[b]);
        if !before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

/// Whether a series name is served: a family of `METRICS`, or a histogram
/// family's `_bucket` / `_sum` / `_count`.
fn is_exported(series: &str) -> bool {
    METRICS.iter().any(|d| {
        d.name == series
            || (d.kind == Kind::Histogram
                && ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| series == format!("{}{s}", d.name)))
    })
}

/// The labels a series has beyond the run labels.
fn labels_of(series: &str) -> &'static [&'static str] {
    let family = series
        .trim_end_matches("_bucket")
        .trim_end_matches("_sum")
        .trim_end_matches("_count");
    METRICS
        .iter()
        .find(|d| d.name == series || d.name == family)
        .map(|d| d.labels)
        .unwrap_or(&[])
}

/// Every `memtrack_x{…}` selector of an expression: (name, matchers).
fn selectors(expr: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for name in metric_names(expr) {
        let mut from = 0;
        while let Some(at) = expr[from..].find(name.as_str()) {
            let start = from + at;
            let end = start + name.len();
            from = end;
            let before_ok = start == 0
                || !(expr.as_bytes()[start - 1].is_ascii_alphanumeric()
                    || expr.as_bytes()[start - 1] == b'_');
            let after = expr[end..].chars().next();
            if !before_ok || after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue; // a longer name
            }
            let rest = expr[end..].trim_start();
            let matchers = if rest.starts_with('{') {
                rest[1..rest.find('}').unwrap()].to_string()
            } else {
                String::new()
            };
            out.push((name.clone(), matchers));
        }
    }
    out
}

#[test]
fn dashboard_imports_cleanly_and_filters_every_query() {
    let dash = dashboard();
    assert!(
        dash["schemaVersion"].as_u64().unwrap() >= 38,
        "schemaVersion"
    );
    assert!(dash["id"].is_null(), "an exported dashboard has `id: null`");
    assert_eq!(dash["uid"], "memtrack");
    let inputs = dash["__inputs"].as_array().unwrap();
    assert!(
        inputs.iter().any(|i| i["name"] == "DS_PROMETHEUS"
            && i["type"] == "datasource"
            && i["pluginId"] == "prometheus"),
        "__inputs must declare the DS_PROMETHEUS data source: {inputs:?}"
    );
    let is_ds = |v: &Value| v["uid"] == "${DS_PROMETHEUS}" && v["type"] == "prometheus";

    // Template variables.
    let vars = dash["templating"]["list"].as_array().unwrap();
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no variable {name}"))
    };
    let query = |v: &Value| {
        v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap()
            .to_string()
    };
    assert_eq!(
        query(var("instance")),
        "label_values(memtrack_build_info, instance)"
    );
    assert_eq!(
        query(var("run")),
        r#"label_values(memtrack_build_info{instance=~"$instance"}, run)"#
    );
    assert_eq!(
        query(var("gpu")),
        r#"label_values(memtrack_gpu_memory_total_bytes{run=~"$run"}, gpu)"#
    );
    assert_eq!(var("gpu")["includeAll"], true);
    for v in vars {
        assert!(
            is_ds(&v["datasource"]),
            "variable {} data source: {}",
            v["name"],
            v["datasource"]
        );
        assert_eq!(
            v["definition"].as_str().unwrap(),
            query(v),
            "definition of {}",
            v["name"]
        );
    }

    // Panels.
    let mut ids = BTreeSet::new();
    let mut units = BTreeMap::new();
    for p in dash["panels"].as_array().unwrap() {
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "panel id {} twice",
            p["id"]
        );
        let g = &p["gridPos"];
        assert!(
            g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24,
            "{} overflows the grid",
            p["title"]
        );
    }
    for p in query_panels(&dash) {
        let title = p["title"].as_str().unwrap();
        assert!(
            is_ds(&p["datasource"]),
            "panel {title:?} data source: {}",
            p["datasource"]
        );
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        let refs: BTreeSet<&str> = targets
            .iter()
            .map(|t| t["refId"].as_str().unwrap())
            .collect();
        assert_eq!(refs.len(), targets.len(), "panel {title:?}: refIds repeat");
        for t in targets {
            assert!(
                is_ds(&t["datasource"]),
                "panel {title:?} target data source: {}",
                t["datasource"]
            );
        }
        if p["type"] != "table" {
            let unit = p["fieldConfig"]["defaults"]["unit"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?} has no unit"));
            units.insert(title.to_string(), unit.to_string());
        }
    }
    // Units as Grafana names them.
    const GRAFANA_UNITS: &[&str] = &[
        "bytes",
        "percentunit",
        "celsius",
        "s",
        "short",
        "eps",
        "hertz",
        "none",
    ];
    for (title, unit) in &units {
        assert!(
            GRAFANA_UNITS.contains(&unit.as_str()) || unit.starts_with("suffix:"),
            "panel {title:?}: unit {unit:?}"
        );
    }

    // Every query: only exported metrics, each selector filtered on the
    // template variables ($gpu where the series has a `gpu` label).
    let all = targets(&dash);
    for (title, refid, expr, _) in &all {
        let sel = selectors(expr);
        assert!(
            !sel.is_empty(),
            "{title}/{refid} reads no memtrack metric: {expr}"
        );
        for (name, matchers) in sel {
            assert!(
                is_exported(&name),
                "{title}/{refid}: {name} is not served by /metrics"
            );
            for want in [r#"instance=~"$instance""#, r#"run=~"$run""#] {
                assert!(
                    matchers.contains(want),
                    "{title}/{refid}: {name}{{{matchers}}} lacks {want}"
                );
            }
            if labels_of(&name).contains(&"gpu") {
                assert!(
                    matchers.contains(r#"gpu=~"$gpu""#),
                    "{title}/{refid}: {name}{{{matchers}}} lacks gpu=~\"$gpu\""
                );
            }
        }
    }

    // The views the dashboard is for (what the issue asks).
    let uses = |what: &str| all.iter().any(|(_, _, e, _)| e.contains(what));
    for what in [
        "memtrack_process_resident_memory_bytes",
        "memtrack_process_gpu_memory_bytes",
        "memtrack_gpu_memory_used_bytes",
        "memtrack_gpu_memory_total_bytes",
        "memtrack_component_peak_memory_bytes",
        "rate(memtrack_events_total",
        "memtrack_pressure_level",
        "deriv(memtrack_tree_resident_memory_bytes",
        "memtrack_allocator_allocated_bytes",
        "memtrack_allocator_reserved_bytes",
        "memtrack_allocator_max_allocated_bytes",
        "histogram_quantile(0.99, sum by (instance, run, le) (rate(memtrack_tick_duration_seconds_bucket",
        "memtrack_missed_ticks_total",
        "memtrack_dropped_events_total",
        "memtrack_protocol_errors_total",
        "memtrack_nvml_up",
        "memtrack_export_errors_total",
    ] {
        assert!(uses(what), "no panel query uses {what}");
    }
    let pressure = query_panels(&dash)
        .into_iter()
        .find(|p| p["title"] == "Pressure level")
        .unwrap();
    let mapping = pressure["fieldConfig"]["defaults"]["mappings"][0]["options"].clone();
    for (value, text) in [
        ("0", "normal"),
        ("1", "high"),
        ("2", "critical"),
        ("3", "emergency"),
    ] {
        assert_eq!(
            mapping[value]["text"], text,
            "pressure value mapping {value}"
        );
    }
}

// ---------------------------------------------------------------- a rich run

/// The fake driver at memtrack's start: two GPUs, GPU 1 80 % used by
/// someone else (pressure `high`).
const GPUS: &str = "device 0 name=NVIDIA_Fake_H100 total_mib=81559 util_gpu=37 temp=41\n\
                    device 1 total_mib=1000 used_mib=800 util_gpu=5 temp=55\n";

/// The job: publishes its own PID on both fake GPUs (as a CUDA process would
/// appear in NVML), opens a stage, then until `stop` exists (or its parent
/// is gone, or a minute passed) grows its RSS and sends `model` spans and
/// `data` marks with PyTorch allocator figures, acknowledged.
const JOB: &str = r#"
import json, os, socket, sys, time
state, stop, gpus = sys.argv[1], sys.argv[2], sys.argv[3]
pid, parent = os.getpid(), os.getppid()
tmp = state + '.tmp'
with open(tmp, 'w') as f:
    f.write(gpus + 'process 0 %d 1500\nprocess 1 %d 100\n' % (pid, pid))
os.replace(tmp, state)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ['MEMTRACK_SOCKET'])
replies = s.makefile('r')
def send(**m):
    m['ack'] = True
    s.sendall((json.dumps(m) + '\n').encode())
    r = json.loads(replies.readline())
    if not r.get('ok'):
        sys.exit('memtrack refused %r: %r' % (m, r))
send(type='stage_begin', name='train')
hog, i, deadline = [], 0, time.time() + 60
while not os.path.exists(stop) and os.getppid() == parent and time.time() < deadline:
    hog.append(b'x' * (256 << 10))
    a = {'allocated': (100 + i) << 20, 'reserved': (256 + i) << 20, 'max_allocated': (120 + i) << 20, 'device': 0}
    send(type='span_begin', component='model', operation='forward', iteration=i, allocator=a)
    time.sleep(0.05)
    send(type='span_end', component='model', operation='forward', iteration=i, allocator=a)
    send(component='data', operation='batch', iteration=i)
    i += 1
    time.sleep(0.1)
send(type='stage_end', name='train')
"#;

/// A daemon following [`JOB`], and a Prometheus when one is started. Drop
/// stops them all, test failed or not: the job sees `stop` and ends, so
/// does memtrack; what does not end in time is killed.
struct Rig {
    dir: tempfile::TempDir,
    stop: PathBuf,
    daemon: Option<Daemon>,
    prometheus: Option<Child>,
}

impl Rig {
    fn start(smaps: bool) -> Rig {
        let dir = scratch();
        let state = dir.path().join("nvml-state");
        std::fs::write(&state, GPUS).unwrap();
        let stop = dir.path().join("stop");
        let lib = fake_nvml().display().to_string();
        let mut extra = vec!["--interval", "200ms", "--nvml-lib", &lib];
        if smaps {
            extra.push("--smaps");
        }
        let mut job = python(JOB);
        job.extend([
            state.display().to_string(),
            stop.display().to_string(),
            GPUS.to_string(),
        ]);
        let state_env = state.display().to_string();
        let daemon = Daemon::start(
            &dir.path().join("out"),
            &extra,
            &job,
            &[("FAKE_NVML_STATE", &state_env)],
        );
        Rig {
            dir,
            stop,
            daemon: Some(daemon),
            prometheus: None,
        }
    }

    fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().unwrap()
    }

    fn metrics(&self) -> String {
        let (status, body) = self.daemon().http("GET", "/metrics");
        assert_eq!(status, 200, "{body}");
        body
    }

    /// Stops everything and checks the run ended well.
    fn finish(mut self) {
        stop_child(self.prometheus.take(), "prometheus");
        std::fs::write(&self.stop, "").unwrap();
        let child = &mut self.daemon.as_mut().unwrap().child;
        let ended = exits_within(child, Duration::from_secs(15));
        assert!(
            ended,
            "memtrack did not end after its job was told to stop:\n{}",
            self.daemon().stderr()
        );
        let daemon = self.daemon.take().unwrap();
        let stderr = daemon.stderr();
        let (code, doc) = daemon.finish();
        assert_eq!(code, Some(0), "memtrack:\n{stderr}");
        assert!(
            doc.counters.protocol_errors == 0,
            "the job's messages were all valid:\n{stderr}"
        );
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        stop_child(self.prometheus.take(), "prometheus");
        let _ = std::fs::write(&self.stop, "");
        if let Some(mut d) = self.daemon.take() {
            if !exits_within(&mut d.child, Duration::from_secs(5)) {
                stop_child(Some(d.child), "memtrack");
            }
        }
    }
}

/// SIGTERM, a few seconds' grace, then SIGKILL; always reaped.
pub(crate) fn stop_child(child: Option<Child>, what: &str) {
    let Some(mut child) = child else { return };
    if child.try_wait().ok().flatten().is_some() {
        return;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    if !exits_within(&mut child, Duration::from_secs(5)) {
        eprintln!("{what} ignored SIGTERM; killing it");
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn exits_within(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Waits until the daemon serves the job's series (GPU processes, allocator
/// figures, events).
fn wait_for_the_job(rig: &Rig) {
    wait_for(
        "the job's series in /metrics",
        Duration::from_secs(15),
        || {
            let m = rig.metrics();
            [
                "memtrack_process_gpu_memory_bytes{",
                "memtrack_allocator_allocated_bytes{",
                "component=\"data\"",
            ]
            .iter()
            .all(|s| m.contains(s))
        },
    );
}

// ---------------------------------------------------------------- promtool check metrics

#[test]
fn a_real_scrape_passes_promtool_check_metrics() {
    let promtool = tool("promtool");
    let rig = Rig::start(true);
    wait_for_the_job(&rig);
    let body = rig.metrics();

    // Every family is there, so the lint covers all of them.
    let missing: Vec<&str> = METRICS
        .iter()
        .map(|d| d.name)
        .filter(|n| !NOT_IN_SCRAPE.contains(n) && !body.contains(&format!("# TYPE {n} ")))
        .collect();
    assert!(missing.is_empty(), "families missing from a rich scrape (make the job produce them, or list them in NOT_IN_SCRAPE with why): {missing:?}\n{body}");

    promtool_check_metrics(&promtool, &body);
    rig.finish();
}

/// `promtool check metrics` on a scrape; any lint message fails.
fn promtool_check_metrics(promtool: &Path, body: &str) {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "promtool check metrics on {} lines: {:?} {text}",
        body.lines().count(),
        out.status
    );
    // No exception: any lint message (promtool exits 0 on some) fails.
    assert!(
        out.status.success() && text.trim().is_empty(),
        "promtool check metrics:\n{text}\n--- scrape:\n{body}"
    );
}

/// Families only a GPU (NVML) or a job sending PyTorch's allocator figures
/// produces: a host-only daemon whose job says nothing cannot serve them.
fn needs_gpu_or_allocator(name: &str) -> bool {
    [
        "memtrack_gpu_",
        "memtrack_process_gpu_",
        "memtrack_tree_gpu_",
        "memtrack_allocator_",
    ]
    .iter()
    .any(|p| name.starts_with(p))
}

#[test]
fn a_fresh_daemon_serves_every_metric_the_dashboard_queries() {
    let promtool = tool("promtool");
    let queried: BTreeSet<String> = targets(&dashboard())
        .iter()
        .flat_map(|(_, _, expr, _)| metric_names(expr))
        .collect();
    assert!(
        queried.contains("memtrack_events_total") && queried.len() > 10,
        "the dashboard's queries were read: {queried:?}"
    );
    // A host-only daemon whose job sends nothing: no event, span, stage or
    // export has happened yet.
    let out = scratch();
    let stop = out.path().join("stop");
    let job = python(&format!(
        "import os, time\nwhile not os.path.exists({:?}): time.sleep(0.05)\n",
        stop.display().to_string()
    ));
    let d = Daemon::start(out.path(), &["--interval", "100ms", "--no-gpu"], &job, &[]);
    // After its first sample (host figures come from it).
    let mut body = String::new();
    wait_for("the first sample", Duration::from_secs(15), || {
        let (status, text) = d.http("GET", "/metrics");
        body = text;
        status == 200 && body.contains("memtrack_host_memory_total_bytes{")
    });
    let served = |name: &str| {
        body.lines().any(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(['{', ' ']))
        })
    };
    let missing: Vec<&String> = queried
        .iter()
        .filter(|n| !needs_gpu_or_allocator(n) && !served(n))
        .collect();
    promtool_check_metrics(&promtool, &body);
    std::fs::write(&stop, "").unwrap();
    let (code, _) = d.finish();
    assert_eq!(code, Some(0));
    assert!(
        missing.is_empty(),
        "the dashboard queries these, which a fresh daemon does not serve: {missing:?}\n{body}"
    );
}

// ---------------------------------------------------------------- a real Prometheus

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET over HTTP/1.0 (so Prometheus neither chunks nor keeps the
/// connection): (status, body).
pub(crate) fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
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

pub(crate) fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `/api/v1/<path>`'s `data`, requiring `status: success`.
pub(crate) fn api(prom: SocketAddr, path: &str) -> Value {
    let (code, body) = get(prom, &format!("/api/v1/{path}"));
    let v: Value = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("GET /api/v1/{path}: HTTP {code}: {e}: {body}"));
    assert_eq!(
        v["status"], "success",
        "GET /api/v1/{path}: HTTP {code}: {body}"
    );
    v["data"].clone()
}

/// An instant query's result vector.
pub(crate) fn query(prom: SocketAddr, expr: &str) -> Vec<Value> {
    let data = api(prom, &format!("query?query={}", url_encode(expr)));
    assert_eq!(data["resultType"], "vector", "{expr}: {data}");
    data["result"].as_array().unwrap().clone()
}

/// Grafana's escaping of a multi-value / include-All variable's value in a
/// Prometheus query (`prometheusSpecialRegexEscape`).
fn grafana_regex_escape(value: &str) -> String {
    let mut out = String::new();
    for c in value.chars() {
        match c {
            '\\' => out.push_str(r"\\\\"),
            '$' | '^' | '*' | '{' | '}' | '[' | ']' | '\'' | '+' | '?' | '.' | '(' | ')' | '|' => {
                out.push_str(r"\\");
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}

/// A panel's expression as Grafana sends it, with `vars` selected.
fn interpolate(expr: &str, vars: &[(&str, String)]) -> String {
    let mut out = expr.replace("$__rate_interval", RATE_INTERVAL);
    for (name, value) in vars {
        out = out
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("${name}"), value);
    }
    // What remains may only be label_replace's `$1`.
    let rest: Vec<&str> = out
        .match_indices('$')
        .map(|(i, _)| &out[i..(i + 2).min(out.len())])
        .collect();
    assert!(
        rest.iter()
            .all(|r| r[1..].starts_with(|c: char| c.is_ascii_digit())),
        "unknown variable in {expr}: {rest:?}"
    );
    out
}

/// Grafana's `label_values(SELECTOR, LABEL)` through the labels API.
fn label_values(prom: SocketAddr, var_query: &str) -> Vec<String> {
    let inner = var_query
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
        .unwrap();
    let (selector, label) = inner.rsplit_once(',').unwrap();
    let data = api(
        prom,
        &format!(
            "label/{}/values?match[]={}",
            label.trim(),
            url_encode(selector.trim())
        ),
    );
    data.as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn every_panel_query_returns_data_from_a_real_prometheus() {
    let prometheus = tool("prometheus");
    let mut rig = Rig::start(false);
    let target = rig.daemon().http;
    let instance = target.to_string();

    let port = free_port();
    let prom: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let config = rig.dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: memtrack\n    static_configs:\n      - targets: ['{instance}']\n",
            rules = repo(RULES).display()
        ),
    )
    .unwrap();
    let log = rig.dir.path().join("prometheus.log");
    rig.prometheus = Some(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                rig.dir.path().join("tsdb").display()
            ))
            .arg("--storage.tsdb.retention.time=1h")
            .arg(format!("--web.listen-address={prom}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let prom_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(prom, "/-/ready").0 != 200 {
        if let Some(status) = rig.prometheus.as_mut().unwrap().try_wait().unwrap() {
            panic!("prometheus exited ({status}):\n{}", prom_log());
        }
        assert!(
            Instant::now() < deadline,
            "prometheus not ready in 20 s:\n{}",
            prom_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Data: at least 3 scrapes of every series, so that rate(), increase()
    // and deriv() have points to work with. The daemon's own series exist
    // from its start (so 3 scrapes are enough for them); the job's appear a
    // little later and are counted themselves.
    wait_for_the_job(&rig);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let scraped = [
            "up",
            "memtrack_process_gpu_memory_bytes",
            "memtrack_allocator_allocated_bytes",
            "memtrack_events_total",
            "memtrack_pressure_level",
        ]
        .iter()
        .map(|m| {
            let r = query(
                prom,
                &format!("min(count_over_time({m}{{job=\"memtrack\"}}[1m]))"),
            );
            r.first()
                .and_then(|r| r["value"][1].as_str()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        })
        .fold(f64::INFINITY, f64::min);
        if scraped >= 3.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no data in prometheus after 20 s (targets: {})\nprometheus:\n{}\nmemtrack:\n{}",
            api(prom, "targets"),
            prom_log(),
            rig.daemon().stderr()
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    let dash = dashboard();

    // Template variables, in order, as Grafana resolves them.
    let vars_json = dash["templating"]["list"].as_array().unwrap();
    let var_query = |name: &str| {
        let v = vars_json.iter().find(|v| v["name"] == name).unwrap();
        v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap()
            .to_string()
    };
    let instances = label_values(prom, &var_query("instance"));
    assert!(
        instances.contains(&instance),
        "$instance values {instances:?} lack {instance}"
    );
    let mut vars = vec![("instance", grafana_regex_escape(&instance))];
    let runs = label_values(prom, &interpolate(&var_query("run"), &vars));
    assert_eq!(runs, ["d"], "$run values");
    vars.push(("run", grafana_regex_escape("d")));
    let gpus = label_values(prom, &interpolate(&var_query("gpu"), &vars));
    assert_eq!(gpus, ["0", "1"], "$gpu values");
    println!("template variables: instance {instances:?}, run {runs:?}, gpu {gpus:?}");

    // Every panel query, with $gpu = All, then with one GPU (1) selected.
    let all_gpus: Vec<(&str, String)> = vars
        .iter()
        .cloned()
        .chain([("gpu", ".*".to_string())])
        .collect();
    let one_gpu: Vec<(&str, String)> = vars
        .iter()
        .cloned()
        .chain([("gpu", "1".to_string())])
        .collect();
    let mut checked = 0;
    for (title, refid, expr, legend) in targets(&dash) {
        for (selection, vars) in [("gpu=All", &all_gpus), ("gpu=1", &one_gpu)] {
            if selection == "gpu=1" && !expr.contains("$gpu") {
                continue;
            }
            let sent = interpolate(&expr, vars);
            let result = query(prom, &sent);
            println!(
                "checked {title} / {refid} ({selection}): {} series: {sent}",
                result.len()
            );
            assert!(
                !result.is_empty(),
                "panel {title:?} query {refid} ({selection}) returned no data:\n{sent}"
            );
            for series in &result {
                let labels = &series["metric"];
                // The legend only names labels the series has.
                for name in legend
                    .split("{{")
                    .skip(1)
                    .filter_map(|s| s.split_once("}}"))
                    .map(|(n, _)| n.trim())
                {
                    assert!(labels.get(name).is_some(), "panel {title:?} {refid}: legend {legend:?} names `{name}`, missing from {labels}");
                }
                if selection == "gpu=1" {
                    if let Some(g) = labels.get("gpu") {
                        assert_eq!(
                            g, "1",
                            "panel {title:?} {refid}: $gpu=1 let {labels} through"
                        );
                    }
                }
                assert_eq!(
                    labels.get("run").map_or("d", |r| r.as_str().unwrap()),
                    "d",
                    "{title}: {labels}"
                );
            }
            // Panel-specific expectations.
            let resources = |r: &[Value]| -> BTreeMap<String, String> {
                r.iter()
                    .map(|s| {
                        (
                            s["metric"]["resource"].as_str().unwrap().to_string(),
                            s["value"][1].as_str().unwrap().to_string(),
                        )
                    })
                    .collect()
            };
            match (title.as_str(), selection) {
                ("Pressure level", "gpu=All") => {
                    let got = resources(&result);
                    assert_eq!(
                        got.get("gpu1").map(String::as_str),
                        Some("1"),
                        "GPU 1 is 80 % used: high: {got:?}"
                    );
                    assert_eq!(
                        got.get("gpu0").map(String::as_str),
                        Some("0"),
                        "GPU 0 is normal, exported as 0: {got:?}"
                    );
                    assert!(
                        got.contains_key("host"),
                        "host RAM is always there: {got:?}"
                    );
                }
                ("Pressure level", _) => {
                    let got = resources(&result);
                    assert!(!got.contains_key("gpu0"), "$gpu=1 keeps GPU 0 out: {got:?}");
                }
                ("Peaks by component", _) => {
                    let components: BTreeSet<&str> = result
                        .iter()
                        .filter_map(|s| s["metric"]["component"].as_str())
                        .collect();
                    assert!(
                        components.contains("model") && components.contains("data"),
                        "{components:?}"
                    );
                }
                _ => {}
            }
            checked += 1;
        }
    }
    println!("{checked} panel queries answered with data");

    // The rules load into the same Prometheus and evaluate without error on
    // real series; only pressure can be pending (GPU 1 is 80 % used), and is.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let groups = api(prom, "rules");
        let rules: Vec<Value> = groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().clone())
            .collect();
        let evaluated = rules.iter().all(|r| {
            r["lastEvaluation"]
                .as_str()
                .is_some_and(|t| !t.starts_with("0001-"))
        });
        if evaluated {
            assert_eq!(
                rules.len(),
                rule_blocks(&std::fs::read_to_string(repo(RULES)).unwrap()).len()
            );
            for r in &rules {
                assert_eq!(
                    r["health"], "ok",
                    "rule {} failed on real data: {}",
                    r["name"], r["lastError"]
                );
            }
            break;
        }
        assert!(Instant::now() < deadline, "rules not evaluated: {groups}");
        std::thread::sleep(Duration::from_millis(250));
    }
    let alerts = api(prom, "alerts");
    let active: Vec<(String, String, String)> = alerts["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let l = &a["labels"];
            let s = |k: &str| l[k].as_str().unwrap_or("").to_string();
            (
                s("alertname"),
                s("resource"),
                a["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    println!("alerts on the live run: {active:?}");
    assert!(
        active.contains(&(
            "MemtrackPressureHigh".into(),
            "gpu1".into(),
            "pending".into()
        )),
        "GPU 1 at 80 %: MemtrackPressureHigh pending: {active:?}"
    );
    assert!(
        active
            .iter()
            .all(|(name, _, _)| name.starts_with("MemtrackPressure")),
        "a healthy run raises no other alert: {active:?}"
    );

    rig.finish();
}

// ---------------------------------------------------------------- verdicts

/// A job that opens the stage `train`, then grows by 2 MiB every 100 ms
/// (steadily: a leak) until `stop` exists or two minutes passed.
const LEAKING_JOB: &str = r#"
import json, os, socket, sys, time
stop = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ['MEMTRACK_SOCKET'])
replies = s.makefile('r')
s.sendall((json.dumps({'type': 'stage_begin', 'name': 'train', 'ack': True}) + '\n').encode())
assert json.loads(replies.readline())['ok']
hog, deadline = [], time.time() + 120
while not os.path.exists(stop) and time.time() < deadline:
    hog.append(b'x' * (2 << 20))
    time.sleep(0.1)
"#;

/// The value of the series of `name` whose labels contain `with`.
fn series_value(body: &str, name: &str, with: &str) -> Option<f64> {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(with))
        .find_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse().ok()))
}

#[test]
fn memtracks_verdicts_are_metrics_during_a_short_leaking_run() {
    let dir = scratch();
    let stop = dir.path().join("stop");
    let mut job = python(LEAKING_JOB);
    job.push(stop.display().to_string());
    let daemon = Daemon::start(
        &dir.path().join("out"),
        &["--interval", "200ms", "--no-gpu"],
        &job,
        &[],
    );
    // The current stage and what a re-run needs are there from the start.
    let deadline = Instant::now() + Duration::from_secs(30);
    let early = loop {
        let (_, body) = daemon.http("GET", "/metrics");
        if series_value(&body, "memtrack_current_stage", "stage=\"train\"").is_some() {
            break body;
        }
        assert!(Instant::now() < deadline, "no current stage:\n{body}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        series_value(&early, "memtrack_current_stage", "stage=\"train\""),
        Some(1.0)
    );
    let need = series_value(&early, "memtrack_rerun_host_memory_bytes", "run=\"d\"")
        .unwrap_or_else(|| panic!("no re-run need:\n{early}"));
    assert!(need > 0.0, "{early}");
    assert!(
        !early.contains("memtrack_rerun_gpu_memory_bytes"),
        "no GPU, no GPU need"
    );
    // The verdict: judged once the run is long enough, then a leak of the
    // tree and of the job's process, well within the run.
    let deadline = Instant::now() + Duration::from_secs(90);
    let body = loop {
        let (_, body) = daemon.http("GET", "/metrics");
        if series_value(&body, "memtrack_leak_suspected", "memory=\"host\"") == Some(1.0) {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "no leak verdict after 90 s:\n{body}\n{}",
            daemon.stderr()
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let growth = series_value(&body, "memtrack_leak_growth_bytes", "memory=\"host\"")
        .unwrap_or_else(|| panic!("{body}"));
    assert!(growth > 32.0 * 1024.0 * 1024.0, "{body}");
    assert!(
        body.lines()
            .any(|l| l.starts_with("memtrack_process_leak_suspected{")
                && l.contains("memory=\"host\"")
                && l.ends_with(" 1")),
        "{body}"
    );
    let later = series_value(&body, "memtrack_rerun_host_memory_bytes", "run=\"d\"").unwrap();
    assert!(
        later > need,
        "the need follows the peak: {need} then {later}"
    );
    std::fs::write(&stop, "").unwrap();
    let (code, doc) = daemon.finish();
    assert_eq!(code, Some(0));
    // The metric said what the file says.
    let leak = memtrack::model::leak::LeakReport::from_value(doc.leak.as_ref().unwrap());
    assert!(leak.host.unwrap().suspected, "the document agrees");
}
