//! `memtrack advise` on real jobs: fork workers copying a parent's Python
//! objects, batch sizes stepped under `--memory-limit`, a job the kernel's
//! OOM killer ends there, a reported CUDA OOM (only the CUDA side faked),
//! and healthy jobs that get no warning.
//!
//! `--memory-limit` needs a memory cgroup memtrack may create (root and
//! cgroup v1's memory controller, as in CI). Where there is none these
//! tests fail, unless `MEMTRACK_ALLOW_SKIP` names why they may not run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

/// The Python client's sources, for `PYTHONPATH`.
fn client_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src")
}

/// `memtrack advise DIR --json`.
fn advise(dir: &Path) -> Vec<Value> {
    let out = run_to_end(
        memtrack().arg("advise").arg(dir).arg("--json"),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("advise --json is a JSON array")
}

fn find<'a>(advice: &'a [Value], code: &str) -> &'a Value {
    advice
        .iter()
        .find(|a| a["code"] == code)
        .unwrap_or_else(|| panic!("no `{code}` advice in {advice:#?}"))
}

fn figure(a: &Value, name: &str) -> f64 {
    a["figures"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("no figure {name} in {a:#}"))
}

/// Whether a memory cgroup with a limit can be made here; the test may
/// only skip when `MEMTRACK_ALLOW_SKIP` says why.
fn cgroup_or_skip() -> bool {
    let why = cgroup_unavailable().unwrap_or_default();
    can_run(
        "cgroup",
        why.is_empty(),
        &format!("--memory-limit needs a memory cgroup: {why}"),
    )
}

/// A process's unique memory (Private_Clean + Private_Dirty), MiB, as
/// the test reads it itself.
fn uss_of(pid: u32) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).expect("smaps_rollup");
    let kib = |key: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (kib("Private_Clean:") + kib("Private_Dirty:")) / 1024.0
}

