//! The headline is the tree's distinct physical pages. Each job here counts
//! them itself — the page frame numbers of every page any of its processes
//! maps, read from `/proc/PID/pagemap` by stdlib Python — at moments when
//! it holds still, and writes `start end bytes` lines; every timer sample
//! memtrack took inside such a window must be within 5 % of that count.
//!
//! Reading page frame numbers needs root (CI runs as root); elsewhere the
//! tests fail unless `MEMTRACK_ALLOW_SKIP` says why they may not run.

use std::path::Path;
use std::time::Duration;

use memtrack::model::{Document, EntryKind, HostSource};

use crate::common::*;

/// Stdlib Python shared by the jobs: `truth(pids)` counts distinct PFNs;
/// `steady(pids, hold)` counts, holds, counts again and writes a window
/// when both counts agree within 3 % (counting itself allocates).
pub(crate) const PRELUDE: &str = include_str!("jobs/prelude.py");

/// A parent holding 300 MiB forks 4 workers that each write 20 MiB of
/// their own and read the parent's; then they exit and the parent holds.
pub(crate) const FORK: &str = r#"
b = bytearray(300 << 20); touch(b)
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        c = bytearray(20 << 20); touch(c)
        s = sum(b[j] for j in range(0, len(b), 1 << 20))
        hold_then_exit(8)
    kids.append(pid)
time.sleep(1.0)
steady([os.getpid()] + kids)
for k in kids: os.waitpid(k, 0)
time.sleep(0.5)
steady([os.getpid()])
"#;

/// A parent holding 400 MiB forks 4 workers that each write one byte in
/// every page of their quarter of it: 400 MiB of copies on write, which
/// change no worker's resident or anonymous figure (the DataLoader
/// workers' "copy-on-read" growth, made quick).
const COPY_ON_WRITE: &str = r#"
b = bytearray(400 << 20); touch(b)
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        q = len(b) // 4
        for j in range(i * q, (i + 1) * q, PAGE): b[j] = 2
        hold_then_exit(9)
    kids.append(pid)
time.sleep(2.0)
steady([os.getpid()] + kids)
for k in kids: os.waitpid(k, 0)
time.sleep(0.5)
steady([os.getpid()])
"#;

/// Workers exec'd afresh (multiprocessing's spawn), each with 40 MiB.
const SPAWN: &str = r#"
import subprocess
code = 'import time\nb = bytearray(40 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(9)\n'
kids = [subprocess.Popen([sys.executable, '-c', code]) for _ in range(3)]
b = bytearray(100 << 20); touch(b)
time.sleep(2.0)
steady([os.getpid()] + [k.pid for k in kids])
for k in kids: k.wait()
"#;

/// A 200 MiB `/dev/shm` file written by the parent, then mapped and read
/// by 3 forked workers (a shared tensor's pattern).
pub(crate) const SHM: &str = r#"
path = f'/dev/shm/memtrack-truth-{os.getpid()}'
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 200 << 20)
m = mmap.mmap(fd, 200 << 20); touch(m)
kids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        m2 = mmap.mmap(fd, 200 << 20, prot=mmap.PROT_READ)
        s = sum(m2[j] for j in range(0, len(m2), PAGE))
        hold_then_exit(7)
    kids.append(pid)
time.sleep(2.0)
steady([os.getpid()] + kids)
for k in kids: os.waitpid(k, 0)
os.unlink(path)
"#;

/// A 200 MiB file, read into the page cache before the job maps it (like
/// a library another process loaded first), mapped by the parent and 2
/// spawned workers.
const LIBRARY: &str = r#"
import subprocess
path = sys.argv[2]
m = mmap.mmap(os.open(path, os.O_RDONLY), 0, prot=mmap.PROT_READ)
s = sum(m[j] for j in range(0, len(m), PAGE))
code = ('import mmap, os, sys, time\nm = mmap.mmap(os.open(sys.argv[1], os.O_RDONLY), 0, prot=mmap.PROT_READ)\n'
        's = sum(m[j] for j in range(0, len(m), 4096))\ntime.sleep(8)\n')
kids = [subprocess.Popen([sys.executable, '-c', code, path]) for _ in range(2)]
time.sleep(2.5)
steady([os.getpid()] + [k.pid for k in kids])
for k in kids: k.wait()
"#;

