//! Golden files: memtrack's outputs pinned byte for byte, so a change of
//! the JSON it writes, the reports it prints, the CLI's help and errors,
//! the socket protocol's replies or the `/metrics` exposition shows up as a
//! failing test with the first differing line.
//!
//! The goldens live in `tests/it/snapshots/golden/` (the help texts beside
//! the older `help.txt`); `UPDATE_SNAPSHOTS=1` rewrites them, and the diff
//! of that folder is then the change to review. Their inputs are fixed:
//! runs folded from a scripted record sequence through the store, and the
//! documents under `tests/it/fixtures/golden/` (copies of such runs, plus a
//! bare file as the Python trackers wrote it), never rewritten by a test.
//!
//! Nothing here depends on the clock, the host or the temporary directory.
//! Where an output must contain such a value (a daemon's timestamps, the
//! temporary path in an error), one named function below replaces exactly
//! that value, and nothing else.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::*;

// ---------------------------------------------------------------------------
// The library API the goldens use, all of it here: a module that moves is
// one line to edit.

use memtrack::app::LABEL_ENV;
use memtrack::export::prometheus::{render_with, ServerCounters};
use memtrack::model::json::write_document;
use memtrack::model::{GpuAttribution, PidNamespaceInfo, RunInfo};
use memtrack::sample::gpu::Device;
use memtrack::sample::procfs::SelfUsage;
use memtrack::store::pressure::Thresholds;
use memtrack::store::{Limits, Record, Store};

/// A store fed `records` (each a [`Record`] in its journal form), for a
/// run described by `run` ([`RunInfo`] as JSON), with the GPUs NVML would
/// describe at start and `limits` over the defaults.
fn store_of(run: Value, limits: Value, gpus: &[(u32, &str, &str)], records: &[Value]) -> Store {
    let run: RunInfo = serde_json::from_value(run).unwrap();
    let limits: Limits = serde_json::from_value(limits).unwrap();
    let mut store = Store::new(run, limits, Thresholds::default());
    let devices: Vec<Device> = gpus
        .iter()
        .map(|&(index, uuid, name)| Device {
            index,
            uuid: uuid.into(),
            name: name.into(),
        })
        .collect();
    // As on a host: NVML's PIDs are the tree's.
    let attribution = (!devices.is_empty()).then(|| GpuAttribution {
        reason: "memtrack runs in the host's PID namespace: NVML's PIDs are the tree's".into(),
        pid_namespace: PidNamespaceInfo {
            inode: Some(memtrack::sample::pidns::INIT_PID_NS_INODE),
            init: Some(true),
            nspid: vec![4242],
        },
        ..GpuAttribution::default()
    });
    store.describe_gpus(&devices, attribution);
    apply(&mut store, records);
    store
}

fn apply(store: &mut Store, records: &[Value]) {
    for r in records {
        let record: Record =
            serde_json::from_value(r.clone()).unwrap_or_else(|e| panic!("not a record ({e}): {r}"));
        store.apply(&record);
    }
}

/// `memory_usage.json` as the daemon writes it at the end of a run: the
/// store's streamed view through the atomic writer.
fn written_document(store: &Store) -> String {
    let dir = scratch();
    let path = dir.path().join("memory_usage.json");
    write_document(&path, &store.document_view()).unwrap();
    std::fs::read_to_string(&path).unwrap()
}

/// The `/metrics` body for the store's snapshot. What a live daemon fills
/// in from outside the store (tick durations, exporter failures, the HTTP
/// server's counters, memtrack's own RSS and CPU time, read from /proc)
/// is given fixed values here, so every family is present and pinned.
fn exposition(store: &Store) -> String {
    let mut snap = store.snapshot();
    for seconds in [0.000_4, 0.001_2, 0.003, 0.07] {
        snap.tick_seconds.observe(seconds);
    }
    snap.export_errors.insert("clearml".into(), 2);
    snap.export_errors.insert("checkpoint".into(), 0);
    let me = SelfUsage {
        rss_bytes: 25 * MIB_U,
        cpu_seconds: 1.25,
    };
    let server = ServerCounters {
        cleanup_throttled: 3,
        connections_evicted: 1,
    };
    String::from_utf8(render_with(&snap, Some(me), &server)).unwrap()
}

// ---------------------------------------------------------------------------
// Comparing with the goldens.

const MIB_U: u64 = 1024 * 1024;

fn snapshots() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/snapshots")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures/golden")
}

/// Compares `got` with the golden file `name` (under tests/it/snapshots),
/// or, with `UPDATE_SNAPSHOTS` set, writes it there.
fn assert_golden(name: &str, got: &str) {
    let path = snapshots().join(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, got).unwrap();
        return;
    }
    let Ok(want) = std::fs::read_to_string(&path) else {
        panic!(
            "no golden file tests/it/snapshots/{name}: create it with \
             `UPDATE_SNAPSHOTS=1 cargo test --test it golden` and review it"
        );
    };
    if got == want {
        return;
    }
    let shown = |l: Option<&str>| l.map_or("(end of file)".to_string(), |l| format!("{l:?}"));
    let (line, (w, g)) = want
        .split_inclusive('\n')
        .map(Some)
        .chain(std::iter::repeat(None))
        .zip(
            got.split_inclusive('\n')
                .map(Some)
                .chain(std::iter::repeat(None)),
        )
        .enumerate()
        .find(|(_, (w, g))| w != g)
        .map(|(i, pair)| (i + 1, pair))
        .unwrap_or((0, (None, None)));
    panic!(
        "output differs from the golden file tests/it/snapshots/{name}\n\
         first difference at line {line}:\n  golden: {}\n  now:    {}\n\
         If the change is intended, rewrite the goldens with \
         `UPDATE_SNAPSHOTS=1 cargo test --test it golden` and review \
         `git diff tests/it/snapshots` before committing.",
        shown(w),
        shown(g)
    );
}

// ---------------------------------------------------------------------------
// Normalisations: each replaces one kind of varying value, by name.

/// The scratch directory's path (it differs per run) as `<tmp>`.
fn without_tmp(text: &str, tmp: &Path) -> String {
    text.replace(&tmp.display().to_string(), "<tmp>")
}

/// This build's version (it changes with every release, not with the
/// output's form) as `<version>`, where it is a label value.
fn without_version(text: &str) -> String {
    text.replace(
        &format!("version=\"{}\"", env!("CARGO_PKG_VERSION")),
        "version=\"<version>\"",
    )
}