/// memtrack's last USS of `pid` on /metrics, MiB.
fn metric_uss(d: &Daemon, pid: u32) -> Option<f64> {
    let (_, body) = d.http("GET", "/metrics");
    body.lines()
        .filter(|l| l.starts_with("memtrack_process_unique_memory_bytes{"))
        .find(|l| l.contains(&format!("pid=\"{pid}\"")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|b| b / MIB)
}

/// A parent builds 1.5 million Python strings (about 190 MiB) and forks
/// three workers; once told, each worker reads every string (writing its
/// reference count, which copies the page), says so, and waits.
const COPY_ON_READ_JOB: &str = r#"
import os, sys, time
go, pids_file, done = sys.argv[1], sys.argv[2], sys.argv[3]
data = [("x" * 64) + str(i) for i in range(1_500_000)]
pids = []
for w in range(3):
    pid = os.fork()
    if pid == 0:
        while not os.path.exists(go): time.sleep(0.02)
        n = 0
        for s in data: n += len(s)
        open(os.path.join(done, str(os.getpid())), "w").close()
        while not os.path.exists(go + ".end"): time.sleep(0.02)
        os._exit(0)
    pids.append(pid)
with open(pids_file + ".tmp", "w") as f: f.write(" ".join(map(str, pids)))
os.rename(pids_file + ".tmp", pids_file)
for p in pids: os.waitpid(p, 0)
"#;

#[test]
fn workers_copying_the_parents_objects_get_copy_on_read_and_their_cost() {
    let dir = scratch();
    let (go, pids_file, done) = (
        dir.path().join("go"),
        dir.path().join("pids"),
        dir.path().join("done"),
    );
    std::fs::create_dir(&done).unwrap();
    let mut job = python(COPY_ON_READ_JOB);
    for p in [&go, &pids_file, &done] {
        job.push(p.display().to_string());
    }
    let out = dir.path().join("runs");
    let d = Daemon::start(&out, &["--interval", "200ms"], &job, &[]);
    wait_for("the workers' PIDs", Duration::from_secs(60), || {
        pids_file.exists()
    });
    let pids: Vec<u32> = std::fs::read_to_string(&pids_file)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 3);
    // memtrack has read each worker's own memory before it copies.
    wait_for(
        "a first USS read of every worker",
        Duration::from_secs(60),
        || pids.iter().all(|p| metric_uss(&d, *p).is_some()),
    );
    std::fs::write(&go, "").unwrap();
    wait_for(
        "the workers to read the data",
        Duration::from_secs(120),
        || pids.iter().all(|p| done.join(p.to_string()).exists()),
    );
    let truth: Vec<f64> = pids.iter().map(|p| uss_of(*p)).collect();
    // …and again after they copied (the figure the advice rests on).
    wait_for(
        "memtrack to read the copies",
        Duration::from_secs(60),
        || {
            pids.iter()
                .zip(&truth)
                .all(|(p, t)| metric_uss(&d, *p).is_some_and(|m| m >= 0.95 * t))
        },
    );
    std::fs::write(go.with_extension("end"), "").unwrap();
    let (code, doc, log) = d.finish_logged();
    assert_eq!(code, Some(0), "{log}");

    // The advice is in the document, and `advise` says the same.
    let advice = advise(&out.join("d"));
    let written: Vec<Value> = doc
        .advice
        .iter()
        .map(|a| serde_json::to_value(a).unwrap())
        .collect();
    assert_eq!(written, advice, "memory_usage.json's advice[] and `advise`");
    let cost = find(&advice, "worker-cost");
    assert_eq!(figure(cost, "workers"), 3.0, "{cost:#}");
    for (pid, t) in pids.iter().zip(&truth) {
        let got = figure(cost, &format!("worker_{pid}_uss_mb"));
        assert!(
            (got - t).abs() <= 0.10 * t,
            "worker {pid}: memtrack {got:.1} MiB, smaps_rollup {t:.1} MiB"
        );
    }
    let copies = find(&advice, "copy-on-read");
    assert_eq!(copies["level"], "warning");
    let saving = figure(copies, "projected_saving_mb");
    let copied: f64 = truth.iter().sum();
    assert!(
        saving >= 0.5 * copied && saving <= 1.1 * copied,
        "projected saving {saving:.1} MiB of {copied:.1} MiB the workers hold alone"
    );
    assert!(copies["action"].as_str().unwrap().contains("NumPy"));

    // The report shows it first.
    let report = run_to_end(
        memtrack().arg("report").arg(out.join("d")),
        Duration::from_secs(60),
    );
    let text = String::from_utf8_lossy(&report.stdout);
    let first = text.lines().position(|l| l == "advice:");
    let peaks = text.lines().position(|l| l.starts_with("Peaks"));
    assert!(first.is_some() && first < peaks, "{text}");
    assert!(text.contains("[warning] copy-on-read:"), "{text}");
}

/// Holds a 24 MiB model, then for each batch size given steps with
/// 2 MiB per sample held, marking the step (with its batch size) while
/// the activations are held.
const BATCH_JOB: &str = r#"
import sys, memtrack
MIB = 1 << 20
def touched(n):
    b = bytearray(n)
    for i in range(0, n, 4096): b[i] = 1
    return b
model = touched(24 * MIB)
memtrack.mark("model", "ready", ack=True)
for b in map(int, sys.argv[1:]):
    with memtrack.span("train", "step", labels={"batch_size": str(b)}):
        act = touched(b * 2 * MIB)
        memtrack.mark("train", "step", labels={"batch_size": str(b)}, ack=True)
        del act
"#;

