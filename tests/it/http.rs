//! The HTTP endpoints: real daemons, real TCP, hostile clients.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use crate::common::*;

/// `name{labels} value` lines of a scrape.
fn samples(body: &str) -> Vec<(String, String, f64)> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n.to_string(), rest.trim_end_matches('}').to_string()),
                None => (series.to_string(), String::new()),
            };
            Some((name, labels, value.parse().ok()?))
        })
        .collect()
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels
        .split(',')
        .find_map(|kv| kv.strip_prefix(&format!("{key}=\""))?.strip_suffix('"'))
}

/// A job holding memory still: 200 MiB in the parent, 100 MiB in a child,
/// until the file `stop` appears (or a minute passes).
fn still_job(ready: &Path, stop: &Path) -> Vec<String> {
    python(&format!(
        r#"
import os, time
def hold(mib):
    b = bytearray(mib << 20)
    for i in range(0, len(b), 4096): b[i] = 1
    return b
def until_stopped():
    deadline = time.time() + 60
    while not os.path.exists({stop:?}) and time.time() < deadline:
        time.sleep(0.05)
a = hold(200)
if os.fork() == 0:
    c = hold(100)
    open({ready:?}, 'w').write('x')
    until_stopped()
    os._exit(0)
until_stopped()
os.wait()
"#,
        ready = ready.display().to_string(),
        stop = stop.display().to_string()
    ))
}

#[test]
fn tree_rss_in_metrics_matches_the_kernel() {
    let dir = scratch();
    let ready = dir.path().join("ready");
    let stop = dir.path().join("stop");
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &still_job(&ready, &stop),
        &[],
    );
    wait_for("the child", Duration::from_secs(30), || ready.exists());
    // The job holds still from here: only a sample taken after this moment
    // is compared with the kernel (one taken while the child was still
    // touching its 100 MiB would differ by what it touched since).
    let still_since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    // Until memtrack has seen both processes and the tree's 300 MiB (the
    // page count is read in budgeted slices), however loaded the machine.
    let mut body = String::new();
    wait_for(
        "both processes and the tree",
        Duration::from_secs(60),
        || {
            let (status, b) = d.http("GET", "/metrics");
            body = b;
            let s = samples(&body);
            status == 200
                && s.iter().any(|(n, _, v)| {
                    n == "memtrack_last_sample_timestamp_seconds" && *v > still_since
                })
                && s.iter()
                    .filter(|(n, _, _)| n == "memtrack_process_resident_memory_bytes")
                    .count()
                    >= 2
                && s.iter().any(|(n, _, v)| {
                    n == "memtrack_tree_resident_memory_bytes" && *v >= 300.0 * MIB
                })
        },
    );
    let s = samples(&body);
    let tree = s
        .iter()
        .find(|(n, _, _)| n == "memtrack_tree_resident_memory_bytes")
        .unwrap()
        .2;
    let pids: Vec<u32> = s
        .iter()
        .filter(|(n, _, _)| n == "memtrack_process_resident_memory_bytes")
        .map(|(_, l, _)| label(l, "pid").unwrap().parse().unwrap())
        .collect();
    assert!(pids.len() >= 2, "{pids:?}");
    // Per process: RSS, as the kernel says.
    for (n, l, v) in &s {
        if n == "memtrack_process_resident_memory_bytes" {
            let pid: u32 = label(l, "pid").unwrap().parse().unwrap();
            let kernel = vm_rss(pid).unwrap() as f64;
            assert!((v - kernel).abs() / kernel < 0.01, "{pid}: {v} vs {kernel}");
        }
    }
    // The tree: every page once. The child shares its parent's 200 MiB,
    // which the RSS sum counts twice and Σ Pss once.
    let pss: u64 = pids.iter().map(|p| pss(*p)).sum();
    let diff = (tree - pss as f64).abs() / pss as f64;
    assert!(
        diff < 0.10,
        "tree {tree} vs Σ Pss {pss} ({:.2}%)",
        diff * 100.0
    );
    assert!(tree >= 300.0 * MIB);
    std::fs::write(&stop, "x").unwrap();
    let (code, _) = d.finish();
    assert_eq!(code, Some(0));
}

