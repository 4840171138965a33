//! GPU figures across PID namespaces. NVML (here the fake library) lists
//! processes by their host PID, as the real driver does inside a
//! container. memtrack runs in a real PID namespace (`unshare --pid
//! --fork`, which needs root): its own procfs on /proc, and the host's
//! procfs bound at `host-proc/` before it was covered, so the job can
//! learn its host PID and, when the run is told so, memtrack can map
//! NVML's PIDs through it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use memtrack::model::{AttributionMode, Document, GpuSource};

use crate::common::*;

/// What the job uses on the GPU, MiB.
const JOB_MIB: u64 = 1500;
/// What a process outside the namespace uses on the same GPU, MiB.
const FOREIGN_MIB: u64 = 4000;

/// `memtrack ARGS` in a new PID and mount namespace, with the host's
/// procfs bound at `host_proc` and a procfs of the new namespace on /proc.
fn memtrack_in_a_pid_namespace(host_proc: &Path) -> Command {
    std::fs::create_dir_all(host_proc).unwrap();
    let mut cmd = Command::new("unshare");
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") || k == "RUST_LOG" || k == "CUDA_VISIBLE_DEVICES" {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(Stdio::null())
        .args(["--pid", "--fork", "--mount", "--", "sh", "-c"])
        .arg(r#"mount --bind /proc "$0" && mount -t proc proc /proc && exec "$@""#)
        .arg(host_proc)
        .arg(env!("CARGO_BIN_EXE_memtrack"));
    cmd
}

/// A job that finds its host PID through `host_proc`, has the fake NVML
/// list it (and, with `foreign`, the test process, which is outside the
/// job's namespace) and waits until memtrack's status (`now`, its
/// `current` figures) satisfies the Python condition `want`, or 20 s pass.
fn job(state: &Path, host_proc: &str, foreign: bool, want: &str) -> String {
    let device = if foreign {
        "device 0 name=NVIDIA_Fake_H100 total_mib=81559".to_string()
    } else {
        // The whole device is the job's: its used memory is the job's use.
        format!("device 0 name=NVIDIA_Fake_H100 total_mib=81559 used_mib={JOB_MIB}")
    };
    let stranger = if foreign {
        format!("process 0 {} {FOREIGN_MIB}\n", std::process::id())
    } else {
        String::new()
    };
    format!(
        r#"
import json, os, socket, time
def host_pid():
    for line in open({host_proc:?} + '/self/status'):
        if line.startswith('NSpid:'):
            return int(line.split()[1])
tmp = {state:?} + '.tmp'
open(tmp, 'w').write({device:?} + '\nprocess 0 %d {JOB_MIB}\n' % host_pid() + {stranger:?})
os.replace(tmp, {state:?})
s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET']); f = s.makefile('rwb')
deadline = time.time() + 20
while time.time() < deadline:
    f.write(b'{{"type": "status"}}\n'); f.flush()
    now = json.loads(f.readline()).get('current', {{}})
    if now and {want}:
        break
    time.sleep(0.1)
"#,
        state = state.display().to_string(),
    )
}

/// Runs `cmd` (memtrack, then `run ARGS -- JOB`) with the fake NVML on
/// `state`; returns its stderr and the run's document.
fn gpu_run(mut cmd: Command, dir: &Path, state: &Path, job: &[String]) -> (String, Document) {
    std::fs::write(state, "device 0 name=NVIDIA_Fake_H100 total_mib=81559\n").unwrap();
    let runs = dir.join("runs");
    let out = run_to_end(
        cmd.args(["run", "--interval", "100ms", "--output"])
            .arg(&runs)
            // Its own socket: the default is named by memtrack's PID,
            // which is 1 in every new namespace.
            .arg("--socket")
            .arg(dir.join("memtrack.sock"))
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .env("FAKE_NVML_STATE", state)
            .arg("--")
            .args(job),
        Duration::from_secs(60),
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    (err, only_document(&runs).1)
}

fn attribution(doc: &Document) -> &memtrack::model::GpuAttribution {
    doc.gpu_attribution
        .as_ref()
        .expect("a run with NVML has a gpu_attribution block")
}

fn report(doc: &Path) -> String {
    let out = memtrack().arg("report").arg(doc).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn document_path(dir: &Path) -> PathBuf {
    only_document(&dir.join("runs")).0.join("memory_usage.json")
}

#[test]
fn inside_a_pid_namespace_without_the_hosts_procfs_the_figures_are_device_level() {
    let dir = scratch();
    let host_proc = dir.path().join("host-proc");
    let state = dir.path().join("nvml-state");
    let want = format!("now['gpu_source'] == 'device' and now['gpu_tree_mb'] == {JOB_MIB}");
    let script = job(&state, host_proc.to_str().unwrap(), false, &want);
    let (err, doc) = gpu_run(
        memtrack_in_a_pid_namespace(&host_proc),
        dir.path(),
        &state,
        &python(&script),
    );
    let a = attribution(&doc);
    assert_eq!(a.mode, AttributionMode::DeviceLevel, "{a:?}");
    assert_eq!(a.pid_namespace.init, Some(false), "{a:?}");
    assert!(
        a.device_level_samples > 0 && a.per_process_samples == 0,
        "{a:?}"
    );
    assert!(a.reason.contains("PID namespace"), "{}", a.reason);
    let said: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("PID namespace"))
        .collect();
    assert_eq!(said.len(), 1, "said once: {err}");
    assert!(
        said[0].contains("device-level, every process on the job's GPUs included"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "peak GPU {JOB_MIB}.0 MiB (device-level: every process on the job's GPUs)"
        )),
        "{err}"
    );
    // The job's use, from the device: labelled, never per-process.
    assert_eq!(doc.peak_usage.figures.gpu_process_used_mb, JOB_MIB as f64);
    assert_eq!(doc.gpus[0].peak_tree_used_mb, JOB_MIB as f64);
    assert_eq!(doc.summary.peak_gpu_mb_by_device[&0], JOB_MIB as f64);
    assert!(doc
        .detailed_log
        .iter()
        .any(|e| e.gpu_source == GpuSource::Device
            && e.figures.gpu_process_used_mb == JOB_MIB as f64));
    assert!(
        doc.detailed_log
            .iter()
            .all(|e| e.gpu_source != GpuSource::Nvml),
        "no per-process entry"
    );
    assert!(
        doc.targets.iter().all(|t| t.peak_gpu_mb == 0.0),
        "no process is given a share it cannot be known to hold"
    );
    let text = report(&document_path(dir.path()));
    assert!(
        text.contains("GPU attribution: device-level (includes every process on the device"),
        "{text}"
    );
    assert!(
        text.contains("fits (GPU 0: 1500.0 MiB); device-level: every process on the job's GPUs"),
        "{text}"
    );
}

#[test]
fn a_device_level_figure_of_a_shared_gpu_includes_the_stranger_and_says_so() {
    let dir = scratch();
    let host_proc = dir.path().join("host-proc");
    let state = dir.path().join("nvml-state");
    let both = JOB_MIB + FOREIGN_MIB;
    let want = format!("now['gpu_source'] == 'device' and now['gpu_tree_mb'] >= {both}");
    let script = job(&state, host_proc.to_str().unwrap(), true, &want);
    let (err, doc) = gpu_run(
        memtrack_in_a_pid_namespace(&host_proc),
        dir.path(),
        &state,
        &python(&script),
    );
    assert_eq!(attribution(&doc).mode, AttributionMode::DeviceLevel);
    // The whole device, the stranger included: never the job's alone
    // without the label.
    let g = &doc.gpus[0];
    assert!(g.peak_tree_used_mb >= both as f64, "{g:?}");
    assert_eq!(g.peak_tree_used_mb, g.peak_used_mb, "{g:?}");
    assert_eq!(doc.peak_usage.figures.gpu_process_used_mb, g.peak_used_mb);
    assert!(
        err.contains("(device-level: every process on the job's GPUs)"),
        "{err}"
    );
    let text = report(&document_path(dir.path()));
    assert!(
        text.contains("\"this run\" is device-level: it includes every process on the device"),
        "{text}"
    );
}

#[test]
fn inside_a_pid_namespace_the_hosts_procfs_maps_nvml_pids_to_the_job() {
    let dir = scratch();
    let host_proc = dir.path().join("host-proc");
    let state = dir.path().join("nvml-state");
    let want = format!("now['gpu_source'] == 'nvml' and now['gpu_tree_mb'] == {JOB_MIB}");
    let script = job(&state, host_proc.to_str().unwrap(), true, &want);
    let mut cmd = memtrack_in_a_pid_namespace(&host_proc);
    cmd.env("MEMTRACK_GPU_HOST_PROC", &host_proc);
    let (err, doc) = gpu_run(cmd, dir.path(), &state, &python(&script));
    let a = attribution(&doc);
    assert_eq!(a.mode, AttributionMode::PerProcess, "{a:?}\n{err}");
    assert_eq!(a.pid_namespace.init, Some(false), "{a:?}");
    assert_eq!(a.host_proc.as_deref(), host_proc.to_str());
    assert!(
        a.per_process_samples > 0 && a.device_level_samples == 0,
        "{a:?}"
    );
    assert!(!err.contains("device-level"), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.contains("PID namespace")).count(),
        1,
        "said once: {err}"
    );
    // The job's own figure; the process outside the namespace is not the job's.
    assert_eq!(doc.peak_usage.figures.gpu_process_used_mb, JOB_MIB as f64);
    assert_eq!(doc.gpus[0].peak_tree_used_mb, JOB_MIB as f64);
    assert!(doc.gpus[0].peak_used_mb >= (JOB_MIB + FOREIGN_MIB) as f64);
    let root = doc.targets.iter().find(|t| t.root).unwrap();
    assert_eq!(root.peak_gpu_mb, JOB_MIB as f64, "by the job's own PID");
    let text = report(&document_path(dir.path()));
    assert!(text.contains("GPU attribution: per-process"), "{text}");
}