/// `memtrack run --memory-limit LIMIT` of [`BATCH_JOB`] at `sizes`.
fn batch_run(out: &Path, limit: &str, sizes: &[u64]) -> (Option<i32>, PathBuf, String) {
    let mut job = python(BATCH_JOB);
    job.extend(sizes.iter().map(u64::to_string));
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--no-gpu", "--interval", "100ms"])
            .args(["--memory-limit", limit, "--name", "b", "--output"])
            .arg(out)
            .arg("--")
            .args(&job)
            .env("PYTHONPATH", client_src()),
        Duration::from_secs(120),
    );
    (res.status.code(), out.join("b"), stderr(&res))
}

#[test]
fn batch_sizes_stepped_under_a_limit_give_the_largest_batch_that_fits() {
    if !cgroup_or_skip() {
        return;
    }
    let dir = scratch();
    let (code, run, log) = batch_run(&dir.path().join("fit"), "512M", &[8, 16, 32, 64]);
    assert_eq!(code, Some(0), "{log}");
    let doc = read_document(&run.join("memory_usage.json"));
    assert_eq!(doc.run.memory_limit_mb, Some(512.0));
    let advice = advise(&run);
    let fit = find(&advice, "batch-fit");
    assert_eq!(figure(fit, "capacity_mb"), 512.0, "{fit:#}");
    let per_sample = figure(fit, "per_sample_mb");
    assert!((per_sample - 2.0).abs() <= 0.15 * 2.0, "{fit:#}");
    let at_limit = figure(fit, "largest_batch_at_limit");
    let largest = figure(fit, "largest_batch");

    // The true largest batch, found by running it: 85 % of the answer at
    // the limit runs, 115 % is killed.
    let below = (0.85 * at_limit).floor() as u64;
    let (code, _, log) = batch_run(&dir.path().join("below"), "512M", &[below]);
    assert_eq!(code, Some(0), "batch {below} fits in 512 MiB: {log}");
    let above = (1.15 * at_limit).ceil() as u64;
    let (code, killed, log) = batch_run(&dir.path().join("above"), "512M", &[above]);
    assert_eq!(
        code,
        Some(137),
        "batch {above} does not fit in 512 MiB: {log}"
    );
    // With the run's headroom the answer stays within 15 % of the truth.
    assert!(
        largest >= 0.85 * at_limit && largest <= at_limit,
        "largest batch {largest} with headroom, {at_limit} at the limit"
    );

    // The killed run says why, naming the phase it died in.
    let advice = advise(&killed);
    let oom = find(&advice, "oom-killed");
    assert_eq!(oom["level"], "critical", "{oom:#}");
    let finding = oom["finding"].as_str().unwrap();
    assert!(finding.contains("during train/step"), "{finding}");
    assert!(finding.contains("of its 512 MiB limit"), "{finding}");
    assert_eq!(figure(oom, "limit_mb"), 512.0);
}

/// A training loop's steps as PyTorch runs them: each step allocates
/// 4 MiB per sample ("activations"), reads them ("backward") and frees
/// them before its end mark, so the marks alone never see the peak. Two
/// steps per batch size given, inside spans that name the batch size.
const FREEING_BATCH_JOB: &str = r#"
import sys, memtrack
MIB = 1 << 20
def touched(n):
    b = bytearray(n)
    for i in range(0, n, 4096): b[i] = 1
    return b
for b in map(int, sys.argv[1:]):
    for _ in range(2):
        with memtrack.span("train", "step", labels={"batch_size": str(b)}):
            act = touched(b * 4 * MIB)
            s = sum(act[::4096])
            del act
"#;

/// `memtrack run --memory-limit LIMIT` of [`FREEING_BATCH_JOB`] at
/// `sizes`: the exit code, the run's directory and memtrack's log.
fn freeing_run(out: &Path, limit: &str, sizes: &[u64]) -> (Option<i32>, PathBuf, String) {
    let mut job = python(FREEING_BATCH_JOB);
    job.extend(sizes.iter().map(u64::to_string));
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--no-gpu", "--interval", "100ms"])
            .args(["--memory-limit", limit, "--name", "f", "--output"])
            .arg(out)
            .arg("--")
            .args(&job)
            .env("PYTHONPATH", client_src()),
        Duration::from_secs(120),
    );
    (res.status.code(), out.join("f"), stderr(&res))
}

