//! A hostile neighbour, fourth round: a runs folder another user made
//! first, a Python hooks folder swapped in a shared `TMPDIR`, a
//! `gpu.host_proc` full of FIFOs and `/dev/zero`, cgroups nested past any
//! fixed depth or left by a killed PID 1, a socket served by another user,
//! a planted output link, and a job's escapes in `/metrics`, `/memory-info`
//! and the SVG. Each test provokes the fault for real against the memtrack
//! binary; those that need root (a second uid, a PID namespace, cgroups)
//! fail without it unless `MEMTRACK_ALLOW_SKIP` names the reason.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// The uid the attacker's commands run as.
const NOBODY: u32 = 65534;

fn need_root(what: &str) -> bool {
    can_run("root", is_root(), &format!("{what} needs root"))
}

fn sh(script: &str) {
    let out = Command::new("sh")
        .args(["-c", script])
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `sh -c SCRIPT` as `uid` (its own gid, no supplementary groups), with
/// the system's tools only.
fn as_user(uid: u32, script: &str) -> std::process::Output {
    Command::new("setpriv")
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "sh",
            "-c",
            script,
        ])
        .output()
        .expect("setpriv")
}

fn as_nobody(script: &str) {
    let out = as_user(NOBODY, script);
    assert!(
        out.status.success(),
        "{script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// memtrack as `uid`, with a clean environment: no `XDG_RUNTIME_DIR`, no
/// `TMPDIR`, `HOME` at `home`.
fn memtrack_as(uid: u32, home: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={uid}"),
        &format!("--regid={uid}"),
        "--clear-groups",
        env!("CARGO_BIN_EXE_memtrack"),
    ])
    .env_clear()
    .env("PATH", "/usr/local/bin:/usr/bin:/bin")
    .env("HOME", home)
    .stdin(Stdio::null());
    cmd
}

/// A child killed if the test fails before it ends.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A folder removed (as root) when the test ends, however it ends.
struct Remove(PathBuf);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A uid nobody on this machine has, and its `/tmp/memtrack-<uid>`.
fn victim_uid() -> u32 {
    40_000 + std::process::id() % 20_000
}

/// What once broke: another user made `/tmp/memtrack-<uid>` (0777) before
/// the victim's first run and planted records: `memtrack ls` deleted the
/// victim's file named as a dead run's discovery file and listed a spoofed
/// run, and `memtrack run` refused to start ("not a private directory").
#[test]
fn a_runs_folder_another_user_made_is_neither_read_nor_written() {
    if !need_root("a second and a third uid") {
        return;
    }
    let victim = victim_uid();
    let planted = PathBuf::from(format!("/tmp/memtrack-{victim}"));
    let _ = std::fs::remove_dir_all(&planted);
    let _cleanup = Remove(planted.clone());
    let top = scratch();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let home = top.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let important = home.join("important.txt");
    std::fs::write(&important, "the victim's\n").unwrap();
    sh(&format!("chown -R {victim}:{victim} {}", home.display()));
    // The attacker makes the folder and plants two records: a dead run
    // whose discovery file is the victim's file, and a live-looking one.
    let dead = serde_json::json!({
        "name": "gone", "pid": 2_147_483_000u32, "socket": null, "metrics": null,
        "dir": "/x", "start": 1.0, "sd_file": important,
    });
    let spoof = serde_json::json!({
        "name": "spoof", "pid": 1, "socket": "/tmp/attacker.sock", "metrics": null,
        "dir": "/x", "start": 1.0,
    });
    as_nobody(&format!(
        "umask 0 && mkdir -m 0777 {p} {p}/runs && printf '%s' '{dead}' > {p}/runs/memtrack-2147483000.json \
         && printf '%s' '{spoof}' > {p}/runs/memtrack-1.json",
        p = planted.display(),
    ));

    let ls = run_to_end(
        memtrack_as(victim, &home).arg("ls"),
        Duration::from_secs(30),
    );
    let listed = String::from_utf8_lossy(&ls.stdout).into_owned();
    assert_eq!(ls.status.code(), Some(0), "{}", stderr(&ls));
    assert!(
        important.exists(),
        "the victim's file is not deleted on the word of a planted record"
    );
    assert!(!listed.contains("spoof"), "no spoofed run listed: {listed}");
    assert!(
        stderr(&ls).contains("not read"),
        "ls says why: {}",
        stderr(&ls)
    );
    let status = run_to_end(
        memtrack_as(victim, &home).args(["status", "--run", "spoof"]),
        Duration::from_secs(30),
    );
    assert_eq!(status.status.code(), Some(1), "{}", stderr(&status));
    assert!(
        stderr(&status).contains("no live run named `spoof`"),
        "{}",
        stderr(&status)
    );

    // The victim's run starts all the same, in a private place, and writes
    // nothing into the attacker's folder.
    let out = home.join("out");
    let run = run_to_end(
        memtrack_as(victim, &home)
            .args(["run", "--listen", "off", "--name", "r", "--output"])
            .arg(&out)
            .args(["--", "true"]),
        Duration::from_secs(60),
    );
    let log = stderr(&run);
    assert_eq!(run.status.code(), Some(0), "{log}");
    assert!(out.join("r/memory_usage.json").is_file(), "{log}");
    assert!(log.contains(&planted.display().to_string()), "{log}");
    let mut left: Vec<String> = std::fs::read_dir(planted.join("runs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["memtrack-1.json", "memtrack-2147483000.json"],
        "{log}"
    );
    // The fresh private folder it used instead is gone with the run.
    let fresh: Vec<String> = std::fs::read_dir("/tmp")
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("memtrack-{victim}-")))
        .collect();
    for name in &fresh {
        let _ = std::fs::remove_dir_all(Path::new("/tmp").join(name));
    }
    assert!(fresh.is_empty(), "left behind: {fresh:?}\n{log}");
}

