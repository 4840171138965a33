//! The core: real jobs, real memory, real exits.

use std::path::Path;
use std::time::{Duration, Instant};

use memtrack::model::{EntryKind, GpuSource};

use crate::common::*;

#[test]
fn peak_of_a_300_mib_job_matches_its_rss() {
    let out_dir = scratch();
    let base_file = out_dir.path().join("base");
    let script = format!(
        r#"
import os, time
def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
open({base:?}, 'w').write(str(rss()))
b = bytearray(300 << 20)
for i in range(0, len(b), 4096): b[i] = 1
time.sleep(2)
"#,
        base = base_file.display().to_string()
    );
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "100ms", "--output"])
            .arg(out_dir.path())
            .arg("--")
            .args(python(&script)),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    let base: f64 = std::fs::read_to_string(&base_file)
        .unwrap()
        .parse()
        .unwrap();
    let expected = (base + 300.0 * MIB) / MIB;
    let peak = doc.peak_usage.figures.cpu_ram_used_mb;
    assert!(
        (peak - expected).abs() / expected < 0.05,
        "peak {peak:.1} MiB, expected {expected:.1} MiB (baseline {:.1} + 300)",
        base / MIB
    );
    assert_eq!(doc.run.exit.unwrap().code, 0);
    assert_eq!(
        doc.detailed_log.first().unwrap().operation,
        "experiment_start"
    );
    assert_eq!(doc.detailed_log.last().unwrap().operation, "experiment_end");
}

#[test]
fn a_20ms_spike_between_ticks_shows_through_vmhwm() {
    let out_dir = scratch();
    // Σ Pss: the spike shows through the job's VmHWM rising between two
    // reads (the cgroup's own peak is tested in host.rs).
    let out = run_to_end(
        memtrack()
            .args([
                "run",
                "--interval",
                "1s",
                "--host-source",
                "pss",
                "--output",
            ])
            .arg(out_dir.path())
            .arg("--")
            .args(python(SPIKE_JOB)),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    assert!(
        doc.peak_usage.figures.cpu_ram_hwm_mb >= 400.0,
        "hwm peak {:.1} MiB",
        doc.peak_usage.figures.cpu_ram_hwm_mb
    );
    assert!(doc.targets[0].hwm_mb >= 400.0);
    assert!(
        doc.summary.peak_host_ram_mb >= 400.0,
        "the re-run summary uses the true peak"
    );
}

#[test]
fn forked_children_join_the_tree_and_leave_it() {
    let out_dir = scratch();
    let script = r#"
import os, time
pids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        b = bytearray(100 << 20)
        for j in range(0, len(b), 4096): b[j] = 1
        time.sleep(2.0)
        os._exit(0)
    pids.append(pid)
for p in pids: os.waitpid(p, 0)
time.sleep(1.0)
"#;
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "100ms", "--output"])
            .arg(out_dir.path())
            .arg("--")
            .args(python(script)),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    assert_eq!(doc.targets.len(), 5, "{:#?}", doc.targets);
    assert_eq!(doc.targets.iter().filter(|t| t.root).count(), 1);
    assert!(
        doc.peak_usage.figures.cpu_ram_used_mb >= 400.0,
        "tree peak {:.1} MiB covers all five",
        doc.peak_usage.figures.cpu_ram_used_mb
    );
    let children: Vec<_> = doc.targets.iter().filter(|t| !t.root).collect();
    for c in &children {
        assert!(
            c.peak_rss_mb >= 100.0,
            "child {} peak {}",
            c.pid,
            c.peak_rss_mb
        );
        assert!(c.exited_at.is_some(), "child {} left the tree", c.pid);
    }
    let last_child_exit = children
        .iter()
        .filter_map(|c| c.exited_at)
        .fold(0.0, f64::max);
    let after: Vec<f64> = doc
        .detailed_log
        .iter()
        .filter(|e| e.kind == EntryKind::Timer && e.timestamp > last_child_exit)
        .map(|e| e.figures.cpu_ram_used_mb)
        .collect();
    assert!(!after.is_empty());
    // What led up to it, should it fail: the samples from a second before
    // the last child left, and when each child left.
    let around: Vec<(f64, f64)> = doc
        .detailed_log
        .iter()
        .filter(|e| e.kind == EntryKind::Timer && e.timestamp > last_child_exit - 1.0)
        .map(|e| (e.timestamp - last_child_exit, e.figures.cpu_ram_used_mb))
        .collect();
    let exits: Vec<f64> = children.iter().filter_map(|c| c.exited_at).collect();
    assert!(
        after.iter().all(|&mb| mb < 100.0),
        "parent alone after the children left: {after:?}\n\
         (seconds from the last exit, MiB): {around:?}\nexits at {exits:?}; host: {:?}",
        doc.host
    );
}

