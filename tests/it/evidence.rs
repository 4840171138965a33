//! What reached memtrack is kept, and what could not be kept is counted:
//! acknowledged marks from a client that hung up without reading its
//! replies, `recover` after a full disk, a damaged journal or a kill before
//! the first checkpoint, and `merge` bounded in what it writes and leaves
//! behind. Each test provokes the fault for real against the memtrack
//! binary.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

/// A job that connects to memtrack's socket, sends `N` `ack` marks
/// (component `acked`, iterations 0…N-1) in one write and closes the
/// socket without reading a reply. With FIFOs `GO` and `DONE` (else `-`),
/// it first writes the file `GO.ready` and waits for a line on `GO`, and
/// once it has sent, writes `sent` to `DONE`.
const ACK_AND_HANG_UP: &str = r#"
import json, os, socket, sys
n, go, done = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if go != "-":
    with open(go + ".ready", "w") as r:
        r.write("ready")
    open(go).read()
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["MEMTRACK_SOCKET"])
s.sendall(b"".join((json.dumps({"type": "mark", "component": "acked", "operation": "x",
                                "iteration": i, "ack": True}) + "\n").encode() for i in range(n)))
s.close()
if done != "-":
    with open(done, "w") as f:
        f.write("sent")
"#;

fn acked(doc: &memtrack::model::Document) -> usize {
    doc.detailed_log
        .iter()
        .filter(|e| e.component == "acked")
        .filter_map(|e| e.iteration)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

fn ack_job(n: usize, go: &str, done: &str) -> Vec<String> {
    let mut argv = python(ACK_AND_HANG_UP);
    argv.extend([n.to_string(), go.into(), done.into()]);
    argv
}

/// What once broke: a client that sent 2,000 `ack` marks and closed its
/// socket before reading the replies had 121 of them recorded: the first
/// reply that could not be written dropped the connection and every line
/// still buffered.
#[test]
fn acknowledged_marks_of_a_client_that_hung_up_are_all_recorded() {
    let out = scratch();
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--name", "d", "--output"])
            .arg(out.path())
            .arg("--")
            .args(ack_job(2000, "-", "-")),
        Duration::from_secs(120),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let doc = read_document(&out.path().join("d/memory_usage.json"));
    assert_eq!(acked(&doc), 2000, "{log}");
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo")
        .success();
    assert!(ok);
}

/// What once broke: 50 `ack` marks sent while memtrack was stopped
/// (SIGSTOP), then the client exited: 2 recorded, in 3 of 3 tries.
#[test]
fn acknowledged_marks_sent_while_memtrack_was_stopped_are_all_recorded() {
    let out = scratch();
    let go = out.path().join("go");
    let done = out.path().join("done");
    mkfifo(&go);
    mkfifo(&done);
    let d = Daemon::start(
        out.path(),
        &[],
        &ack_job(50, go.to_str().unwrap(), done.to_str().unwrap()),
        &[],
    );
    let pid = d.child.id();
    // The job is running (memtrack spawns it after its start line).
    wait_for("the job to start", Duration::from_secs(60), || {
        out.path().join("go.ready").exists()
    });
    signal(pid, "STOP");
    std::fs::write(&go, "go\n").unwrap();
    // The job has sent everything and hung up (memtrack still stopped).
    let said = std::fs::read_to_string(&done).unwrap();
    assert_eq!(said, "sent");
    signal(pid, "CONT");
    let (code, doc, log) = d.finish_logged();
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(acked(&doc), 50, "{log}");
}

/// A job sending `N` acknowledged marks of ~250 bytes (component `acked`,
/// iterations 0…N-1), each waiting for its reply; before the last one it
/// writes the time to `WHEN`, then it waits for a line on the FIFO `GO`
/// (`-`: it ends at once).
const ACKED_MARKS: &str = r#"
import json, os, socket, sys, time
n, when, go = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["MEMTRACK_SOCKET"])
f = s.makefile("rwb")
for i in range(n):
    if i == n - 1:
        with open(when, "w") as w:
            w.write(repr(time.time()))
    f.write((json.dumps({"type": "mark", "component": "acked", "operation": "batch",
                         "iteration": i, "labels": {"pad": "x" * 200}, "ack": True}) + "\n").encode())
    f.flush()
    assert json.loads(f.readline())["ok"]
