//! A hostile neighbour or an unlucky machine, third round: a run folder
//! swapped for a link mid-run, a rank that is a path, a full disk whose
//! fallback is full too, IPv4-mapped clients crowding the HTTP endpoint,
//! and job-chosen names full of terminal escapes. Each test provokes the
//! fault for real against the memtrack binary. The ones that need root (a
//! second uid, a tmpfs, a mount namespace) fail without it unless
//! `MEMTRACK_ALLOW_SKIP` names the reason.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// The uid the attacker's commands run as.
const NOBODY: u32 = 65534;

/// Whether the test may go on: root, or a skip asked for by name.
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

/// `sh -c SCRIPT` as uid/gid 65534 with no supplementary groups.
fn as_nobody(script: &str) {
    sh(&format!(
        "setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups sh -c '{script}'"
    ));
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

/// Waits for a child with a deadline; its exit code.
fn wait_exit(child: &mut std::process::Child, timeout: Duration) -> Option<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status.code();
        }
        assert!(
            Instant::now() < deadline,
            "memtrack did not finish in {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What once broke: in an output root others may write to without the
/// sticky bit, another user renamed the run folder mid-run and put a link
/// to bob's run in its place; memtrack, root, then replaced bob's
/// `memory_usage.json` and deleted bob's `.memtrack`.
#[test]
fn a_run_folder_swapped_for_a_link_is_never_written_through() {
    if !need_root("a second uid") {
        return;
    }
    let top = scratch();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = top.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    // A pre-made team folder: everyone may write, no sticky bit.
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let bob = top.path().join("bob-run1");
    std::fs::create_dir_all(bob.join(".memtrack")).unwrap();
    std::fs::write(bob.join("memory_usage.json"), "bob's result\n").unwrap();
    std::fs::write(bob.join(".memtrack/keep"), "bob's journal\n").unwrap();
    let go = top.path().join("go");

    let log = top.path().join("memtrack.log");
    let mut cmd = memtrack();
    cmd.args([
        "run",
        "--listen",
        "off",
        "--socket",
        "off",
        "--interval",
        "100ms",
    ])
    .args(["--name", "run1", "--output"])
    .arg(&shared)
    .args(["--", "sh", "-c"])
    .arg(format!(
        "while [ ! -e '{}' ]; do sleep 0.05; done",
        go.display()
    ))
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(&log).unwrap());
    let mut run = Reap(cmd.spawn().expect("spawn memtrack"));
    let run_dir = shared.join("run1");
    wait_for("the run's journal", Duration::from_secs(30), || {
        run_dir.join(".memtrack/state.json").is_file()
    });
    // The other user swaps the run folder for a link to bob's run.
    as_nobody(&format!(
        "mv {0}/run1 {0}/moved && ln -s {1} {0}/run1",
        shared.display(),
        bob.display()
    ));
    std::fs::write(&go, "").unwrap();
    let code = wait_exit(&mut run.0, Duration::from_secs(60));
    let log = std::fs::read_to_string(&log).unwrap();

    assert_eq!(
        std::fs::read_to_string(bob.join("memory_usage.json")).unwrap(),
        "bob's result\n",
        "bob's file is untouched\n{log}"
    );
    assert!(
        bob.join(".memtrack/keep").is_file(),
        "bob's .memtrack is not deleted\n{log}"
    );
    assert_eq!(code, Some(0), "{log}");
    let doc = read_document(&shared.join("moved/memory_usage.json"));
    assert_eq!(doc.run.status, "finished", "{log}");
    assert!(
        !shared.join("moved/.memtrack").exists(),
        "the run's own journal is removed: {log}"
    );
    assert!(log.contains("was moved or replaced"), "{log}");
}