/// The same for root, whose `XDG_RUNTIME_DIR` another user may write to:
/// once, a planted record had root's `memtrack ls` delete a root-only file.
#[test]
fn roots_runtime_dir_writable_by_others_is_not_trusted() {
    if !need_root("a second uid") {
        return;
    }
    let top = scratch();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = top.path().join("root-only");
    std::fs::write(&secret, "root's\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let xdg = top.path().join("xdg");
    std::fs::create_dir(&xdg).unwrap();
    std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o777)).unwrap();
    let record = serde_json::json!({
        "name": "gone", "pid": 2_147_483_001u32, "socket": null, "metrics": null,
        "dir": "/x", "start": 1.0, "sd_file": secret,
    });
    as_nobody(&format!(
        "umask 0 && mkdir -p {x}/memtrack/runs && printf '%s' '{record}' > {x}/memtrack/runs/memtrack-2147483001.json",
        x = xdg.display()
    ));
    let ls = run_to_end(
        memtrack().arg("ls").env("XDG_RUNTIME_DIR", &xdg),
        Duration::from_secs(30),
    );
    assert_eq!(ls.status.code(), Some(0), "{}", stderr(&ls));
    assert!(secret.exists(), "root's file is kept: {}", stderr(&ls));
    // A run does not put its socket there either.
    let out = top.path().join("out");
    let run = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--name", "r", "--output"])
            .arg(&out)
            .args(["--", "sh", "-c", "echo \"$MEMTRACK_SOCKET\" > \"$0\""])
            .arg(top.path().join("socket"))
            .env("XDG_RUNTIME_DIR", &xdg),
        Duration::from_secs(60),
    );
    assert_eq!(run.status.code(), Some(0), "{}", stderr(&run));
    let socket = std::fs::read_to_string(top.path().join("socket")).unwrap();
    assert!(
        !socket.trim().is_empty() && !Path::new(socket.trim()).starts_with(&xdg),
        "{socket}"
    );
    assert!(
        stderr(&run).contains("XDG_RUNTIME_DIR is not used"),
        "{}",
        stderr(&run)
    );
}

/// A job that writes the first folder of its `PYTHONPATH` (the hooks) and
/// its PID to `info`, waits for `go`, then starts a new Python, which
/// imports `sitecustomize` from that folder.
fn hooks_job(info: &Path, go: &Path) -> Vec<String> {
    python(&format!(
        r#"
import os, subprocess, sys, time
first = os.environ.get("PYTHONPATH", "").split(":")[0]
tmp = {info:?} + ".tmp"
open(tmp, "w").write(first + "\n" + str(os.getpid()) + "\n")
os.replace(tmp, {info:?})
while not os.path.exists({go:?}):
    time.sleep(0.05)
subprocess.run([sys.executable, "-c", "pass"], check=True)
"#,
        info = info.display().to_string(),
        go = go.display().to_string(),
    ))
}

fn read_info(info: &Path) -> (PathBuf, u32) {
    let text = std::fs::read_to_string(info).unwrap();
    let mut lines = text.lines();
    let dir = PathBuf::from(lines.next().unwrap());
    let pid = lines.next().unwrap().parse().unwrap();
    (dir, pid)
}