/// One JSON text with the values at `paths` replaced by `<number>`,
/// `"<string>"`, `<object>` or `<array>` (after what was there); every
/// other byte, key order and spacing included, is left as it was. A path
/// is the keys from the top joined by `.`, `[]` standing for any array
/// element and `*` for any one key: `entry.timestamp`,
/// `processes[].pid`, `peaks_by_component.*.samples`.
fn mask_json(text: &str, paths: &[&str]) -> String {
    struct Scan<'a> {
        s: &'a [u8],
        i: usize,
        out: Vec<u8>,
        paths: &'a [&'a str],
    }
    impl Scan<'_> {
        fn ws(&mut self) {
            while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
                self.out.push(self.s[self.i]);
                self.i += 1;
            }
        }
        fn masked(&self, path: &[String]) -> bool {
            self.paths.iter().any(|p| {
                let want: Vec<&str> = p.split('.').collect();
                want.len() == path.len() && want.iter().zip(path).all(|(w, g)| *w == "*" || w == g)
            })
        }
        /// The end of the value starting at `i` (a compact scan: the text
        /// is known to be JSON).
        fn skip(&self, mut i: usize) -> usize {
            let mut depth = 0usize;
            let mut in_string = false;
            while i < self.s.len() {
                let c = self.s[i];
                if in_string {
                    match c {
                        b'\\' => i += 1,
                        b'"' => {
                            in_string = false;
                            if depth == 0 {
                                return i + 1;
                            }
                        }
                        _ => {}
                    }
                } else {
                    match c {
                        b'"' => in_string = true,
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' if depth > 0 => {
                            depth -= 1;
                            if depth == 0 {
                                return i + 1;
                            }
                        }
                        b',' | b'}' | b']' if depth == 0 => return i,
                        c if depth == 0 && c.is_ascii_whitespace() => return i,
                        _ => {}
                    }
                }
                i += 1;
            }
            i
        }
        fn value(&mut self, path: &mut Vec<String>) {
            self.ws();
            let start = self.i;
            if self.masked(path) {
                let end = self.skip(start);
                let placeholder: &[u8] = match self.s[start] {
                    b'"' => b"\"<string>\"",
                    b'{' => b"<object>",
                    b'[' => b"<array>",
                    _ => b"<number>",
                };
                self.out.extend_from_slice(placeholder);
                self.i = end;
                return;
            }
            match self.s[start] {
                b'{' => {
                    self.out.push(b'{');
                    self.i += 1;
                    loop {
                        self.ws();
                        if self.s[self.i] == b'}' {
                            break;
                        }
                        let key_end = self.skip(self.i);
                        let key: String = serde_json::from_slice(&self.s[self.i..key_end]).unwrap();
                        self.out.extend_from_slice(&self.s[self.i..key_end]);
                        self.i = key_end;
                        self.ws();
                        self.out.push(b':');
                        self.i += 1;
                        path.push(key);
                        self.value(path);
                        path.pop();
                        self.ws();
                        if self.s[self.i] == b',' {
                            self.out.push(b',');
                            self.i += 1;
                        }
                    }
                    self.out.push(b'}');
                    self.i += 1;
                }
                b'[' => {
                    self.out.push(b'[');
                    self.i += 1;
                    let last = path.pop();
                    path.push(format!("{}[]", last.as_deref().unwrap_or("")));
                    loop {
                        self.ws();
                        if self.s[self.i] == b']' {
                            break;
                        }
                        self.value(path);
                        self.ws();
                        if self.s[self.i] == b',' {
                            self.out.push(b',');
                            self.i += 1;
                        }
                    }
                    path.pop();
                    if let Some(last) = last {
                        path.push(last);
                    }
                    self.out.push(b']');
                    self.i += 1;
                }
                _ => {
                    let end = self.skip(start);
                    self.out.extend_from_slice(&self.s[start..end]);
                    self.i = end;
                }
            }
        }
    }
    let mut scan = Scan {
        s: text.as_bytes(),
        i: 0,
        out: Vec::new(),
        paths,
    };
    scan.value(&mut Vec::new());
    scan.out.extend_from_slice(&scan.s[scan.i..]);
    String::from_utf8(scan.out).unwrap()
}

#[test]
fn mask_json_replaces_only_the_named_values() {
    let text = r#"{"id":7,"run":{"id":"x y","labels":{"host":"h"}},"entry":{"timestamp":1.5e9,"pid":3,"labels":{"pid":"keep"}},"processes":[{"pid":1,"name":"a"},{"pid":2,"name":"b\"c"}]}"#;
    let got = mask_json(
        text,
        &["run.id", "entry.timestamp", "entry.pid", "processes[].pid"],
    );
    assert_eq!(
        got,
        r#"{"id":7,"run":{"id":"<string>","labels":{"host":"h"}},"entry":{"timestamp":<number>,"pid":<number>,"labels":{"pid":"keep"}},"processes":[{"pid":<number>,"name":"a"},{"pid":<number>,"name":"b\"c"}]}"#
    );
    let pretty = "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {\n    \"c\": \"d\"\n  }\n}\n";
    assert_eq!(mask_json(pretty, &[]), pretty, "spacing is kept");
    assert_eq!(
        mask_json(pretty, &["*.c", "a"]),
        "{\n  \"a\": <array>,\n  \"b\": {\n    \"c\": \"<string>\"\n  }\n}\n"
    );
}

// ---------------------------------------------------------------------------
// The scripted runs: every figure fixed, in MiB unless named otherwise.

const T0: f64 = 1_700_000_000.0;
const GIB: u64 = 1024;

fn mib(m: u64) -> u64 {
    m * MIB_U
}

/// A process reading: RSS and high-water mark (MiB).
fn proc_reading(pid: u32, rss: u64, hwm: u64) -> Value {
    json!({"pid": pid, "rss": mib(rss), "hwm": mib(hwm), "pss": null, "uss": null})
}

fn joined(pid: u32, ppid: u32, name: &str, cmdline: &[&str], root: bool) -> Value {
    json!({
        "id": {"pid": pid, "start_ticks": u64::from(pid) * 10},
        "ppid": ppid, "start_time": T0 - 0.5, "name": name, "cmdline": cmdline, "root": root,
    })
}