#[test]
fn a_job_in_a_child_pid_namespace_is_matched_by_its_host_pid() {
    // memtrack on the host follows the job's host PIDs directly; the job
    // sees the host's procfs (no --mount-proc) to learn its host PID.
    let dir = scratch();
    let state = dir.path().join("nvml-state");
    let want = format!("now['gpu_source'] == 'nvml' and now['gpu_tree_mb'] == {JOB_MIB}");
    let script = job(&state, "/proc", true, &want);
    let mut job_argv: Vec<String> = ["unshare", "--pid", "--fork", "--"]
        .map(String::from)
        .to_vec();
    job_argv.extend(python(&script));
    let (err, doc) = gpu_run(memtrack(), dir.path(), &state, &job_argv);
    let a = attribution(&doc);
    assert_eq!(a.mode, AttributionMode::PerProcess, "{a:?}");
    assert_eq!(a.pid_namespace.init, Some(true), "{a:?}");
    assert!(!err.contains("device-level"), "{err}");
    assert_eq!(doc.peak_usage.figures.gpu_process_used_mb, JOB_MIB as f64);
    assert_eq!(doc.gpus[0].peak_tree_used_mb, JOB_MIB as f64);
    let text = report(&document_path(dir.path()));
    assert!(!text.contains("GPU attribution"), "nothing to say: {text}");
}