if go != "-":
    with open(go + ".ready", "w") as r:
        r.write("ready")
    open(go).read()
"#;

fn acked_marks_job(n: usize, when: &Path, go: &str) -> Vec<String> {
    let mut argv = python(ACKED_MARKS);
    argv.extend([n.to_string(), when.display().to_string(), go.into()]);
    argv
}

fn time_in(path: &Path) -> f64 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Overwrites the first `lines` lines of `path` with `#` (their newlines
/// kept): records damaged in place, as a bad disk block leaves them.
fn damage_lines(path: &Path, lines: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    let mut seen = 0;
    for b in bytes.iter_mut() {
        if *b == b'\n' {
            seen += 1;
            if seen == lines {
                break;
            }
        } else {
            *b = b'#';
        }
    }
    assert_eq!(seen, lines, "the journal has fewer lines than that");
    std::fs::write(path, bytes).unwrap();
}

fn recover(dir: &Path) -> std::process::Output {
    run_to_end(memtrack().arg("recover").arg(dir), Duration::from_secs(120))
}

/// `memtrack run` of [`ACKED_MARKS`] killed with SIGKILL once its job has
/// had every mark acknowledged (before the first checkpoint): the run
/// directory.
fn killed_after_marks(out: &Path, n: usize) -> std::path::PathBuf {
    let go = out.join("go");
    mkfifo(&go);
    let when = out.join("when");
    let d = Daemon::start(
        out,
        &[],
        &acked_marks_job(n, &when, go.to_str().unwrap()),
        &[],
    );
    wait_for("the job's marks", Duration::from_secs(120), || {
        out.join("go.ready").exists()
    });
    signal(d.child.id(), "KILL");
    let mut child = d.child;
    let _ = child.wait();
    // The job (memtrack's child, now orphaned) ends.
    let _ = std::fs::write(&go, "go\n");
    out.join("d")
}

/// What once broke: a run killed before its first checkpoint whose journal
/// was then damaged recovered 0 of 2,134 marks, and `recover` deleted
/// `.memtrack` with the intact `entries.jsonl` that held them. Here the
/// journal's first 1,500 lines are damaged: the marks they held are still
/// in `entries.jsonl`, the rest in the journal.
#[test]
fn recover_uses_the_entries_file_when_the_journal_is_damaged_and_deletes_nothing() {
    let out = scratch();
    let run = killed_after_marks(out.path(), 2000);
    let memtrack_dir = run.join(".memtrack");
    assert!(memtrack_dir.join("state.json").is_file());
    damage_lines(&memtrack_dir.join("journal.jsonl"), 1500);
    let res = recover(&run);
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let doc = read_document(&run.join("memory_usage.json"));
    assert_eq!(doc.run.status, "recovered");
    eprintln!(
        "figures: {} of 2000 marks recovered; records_lost {}",
        acked(&doc),
        doc.counters.records_lost
    );
    assert_eq!(acked(&doc), 2000, "every acknowledged mark: {log}");
    assert!(
        doc.counters.records_lost > 0,
        "the damaged records are counted: {:?}",
        doc.counters
    );
    // Evidence is never deleted: the files are kept, and not recovered twice.
    let kept = run.join(".memtrack.recovered");
    assert!(kept.join("entries.jsonl").is_file(), "{log}");
    assert!(kept.join("journal.jsonl").is_file(), "{log}");
    assert!(!memtrack_dir.exists());
    assert!(log.contains(".memtrack.recovered"), "{log}");
}

/// The same with the journal gone (emptied): what `entries.jsonl` holds
/// comes back, and the marks no file holds are counted, so that recovered
/// and lost add up to every acknowledged mark.
#[test]
fn recover_counts_the_marks_no_file_holds() {
    let out = scratch();
    let run = killed_after_marks(out.path(), 2000);
    std::fs::write(run.join(".memtrack/journal.jsonl"), b"").unwrap();
    let res = recover(&run);
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let doc = read_document(&run.join("memory_usage.json"));
    let got = acked(&doc) as u64;
    eprintln!(
        "figures: {got} of 2000 marks recovered, entries_lost {}, records_lost {}",
        doc.counters.entries_lost, doc.counters.records_lost
    );
    assert!(got > 0, "the entries file's marks: {log}");
    assert_eq!(
        got + doc.counters.entries_lost,
        2000,
        "recovered {got}, counted lost {}: {log}",
        doc.counters.entries_lost
    );
    assert!(doc.counters.records_lost > 0, "{:?}", doc.counters);
    assert!(run.join(".memtrack.recovered/entries.jsonl").is_file());
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

/// A tmpfs of `size` mounted at a folder, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        sh(&format!(
            "mount -t tmpfs -o size={size} tmpfs {}",
            at.display()
        ));
        Tmpfs(at.to_path_buf())
    }

    /// Fills it to its last byte.
    fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.0.join("filler")).unwrap();
        let block = vec![0u8; 4096];
        while f.write_all(&block).is_ok() {}
        let _ = f.write_all(&[0u8]);
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// What once broke: with every disk full, `recover` rebuilt 620 (then 831)
/// of 3,000 acknowledged marks and wrote `journal_errors: 0`, no
/// `entries_lost`, and a duration of 1.1 s for a run of about 5 s. Every
/// disk is full here: the run directory's, `TMPDIR`'s and `/var/tmp` (in a
/// mount namespace of its own).
#[test]
fn recovery_after_a_full_disk_counts_what_it_could_not_recover() {
    if !can_run("root", is_root(), "a tmpfs and a mount namespace need root") {
        return;
    }
    let top = scratch();
    let disk = Tmpfs::mount(&top.path().join("full"), "512k");
    let tmp = disk.0.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let var_tmp = Tmpfs::mount(&top.path().join("var-tmp"), "64k");
    var_tmp.fill();
    let when = top.path().join("when");
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$1" /var/tmp && shift && exec "$@""#)
        .arg("sh")
        .arg(&var_tmp.0)
        .arg(env!("CARGO_BIN_EXE_memtrack"))
        .args(["run", "--listen", "off", "--name", "run", "--output"])
        .arg(&disk.0)
        .arg("--")
        .args(acked_marks_job(3000, &when, "-"))
        .env("TMPDIR", &tmp)
        .env("HOME", &tmp)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    let res = run_to_end(&mut cmd, Duration::from_secs(180));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "the job's status: {log}");
    assert!(log.contains("could not be written anywhere"), "{log}");
    let run = disk.0.join("run");
    sh(&format!("mount -o remount,size=64m {}", disk.0.display()));
    let again = recover(&run);
    let rlog = stderr(&again);
    assert_eq!(again.status.code(), Some(0), "{rlog}");
    let doc = read_document(&run.join("memory_usage.json"));
    let got = acked(&doc) as u64;
    let c = &doc.counters;
    eprintln!(
        "figures: {got} of 3000 marks recovered; entries_lost {}, records_lost {}, \
         journal_errors {}; run {:.2} s, the last mark sent {:.2} s after the start",
        c.entries_lost,
        c.records_lost,
        c.journal_errors,
        doc.run.end.unwrap_or(0.0) - doc.run.start,
        time_in(&when) - doc.run.start
    );
    assert!(
        got < 3000,
        "the disk took every mark: the test provokes nothing ({got})"
    );
    // The live run logged experiment_start, the 3,000 marks and
    // experiment_end: each is in the recovered log or counted lost.
    let entries = doc
        .detailed_log
        .iter()
        .filter(|e| e.kind != memtrack::model::EntryKind::Timer)
        .count() as u64;
    assert_eq!(
        entries + c.entries_lost,
        3002,
        "recovered {entries} entries ({got} marks) and counted {} lost: {rlog}",
        c.entries_lost
    );
    assert!(c.journal_errors > 0, "{c:?}");
    assert!(c.records_lost > 0, "{c:?}");
    // The run lasted at least until the job sent its last mark.
    let last_sent = time_in(&when);
    let end = doc.run.end.expect("an end");
    assert!(
        end >= last_sent,
        "the run ends at {end}, before the last mark was sent at {last_sent}"
    );
    assert!(rlog.contains("counters.records_lost"), "{rlog}");
    assert!(run.join(".memtrack.recovered").is_dir(), "{rlog}");
}