/// Each epoch forks 4 workers that copy part of the parent's data and
/// exit (non-persistent DataLoader workers).
pub(crate) const RESTART: &str = r#"
b = bytearray(200 << 20); touch(b)
for epoch in range(4):
    kids = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            c = bytearray(15 << 20); touch(c)
            hold_then_exit(3.5)
        kids.append(pid)
    time.sleep(0.6)
    steady([os.getpid()] + kids, hold=1.5)
    for k in kids: os.waitpid(k, 0)
    time.sleep(0.3)
"#;

fn root_or_explained() -> bool {
    can_run(
        "root",
        memtrack::sys::euid() == 0,
        "these tests read page frame numbers and need root",
    )
}

/// One job at a time: each counts every page of its processes in Python,
/// which takes a core; two at once on a 2-core machine would starve the
/// budgeted passes they are compared with.
pub(crate) static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `job` under memtrack; returns the document and the job's windows.
fn run_job(job: &str, extra_args: &[&str], job_args: &[&Path]) -> (Document, Vec<(f64, f64, f64)>) {
    // At the default budget, as a user runs it: the debug build's slower
    // page loop is no reason to give it more.
    run_job_within(job, None, extra_args, job_args)
}

/// [`run_job`] with the page reads' budget (`host.pss_budget`) given
/// (`None`: the default).
fn run_job_within(
    job: &str,
    budget: Option<&str>,
    extra_args: &[&str],
    job_args: &[&Path],
) -> (Document, Vec<(f64, f64, f64)>) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out_dir = scratch();
    let windows = out_dir.path().join("windows");
    let script = format!("{PRELUDE}\n{job}");
    let mut command = memtrack();
    if let Some(budget) = budget {
        command.env("MEMTRACK_HOST_PSS_BUDGET", budget);
    }
    let out = run_to_end(
        command
            .args(["run", "--interval", "100ms", "--listen", "off", "--output"])
            .arg(out_dir.path().join("runs"))
            .args(extra_args)
            .arg("--")
            .args([python3(), "-c", &script])
            .arg(&windows)
            .args(job_args),
        Duration::from_secs(120),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(&out_dir.path().join("runs"));
    let w = steady_windows(&windows, &out);
    (doc, w)
}

/// Every timer sample inside a window is within 5 % of the job's count.
pub(crate) fn check_windows(doc: &Document, windows: &[(f64, f64, f64)], what: &str) {
    for &(t0, t1, truth) in windows {
        let inside: Vec<f64> = doc
            .detailed_log
            .iter()
            .filter(|e| e.kind == EntryKind::Timer && e.timestamp >= t0 && e.timestamp <= t1)
            .map(|e| e.figures.cpu_ram_used_mb)
            .collect();
        assert!(!inside.is_empty(), "{what}: no sample in [{t0}, {t1}]");
        for used in inside {
            assert!(
                (used - truth).abs() <= 0.05 * truth,
                "{what}: headline {used:.1} MiB vs {truth:.1} MiB of distinct pages"
            );
        }
    }
}

fn pages_job(name: &str, job: &str, args: &[&Path]) -> Document {
    let (doc, windows) = run_job(job, &[], args);
    let host = doc.host.as_ref().expect("host");
    assert_eq!(host.source, HostSource::Pages, "{host:?}");
    check_windows(&doc, &windows, name);
    // The run's peak is the largest count the job saw (each job holds its
    // most inside a window).
    let most = windows.iter().map(|w| w.2).fold(0.0, f64::max);
    let peak = doc.peak_usage.figures.cpu_ram_used_mb;
    assert!(
        (peak - most).abs() <= 0.05 * most,
        "{name}: peak {peak:.1} MiB vs {most:.1} MiB of distinct pages"
    );
    doc
}

#[test]
fn fork_workers_headline_is_the_distinct_pages() {
    if !root_or_explained() {
        return;
    }
    let doc = pages_job("fork", FORK, &[]);
    // The peak (while the workers live) is their count too, not Σ RSS.
    let host = doc.host.as_ref().expect("host");
    assert!(host.rss_sum_peak_mb > 2.0 * doc.peak_usage.figures.cpu_ram_used_mb);
}

#[test]
fn copies_on_write_by_fork_workers_count_once_they_are_made() {
    if !root_or_explained() {
        return;
    }
    let doc = pages_job("copy on write", COPY_ON_WRITE, &[]);
    // The copies doubled the tree's pages: 800 MiB and more, not the
    // parent's 400 that every process's resident figure still shows.
    assert!(
        doc.peak_usage.figures.cpu_ram_used_mb > 780.0,
        "{}",
        doc.peak_usage.figures.cpu_ram_used_mb
    );
}