#[test]
fn two_memtracks_each_pid_1_of_its_namespace_get_a_default_socket_each() {
    if !can_run(
        "root",
        is_root(),
        "PID namespaces (unshare --pid) need root",
    ) {
        return;
    }
    let dir = scratch();
    // One socket folder for both, as /tmp is shared by containers on a node.
    let sockets = dir.path().join("xdg");
    std::fs::create_dir(&sockets).unwrap();
    let release = dir.path().join("release");
    let start = |n: u32| {
        let told = dir.path().join(format!("socket{n}"));
        let script = format!(
            "import os, time\nopen({told:?} + '.tmp', 'w').write(os.environ['MEMTRACK_SOCKET'])\n\
             os.replace({told:?} + '.tmp', {told:?})\n\
             while not os.path.exists({release:?}): time.sleep(0.05)\n",
            told = told.display().to_string(),
            release = release.display().to_string(),
        );
        let child = memtrack_in_a_pid_namespace(&dir.path().join(format!("host-proc{n}")))
            .env("XDG_RUNTIME_DIR", &sockets)
            .args(["run", "--no-gpu", "--listen", "off", "--output"])
            .arg(dir.path().join(format!("runs{n}")))
            .arg("--")
            .args(python(&script))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        (child, told)
    };
    let (mut a, told_a) = start(1);
    wait_for("the first job to start", Duration::from_secs(30), || {
        told_a.exists()
    });
    let (mut b, told_b) = start(2);
    wait_for("the second job to start", Duration::from_secs(30), || {
        told_b.exists() || b.try_wait().unwrap().is_some()
    });
    std::fs::write(&release, "").unwrap();
    let (a_status, b_status) = (a.wait().unwrap(), b.wait().unwrap());
    let mut b_err = String::new();
    std::io::Read::read_to_string(b.stderr.as_mut().unwrap(), &mut b_err).unwrap();
    assert!(a_status.success() && b_status.success(), "{b_err}");
    let (sa, sb) = (
        std::fs::read_to_string(&told_a).unwrap(),
        std::fs::read_to_string(&told_b).unwrap(),
    );
    assert!(sa.ends_with("/memtrack-1.sock"), "{sa}");
    assert!(sb.ends_with("/memtrack-1-2.sock"), "{sb}");
}