#[test]
fn a_step_that_frees_before_its_end_mark_gets_a_batch_that_runs() {
    if !cgroup_or_skip() {
        return;
    }
    let dir = scratch();
    let limit = "400M";
    let (code, run, log) = freeing_run(&dir.path().join("fit"), limit, &[8, 16, 32, 64]);
    assert_eq!(code, Some(0), "{log}");
    let advice = advise(&run);
    let fit = find(&advice, "batch-fit");
    assert_eq!(figure(fit, "capacity_mb"), 400.0, "{fit:#}");
    let per_sample = figure(fit, "per_sample_mb");
    assert!((per_sample - 4.0).abs() <= 0.15 * 4.0, "{fit:#}");
    let named = figure(fit, "largest_batch") as u64;

    // The true largest batch, found by running batches: one that fits
    // (`lo`) and one killed (`hi`), then halving the range between.
    let runs = std::cell::Cell::new(0);
    let fits = |b: u64| {
        runs.set(runs.get() + 1);
        let (code, _, log) = freeing_run(&dir.path().join(format!("b{}", runs.get())), limit, &[b]);
        assert!(
            code == Some(0) || code == Some(137),
            "batch {b}: exit {code:?}: {log}"
        );
        code == Some(0)
    };
    let (mut lo, mut hi) = (64u64, 128u64);
    assert!(fits(lo), "batch {lo} fits in {limit}");
    assert!(!fits(hi), "batch {hi} does not fit in {limit}");
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let truth = lo as f64;
    assert!(
        (named as f64) <= truth && (named as f64) >= 0.85 * truth,
        "named {named}, true largest {lo} (killed at {hi}): {fit:#}"
    );
    // The named batch runs.
    let (code, _, log) = freeing_run(&dir.path().join("named"), limit, &[named]);
    assert_eq!(
        code,
        Some(0),
        "the named batch {named} runs in {limit}: {log}"
    );
}

#[test]
fn a_memory_limit_without_a_cgroup_is_a_clear_error_before_the_job() {
    let dir = scratch();
    let marker = dir.path().join("ran");
    // A bad size is refused by its flag.
    let res = run_to_end(
        memtrack()
            .args([
                "run",
                "--listen",
                "off",
                "--memory-limit",
                "lots",
                "--output",
            ])
            .arg(dir.path())
            .args(["--", "touch"])
            .arg(&marker),
        Duration::from_secs(30),
    );
    assert_ne!(res.status.code(), Some(0));
    assert!(stderr(&res).contains("--memory-limit"), "{}", stderr(&res));
    assert!(!marker.exists(), "the job must not run");
    // A procfs without cgroups: no cgroup can be made, so no job.
    let fake = dir.path().join("proc");
    std::fs::create_dir_all(fake.join("self")).unwrap();
    std::fs::write(fake.join("self/cgroup"), "0::/\n").unwrap();
    std::fs::write(fake.join("self/mountinfo"), "").unwrap();
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--memory-limit", "1G", "--output"])
            .arg(dir.path().join("runs"))
            .args(["--", "touch"])
            .arg(&marker)
            .env("MEMTRACK_HOST_PROC_ROOT", &fake),
        Duration::from_secs(30),
    );
    let log = stderr(&res);
    assert_ne!(res.status.code(), Some(0), "{log}");
    assert!(
        log.contains("--memory-limit 1,024 MiB: memtrack cannot make a memory cgroup"),
        "{log}"
    );
    assert!(!marker.exists(), "the job must not run unlimited: {log}");
}

