//! Every process shows what it alone costs: its USS (and Pss) as a series
//! with a peak, in the JSON, the report and the leak verdicts. The job is
//! the DataLoader "leak": a forked worker reading a Python-object dataset
//! writes each object's reference count, which turns the parent's shared
//! pages into private copies of its own. Its RSS does not move (those
//! pages were mapped from the start); its own memory grows by the size of
//! the dataset.

use std::path::Path;
use std::time::Duration;

use memtrack::model::leak::LeakReport;
use memtrack::model::{Document, Target};

use crate::common::*;

/// The parent builds a dataset of distinct int objects and forks two
/// workers: `reader` walks the dataset a slice at a time over ~28 s,
/// `idle` only sleeps, so the pages the reader copies stay shared between
/// the parent and `idle` (the parent's own memory stays flat). The job
/// writes `reader idle objects_bytes` to argv[1].
const COPY_ON_READ_JOB: &str = r#"
import gc, os, sys, time
gc.disable()
N = 2_000_000
data = [i + 1000 for i in range(N)]
objects_bytes = N * sys.getsizeof(N + 1000)
def reader():
    # 150 steps of 0.28 s: at the default budget a growing worker's own
    # cost is read every 2-3 s, and the leak rule needs 12 reads after
    # its warm-up to judge USS rather than RSS.
    steps = 150
    chunk = N // steps
    for s in range(steps):
        part = data[s * chunk:(s + 1) * chunk]
        del part
        time.sleep(0.28)
    time.sleep(1.0)
    os._exit(0)
r = os.fork()
if r == 0: reader()
i = os.fork()
if i == 0:
    time.sleep(3600)
    os._exit(0)
open(sys.argv[1], 'w').write(f'{r} {i} {objects_bytes}')
os.waitpid(r, 0)
os.kill(i, 9)
os.waitpid(i, 0)
"#;

fn target(doc: &Document, pid: u32) -> &Target {
    doc.targets
        .iter()
        .find(|t| t.pid == pid)
        .unwrap_or_else(|| panic!("no row for PID {pid}: {:#?}", doc.targets))
}