/// What once broke: `RANK='0/../../escape'` put the document in
/// `<output>/../escape/`.
#[test]
fn a_rank_or_name_that_is_a_path_is_refused() {
    let top = scratch();
    let out = top.path().join("a/o");
    // (environment, arguments, what the error says)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str], &'a str);
    let cases: &[Case<'_>] = &[
        (
            &[("RANK", "0/../../escape")],
            &["--name", "x"],
            "not a number",
        ),
        (
            &[("SLURM_PROCID", "../../escape")],
            &["--name", "x"],
            "not a number",
        ),
        (
            &[],
            &["--name", "x", "--label", "rank=../../escape"],
            "not a number",
        ),
        (&[], &["--name", "../escape"], "name"),
        (&[], &["--name", ".."], "name"),
        (&[], &["--name", "x\u{1b}]0;T\u{7}"], "name"),
    ];
    for (env, args, says) in cases {
        let mut cmd = memtrack();
        for var in ["RANK", "LOCAL_RANK", "SLURM_PROCID"] {
            cmd.env_remove(var);
        }
        cmd.args(["run", "--listen", "off", "--socket", "off"])
            .args(*args)
            .arg("--output")
            .arg(&out)
            .args(["--", "true"])
            .envs(env.iter().copied());
        let res = run_to_end(&mut cmd, Duration::from_secs(30));
        let log = stderr(&res);
        assert!(!res.status.success(), "{args:?} {env:?}: {log}");
        assert!(log.contains(says), "{args:?} {env:?}: {log}");
        assert!(!log.contains('\u{1b}'), "the name is shown escaped: {log}");
        for escaped in [top.path().join("a/escape"), top.path().join("escape")] {
            assert!(
                !escaped.exists(),
                "{args:?} {env:?} wrote {}",
                escaped.display()
            );
        }
    }
    // A rank that is a number names the rank's folder.
    let res = run_to_end(
        memtrack()
            .args([
                "run", "--listen", "off", "--socket", "off", "--name", "x", "--output",
            ])
            .arg(&out)
            .args(["--", "true"])
            .env("RANK", "3"),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert!(out.join("x.rank3/memory_usage.json").is_file());
}

/// Mounts a tmpfs of `size` at `at` for the test's life.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        sh(&format!(
            "mount -t tmpfs -o size={size} tmpfs {}",
            at.display()
        ));
        Tmpfs(at.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A job sending 3,000 acknowledged marks of ~250 bytes: more than 512 KiB
/// of journal.
const MARKS_JOB: &str = r#"
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

/// `memtrack run` on a full disk, in a mount namespace of its own where
/// `/var/tmp` is `var_tmp` and `TMPDIR` and `HOME` are `tmp`.
fn run_on_full_disk(output: &Path, var_tmp: &Path, tmp: &Path) -> std::process::Output {
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$1" /var/tmp && shift && exec "$@""#)
        .arg("sh")
        .arg(var_tmp)
        .arg(env!("CARGO_BIN_EXE_memtrack"))
        .args(["run", "--listen", "off", "--name", "run", "--output"])
        .arg(output)
        .args(["--", "python3", "-c", MARKS_JOB])
        .env("TMPDIR", tmp)
        .env("HOME", tmp)
        .stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    run_to_end(&mut cmd, Duration::from_secs(120))
}

/// Fills the filesystem of `dir` to its last byte.
fn fill(dir: &Path) {
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let block = vec![0u8; 4096];
    while f.write_all(&block).is_ok() {}
    let _ = f.write_all(&[0u8]);
}

fn iterations(doc: &memtrack::model::Document) -> usize {
    doc.detailed_log
        .iter()
        .filter(|e| e.component == "data")
        .filter_map(|e| e.iteration)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

/// What once broke: the run folder full and `TMPDIR` on the same disk: "could
/// not be written anywhere", the journal left to be "recovered" with 1,003
/// of 3,000 acknowledged marks, the partial checkpoint reading `running`.
#[test]
fn a_full_disk_with_a_full_temp_dir_still_keeps_the_complete_run() {
    if !need_root("a tmpfs and a mount namespace") {
        return;
    }
    let top = scratch();
    let disk = Tmpfs::mount(&top.path().join("full"), "512k");
    let tmp = disk.0.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let var_tmp = top.path().join("var-tmp");
    std::fs::create_dir(&var_tmp).unwrap();
    std::fs::set_permissions(&var_tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    // TMPDIR is on the full disk; /var/tmp (here `var-tmp`) has room.
    let res = run_on_full_disk(&disk.0, &var_tmp, &tmp);
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "the job's status: {log}");
    let moved: Vec<PathBuf> = std::fs::read_dir(&var_tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(moved.len(), 1, "the complete JSON went to /var/tmp: {log}");
    let name = moved[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("memtrack-") && name.ends_with("-memory_usage.json"),
        "{name}"
    );
    assert_eq!(
        std::fs::metadata(&moved[0]).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let doc = read_document(&moved[0]);
    assert_eq!(doc.run.status, "finished");
    assert_eq!(iterations(&doc), 3000, "{log}");
    let run_dir = disk.0.join("run");
    assert!(
        !run_dir.join("memory_usage.json").exists(),
        "no partial checkpoint passes for the result: {log}"
    );
    assert!(log.contains(&name), "the log says where: {log}");
}

/// The same with no place at all for the final document: nothing is
/// deleted, the error names `memtrack recover`, and once there is room
/// again the journal recovers the run.
#[test]
fn a_run_no_disk_can_take_keeps_its_journal_for_recover() {
    if !need_root("a tmpfs and a mount namespace") {
        return;
    }
    let top = scratch();
    let disk = Tmpfs::mount(&top.path().join("full"), "512k");
    let tmp = disk.0.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let var_tmp = Tmpfs::mount(&top.path().join("var-tmp"), "64k");
    fill(&var_tmp.0);
    let res = run_on_full_disk(&disk.0, &var_tmp.0, &tmp);
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "the job's status: {log}");
    assert!(log.contains("could not be written anywhere"), "{log}");
    let run_dir = disk.0.join("run");
    assert!(
        log.contains(&format!("memtrack recover {}", run_dir.display())),
        "{log}"
    );
    assert!(
        run_dir.join(".memtrack/state.json").is_file(),
        "the journal is kept: {log}"
    );
    assert!(
        !run_dir.join("memory_usage.json").exists(),
        "no partial checkpoint passes for the result: {log}"
    );
    sh(&format!("mount -o remount,size=64m {}", disk.0.display()));
    let again = run_to_end(
        memtrack().arg("recover").arg(&run_dir),
        Duration::from_secs(60),
    );
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    let doc = read_document(&run_dir.join("memory_usage.json"));
    assert_eq!(doc.run.status, "recovered");
    assert!(iterations(&doc) > 0);
}

/// A job that sets a hostile process name and sends hostile span, stage,
/// component and label names, then waits for `go`.
fn hostile_job(ready: &Path, go: &Path) -> String {
    format!(
        r#"
import ctypes, json, os, socket, time
ctypes.CDLL(None).prctl(15, b"\x1b]0;T\x07\x1b[5m", 0, 0, 0)
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["MEMTRACK_SOCKET"])
f = s.makefile("rw")
def ask(obj):
    obj["ack"] = True
    f.write(json.dumps(obj) + "\n"); f.flush(); return f.readline()
evil = "\u202eevil\x1b[31m\x9b2J\u2066"
ask({{"type": "stage_begin", "name": "stage" + evil}})
ask({{"type": "span_begin", "name": "span" + evil}})
for i in range(3):
    ask({{"type": "mark", "component": "comp" + evil, "operation": "op" + evil,
          "iteration": i, "labels": {{"k" + evil: "v" + evil}}}})
ask({{"type": "span_end", "name": "span" + evil}})
ask({{"type": "stage_end", "name": "stage" + evil}})
# A new process, found with its hostile name.
if os.fork() == 0:
    while not os.path.exists({go:?}):
        time.sleep(0.05)
    os._exit(0)
open({ready:?}, "w").close()
os.wait()
"#,
        ready = ready.display().to_string(),
        go = go.display().to_string()
    )
}

/// Bytes that drive a terminal: ESC, a C1 control (UTF-8 `C2 80`–`C2 9F`),
/// a bidirectional override or isolate.
fn terminal_controls(bytes: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(bytes);
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

/// What once broke: `status` printed a process name set with `prctl` raw,
/// changing the terminal's title; U+202E in span, stage and component
/// names reordered report lines.
#[test]
fn no_printing_command_passes_a_jobs_terminal_controls_through() {
    let dir = scratch();
    let ready = dir.path().join("ready");
    let go = dir.path().join("go");
    let job = python(&hostile_job(&ready, &go));
    let d = Daemon::start(dir.path(), &["--interval", "100ms"], &job, &[]);
    wait_for("the job's hostile names", Duration::from_secs(30), || {
        ready.exists()
    });
    let mut outputs: Vec<(String, Vec<u8>)> = Vec::new();
    fn record(outputs: &mut Vec<(String, Vec<u8>)>, what: &str, out: std::process::Output) {
        assert!(out.status.success(), "{what}: {}", stderr(&out));
        outputs.push((format!("{what} stdout"), out.stdout));
        outputs.push((format!("{what} stderr"), out.stderr));
    }
    let sock = d.socket.clone();
    let status = || {
        run_to_end(
            memtrack().arg("status").arg("--socket").arg(&sock),
            Duration::from_secs(30),
        )
    };
    // The forked process is sampled: its name is in `status`.
    wait_for(
        "the process name in status",
        Duration::from_secs(30),
        || String::from_utf8_lossy(&status().stdout).contains("]0;T"),
    );
    for args in [
        vec!["status"],
        vec!["status", "--json"],
        vec!["watch", "--once"],
    ] {
        let out = run_to_end(
            memtrack().args(&args).arg("--socket").arg(&sock),
            Duration::from_secs(30),
        );
        record(&mut outputs, &args.join(" "), out);
    }
    std::fs::write(&go, "").unwrap();
    let (code, _, log) = d.finish_logged();
    assert_eq!(code, Some(0), "{log}");
    outputs.push(("memtrack run stderr".into(), log.into_bytes()));
    let run = dir.path().join("d");
    let file = run.join("memory_usage.json");
    for args in [
        vec!["report".to_string(), run.display().to_string()],
        vec!["report".into(), "--json".into(), run.display().to_string()],
        vec![
            "compare".into(),
            run.display().to_string(),
            file.display().to_string(),
        ],
        vec![
            "compare".into(),
            "--format".into(),
            "markdown".into(),
            run.display().to_string(),
        ],
        vec![
            "compare".into(),
            "--format".into(),
            "csv".into(),
            run.display().to_string(),
        ],
        vec!["merge".into(), file.display().to_string()],
    ] {
        let out = run_to_end(memtrack().args(&args), Duration::from_secs(30));
        record(&mut outputs, &args[..args.len().min(3)].join(" "), out);
    }
    let merged = dir.path().join("merged.json");
    let out = run_to_end(
        memtrack().arg("merge").arg(&file).arg("-o").arg(&merged),
        Duration::from_secs(30),
    );
    record(&mut outputs, "merge -o", out);
    let report = String::from_utf8_lossy(&outputs[7].1).into_owned();
    assert!(report.contains("\\u{1b}]0;T"), "{report}");
    let mut found = Vec::new();
    for (what, bytes) in &outputs {
        for c in terminal_controls(bytes) {
            found.push(format!("{what}: {c}"));
        }
    }
    assert!(
        found.is_empty(),
        "terminal controls printed:\n{}",
        found.join("\n")
    );
    // JSON outputs stay JSON, with the names intact.
    let json: serde_json::Value = serde_json::from_slice(&outputs[2].1).unwrap();
    assert!(json.to_string().contains("\\u001b]0;T"), "{json}");
}

/// A loopback client: an IPv6 socket bound to `::ffff:<source>`, or an
/// IPv4 one.
const HOLDER: &str = r#"
import socket, sys, time, os
port, ready = int(sys.argv[1]), sys.argv[2]
head = b"POST /cleanup-memory HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
def open_one(src):
    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::ffff:" + src, 0))
        s.connect(("::ffff:127.0.0.1", port))
        s.sendall(head)
        s.setblocking(False)
        return s
    except OSError:
        return None
sources = ["127.0.0.%d" % i for i in range(2, 10)]
held = {(src, n): open_one(src) for src in sources for n in range(16)}
open(ready, "w").close()
while True:
    for key, s in list(held.items()):
        try:
            if s is None or s.recv(1) == b"":
                raise OSError
        except BlockingIOError:
            continue
        except OSError:
            if s is not None:
                s.close()
            held[key] = open_one(key[0])
    time.sleep(0.01)
"#;

/// What once broke: 8 source addresses × 16 held-open POST bodies from
/// `::ffff:127.0.0.x` took all 64 slots (the owner was looked up in
/// `/proc/net/tcp` only) and `/healthz` answered 1 of 10.
#[test]
fn mapped_clients_of_one_user_share_one_quota() {
    if !need_root("a second uid") {
        return;
    }
    let dir = scratch();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let job = vec!["sleep".to_string(), "60".to_string()];
    let d = Daemon::start_listening(dir.path(), "[::]:0", &[], &job, &[]);
    let port = d.http.port();
    // Before its first sample memtrack is not healthy ("stale", 503): wait
    // for that state to pass, so that only the holder can fail /healthz.
    wait_for("the first sample", Duration::from_secs(30), || {
        d.http("GET", "/healthz").0 == 200
    });
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o777)).unwrap();
    let ready = theirs.join("held");
    // The system's python3: an interpreter under root's home cannot run as
    // uid 65534.
    let mut holder = Reap(
        Command::new("setpriv")
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .args([
                &format!("--reuid={NOBODY}"),
                &format!("--regid={NOBODY}"),
                "--clear-groups",
                "python3",
                "-c",
                HOLDER,
                &port.to_string(),
            ])
            .arg(&ready)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3"),
    );
    wait_for("the held-open connections", Duration::from_secs(30), || {
        ready.exists()
    });
    assert!(holder.0.try_wait().unwrap().is_none(), "the holder runs");
    let mut answered = 0;
    let mut failures = Vec::new();
    for _ in 0..10 {
        let reply = (|| -> std::io::Result<String> {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
            let mut reply = String::new();
            s.read_to_string(&mut reply)?;
            Ok(reply)
        })();
        match reply {
            Ok(r) if r.starts_with("HTTP/1.1 200") => answered += 1,
            other => failures.push(format!("{other:?}")),
        }
    }
    drop(holder);
    assert_eq!(
        answered, 10,
        "/healthz answered {answered} of 10: {failures:?}"
    );
    signal(d.child.id(), "TERM");
    let (_, _, log) = d.finish_logged();
    assert!(log.contains("metrics on"), "{log}");
}