/// Reports a CUDA OOM through the real client, with only `torch.cuda`
/// faked: 60 GiB allocated of 75 GiB reserved when 2 GiB was asked for.
const CUDA_OOM_JOB: &str = r#"
import sys, types
torch = types.ModuleType("torch")
cuda = types.SimpleNamespace(
    is_initialized=lambda: True,
    memory_allocated=lambda: 60 << 30,
    memory_reserved=lambda: 75 << 30,
    max_memory_allocated=lambda: 70 << 30,
    current_device=lambda: 0,
    memory_summary=lambda: "|   fake allocator summary   |",
)
torch.cuda = cuda
sys.modules["torch"] = torch
import memtrack
err = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                   "capacity of 79.15 GiB of which 1.23 GiB is free.")
assert memtrack.report_oom(err) is not None, "the OOM was not recorded"
"#;

#[test]
fn a_reported_cuda_oom_gets_the_fragmentation_figure() {
    let dir = scratch();
    let res = run_to_end(
        memtrack()
            .args([
                "run", "--listen", "off", "--no-gpu", "--name", "c", "--output",
            ])
            .arg(dir.path())
            .arg("--")
            .args(python(CUDA_OOM_JOB))
            .env("PYTHONPATH", client_src()),
        Duration::from_secs(60),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let advice = advise(&dir.path().join("c"));
    let oom = find(&advice, "cuda-oom");
    assert_eq!(figure(oom, "requested_mb"), 2048.0);
    assert_eq!(figure(oom, "reserved_mb"), 75.0 * 1024.0);
    assert_eq!(figure(oom, "allocated_mb"), 60.0 * 1024.0);
    assert_eq!(figure(oom, "fragmentation_mb"), 15.0 * 1024.0);
    let action = oom["action"].as_str().unwrap();
    assert!(
        action.contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        "{action}"
    );
    // The text form says the same.
    let text = run_to_end(
        memtrack().arg("advise").arg(dir.path().join("c")),
        Duration::from_secs(30),
    );
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("[critical] cuda-oom: PID") && text.contains("15.0 GiB reserved but unused"),
        "{text}"
    );
}

/// The advice of a healthy run: at most informational items.
fn only_information(dir: &Path) -> Vec<Value> {
    let advice = advise(dir);
    for a in &advice {
        assert_eq!(a["level"], "info", "a healthy run gets no warning: {a:#}");
    }
    advice
}

