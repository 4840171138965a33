//! The event socket: real daemons, real Unix sockets, hostile
//! clients.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use memtrack::model::Document;

use crate::common::*;

/// A daemon running `sleep SECS` with its socket at `socket`.
fn daemon(out: &Path, socket: &Path, interval: &str, secs: u32) -> Child {
    let child = memtrack()
        .args(["run", "--interval", interval, "--name", "ev", "--output"])
        .arg(out)
        .arg("--socket")
        .arg(socket)
        .args(["--", "sleep", &secs.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the socket", Duration::from_secs(10), || {
        UnixStream::connect(socket).is_ok()
    });
    child
}

fn finish(mut child: Child, out: &Path) -> Document {
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    read_document(&out.join("ev/memory_usage.json"))
}

fn call(stream: &mut UnixStream, line: &str) -> serde_json::Value {
    stream.write_all(line.as_bytes()).unwrap();
    stream.write_all(b"\n").unwrap();
    let mut reply = String::new();
    BufReader::new(stream.try_clone().unwrap())
        .read_line(&mut reply)
        .unwrap();
    serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{reply:?}: {e}"))
}

#[test]
fn the_socket_is_private_and_owned_by_one_daemon() {
    let dir = scratch();
    let sock = dir.path().join("m.sock");
    let first = daemon(&dir.path().join("a"), &sock, "100ms", 3);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let out = run_to_end(
        memtrack()
            .args(["run", "--output"])
            .arg(dir.path().join("b"))
            .arg("--socket")
            .arg(&sock)
            .args(["--", "true"]),
        Duration::from_secs(10),
    );
    // The second run never takes the first one's socket: it warns and
    // uses a free path of its own (the job is told which), and its job
    // runs.
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert!(
        log.contains("in use by a running memtrack") && log.contains("instead"),
        "{log}"
    );
    assert!(sock.exists(), "the first run keeps its socket");
    finish(first, &dir.path().join("a"));
    assert!(!sock.exists(), "removed at exit");

    // A stale socket (its owner died without removing it) is replaced.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let out = run_to_end(
        memtrack()
            .args(["run", "--output"])
            .arg(dir.path().join("c"))
            .arg("--socket")
            .arg(&sock)
            .args(["--", "true"]),
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // A file that is not a socket is never replaced.
    std::fs::write(&sock, "precious").unwrap();
    let out = run_to_end(
        memtrack()
            .args(["run", "--output"])
            .arg(dir.path().join("d"))
            .arg("--socket")
            .arg(&sock)
            .args(["--", "true"]),
        Duration::from_secs(10),
    );
    let log = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert!(
        log.contains("not a socket") && log.contains("instead"),
        "{log}"
    );
    assert_eq!(std::fs::read_to_string(&sock).unwrap(), "precious");
}

#[test]
fn hostile_clients_never_stop_sampling() {
    let dir = scratch();
    let sock = dir.path().join("m.sock");
    let interval = 0.25;
    let child = daemon(dir.path(), &sock, "250ms", 8);

    // Malformed JSON, NUL bytes, invalid UTF-8: an error reply each.
    let mut c = UnixStream::connect(&sock).unwrap();
    let mut lines: Vec<Vec<u8>> = vec![
        b"not json".to_vec(),
        b"{\"component\":".to_vec(),
        b"[1,2,3]".to_vec(),
    ];
    lines.push(b"{\"component\":\"a\0b\",\"operation\":\"x\"}".to_vec());
    lines.push(b"{\"component\":\"\xff\xfe\",\"operation\":\"x\"}".to_vec());
    lines.push(b"\0\0\0\0".to_vec());
    for line in &lines {
        c.write_all(line).unwrap();
        c.write_all(b"\n").unwrap();
    }
    let mut r = BufReader::new(c.try_clone().unwrap());
    for line in &lines {
        let mut reply = String::new();
        r.read_line(&mut reply).unwrap();
        let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(
            v["ok"],
            false,
            "{:?} -> {reply}",
            String::from_utf8_lossy(line)
        );
    }
    // The connection survives bad lines: a good one still works.
    assert_eq!(
        call(
            &mut c,
            r#"{"component":"probe","operation":"after_garbage","ack":true}"#
        )["ok"],
        true
    );

    // A 1 MiB line: too_long, then the connection is closed.
    let mut big = UnixStream::connect(&sock).unwrap();
    big.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = big.write_all(&vec![b'x'; 1 << 20]);
    let mut reply = String::new();
    BufReader::new(big.try_clone().unwrap())
        .read_line(&mut reply)
        .unwrap();
    assert!(reply.contains("too_long"), "{reply}");

    // 1000 idle connections.
    let idle: Vec<UnixStream> = (0..1000)
        .map(|_| UnixStream::connect(&sock).unwrap())
        .collect();

    // A client that sends acks and never reads its replies.
    let mut deaf = UnixStream::connect(&sock).unwrap();
    deaf.set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let ack = b"{\"component\":\"deaf\",\"operation\":\"x\",\"ack\":true}\n".repeat(100);
    for _ in 0..50 {
        if deaf.write_all(&ack).is_err() {
            break;
        }
    }

    // Through all that, a well-behaved client is answered.
    let mut good = UnixStream::connect(&sock).unwrap();
    good.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let v = call(
        &mut good,
        r#"{"component":"probe","operation":"during_attack","ack":true}"#,
    );
    assert_eq!(v["ok"], true, "{v}");
    drop(idle);

    let doc = finish(child, dir.path());
    // A sampler the flood held up would stop for seconds.
    assert_sampling_went_on(&doc, 8.0 * interval);
    // Every bad line, plus the 1 MiB one.
    assert!(
        doc.counters.protocol_errors > lines.len() as u64,
        "{:?}",
        doc.counters
    );
    assert!(
        doc.counters.slow_clients >= 1,
        "the deaf client was counted: {:?}",
        doc.counters
    );
    assert!(doc
        .detailed_log
        .iter()
        .any(|e| e.operation == "during_attack"));
}