/// The same copies with the page reads starved (0.1 % of a core, the
/// least memtrack takes: reading the workers takes longer than the job
/// lasts): the cgroup memtrack made for the job is charged for each copy
/// at once, and its anonymous charge, with the file pages counted, is the
/// floor that keeps the headline true.
#[test]
fn copies_on_write_count_through_the_cgroup_floor_before_any_read() {
    if !root_or_explained() {
        return;
    }
    if let Some(why) = cgroup_unavailable() {
        panic!(
            "this test needs the cgroup v1 memory controller memtrack creates cgroups in: {why}"
        );
    }
    let (doc, windows) = run_job_within(COPY_ON_WRITE, Some("0.001"), &[], &[]);
    assert_eq!(doc.host.as_ref().expect("host").source, HostSource::Pages);
    check_windows(&doc, &windows, "copy on write, reads starved");
}

#[test]
fn spawn_workers_headline_is_the_distinct_pages() {
    if !root_or_explained() {
        return;
    }
    pages_job("spawn", SPAWN, &[]);
}

#[test]
fn shared_memory_headline_is_the_distinct_pages() {
    if !root_or_explained() {
        return;
    }
    pages_job("shm", SHM, &[]);
}

#[test]
fn a_file_loaded_before_the_job_counts_once() {
    if !root_or_explained() {
        return;
    }
    let dir = scratch();
    let lib = dir.path().join("lib.bin");
    std::fs::write(&lib, vec![7u8; 200 << 20]).expect("write the file");
    // Loaded first by this process, outside the job (page cache).
    let _ = std::fs::read(&lib).expect("read the file");
    pages_job("library", LIBRARY, &[&lib]);
}

#[test]
fn workers_restarting_each_epoch_neither_spike_nor_dip() {
    if !root_or_explained() {
        return;
    }
    let doc = pages_job("restart", RESTART, &[]);
    // Reruns agree within 3 %.
    let mut peaks = vec![doc.peak_usage.figures.cpu_ram_used_mb];
    for _ in 0..2 {
        let (d, _) = run_job(RESTART, &[], &[]);
        peaks.push(d.peak_usage.figures.cpu_ram_used_mb);
    }
    let lo = peaks.iter().copied().fold(f64::MAX, f64::min);
    let hi = peaks.iter().copied().fold(0.0, f64::max);
    assert!((hi - lo) <= 0.03 * hi, "rerun peaks {peaks:?}");
}

/// A root job that moves itself out of the cgroup memtrack made for it
/// (`echo $$ > …/cgroup.procs` of the parent) keeps holding its memory:
/// the headline must not fall, and `host.earlier` says what happened.
const ESCAPE: &str = r#"
b = bytearray(300 << 20); touch(b)
time.sleep(1.0)
steady([os.getpid()], hold=1.0)
mine = [l for l in open('/proc/self/cgroup') if ':memory:' in l][0].split(':', 2)[2].strip()
parent = os.path.dirname(mine)
open(f'/sys/fs/cgroup/memory{parent}/cgroup.procs', 'w').write(str(os.getpid()))
time.sleep(3.0)
steady([os.getpid()], hold=2.0)
"#;

#[test]
fn a_job_leaving_memtracks_cgroup_does_not_shrink_the_headline() {
    if !root_or_explained() {
        return;
    }
    if let Some(why) = cgroup_unavailable() {
        panic!(
            "this test needs the cgroup v1 memory controller memtrack creates cgroups in: {why}"
        );
    }
    let (doc, windows) = run_job(ESCAPE, &[], &[]);
    assert_eq!(windows.len(), 2, "{windows:?}");
    check_windows(&doc, &windows, "escape");
    let host = doc.host.as_ref().expect("host");
    assert!(
        host.reason.contains("outside")
            || host.earlier.iter().any(|e| e.reason.contains("outside")),
        "the move out of the cgroup is on record: {host:#?}"
    );
}

/// Holds 150 MiB for a moment, lets go, says so, and waits to be told to
/// end (argv[1]: a folder for the two flag files).
const ONE_PEAK: &str = r#"
import os, sys, time
d = sys.argv[1]
b = bytearray(150 << 20)
for i in range(0, len(b), 4096): b[i] = 1
time.sleep(1.0)
del b
time.sleep(0.5)
open(os.path.join(d, 'ready'), 'w').close()
for _ in range(1200):
    if os.path.exists(os.path.join(d, 'go')): break
    time.sleep(0.05)
"#;