/// Runs a job that exercises every metric: the fake NVML (GPU series),
/// allocator figures, spans, smaps.
fn busy_daemon(dir: &Path) -> Daemon {
    let state = dir.join("nvml-state");
    std::fs::write(
        &state,
        "device 0 name=NVIDIA_Fake_H100 total_mib=81559 util_gpu=40 temp=50\n",
    )
    .unwrap();
    let script = format!(
        r#"
import json, os, socket, time
tmp = {state:?} + '.tmp'
open(tmp, 'w').write('device 0 name=NVIDIA_Fake_H100 total_mib=81559 util_gpu=40 temp=50\nprocess 0 %d 1500\n' % os.getpid())
os.replace(tmp, {state:?})
s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET']); f = s.makefile('rwb')
def call(m):
    m['ack'] = True
    f.write((json.dumps(m) + '\n').encode()); f.flush(); return json.loads(f.readline())
alloc = {{'allocated': 1 << 30, 'reserved': 2 << 30, 'max_allocated': 3 << 29, 'device': 0}}
call({{'type': 'span_begin', 'component': 'model', 'operation': 'generate', 'allocator': alloc}})
call({{'component': 'model', 'operation': 'step', 'allocator': alloc}})
call({{'type': 'stage_begin', 'name': 'load'}})
time.sleep(3)
call({{'type': 'span_end', 'component': 'model', 'operation': 'generate'}})
"#,
        state = state.display().to_string()
    );
    let lib = fake_nvml().display().to_string();
    Daemon::start(
        dir,
        &["--interval", "100ms", "--smaps", "--nvml-lib", &lib],
        &python(&script),
        &[("FAKE_NVML_STATE", state.to_str().unwrap())],
    )
}

#[test]
fn every_declared_metric_is_served_and_the_readme_lists_them() {
    let dir = scratch();
    let d = busy_daemon(dir.path());
    let names = || -> BTreeSet<String> {
        let (_, body) = d.http("GET", "/metrics");
        body.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect()
    };
    // The leak verdicts need 20 s of samples (tests/it/prometheus.rs
    // scrapes them from a longer run).
    let declared: BTreeSet<String> = memtrack::export::prometheus::METRICS
        .iter()
        .map(|m| m.name.to_string())
        .filter(|n| !n.contains("_leak_"))
        // Only while memory climbs towards a limit (tests/it/advice.rs).
        .filter(|n| n != "memtrack_seconds_to_limit")
        .collect();
    wait_for("every metric family", Duration::from_secs(15), || {
        names() == declared
    });
    // Both of the job's model marks, not only the first.
    wait_for("the model marks", Duration::from_secs(15), || {
        let (_, body) = d.http("GET", "/metrics");
        samples(&body)
            .iter()
            .filter(|(n, l, _)| {
                n == "memtrack_events_total" && label(l, "component") == Some("model")
            })
            .map(|(_, _, v)| v)
            .sum::<f64>()
            >= 2.0
    });
    let (_, body) = d.http("GET", "/metrics");
    let s = samples(&body);
    let get = |name: &str| s.iter().filter(|(n, _, _)| n == name).collect::<Vec<_>>();
    assert_eq!(get("memtrack_process_gpu_memory_bytes")[0].2, 1500.0 * MIB);
    assert_eq!(
        get("memtrack_allocator_reserved_bytes")[0].2,
        2.0 * 1024.0 * MIB
    );
    assert_eq!(get("memtrack_gpu_utilization_ratio")[0].2, 0.4);
    let model_events: f64 = get("memtrack_events_total")
        .iter()
        .filter(|(_, l, _)| label(l, "component") == Some("model"))
        .map(|(_, _, v)| v)
        .sum();
    assert!(model_events >= 2.0, "{model_events}");
    for (_, labels, _) in &s {
        assert!(labels.starts_with("run=\"d\",host=\""), "{labels}");
    }
    let (code, doc) = d.finish();
    assert_eq!(code, Some(0));
    assert!(doc.peaks_by_component.contains_key("model"));

    // The README's table is the generated one, verbatim.
    let readme_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let table = memtrack::export::prometheus::reference_table();
    let (before, rest) = readme
        .split_once("<!-- metrics:begin -->\n")
        .expect("README metrics markers");
    let (current, after) = rest
        .split_once("<!-- metrics:end -->")
        .expect("README metrics markers");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(
            &readme_path,
            format!("{before}<!-- metrics:begin -->\n{table}<!-- metrics:end -->{after}"),
        )
        .unwrap();
    } else {
        assert_eq!(
            current, table,
            "README metrics table is stale; rerun with UPDATE_SNAPSHOTS=1"
        );
    }
}

