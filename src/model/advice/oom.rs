//! `oom-killed` (the kernel's OOM killer ended a process of the job) and
//! `cuda-oom` (the job reported a CUDA out-of-memory error): why it ran
//! out, in which phase, and what would fit.

use super::item::{size, Advice, Severity};
use crate::model::{DocumentOf, Entry, EntryKind, FlightWindow};

/// Phase changes kept; older ones are dropped in halves beyond this.
const MAX_PHASES: usize = 4096;

/// Timer points kept for the growth before a kill (the last ones).
const MAX_POINTS: usize = 4096;

/// The growth before a kill is read over this many seconds.
const GROWTH_WINDOW_S: f64 = 5.0;

/// Interpreters and shells a job is often started through (pyenv's
/// `python3` is a bash script): a process of these names that holds
/// little while a child of it holds the memory is not named.
const SHIMS: &[&str] = &[
    "sh", "bash", "dash", "zsh", "env", "pyenv", "conda", "uv", "timeout",
];

/// Which phase the job was in over time: the span or stage of timer
/// samples, the component and operation of marks.
#[derive(Debug, Default)]
pub(super) struct Phases {
    /// `(since, phase)`, in time order, consecutive duplicates merged.
    changes: Vec<(f64, String)>,
    /// The last timer points: `(time, host figure)` on the charge basis
    /// when the entries have it.
    points: std::collections::VecDeque<(f64, f64)>,
    /// The highest charge (the job's cgroup) any entry saw.
    charge_peak: Option<f64>,
}

impl Phases {
    pub(super) fn observe(&mut self, e: &Entry) {
        if e.charge_mb.is_some() || e.charge_hwm_mb.is_some() {
            let c = e.charge_or_headline_peak();
            self.charge_peak = Some(self.charge_peak.map_or(c, |p| p.max(c)));
        }
        if e.kind == EntryKind::Timer {
            if self.points.len() >= MAX_POINTS {
                self.points.pop_front();
            }
            let figure = e.charge_mb.unwrap_or(e.figures.cpu_ram_used_mb);
            self.points
                .push_back((e.timestamp_end.unwrap_or(e.timestamp), figure));
        }
        let phase = match e.kind {
            EntryKind::System => return,
            EntryKind::Timer => match (&e.span, &e.stage) {
                (Some(span), _) => span.clone(),
                (None, Some(stage)) => format!("stage {stage}"),
                (None, None) => return,
            },
            EntryKind::Event => {
                if e.component == "cuda" && e.operation == "out_of_memory" {
                    return;
                }
                // A span's begin is logged `before_OP`, its end `after_OP`.
                match (
                    e.operation.strip_prefix("before_"),
                    e.operation.strip_prefix("after_"),
                ) {
                    (Some(op), _) => format!("{}/{op}", e.component),
                    (None, Some(op)) => format!("after {}/{op}", e.component),
                    (None, None) => format!("{}/{}", e.component, e.operation),
                }
            }
        };
        if self.changes.last().is_some_and(|(_, p)| *p == phase) {
            return;
        }
        if self.changes.len() >= MAX_PHASES {
            self.changes.drain(..MAX_PHASES / 2);
        }
        self.changes.push((e.timestamp, phase));
    }

    /// MiB per second over the last seconds of timer points before `t`
    /// (growing only).
    fn growth_before(&self, t: f64) -> Option<f64> {
        // Up to the highest point of the last seconds: a sample taken as
        // the kill freed the memory must not read as a fall.
        let recent = || {
            self.points
                .iter()
                .filter(move |(at, _)| *at <= t + 0.5 && *at >= t - GROWTH_WINDOW_S)
        };
        let top = *recent().max_by(|a, b| a.1.total_cmp(&b.1))?;
        let first = *recent().find(|(at, _)| *at >= top.0 - GROWTH_WINDOW_S)?;
        let dt = top.0 - first.0;
        (dt > 0.0 && top.1 > first.1).then(|| (top.1 - first.1) / dt)
    }

    /// The phase at time `t`.
    fn at(&self, t: f64) -> Option<&str> {
        self.changes
            .iter()
            .rev()
            .find(|(since, _)| *since <= t)
            .map(|(_, p)| p.as_str())
    }
}

