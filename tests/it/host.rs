//! The tree's host figure counts every page once: forked workers that share
//! their parent's pages copy-on-write (PyTorch's DataLoader) must not be
//! counted once per worker. Each job here measures the ground truth itself
//! (Σ Pss from `smaps_rollup` over its processes, at a moment when all of
//! them hold their memory) and writes it down for the test to compare.
//!
//! The cgroup mode needs a memory cgroup memtrack may create: cgroup v1's
//! memory controller, writable (root). Where that is missing the cgroup
//! tests say why and return; the Pss tests run everywhere.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use memtrack::model::{Document, HostSource};

use crate::common::*;

fn real_python() -> &'static str {
    python3()
}

/// Why cgroup mode cannot be tested here, if it cannot.
fn no_cgroup_mode() -> Option<String> {
    cgroup_unavailable()
}

macro_rules! needs_cgroup_mode {
    () => {
        let why = no_cgroup_mode();
        if !can_run(
            "cgroup",
            why.is_none(),
            &format!(
                "cgroup mode needs a writable cgroup v1 memory controller: {}",
                why.unwrap_or_default()
            ),
        ) {
            return;
        }
    };
}

/// A parent holding 500 MiB forks 4 workers that read its memory (sharing
/// it) and each allocate 10 MiB of their own. With all of them alive the
/// job writes Σ Pss of its processes to `truth`; one worker exits early and
/// stays a zombie (unreaped) for the rest of the run.
const FORK_JOB: &str = r#"
import os, sys, time
truth = sys.argv[1]
b = bytearray(500 << 20)
for i in range(0, len(b), 4096): b[i] = 1
def worker(linger):
    c = bytearray(10 << 20)
    for j in range(0, len(c), 4096): c[j] = 1
    s = 0
    for j in range(0, len(b), 1 << 20): s += b[j]
    time.sleep(linger)
    os._exit(0)
pids = []
for i in range(4):
    pid = os.fork()
    if pid == 0: worker(4.0)
    pids.append(pid)
zombie = os.fork()
if zombie == 0:
    time.sleep(0.5)
    os._exit(0)
time.sleep(2.0)
def pss(p):
    for l in open(f'/proc/{p}/smaps_rollup'):
        if l.startswith('Pss:'): return int(l.split()[1]) * 1024
    return 0
tot = sum(pss(p) for p in [os.getpid()] + pids)
open(truth, 'w').write(str(tot))
for p in pids: os.waitpid(p, 0)
time.sleep(1.0)
os.waitpid(zombie, 0)
"#;

/// Starts processes outside the tree fast enough that more PIDs than the
/// probe limit are handed out between ticks, so every tick lists `/proc`
/// (a busy machine). Stopped on drop.
struct Busy(std::process::Child);

impl Busy {
    fn start() -> Busy {
        Busy(
            Command::new("sh")
                .args(["-c", "while :; do /bin/true; done"])
                .spawn()
                .expect("busy loop"),
        )
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_fork_job(extra: &[&str]) -> (Document, f64, String) {
    let out_dir = scratch();
    let truth = out_dir.path().join("truth");
    let _busy = Busy::start();
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "100ms", "--listen", "off", "--output"])
            .arg(out_dir.path().join("runs"))
            .args(extra)
            .arg("--")
            .args([real_python(), "-c", FORK_JOB])
            .arg(&truth),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(&out_dir.path().join("runs"));
    let truth: f64 = std::fs::read_to_string(&truth)
        .expect("the job wrote Σ Pss")
        .parse()
        .expect("a number");
    (doc, truth / MIB, stderr(&out))
}

/// The checks every mode shares: the headline peak and "what a re-run
/// needs" follow Σ Pss, and every process is one row.
fn check_fork_job(doc: &Document, truth_mb: f64) {
    let peak = doc.peak_usage.figures.cpu_ram_used_mb;
    assert!(
        (peak - truth_mb).abs() / truth_mb < 0.10,
        "headline peak {peak:.1} MiB vs Σ Pss {truth_mb:.1} MiB"
    );
    let needs = doc.summary.peak_host_ram_mb;
    assert!(
        (needs - truth_mb).abs() / truth_mb < 0.10,
        "what a re-run needs {needs:.1} MiB vs Σ Pss {truth_mb:.1} MiB"
    );
    let host = doc.host.as_ref().expect("the host source is recorded");
    assert!(
        host.rss_sum_peak_mb > 2.0 * truth_mb,
        "the RSS sum counts the shared 500 MiB once per worker: {:.1} MiB",
        host.rss_sum_peak_mb
    );
    let mut seen = BTreeSet::new();
    for t in &doc.targets {
        assert!(
            seen.insert((t.pid, t.start_time.to_bits())),
            "process {} has more than one row: {:#?}",
            t.pid,
            doc.targets
        );
    }
    // The parent, 4 workers and the zombie.
    assert_eq!(doc.targets.len(), 6, "{:#?}", doc.targets);
}

