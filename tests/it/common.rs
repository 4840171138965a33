//! Helpers shared by the integration tests: the real memtrack binary, real
//! Python jobs, the fake NVML library, and reading what memtrack wrote.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use memtrack::model::Document;

pub const MIB: f64 = 1024.0 * 1024.0;

/// The memtrack binary under test, with a clean environment: no inherited
/// `MEMTRACK_*` settings, no `RUST_LOG`.
pub fn memtrack() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memtrack"));
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") || k == "RUST_LOG" || k == "CUDA_VISIBLE_DEVICES" {
            cmd.env_remove(k);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// A scratch directory for one test's outputs.
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("memtrack-it-")
        .tempdir()
        .expect("tempdir")
}

/// Runs memtrack to the end with a deadline, returning its output.
pub fn run_to_end(cmd: &mut Command, timeout: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn memtrack");
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "memtrack did not finish in {timeout:?}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Reads the document of the one run under `output`.
pub fn only_document(output: &Path) -> (PathBuf, Document) {
    let dirs: Vec<PathBuf> = std::fs::read_dir(output)
        .expect("output dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(dirs.len(), 1, "one run directory: {dirs:?}");
    let path = dirs[0].join("memory_usage.json");
    (dirs[0].clone(), read_document(&path))
}

pub fn read_document(path: &Path) -> Document {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `python3 -c SCRIPT` as argv.
pub fn python(script: &str) -> Vec<String> {
    vec!["python3".into(), "-c".into(), script.into()]
}

/// Builds the fake NVML library once per test run (gcc, see
/// tests/fake_nvml/README.md).
pub fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake_nvml");
        std::fs::create_dir_all(&dir).expect("fake nvml dir");
        let out = dir.join("libnvidia-ml-fake.so");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_nvml/fake_nvml.c");
        let status = Command::new("gcc")
            .args([
                "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o",
            ])
            .arg(&out)
            .arg(&src)
            .status()
            .expect("gcc");
        assert!(status.success(), "building the fake NVML library failed");
        out
    })
}

/// Waits until `cond` holds, polling.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `VmRSS` of a live process, bytes.
pub fn vm_rss(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|k| k * 1024)
}

/// Sends a signal with the `kill` command (no unsafe code in tests).
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -{sig} {pid}");
}
