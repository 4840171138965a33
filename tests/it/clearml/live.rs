//! The reporter driven through the library: a real tokio runtime and real
//! HTTP on loopback, entries pushed as the engine pushes them; and the
//! points a test expects of them, keyed as the server stores them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use memtrack::config::ClearmlConfig;
use memtrack::export::clearml::{resolve, FinishReport, Reporter, Settings, TaskEnd, SPOOL_FILE};
use memtrack::model::{Entry, EntryKind, Exit, Figures, RunInfo};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use super::KEY;
use crate::common::*;

/// Settings as `resolve` makes them from the environment, with the short
/// timings the tests need.
pub(super) fn settings(host: &str, secret: &str) -> Settings {
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

pub(super) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

pub(super) fn run_info(name: &str) -> RunInfo {
    RunInfo {
        name: name.into(),
        id: "run-1".into(),
        host: "it-host".into(),
        ..RunInfo::default()
    }
}

/// A started reporter and the sending end of its channel.
pub(super) struct Live {
    rt: tokio::runtime::Runtime,
    reporter: Reporter,
    tx: UnboundedSender<Entry>,
    dir: tempfile::TempDir,
}

impl Live {
    pub(super) fn start(settings: Settings, name: &str) -> Live {
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

    pub(super) fn spool(&self) -> PathBuf {
        self.dir.path().join("run").join(SPOOL_FILE)
    }

    pub(super) fn push(&self, e: Entry) {
        self.tx.send(e).unwrap();
    }

    pub(super) fn wait_task(&self) -> String {
        wait_for("the task", Duration::from_secs(10), || {
            self.reporter.task().is_some()
        });
        self.reporter.task().unwrap().id
    }

    pub(super) fn finish(
        self,
        outcome: TaskEnd,
        timeout: Duration,
    ) -> (FinishReport, u64, tempfile::TempDir) {
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

pub(super) fn exit(code: i32) -> TaskEnd {
    TaskEnd {
        exit: Some(Exit::code(code)),
        artifact: None,
        page: None,
    }
}

pub(super) fn entry(component: &str, op: &str, ts: f64, iteration: Option<u64>, v: f64) -> Entry {
    Entry {
        component: component.into(),
        operation: op.into(),
        timestamp: ts,
        figures: Figures {
            cpu_ram_used_mb: v,
            gpu_ram_used_mb: v + 0.5,
            gpu_ram_peak_mb: v + 1.0,
            reserved_gpu_ram_mb: v + 2.0,
            gpu_process_used_mb: v + 3.0,
            cpu_ram_hwm_mb: v + 4.0,
        },
        kind: EntryKind::Event,
        iteration,
        ..Entry::default()
    }
}

pub(super) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

pub(super) const FIELDS: [&str; 6] = [
    "cpu_ram_used_mb",
    "gpu_ram_used_mb",
    "gpu_ram_peak_mb",
    "reserved_gpu_ram_mb",
    "gpu_process_used_mb",
    "cpu_ram_hwm_mb",
];

/// (metric, variant, iter) → (value, timestamp ms).
pub(super) type Expected = BTreeMap<(String, String, u64), (f64, i64)>;

/// The six points of an entry, as the README documents them.
pub(super) fn expect(exp: &mut Expected, e: &Entry, iter: u64, suffix: Option<&str>) {
    let values = [
        e.figures.cpu_ram_used_mb,
        e.figures.gpu_ram_used_mb,
        e.figures.gpu_ram_peak_mb,
        e.figures.reserved_gpu_ram_mb,
        e.figures.gpu_process_used_mb,
        e.figures.cpu_ram_hwm_mb,
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

pub(super) fn stored(points: &[Value]) -> Expected {
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
pub(super) fn diff(want: &Expected, got: &Expected) -> String {
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
pub(super) fn steady_marks(
    live: &Live,
    exp: &mut Expected,
    component: &str,
    range: std::ops::Range<u64>,
) {
    for i in range {
        let e = entry(component, "step", unix_now(), Some(i), 100.0 + i as f64);
        expect(exp, &e, i, None);
        live.push(e);
    }
}
