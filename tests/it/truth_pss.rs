//! The Σ Pss source (`--host-source pss`: what a run gets without root,
//! under `attach`, and on cgroup v2 machines) against the truth. As root
//! each job counts its distinct physical pages itself (the page frame
//! numbers of `truth.rs`); as an unprivileged user, where frame numbers
//! read as 0, it sums its processes' Pss from `smaps_rollup`. Every timer
//! sample memtrack took inside a window the job wrote must be within 5 %
//! of that count, and so must the run's peak: forks must not count their
//! parent's pages again, exits must not take pages the survivors hold.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use memtrack::model::{Document, HostSource};

use crate::common::*;
use crate::truth::{check_windows, FORK, ONE_AT_A_TIME, PRELUDE, RESTART, SHM};

const NOBODY: u32 = 65534;

/// The job's own truth as Σ Pss (no frame numbers without root): replaces
/// the prelude's `truth`.
const PSS_TRUTH: &str = r#"
def truth(pids):
    tot = 0
    for p in pids:
        try:
            for l in open(f'/proc/{p}/smaps_rollup'):
                if l.startswith('Pss:'): tot += int(l.split()[1]) * 1024
        except OSError:
            pass
    return tot
"#;

/// A process holding 300 MiB that forks and exits in a loop (a daemon
/// detaching, a job re-forking itself): each fork holds the pages, its
/// parent exits at once, and the fork is an orphan memtrack reaps. The
/// job's first process waits for the last fork to say it is done.
const FORK_AWAY: &str = r#"
root = os.getpid()
done = OUT + '.done'
if os.fork() == 0:
    b = bytearray(300 << 20); touch(b)
    time.sleep(1.0)
    for rnd in range(2):
        t0 = time.time(); a = truth([os.getpid(), root])
        for i in range(20):
            if os.fork() != 0:
                os._exit(0)
            time.sleep(0.15)
        b2 = truth([os.getpid(), root]); t1 = time.time()
        if abs(a - b2) <= 0.03 * max(a, b2):
            with open(OUT, 'a') as f: f.write(f'{t0} {t1} {(a + b2) // 2}\n')
    open(done, 'w').close()
    os._exit(0)
while not os.path.exists(done):
    time.sleep(0.1)
time.sleep(0.3)
"#;

/// Non-persistent workers, with windows spanning their fork and their
/// exit: the job holds 200 MiB, forks 4 workers that sleep and exit, and
/// counts itself before the fork and after they are reaped (the workers
/// add only the few pages they copy on write).
const EPOCHS: &str = r#"
b = bytearray(200 << 20); touch(b)
time.sleep(1.5)
for epoch in range(3):
    t0 = time.time(); a = truth([os.getpid()])
    kids = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            hold_then_exit(1.2)
        kids.append(pid)
    for k in kids: os.waitpid(k, 0)
    time.sleep(0.3)
    b2 = truth([os.getpid()]); t1 = time.time()
    if abs(a - b2) <= 0.03 * max(a, b2):
        with open(OUT, 'a') as f: f.write(f'{t0} {t1} {(a + b2) // 2}\n')
    time.sleep(0.5)
"#;

fn root_or_explained() -> bool {
    can_run(
        "root",
        is_root(),
        "these tests read page frame numbers (and switch to another user) and need root",
    )
}

/// Runs `job` under `memtrack run --host-source pss` at the default budget
/// (as `user`, when given); the document and the job's windows.
fn run_pss(job: &str, user: Option<u32>) -> (Document, Vec<(f64, f64, f64)>) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    if let Some(uid) = user {
        std::os::unix::fs::chown(&work, Some(uid), Some(uid)).unwrap();
    }
    let windows = work.join("windows");
    let runs = work.join("runs");
    let truth = if user.is_some() { PSS_TRUTH } else { "" };
    let script = format!("{PRELUDE}\n{truth}\n{job}");
    let mut cmd = match user {
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                env!("CARGO_BIN_EXE_memtrack"),
            ]);
            c
        }
        None => memtrack(),
    };
    // An interpreter under root's home cannot run as another user.
    let python = if user.is_some() {
        "/usr/bin/python3"
    } else {
        python3()
    };
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") {
            cmd.env_remove(k);
        }
    }
    let out = run_to_end(
        cmd.args(["run", "--interval", "100ms", "--listen", "off"])
            .args(["--host-source", "pss", "--output"])
            .arg(&runs)
            .stdin(std::process::Stdio::null())
            .arg("--")
            .args([python, "-c", &script])
            .arg(&windows),
        Duration::from_secs(120),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(&runs);
    let w = crate::truth::steady_windows(&windows, &out);
    let host = doc.host.as_ref().expect("host");
    assert_eq!(host.source, HostSource::Pss, "{host:#?}\n{}", stderr(&out));
    assert!(host.pss_reads.unwrap_or(0) > 0, "{host:#?}");
    (doc, w)
}

/// Every window, and the peak against the largest count the job saw.
fn check(name: &str, doc: &Document, windows: &[(f64, f64, f64)]) {
    check_windows(doc, windows, name);
    let most = windows.iter().map(|w| w.2).fold(0.0, f64::max);
    let peak = doc.peak_usage.figures.cpu_ram_used_mb;
    assert!(
        (peak - most).abs() <= 0.05 * most,
        "{name}: peak {peak:.1} MiB vs {most:.1} MiB"
    );
}

#[test]
fn pss_fork_workers_count_their_parents_pages_once() {
    if !root_or_explained() {
        return;
    }
    let (doc, w) = run_pss(FORK, None);
    check("fork", &doc, &w);
    let host = doc.host.as_ref().expect("host");
    assert!(host.rss_sum_peak_mb > 2.0 * doc.peak_usage.figures.cpu_ram_used_mb);
}

#[test]
fn pss_workers_restarting_each_epoch_neither_spike_nor_dip() {
    if !root_or_explained() {
        return;
    }
    let (doc, w) = run_pss(RESTART, None);
    check("restart", &doc, &w);
}

#[test]
fn pss_worker_forks_and_exits_neither_spike_nor_dip_the_figure() {
    if !root_or_explained() {
        return;
    }
    let (doc, w) = run_pss(EPOCHS, None);
    assert!(w.len() >= 2, "{w:?}");
    check("epochs", &doc, &w);
}

#[test]
fn pss_shared_memory_mapped_by_workers_counts_once() {
    if !root_or_explained() {
        return;
    }
    let (doc, w) = run_pss(SHM, None);
    check("shm", &doc, &w);
}

#[test]
fn pss_a_process_forking_away_in_a_loop_keeps_its_pages() {
    if !root_or_explained() {
        return;
    }
    let (doc, w) = run_pss(FORK_AWAY, None);
    check("fork-away", &doc, &w);
    // The forks were followed (the job, then 1 + 2 × 20 forks, each alive
    // for 1.5 sampling intervals).
    assert!(doc.targets.len() >= 30, "{} processes", doc.targets.len());
}

#[test]
fn pss_source_works_for_an_unprivileged_user() {
    if !root_or_explained() {
        return;
    }
    let (doc, w) = run_pss(FORK, Some(NOBODY));
    check("fork as nobody", &doc, &w);
}