/// The kernel's OOM killer ended a process of the job: from the cgroup's
/// `oom_kill` counter or a flight-recorder window kept for it.
pub(super) fn oom_killed<L>(doc: &DocumentOf<L>, phases: &Phases) -> Option<Advice> {
    let kills = doc.host.as_ref().and_then(|h| h.oom_kills).unwrap_or(0);
    // A window kept for the OOM kill, or (the kernel's kill reads as a
    // SIGKILL) for a SIGKILLed process of a job the kernel killed in.
    let window = doc
        .flight_recorder
        .iter()
        .find(|w| w.reason == "oom_kill")
        .or_else(|| {
            doc.flight_recorder.iter().find(|w| {
                kills > 0 && w.reason == "signal" && w.exit.is_some_and(|x| x.signal == Some(9))
            })
        });
    if kills == 0 && window.is_none() {
        return None;
    }
    let killed = doc
        .targets
        .iter()
        .filter(|t| t.exit.is_some_and(|x| x.signal == Some(9)))
        .max_by(|a, b| a.hwm_mb.total_cmp(&b.hwm_mb));
    let (pid, at) = match (window, killed) {
        (Some(w), _) => (w.pid.or_else(|| holder(w)), w.timestamp),
        (None, Some(t)) => (Some(t.pid), t.exited_at.unwrap_or(t.last_seen)),
        (None, None) => (None, doc.run.end.unwrap_or(f64::MAX)),
    };
    let pid = pid.map(|p| past_shims(doc, p)).map(|p| {
        // Still a shim (its child no longer listed): the window's holder.
        match window.and_then(holder) {
            Some(h) if is_shim(doc, p) => h,
            _ => p,
        }
    });
    let name = pid
        .and_then(|p| doc.targets.iter().rev().find(|t| t.pid == p))
        .map(|t| t.display_name())
        .filter(|n| !n.is_empty())
        .or_else(|| window.map(|w| w.name.clone()).filter(|n| !n.is_empty()));
    let who = match (pid, name) {
        (Some(p), None) => format!("PID {p}"),
        (Some(p), Some(n)) => format!("PID {p} ({n})"),
        (None, _) => "a process of the job".to_string(),
    };
    let phase = phases.at(at).unwrap_or("an unnamed phase").to_string();
    // On the kernel's basis where the job had a cgroup: what the limit
    // was enforced on, not pages another cgroup was charged for.
    let (peak, basis) = match charge_peak(doc, phases) {
        Some(c) => (c, "the job's memory cgroup was charged"),
        None => (peak_host(doc), "the job reached"),
    };
    let headroom = if doc.summary.headroom_ratio > 0.0 {
        doc.summary.headroom_ratio
    } else {
        0.10
    };
    let rate = window
        .and_then(growth_rate)
        .or_else(|| phases.growth_before(at));
    let mut finding = format!("the kernel's OOM killer ended {who} during {phase}");
    let mut a = Advice::new(
        "oom-killed",
        Severity::Critical,
        String::new(),
        String::new(),
    )
    .figure("oom_kills", kills as f64)
    .figure("peak_mb", peak);
    match doc.run.memory_limit_mb {
        Some(limit) => {
            finding.push_str(&format!(
                ": {basis} {} of its {} limit ({:.0} %)",
                size(peak),
                size(limit),
                100.0 * peak / limit
            ));
            a = a
                .figure("limit_mb", limit)
                .figure("over_limit_mb", peak - limit);
        }
        None => finding.push_str(&format!(" at {} of host memory", size(peak))),
    }
    if let Some(r) = rate {
        finding.push_str(&format!(
            ", growing {} per second in its last seconds",
            size(r)
        ));
        a = a.figure("growth_mib_per_s", r);
    }
    if let Some(p) = pid {
        a = a.figure("pid", f64::from(p));
    }
    a.finding = finding;
    a.action = format!(
        "{phase} needs more than {}: give the job at least {} (its peak plus {:.0} % headroom) \
         or cut what {phase} holds (smaller batches, fewer workers, data streamed instead of \
         loaded whole)",
        size(peak),
        size((peak * (1.0 + headroom)).ceil()),
        headroom * 100.0
    );
    Some(a)
}

/// The process that held the most memory at the window's last point
/// with processes (the OOM killer's choice is the largest), for a window
/// that names none.
fn holder(w: &FlightWindow) -> Option<u32> {
    let last = w.points.iter().rev().find(|p| !p.processes.is_empty())?;
    last.processes
        .iter()
        .max_by(|a, b| a[1].total_cmp(&b[1]))
        .map(|p| p[0] as u32)
}

