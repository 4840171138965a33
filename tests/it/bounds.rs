//! Bounds on what other programs can make memtrack hold or print: names a
//! job invents (components, operations, spans, stages), HTTP clients of
//! other users, absurd figures, hostile strings and sizes for the readers.
//! Real daemons, real sockets, real TCP, the real binary.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use memtrack::model::EntryKind;

use crate::common::*;

/// `VmRSS` and `VmHWM` of a process, bytes.
fn rss_and_hwm(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib = |key: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    };
    (kib("VmRSS:") * 1024, kib("VmHWM:") * 1024)
}

const MARKS: usize = 100_000;

#[test]
fn a_hundred_thousand_invented_names_keep_memory_metrics_and_status_bounded() {
    let dir = scratch();
    let status_len = dir.path().join("status-len");
    let go = dir.path().join("go");
    // One connection sends 100,000 marks, each with a new component and
    // operation, 2,000 spans never closed and 2,000 stages, then asks
    // for an ack (every line before it is recorded) and the status.
    let script = format!(
        r#"
import json, os, socket, time
s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])
f = s.makefile('rwb')
lines = [json.dumps({{'component': 'c%06d' % i, 'operation': 'op%06d' % i,
                      'labels': {{'request': 'r%06d' % i}}}}) for i in range({MARKS})]
lines += [json.dumps({{'type': 'span_begin', 'component': 'span%04d' % i, 'operation': 'x'}}) for i in range(2000)]
lines += [json.dumps({{'type': 'stage_begin', 'name': 'stage%04d' % i}}) for i in range(2000)]
s.sendall(('\n'.join(lines) + '\n').encode())
f.write(b'{{"component":"end","operation":"end","ack":true}}\n'); f.flush()
assert json.loads(f.readline())['ok']
f.write(b'{{"type":"status"}}\n'); f.flush()
reply = f.readline()
assert json.loads(reply)['ok']
open({status_len:?} + '.tmp', 'w').write(str(len(reply)))
os.replace({status_len:?} + '.tmp', {status_len:?})
while not os.path.exists({go:?}):
    time.sleep(0.05)
"#,
        status_len = status_len.display().to_string(),
        go = go.display().to_string(),
    );
    let d = Daemon::start(dir.path(), &["--interval", "100ms"], &python(&script), &[]);
    wait_for("the marks", Duration::from_secs(120), || {
        status_len.exists()
    });
    let status_bytes: usize = std::fs::read_to_string(&status_len)
        .unwrap()
        .parse()
        .unwrap();
    // Two scrapes: the second one's peak memory is in VmHWM.
    let _ = d.http("GET", "/metrics");
    let (code, metrics) = d.http("GET", "/metrics");
    assert_eq!(code, 200);
    let (rss, hwm) = rss_and_hwm(d.child.id());
    std::fs::write(&go, "x").unwrap();
    let (code, doc) = d.finish();
    assert_eq!(code, Some(0));
    eprintln!(
        "{MARKS} names: status {status_bytes} B, /metrics {} B, memtrack RSS {} MiB, peak {} MiB",
        metrics.len(),
        rss >> 20,
        hwm >> 20
    );

    // Every mark is in the log with the names the job sent.
    let events: Vec<_> = doc
        .detailed_log
        .iter()
        .filter(|e| e.kind == EntryKind::Event && e.component.starts_with('c'))
        .collect();
    assert_eq!(events.len(), MARKS);
    assert_eq!(events[MARKS - 1].component, format!("c{:06}", MARKS - 1));
    assert_eq!(events[MARKS - 1].operation, format!("op{:06}", MARKS - 1));
    assert_eq!(
        events[MARKS - 1].labels["request"],
        format!("r{:06}", MARKS - 1)
    );
    assert_eq!(doc.counters.events as usize, MARKS + 4001);

    // Per-name state is bounded, and what went over is counted.
    let limits = memtrack::store::Limits::default();
    assert!(
        doc.peaks_by_component.len() <= limits.max_components + 1,
        "{} components",
        doc.peaks_by_component.len()
    );
    assert!(doc.peaks_by_component["_other"].samples > 0);
    assert!(doc.counters.components_folded >= (MARKS - limits.max_components) as u64);
    assert!(doc.counters.event_kinds_folded >= (MARKS - limits.max_event_kinds) as u64);
    assert_eq!(
        doc.counters.spans_untracked,
        (2000 - limits.max_open_spans) as u64
    );
    assert!(doc.stages.len() <= limits.max_stages);
    assert_eq!(
        doc.counters.stages_dropped,
        (2000 - limits.max_stages) as u64
    );

    // Replies and scrapes stay small: hundreds of KiB, not the tens of MB
    // 100,000 names made them.
    assert!(
        status_bytes < 512 << 10,
        "status reply {status_bytes} bytes"
    );
    assert!(metrics.len() < 1 << 20, "/metrics {} bytes", metrics.len());
    let series = |name: &str| metrics.lines().filter(|l| l.starts_with(name)).count();
    assert!(series("memtrack_component_peak_memory_bytes{") <= 6 * (limits.max_components + 1));
    assert!(series("memtrack_events_total{") <= limits.max_event_kinds + 1);
    assert!(
        metrics.contains("memtrack_folded_total{"),
        "the folds are exported"
    );
    // memtrack's own memory: the log of 100,000 entries is kept (every
    // mark is in the file), but no per-name map or scrape grows with the
    // names (124 MiB in a debug build). Without the bounds a release build
    // held 200 MiB and one scrape took it to 627 MiB.
    assert!(
        hwm < 200 << 20,
        "memtrack peaked at {} MiB (now {} MiB)",
        hwm >> 20,
        rss >> 20
    );
}

