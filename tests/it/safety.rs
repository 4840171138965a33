//! A hostile or unlucky machine: descriptors running out mid-run, links
//! planted by another user in a shared output root, a dead stderr, a full
//! disk, hostile PID files, doubled signals. Each test provokes the fault
//! for real against the memtrack binary; the ones that need root (a tmpfs
//! mount, a second uid) say so and return when not root.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;

fn sh(script: &str) {
    let ok = Command::new("sh")
        .args(["-c", script])
        .status()
        .expect("sh")
        .success();
    assert!(ok, "{script}");
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

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Iterations of the marks of `component` in a document.
fn mark_iterations(doc: &memtrack::model::Document, component: &str) -> Vec<u64> {
    doc.detailed_log
        .iter()
        .filter(|e| e.component == component)
        .filter_map(|e| e.iteration)
        .collect()
}

/// A job that sends acknowledged marks (component `c`, iteration N) until
/// `<dir>/stop` exists, appending each acknowledged N to `<dir>/acked`,
/// then writes `<dir>/done` and sleeps.
const ACKED_MARKS_JOB: &str = r#"
import json, os, socket, sys, time
d = sys.argv[1]
open(d + "/job.pid", "w").write(str(os.getpid()))
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["MEMTRACK_SOCKET"])
f = s.makefile("rwb")
acked = open(d + "/acked", "w")
n = 0
while not os.path.exists(d + "/stop"):
    n += 1
    f.write((json.dumps({"type": "mark", "component": "c", "operation": "op",
                         "iteration": n, "ack": True}) + "\n").encode())
    f.flush()
    reply = json.loads(f.readline())
    if reply.get("ok") and reply.get("type") == "recorded":
        acked.write("%d\n" % n)
        acked.flush()
    time.sleep(0.005)
open(d + "/done", "w").close()
time.sleep(120)
"#;

