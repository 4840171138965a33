//! The event path against its floor, in one run.
//!
//! `cargo bench --bench events`:
//! - `ack` round trip p50 / p99 of a real daemon (host-only, so no NVML
//!   time) against the floor: the same line sent to an echo server on a Unix
//!   stream socket and a reply line read back. With `BENCH_GPU=1` the daemon
//!   keeps NVML on, and the floor adds what an acknowledged mark must at
//!   least ask the driver: one compute-process list per GPU, timed in the
//!   same round trip;
//! - fire-and-forget: 4 client threads × 20 000 marks, every one of them
//!   recorded, with the daemon's CPU time for them (utime + stime from
//!   /proc), per mark.

// A benchmark program: it prints its table and fails loudly.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::print_stdout)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MARK: &[u8] =
    b"{\"component\":\"model\",\"operation\":\"before_generate\",\"iteration\":17,\"ack\":true}\n";

/// A request the engine answers without a sample.
const REGISTER: &[u8] = b"{\"type\":\"register\",\"id\":1}\n";

fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn round_trips(stream: &mut UnixStream, n: usize) -> Vec<Duration> {
    round_trips_of(stream, MARK, n, &mut || {})
}

/// Round trips, each followed by `extra` inside the timed span.
fn round_trips_with(stream: &mut UnixStream, n: usize, extra: &mut dyn FnMut()) -> Vec<Duration> {
    round_trips_of(stream, MARK, n, extra)
}

/// Round trips of `request`, each followed by `extra` inside the timed span.
fn round_trips_of(
    stream: &mut UnixStream,
    request: &[u8],
    n: usize,
    extra: &mut dyn FnMut(),
) -> Vec<Duration> {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    let mut times: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            stream.write_all(request).unwrap();
            line.clear();
            reader.read_line(&mut line).unwrap();
            extra();
            t.elapsed()
        })
        .collect();
    times.sort();
    times
}

fn echo_server(path: &Path) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(path).unwrap();
    // A reply about as long as memtrack's, so both move the same bytes.
    let reply = format!(
        "{{\"ok\":true,\"type\":\"recorded\",\"entry\":{{{}}}}}\n",
        "\"x\":1.0,".repeat(40).trim_end_matches(',')
    );
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut writer = stream;
        let mut line = String::new();
        while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            writer.write_all(reply.as_bytes()).unwrap();
            line.clear();
        }
    })
}

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / memtrack::sys::clock_ticks() as f64
}