#[test]
fn fork_pattern_in_cgroup_mode_counts_shared_pages_once() {
    needs_cgroup_mode!();
    let (doc, truth, log) = run_fork_job(&["--host-source", "cgroup"]);
    let host = doc.host.as_ref().expect("host");
    assert_eq!(host.source, HostSource::Cgroup, "{host:?}\n{log}");
    assert!(host.cgroup_created);
    let dir = host.cgroup.as_ref().expect("cgroup path");
    assert!(
        !Path::new(dir).exists(),
        "the cgroup memtrack created is removed at the end: {dir}"
    );
    assert!(host.kernel_peak_mb.is_some() && host.at_peak.is_some());
    check_fork_job(&doc, truth);
}

#[test]
fn fork_pattern_in_pss_mode_counts_shared_pages_once() {
    let (doc, truth, log) = run_fork_job(&["--host-source", "pss"]);
    let host = doc.host.as_ref().expect("host");
    assert_eq!(host.source, HostSource::Pss, "{host:?}\n{log}");
    assert!(host.pss_reads.unwrap_or(0) > 0, "{host:?}");
    assert!(host.pss_age_at_peak_s.is_some(), "{host:?}");
    check_fork_job(&doc, truth);
}

#[test]
fn the_rss_sum_is_labelled_when_asked_for() {
    let out_dir = scratch();
    let out = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--host-source", "rss", "--output"])
            .arg(out_dir.path())
            .args(["--", "true"]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    let host = doc.host.expect("host");
    assert_eq!(host.source, HostSource::Rss);
    assert!(host.reason.contains("once per process"), "{}", host.reason);
}

#[test]
fn a_20ms_spike_shows_through_the_cgroup_peak() {
    needs_cgroup_mode!();
    let out_dir = scratch();
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "1s", "--listen", "off"])
            .args(["--host-source", "cgroup", "--output"])
            .arg(out_dir.path())
            .args(["--", real_python(), "-c", SPIKE_JOB]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    assert_eq!(
        doc.host.as_ref().map(|h| h.source),
        Some(HostSource::Cgroup)
    );
    assert!(
        doc.peak_usage.figures.cpu_ram_hwm_mb >= 400.0,
        "the kernel's peak {:.1} MiB",
        doc.peak_usage.figures.cpu_ram_hwm_mb
    );
    assert!(doc.summary.peak_host_ram_mb >= 400.0);
    let host = doc.host.as_ref().expect("host");
    assert!(
        host.kernel_peak_mb.unwrap_or(0.0) >= 400.0,
        "the cgroup's own peak holds the spike: {host:?}"
    );
    // The spike is placed in time: an entry's interval peak holds it (the
    // job's wait4 peak alone would reach `peak_usage`, not the log).
    assert!(doc
        .detailed_log
        .iter()
        .any(|e| e.figures.cpu_ram_hwm_mb >= 400.0));
}

/// `GET /metrics`, or `None` when it is not answered.
fn scrape(addr: std::net::SocketAddr) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    Some(raw)
}

/// A cgroup made by hand and the processes put in it: on drop (the test
/// failed or ended) they are killed and the cgroup removed.
struct HandMade {
    dir: std::path::PathBuf,
    processes: Vec<std::process::Child>,
}