/// A sample record: `kind` timer or event, the host part, the GPU part
/// (None: no GPU), and host totals.
fn sample(kind: &str, t: f64, host: Value, gpu: Option<Value>) -> Value {
    let (gpu, status) = match gpu {
        Some(g) => (g, json!("Sampled")),
        None => (
            json!({"devices": [], "processes": []}),
            json!("Unavailable"),
        ),
    };
    let mut host_part = json!({"processes": [], "joined": [], "left": [], "errors": 0});
    if let (Some(base), Value::Object(extra)) = (host_part.as_object_mut(), host) {
        base.extend(extra);
    }
    json!({
        "record": "sample", "kind": kind,
        "sample": {
            "timestamp": t, "host": host_part, "gpu": gpu, "gpu_status": status,
            "memory": {"total": mib(256 * GIB), "available": mib(200 * GIB)},
        }
    })
}

fn device(index: u32, used: u64, util: u32, temp: u32) -> Value {
    json!({
        "index": index, "used": mib(used), "free": mib(81_920 - used), "total": mib(81_920),
        "utilization_pct": util, "memory_utilization_pct": util / 2, "temperature_c": temp,
    })
}

fn mark(t: f64, pid: Option<u32>, component: &str, operation: &str) -> Value {
    json!({
        "timestamp": t, "pid": pid, "component": component, "operation": operation,
        "iteration": null, "labels": {}, "allocator": null, "kind": "event",
    })
}

fn with(mut v: Value, extra: Value) -> Value {
    if let (Some(base), Value::Object(extra)) = (v.as_object_mut(), extra) {
        base.extend(extra);
    }
    v
}

fn allocator(allocated: u64, reserved: u64, max_allocated: u64, device: u32) -> Value {
    json!({
        "allocated": mib(allocated), "reserved": mib(reserved),
        "max_allocated": mib(max_allocated), "device": device,
    })
}

fn record(kind: &str, body: Value) -> Value {
    with(json!({"record": kind}), body)
}

fn boundary(kind: &str, mark: Value, status: Option<&str>, message: Option<&str>) -> Value {
    json!({"record": kind, "mark": mark, "status": status, "message": message})
}

const GPUS: &[(u32, &str, &str)] = &[
    (
        0,
        "GPU-1f6b2c9e-0d3a-4c1e-9b7a-5e2f8d4c3b10",
        "NVIDIA A100-SXM4-80GB",
    ),
    (
        1,
        "GPU-7a2e4d11-6c5b-4f08-8e3d-2b9c1a0f4e27",
        "NVIDIA A100-SXM4-80GB",
    ),
];

fn train_run(rank: u32, host: &str) -> Value {
    json!({
        "id": format!("golden-train-{rank}"), "name": "train", "host": host, "mode": "run",
        "command": ["python3", "train.py", "--epochs", "2"], "start": T0,
        "labels": {
            "host": host, "rank": rank.to_string(), "model": "llama-7b",
            "precision": "bf16", "comment": "golden run",
        },
        "interval_s": 1.0, "memtrack_version": "0.0.0-golden", "gpu_backend": "nvml",
    })
}