/// What once broke: in a `TMPDIR` every user may write to without the
/// sticky bit, another user renamed `memtrack-python-*` and put their own
/// `sitecustomize.py` in its place; it ran inside the root job.
#[test]
fn the_hooks_folder_cannot_be_swapped_from_a_shared_tmpdir() {
    if !need_root("a second uid") {
        return;
    }
    let top = scratch();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let tmp = top.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o777)).unwrap();
    let info = top.path().join("info");
    let go = top.path().join("go");
    let marker = tmp.join("planted-code-ran");
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--socket", "off", "--name", "h"])
        .arg("--output")
        .arg(top.path().join("out"))
        .arg("--")
        .args(hooks_job(&info, &go))
        .env("TMPDIR", &tmp)
        .env_remove("XDG_RUNTIME_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut run = Reap(cmd.spawn().expect("spawn memtrack"));
    wait_for("the job's PYTHONPATH", Duration::from_secs(30), || {
        info.exists()
    });
    let (hooks, _) = read_info(&info);
    assert!(
        hooks
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("memtrack-python-"),
        "{}",
        hooks.display()
    );
    // The attacker tries the swap; it may fail (that is the point).
    let swap = as_user(
        NOBODY,
        &format!(
            "mv {d} {d}.moved && mkdir {d} && echo \"open('{m}', 'w')\" > {d}/sitecustomize.py",
            d = hooks.display(),
            m = marker.display()
        ),
    );
    std::fs::write(&go, "").unwrap();
    let code = {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = run.0.try_wait().unwrap() {
                break s.code();
            }
            assert!(Instant::now() < deadline, "memtrack did not finish");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut log = String::new();
    let _ = std::io::Read::read_to_string(run.0.stderr.as_mut().unwrap(), &mut log);
    assert!(
        !marker.exists(),
        "the other user's sitecustomize ran in the job (swap: {})\n{log}",
        String::from_utf8_lossy(&swap.stderr)
    );
    assert!(!swap.status.success(), "the swap was refused");
    assert!(!hooks.starts_with(&tmp), "{}", hooks.display());
    assert_eq!(code, Some(0), "{log}");
    assert!(!hooks.exists(), "removed at the end");
}

/// What once broke: 38 `memtrack-python-*` folders of killed runs, never
/// removed, `recover` included.
#[test]
fn hooks_folders_of_killed_runs_are_removed_by_recover() {
    let top = scratch();
    let tmp = top.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    // An earlier version's folder, left in the temporary directory.
    let legacy = tmp.join("memtrack-python-0123456789abcdef");
    std::fs::create_dir(&legacy).unwrap();
    std::fs::write(legacy.join("sitecustomize.py"), "").unwrap();
    let info = top.path().join("info");
    let go = top.path().join("never");
    let out = top.path().join("out");
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--socket", "off", "--name", "k"])
        .arg("--output")
        .arg(&out)
        .arg("--")
        .args(hooks_job(&info, &go))
        .env("TMPDIR", &tmp)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut run = Reap(cmd.spawn().expect("spawn memtrack"));
    wait_for("the job's PYTHONPATH", Duration::from_secs(30), || {
        info.exists()
    });
    let (hooks, job) = read_info(&info);
    assert!(hooks.join("sitecustomize.py").is_file());
    signal(run.0.id(), "KILL");
    let _ = run.0.wait();
    signal(job, "KILL");
    assert!(hooks.exists(), "a killed run leaves its hooks folder");
    let rec = run_to_end(
        memtrack()
            .arg("recover")
            .arg(out.join("k"))
            .env("TMPDIR", &tmp),
        Duration::from_secs(60),
    );
    assert_eq!(rec.status.code(), Some(0), "{}", stderr(&rec));
    assert!(!hooks.exists(), "{}", stderr(&rec));
    assert!(!legacy.exists(), "{}", stderr(&rec));
    assert!(
        stderr(&rec).contains("Python hooks folder"),
        "{}",
        stderr(&rec)
    );
}

/// `memtrack ARGS` as PID 1 of a new PID namespace (`unshare`, killed with
/// it), its own procfs on /proc.
fn memtrack_as_pid1() -> Command {
    let mut cmd = Command::new("unshare");
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") || k == "RUST_LOG" || k == "CUDA_VISIBLE_DEVICES" {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(Stdio::null())
        .args([
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
        ])
        .arg(r#"mount -t proc proc /proc && exec "$@""#)
        .arg("sh")
        .arg(env!("CARGO_BIN_EXE_memtrack"));
    cmd
}

/// A fake procfs of the host for `gpu.host_proc`: `self/status` says
/// memtrack is PID 100 there (one namespace up), and process 4242 has a
/// real `stat` but the given `status`.
fn fake_host_proc(root: &Path, self_status: Option<&str>, status_4242: Option<&Path>) {
    std::fs::create_dir_all(root.join("self")).unwrap();
    std::fs::create_dir_all(root.join("4242")).unwrap();
    match self_status {
        Some(text) => std::fs::write(root.join("self/status"), text).unwrap(),
        None => sh(&format!("mkfifo {}", root.join("self/status").display())),
    }
    let mut stat = String::from("4242 (python3) S 1 4242 4242 0 -1 4194304");
    for i in 10..=52 {
        stat.push_str(if i == 22 { " 12345" } else { " 0" });
    }
    std::fs::write(root.join("4242/stat"), stat + "\n").unwrap();
    if let Some(target) = status_4242 {
        std::os::unix::fs::symlink(target, root.join("4242/status")).unwrap();
    }
}

/// A job that waits until memtrack has sampled (its `status` has current
/// figures) a few times, then exits.
const SAMPLED_JOB: &str = r#"
import json, os, socket, time
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["MEMTRACK_SOCKET"]); f = s.makefile("rwb")
seen = set()
deadline = time.time() + 30
while len(seen) < 3 and time.time() < deadline:
    f.write(b'{"type": "status"}\n'); f.flush()
    now = json.loads(f.readline()).get("current") or {}
    if now:
        seen.add(json.dumps(now, sort_keys=True))
    time.sleep(0.05)
"#;

/// What once broke: a FIFO at `gpu.host_proc`'s `self/status` hung
/// memtrack (PID 1 of a namespace, deaf to SIGTERM) for over 10 minutes
/// before the job started.
#[test]
fn a_fifo_in_host_proc_does_not_hang_the_start() {
    if !need_root("a PID namespace") {
        return;
    }
    let dir = scratch();
    let host_proc = dir.path().join("host-proc");
    fake_host_proc(&host_proc, None, None);
    let state = dir.path().join("nvml-state");
    std::fs::write(
        &state,
        "device 0 name=NVIDIA_Fake_H100 total_mib=81559\nprocess 0 4242 1000\n",
    )
    .unwrap();
    let runs = dir.path().join("runs");
    let out = run_to_end(
        memtrack_as_pid1()
            .args(["run", "--listen", "off", "--interval", "100ms", "--output"])
            .arg(&runs)
            .arg("--socket")
            .arg(dir.path().join("m.sock"))
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .env("FAKE_NVML_STATE", &state)
            .env("MEMTRACK_GPU_HOST_PROC", &host_proc)
            .arg("--")
            .args(python(SAMPLED_JOB)),
        Duration::from_secs(60),
    );
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{log}");
    let (_, doc) = only_document(&runs);
    let why = &doc.gpu_attribution.as_ref().unwrap().reason;
    assert!(why.contains("FIFO"), "{why}");
}

/// What once broke: `/dev/zero` as a process's `status` under
/// `gpu.host_proc` took memtrack to 16,799 MiB in 13 s. Here its address
/// space is capped at 2 GiB, so the unbounded read ends in a failed
/// allocation (about 1 GiB held) instead of the machine's memory.
#[test]
fn dev_zero_in_host_proc_is_refused_not_read() {
    if !need_root("a PID namespace") {
        return;
    }
    let dir = scratch();
    let host_proc = dir.path().join("host-proc");
    fake_host_proc(
        &host_proc,
        Some("Name:\tmemtrack\nNSpid:\t100\t1\n"),
        Some(Path::new("/dev/zero")),
    );
    let state = dir.path().join("nvml-state");
    std::fs::write(
        &state,
        "device 0 name=NVIDIA_Fake_H100 total_mib=81559\nprocess 0 4242 1000\n",
    )
    .unwrap();
    let runs = dir.path().join("runs");
    let mut cmd = Command::new("prlimit");
    let pid1 = memtrack_as_pid1();
    cmd.arg(format!("--as={}", 2u64 << 30))
        .arg("--")
        .arg(pid1.get_program())
        .args(pid1.get_args())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") {
            cmd.env_remove(k);
        }
    }
    let out = run_to_end(
        cmd.args(["run", "--listen", "off", "--interval", "100ms", "--output"])
            .arg(&runs)
            .arg("--socket")
            .arg(dir.path().join("m.sock"))
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .env("FAKE_NVML_STATE", &state)
            .env("MEMTRACK_GPU_HOST_PROC", &host_proc)
            .arg("--")
            .args(python(SAMPLED_JOB)),
        Duration::from_secs(60),
    );
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{log}");
    let (_, doc) = only_document(&runs);
    assert_eq!(doc.run.status, "finished", "{log}");
    // The read stopped at its cap, not at the allocation that failed.
    let own_peak: f64 = log
        .split("memtrack's own peak RSS ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|mib| mib.parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS in the log: {log}"));
    assert!(
        own_peak < 256.0,
        "memtrack's own peak RSS {own_peak} MiB: {log}"
    );
}