/// Whether `pid` is a shell or launcher of the tree.
fn is_shim<L>(doc: &DocumentOf<L>, pid: u32) -> bool {
    doc.targets
        .iter()
        .rev()
        .find(|t| t.pid == pid)
        .is_some_and(|t| {
            let base = t.name.rsplit('/').next().unwrap_or(&t.name);
            SHIMS.contains(&base)
        })
}

/// `pid`, or when it is a shell or launcher shim whose child held more,
/// that child (followed down: `bash` → `pyenv` → `python3`).
fn past_shims<L>(doc: &DocumentOf<L>, mut pid: u32) -> u32 {
    for _ in 0..8 {
        let Some(t) = doc.targets.iter().rev().find(|t| t.pid == pid) else {
            break;
        };
        if !is_shim(doc, pid) {
            break;
        }
        let Some(child) = doc
            .targets
            .iter()
            .filter(|c| c.ppid == pid && c.pid != pid)
            .max_by(|a, b| a.hwm_mb.total_cmp(&b.hwm_mb))
        else {
            break;
        };
        if child.hwm_mb < t.hwm_mb {
            break;
        }
        pid = child.pid;
    }
    pid
}

/// The job's highest charge (its memory cgroup's), MiB: the kernel's own
/// peak of the charge where it has one, else the highest the entries saw.
fn charge_peak<L>(doc: &DocumentOf<L>, phases: &Phases) -> Option<f64> {
    let kernel = doc.host.as_ref().and_then(|h| h.kernel_peak_mb);
    match (kernel, phases.charge_peak) {
        (Some(k), Some(c)) => Some(k.max(c)),
        (k, c) => k.or(c),
    }
}

/// The tree's highest host figure over the run, MiB.
fn peak_host<L>(doc: &DocumentOf<L>) -> f64 {
    doc.peak_usage
        .figures
        .cpu_ram_used_mb
        .max(doc.peak_usage.figures.cpu_ram_hwm_mb)
}

/// MiB per second over a flight window's last second of points.
fn growth_rate(w: &FlightWindow) -> Option<f64> {
    let last = w.points.last()?;
    let first = w.points.iter().find(|p| p.t >= last.t - 1.0)?;
    let dt = last.t - first.t;
    (dt > 0.0 && last.cpu_mb > first.cpu_mb).then(|| (last.cpu_mb - first.cpu_mb) / dt)
}

/// Reads a `torch.OutOfMemoryError` text: "Tried to allocate 2.00 GiB",
/// "of which 1.23 GiB is free". MiB.
fn size_after(text: &str, key: &str) -> Option<f64> {
    let rest = &text[text.find(key)? + key.len()..];
    let mut words = rest.split_whitespace();
    let number: f64 = words.next()?.parse().ok()?;
    let unit = words.next()?.trim_end_matches(['.', ',', ')']);
    let factor = match unit {
        "GiB" | "GB" => 1024.0,
        "MiB" | "MB" => 1.0,
        "KiB" | "KB" => 1.0 / 1024.0,
        "TiB" => 1024.0 * 1024.0,
        "bytes" | "B" => 1.0 / (1024.0 * 1024.0),
        _ => return None,
    };
    Some(number * factor)
}