/// A training run on two GPUs, `scale`d per rank: Σ Pss as the host
/// source until the job moves into a cgroup of its own, a `load` stage, a `train` stage failing
/// with a worker killed by a signal (its flight-recorder window), a span
/// with allocator marks, GPU pressure alerts, an NVML error, and an `eval`
/// stage left open. Returned in two parts: the second starts while the
/// worker, the span and the `train` stage are alive.
fn train_records(scale: u64) -> (Vec<Value>, Vec<Value>) {
    // Host figures scale with `scale`; GPU figures grow by 500 MiB a step,
    // staying on an 80 GiB card.
    let s = |m: u64| m * scale;
    let gs = |m: u64| m + 500 * (scale - 1);
    let main = 4242;
    let worker = 4250;
    let pss = |used: u64, peak: u64| {
        json!({"source": "pss", "used": mib(used), "peak": mib(peak), "age_s": 0.5,
               "pss_reads": 3, "pss_read_s": 0.012})
    };
    let cgroup = |used: u64, charged: u64, peak: u64| {
        json!({
            "source": "cgroup", "used": mib(used), "peak": mib(peak),
            "cgroup": {
                "usage": mib(charged), "interval_peak": mib(peak + 40),
                "kernel_peak": mib(peak + 100),
                "stat": {
                    "anon": mib(used.saturating_sub(60)), "file": mib(charged - used + 60), "shmem": mib(8),
                    "file_mapped": mib(40), "inactive_file": mib(charged - used), "active_file": mib(60),
                },
                "oom_kills": 0,
            },
        })
    };
    let gpu = |d0: u64, d1: u64, p0: u64, p1: u64, util: u32| {
        let mut processes = vec![json!({"pid": main, "device": 0, "used": mib(p0)})];
        if p1 > 0 {
            processes.push(json!({"pid": main, "device": 1, "used": mib(p1)}));
        }
        processes.push(json!({"pid": 9999, "device": 1, "used": mib(300)}));
        json!({
            "devices": [device(0, d0, util, 40 + util / 4), device(1, d1, util / 2, 38 + util / 8)],
            "processes": processes,
        })
    };
    let timer = |t: f64, procs: Vec<Value>, footprint: Value, gpu_part: Value| {
        sample(
            "timer",
            T0 + t,
            json!({"processes": procs, "footprint": footprint}),
            Some(gpu_part),
        )
    };

    let mut first = vec![
        with(
            sample(
                "event",
                T0 + 0.05,
                json!({
                    "processes": [proc_reading(main, s(512), s(512))],
                    "joined": [joined(main, 4200, "python3", &["python3", "train.py", "--epochs", "2"], true)],
                    "footprint": pss(s(480), s(500)),
                }),
                Some(gpu(gs(600), 300, gs(520), 0, 0)),
            ),
            json!({}),
        ),
        record(
            "mark",
            with(
                mark(T0 + 0.06, None, "system", "experiment_start"),
                json!({"kind": "system"}),
            ),
        ),
        boundary(
            "stage_begin",
            mark(T0 + 0.1, Some(main), "stage", "load"),
            None,
            None,
        ),
    ];
    // The host source comes with the first sample.
    first[0]["sample"]["host_source"] = json!({
        "source": "pss", "reason": "no memory cgroup holds only the job yet",
        "cgroup_created": false, "since": T0,
    });
    for (i, t) in [1.0, 2.0, 3.0].into_iter().enumerate() {
        let i = i as u64;
        first.push(timer(
            t,
            vec![proc_reading(main, s(900 + 400 * i), s(950 + 400 * i))],
            pss(s(850 + 400 * i), s(900 + 400 * i)),
            gpu(
                gs(2_000 + 6_000 * i),
                300,
                gs(1_900 + 6_000 * i),
                0,
                10 + 20 * i as u32,
            ),
        ));
    }
    first.extend([
        boundary(
            "stage_end",
            mark(T0 + 3.5, Some(main), "stage", "load"),
            Some("SUCCESS"),
            None,
        ),
        boundary("stage_begin", mark(T0 + 4.0, Some(main), "stage", "train"), None, None),
        boundary(
            "span_begin",
            with(
                mark(T0 + 4.2, Some(main), "model", "forward"),
                json!({"iteration": 0, "allocator": allocator(gs(20_000), gs(24_000), gs(21_000), 0)}),
            ),
            None,
            None,
        ),
    ]);
    // A data-loader worker joins inside the span (named once it has
    // executed), and the job's allocator marks follow.
    let mut join_worker = timer(
        5.0,
        vec![
            proc_reading(main, s(2_400), s(2_450)),
            proc_reading(worker, s(300), s(310)),
        ],
        cgroup(s(2_500), s(2_900), s(2_600)),
        gpu(gs(30_000), 20_000, gs(29_000), gs(19_000), 70),
    );
    join_worker["sample"]["host"]["joined"] =
        json!([joined(worker, main, "python3", &["python3"], false)]);
    // The job moved into a cgroup of its own: its charge from here on.
    join_worker["sample"]["host_source"] = json!({
        "source": "cgroup", "reason": "a memory cgroup created for the job",
        "cgroup": "/sys/fs/cgroup/memtrack.slice/train", "cgroup_version": 2,
        "cgroup_created": true, "since": T0 + 5.0,
    });
    join_worker["sample"]["host"]["described"] = json!([
        {"pid": worker, "name": "pt_data_worker", "cmdline": ["python3", "-c", "from multiprocessing.spawn import spawn_main"]}
    ]);
    first.push(join_worker);
    first.push(sample(
        "event",
        T0 + 5.4,
        json!({
            "processes": [proc_reading(main, s(2_500), s(2_500)), proc_reading(worker, s(320), s(320))],
            "footprint": cgroup(s(2_600), s(3_000), s(2_650)),
        }),
        Some(gpu(gs(31_000), 20_500, gs(30_000), gs(19_500), 72)),
    ));
    first.push(record(
        "mark",
        with(
            mark(T0 + 5.5, Some(main), "model", "step"),
            json!({
                "iteration": 1, "labels": {"lr": "0.001", "batch_size": "32"},
                "allocator": allocator(gs(30_000), gs(34_000), gs(31_500), 0),
            }),
        ),
    ));
    // The GPUs fill: 0 crosses 75 % (high) then 85 % (critical).
    for (i, (d0, d1)) in [(gs(62_000), 40_000), (gs(70_500), 50_000)]
        .into_iter()
        .enumerate()
    {
        let i = i as u64;
        first.push(timer(
            6.0 + i as f64,
            vec![
                proc_reading(main, s(2_600 + 100 * i), s(2_700 + 100 * i)),
                proc_reading(worker, s(400 + 200 * i), s(450 + 200 * i)),
            ],
            cgroup(s(2_900 + 300 * i), s(3_300 + 300 * i), s(3_000 + 300 * i)),
            gpu(d0, d1, d0 - 1_000, d1 / 2, 95),
        ));
    }
    let mut second = vec![
        // NVML failed for this one sample.
        with(
            timer(
                8.0,
                vec![
                    proc_reading(main, s(2_800), s(2_800)),
                    proc_reading(worker, s(900), s(900)),
                ],
                cgroup(s(3_600), s(4_000), s(3_700)),
                json!({"devices": [], "processes": []}),
            ),
            json!({}),
        ),
        boundary(
            "span_end",
            with(
                mark(T0 + 8.5, Some(main), "model", "forward"),
                json!({"iteration": 1, "allocator": allocator(gs(28_000), gs(34_000), gs(31_500), 0)}),
            ),
            None,
            None,
        ),
        record(
            "flight",
            json!({
                "reason": "signal", "timestamp": T0 + 8.9, "pid": worker, "name": "pt_data_worker",
                "exit": {"code": 137, "signal": 9, "known": true}, "interval_s": 0.1,
                "points": [
                    {"t": T0 + 8.7, "cpu_mb": (s(3_700)) as f64, "gpu_mb": 40_000.0,
                     "processes": [[f64::from(main), s(2_800) as f64, 40_000.0], [f64::from(worker), s(900) as f64, 0.0]]},
                    {"t": T0 + 8.8, "cpu_mb": (s(4_100)) as f64, "gpu_mb": 40_000.0,
                     "processes": [[f64::from(main), s(2_800) as f64, 40_000.0], [f64::from(worker), s(1_300) as f64, 0.0]]},
                ],
            }),
        ),
    ];
    second[0]["sample"]["gpu_status"] = json!({"Error": "NVML_ERROR_GPU_IS_LOST"});
    second[0]["sample"]["host"]["errors"] = json!(1);
    let mut worker_gone = timer(
        9.0,
        vec![proc_reading(main, s(2_700), s(2_800))],
        cgroup(s(2_900), s(3_400), s(4_200)),
        gpu(gs(60_000), 30_000, gs(59_000), 0, 40),
    );
    // The kernel's OOM killer ended it.
    worker_gone["sample"]["host"]["footprint"]["cgroup"]["oom_kills"] = json!(1);
    worker_gone["sample"]["host"]["left"] = json!([{
        "id": {"pid": worker, "start_ticks": u64::from(worker) * 10},
        "exit": {"code": 137, "signal": 9, "known": true}, "max_rss": mib(s(1_300)),
    }]);
    second.push(worker_gone);
    second.push(boundary(
        "stage_end",
        mark(T0 + 9.5, Some(main), "stage", "train"),
        Some("FAILED"),
        Some("data-loader worker 4250 was killed (SIGKILL)"),
    ));
    second.push(boundary(
        "stage_begin",
        with(
            mark(T0 + 10.0, Some(main), "stage", "eval"),
            json!({"labels": {"split": "validation"}}),
        ),
        None,
        None,
    ));
    // The process's own Pss and Uss (smaps) come with this sample.
    let mut evaluating = timer(
        11.0,
        vec![with(
            proc_reading(main, s(2_000), s(2_800)),
            json!({"pss": mib(s(1_900)), "uss": mib(s(1_700))}),
        )],
        cgroup(s(1_900), s(2_300), s(1_950)),
        gpu(gs(20_000), 300, gs(19_000), 0, 5),
    );
    evaluating["sample"]["host"]["footprint"]["cgroup"]["oom_kills"] = json!(1);
    second.push(evaluating);
    second.push(record(
        "exit",
        json!({"pid": main, "exit": {"code": 1, "known": true}, "max_rss": mib(s(3_000))}),
    ));
    let mut main_gone = timer(12.0, vec![], cgroup(0, 40, 0), gpu(300, 300, 0, 0, 0));
    main_gone["sample"]["host"]["footprint"]["cgroup"]["oom_kills"] = json!(1);
    main_gone["sample"]["host"]["left"] = json!([{
        "id": {"pid": main, "start_ticks": u64::from(main) * 10},
        "exit": null, "max_rss": null,
    }]);
    second.push(main_gone);
    second.push(record(
        "finish",
        json!({"timestamp": T0 + 12.5, "exit": {"code": 1, "known": true}}),
    ));
    (first, second)
}