#[test]
fn exit_status_is_the_jobs() {
    let out_dir = scratch();
    for (script, code) in [
        ("exit 7", 7),
        ("kill -KILL $$", 137),
        ("kill -TERM $$", 143),
        ("true", 0),
    ] {
        let out = run_to_end(
            memtrack()
                .args(["run", "--output"])
                .arg(out_dir.path())
                .args(["--", "sh", "-c", script]),
            Duration::from_secs(20),
        );
        assert_eq!(out.status.code(), Some(code), "{script}: {}", stderr(&out));
    }
    // Each run wrote a complete document recording the same status.
    let mut codes: Vec<i32> = std::fs::read_dir(out_dir.path())
        .unwrap()
        .map(|e| {
            read_document(&e.unwrap().path().join("memory_usage.json"))
                .run
                .exit
                .unwrap()
                .code
        })
        .collect();
    codes.sort();
    assert_eq!(codes, [0, 7, 137, 143]);
}

#[test]
fn sigterm_to_memtrack_reaches_the_job_and_the_json_is_complete() {
    let out_dir = scratch();
    let marker = out_dir.path().join("got-term");
    let started = out_dir.path().join("started");
    let script = format!(
        "trap 'echo term > {m}; exit 3' TERM; touch {s}; while :; do sleep 0.05; done",
        m = marker.display(),
        s = started.display()
    );
    let mut child = memtrack()
        .args(["run", "--interval", "100ms", "--output"])
        .arg(out_dir.path().join("runs"))
        .args(["--", "sh", "-c", &script])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the job to start", Duration::from_secs(10), || {
        started.exists()
    });
    signal(child.id(), "TERM");
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(3));
    assert_eq!(std::fs::read_to_string(&marker).unwrap().trim(), "term");
    let (dir, doc) = only_document(&out_dir.path().join("runs"));
    assert_eq!(doc.run.status, "finished");
    assert_eq!(doc.run.exit.unwrap().code, 3);
    assert!(
        !dir.join(".memtrack").exists(),
        "journal removed after a clean end"
    );
}

#[test]
fn sigint_and_sighup_sent_to_memtrack_reach_the_job_too() {
    for (sig, code) in [("INT", 4), ("HUP", 5)] {
        let out_dir = scratch();
        let started = out_dir.path().join("started");
        let script = format!(
            "trap 'exit {code}' {sig}; touch {s}; while :; do sleep 0.05; done",
            s = started.display()
        );
        let mut child = memtrack()
            .args(["run", "--listen", "off", "--interval", "100ms", "--output"])
            .arg(out_dir.path())
            .args(["--", "sh", "-c", &script])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_for("the job to start", Duration::from_secs(10), || {
            started.exists()
        });
        signal(child.id(), sig);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(code), "SIG{sig}");
        let (_, doc) = only_document(out_dir.path());
        assert_eq!(doc.run.status, "finished", "SIG{sig}");
        assert_eq!(doc.run.exit.unwrap().code, code, "SIG{sig}");
    }
}