/// Peak RSS (KiB) of `memtrack ARGS…` run under GNU time, and its output.
fn peak_rss_of(args: &[&std::ffi::OsStr], scratch: &Path) -> (u64, std::process::Output) {
    let rss = scratch.join("rss");
    let out = run_to_end(
        Command::new("/usr/bin/time")
            .args(["-f", "%M", "-o"])
            .arg(&rss)
            .arg(env!("CARGO_BIN_EXE_memtrack"))
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null()),
        Duration::from_secs(120),
    );
    let kib = std::fs::read_to_string(&rss)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (kib, out)
}

/// What once broke: `recover` read up to 1 GiB of `state.json` whole
/// (1,057 MiB RSS). A checkpoint is bounded far below that: one over
/// 256 MiB is refused before it is read, and nothing is changed.
#[test]
fn recover_reads_no_oversized_state() {
    let out = scratch();
    let run = out.path().join("run");
    let dir = run.join(".memtrack");
    std::fs::create_dir_all(&dir).unwrap();
    sh(&format!("chmod 700 {0} {1}", run.display(), dir.display()));
    let state = dir.join("state.json");
    let f = std::fs::File::create(&state).unwrap();
    f.set_len(1000 << 20).unwrap();
    drop(f);
    let (kib, res) = peak_rss_of(&["recover".as_ref(), run.as_os_str()], out.path());
    let log = stderr(&res);
    eprintln!("figures: recover's peak RSS {kib} KiB");
    assert_eq!(res.status.code(), Some(1), "{log}");
    assert!(log.contains("larger than 268435456 bytes"), "{log}");
    assert!(kib < 100 << 10, "recover's peak RSS {kib} KiB");
    assert_eq!(std::fs::metadata(&state).unwrap().len(), 1000 << 20);
}