/// The host PID of the one child of `parent`.
fn child_of(parent: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// What once broke: memtrack as PID 1 of a PID namespace has no default
/// action for SIGTERM, so while it started (here: an NVML whose init
/// blocks, as a wedged driver's does) `docker stop` did nothing; the job
/// then started anyway.
#[test]
fn as_pid_1_a_sigterm_during_the_start_ends_memtrack() {
    if !need_root("a PID namespace") {
        return;
    }
    let dir = scratch();
    let state = dir.path().join("nvml-state");
    sh(&format!("mkfifo {}", state.display()));
    let ran = dir.path().join("job-ran");
    let mut cmd = memtrack_as_pid1();
    cmd.args(["run", "--listen", "off", "--socket", "off", "--output"])
        .arg(dir.path().join("runs"))
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .env("FAKE_NVML_STATE", &state)
        .args(["--", "touch"])
        .arg(&ran)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut run = Reap(cmd.spawn().expect("unshare"));
    // NVML's init is reading the state FIFO: memtrack is mid-start.
    let writer = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&state)
            {
                Ok(f) => break f,
                Err(_) => {
                    assert!(Instant::now() < deadline, "NVML never opened its state");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    };
    let pid1 = child_of(run.0.id()).expect("memtrack's host PID");
    signal(pid1, "TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(s) = run.0.try_wait().unwrap() {
            break s.code();
        }
        // Dropping `run` kills unshare, and memtrack with it.
        assert!(
            Instant::now() < deadline,
            "memtrack, PID 1, was still starting 20 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(writer);
    assert!(!ran.exists(), "the job started after the SIGTERM");
    assert_eq!(code, Some(128 + 15));
}

fn need_cgroups() -> bool {
    let why = cgroup_unavailable();
    can_run(
        "cgroup",
        why.is_none(),
        &format!(
            "needs a writable cgroup v1 memory controller: {}",
            why.unwrap_or_default()
        ),
    )
}

/// A shell job that writes the memory cgroup it runs in to `at`, then
/// runs `then`.
fn cgroup_job(at: &Path, then: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "c=/sys/fs/cgroup/memory$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup) && echo \"$c\" > {at}.tmp && mv {at}.tmp {at} && {then}",
            at = at.display()
        ),
    ]
}