#[test]
fn a_peer_of_another_user_is_refused() {
    let setpriv = std::process::Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok();
    if !can_run(
        "root",
        is_root() && setpriv,
        "needs root and setpriv to run a daemon as another user",
    ) {
        return;
    }
    // The daemon runs as `nobody`; root can still open its 0600 socket
    // (root ignores file modes), so only SO_PEERCRED stands in the way.
    let dir = scratch();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = dir.path().join("m.sock");
    let child = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            env!("CARGO_BIN_EXE_memtrack"),
        ])
        .args(["run", "--interval", "100ms", "--name", "ev", "--output"])
        .arg(dir.path())
        .arg("--socket")
        .arg(&sock)
        .args(["--", "sleep", "2"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the socket", Duration::from_secs(10), || sock.exists());
    let mut c = UnixStream::connect(&sock).unwrap();
    let mut reply = String::new();
    let _ = c.write_all(b"{\"component\":\"root\",\"operation\":\"x\",\"ack\":true}\n");
    BufReader::new(c).read_line(&mut reply).unwrap();
    assert!(reply.contains("\"refused\""), "{reply}");
    let doc = finish(child, dir.path());
    assert_eq!(doc.counters.refused_peers, 1);
    assert!(!doc.detailed_log.iter().any(|e| e.component == "root"));
}

#[test]
fn every_mark_of_four_busy_processes_is_recorded() {
    let dir = scratch();
    let script = r#"
import json, os, socket
pids = []
for w in range(4):
    pid = os.fork()
    if pid == 0:
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.environ["MEMTRACK_SOCKET"])
        for i in range(20000):
            s.sendall(b'{"component":"load","operation":"step","iteration":%d}\n' % i)
        # One acknowledged mark at the end: everything before it is in.
        s.sendall(b'{"component":"load","operation":"done","ack":true}\n')
        s.makefile().readline()
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
"#;
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "100ms", "--output"])
            .arg(dir.path())
            .arg("--")
            .args(python(script)),
        Duration::from_secs(120),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(dir.path());
    let steps: Vec<_> = doc
        .detailed_log
        .iter()
        .filter(|e| e.component == "load" && e.operation == "step")
        .collect();
    assert_eq!(steps.len(), 80_000);
    let mut by_pid = std::collections::BTreeMap::new();
    for e in &steps {
        *by_pid.entry(e.pid.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(by_pid.len(), 4);
    assert!(by_pid.values().all(|&n| n == 20_000), "{by_pid:?}");
    assert_eq!(doc.counters.dropped_events, 0);
    assert_eq!(doc.counters.events, 80_004);
}

#[test]
fn attach_without_pids_follows_processes_that_register() {
    let dir = scratch();
    let sock = dir.path().join("m.sock");
    let mut daemon = memtrack()
        .args(["attach", "--interval", "100ms", "--name", "svc", "--output"])
        .arg(dir.path())
        .arg("--socket")
        .arg(&sock)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the socket", Duration::from_secs(10), || {
        UnixStream::connect(&sock).is_ok()
    });
    let script = r#"
import json, os, socket, time
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["SOCK"]); f = s.makefile("rwb")
def call(m):
    f.write((json.dumps(m) + "\n").encode()); f.flush(); return json.loads(f.readline())
assert call({"component": "embedder", "operation": "loaded", "ack": True})["ok"]
b = bytearray(200 << 20)
for i in range(0, len(b), 4096): b[i] = 1
time.sleep(0.6)
call({"component": "embedder", "operation": "served", "ack": True})
"#;
    let status = std::process::Command::new("python3")
        .args(["-c", script])
        .env("SOCK", &sock)
        .status()
        .unwrap();
    assert!(status.success());
    signal(daemon.id(), "TERM");
    assert!(daemon.wait().unwrap().success());
    let doc = read_document(&dir.path().join("svc/memory_usage.json"));
    assert_eq!(doc.targets.len(), 1, "{:?}", doc.targets);
    assert!(doc.targets[0].root && doc.targets[0].name.starts_with("python"));
    assert!(
        doc.peak_usage.figures.cpu_ram_used_mb >= 200.0,
        "{}",
        doc.peak_usage.figures.cpu_ram_used_mb
    );
}