/// A job that traps SIGTERM (as the ClearML SDK does) and will not end: a
/// second signal is forwarded too and, like `timeout -k`, the job gets
/// SIGKILL after the grace period. memtrack never exits leaving it
/// running unwatched; the run ends with the job, its document complete.
#[test]
fn a_second_signal_kills_the_job_after_the_grace_period() {
    let out_dir = scratch();
    let started = out_dir.path().join("started");
    let pid_file = out_dir.path().join("job.pid");
    let terms = out_dir.path().join("terms");
    // A job that notes and otherwise ignores the forwarded signals.
    let script = format!(
        "trap 'echo TERM >> {t}' TERM; trap 'echo INT >> {t}' INT; echo $$ > {p}; touch {s}; \
         while :; do sleep 0.05; done",
        t = terms.display(),
        p = pid_file.display(),
        s = started.display()
    );
    let mut child = memtrack()
        .args(["run", "--listen", "off", "--interval", "100ms", "--output"])
        .arg(out_dir.path())
        .args(["--", "sh", "-c", &script])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the job to start", Duration::from_secs(10), || {
        started.exists()
    });
    let job: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let got = |sig: &str| std::fs::read_to_string(&terms).is_ok_and(|t| t.contains(sig));
    let asked = Instant::now();
    signal(child.id(), "TERM");
    wait_for("the job to get SIGTERM", Duration::from_secs(10), || {
        got("TERM")
    });
    // A second signal counts only past the window in which it is the first
    // delivered twice: SIGINT is sent again and again until memtrack
    // forwards one (those inside the window are dropped), memtrack going
    // on all the while.
    let deadline = asked + Duration::from_secs(20);
    while !got("INT") {
        assert!(
            child.try_wait().unwrap().is_none(),
            "one signal only asks the job"
        );
        assert!(
            Instant::now() < deadline,
            "no second signal reached the job in 20 s"
        );
        signal(child.id(), "INT");
        std::thread::sleep(Duration::from_millis(100));
    }
    // memtrack got SIGTERM after `asked` and forwarded SIGINT before it
    // was seen here, so this holds however slow the machine: it fails
    // only when a SIGINT inside the window was forwarded.
    assert!(
        asked.elapsed() >= memtrack::shutdown::STOP_NOW_AFTER,
        "a signal within {:?} of the first was forwarded ({:?})",
        memtrack::shutdown::STOP_NOW_AFTER,
        asked.elapsed()
    );
    let status = child.wait().unwrap();
    let job_alive = vm_rss(job).is_some();
    if job_alive {
        // Left behind, it would hold memtrack's stderr open.
        signal(job, "KILL");
    }
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    assert!(!job_alive, "the job was not left running: {log}");
    assert_eq!(status.code(), Some(128 + 9), "{log}");
    assert!(log.contains("second signal"), "{log}");
    assert!(log.contains("sent SIGKILL"), "{log}");
    let (_, doc) = only_document(out_dir.path());
    let exit = doc.run.exit.expect("the run ended with the job");
    assert_eq!(exit.signal, Some(9), "{log}");
    assert!(!doc.detailed_log.is_empty());
}

/// The timestamps of the timer samples in a run's journal (empty while
/// there is none).
fn journalled_timers(run_dir: &Path) -> Vec<f64> {
    let journal =
        std::fs::read_to_string(run_dir.join(".memtrack/journal.jsonl")).unwrap_or_default();
    journal
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["record"]["record"] == "sample" && v["record"]["kind"] == "timer")
        .filter_map(|v| v["record"]["sample"]["timestamp"].as_f64())
        .collect()
}