impl Drop for HandMade {
    fn drop(&mut self) {
        for p in &mut self.processes {
            let _ = p.kill();
            let _ = p.wait();
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn attach_uses_the_jobs_own_cgroup_until_a_stranger_joins_it() {
    needs_cgroup_mode!();
    // A cgroup made by hand, as a container or a SLURM step would be.
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let path = memtrack::sample::cgroup::parse_proc_cgroup(&own)
        .v1_memory
        .unwrap();
    let dir = Path::new("/sys/fs/cgroup/memory")
        .join(path.trim_start_matches('/'))
        .join(format!("it-attach-{}", std::process::id()));
    std::fs::create_dir(&dir).unwrap();
    let procs = dir.join("cgroup.procs");
    let mut hand = HandMade {
        dir,
        processes: Vec::new(),
    };
    let job = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {p}; exec {py} -c 'import time; b = bytearray(200 << 20); [b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; time.sleep(7)'",
            p = procs.display(),
            py = real_python()
        ))
        .spawn()
        .unwrap();
    let job_pid = job.id();
    hand.processes.push(job);
    wait_for("the job in its cgroup", Duration::from_secs(5), || {
        std::fs::read_to_string(&procs).is_ok_and(|t| t.contains(&job_pid.to_string()))
    });
    let out_dir = scratch();
    let mut d = Daemon::attach(
        out_dir.path(),
        &["--interval", "100ms", "--host-source", "cgroup"],
        job_pid,
    );
    // The one source memtrack uses now, as `/metrics` says.
    let mut source = |s: &str| {
        if let Some(status) = d.child.try_wait().unwrap() {
            panic!(
                "memtrack ended ({status}) still waiting for `{s}`:\n{}",
                d.stderr()
            );
        }
        // Not answered (memtrack is ending): asked again, or the check
        // above says it ended.
        scrape(d.http).is_some_and(|body| {
            body.lines().any(|l| {
                l.starts_with("memtrack_tree_memory_source{")
                    && l.contains(&format!("source=\"{s}\""))
            })
        })
    };
    // The stranger joins once memtrack samples the cgroup's charge, and
    // stays until memtrack has seen it.
    wait_for(
        "sampling from the job's cgroup",
        Duration::from_secs(10),
        || source("cgroup"),
    );
    hand.processes.push(
        Command::new("sh")
            .arg("-c")
            .arg(format!("echo $$ > {}; exec sleep 60", procs.display()))
            .spawn()
            .unwrap(),
    );
    wait_for(
        "memtrack to leave the shared cgroup",
        Duration::from_secs(20),
        || source("pss"),
    );
    let mut stranger = hand.processes.pop().unwrap();
    let _ = stranger.kill();
    let _ = stranger.wait();
    let (code, doc, log) = d.finish_logged();
    assert_eq!(code, Some(0), "{log}");
    let host = doc.host.expect("host");
    assert_eq!(host.source, HostSource::Pss, "{host:#?}");
    assert!(host.reason.contains("other process"), "{}", host.reason);
    assert_eq!(host.earlier.len(), 1, "{host:#?}");
    assert_eq!(host.earlier[0].source, HostSource::Cgroup);
    assert!(doc.peak_usage.figures.cpu_ram_used_mb >= 200.0);
}

#[test]
fn processes_beyond_the_descriptor_limit_are_still_followed() {
    // 300 sleeping children under a limit of 128 descriptors: memtrack
    // keeps one open per process while it can, then reads by path.
    let out_dir = scratch();
    let script = format!(
        "ulimit -n 128; exec {} run --interval 200ms --listen off --host-source rss --output {} -- {} -c '{}'",
        env!("CARGO_BIN_EXE_memtrack"),
        out_dir.path().display(),
        real_python(),
        "import os, time\npids = []\nfor i in range(300):\n    p = os.fork()\n    if p == 0:\n        time.sleep(3); os._exit(0)\n    pids.append(p)\nfor p in pids: os.waitpid(p, 0)\n"
    );
    let out = run_to_end(
        Command::new("sh").args(["-c", &script]),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    assert_eq!(doc.targets.len(), 301, "every child is followed");
    assert!(
        doc.counters.fd_fallbacks > 0,
        "descriptor exhaustion is counted: {:?}",
        doc.counters
    );
}

#[test]
fn the_jobs_peak_is_not_memtracks_own() {
    // The spawned job starts as a copy of memtrack; its wait4 peak carries
    // memtrack's own high-water mark until it is above it.
    let out_dir = scratch();
    let out = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--output"])
            .arg(out_dir.path())
            .args(["--", "sleep", "0.3"]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(out_dir.path());
    let root = doc.targets.iter().find(|t| t.root).expect("the job");
    assert!(
        root.hwm_mb < 6.0,
        "`sleep` peaks at about 2 MiB, not memtrack's size: {:.1} MiB",
        root.hwm_mb
    );
}

#[test]
fn a_cgroup_left_by_a_killed_memtrack_is_removed_by_the_next() {
    needs_cgroup_mode!();
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let path = memtrack::sample::cgroup::parse_proc_cgroup(&own)
        .v1_memory
        .unwrap();
    let parent = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
    // An owner that is surely gone: a child we reaped.
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let stale = parent.join(format!("memtrack-{dead_pid}-killedrun"));
    std::fs::create_dir(&stale).unwrap();
    // The job had made a cgroup of its own inside: removal goes children
    // first.
    std::fs::create_dir(stale.join("job-child")).unwrap();
    let out_dir = scratch();
    let out = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--output"])
            .arg(out_dir.path())
            .args(["--", "true"]),
        Duration::from_secs(30),
    );
    let left = stale.exists();
    let _ = std::fs::remove_dir(stale.join("job-child"));
    let _ = std::fs::remove_dir(&stale);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!left, "the stale cgroup {} is removed", stale.display());
}