/// A checkpoint a later memtrack wrote (a later version: here the state of
/// a killed run with its version raised) is refused by its version, never
/// read as this memtrack's own, and nothing in the run is changed.
#[test]
fn recover_refuses_a_checkpoint_of_a_later_version() {
    let out = scratch();
    let run = killed_after_marks(out.path(), 10);
    let dot = run.join(".memtrack");
    let state = dot.join("state.json");
    let mut later: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    later["v"] = 99.into();
    let bytes = serde_json::to_vec(&later).unwrap();
    std::fs::write(&state, &bytes).unwrap();
    let journal = std::fs::read(dot.join("journal.jsonl")).unwrap();
    let res = recover(&run);
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(1), "{log}");
    assert!(
        log.contains("a checkpoint of version 99, later than this memtrack reads"),
        "{log}"
    );
    assert!(!run.join("memory_usage.json").exists(), "{log}");
    assert_eq!(std::fs::read(&state).unwrap(), bytes, "the state is kept");
    assert_eq!(std::fs::read(dot.join("journal.jsonl")).unwrap(), journal);
}

/// Writes a rank's `memory_usage.json` in `dir` as a run with a thinned
/// log leaves it: a small document whose complete event log of `n`
/// entries lies beside it, gzip'd (`memory_usage.events.jsonl.gz`);
/// `wide`: entries with 16 long labels.
const RANK: &str = r#"
import gzip, json, os, sys
d, n, rank, wide = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "wide"
# 16 labels of 120 to 180 bytes (about 3 KB an entry in the merged file), or one.
labels = ({"l%d" % k: ("v%d" % k) * 60 for k in range(16)} if wide else {"batch": "x" * 100})
os.makedirs(d, exist_ok=True)
t0 = 1795000000.0
timer = {"component": "system", "operation": "timer", "timestamp": t0, "kind": "timer",
         "cpu_ram_used_mb": 100.0}
event = {"component": "model", "operation": "step", "timestamp": t0 + 1, "kind": "event",
         "cpu_ram_used_mb": 120.0, "samples": n}
doc = {"schema": 1, "run": {"id": "r" + rank, "name": "job", "host": "node" + rank,
       "labels": {"rank": rank}, "start": t0, "end": t0 + n / 1000.0 + 2, "status": "finished"},
       "detailed_log": [timer, event], "peak_usage": {"cpu_ram_used_mb": 120.0}}
with open(os.path.join(d, "memory_usage.json"), "w") as f:
    json.dump(doc, f)
with gzip.open(os.path.join(d, "memory_usage.events.jsonl.gz"), "wb", compresslevel=1) as g:
    chunk = []
    for i in range(n):
        chunk.append(json.dumps({"component": "model", "operation": "step",
                                 "timestamp": t0 + 1 + i / 1000.0, "kind": "event",
                                 "cpu_ram_used_mb": 120.0, "iteration": i,
                                 "labels": labels}))
        if len(chunk) == 10000:
            g.write(("\n".join(chunk) + "\n").encode())
            chunk = []
    if chunk:
        g.write(("\n".join(chunk) + "\n").encode())