fn acked(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("acked"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect()
}

/// Everything `child` writes to its (piped) stderr, as it comes: read on a
/// thread of its own, so memtrack never blocks on a full pipe.
fn watch_stderr(child: &mut std::process::Child) -> Arc<Mutex<String>> {
    let mut pipe = child.stderr.take().expect("stderr piped");
    let log = Arc::new(Mutex::new(String::new()));
    let sink = Arc::clone(&log);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    log
}

/// The inode of the run's document: a new one each time a checkpoint has
/// been written (it is replaced by a rename).
fn document_inode(run_dir: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(run_dir.join("memory_usage.json"))
        .ok()
        .map(|m| m.ino())
}

/// What once broke: a rotation whose new journal could not be opened left the
/// writer on `journal.old.jsonl`, which the next good checkpoint deleted;
/// every later record went into a deleted file.
#[test]
fn a_journal_rotation_failed_for_want_of_descriptors_loses_no_acknowledged_mark() {
    let out = scratch();
    let d = out.path();
    let socket = d.join("m.sock");
    // memtrack raises its soft limit to the hard one: both are set low.
    let child = Command::new("prlimit")
        .arg("--nofile=48:48")
        .arg(env!("CARGO_BIN_EXE_memtrack"))
        .args([
            "run",
            "--listen",
            "off",
            "--interval",
            "100ms",
            "--checkpoint-interval",
            "1s",
            "--name",
            "r",
            "--output",
        ])
        .arg(d)
        .arg("--socket")
        .arg(&socket)
        .args(["--", "python3", "-c", ACKED_MARKS_JOB])
        .arg(d)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("prlimit memtrack");
    let mut child = Reap(child);
    let log = watch_stderr(&mut child.0);
    wait_for("acknowledged marks", Duration::from_secs(20), || {
        acked(d).len() >= 20
    });
    // Connections that are never used take memtrack's descriptors: one
    // each, until it has none left for a new journal.
    let mut hogs = Vec::new();
    for _ in 0..200 {
        let s = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        s.set_nonblocking(true).unwrap();
        hogs.push(s);
    }
    let holding = acked(d).len();
    // No descriptor to spare: marks go on, and a rotation fails (memtrack
    // logs it; no checkpoint can be written meanwhile)…
    wait_for("marks while exhausted", Duration::from_secs(30), || {
        acked(d).len() >= holding + 10
    });
    wait_for("a failed rotation, logged", Duration::from_secs(60), || {
        log.lock().unwrap().contains("journal error")
    });
    // …then descriptors again: the next checkpoint succeeds (the document
    // is replaced), and with the bug it removed the journal being written.
    let run_dir = d.join("r");
    let before = document_inode(&run_dir);
    drop(hogs);
    wait_for(
        "a checkpoint once descriptors are back",
        Duration::from_secs(30),
        || document_inode(&run_dir).is_some_and(|i| Some(i) != before),
    );
    let after = acked(d).len();
    wait_for("marks after", Duration::from_secs(20), || {
        acked(d).len() >= after + 20
    });
    std::fs::write(d.join("stop"), "").unwrap();
    wait_for("the job to stop marking", Duration::from_secs(20), || {
        d.join("done").exists()
    });
    signal(child.0.id(), "KILL");
    child.0.wait().unwrap();
    let job: u32 = std::fs::read_to_string(d.join("job.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    signal(job, "KILL");
    let sent = acked(d);

    let res = run_to_end(
        memtrack().arg("recover").arg(&run_dir),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let doc = read_document(&run_dir.join("memory_usage.json"));
    let got: std::collections::BTreeSet<u64> = mark_iterations(&doc, "c").into_iter().collect();
    let lost: Vec<u64> = sent.iter().filter(|n| !got.contains(n)).copied().collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged marks lost, first {:?}",
        lost.len(),
        sent.len(),
        &lost[..lost.len().min(5)]
    );
    // The failed rotation is counted (`journal_errors`), not silent.
    assert!(
        doc.counters.journal_errors >= 1,
        "the test must make a rotation fail: {:?}",
        doc.counters
    );
}

/// What once broke: killed while no checkpoint could be written (inodes or
/// descriptors exhausted), memtrack's recovered JSON said `journal_errors`
/// 0 though the failure was logged: the count lived only in memory.
#[test]
fn journal_errors_survive_a_kill_while_no_checkpoint_can_be_written() {
    let out = scratch();
    let d = out.path();
    let socket = d.join("m.sock");
    let child = Command::new("prlimit")
        .arg("--nofile=48:48")
        .arg(env!("CARGO_BIN_EXE_memtrack"))
        .args([
            "run",
            "--listen",
            "off",
            "--interval",
            "100ms",
            "--checkpoint-interval",
            "1s",
            "--name",
            "r",
            "--output",
        ])
        .arg(d)
        .arg("--socket")
        .arg(&socket)
        .args(["--", "python3", "-c", ACKED_MARKS_JOB])
        .arg(d)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("prlimit memtrack");
    let mut child = Reap(child);
    wait_for("acknowledged marks", Duration::from_secs(20), || {
        acked(d).len() >= 20
    });
    let mut hogs = Vec::new();
    for _ in 0..200 {
        let s = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        s.set_nonblocking(true).unwrap();
        hogs.push(s);
    }
    // memtrack logs the failed rotation: wait for that line, then kill it
    // while the descriptors are still taken.
    let log = watch_stderr(&mut child.0);
    wait_for("a failed rotation, logged", Duration::from_secs(60), || {
        log.lock().unwrap().contains("journal error")
    });
    // One more acknowledged mark: the count was journalled before it.
    let now = acked(d).len();
    wait_for("a mark after the failure", Duration::from_secs(20), || {
        acked(d).len() > now
    });
    signal(child.0.id(), "KILL");
    child.0.wait().unwrap();
    drop(hogs);
    let job: u32 = std::fs::read_to_string(d.join("job.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    signal(job, "KILL");
    let run_dir = d.join("r");
    let res = run_to_end(
        memtrack().arg("recover").arg(&run_dir),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let doc = read_document(&run_dir.join("memory_usage.json"));
    assert!(
        doc.counters.journal_errors >= 1,
        "the logged failure is counted: {:?}",
        doc.counters
    );
}

/// What once broke: as root, memtrack wrote through links another user planted in a
/// shared output root, and recovered that user's folders.
#[test]
fn links_planted_by_another_user_are_never_followed() {
    if !can_run(
        "root",
        is_root(),
        "needs root to plant files as a second uid",
    ) {
        return;
    }
    const OTHER: u32 = 4242;
    let top = scratch();
    let shared = top.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    // A shared output root: everyone may create folders in it.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let victim = top.path().join("victim");
    std::fs::write(&victim, "root's secret\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let elsewhere = top.path().join("created-elsewhere");

    // The other user prepares the run directory of a run named `job`.
    let planted = shared.join("job");
    let dot = planted.join(".memtrack");
    std::fs::create_dir_all(&dot).unwrap();
    std::os::unix::fs::symlink(&victim, dot.join("journal.jsonl")).unwrap();
    std::os::unix::fs::symlink(&victim, dot.join("state.json")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, dot.join("lock")).unwrap();
    for pid in std::process::id()..std::process::id() + 2000 {
        let name = format!(".memory_usage.json.tmp-{pid}");
        std::os::unix::fs::symlink(&victim, planted.join(name)).unwrap();
    }
    sh(&format!("chown -hR {OTHER}:{OTHER} {}", planted.display()));

    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--socket", "off", "--name", "job"])
            .arg("--output")
            .arg(&shared)
            .args(["--", "true"]),
        Duration::from_secs(30),
    );
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "root's secret\n",
        "the victim is untouched: {}",
        stderr(&res)
    );
    assert!(!elsewhere.exists(), "no file created through the lock link");
    assert_ne!(
        res.status.code(),
        Some(0),
        "a folder of another user is refused"
    );
    assert!(
        stderr(&res).contains("belongs to uid 4242"),
        "{}",
        stderr(&res)
    );

    // An automatic name skips a folder planted under it.
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--socket", "off"])
            .arg("--output")
            .arg(&shared)
            .args(["--", "true"]),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's secret\n");
}

/// What once broke: a memtrack starting in a shared output root opened and recovered
/// the leftover runs of other users.
#[test]
fn another_users_leftover_run_is_neither_opened_nor_recovered() {
    if !can_run(
        "root",
        is_root(),
        "needs root to leave a run as a second uid",
    ) {
        return;
    }
    const OTHER: u32 = 4243;
    let top = scratch();
    let shared = top.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    // A real run killed -9, then handed to the other user.
    let pid_file = top.path().join("job.pid");
    let mut child = memtrack()
        .args([
            "run",
            "--listen",
            "off",
            "--socket",
            "off",
            "--interval",
            "50ms",
        ])
        .args(["--name", "theirs", "--output"])
        .arg(top.path())
        .args(["--", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 60", pid_file.display()))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let state = top.path().join("theirs/.memtrack/state.json");
    wait_for("the run to start", Duration::from_secs(10), || {
        state.exists() && pid_file.exists()
    });
    signal(child.id(), "KILL");
    child.wait().unwrap();
    let job: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    signal(job, "KILL");
    std::fs::rename(top.path().join("theirs"), shared.join("theirs")).unwrap();
    sh(&format!(
        "chown -hR {OTHER}:{OTHER} {}",
        shared.join("theirs").display()
    ));

    let res = run_to_end(
        memtrack()
            .args([
                "run", "--listen", "off", "--socket", "off", "--name", "mine",
            ])
            .arg("--output")
            .arg(&shared)
            .args(["--", "true"]),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert!(
        !stderr(&res).contains("recovered the run"),
        "{}",
        stderr(&res)
    );
    let theirs = shared.join("theirs");
    assert!(theirs.join(".memtrack/state.json").exists(), "left alone");
    assert!(
        !theirs.join("memory_usage.json").exists()
            || read_document(&theirs.join("memory_usage.json")).run.status != "recovered"
    );
    // Asked explicitly, root refuses too: it is the other user's to do.
    let res = run_to_end(
        memtrack().arg("recover").arg(&theirs),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
    assert!(
        stderr(&res).contains("belongs to uid 4243"),
        "{}",
        stderr(&res)
    );
}

#[test]
fn what_memtrack_writes_is_private_to_its_user() {
    let out = scratch();
    let root = out.path().join("new/outputs");
    let child = memtrack()
        .args([
            "run",
            "--listen",
            "off",
            "--interval",
            "50ms",
            "--checkpoint-interval",
            "1s",
        ])
        .args(["--name", "p", "--output"])
        .arg(&root)
        .args(["--", "sh", "-c"])
        // Bounded, so that a failed test leaves nothing running.
        .arg(format!(
            "i=0; while [ ! -e {0}/stop ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done",
            out.path().display()
        ))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut child = Reap(child);
    let stop = out.path().join("stop");
    let dot = root.join("p/.memtrack");
    wait_for("a checkpoint", Duration::from_secs(20), || {
        root.join("p/memory_usage.json").exists()
    });
    for f in ["state.json", "journal.jsonl", "lock"] {
        assert_eq!(mode(&dot.join(f)), 0o600, "{f}");
    }
    assert_eq!(mode(&dot), 0o700);
    std::fs::write(&stop, "").unwrap();
    assert_eq!(child.0.wait().unwrap().code(), Some(0));
    assert_eq!(mode(&root.join("p/memory_usage.json")), 0o600);
    assert_eq!(mode(&root.join("p")), 0o700);
    assert_eq!(mode(&root), 0o700, "a root memtrack creates is private too");
    assert_eq!(mode(&out.path().join("new")), 0o700);
}

/// What once broke: tracing's fallback for a failed write panicked: the job's status
/// became 101, and with a signal-killed job no JSON was written.
#[test]
fn a_closed_stderr_changes_neither_the_exit_status_nor_the_json() {
    for (end, code) in [("exit 3", 3), ("kill -KILL $$", 137)] {
        let out = scratch();
        let go = out.path().join("go");
        // Prints a lot, then waits until stderr is closed before it ends.
        let script = format!(
            "seq 1 20000; while [ ! -e {} ]; do sleep 0.02; done; seq 1 20000; {end}",
            go.display()
        );
        let mut child = memtrack()
            .args(["run", "--listen", "off", "--interval", "50ms"])
            .args(["--name", "j", "--output"])
            .arg(out.path())
            .args(["--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // `2> >(head -c 1 >/dev/null)`: one byte read, then the pipe closed.
        let mut err = child.stderr.take().unwrap();
        let mut byte = [0u8; 1];
        err.read_exact(&mut byte).unwrap();
        drop(err);
        std::fs::write(&go, "").unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(code), "{end}");
        let doc = read_document(&out.path().join("j/memory_usage.json"));
        assert_eq!(doc.run.status, "finished", "{end}");
        assert_eq!(doc.run.exit.unwrap().code, code, "{end}");
    }
}

/// What once broke: the complete JSON went to $TMPDIR after a full disk, and the
/// next memtrack with the same --output "recovered" the partial journal
/// left in the run directory into the normal path.
#[test]
fn after_a_full_disk_the_partial_journal_is_never_recovered() {
    if !can_run("root", is_root(), "needs root to mount a small tmpfs") {
        return;
    }
    let top = scratch();
    let mnt = top.path().join("full");
    let tmp = top.path().join("tmp");
    std::fs::create_dir(&mnt).unwrap();
    std::fs::create_dir(&tmp).unwrap();
    sh(&format!(
        "mount -t tmpfs -o size=512k tmpfs {}",
        mnt.display()
    ));
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _mounted = Unmount(mnt.clone());
    let job = r#"
import json, os, socket
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["MEMTRACK_SOCKET"])
f = s.makefile("rwb")
for i in range(3000):
    f.write((json.dumps({"type": "mark", "component": "data", "operation": "batch",
                         "iteration": i, "labels": {"pad": "x" * 200}, "ack": True}) + "\n").encode())
    f.flush()
    f.readline()
"#;
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--name", "run", "--output"])
            .arg(&mnt)
            .args(["--", "python3", "-c", job])
            .env("TMPDIR", &tmp),
        Duration::from_secs(120),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let moved: Vec<PathBuf> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("memory_usage.json"))
        .collect();
    assert_eq!(
        moved.len(),
        1,
        "the complete JSON went to TMPDIR: {}",
        stderr(&res)
    );
    let complete = std::fs::read(&moved[0]).unwrap();
    let doc = read_document(&moved[0]);
    assert_eq!(doc.run.status, "finished");
    assert_eq!(mark_iterations(&doc, "data").len(), 3000);
    let run_dir = mnt.join("run");
    let note = std::fs::read_to_string(run_dir.join(".memtrack.superseded/final-document"));
    if let Ok(note) = note {
        assert_eq!(note.trim(), moved[0].display().to_string());
    }

    // The disk has room again; the next run in the same output root.
    sh(&format!("mount -o remount,size=64m {}", mnt.display()));
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--name", "next", "--output"])
            .arg(&mnt)
            .args(["--", "true"])
            .env("TMPDIR", &tmp),
        Duration::from_secs(60),
    );
    assert!(
        !stderr(&res).contains("recovered the run"),
        "{}",
        stderr(&res)
    );
    let normal = run_dir.join("memory_usage.json");
    if normal.exists() {
        assert_ne!(read_document(&normal).run.status, "recovered");
    }
    assert_eq!(std::fs::read(&moved[0]).unwrap(), complete, "untouched");
    assert!(
        run_dir.join(".memtrack.superseded").is_dir(),
        "the journal is kept"
    );
    let again = run_to_end(
        memtrack().arg("recover").arg(&run_dir),
        Duration::from_secs(30),
    );
    assert_eq!(again.status.code(), Some(1), "{}", stderr(&again));
}

/// What once broke: `/dev/zero` grew memtrack to 6.3 GB, a FIFO hung it, and the
/// error echoed the start of the file (`/etc/shadow`'s root line).
#[test]
fn attach_pid_files_are_bounded_regular_and_never_echoed() {
    let out = scratch();
    let fifo = out.path().join("fifo");
    sh(&format!("mkfifo {}", fifo.display()));
    let secret = out.path().join("shadow");
    std::fs::write(&secret, "root:$6$hash-of-the-secret:19000:0:99999:7:::\n").unwrap();
    let big = out.path().join("big");
    std::fs::write(&big, "1 ".repeat(10_000)).unwrap();
    for (file, expect) in [
        (Path::new("/dev/zero"), "not a regular file"),
        (fifo.as_path(), "not a regular file"),
        (out.path(), "not a regular file"),
        (big.as_path(), "larger than 4096 bytes"),
        (Path::new("/proc/self/smaps"), "larger than 4096 bytes"),
        (secret.as_path(), "word 1 is not a PID"),
    ] {
        let res = run_to_end(
            memtrack()
                .args(["attach", "--listen", "off", "--pid-file"])
                .arg(file)
                .arg("--output")
                .arg(out.path()),
            Duration::from_secs(20),
        );
        let err = stderr(&res);
        assert_eq!(res.status.code(), Some(1), "{}: {err}", file.display());
        assert!(err.contains(expect), "{}: {err}", file.display());
        assert!(!err.contains("secret") && !err.contains("root:"), "{err}");
    }
}

fn s3_args(server: &S3Server) -> Vec<String> {
    vec![
        "--s3-url".into(),
        format!("s3://{}/runs", server.bucket),
        "--s3-endpoint".into(),
        server.endpoint(),
    ]
}

/// What once broke: `timeout` signals memtrack, then its process group: two
/// SIGTERMs microseconds apart were taken as "stop at once", and the final
/// sample, the upload and the flushes were skipped.
#[test]
fn doubled_signals_still_end_the_run_with_its_upload() {
    let server = S3Server::start();
    for how in ["timeout", "back to back"] {
        let out = scratch();
        let started = out.path().join("started");
        let script = format!(
            "trap 'sleep 0.3; exit 3' TERM HUP; touch {}; while :; do sleep 0.05; done",
            started.display()
        );
        let mut cmd = if how == "timeout" {
            let mut c = Command::new("timeout");
            c.args(["--preserve-status", "4"])
                .arg(env!("CARGO_BIN_EXE_memtrack"));
            c
        } else {
            Command::new(env!("CARGO_BIN_EXE_memtrack"))
        };
        cmd.args(["run", "--listen", "off", "--interval", "100ms"])
            .args(["--name", "job", "--output"])
            .arg(out.path())
            .args(s3_args(&server))
            .args(["--", "sh", "-c", &script])
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in server.env(S3_SECRET) {
            cmd.env(k, v);
        }
        let mut child = Reap(cmd.spawn().unwrap());
        wait_for("the job to start", Duration::from_secs(20), || {
            started.exists()
        });
        if how == "back to back" {
            // Two signals as one `sh` sends them: microseconds apart, and
            // of two kinds so that neither merges into the other.
            sh(&format!("kill -TERM {0}; kill -HUP {0}", child.0.id()));
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.0.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "{how}: memtrack did not end");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut log = String::new();
        child
            .0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut log)
            .unwrap();
        assert_eq!(status.code(), Some(3), "{how}: the job's status: {log}");
        assert!(!log.contains("stopping now"), "{how}: {log}");
        let local = std::fs::read(out.path().join("job/memory_usage.json")).unwrap();
        let doc = read_document(&out.path().join("job/memory_usage.json"));
        assert_eq!(doc.run.status, "finished", "{how}");
        assert_eq!(doc.run.exit.unwrap().code, 3, "{how}");
        let key = "runs/job/artifacts/memory_usage/memory_usage.json";
        assert_eq!(
            server.object(key).as_deref(),
            Some(local.as_slice()),
            "{how}: the final upload happened: {log}"
        );
        std::fs::remove_file(server.root.path().join(&server.bucket).join(key)).unwrap();
    }
}
