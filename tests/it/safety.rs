//! A hostile or unlucky machine: a dead stderr, hostile PID files, doubled
//! signals. Each test provokes the fault for real against the memtrack
//! binary.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
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