"#;

fn rank_file(dir: &Path, n: usize, rank: u32, wide: bool) -> std::path::PathBuf {
    let ok = Command::new(python3())
        .args(["-c", RANK])
        .arg(dir)
        .arg(n.to_string())
        .arg(rank.to_string())
        .arg(if wide { "wide" } else { "narrow" })
        .status()
        .expect("python3")
        .success();
    assert!(ok, "writing the rank's files");
    dir.join("memory_usage.json")
}

fn merge_folders(tmp: &Path) -> Vec<String> {
    std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("memtrack-merge-"))
        .collect()
}

/// What once broke: a `merge` killed by SIGTERM left 870 MB in its
/// temporary folder. The folder goes with the signal; one left by a merge
/// killed with SIGKILL (no handler runs) is swept by the next merge, and
/// one a running merge holds is not.
#[test]
fn a_merge_ended_by_a_signal_leaves_no_temporary_folder() {
    let top = scratch();
    let tmp = top.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let a = rank_file(&top.path().join("a"), 300_000, 0, false);
    let b = rank_file(&top.path().join("b"), 300_000, 1, false);
    let merged = top.path().join("job/memory_usage.json");
    let merge = |tmp: &Path| {
        memtrack()
            .arg("merge")
            .arg(&a)
            .arg(&b)
            .arg("--output")
            .arg(&merged)
            .env("TMPDIR", tmp)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("memtrack merge")
    };
    let mut child = merge(&tmp);
    wait_for("merge's temporary folder", Duration::from_secs(120), || {
        !merge_folders(&tmp).is_empty()
    });
    signal(child.id(), "TERM");
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the merge ended by the signal: {status:?}"
    );
    assert_eq!(merge_folders(&tmp), Vec::<String>::new(), "left behind");
    assert!(
        !merged.exists(),
        "no merged file from a merge that did not finish"
    );
    let job: Vec<_> = std::fs::read_dir(top.path().join("job"))
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(job.is_empty(), "nothing half-written: {job:?}");

    // A folder left by a merge killed with SIGKILL, and one a live merge
    // holds (its lock taken here).
    let mut child = merge(&tmp);
    wait_for("merge's temporary folder", Duration::from_secs(120), || {
        !merge_folders(&tmp).is_empty()
    });
    signal(child.id(), "KILL");
    let _ = child.wait();
    let stale = merge_folders(&tmp);
    assert_eq!(stale.len(), 1, "{stale:?}");
    let held = tmp.join("memtrack-merge-00000000000000aa");
    std::fs::create_dir(&held).unwrap();
    let lock = std::fs::File::create(held.join("lock")).unwrap();
    lock.lock().unwrap();
    let child = merge(&tmp);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        merge_folders(&tmp),
        vec!["memtrack-merge-00000000000000aa".to_string()],
        "the dead merge's folder is swept, the live one's kept"
    );
    drop(lock);
}

/// What once broke: a 25 KB document and its 22 MB gzip'd event log gave a
/// 4.89 GB merged file, which `report` then refused (it reads documents
/// up to 1 GiB). Here two ranks whose merged document would be about
/// 1.2 GB: refused, nothing written, the previous file left as it was.
#[test]
fn a_merge_larger_than_report_reads_writes_nothing() {
    let top = scratch();
    let tmp = top.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let a = rank_file(&top.path().join("a"), 200_000, 0, true);
    let b = rank_file(&top.path().join("b"), 200_000, 1, true);
    let job = top.path().join("job");
    std::fs::create_dir(&job).unwrap();
    let merged = job.join("memory_usage.json");
    std::fs::write(&merged, "previous").unwrap();
    let res = run_to_end(
        memtrack()
            .arg("merge")
            .arg(&a)
            .arg(&b)
            .arg("--output")
            .arg(&merged)
            .env("TMPDIR", &tmp),
        Duration::from_secs(900),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(1), "{log}");
    assert!(
        log.contains("would be larger than 1024 MiB"),
        "a clear error: {log}"
    );
    assert_eq!(std::fs::read_to_string(&merged).unwrap(), "previous");
    let left: Vec<_> = std::fs::read_dir(&job)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "nothing half-written: {left:?}");
    assert_eq!(merge_folders(&tmp), Vec::<String>::new());
}