fn start_daemon(dir: &Path) -> (Child, PathBuf) {
    let sock = dir.join("m.sock");
    // BENCH_MEMTRACK_BIN: the binary when this bench runs on another
    // machine; BENCH_GPU=1: keep NVML on (ack time then includes it).
    let bin = std::env::var("BENCH_MEMTRACK_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_memtrack").to_string());
    let gpu = std::env::var("BENCH_GPU").is_ok_and(|v| v == "1");
    let child = Command::new(bin)
        .args([
            "run",
            if gpu { "--log-level=info" } else { "--no-gpu" },
            "--interval",
            "1s",
            "--name",
            "bench",
            "--output",
        ])
        .arg(dir)
        .arg("--socket")
        .arg(&sock)
        .args(["--", "sleep", "3600"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&sock).is_err() {
        assert!(Instant::now() < deadline, "daemon did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, sock)
}

fn main() {
    let n = if full_run() { 20_000 } else { 500 };
    let marks_per_client = if full_run() { 20_000 } else { 500 };
    if !full_run() {
        println!("(smoke run: figures are meaningless; `cargo bench --bench events` measures)");
    }
    let dir = tempfile::tempdir().unwrap();

    let echo_path = dir.path().join("echo.sock");
    let server = echo_server(&echo_path);
    let mut echo = UnixStream::connect(&echo_path).unwrap();
    let gpu = std::env::var("BENCH_GPU").is_ok_and(|v| v == "1");
    // With NVML, the floor also asks each GPU for its compute processes:
    // the least an acknowledged mark's GPU figure needs.
    let lib = std::env::var_os("BENCH_NVML_LIB");
    let nvml = gpu.then(|| {
        let mut b = nvml_wrapper::Nvml::builder();
        if let Some(lib) = &lib {
            b.lib_path(lib);
        }
        b.init().expect("BENCH_GPU=1 needs NVML")
    });
    let mut query = || {
        if let Some(nvml) = &nvml {
            for i in 0..nvml.device_count().unwrap() {
                nvml.device_by_index(i)
                    .unwrap()
                    .running_compute_processes()
                    .unwrap();
            }
        }
    };
    round_trips_with(&mut echo, n / 10, &mut query); // warm up
    let floor = round_trips_with(&mut echo, n, &mut query);
    drop(nvml);
    drop(echo);
    server.join().unwrap();

    let (mut daemon, sock) = start_daemon(dir.path());
    let mut client = UnixStream::connect(&sock).unwrap();
    round_trips(&mut client, n / 10);
    let acks = round_trips(&mut client, n);
    // The same trip with nothing sampled, recorded or journalled: the
    // socket task hands `register` to the engine, which answers at once.
    let hops = round_trips_of(&mut client, REGISTER, n, &mut || {});

    // Fire-and-forget from 4 clients, then one ack each: all are recorded.
    let pid = daemon.id();
    let before = cpu_seconds(pid);
    let t = Instant::now();
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&sock).unwrap();
                let line = b"{\"component\":\"load\",\"operation\":\"step\"}\n".repeat(100);
                for _ in 0..marks_per_client / 100 {
                    s.write_all(&line).unwrap();
                }
                round_trips(&mut s, 1);
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let wall = t.elapsed();
    let cpu = cpu_seconds(pid) - before;
    let total = 4 * marks_per_client;

    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (f50, f99, a50, a99) = (
        percentile(&floor, 0.5),
        percentile(&floor, 0.99),
        percentile(&acks, 0.5),
        percentile(&acks, 0.99),
    );
    let (what, floor_name) = if gpu {
        (
            "with NVML",
            "floor: Unix stream echo + compute-process list per GPU",
        )
    } else {
        ("no GPU", "floor: Unix stream echo")
    };
    println!("memtrack event path vs the floor ({n} round trips each, this machine, {what})");
    println!();
    println!("| | {floor_name} | memtrack ack | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| p50 | {:.1} µs | {:.1} µs | {:.2}× |",
        us(f50),
        us(a50),
        us(a50) / us(f50)
    );
    println!(
        "| p99 | {:.1} µs | {:.1} µs | {:.2}× |",
        us(f99),
        us(a99),
        us(a99) / us(f99)
    );
    println!();
    let (h50, h99) = (percentile(&hops, 0.5), percentile(&hops, 0.99));
    println!(
        "where an ack's time goes: a `register` round trip (socket task → engine → socket task, \
         nothing sampled, recorded or journalled) takes p50 {:.1} µs, p99 {:.1} µs; the ack's \
         sample, record and journal write add p50 {:.1} µs, p99 {:.1} µs",
        us(h50),
        us(h99),
        us(a50) - us(h50),
        us(a99) - us(h99)
    );
    println!();
    println!(
        "fire-and-forget: 4 clients × {marks_per_client} marks in {:.2} s wall; daemon CPU {:.3} s = {:.2} µs per mark",
        wall.as_secs_f64(),
        cpu,
        cpu * 1e6 / total as f64
    );
    let met = us(a99) <= 2.0 * us(f99);
    println!(
        "goal: ack p99 <= 2x the floor: {}",
        if met { "met" } else { "not met" }
    );

    memtrack::sys::kill(pid, 15).unwrap();
    daemon.wait().unwrap();
    let doc: memtrack::model::Document =
        serde_json::from_slice(&std::fs::read(dir.path().join("bench/memory_usage.json")).unwrap())
            .unwrap();
    let steps = doc
        .detailed_log
        .iter()
        .filter(|e| e.operation == "step")
        .count();
    assert_eq!(steps, total, "every fire-and-forget mark is in the log");
}