/// A CUDA out-of-memory error the job reported, with the allocator's
/// figures when the client sent them.
pub(super) fn cuda_oom<L>(doc: &DocumentOf<L>, e: &Entry) -> Option<Advice> {
    let error = e.labels.get("error").map(String::as_str).unwrap_or("");
    let requested = size_after(error, "Tried to allocate ");
    let free = size_after(error, "of which ");
    let (allocated, reserved) = (e.figures.gpu_ram_used_mb, e.figures.reserved_gpu_ram_mb);
    let fragmented = (reserved - allocated).max(0.0);
    // Below the threshold it is the driver's own share, not a process's.
    let foreign = Some(super::gpu::foreign_mb(doc))
        .filter(|f| *f >= super::gpu::MIN_FOREIGN_MIB)
        .unwrap_or(0.0);
    let who = e
        .pid
        .map(|p| format!("PID {p}"))
        .unwrap_or("the job".into());
    let mut finding = format!("{who} ran out of GPU memory");
    if let Some(r) = requested {
        finding.push_str(&format!(" asking for {}", size(r)));
    }
    if let Some(f) = free {
        finding.push_str(&format!(" with {} free", size(f)));
    }
    if reserved > 0.0 {
        finding.push_str(&format!(
            "; PyTorch held {} reserved, {} of it allocated: {} reserved but unused ({:.0} %)",
            size(reserved),
            size(allocated),
            size(fragmented),
            100.0 * fragmented / reserved
        ));
    }
    if foreign > 0.0 {
        finding.push_str(&format!(
            "; other processes held {} of the card",
            size(foreign)
        ));
    }
    // Fragmentation matters when the unused reserve could have served the
    // request, or is a large share of the pool.
    let fragmentation = reserved > 0.0
        && (requested.is_some_and(|r| fragmented >= r) || fragmented >= 0.2 * reserved);
    let action = if fragmentation {
        "the allocator's pool is fragmented: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
         (and do not call torch.cuda.empty_cache() in the loop)"
            .to_string()
    } else if foreign > requested.unwrap_or(0.0) && foreign > 0.0 {
        format!(
            "other processes hold {} of the card: run alone on it (CUDA_VISIBLE_DEVICES) or stop them",
            size(foreign)
        )
    } else {
        "the job needs more than the card has: a smaller batch with gradient accumulation, mixed \
         precision or activation checkpointing"
            .to_string()
    };
    let mut a = Advice::new("cuda-oom", Severity::Critical, finding, action)
        .figure("allocated_mb", allocated)
        .figure("reserved_mb", reserved)
        .figure("fragmentation_mb", fragmented)
        .figure("other_processes_mb", foreign);
    if let Some(r) = requested {
        a = a.figure("requested_mb", r);
    }
    if let Some(f) = free {
        a = a.figure("free_mb", f);
    }
    Some(a)
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use crate::model::{Exit, FlightPoint, GpuSource, HostInfo};

    #[test]
    fn an_oom_kill_names_the_process_the_phase_and_the_limit() {
        let mut d = doc();
        d.run.memory_limit_mb = Some(256.0);
        d.detailed_log.push(entry(1001.0, "data", "load", 50.0));
        d.detailed_log.push(entry(1002.0, "train", "epoch", 120.0));
        d.detailed_log.push(timer(1002.5, 150.0));
        d.detailed_log.push(timer(1003.0, 250.0));
        // The sample that found the kill: the memory freed.
        d.detailed_log.push(timer(1003.5, 5.0));
        // The headline counts library pages another cgroup was charged
        // for: the limit is compared with the charge.
        d.peak_usage.figures.cpu_ram_used_mb = 290.0;
        d.host = Some(HostInfo {
            oom_kills: Some(1),
            kernel_peak_mb: Some(256.0),
            ..HostInfo::default()
        });
        let mut t = target(42, 1, true, 250.0);
        t.exit = Some(Exit::signal(9));
        t.exited_at = Some(1003.5);
        d.targets.push(t);
        let a = super::super::advise(&d);
        assert_eq!(a[0].code, "oom-killed");
        assert_eq!(a[0].level, Severity::Critical);
        assert_eq!(
            a[0].finding,
            "the kernel's OOM killer ended PID 42 (python3) during train/epoch: \
             the job's memory cgroup was charged 256 MiB of its 256 MiB limit (100 %), \
             growing 200 MiB per second in its last seconds"
        );
        assert!(
            a[0].action
                .starts_with("train/epoch needs more than 256 MiB: give the job at least 282 MiB"),
            "{}",
            a[0].action
        );
    }

    #[test]
    fn the_flight_window_gives_the_process_and_the_growth() {
        let mut d = doc();
        d.detailed_log.push(entry(1001.0, "data", "load", 50.0));
        d.flight_recorder.push(FlightWindow {
            reason: "oom_kill".into(),
            timestamp: 1001.9,
            pid: Some(7),
            name: "worker".into(),
            points: vec![
                FlightPoint {
                    t: 1001.0,
                    cpu_mb: 100.0,
                    ..FlightPoint::default()
                },
                FlightPoint {
                    t: 1001.5,
                    cpu_mb: 200.0,
                    ..FlightPoint::default()
                },
            ],
            ..FlightWindow::default()
        });
        let a = super::super::advise(&d);
        assert_eq!(a[0].code, "oom-killed");
        assert!(
            a[0].finding
                .contains("ended PID 7 (worker) during data/load"),
            "{}",
            a[0].finding
        );
        assert_eq!(a[0].figures["growth_mib_per_s"], 200.0);
    }

    #[test]
    fn a_reported_cuda_oom_with_a_fragmented_pool_gets_expandable_segments() {
        let mut d = doc();
        let mut e = entry(1002.0, "cuda", "out_of_memory", 3000.0);
        e.pid = Some(9);
        e.gpu_source = GpuSource::Allocator;
        e.figures.gpu_ram_used_mb = 60_000.0;
        e.figures.reserved_gpu_ram_mb = 75_000.0;
        e.labels.insert(
            "error".into(),
            "OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total \
             capacity of 79.15 GiB of which 1.23 GiB is free.')"
                .into(),
        );
        d.detailed_log.push(e);
        let a = super::super::advise(&d);
        assert_eq!(a.len(), 1, "{a:#?}");
        assert_eq!(a[0].code, "cuda-oom");
        assert_eq!(a[0].figures["requested_mb"], 2048.0);
        assert_eq!(a[0].figures["free_mb"], 1259.52);
        assert_eq!(a[0].figures["fragmentation_mb"], 15_000.0);
        assert!(
            a[0].action.contains("expandable_segments:True"),
            "{}",
            a[0].action
        );
        assert!(
            a[0].finding.contains("14.6 GiB reserved but unused (20 %)"),
            "{}",
            a[0].finding
        );
    }

    #[test]
    fn a_tight_pool_is_a_real_need_not_fragmentation() {
        let mut d = doc();
        let mut e = entry(1002.0, "cuda", "out_of_memory", 3000.0);
        e.figures.gpu_ram_used_mb = 74_000.0;
        e.figures.reserved_gpu_ram_mb = 75_000.0;
        e.labels
            .insert("error".into(), "Tried to allocate 4.00 GiB.".into());
        d.detailed_log.push(e);
        let a = super::super::advise(&d);
        assert!(a[0].action.contains("smaller batch"), "{}", a[0].action);
    }

    #[test]
    fn a_job_started_through_a_shell_shim_names_the_process_that_held_the_memory() {
        let mut d = doc();
        d.run.memory_limit_mb = Some(400.0);
        d.detailed_log.push(entry(1001.0, "train", "step", 50.0));
        // pyenv's python3 is a bash script: bash (42) runs python (43).
        let mut shim = target(42, 1, true, 3.0);
        shim.name = "bash".into();
        shim.exit = Some(Exit::code(137));
        d.targets.push(shim);
        let mut py = target(43, 42, false, 390.0);
        py.cmdline = vec!["python3".into(), "train.py".into()];
        py.exit = Some(Exit::signal(9));
        d.targets.push(py);
        d.host = Some(HostInfo {
            oom_kills: Some(1),
            kernel_peak_mb: Some(400.0),
            ..HostInfo::default()
        });
        // The flight window was kept for the shim's end.
        d.flight_recorder.push(FlightWindow {
            reason: "oom_kill".into(),
            timestamp: 1002.0,
            pid: Some(42),
            name: "bash".into(),
            points: vec![FlightPoint {
                t: 1001.9,
                cpu_mb: 393.0,
                processes: vec![[42.0, 3.0, 0.0], [43.0, 390.0, 0.0]],
                ..FlightPoint::default()
            }],
            ..FlightWindow::default()
        });
        let a = super::super::advise(&d);
        assert!(
            a[0].finding.starts_with(
                "the kernel's OOM killer ended PID 43 (python3 train.py) during train/step"
            ),
            "{}",
            a[0].finding
        );
        assert_eq!(a[0].figures["pid"], 43.0);
        // Without the window, the shim's child is found through the tree.
        d.flight_recorder.clear();
        d.targets[1].exit = None;
        d.targets[0].exit = Some(Exit::signal(9));
        let a = super::super::advise(&d);
        assert_eq!(a[0].figures["pid"], 43.0, "{}", a[0].finding);
    }

    #[test]
    fn no_kill_no_advice() {
        let mut d = doc();
        d.host = Some(HostInfo {
            oom_kills: Some(0),
            ..HostInfo::default()
        });
        let mut t = target(42, 1, true, 250.0);
        t.exit = Some(Exit::signal(9));
        d.targets.push(t);
        assert!(super::super::advise(&d).is_empty());
    }
}