#[test]
fn endpoints_answer_and_refuse_the_right_things() {
    let dir = scratch();
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &["sleep".into(), "3".into()],
        &[],
    );
    // Before the first sample it says "stale" (503); then "ok".
    wait_for("healthz ok", Duration::from_secs(10), || {
        d.http("GET", "/healthz").0 == 200
    });
    let (status, body) = d.http("GET", "/healthz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"ok\""));
    let (status, body) = d.http("GET", "/memory-info");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    for key in [
        "host",
        "tree",
        "peak_usage",
        "gpus",
        "processes",
        "peaks_by_component",
    ] {
        assert!(!v[key].is_null(), "/memory-info lacks {key}: {v}");
    }
    assert!(v["tree"]["processes"].as_u64().unwrap() >= 1);
    let (status, body) = d.http("POST", "/cleanup-memory");
    assert_eq!(
        (status, body.contains("\"notified\": 0")),
        (200, true),
        "{body}"
    );
    assert_eq!(d.http("GET", "/cleanup-memory").0, 405);
    assert_eq!(d.http("DELETE", "/metrics").0, 405);
    assert_eq!(d.http("GET", "/admin").0, 404);
    assert_eq!(d.http("HEAD", "/metrics").0, 200);
    let (code, _) = d.finish();
    assert_eq!(code, Some(0));
}