/// Sends one request on its own connection; returns the raw response
/// (empty when the connection was closed on us).
fn raw_request(addr: std::net::SocketAddr, method: &str, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return String::new();
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    if write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    .is_err()
    {
        return String::new();
    }
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw
}

/// Another user's program holding HTTP connections that never finish a
/// request: 300 of them (half send nothing, half drip a header byte by
/// byte), each opened again as soon as the server closes it.
const HOLDER: &str = r#"
import socket, sys, time
host, port, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import os
held = []
while not os.path.exists(stop):
    alive = []
    for i, s in held:
        try:
            s.setblocking(False)
            if s.recv(1) == b'':
                s.close(); continue
        except BlockingIOError:
            pass
        except OSError:
            s.close(); continue
        if i % 2:
            try: s.send(b'X')
            except OSError: s.close(); continue
        alive.append((i, s))
    held = alive
    while len(held) < 300:
        s = socket.socket()
        try:
            s.connect((host, port))
            if len(held) % 2:
                s.send(b'GET /metrics HTTP/1.1\r\nX-Slow: ')
        except OSError:
            s.close(); break
        held.append((len(held), s))
    time.sleep(0.05)
"#;

/// The other user's client, stopped however the test ends.
struct Holder(std::process::Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn another_users_slow_and_idle_clients_never_make_healthz_fail() {
    if !can_run(
        "root",
        is_root(),
        "needs root to run the other user's client (setpriv)",
    ) {
        return;
    }
    // The other user cannot run this user's (pyenv) interpreter.
    let python = Path::new("/usr/bin/python3");
    if !can_run(
        "system-python",
        python.exists(),
        "no /usr/bin/python3 for the other user",
    ) {
        return;
    }
    let dir = scratch();
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &["sleep".into(), "60".into()],
        &[],
    );
    wait_for("healthz ok", Duration::from_secs(10), || {
        d.http("GET", "/healthz").0 == 200
    });
    let stop = dir.path().join("stop");
    let mut holder = Holder(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(python)
            .args(["-c", HOLDER])
            .arg(d.http.ip().to_string())
            .arg(d.http.port().to_string())
            .arg(&stop)
            .spawn()
            .expect("setpriv (util-linux)"),
    );
    // Until it has filled its share: its own oldest connections are then
    // closed to make room for its new ones, which /metrics counts.
    wait_for(
        "the other user's connections to fill its share",
        Duration::from_secs(60),
        || {
            raw_request(d.http, "GET", "/metrics").lines().any(|l| {
                l.starts_with("memtrack_http_evicted_connections_total")
                    && l.rsplit(' ')
                        .next()
                        .and_then(|v| v.parse::<f64>().ok())
                        .is_some_and(|v| v > 0.0)
            })
        },
    );
    let answers: Vec<u16> = (0..40)
        .map(|_| {
            let raw = raw_request(d.http, "GET", "/healthz");
            std::thread::sleep(Duration::from_millis(100));
            raw.split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0)
        })
        .collect();
    let (_, metrics) = d.http("GET", "/metrics");
    assert!(
        holder.0.try_wait().unwrap().is_none(),
        "the other user's client kept running: {:?}",
        holder.0.try_wait()
    );
    std::fs::write(&stop, "x").unwrap();
    let _ = holder.0.wait();
    assert!(
        answers.iter().all(|c| *c == 200),
        "/healthz answers while another user holds connections: {answers:?}"
    );
    let evicted: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("memtrack_http_evicted_connections_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    assert!(
        evicted > 0.0,
        "the holder's connections were closed to make room"
    );
    signal(d.child.id(), "TERM");
    let _ = d.finish();
}