/// Removes a cgroup tree a test made, deepest first.
fn remove_tree(dir: &Path) {
    let mut dirs = vec![dir.to_path_buf()];
    let mut i = 0;
    while i < dirs.len() {
        if let Ok(entries) = std::fs::read_dir(&dirs[i]) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
        }
        i += 1;
    }
    for d in dirs.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
}

/// What once broke: a job that nested its own cgroups 20 deep left all 21
/// folders for good (removal stopped at depth 16 with EBUSY).
#[test]
fn a_job_nesting_cgroups_20_deep_leaves_none() {
    if !need_root("cgroups") || !need_cgroups() {
        return;
    }
    let dir = scratch();
    let at = dir.path().join("cgroup");
    // 20 levels; the job moves itself to the deepest and exits there.
    let job = cgroup_job(
        &at,
        "d=\"$c\"; for i in $(seq 1 20); do d=\"$d/n$i\"; mkdir \"$d\"; done; echo $$ > \"$d/cgroup.procs\"",
    );
    let out = run_to_end(
        memtrack()
            .args([
                "run",
                "--listen",
                "off",
                "--socket",
                "off",
                "--host-source",
                "cgroup",
            ])
            .arg("--output")
            .arg(dir.path().join("runs"))
            .arg("--")
            .args(&job),
        Duration::from_secs(120),
    );
    let cgroup = PathBuf::from(std::fs::read_to_string(&at).unwrap().trim());
    let left = cgroup.exists();
    if left {
        remove_tree(&cgroup);
    }
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        cgroup
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("memtrack-"),
        "{}",
        cgroup.display()
    );
    assert!(
        !left,
        "{} and its 20 levels are removed: {}",
        cgroup.display(),
        stderr(&out)
    );
}