#[test]
fn hostile_http_clients_never_stop_sampling() {
    let dir = scratch();
    let d = Daemon::start(
        dir.path(),
        &["--interval", "250ms"],
        &["sleep".into(), "16".into()],
        &[],
    );
    let addr = d.http;

    // Huge headers: refused (431) or cut off, never buffered whole.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(1 << 20)
    );
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert!(
        reply.is_empty() || reply.starts_with("HTTP/1.1 431"),
        "{}",
        &reply[..reply.len().min(200)]
    );

    // A body over the limit.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = write!(
        s,
        "POST /cleanup-memory HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{}",
        "b".repeat(100_000)
    );
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert!(
        reply.starts_with("HTTP/1.1 413"),
        "{}",
        &reply[..reply.len().min(200)]
    );

    // Bad methods: 405.
    for m in ["PUT", "PATCH", "TRACE", "DELETE"] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = write!(
            s,
            "{m} /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        );
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        assert!(reply.starts_with("HTTP/1.1 405"), "{m}: {reply}");
    }

    // Slow drip: headers a byte at a time never complete; the server
    // holds the connection until its header timeout, then cuts it off.
    let (connected_tx, connected) = std::sync::mpsc::channel();
    let drip = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
        let start = std::time::Instant::now();
        let mut told = false;
        for b in b"GET /metrics HTTP/1.1\r\nHost: slow\r\n".iter().cycle() {
            if s.write_all(&[*b]).is_err() || start.elapsed() > Duration::from_secs(12) {
                break;
            }
            if !told {
                told = true;
                let _ = connected_tx.send(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        start.elapsed()
    });
    // The drip is served before the crowd arrives; the crowd (the same
    // user) then needs room, and the drip, this user's oldest connection
    // that is not being answered, is closed to make it — or, failing
    // that, its header timeout ends it. The server accepts in the order
    // clients connect, so a scrape answered after the drip connected
    // shows the drip has its slot.
    connected.recv().unwrap();
    assert_eq!(
        d.http("GET", "/metrics").0,
        200,
        "a request after the drip is answered"
    );

    // 1000 connections at once: beyond the limit they are closed.
    let crowd: Vec<TcpStream> = (0..1000)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    assert!(crowd.len() > 100);
    // Bad methods while the crowd waits.
    for m in ["PUT", "PATCH", "TRACE"] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = write!(
            s,
            "{m} /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        );
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        // Either refused at the door (over the limit) or told 405.
        assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 405"),
            "{m}: {reply}"
        );
    }
    drop(crowd);
    let dripped = drip.join().unwrap();
    let limit = memtrack::export::http::REQUEST_TIMEOUT;
    assert!(
        dripped < limit * 2,
        "the slow client was cut off, by eviction or at the header timeout ({dripped:?})"
    );
    // And a normal scrape still works.
    assert_eq!(d.http("GET", "/metrics").0, 200);
    // Alone (the crowd's backlog accepted by now), a drip is held until its header timeout, then cut off.
    let mut s = TcpStream::connect(addr).unwrap();
    let start = std::time::Instant::now();
    for b in b"GET /metrics HTTP/1.1\r\nHost: slow\r\n".iter().cycle() {
        if s.write_all(&[*b]).is_err() || start.elapsed() > limit * 3 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let alone = start.elapsed();
    assert!(
        alone >= limit - Duration::from_millis(500) && alone < limit * 3,
        "a lone slow client is held, then cut off at the header timeout ({alone:?})"
    );

    let (code, doc) = d.finish();
    assert_eq!(code, Some(0));
    // A sampler the crowd held up would stop for seconds.
    assert_sampling_went_on(&doc, 2.0);
}

#[test]
fn a_taken_address_still_starts_the_job_an_unparsable_one_is_refused() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = scratch();
    let marker = dir.path().join("ran");
    let out = run_to_end(
        memtrack()
            .args(["run", "--listen", &addr, "--output"])
            .arg(dir.path())
            .args(["--", "touch"])
            .arg(&marker),
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(marker.exists(), "the job ran");
    assert!(
        stderr(&out).contains(&format!("cannot listen on {addr}")),
        "{}",
        stderr(&out)
    );
    let out = run_to_end(
        memtrack()
            .args(["run", "--listen", "nowhere", "--output"])
            .arg(dir.path())
            .args(["--", "true"]),
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("listen"), "{}", stderr(&out));
}

#[test]
fn post_cleanup_memory_runs_the_python_clients_handler() {
    let dir = scratch();
    let done = dir.path().join("cleaned");
    let subscribed = dir.path().join("subscribed");
    let script = format!(
        r#"
import os, sys, time
import memtrack
def free(notice):
    open({done:?}, 'w').write(notice.get('reason', '?'))
memtrack.on_cleanup(free)
assert memtrack.wait_subscribed(10)
open({subscribed:?}, 'w').write('x')
deadline = time.time() + 20
while not os.path.exists({done:?}) and time.time() < deadline:
    time.sleep(0.05)
"#,
        done = done.display().to_string(),
        subscribed = subscribed.display().to_string()
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &python(&script),
        &[("PYTHONPATH", src.to_str().unwrap())],
    );
    wait_for("the client to subscribe", Duration::from_secs(15), || {
        subscribed.exists()
    });
    let (status, body) = d.http("POST", "/cleanup-memory");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["notified"], 1, "{body}");
    wait_for("the cleanup handler", Duration::from_secs(10), || {
        done.exists()
    });
    assert_eq!(std::fs::read_to_string(&done).unwrap(), "http");
    let (code, _) = d.finish();
    assert_eq!(code, Some(0));
}

/// `Pss` of a live process from `smaps_rollup`, bytes.
fn pss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