#[test]
fn cleanup_over_http_runs_at_most_once_per_interval_and_says_when_to_retry() {
    let dir = scratch();
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &["sleep".into(), "30".into()],
        &[],
    );
    // A subscriber, as the Python client's on_cleanup handler is.
    let sub = UnixStream::connect(&d.socket).unwrap();
    let mut w = sub.try_clone().unwrap();
    w.write_all(b"{\"type\":\"subscribe\"}\n").unwrap();
    let mut notices = BufReader::new(sub);
    let mut line = String::new();
    notices.read_line(&mut line).unwrap();
    assert!(line.contains("subscribed"), "{line}");

    // (sent, answered, response) for 200 requests in a row.
    let replies: Vec<(Instant, Instant, String)> = (0..200)
        .map(|_| {
            let sent = Instant::now();
            let r = raw_request(d.http, "POST", "/cleanup-memory");
            (sent, Instant::now(), r)
        })
        .collect();
    let ok: Vec<&(Instant, Instant, String)> = replies
        .iter()
        .filter(|r| r.2.starts_with("HTTP/1.1 200"))
        .collect();
    let throttled: Vec<&String> = replies
        .iter()
        .map(|r| &r.2)
        .filter(|r| r.starts_with("HTTP/1.1 429"))
        .collect();
    assert!(!ok.is_empty());
    assert_eq!(ok.len() + throttled.len(), 200, "every request answered");
    assert!(ok.len() < 100, "{} cleanups ran", ok.len());
    // Between two cleanups the server let at least the interval pass: the
    // later one was answered at least that long after the earlier was sent.
    let interval = memtrack::export::http::CLEANUP_MIN_INTERVAL;
    for pair in ok.windows(2) {
        assert!(pair[1].1 - pair[0].0 >= interval, "two cleanups too close");
    }
    let limit = interval.as_secs();
    for r in &throttled {
        let retry: u64 = r
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("retry-after: ")
                    .map(str::to_string)
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After: {r}"));
        assert!((1..=limit).contains(&retry), "{r}");
    }

    // The subscriber got one notice per cleanup, not one per request.
    // Notices reach a subscriber in the order they were sent, so a cleanup
    // asked on the socket now (reason "socket") comes after every notice
    // the HTTP requests caused, however late a loaded machine delivers them.
    let mut marker = UnixStream::connect(&d.socket).unwrap();
    marker.write_all(b"{\"type\":\"cleanup\"}\n").unwrap();
    notices
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut got = 0;
    loop {
        line.clear();
        let n = notices.read_line(&mut line).unwrap();
        assert!(n > 0, "the subscription ended before the socket's notice");
        if line.contains("\"socket\"") {
            break;
        }
        got += usize::from(line.contains("\"cleanup\""));
    }
    assert_eq!(got, ok.len());
    drop(marker);
    let (_, metrics) = d.http("GET", "/metrics");
    assert!(
        metrics.contains("memtrack_http_cleanup_throttled_total{run=\"d\"")
            && metrics
                .lines()
                .any(|l| l.starts_with("memtrack_http_cleanup_throttled_total")
                    && l.ends_with(&format!(" {}", throttled.len()))),
        "{metrics}"
    );
    drop(w);
    signal(d.child.id(), "TERM");
    let _ = d.finish();
}