/// Timer entries beyond this are merged in the train run, so merged
/// entries (`samples`, `timestamp_end`) are pinned too.
fn train_limits() -> Value {
    json!({"max_timer_entries": 6})
}

fn train_store(rank: u32, host: &str, scale: u64) -> Store {
    let (first, second) = train_records(scale);
    let mut store = store_of(train_run(rank, host), train_limits(), GPUS, &first);
    apply(&mut store, &second);
    store
}

/// An attached host-only process whose memory grows steadily for a
/// minute (a leak the rule must flag), Σ Pss as the host source, marks
/// every few seconds.
fn leaky_records() -> Vec<Value> {
    let pid = 777;
    let footprint = |used: u64| {
        json!({"source": "pss", "used": mib(used), "peak": mib(used + 2), "age_s": 1.5,
               "pss_reads": 4, "pss_read_s": 0.02})
    };
    let mut first = sample(
        "event",
        T0,
        json!({
            "processes": [proc_reading(pid, 820, 820)],
            "joined": [joined(pid, 1, "python3", &["python3", "serve.py", "--port", "8080"], true)],
            "footprint": footprint(780),
        }),
        None,
    );
    first["sample"]["host_source"] = json!({
        "source": "pss", "reason": "no memory cgroup holds only the job",
        "cgroup_created": false, "since": T0,
    });
    let mut records = vec![
        first,
        record(
            "mark",
            with(
                mark(T0 + 0.01, None, "system", "experiment_start"),
                json!({"kind": "system"}),
            ),
        ),
    ];
    for i in 1..=60u64 {
        let t = T0 + i as f64;
        // 12 MiB a second, with a little deterministic noise.
        let rss = 820 + 12 * i + (i * 37) % 11;
        records.push(sample(
            "timer",
            t,
            json!({"processes": [proc_reading(pid, rss, rss + 5)], "footprint": footprint(rss - 40)}),
            None,
        ));
        if i % 6 == 0 {
            records.push(sample(
                "event",
                t + 0.3,
                json!({"processes": [proc_reading(pid, rss + 3, rss + 5)], "footprint": footprint(rss - 37)}),
                None,
            ));
            records.push(record(
                "mark",
                with(
                    mark(t + 0.3, Some(pid), "server", "request_batch"),
                    json!({"iteration": i / 6, "labels": {"route": "/generate"}}),
                ),
            ));
        }
    }
    records.push(record(
        "finish",
        json!({"timestamp": T0 + 60.5, "exit": null}),
    ));
    records
}

fn leaky_run() -> Value {
    json!({
        "id": "golden-leaky", "name": "leaky", "host": "node-c", "mode": "attach",
        "command": [], "start": T0,
        "labels": {"host": "node-c", "model": "bert-base", "precision": "fp32"},
        "interval_s": 1.0, "memtrack_version": "0.0.0-golden",
        "gpu_backend": "none: disabled by configuration",
    })
}

// ---------------------------------------------------------------------------
// 1. memory_usage.json as the store and the writer make it.

#[test]
fn the_written_document_of_a_gpu_run_matches_its_golden() {
    assert_golden(
        "golden/document-train.json",
        &written_document(&train_store(0, "node-a", 1)),
    );
}

#[test]
fn the_written_document_of_a_leaking_run_matches_its_golden() {
    let store = store_of(leaky_run(), json!({}), &[], &leaky_records());
    let text = written_document(&store);
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        doc["leak"]["suspected"], true,
        "the scripted leak is flagged: {}",
        doc["leak"]
    );
    assert_golden("golden/document-leaky.json", &text);
}

// ---------------------------------------------------------------------------
// 5. The Prometheus exposition.

#[test]
fn the_exposition_of_a_live_gpu_run_matches_its_golden() {
    let (first, _) = train_records(1);
    let store = store_of(train_run(0, "node-a"), train_limits(), GPUS, &first);
    assert_golden(
        "golden/metrics-train-live.prom",
        &without_version(&exposition(&store)),
    );
}

#[test]
fn the_exposition_of_a_finished_host_only_run_matches_its_golden() {
    let store = store_of(leaky_run(), json!({}), &[], &leaky_records());
    assert_golden(
        "golden/metrics-leaky-finished.prom",
        &without_version(&exposition(&store)),
    );
}

// ---------------------------------------------------------------------------
// 2. The readers, over the fixture documents.