/// What once broke: memtrack as PID 1 of a PID namespace, killed, left its
/// `memtrack-1-*` cgroup for good: PID 1 always looks alive.
#[test]
fn a_cgroup_of_a_killed_pid_1_memtrack_is_removed() {
    if !need_root("a PID namespace") || !need_cgroups() {
        return;
    }
    let dir = scratch();
    let at = dir.path().join("cgroup");
    let runs = dir.path().join("runs");
    let mut cmd = memtrack_as_pid1();
    cmd.args([
        "run",
        "--listen",
        "off",
        "--socket",
        "off",
        "--host-source",
        "cgroup",
    ])
    .args(["--name", "pid1", "--output"])
    .arg(&runs)
    .arg("--")
    .args(cgroup_job(&at, "exec sleep 600"))
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut run = Reap(cmd.spawn().expect("unshare"));
    wait_for("the job in its cgroup", Duration::from_secs(30), || {
        at.exists()
    });
    let cgroup = PathBuf::from(std::fs::read_to_string(&at).unwrap().trim());
    let name = cgroup.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("memtrack-1-"), "{name}");
    // memtrack (PID 1) killed: the namespace and the job go with it.
    let pid1 = child_of(run.0.id()).expect("memtrack's host PID");
    signal(pid1, "KILL");
    let _ = run.0.wait();
    wait_for("the job's end", Duration::from_secs(30), || {
        std::fs::read_to_string(cgroup.join("cgroup.procs")).map_or(true, |t| t.trim().is_empty())
    });
    assert!(cgroup.exists(), "the killed run left its cgroup");
    let rec = run_to_end(
        memtrack().arg("recover").arg(runs.join("pid1")),
        Duration::from_secs(60),
    );
    let left = cgroup.exists();
    if left {
        remove_tree(&cgroup);
    }
    assert!(!left, "{} is removed: {}", cgroup.display(), stderr(&rec));
    assert!(stderr(&rec).contains("memory cgroup"), "{}", stderr(&rec));
}

/// A job that sends marks and a stage whose names hold a terminal title
/// sequence, U+202E and a C1 control, then waits for `go`.
fn escapes_job(ready: &Path, go: &Path) -> Vec<String> {
    python(&format!(
        r#"
import json, os, socket, time
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["MEMTRACK_SOCKET"]); f = s.makefile("rw")
def ask(o):
    o["ack"] = True; f.write(json.dumps(o) + "\n"); f.flush(); return f.readline()
import ctypes
ctypes.CDLL(None).prctl(15, b"\x1b]2;PWNED\x07\xe2\x80\xae", 0, 0, 0)
evil = "\x1b]2;PWNED\x07\u202e\x9b"
ask({{"type": "stage_begin", "name": "stage" + evil}})
for i in range(3):
    ask({{"type": "mark", "component": "comp" + evil, "operation": "op" + evil, "iteration": i,
          "labels": {{"k": "v" + evil}}}})
# A new process, found with its hostile name.
if os.fork() == 0:
    while not os.path.exists({go:?}):
        time.sleep(0.05)
    os._exit(0)
open({ready:?}, "w").close()
os.wait()
ask({{"type": "stage_end", "name": "stage" + evil}})
"#,
        ready = ready.display().to_string(),
        go = go.display().to_string()
    ))
}

/// Characters that drive a terminal or break XML: C0 (but newline and
/// tab), DEL, C1, bidirectional overrides and isolates.
fn controls(text: &str) -> Vec<String> {
    text.char_indices()
        .filter(|(_, c)| {
            (c.is_control() && *c != '\n' && *c != '\t')
                || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        })
        .map(|(i, c)| {
            let from = text[..i].char_indices().rev().nth(30).map_or(0, |(j, _)| j);
            format!("U+{:04X} after {:?}", u32::from(c), &text[from..i])
        })
        .collect()
}