/// The value of a `/metrics` line with `label` on the metric `name`.
fn metric(page: &str, name: &str, label: &str) -> Option<f64> {
    page.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn the_end_line_report_plot_json_and_metrics_give_one_peak() {
    let dir = scratch();
    let flags = dir.path().join("flags");
    std::fs::create_dir(&flags).expect("flags folder");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let child = memtrack()
        .args(["run", "--interval", "100ms", "--listen"])
        .arg(addr.to_string())
        .arg("--output")
        .arg(dir.path().join("runs"))
        .args(["--", python3(), "-c", ONE_PEAK])
        .arg(&flags)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("memtrack");
    wait_for("the job's peak to pass", Duration::from_secs(60), || {
        flags.join("ready").exists()
    });
    // The metrics of the live run, once a sample after the peak is in.
    let sampled_name = "figure=\"cpu_ram_used\"";
    let mut page = String::new();
    wait_for("the peak on /metrics", Duration::from_secs(30), || {
        page = http_request(addr, "GET", "/metrics").1;
        metric(&page, "memtrack_peak_memory_bytes", sampled_name).is_some_and(|v| v > 100.0 * MIB)
    });
    std::fs::write(flags.join("go"), "").expect("go");
    let out = child.wait_with_output().expect("memtrack ends");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (run_dir, doc) = only_document(&dir.path().join("runs"));

    let sampled = doc.peak_usage.figures.cpu_ram_used_mb;
    let between = sampled.max(doc.peak_usage.figures.cpu_ram_hwm_mb);
    let one = |v: f64| format!("{v:.1}");
    // The end line.
    let log = stderr(&out);
    let end = log
        .lines()
        .find(|l| l.contains("ended: peak host RAM"))
        .unwrap_or_else(|| panic!("no end line:\n{log}"));
    assert!(
        end.contains(&format!(
            "peak host RAM {} MiB sampled, {} MiB between samples",
            one(sampled),
            one(between)
        )),
        "{end} vs JSON {sampled} / {between}"
    );
    // The summary is the between-samples peak.
    assert_eq!(one(doc.summary.peak_host_ram_mb), one(between));
    // /metrics, scraped live.
    let m_sampled =
        metric(&page, "memtrack_peak_memory_bytes", sampled_name).expect("sampled") / MIB;
    let m_between = metric(
        &page,
        "memtrack_peak_memory_bytes",
        "figure=\"cpu_ram_hwm\"",
    )
    .expect("between")
        / MIB;
    assert_eq!(one(m_sampled), one(sampled), "{page}");
    // The job's exact peak from wait4 arrives when it is reaped, after
    // this scrape: it can only raise the between-samples peak.
    assert!(
        m_between.max(m_sampled) <= between + 0.05,
        "{m_between} vs {between}\n{page}"
    );
    // The report's peaks table.
    let report = run_to_end(
        memtrack().arg("report").arg(&run_dir),
        Duration::from_secs(30),
    );
    let text = String::from_utf8_lossy(&report.stdout).into_owned();
    let row = text
        .lines()
        .skip_while(|l| !l.starts_with("Peaks"))
        .find(|l| l.trim_start().starts_with("run "))
        .unwrap_or_else(|| panic!("no run row:\n{text}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        &cells[1..5],
        [one(sampled).as_str(), "MiB", one(between).as_str(), "MiB"],
        "{row}"
    );
    // The plot's header.
    let svg = dir.path().join("plot.svg");
    let plotted = run_to_end(
        memtrack().arg("plot").arg(&run_dir).arg("-o").arg(&svg),
        Duration::from_secs(60),
    );
    assert_eq!(plotted.status.code(), Some(0), "{}", stderr(&plotted));
    let drawn = std::fs::read_to_string(&svg).expect("svg");
    let header = if between > sampled {
        format!(
            "host peak {} MiB sampled, {} MiB between samples",
            one(sampled),
            one(between)
        )
    } else {
        format!("host peak {} MiB sampled", one(sampled))
    };
    assert!(drawn.contains(&header), "no `{header}` in the plot");
}

/// The steady windows a truth job wrote (`start end distinct_bytes` per
/// line) as `(start, end, MiB)`; a job that found none fails the test.
pub(crate) fn steady_windows(windows: &Path, out: &std::process::Output) -> Vec<(f64, f64, f64)> {
    let text = std::fs::read_to_string(windows).unwrap_or_default();
    let w: Vec<(f64, f64, f64)> = text
        .lines()
        .map(|l| {
            let v: Vec<f64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (v[0], v[1], v[2] / MIB)
        })
        .collect();
    assert!(
        !w.is_empty(),
        "the job found no steady moment\n{}",
        stderr(out)
    );
    w
}