#[test]
fn allocator_figures_above_any_gpu_are_refused_and_counted() {
    let dir = scratch();
    let script = r#"
import json, os, socket
s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])
f = s.makefile('rwb')
big = 18446744073709551615
f.write((json.dumps({'component': 'model', 'operation': 'step', 'ack': True, 'id': 1,
    'allocator': {'allocated': big, 'reserved': big, 'max_allocated': big, 'device': 0}}) + '\n').encode())
f.flush()
print(f.readline().decode().strip())
f.write((json.dumps({'component': 'model', 'operation': 'step', 'ack': True, 'id': 2,
    'allocator': {'allocated': 1 << 30, 'reserved': 2 << 30, 'max_allocated': 1 << 30, 'device': 0}}) + '\n').encode())
f.flush()
print(f.readline().decode().strip())
"#;
    let out = run_to_end(
        memtrack()
            .args([
                "run", "--listen", "off", "--no-gpu", "--name", "a", "--output",
            ])
            .arg(dir.path())
            .arg("--")
            .args(python(script)),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let replies: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(replies[0]["ok"], false, "{replies:?}");
    assert_eq!(replies[0]["error"], "invalid");
    assert!(replies[0]["message"]
        .as_str()
        .unwrap()
        .contains("allocator.allocated"));
    assert_eq!(replies[1]["ok"], true, "{replies:?}");
    let file = dir.path().join("a/memory_usage.json");
    let doc = read_document(&file);
    assert_eq!(doc.counters.protocol_errors, 1);
    assert_eq!(doc.peak_usage.figures.reserved_gpu_ram_mb, 2048.0);
    let report = run_to_end(memtrack().arg("report").arg(&file), Duration::from_secs(10));
    let text = String::from_utf8_lossy(&report.stdout);
    assert!(text.contains("a 4 GB card fits"), "{text}");
}

/// A document whose strings carry terminal escape sequences.
fn hostile_document(path: &Path) {
    let esc = "\u{1b}";
    let doc = serde_json::json!({
        "schema": 3,
        "run": {
            "name": format!("run{esc}]0;owned\u{7}"),
            "start": 1_700_000_000.0,
            "command": ["python3", format!("train.py{esc}[2J{esc}[H")],
            "labels": {"note": format!("{esc}[31mred")},
        },
        "detailed_log": [{
            "component": format!("model{esc}[5m"), "operation": "step",
            "timestamp": 1_700_000_001.0, "cpu_ram_used_mb": 10.0,
            "gpu_ram_used_mb": 0.0, "gpu_ram_peak_mb": 0.0, "reserved_gpu_ram_mb": 0.0,
        }],
        "peak_usage": {"cpu_ram_used_mb": 10.0, "gpu_ram_used_mb": 0.0,
                       "gpu_ram_peak_mb": 0.0, "reserved_gpu_ram_mb": 0.0},
        "peaks_by_component": {format!("model{esc}[5m"): {"cpu_ram_used_mb": 10.0}},
        "stages": [{"name": format!("train{esc}[8m"), "status": format!("FAILED\r{esc}[KSUCCESS"),
                    "start": 1_700_000_000.0}],
        "flight_recorder": [{
            "reason": "cuda_oom", "timestamp": 1_700_000_002.0, "name": "python3",
            "cuda_summary": format!("|  CUDA OOM  |\n{esc}]52;c;cm0gLXJmIH4=\u{7}|  pool  |"),
        }],
    });
    std::fs::write(path, serde_json::to_vec(&doc).unwrap()).unwrap();
}

#[test]
fn report_shows_job_strings_without_obeying_their_escape_sequences() {
    let dir = scratch();
    let file = dir.path().join("memory_usage.json");
    hostile_document(&file);
    let out = run_to_end(memtrack().arg("report").arg(&file), Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "a control character reached the terminal: {text:?}"
    );
    for shown in [
        "run\\u{1b}]0;owned\\u{7}",
        "train.py\\u{1b}[2J\\u{1b}[H",
        "\\u{1b}[31mred",
        "model\\u{1b}[5m",
        "train\\u{1b}[8m",
        "FAILED\\u{d}\\u{1b}[KSUCCESS",
        "\\u{1b}]52;c;cm0gLXJmIH4=\\u{7}|  pool  |",
    ] {
        assert!(text.contains(shown), "{shown} not shown in\n{text}");
    }
}