/// What once broke: `/metrics` label values carried the job's raw ESC
/// (`name="^[]2;PWNED^G"`), `/memory-info` raw U+202E, and `plot` copied
/// ESC into the SVG, which no XML reader then opened.
#[test]
fn metrics_memory_info_and_the_svg_carry_no_raw_controls() {
    let dir = scratch();
    let ready = dir.path().join("ready");
    let go = dir.path().join("go");
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &escapes_job(&ready, &go),
        &[],
    );
    wait_for("the job's marks", Duration::from_secs(30), || {
        ready.exists()
    });
    let mut metrics = String::new();
    wait_for(
        "the process name in /metrics",
        Duration::from_secs(30),
        || {
            let (code, text) = d.http("GET", "/metrics");
            metrics = text;
            code == 200 && metrics.contains("PWNED")
        },
    );
    let (code, info) = d.http("GET", "/memory-info");
    assert_eq!(code, 200);
    assert!(info.contains("PWNED"), "{info}");
    std::fs::write(&go, "").unwrap();
    let (code, _, log) = d.finish_logged();
    assert_eq!(code, Some(0), "{log}");
    let svg = dir.path().join("t.svg");
    let plot = run_to_end(
        memtrack()
            .arg("plot")
            .arg(dir.path().join("d"))
            .arg("-o")
            .arg(&svg),
        Duration::from_secs(60),
    );
    assert_eq!(plot.status.code(), Some(0), "{}", stderr(&plot));
    let picture = std::fs::read_to_string(&svg).unwrap();
    let mut found = Vec::new();
    for (what, text) in [
        ("/metrics", &metrics),
        ("/memory-info", &info),
        ("SVG", &picture),
    ] {
        found.extend(controls(text).into_iter().map(|c| format!("{what}: {c}")));
    }
    assert!(found.is_empty(), "raw controls:\n{}", found.join("\n"));
    let json: serde_json::Value = serde_json::from_str(&info).expect("still JSON");
    assert!(
        json.to_string().contains('\u{202e}'),
        "same meaning: {json}"
    );
    let xml = Command::new(python3())
        .args([
            "-c",
            "import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])",
        ])
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        xml.status.success(),
        "{}",
        String::from_utf8_lossy(&xml.stderr)
    );
}

/// A listener on `path`, run as uid 65534, that logs every line it gets
/// to `log` and answers each with a plausible reply.
const FAKE_DAEMON: &str = r#"
import json, os, socket, sys
path, log, ready = sys.argv[1], sys.argv[2], sys.argv[3]
srv = socket.socket(socket.AF_UNIX); srv.bind(path); os.chmod(path, 0o777); srv.listen(8)
open(ready, "w").close()
while True:
    c, _ = srv.accept()
    f = c.makefile("rwb")
    for line in f:
        with open(log, "ab") as out:
            out.write(line)
        f.write(b'{"ok": true, "entry": {}}\n'); f.flush()
"#;

/// What once broke: a `--socket` in a folder others may write to can be
/// swapped for another user's, and `memtrack mark` and the Python client
/// delivered to whoever listened there.
#[test]
fn clients_refuse_a_socket_served_by_another_user() {
    if !need_root("a second uid") {
        return;
    }
    let top = scratch();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = top.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = shared.join("memtrack.sock");
    let log = shared.join("received");
    let ready = shared.join("ready");
    let mut fake = Reap(
        Command::new("setpriv")
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .args([
                &format!("--reuid={NOBODY}"),
                &format!("--regid={NOBODY}"),
                "--clear-groups",
                "python3",
                "-c",
                FAKE_DAEMON,
            ])
            .arg(&sock)
            .arg(&log)
            .arg(&ready)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3"),
    );
    wait_for("the other user's listener", Duration::from_secs(30), || {
        ready.exists()
    });
    let mark = run_to_end(
        memtrack()
            .args([
                "mark",
                "--wait",
                "--label",
                "token=SECRET",
                "data",
                "batch",
                "--socket",
            ])
            .arg(&sock),
        Duration::from_secs(30),
    );
    assert_ne!(mark.status.code(), Some(0), "{}", stderr(&mark));
    assert!(stderr(&mark).contains("uid 65534"), "{}", stderr(&mark));
    let status = run_to_end(
        memtrack().arg("status").arg("--socket").arg(&sock),
        Duration::from_secs(30),
    );
    assert_ne!(status.status.code(), Some(0), "{}", stderr(&status));
    // The Python client, as a job would use it.
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    let py = Command::new(python3())
        .env("PYTHONPATH", &client)
        .env("MEMTRACK_SOCKET", &sock)
        .args([
            "-c",
            "import memtrack.client as m\n\
             c = m.Client()\n\
             c.mark('data', 'batch', labels={'token': 'SECRET'})\n\
             try:\n    c.mark('data', 'batch', labels={'token': 'SECRET'}, ack=True)\n\
             except Exception as e:\n    print('refused:', e)\n\
             c.flush(); c.close()",
        ])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&py.stdout),
        String::from_utf8_lossy(&py.stderr)
    );
    let _ = fake.0.kill();
    let _ = fake.0.wait();
    let got = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(got.is_empty(), "the other user received: {got}\n{said}");
    assert!(said.contains("uid 65534"), "{said}");
}