/// USS growth over the process's own-cost series up to `until` (seconds
/// since the epoch): the last reads against the first ones (medians of
/// three, so one read does not decide).
fn uss_growth(t: &Target, until: f64) -> f64 {
    let uss: Vec<f64> = t
        .own_series
        .iter()
        .filter(|p| p[0] < until)
        .map(|p| p[1])
        .collect();
    assert!(
        uss.len() >= 6,
        "PID {} has too few own-cost reads: {:?}",
        t.pid,
        t.own_series
    );
    let med = |s: &[f64]| {
        let mut v = s.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    med(&uss[uss.len() - 3..]) - med(&uss[..3])
}

fn rss_growth(t: &Target) -> f64 {
    let rss: Vec<f64> = t.series.iter().map(|p| p[1]).collect();
    rss.last().copied().unwrap_or(0.0) - rss.first().copied().unwrap_or(0.0)
}

/// The job's run: its scratch folder (kept while the caller holds it), the
/// document, the run folder, the root, reader and idle PIDs and the
/// dataset's MiB.
struct CopyOnRead {
    _scratch: tempfile::TempDir,
    doc: Document,
    dir: std::path::PathBuf,
    root: u32,
    reader: u32,
    idle: u32,
    objects: f64,
}

/// Runs the job at the default budget beside CPU hogs (two per core), as
/// on a training node: the page count then never catches up, and the
/// own-cost reads must still get their turns.
fn run_copy_on_read(extra: &[&str]) -> CopyOnRead {
    let out_dir = scratch();
    let pids = out_dir.path().join("pids");
    let _one = crate::truth::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let hogs = crate::busy::Hogs::start();
    let out = run_to_end(
        memtrack()
            .args(["run", "--interval", "200ms", "--listen", "off", "--output"])
            .arg(out_dir.path().join("runs"))
            .args(extra)
            .arg("--")
            .args([python3(), "-c", COPY_ON_READ_JOB])
            .arg(&pids),
        Duration::from_secs(120),
    );
    drop(hogs);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (dir, doc) = only_document(&out_dir.path().join("runs"));
    let text = std::fs::read_to_string(&pids).expect("the job wrote its PIDs");
    let v: Vec<&str> = text.split_whitespace().collect();
    let reader: u32 = v[0].parse().expect("reader pid");
    let idle: u32 = v[1].parse().expect("idle pid");
    let objects = v[2].parse::<f64>().expect("dataset size") / MIB;
    let root = doc.targets.iter().find(|t| t.root).expect("the root").pid;
    CopyOnRead {
        _scratch: out_dir,
        doc,
        dir,
        root,
        reader,
        idle,
        objects,
    }
}

fn report_text(dir: &Path) -> String {
    let out = run_to_end(memtrack().arg("report").arg(dir), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_copy_on_read_worker_shows_its_own_growth_and_its_parent_does_not() {
    let CopyOnRead {
        _scratch,
        doc,
        dir,
        root,
        reader,
        idle,
        objects,
    } = run_copy_on_read(&[]);
    let r = target(&doc, reader);
    let p = target(&doc, root);
    let i = target(&doc, idle);

    // The reader's own memory grows by most of the dataset it touched,
    // while its RSS (the shared pages were mapped from the start) does not.
    let grew = uss_growth(r, f64::INFINITY);
    assert!(
        grew > 0.5 * objects,
        "the reader's USS grew {grew:.1} MiB for a {objects:.1} MiB dataset: {:?}",
        r.own_series
    );
    assert!(
        rss_growth(r) < grew / 2.0,
        "RSS does not show copy-on-read: RSS +{:.1} vs USS +{grew:.1} MiB",
        rss_growth(r)
    );
    let peak = r.peak_uss_mb.expect("the reader's peak USS");
    let last = r.uss_mb.expect("the reader's last USS");
    assert!(peak >= last && peak > grew, "peak {peak} last {last}");
    assert!(r.peak_pss_mb.is_some() && r.pss_mb.is_some());
    // The parent's and the idle worker's own memory stay where they were
    // while the reader ran. (Once the job kills the idle worker, the pages
    // it shared with the parent are the parent's alone: its USS rises then,
    // rightly, while the interpreter frees the dataset on its way out.)
    let reader_ran = r.exited_at.expect("the reader's exit was seen");
    for t in [p, i] {
        let g = uss_growth(t, reader_ran);
        assert!(
            g < grew / 4.0,
            "PID {} ({}) grew {g:.1} MiB of its own beside the reader's {grew:.1}: {:?}\nthe reader: {:?}",
            t.pid,
            t.name,
            t.own_series,
            r.own_series
        );
    }

    // The leak verdicts judge each process's own memory.
    let leak: LeakReport =
        serde_json::from_value(doc.leak.clone().expect("a leak block")).expect("leak block");
    let verdicts = leak.targets.expect("per-process verdicts");
    let rv = verdicts
        .iter()
        .find(|v| v.pid == reader)
        .expect("the reader is judged");
    assert_eq!(rv.figure, "uss", "{:#?}\n{:?}", rv, r.own_series);
    assert!(rv.host.suspected, "{rv:#?}");
    for v in verdicts.iter().filter(|v| v.pid != reader) {
        assert!(!v.host.suspected, "PID {} is not leaking: {v:#?}", v.pid);
    }

    // The report shows the own cost beside RSS, and says whose memory grew.
    let text = report_text(&dir);
    assert!(text.contains("peak USS"), "{text}");
    let row = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&reader.to_string()))
        .unwrap_or_else(|| panic!("no row for the reader {reader}:\n{text}"));
    assert!(
        row.contains(&memtrack::units::format_mib_one_decimal(peak)),
        "{row}"
    );
    assert!(
        text.contains(&format!("PID {reader} ")) && text.contains("(own memory, USS)"),
        "{text}"
    );
}

#[test]
fn own_cost_is_collected_in_pss_mode_too() {
    let run = run_copy_on_read(&["--host-source", "pss"]);
    let (reader, objects) = (run.reader, run.objects);
    let r = target(&run.doc, reader);
    let grew = uss_growth(r, f64::INFINITY);
    assert!(
        grew > 0.5 * objects,
        "the reader's USS grew {grew:.1} MiB for a {objects:.1} MiB dataset"
    );
}