#[test]
fn healthy_jobs_get_no_warning() {
    let dir = scratch();
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/demo_job.py");
    let res = run_to_end(
        memtrack()
            .args([
                "run", "--listen", "off", "--no-gpu", "--name", "demo", "--output",
            ])
            .arg(dir.path())
            .args(["--", python3()])
            .arg(&demo)
            .args(["--scale", "0.2", "--pause", "0.2"])
            .env("PYTHONPATH", client_src()),
        Duration::from_secs(120),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    only_information(&dir.path().join("demo"));

    let steady = "import time\nb = bytearray(64 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(3)\n";
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--no-gpu", "--interval", "100ms"])
            .args(["--name", "steady", "--output"])
            .arg(dir.path())
            .arg("--")
            .args(python(steady)),
        Duration::from_secs(60),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let advice = only_information(&dir.path().join("steady"));
    assert!(advice.is_empty(), "{advice:#?}");
    let text = run_to_end(
        memtrack().arg("advise").arg(dir.path().join("steady")),
        Duration::from_secs(30),
    );
    assert_eq!(
        String::from_utf8_lossy(&text.stdout),
        "no advice: nothing in this run's figures calls for a change\n"
    );
    // A report without advice has no advice section.
    let report = run_to_end(
        memtrack().arg("report").arg(dir.path().join("steady")),
        Duration::from_secs(30),
    );
    assert!(!String::from_utf8_lossy(&report.stdout).contains("advice:"));
}

#[test]
fn advise_refuses_what_is_not_a_run() {
    let dir = scratch();
    let res = run_to_end(
        memtrack().arg("advise").arg(dir.path().join("missing")),
        Duration::from_secs(30),
    );
    assert_ne!(res.status.code(), Some(0));
    assert!(stderr(&res).contains("missing"), "{}", stderr(&res));
    let bad = dir.path().join("memory_usage.json");
    std::fs::write(&bad, "{not json").unwrap();
    let res = run_to_end(memtrack().arg("advise").arg(&bad), Duration::from_secs(30));
    assert_ne!(res.status.code(), Some(0));
    assert!(
        stderr(&res).contains("memory_usage.json"),
        "{}",
        stderr(&res)
    );
}

/// The job holds 20,000 MiB of GPU 0 (fake NVML) beside another process
/// holding 12,000 MiB, then frees its own; each state is waited for
/// through a mark's sample.
const FOREIGN_GPU_JOB: &str = r#"
import os, sys, memtrack
state = sys.argv[1]
def put(text):
    open(state + ".tmp", "w").write(text)
    os.replace(state + ".tmp", state)
dev = "device 0 name=NVIDIA_Fake_H100 total_mib=81559\nprocess 0 1 12000\n"
def seen(own):
    while True:
        e = memtrack.mark("train", "step", ack=True)
        if e is not None and e["gpu_process_used_mb"] == own:
            return
put(dev + "process 0 %d 20000\n" % os.getpid())
seen(20000)
put(dev)
seen(0)
"#;

#[test]
fn memory_others_hold_on_the_jobs_gpu_is_named() {
    let dir = scratch();
    let state = dir.path().join("nvml.state");
    std::fs::write(&state, "device 0 name=NVIDIA_Fake_H100 total_mib=81559\n").unwrap();
    let mut job = python(FOREIGN_GPU_JOB);
    job.push(state.display().to_string());
    let res = run_to_end(
        memtrack()
            .args([
                "run",
                "--listen",
                "off",
                "--interval",
                "100ms",
                "--name",
                "g",
            ])
            .arg("--output")
            .arg(dir.path())
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .arg("--")
            .args(&job)
            .env("FAKE_NVML_STATE", &state)
            .env("PYTHONPATH", client_src()),
        Duration::from_secs(60),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let advice = advise(&dir.path().join("g"));
    let foreign = find(&advice, "foreign-gpu-memory");
    assert_eq!(foreign["level"], "warning");
    // The other process's 12,000 MiB, and the driver's own few hundred.
    let held = figure(foreign, "foreign_mb");
    assert!((12000.0..13024.0).contains(&held), "{foreign:#}");
    assert_eq!(figure(foreign, "total_mb"), 81559.0);
    let finding = foreign["finding"].as_str().unwrap();
    assert!(finding.contains("held outside this job"), "{finding}");
}

#[test]
fn cleanup_calls_that_free_nothing_are_called_useless() {
    let dir = scratch();
    let job = "import memtrack\nb = bytearray(64 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nfor step in range(3):\n    memtrack.mark('train', 'step', iteration=step, ack=True)\n    memtrack.clear_memory('train')\nmemtrack.mark('train', 'done', ack=True)\n";
    let res = run_to_end(
        memtrack()
            .args([
                "run", "--listen", "off", "--no-gpu", "--name", "u", "--output",
            ])
            .arg(dir.path())
            .arg("--")
            .args(python(job))
            .env("PYTHONPATH", client_src()),
        Duration::from_secs(60),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let advice = advise(&dir.path().join("u"));
    let useless = find(&advice, "cleanup-useless");
    assert_eq!(useless["level"], "info");
    assert_eq!(figure(useless, "calls"), 3.0, "{useless:#}");
    assert!(figure(useless, "freed_max_mb") < 16.0, "{useless:#}");
}

/// DataLoader-style workers as PyTorch forks them by default
/// (`persistent_workers=False`): three workers per epoch, forked again
/// each epoch, each reading every one of the parent's Python strings
/// (copying the pages) as soon as it starts. At its epoch's end each
/// worker reads its own `smaps_rollup` (the truth), then waits to be
/// told to end.
const EPOCH_WORKERS_JOB: &str = r#"
import os, sys, time
dir = sys.argv[1]
data = [("x" * 64) + str(i) for i in range(1_000_000)]
def uss():
    text = open("/proc/self/smaps_rollup").read()
    kib = lambda k: sum(int(l.split()[1]) for l in text.splitlines() if l.startswith(k))
    return (kib("Private_Clean:") + kib("Private_Dirty:")) / 1024
for epoch in range(3):
    pids = []
    for w in range(3):
        pid = os.fork()
        if pid == 0:
            n = 0
            for s in data: n += len(s)
            me = os.path.join(dir, str(os.getpid()))
            open(me + ".tmp", "w").write("%d %r" % (epoch, uss()))
            os.replace(me + ".tmp", me + ".uss")
            while not os.path.exists(me + ".end"): time.sleep(0.02)
            os._exit(0)
        pids.append(pid)
    for p in pids: os.waitpid(p, 0)
"#;

#[test]
fn workers_forked_each_epoch_are_all_counted_at_their_epochs_end() {
    let dir = scratch();
    let talk = dir.path().join("talk");
    std::fs::create_dir(&talk).unwrap();
    let mut job = python(EPOCH_WORKERS_JOB);
    job.push(talk.display().to_string());
    let out = dir.path().join("runs");
    let d = Daemon::start(&out, &["--interval", "200ms"], &job, &[]);
    // (epoch, pid, USS the worker read at its epoch's end).
    let mut truth: Vec<(u32, u32, f64)> = Vec::new();
    for epoch in 0..3u32 {
        let read = || -> Vec<(u32, u32, f64)> {
            std::fs::read_dir(&talk)
                .unwrap()
                .filter_map(|e| {
                    let path = e.ok()?.path();
                    let pid: u32 = path.file_stem()?.to_str()?.parse().ok()?;
                    (path.extension()? == "uss").then_some(())?;
                    let text = std::fs::read_to_string(&path).ok()?;
                    let (e, uss) = text.split_once(' ')?;
                    Some((e.parse().ok()?, pid, uss.parse().ok()?))
                })
                .filter(|(e, _, _)| *e == epoch)
                .collect()
        };
        wait_for(
            "the epoch's workers to read the data",
            Duration::from_secs(120),
            || read().len() == 3,
        );
        let workers = read();
        // memtrack has read each worker's copies before it ends.
        wait_for(
            "memtrack to read the epoch's copies",
            Duration::from_secs(60),
            || {
                workers
                    .iter()
                    .all(|(_, p, t)| metric_uss(&d, *p).is_some_and(|m| m >= 0.95 * t))
            },
        );
        for (_, p, _) in &workers {
            std::fs::write(talk.join(format!("{p}.end")), "").unwrap();
        }
        truth.extend(workers);
    }
    let (code, _, log) = d.finish_logged();
    assert_eq!(code, Some(0), "{log}");

    let advice = advise(&out.join("d"));
    let cost = find(&advice, "worker-cost");
    assert_eq!(figure(cost, "workers"), 9.0, "{cost:#}");
    assert_eq!(figure(cost, "workers_at_once"), 3.0, "{cost:#}");
    for (_, pid, t) in &truth {
        let got = figure(cost, &format!("worker_{pid}_uss_mb"));
        assert!(
            (got - t).abs() <= 0.15 * t,
            "worker {pid}: memtrack {got:.1} MiB, smaps_rollup {t:.1} MiB"
        );
    }
    // Together: the workers of one epoch, not of the run.
    let epoch_sum = |e: u32| -> f64 {
        truth
            .iter()
            .filter(|(x, _, _)| *x == e)
            .map(|(_, _, t)| t)
            .sum()
    };
    let at_once = (0..3).map(epoch_sum).fold(0.0, f64::max);
    let together = figure(cost, "workers_uss_mb");
    assert!(
        (together - at_once).abs() <= 0.15 * at_once,
        "together {together:.1} MiB, an epoch's workers {at_once:.1} MiB"
    );
    // Their memory is copies of the parent's strings.
    let copies = find(&advice, "copy-on-read");
    let saving = figure(copies, "projected_saving_mb");
    assert!(
        (saving - at_once).abs() <= 0.15 * at_once,
        "projected saving {saving:.1} MiB, an epoch's workers hold {at_once:.1} MiB alone"
    );
}

/// Grows 2 MiB every 100 ms (about 20 MiB/s) under a memory limit until
/// the kernel ends it; notes the time after each step and the first
/// forecast notice memtrack pushes.
const GROWING_JOB: &str = r#"
import json, os, sys, time, memtrack
base = sys.argv[1]
def put(name, text):
    open(base + name + ".tmp", "w").write(text)
    os.replace(base + name + ".tmp", base + name)
def seen(n):
    if n.get("level") == "forecast" and not os.path.exists(base + "notice"):
        put("notice", json.dumps(n))
memtrack.on_pressure(seen)
held = []
while True:
    b = bytearray(2 << 20)
    for i in range(0, len(b), 4096): b[i] = 1
    held.append(b)
    put("beat", repr(time.time()))
    time.sleep(0.1)
"#;

#[test]
fn a_job_growing_to_its_limit_is_forecast_on_metrics_and_to_its_subscribers() {
    if !cgroup_or_skip() {
        return;
    }
    let dir = scratch();
    let base = dir.path().join("g.");
    let mut job = python(GROWING_JOB);
    job.push(base.display().to_string());
    let out = dir.path().join("runs");
    let src = client_src().display().to_string();
    let d = Daemon::start(
        &out,
        &["--interval", "100ms", "--no-gpu", "--memory-limit", "640M"],
        &job,
        &[("PYTHONPATH", &src)],
    );
    let gauge = || -> Option<f64> {
        let (_, body) = d.http("GET", "/metrics");
        body.lines()
            .filter(|l| l.starts_with("memtrack_seconds_to_limit{"))
            .find(|l| l.contains("resource=\"host\"") && l.contains("limit=\"memory_limit\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    let mut first: Option<(f64, f64)> = None;
    wait_for("a forecast on /metrics", Duration::from_secs(60), || {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        first = gauge().map(|s| (now, s));
        first.is_some()
    });
    let (code, _, log) = d.finish_logged();
    assert_eq!(
        code,
        Some(137),
        "the job grows until the kernel ends it: {log}"
    );
    let killed_at: f64 = std::fs::read_to_string(dir.path().join("g.beat"))
        .unwrap()
        .parse()
        .unwrap();
    // The gauge's forecast, and the notice's, came true within 20 %.
    let (scraped_at, seconds) = first.unwrap();
    let actual = killed_at - scraped_at;
    assert!(
        actual > 0.0 && (scraped_at + seconds - killed_at).abs() <= 0.2 * actual + 0.5,
        "/metrics said {seconds:.1} s; the limit came {actual:.1} s later"
    );
    let notice: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("g.notice")).unwrap())
            .unwrap();
    assert_eq!(notice["type"], "pressure", "{notice}");
    assert_eq!(notice["resource"], "host", "{notice}");
    let at = notice["timestamp"].as_f64().unwrap();
    let said = notice["seconds_to_limit"].as_f64().unwrap();
    let actual = killed_at - at;
    assert!(
        actual > 0.0 && (at + said - killed_at).abs() <= 0.2 * actual + 0.5,
        "the notice said {said:.1} s at {at:.1}; the limit came {actual:.1} s later: {notice}"
    );
    assert!(
        notice["message"]
            .as_str()
            .unwrap()
            .starts_with("at this rate the job's host memory reaches its memory limit"),
        "{notice}"
    );
}