/// What once broke: an output root that another user made a link to
/// their own folder was followed: the run folder was created in theirs.
#[test]
fn an_output_link_planted_by_another_user_is_not_followed() {
    if !need_root("a second uid") {
        return;
    }
    let top = scratch();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = top.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let theirs = shared.join("theirs");
    as_nobody(&format!(
        "mkdir -m 0777 {t} && ln -s {t} {s}/out",
        t = theirs.display(),
        s = shared.display()
    ));
    let run = run_to_end(
        memtrack()
            .args([
                "run", "--listen", "off", "--socket", "off", "--name", "r", "--output",
            ])
            .arg(shared.join("out"))
            .args(["--", "true"]),
        Duration::from_secs(60),
    );
    let inside: Vec<_> = std::fs::read_dir(&theirs).unwrap().collect();
    assert!(
        inside.is_empty(),
        "nothing created in theirs: {}",
        stderr(&run)
    );
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    assert!(
        stderr(&run).contains("link owned by uid 65534"),
        "{}",
        stderr(&run)
    );
}

/// What once broke: `--s3-url s3://admin:pw@bucket/p` echoed the password,
/// `--memory-limit 0` silently meant no limit, `--pid ' 1'` and `'+5'` were
/// taken for PIDs, and a 17-level `clearml.conf` chain was reported as a
/// substitution that "refers to itself".
#[test]
fn flags_and_files_that_are_mistakes_say_so() {
    let dir = scratch();
    let out = dir.path().join("out");
    let run = |args: &[&str], env: &[(&str, &Path)]| {
        let mut cmd = memtrack();
        cmd.args(["run", "--listen", "off", "--socket", "off", "--output"])
            .arg(&out)
            .args(args)
            .args(["--", "true"]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        run_to_end(&mut cmd, Duration::from_secs(60))
    };
    let s3 = run(&["--s3-url", "s3://admin:hunter2@bucket/p"], &[]);
    assert_ne!(s3.status.code(), Some(0), "{}", stderr(&s3));
    assert!(!stderr(&s3).contains("hunter2"), "{}", stderr(&s3));
    assert!(stderr(&s3).contains("s3://***@bucket/p"), "{}", stderr(&s3));

    let zero = run(&["--memory-limit", "0"], &[]);
    assert_eq!(zero.status.code(), Some(2), "{}", stderr(&zero));
    assert!(
        stderr(&zero).contains("0 would mean no limit"),
        "{}",
        stderr(&zero)
    );

    for pid in [" 1", "+5", "1 "] {
        let attach = run_to_end(
            memtrack()
                .args(["attach", "--listen", "off", "--socket", "off", "--output"])
                .arg(&out)
                .args(["--pid", pid]),
            Duration::from_secs(30),
        );
        assert_eq!(
            attach.status.code(),
            Some(2),
            "{pid:?}: {}",
            stderr(&attach)
        );
        assert!(
            stderr(&attach).contains("a PID is a decimal number"),
            "{}",
            stderr(&attach)
        );
    }

    let conf = dir.path().join("clearml.conf");
    let mut text = String::from("l0: \"http://127.0.0.1:9\"\n");
    for i in 1..=17 {
        text.push_str(&format!("l{i}: ${{l{}}}\n", i - 1));
    }
    text.push_str("api { api_server: ${l17}\n web_server: ${l17}\n files_server: ${l17}\n credentials { access_key: a, secret_key: b } }\n");
    let mut f = std::fs::File::create(&conf).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    let deep = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--socket", "off", "--output"])
            .arg(&out)
            .args(["--clearml-project", "memtrack-test", "--", "true"])
            .env("HOME", dir.path())
            .env("CLEARML_CONFIG_FILE", &conf)
            .env_remove("CLEARML_API_HOST")
            .env_remove("CLEARML_API_ACCESS_KEY")
            .env_remove("CLEARML_API_SECRET_KEY")
            .env_remove("CLEARML_AUTH_TOKEN"),
        Duration::from_secs(60),
    );
    let said = stderr(&deep);
    assert!(said.contains("nest too deep"), "{said}");
    assert!(!said.contains("refers to itself"), "{said}");
}