#[test]
fn kill_9_of_memtrack_then_recover_keeps_every_journalled_sample() {
    let out_dir = scratch();
    let pid_file = out_dir.path().join("job.pid");
    let mut child = memtrack()
        .args([
            "run",
            "--interval",
            "50ms",
            "--checkpoint-interval",
            "2s",
            "--name",
            "crashed",
            "--output",
        ])
        .arg(out_dir.path())
        .args([
            "--",
            "sh",
            "-c",
            &format!("echo $$ > {}; exec sleep 60", pid_file.display()),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let run_dir = out_dir.path().join("crashed");
    // Past one checkpoint, with journalled records after it: killed once
    // the journal (flushed every second, emptied at each 2 s checkpoint)
    // holds five timer samples, however late a loaded machine gets there.
    wait_for("a checkpoint", Duration::from_secs(30), || {
        run_dir.join("memory_usage.json").exists()
    });
    wait_for("five journalled samples", Duration::from_secs(30), || {
        journalled_timers(&run_dir).len() >= 5
    });
    signal(child.id(), "KILL");
    child.wait().unwrap();
    let job: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    signal(job, "KILL");

    // What the journal and the checkpoint hold, read before recovery.
    let journalled = journalled_timers(&run_dir);
    assert!(
        journalled.len() >= 5,
        "records after the checkpoint: {}",
        journalled.len()
    );
    let checkpoint = read_document(&run_dir.join("memory_usage.json"));

    let out = run_to_end(
        memtrack().arg("recover").arg(&run_dir),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let doc = read_document(&run_dir.join("memory_usage.json"));
    assert_eq!(doc.run.status, "recovered");
    let timers: Vec<f64> = doc
        .detailed_log
        .iter()
        .filter(|e| e.kind == EntryKind::Timer)
        .map(|e| e.timestamp)
        .collect();
    for t in &journalled {
        assert!(
            timers.contains(t),
            "journalled sample at {t} is in the recovered log"
        );
    }
    let checkpointed = checkpoint
        .detailed_log
        .iter()
        .filter(|e| e.kind == EntryKind::Timer)
        .count();
    assert!(timers.len() >= checkpointed + journalled.len());
    assert!(!run_dir.join(".memtrack").exists());
    // The recovered run gets its report page, as a run's end writes it.
    let page = std::fs::read_to_string(run_dir.join("memory_report.html")).unwrap_or_default();
    assert!(
        page.contains("recovered") && page.contains("</html>"),
        "no page of the recovered run: {}",
        stderr(&out)
    );
    // Recovering twice is a clear error, not a second rewrite.
    let again = run_to_end(
        memtrack().arg("recover").arg(&run_dir),
        Duration::from_secs(20),
    );
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains("no run to recover"),
        "{}",
        stderr(&again)
    );
}

#[test]
fn the_next_start_recovers_a_killed_run() {
    let out_dir = scratch();
    let mut child = memtrack()
        .args(["run", "--interval", "50ms", "--name", "first", "--output"])
        .arg(out_dir.path())
        .args([
            "--",
            "sh",
            "-c",
            &format!(
                "echo $$ > {}/job.pid; exec sleep 60",
                out_dir.path().display()
            ),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let state = out_dir.path().join("first/.memtrack/state.json");
    wait_for("the run to start", Duration::from_secs(30), || {
        state.exists()
    });
    // Killed once something is journalled, rather than after a fixed time.
    let run_dir = out_dir.path().join("first");
    wait_for("a journalled sample", Duration::from_secs(30), || {
        !journalled_timers(&run_dir).is_empty()
    });
    signal(child.id(), "KILL");
    child.wait().unwrap();
    let job = std::fs::read_to_string(out_dir.path().join("job.pid")).unwrap();
    signal(job.trim().parse().unwrap(), "KILL");
    let out = run_to_end(
        memtrack()
            .args(["run", "--name", "second", "--output"])
            .arg(out_dir.path())
            .args(["--", "true"]),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(0));
    assert!(
        stderr(&out).contains("recovered the run"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        read_document(&out_dir.path().join("first/memory_usage.json"))
            .run
            .status,
        "recovered"
    );
}

#[test]
fn without_a_gpu_the_run_is_host_only_with_one_notice() {
    for extra in [vec!["--nvml-lib", "/nonexistent/libnvidia-ml.so.1"], vec![]] {
        let out_dir = scratch();
        let mut cmd = memtrack();
        cmd.args(["run", "--interval", "100ms", "--output"])
            .arg(out_dir.path())
            .args(&extra);
        if extra.is_empty() {
            // Deterministic on any machine, GPU or not.
            cmd.env("CUDA_VISIBLE_DEVICES", "");
        }
        let out = run_to_end(cmd.args(["--", "sleep", "0.5"]), Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(0));
        let err = stderr(&out);
        assert_eq!(err.matches("host-only mode").count(), 1, "{err}");
        let (_, doc) = only_document(out_dir.path());
        assert!(
            doc.run.gpu_backend.to_string().starts_with("none: "),
            "{}",
            doc.run.gpu_backend
        );
        for e in &doc.detailed_log {
            assert_eq!(e.gpu_source, GpuSource::None);
            assert_eq!(
                (
                    e.figures.gpu_ram_used_mb,
                    e.figures.gpu_ram_peak_mb,
                    e.figures.reserved_gpu_ram_mb
                ),
                (0.0, 0.0, 0.0)
            );
        }
        assert!(doc.gpus.is_empty());
    }
}

#[test]
fn gpu_memory_of_the_tree_through_nvml() {
    let lib = fake_nvml();
    let out_dir = scratch();
    let state = out_dir.path().join("nvml-state");
    std::fs::write(&state, "device 0 name=NVIDIA_Fake_H100 total_mib=81559\n").unwrap();
    // The job publishes its own PID to the fake driver, as a CUDA process
    // would appear in NVML, then a PID that is not ours, then a GPU loss.
    let script = format!(
        r#"
import os, time
def put(text):
    tmp = {state:?} + '.tmp'
    open(tmp, 'w').write(text)
    os.replace(tmp, {state:?})
import json, socket
s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET']); f = s.makefile('rwb')
def seen(pred):
    # Each state is held until memtrack's status shows it was sampled.
    deadline = time.time() + 30
    while time.time() < deadline:
        f.write(b'{{"type":"status","id":1}}\n'); f.flush()
        if pred(json.loads(f.readline())): return
        time.sleep(0.05)
dev = 'device 0 name=NVIDIA_Fake_H100 total_mib=81559\n'
put(dev + 'process 0 %d 1500\nprocess 0 1 9999\nprocess 0 %d 1500 graphics\n' % (os.getpid(), os.getpid()))
seen(lambda st: st['peak_usage']['gpu_process_used_mb'] >= 1500)
put(dev + 'process 0 %d 2048\n' % os.getpid())
seen(lambda st: st['peak_usage']['gpu_process_used_mb'] >= 2048)
put(dev + 'process 0 %d 512\nfail nvmlDeviceGetComputeRunningProcesses_v3 GPU_IS_LOST\n' % os.getpid())
seen(lambda st: st['counters']['nvml_errors'] > 0)
time.sleep(0.3)
"#,
        state = state.display().to_string()
    );
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "100ms", "--output"])
            .arg(out_dir.path().join("runs"))
            .arg("--nvml-lib")
            .arg(lib)
            .env("FAKE_NVML_STATE", &state)
            .arg("--")
            .args(python(&script)),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(&out_dir.path().join("runs"));
    assert_eq!(doc.run.gpu_backend, "nvml");
    assert_eq!(
        doc.peak_usage.figures.gpu_process_used_mb, 2048.0,
        "ours only, compute+graphics once"
    );
    assert_eq!(doc.peak_usage.figures.gpu_ram_peak_mb, 2048.0);
    assert_eq!(doc.gpus.len(), 1);
    assert_eq!(doc.gpus[0].name, "NVIDIA Fake H100");
    assert_eq!(doc.gpus[0].peak_tree_used_mb, 2048.0);
    assert!(
        doc.gpus[0].peak_used_mb >= 9999.0,
        "device-wide figure counts every process"
    );
    assert!(doc
        .detailed_log
        .iter()
        .any(|e| e.gpu_source == GpuSource::Nvml));
    assert!(doc.counters.nvml_errors > 0, "the GPU loss was counted");
    assert!(
        doc.detailed_log
            .iter()
            .any(|e| e.kind == EntryKind::Timer && e.gpu_source == GpuSource::None),
        "samples after the loss are host-only"
    );
    assert_eq!(doc.summary.min_gpu_mb, (2048.0f64 * 1.1).ceil());
    assert_eq!(doc.targets[0].peak_gpu_mb_by_device[&0], 2048.0);
    // On the host NVML's PIDs are the tree's: per-process, said nowhere.
    let a = doc.gpu_attribution.as_ref().unwrap();
    assert_eq!(a.mode, memtrack::model::AttributionMode::PerProcess);
    assert_eq!(a.pid_namespace.init, Some(true), "{a:?}");
    assert!(a.device_level_samples == 0 && a.per_process_samples > 0);
    assert!(!stderr(&out).contains("PID namespace"), "{}", stderr(&out));
}

#[test]
fn a_mark_reads_gpu_memory_now_and_repeats_the_slow_figures_of_the_last_tick() {
    let lib = fake_nvml();
    let out_dir = scratch();
    let state = out_dir.path().join("nvml-state");
    let calls = out_dir.path().join("nvml-calls");
    std::fs::write(&state, "device 0 temp=41 util_gpu=37\n").unwrap();
    // Between the start and the end there is no tick (10 s interval): 40
    // acknowledged marks, each after the job's GPU memory changed.
    let script = format!(
        r#"
import json, os, socket
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["MEMTRACK_SOCKET"])
f = s.makefile("rw")
for i in range(40):
    tmp = {state:?} + ".tmp"
    open(tmp, "w").write("device 0 temp=41 util_gpu=37\nprocess 0 %d %d\n" % (os.getpid(), 100 + i))
    os.replace(tmp, {state:?})
    f.write(json.dumps({{"component": "step", "operation": "s%d" % i, "ack": True}}) + "\n")
    f.flush()
    assert json.loads(f.readline())["ok"]
"#,
        state = state.display().to_string()
    );
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "10s", "--output"])
            .arg(out_dir.path().join("runs"))
            .arg("--nvml-lib")
            .arg(lib)
            .env("FAKE_NVML_STATE", &state)
            .env("FAKE_NVML_CALLS", &calls)
            .arg("--")
            .args(python(&script)),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(&out_dir.path().join("runs"));
    // Each mark's GPU figure is the one NVML gave at that mark.
    for i in 0..40 {
        let e = doc
            .detailed_log
            .iter()
            .find(|e| e.component == "step" && e.operation == format!("s{i}"))
            .unwrap();
        assert_eq!(e.figures.gpu_process_used_mb, 100.0 + i as f64, "mark s{i}");
    }
    let log = std::fs::read_to_string(&calls).unwrap();
    let count = |name: &str| log.lines().filter(|l| *l == name).count();
    let lists = count("nvmlDeviceGetComputeRunningProcesses_v3");
    let slow = count("nvmlDeviceGetUtilizationRates") + count("nvmlDeviceGetTemperature");
    assert!(lists >= 40, "every mark reads the process list: {lists}");
    // The first read and the last tick read the slow figures; the flight
    // recorder and the marks repeat them.
    assert!(
        slow <= 2 * 3,
        "utilization and temperature read {slow} times"
    );
    assert_eq!(doc.gpus[0].name, "NVIDIA Fake GPU");
}

#[test]
fn a_job_that_execs_is_described_as_what_it_became() {
    let out_dir = scratch();
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "100ms", "--output"])
            .arg(out_dir.path())
            .args([
                "--",
                "sh",
                "-c",
                "sleep 0.3; exec python3 -c 'import time; time.sleep(2.5)'",
            ]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    let root = doc.targets.iter().find(|t| t.root).unwrap();
    assert!(
        root.cmdline.iter().any(|a| a.contains("python3")),
        "{:?}",
        root.cmdline
    );
    assert!(
        root.cmdline.iter().any(|a| a.contains("time.sleep(2.5)")),
        "{:?}",
        root.cmdline
    );
}