/// What one memtrack command did.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs memtrack in `cwd` with a fixed terminal width and none of the
/// variables that turn into run labels.
fn memtrack_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Ran {
    let mut cmd: Command = memtrack();
    cmd.current_dir(cwd).args(args).env("COLUMNS", "100");
    for (var, _) in LABEL_ENV {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out: Output = run_to_end(&mut cmd, Duration::from_secs(30));
    Ran {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

fn read_fixtures(args: &[&str]) -> String {
    let ran = memtrack_in(&fixtures(), args, &[]);
    assert_eq!(ran.code, Some(0), "memtrack {args:?}: {}", ran.stderr);
    assert_eq!(ran.stderr, "", "memtrack {args:?}");
    ran.stdout
}

#[test]
fn report_prints_its_golden_text() {
    for run in ["train", "leaky", "bare"] {
        assert_golden(
            &format!("golden/report-{run}.txt"),
            &read_fixtures(&["report", run]),
        );
    }
    assert_golden(
        "golden/report-train.json",
        &read_fixtures(&["report", "--json", "train/memory_usage.json"]),
    );
    assert_golden(
        "golden/report-leaky.json",
        &read_fixtures(&["report", "--json", "leaky"]),
    );
}

#[test]
fn compare_prints_its_golden_tables() {
    for (format, file) in [
        ("table", "compare.txt"),
        ("markdown", "compare.md"),
        ("csv", "compare.csv"),
    ] {
        assert_golden(
            &format!("golden/{file}"),
            &read_fixtures(&[
                "compare",
                "--format",
                format,
                "train",
                "train-rank1/memory_usage.json",
                "leaky",
                "bare",
            ]),
        );
    }
}

#[test]
fn merge_writes_its_golden_file() {
    let out = scratch();
    let merged = out.path().join("job/memory_usage.json");
    let merged_arg = merged.display().to_string();
    let ran = memtrack_in(
        &fixtures(),
        &[
            "merge",
            "train/memory_usage.json",
            "train-rank1/memory_usage.json",
            "-o",
            &merged_arg,
        ],
        &[],
    );
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(
        without_tmp(&ran.stderr, out.path()),
        "memtrack: merged 2 ranks into <tmp>/job/memory_usage.json\n"
    );
    let text = std::fs::read_to_string(&merged).unwrap();
    assert_golden("golden/merge-train.json", &text);
    // Without -o the same document goes to stdout, with a newline.
    let printed = read_fixtures(&[
        "merge",
        "train/memory_usage.json",
        "train-rank1/memory_usage.json",
    ]);
    assert_eq!(printed, format!("{text}\n"));
}

#[test]
fn plot_draws_its_golden_svg() {
    let out = scratch();
    for run in ["train", "leaky"] {
        let svg = out.path().join(format!("{run}.svg"));
        let svg_arg = svg.display().to_string();
        let ran = memtrack_in(
            &fixtures(),
            &[
                "plot", run, "-o", &svg_arg, "--width", "960", "--height", "600",
            ],
            &[],
        );
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
        assert_eq!(
            without_tmp(&ran.stderr, out.path()),
            format!("memtrack: wrote <tmp>/{run}.svg\n")
        );
        assert_golden(
            &format!("golden/plot-{run}.svg"),
            &std::fs::read_to_string(&svg).unwrap(),
        );
    }
}

// ---------------------------------------------------------------------------
// 3. The CLI: help, configuration, and what bad input prints.

const SUBCOMMANDS: &[&str] = &[
    "attach",
    "mark",
    "status",
    "cleanup",
    "recover",
    "advise",
    "upload",
    "clearml-resend",
    "mlflow-resend",
    "report",
    "compare",
    "merge",
    "plot",
    "watch",
    "config",
];

#[test]
fn every_subcommand_help_matches_its_golden() {
    // `--help` and `run --help` are pinned by cli.rs (help.txt,
    // help-run.txt); every other subcommand here.
    let out = scratch();
    for sub in SUBCOMMANDS {
        let ran = memtrack_in(out.path(), &[sub, "--help"], &[]);
        assert_eq!(ran.code, Some(0), "{sub}: {}", ran.stderr);
        assert_eq!(ran.stderr, "", "{sub}");
        assert_golden(&format!("help-{sub}.txt"), &ran.stdout);
    }
}

#[test]
fn config_prints_its_golden_settings() {
    let out = scratch();
    let ran = memtrack_in(out.path(), &["config", "--defaults"], &[]);
    assert_eq!((ran.code, ran.stderr.as_str()), (Some(0), ""));
    assert_golden("golden/config-defaults.toml", &ran.stdout);

    // Every layer: a file, the environment, flags.
    let file = fixtures().join("config.toml").display().to_string();
    let ran = memtrack_in(
        out.path(),
        &[
            "config",
            "--show",
            "--config",
            &file,
            "--interval",
            "250ms",
            "--label",
            "team=nlp",
            "--no-gpu",
            "--listen",
            "off",
        ],
        &[
            ("MEMTRACK_LOG_LEVEL", "debug"),
            ("MEMTRACK_HOST_SMAPS", "true"),
        ],
    );
    assert_eq!((ran.code, ran.stderr.as_str()), (Some(0), ""));
    assert_golden("golden/config-show.toml", &ran.stdout);
}

/// A bad input: the golden's name, the arguments, extra environment.
type ErrorCase<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>);

/// What each bad input prints: the exit status, stderr and stdout.
#[test]
fn bad_input_prints_its_golden_error() {
    let out = scratch();
    let tmp = out.path();
    let write = |name: &str, text: &str| {
        let p = tmp.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let unknown_key = write("unknown-key.toml", "intervall = \"1s\"\n");
    let bad_type = write("bad-type.toml", "interval = 5\n");
    let bad_table = write("bad-table.toml", "[log]\nmax_timer_entries = \"many\"\n");
    let bad_pressure = write(
        "bad-pressure.toml",
        "[pressure]\nhigh = 0.9\ncritical = 0.8\n",
    );
    let not_json = write("not-json.json", "[1, 2");
    let missing = tmp.join("missing.json").display().to_string();
    let svg_out = tmp.join("x.svg").display().to_string();
    let gif_out = tmp.join("x.gif").display().to_string();
    let train = fixtures().join("train").display().to_string();
    let fixtures_dir = fixtures().display().to_string();

    let cases: Vec<ErrorCase<'_>> = vec![
        ("unknown-flag", vec!["run", "--bogus", "--", "true"], vec![]),
        ("unknown-subcommand", vec!["frobnicate"], vec![]),
        ("run-without-command", vec!["run"], vec![]),
        (
            "config-conflicting-flags",
            vec!["config", "--defaults", "--show"],
            vec![],
        ),
        (
            "config-unknown-key",
            vec!["config", "--show", "--config", &unknown_key],
            vec![],
        ),
        (
            "config-bad-value-type",
            vec!["config", "--show", "--config", &bad_type],
            vec![],
        ),
        (
            "config-bad-value-type-in-table",
            vec!["config", "--show", "--config", &bad_table],
            vec![],
        ),
        (
            "config-bad-pressure",
            vec!["config", "--show", "--config", &bad_pressure],
            vec![],
        ),
        (
            "config-missing-file",
            vec!["config", "--show", "--config", &missing],
            vec![],
        ),
        (
            "env-unknown-key",
            vec!["config", "--show"],
            vec![("MEMTRACK_INTERVALL", "1s")],
        ),
        (
            "env-bad-value-type",
            vec!["config", "--show"],
            vec![("MEMTRACK_LOG_MAX_TIMER_ENTRIES", "lots")],
        ),
        (
            "flag-bad-duration",
            vec!["config", "--show", "--interval", "5parsecs"],
            vec![],
        ),
        (
            "flag-duration-out-of-range",
            vec!["config", "--show", "--interval", "1ms"],
            vec![],
        ),
        (
            "flag-bad-label",
            vec!["config", "--show", "--label", "novalue"],
            vec![],
        ),
        (
            "flag-bad-host-source",
            vec!["config", "--show", "--host-source", "fast"],
            vec![],
        ),
        (
            "flag-bad-listen",
            vec!["config", "--show", "--listen", "nowhere"],
            vec![],
        ),
        (
            "watch-bad-interval",
            vec!["watch", "--interval", "soon", "--socket", &missing],
            vec![],
        ),
        (
            "mark-bad-iteration",
            vec!["mark", "model", "step", "--iteration", "-3"],
            vec![],
        ),
        (
            "clearml-resend-bad-timeout",
            vec!["clearml-resend", &fixtures_dir, "--timeout", "forever"],
            vec![],
        ),
        ("report-missing-file", vec!["report", &missing], vec![]),
        ("report-not-json", vec!["report", &not_json], vec![]),
        (
            "report-directory-without-document",
            vec!["report", &fixtures_dir],
            vec![],
        ),
        ("compare-without-files", vec!["compare"], vec![]),
        (
            "compare-bad-format",
            vec!["compare", "--format", "xml", &train],
            vec![],
        ),
        ("merge-not-json", vec!["merge", &not_json], vec![]),
        (
            "plot-too-small",
            vec!["plot", &train, "-o", &svg_out, "--width", "10"],
            vec![],
        ),
        (
            "plot-bad-extension",
            vec!["plot", &train, "-o", &gif_out],
            vec![],
        ),
        (
            "status-without-daemon",
            vec!["status", "--socket", &missing],
            vec![],
        ),
    ];
    for (name, args, env) in cases {
        let ran = memtrack_in(tmp, &args, &env);
        let shown = without_tmp(
            &format!(
                "exit: {}\n--- stderr\n{}--- stdout\n{}",
                ran.code.map_or("signal".into(), |c| c.to_string()),
                ran.stderr,
                ran.stdout
            ),
            tmp,
        );
        // The fixtures' folder is the source tree's, also varying.
        let shown = shown.replace(&fixtures_dir, "<fixtures>");
        assert_golden(&format!("golden/errors/{name}.txt"), &shown);
    }
}

// ---------------------------------------------------------------------------
// 4. The socket protocol, spoken to a real daemon.

/// The values of a reply that come from the moment and the machine:
/// when a mark arrived and what the tree held then (the job is a real
/// `cat`), the sender's PID (this test's), and the run's identity and
/// start. Everything else in a reply is pinned.
const VARYING_REPLY_FIELDS: &[&str] = &[
    "entry.timestamp",
    "entry.pid",
    "entry.cpu_ram_used_mb",
    "entry.cpu_ram_hwm_mb",
    "run.id",
    "run.host",
    "run.start",
    "current.timestamp",
    "current.cpu_ram_used_mb",
    "current.cpu_rss_mb",
    "current.cpu_hwm_mb",
    "peak_usage.cpu_ram_used_mb",
    "peak_usage.cpu_ram_hwm_mb",
    "peaks_by_component.*.cpu_ram_used_mb",
    "peaks_by_component.*.cpu_ram_hwm_mb",
    "processes[].pid",
    "processes[].ppid",
    "processes[].rss_mb",
    "processes[].peak_rss_mb",
    "processes[].hwm_mb",
    "processes[].pss_mb",
    "processes[].uss_mb",
];

/// One line sent, and whether the daemon answers it.
struct Step {
    line: Vec<u8>,
    /// How the line is shown in the transcript (None: as sent).
    shown: Option<String>,
    replies: bool,
}

fn step(line: &str) -> Step {
    Step {
        line: line.as_bytes().to_vec(),
        shown: None,
        replies: true,
    }
}

/// Bytes as sent, with anything but printable ASCII as `\xNN`.
fn printable(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            0x20..=0x7e => char::from(b).to_string(),
            _ => format!("\\x{b:02x}"),
        })
        .collect()
}