#[test]
fn report_and_plot_survive_times_no_clock_can_show() {
    let dir = scratch();
    for (i, start) in [1e12, 253_402_300_800.0, -5.0, 0.0].iter().enumerate() {
        let file = dir.path().join(format!("t{i}.json"));
        let doc = serde_json::json!({
            "schema": 3,
            "run": {"name": "t", "start": start, "end": start + 10.0},
            "detailed_log": [
                {"component": "system", "operation": "timer", "timestamp": start + 1.0,
                 "cpu_ram_used_mb": 10.0, "gpu_ram_used_mb": 0.0, "gpu_ram_peak_mb": 0.0,
                 "reserved_gpu_ram_mb": 0.0, "kind": "timer"},
                {"component": "system", "operation": "timer", "timestamp": start + 2.0,
                 "cpu_ram_used_mb": 20.0, "gpu_ram_used_mb": 0.0, "gpu_ram_peak_mb": 0.0,
                 "reserved_gpu_ram_mb": 0.0, "kind": "timer"}
            ],
            "peak_usage": {"cpu_ram_used_mb": 20.0},
        });
        std::fs::write(&file, serde_json::to_vec(&doc).unwrap()).unwrap();
        let out = run_to_end(memtrack().arg("report").arg(&file), Duration::from_secs(10));
        assert_eq!(
            out.status.code(),
            Some(0),
            "start {start}: {}",
            stderr(&out)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("What a re-run needs"), "{text}");
        let svg = dir.path().join(format!("t{i}.svg"));
        let out = run_to_end(
            memtrack().arg("plot").arg(&file).arg("-o").arg(&svg),
            Duration::from_secs(30),
        );
        // Drawn, or (no positive time to draw) refused with a clear error:
        // never a panic.
        let err = stderr(&out);
        let drawn = out.status.code() == Some(0);
        assert!(
            drawn || (out.status.code() == Some(1) && err.contains("nothing to plot")),
            "plot, start {start}: {err}"
        );
        assert_eq!(drawn, start + 1.0 > 0.0, "start {start}: {err}");
    }
}

#[test]
fn plot_refuses_sizes_it_cannot_draw_with_a_clear_error() {
    let dir = scratch();
    let file = dir.path().join("memory_usage.json");
    let doc = serde_json::json!({
        "detailed_log": [
            {"component": "m", "operation": "a", "timestamp": 1.0, "cpu_ram_used_mb": 1.0,
             "gpu_ram_used_mb": 0.0, "gpu_ram_peak_mb": 0.0, "reserved_gpu_ram_mb": 0.0},
            {"component": "m", "operation": "b", "timestamp": 2.0, "cpu_ram_used_mb": 2.0,
             "gpu_ram_used_mb": 0.0, "gpu_ram_peak_mb": 0.0, "reserved_gpu_ram_mb": 0.0}
        ],
        "peak_usage": {"cpu_ram_used_mb": 2.0},
    });
    std::fs::write(&file, serde_json::to_vec(&doc).unwrap()).unwrap();
    let max = memtrack::report::plot::MAX_SIDE;
    for (flag, value) in [
        ("--width", "20000"),
        ("--width", "100000"),
        ("--width", "4294967295"),
        ("--height", "20000"),
        ("--height", "4294967295"),
        ("--width", "100"),
    ] {
        for ext in ["png", "svg"] {
            let out_path = dir.path().join(format!("x.{ext}"));
            let out = run_to_end(
                memtrack()
                    .arg("plot")
                    .arg(&file)
                    .arg("-o")
                    .arg(&out_path)
                    .args([flag, value]),
                Duration::from_secs(30),
            );
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(1), "{flag} {value} .{ext}: {err}");
            assert!(
                err.contains(&format!("to {max}")) && !err.contains("panicked"),
                "{flag} {value}: {err}"
            );
            assert!(!out_path.exists());
        }
    }
    // The largest size is drawn.
    let out_path = dir.path().join("max.png");
    let out = run_to_end(
        memtrack()
            .arg("plot")
            .arg(&file)
            .arg("-o")
            .arg(&out_path)
            .args(["--width", &max.to_string(), "--height", "320"]),
        Duration::from_secs(120),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}