#[test]
fn mark_without_a_daemon_warns_unless_waiting() {
    let out = run_to_end(
        memtrack().args(["mark", "model", "x", "--socket", "/nonexistent/m.sock"]),
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(0));
    assert!(stderr(&out).contains("mark not sent"), "{}", stderr(&out));
    let out = run_to_end(
        memtrack().args([
            "mark",
            "model",
            "x",
            "--wait",
            "--socket",
            "/nonexistent/m.sock",
        ]),
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("/nonexistent/m.sock"),
        "{}",
        stderr(&out)
    );
    let out = run_to_end(memtrack().args(["status"]), Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("MEMTRACK_SOCKET"), "{}", stderr(&out));
}

#[test]
fn shell_marks_spans_and_status_from_inside_the_job() {
    let dir = scratch();
    let bin = env!("CARGO_BIN_EXE_memtrack");
    let script = format!(
        "{bin} mark data load --wait --iteration 1 --label split=train && {bin} status && {bin} status --json > {dir}/status.json",
        dir = dir.path().display()
    );
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "100ms", "--output"])
            .arg(dir.path().join("runs"))
            .args(["--", "sh", "-c", &script]),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("recorded data/load"), "{text}");
    assert!(text.contains("PID") && text.contains("(root)"), "{text}");
    let status: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("status.json")).unwrap())
            .unwrap();
    assert_eq!(status["type"], "status");
    assert!(status["processes"].as_array().unwrap().len() >= 2);
    let (_, doc) = only_document(&dir.path().join("runs"));
    let e = doc
        .detailed_log
        .iter()
        .find(|e| e.component == "data")
        .unwrap();
    assert_eq!(
        (e.iteration, e.labels["split"].as_str()),
        (Some(1), "train")
    );
}

#[test]
fn marks_sent_just_before_the_job_exits_are_recorded() {
    // No final ack: the workers fire and exit, the parent exits right
    // after them. The marks are in the socket buffers when the job ends.
    let dir = scratch();
    let script = r#"
import os, socket
pids = []
for w in range(4):
    pid = os.fork()
    if pid == 0:
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.environ["MEMTRACK_SOCKET"])
        s.sendall(b'{"component":"load","operation":"step"}\n' * 5000)
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
"#;
    for _ in 0..3 {
        let out = run_to_end(
            memtrack()
                .args(["run", "--interval", "100ms", "--output"])
                .arg(dir.path())
                .arg("--")
                .args(python(script)),
            Duration::from_secs(60),
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    }
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let doc = read_document(&entry.unwrap().path().join("memory_usage.json"));
        let steps = doc
            .detailed_log
            .iter()
            .filter(|e| e.operation == "step")
            .count();
        assert_eq!(steps, 20_000);
    }
}

#[test]
fn socket_activation_uses_the_passed_socket_and_hides_it_from_the_job() {
    // systemd-socket-activate (Debian package systemd) binds the socket,
    // waits for the first connection, then starts memtrack with it as fd 3
    // and LISTEN_PID/LISTEN_FDS set, as a memtrack-attach.socket unit would.
    let dir = scratch();
    let sock = dir.path().join("activated.sock");
    let seen = dir.path().join("job-env.txt");
    let job = format!(
        "import os, time\n\
         open({seen:?}, 'w').write(' '.join(sorted(k for k in os.environ if k.startswith('LISTEN_'))) + '|' + os.environ['MEMTRACK_SOCKET'])\n\
         time.sleep(1.5)\n",
        seen = seen.display().to_string()
    );
    let mut activator = Command::new("systemd-socket-activate")
        .arg("-l")
        .arg(&sock)
        .arg(env!("CARGO_BIN_EXE_memtrack"))
        .args(["run", "--interval", "100ms", "--name", "act", "--output"])
        .arg(dir.path())
        .args(["--", "python3", "-c", &job])
        .env_remove("MEMTRACK_SOCKET")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("systemd-socket-activate (Debian package systemd)");
    wait_for("the activation socket", Duration::from_secs(10), || {
        sock.exists()
    });
    // This connection starts memtrack; it is answered once memtrack
    // serves the socket it was handed.
    let mut stream = UnixStream::connect(&sock).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream
        .write_all(b"{\"component\":\"svc\",\"operation\":\"up\",\"ack\":true}\n")
        .unwrap();
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply).unwrap();
    assert!(reply.contains("\"ok\":true"), "{reply}");
    drop(stream);

    wait_for("memtrack to finish", Duration::from_secs(30), || {
        activator.try_wait().unwrap().is_some()
    });
    let status = activator.wait().unwrap();
    let mut err = String::new();
    activator
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status:?}\n{err}");
    let job_env = std::fs::read_to_string(&seen).unwrap();
    assert_eq!(job_env, format!("|{}", sock.display()), "{err}");
    // systemd made the socket and owns it: memtrack leaves it in place.
    assert!(sock.exists());
    let doc = read_document(&dir.path().join("act/memory_usage.json"));
    assert!(
        doc.detailed_log
            .iter()
            .any(|e| e.component == "svc" && e.operation == "up"),
        "the mark sent through the activated socket is missing"
    );
}