#[test]
fn a_host_only_run_serves_no_gpu_figures() {
    let dir = scratch();
    let stop = dir.path().join("stop");
    let script = format!(
        r#"
import json, os, socket, time
s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET']); f = s.makefile('rwb')
f.write((json.dumps({{'component': 'model', 'operation': 'load', 'ack': True}}) + '\n').encode()); f.flush(); f.readline()
while not os.path.exists({stop:?}):
    time.sleep(0.05)
"#,
        stop = stop.display().to_string()
    );
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms", "--no-gpu"],
        &python(&script),
        &[],
    );
    let mut body = String::new();
    wait_for("the model's peaks", Duration::from_secs(15), || {
        body = d.http("GET", "/metrics").1;
        body.contains("memtrack_component_peak_memory_bytes{")
            && body.contains("component=\"model\"")
    });
    let peaks: Vec<&str> = body
        .lines()
        .filter(|l| {
            l.starts_with("memtrack_peak_memory_bytes{")
                || l.starts_with("memtrack_component_peak_memory_bytes{")
        })
        .collect();
    assert!(
        peaks.iter().any(|l| l.contains("figure=\"cpu_ram_used\"")),
        "{body}"
    );
    let gpu: Vec<&&str> = peaks
        .iter()
        .filter(|l| l.contains("figure=\"gpu_") || l.contains("figure=\"reserved_gpu"))
        .collect();
    assert!(gpu.is_empty(), "no GPU, no GPU figures: {gpu:#?}");
    std::fs::write(&stop, "").unwrap();
    let (code, _) = d.finish();
    assert_eq!(code, Some(0));
}

/// The Kubernetes sidecar's probe: `attach` without PIDs says 503 `idle`
/// while nothing is followed, 200 with the count once a process registers
/// over the socket, and 503 `idle` again once it is gone.
#[test]
fn healthz_says_what_is_followed_and_fails_while_nothing_is() {
    let dir = scratch();
    let sock = dir.path().join("m.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let mut daemon = memtrack()
        .args(["attach", "--interval", "100ms", "--name", "svc"])
        .args(["--listen", &addr.to_string(), "--output"])
        .arg(dir.path())
        .arg("--socket")
        .arg(&sock)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let health = || -> (u16, serde_json::Value) {
        match TcpStream::connect(addr) {
            Ok(_) => {
                let (code, body) = http_request(addr, "GET", "/healthz");
                (code, serde_json::from_str(&body).unwrap_or_default())
            }
            Err(_) => (0, serde_json::Value::Null),
        }
    };
    wait_for("healthz idle", Duration::from_secs(20), || {
        health().1["status"] == "idle"
    });
    let (code, body) = health();
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["processes"], 0, "{body}");

    let stop = dir.path().join("stop");
    let script = r#"
import json, os, socket, time
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["SOCK"]); f = s.makefile("rwb")
f.write((json.dumps({"component": "svc", "operation": "up", "ack": True}) + "\n").encode()); f.flush()
assert json.loads(f.readline())["ok"]
while not os.path.exists(os.environ["STOP"]): time.sleep(0.05)
"#;
    let mut client = std::process::Command::new("python3")
        .args(["-c", script])
        .env("SOCK", &sock)
        .env("STOP", &stop)
        .spawn()
        .unwrap();
    wait_for("healthz ok", Duration::from_secs(20), || health().0 == 200);
    let (_, body) = health();
    assert_eq!(body["status"], "ok", "{body}");
    assert!(body["processes"].as_u64().unwrap() >= 1, "{body}");
    assert_eq!(body["roots"], serde_json::json!([client.id()]), "{body}");

    std::fs::write(&stop, "").unwrap();
    assert!(client.wait().unwrap().success());
    wait_for("healthz idle again", Duration::from_secs(20), || {
        health().1["status"] == "idle"
    });
    assert_eq!(health().0, 503);
    signal(daemon.id(), "TERM");
    assert!(daemon.wait().unwrap().success());
}
