//! memtrack's CPU cost per 1 000 points forwarded to ClearML.
//!
//! `cargo bench --bench clearml` measures this process's CPU time (user +
//! system, all threads, from `/proc/self/stat`) for:
//! - intake: entries folded into points and queued in memory (what the
//!   engine's side of the channel costs the reporter task);
//! - spill: the same with a one-point memory bound, so every point goes
//!   through the spool file;
//! - end to end: a `Reporter` sending everything to the strict contract
//!   server (tests/servers/clearml_server.py, a separate process whose CPU
//!   is not counted) in batches of 100, including login, task creation and
//!   completion.
//!
//! 50 000 entries (300 000 points) for the intake rows, 20 000 for the
//! end-to-end row. Without `--bench` (as `cargo test --benches` runs it) it
//! does a small smoke run of each.

// A benchmark program: it prints its table and fails loudly.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::print_stdout)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memtrack::config::ClearmlConfig;
use memtrack::export::clearml::points::Converter;
use memtrack::export::clearml::queue::Queue;
use memtrack::export::clearml::{resolve, Reporter, TaskEnd};
use memtrack::model::{Entry, EntryKind, Exit, Figures, RunInfo};

fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the parenthesised command: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    ticks as f64 / memtrack::sys::clock_ticks() as f64
}

fn entry(i: u64) -> Entry {
    let ts = 1_733_000_000.0 + i as f64 * 0.01;
    let v = 1000.0 + (i % 97) as f64;
    Entry {
        component: ["model", "data", "optimizer"][(i % 3) as usize].into(),
        operation: "step".into(),
        timestamp: ts,
        figures: Figures {
            cpu_ram_used_mb: v,
            gpu_ram_used_mb: v * 2.0,
            gpu_ram_peak_mb: v * 2.5,
            reserved_gpu_ram_mb: v * 3.0,
            gpu_process_used_mb: v * 2.0,
            cpu_ram_hwm_mb: v * 1.1,
        },
        kind: EntryKind::Event,
        iteration: Some(i / 3),
        ..Entry::default()
    }
}

fn row(what: &str, points: u64, cpu: f64, wall: Duration) {
    println!(
        "{what:<34} {points:>9} points  {:>8.2} ms CPU / 1000 points  ({:.2} s CPU, {:.2} s wall)",
        cpu * 1000.0 / (points as f64 / 1000.0),
        cpu,
        wall.as_secs_f64()
    );
}

fn intake(n: u64, queue_max: usize, dir: &Path) -> (u64, f64, Duration) {
    let mut conv = Converter::new(Duration::from_secs(10));
    let mut queue = Queue::new(queue_max, dir.join("spool.jsonl"));
    let mut out = Vec::new();
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let now = Instant::now();
    for i in 0..n {
        conv.push(entry(i), now, &mut out);
        queue.extend(out.drain(..));
    }
    let points = queue.len();
    (points, cpu_seconds() - c0, t0.elapsed())
}

struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn end_to_end(n: u64, dir: &Path) -> (u64, f64, Duration) {
    let ports = dir.join("ports.json");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/servers/clearml_server.py");
    let _server = Server(
        Command::new("python3")
            .arg(script)
            .arg("--port-file")
            .arg(&ports)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 tests/servers/clearml_server.py"),
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    let api = loop {
        if let Some(v) = std::fs::read_to_string(&ports)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        {
            break v["api"].as_u64().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "the contract server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let env = |k: &str| match k {
        "CLEARML_API_HOST" => Some(format!("http://127.0.0.1:{api}")),
        "CLEARML_API_ACCESS_KEY" => Some("memtrack-test-key".into()),
        "CLEARML_API_SECRET_KEY" => Some("memtrack-test-secret".into()),
        _ => None,
    };
    let config = ClearmlConfig {
        flush_interval: Duration::from_millis(200),
        ..ClearmlConfig::default()
    };
    let settings = resolve(&config, &env, None).unwrap().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let run = RunInfo {
        name: "bench".into(),
        id: "bench".into(),
        host: "bench".into(),
        ..RunInfo::default()
    };
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let reporter = rt.block_on(async { Reporter::start(settings, run, dir.join("run"), rx, None) });
    for i in 0..n {
        tx.send(entry(i)).unwrap();
    }
    drop(tx);
    let end = TaskEnd {
        exit: Some(Exit::code(0)),
        artifact: None,
        page: None,
    };
    let report = rt.block_on(reporter.finish(end, Duration::from_secs(600)));
    assert_eq!(report.unsent, 0, "{report:?}");
    assert!(report.errors.is_empty(), "{report:?}");
    (report.sent, cpu_seconds() - c0, t0.elapsed())
}

fn main() {
    // The Python server, not memtrack, bounds the end-to-end rate.
    let (n, n_http) = if full_run() {
        (50_000, 20_000)
    } else {
        (300, 300)
    };
    let dir = tempfile::tempdir().unwrap();
    println!("ClearML export, entries of 6 points each; CPU of this process only");
    let (p, c, w) = intake(n, usize::MAX, dir.path());
    row("intake (fold + queue in memory)", p, c, w);
    let (p, c, w) = intake(n, 1, dir.path());
    row("intake through the spool file", p, c, w);
    let (p, c, w) = end_to_end(n_http, dir.path());
    row("end to end (HTTP, batches of 100)", p, c, w);
    std::io::stdout().flush().unwrap();
}