/// A transcript of `steps` on one connection: `> ` what was sent, `< ` each
/// reply line exactly as received (newline included), and `<closed>` when
/// the daemon hung up.
fn converse(socket: &Path, steps: Vec<Step>, transcript: &mut String) {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    for s in steps {
        // A write the daemon cut short (it closes after an oversized
        // line) shows as a missing reply below.
        let _ = stream
            .write_all(&s.line)
            .and_then(|()| stream.write_all(b"\n"));
        let shown = s.shown.unwrap_or_else(|| printable(&s.line));
        transcript.push_str(&format!("> {shown}\n"));
        if !s.replies {
            continue;
        }
        let mut reply = Vec::new();
        if let Err(e) = reader.read_until(b'\n', &mut reply) {
            panic!("no reply to the last line ({e}); so far:\n{transcript}");
        }
        let reply = String::from_utf8(reply).unwrap();
        assert!(reply.ends_with('\n'), "a whole reply line: {reply:?}");
        transcript.push_str(&format!("< {}", mask_json(&reply, VARYING_REPLY_FIELDS)));
    }
    // The connection ends here: the daemon has nothing more to say.
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut rest = Vec::new();
    match reader.read_to_end(&mut rest) {
        Ok(_) => {}
        // Closing with bytes of ours unread resets the connection.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("reading to the end: {e}"),
    }
    assert_eq!(String::from_utf8_lossy(&rest), "", "no unasked-for lines");
    transcript.push_str("<closed>\n");
}

#[test]
fn the_daemon_answers_a_scripted_conversation_as_its_golden() {
    let dir = scratch();
    let socket = dir.path().join("m.sock");
    // The job is `cat`: it lives until its stdin closes. A one-hour
    // interval keeps timer samples out of the conversation; pressure
    // levels set at 0.01 % make the host's level `emergency` on any
    // machine, from the first sample on.
    let mut cmd = memtrack();
    cmd.args([
        "run",
        "--name",
        "proto",
        "--interval",
        "1h",
        "--listen",
        "off",
        "--no-gpu",
        "--no-clearml",
        "--host-source",
        "rss",
        "--label",
        "host=golden",
        "--output",
    ])
    .arg(dir.path())
    .arg("--socket")
    .arg(&socket)
    .args(["--", "cat"])
    .env("MEMTRACK_PRESSURE_HIGH", "0.0001")
    .env("MEMTRACK_PRESSURE_CRITICAL", "0.0002")
    .env("MEMTRACK_PRESSURE_EMERGENCY", "0.0003")
    .env("MEMTRACK_PRESSURE_HYSTERESIS", "0")
    .stdin(Stdio::piped())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    for (var, _) in LABEL_ENV {
        cmd.env_remove(var);
    }
    let mut daemon = cmd.spawn().unwrap();
    wait_for("the socket", Duration::from_secs(20), || {
        UnixStream::connect(&socket).is_ok()
    });

    let mut t = String::new();
    t.push_str("# recorded marks, spans and stages, with acks\n");
    converse(
        &socket,
        vec![
            step(r#"{"type":"register","id":1}"#),
            step(
                r#"{"v":1,"type":"mark","component":"model","operation":"before_generate","iteration":17,"labels":{"bs":"128"},"allocator":{"allocated":1073741824,"reserved":2147483648,"max_allocated":1610612736,"device":0},"ack":true,"id":"a1","future_field":[1,2]}"#,
            ),
            step(
                r#"{"type":"span_begin","component":"model","operation":"generate","ack":true,"id":2}"#,
            ),
            step(
                r#"{"type":"stage_begin","name":"train","labels":{"epoch":"1"},"ack":true,"id":3}"#,
            ),
            step(r#"{"component":"data","operation":"batch","iteration":0,"ack":true,"id":4}"#),
            step(
                r#"{"type":"span_end","component":"model","operation":"generate","ack":true,"id":5}"#,
            ),
            step(
                r#"{"type":"stage_end","name":"train","status":"FAILED","message":"boom","ack":true,"id":6}"#,
            ),
            step(r#"{"type":"stage_begin","name":"eval","ack":true,"id":7}"#),
            step(r#"{"type":"status","id":"s1"}"#),
            step(r#"{"type":"cleanup","id":8}"#),
            // Without an ack a task announcement is not answered; with one,
            // a daemon not reporting to ClearML says so at once.
            Step {
                line: br#"{"type":"clearml_task","task":"0123abcd","id":9}"#.to_vec(),
                shown: None,
                replies: false,
            },
            step(r#"{"type":"clearml_task","task":"0123abcd","ack":true,"id":"9a"}"#),
            // The SDK's close offered: not taken over, the SDK keeps it.
            step(
                r#"{"type":"clearml_close","task":"0123abcd","status":"completed","ack":true,"id":"9b"}"#,
            ),
            step(r#"{"type":"register","id":10}"#),
        ],
        &mut t,
    );

    t.push_str("\n# refused lines: each answered, the connection kept\n");
    let long_id = format!(r#"{{"type":"status","id":"{}"}}"#, "i".repeat(65));
    let seventeen_labels = format!(
        r#"{{"component":"a","operation":"x","labels":{{{}}},"id":27}}"#,
        (0..17)
            .map(|i| format!("\"k{i}\":\"v\""))
            .collect::<Vec<_>>()
            .join(",")
    );
    let long_value = format!(
        r#"{{"component":"a","operation":"x","labels":{{"k":"{}"}},"id":28}}"#,
        "v".repeat(257)
    );
    let long_name = format!(
        r#"{{"component":"{}","operation":"x","id":29}}"#,
        "c".repeat(129)
    );
    let mut refused = vec![
        step("not json"),
        step(r#"{"component":"#),
        step("[1,2,3]"),
        step(r#"{"a":1} {"b":2}"#),
        step(r#"{"type":"launch","id":20}"#),
        step(r#"{"v":2,"type":"mark","component":"a","operation":"x","id":21}"#),
        step(r#"{"operation":"x","id":22}"#),
        step(r#"{"component":"","operation":"x","id":23}"#),
        step(r#"{"component":"a","operation":"x","iteration":-1,"id":24}"#),
        step(r#"{"component":"a","operation":"x","iteration":"7","id":25}"#),
        step(r#"{"component":"a","operation":"x","labels":{"bad-name":"v"},"id":26}"#),
        step(&seventeen_labels),
        step(&long_value),
        step(&long_name),
        step(r#"{"component":"a","operation":"x","labels":{"k":1},"id":30}"#),
        step(
            r#"{"component":"a","operation":"x","allocator":{"allocated":17592186044417,"reserved":0,"max_allocated":0},"id":31}"#,
        ),
        step(&long_id),
        step(
            r#"{"type":"stage_end","name":"train","status":"THIS-STATUS-IS-FAR-TOO-LONG-TO-KEEP","id":32}"#,
        ),
        step(r#"{"type":"clearml_task","task":"bad id!","ack":true,"id":33}"#),
        step(r#"{"component":"a\u0000b","operation":"x","id":34}"#),
    ];
    refused.push(Step {
        line: b"{\"component\":\"\xff\xfe\",\"operation\":\"x\"}".to_vec(),
        shown: None,
        replies: true,
    });
    refused.push(Step {
        line: b"\0\0\0\0".to_vec(),
        shown: None,
        replies: true,
    });
    // A blank line is skipped without a reply; the next line is answered.
    refused.push(Step {
        line: b"   ".to_vec(),
        shown: Some("(three spaces)".into()),
        replies: false,
    });
    refused.push(step(r#"{"type":"register","id":35}"#));
    converse(&socket, refused, &mut t);

    t.push_str("\n# an oversized line: answered, then the connection closed\n");
    let mut oversized = b"{\"component\":\"".to_vec();
    oversized.resize(70_000, b'a');
    converse(
        &socket,
        vec![Step {
            line: oversized,
            shown: Some("{\"component\":\"aaa… (70000 bytes, then a newline)".into()),
            replies: true,
        }],
        &mut t,
    );

    t.push_str("\n# a subscription\n");
    converse(
        &socket,
        vec![step(r#"{"type":"subscribe","id":"sub"}"#)],
        &mut t,
    );

    drop(daemon.stdin.take());
    let status = daemon.wait().unwrap();
    let mut stderr = String::new();
    daemon
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert_golden("golden/protocol.txt", &t);
}
