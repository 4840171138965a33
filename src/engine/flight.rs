//! The OOM flight recorder: a ring of the last few seconds of memory, kept
//! as a [`FlightWindow`] when a target dies by a signal, by the kernel's
//! OOM killer, or reports a CUDA out-of-memory error.
//!
//! [`Flight`] holds the ring and decides; the engine feeds it samples and
//! commits the windows it keeps.

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::model::{Exit, FlightPoint, FlightWindow};
use crate::sample::gpu::GpuSample;
use crate::sample::{Sample, Sampler};
use crate::store::Record;
use crate::sys;
use crate::units::{unix_now, MIB};

/// How long a CUDA OOM window keeps recording after the report (or until
/// the process leaves, if sooner).
const OOM_TAIL: Duration = Duration::from_secs(1);

/// How far back an OOM kill counts as the cause of a target's death.
const OOM_LOOKBACK: Duration = Duration::from_secs(3);

/// The flight recorder's ring of recent points. Between timer ticks that
/// are slower than its interval it reads on its own, through the cheap
/// paths only: a `statm` read per followed process and NVML's stateless
/// sample, no discovery (the next timer sample handles joins and exits).
pub(super) struct Flight {
    interval: Duration,
    capacity: usize,
    ring: VecDeque<FlightPoint>,
    /// Reads between timer ticks (its interval is the shorter).
    pub(super) fast: bool,
    /// When the next read between ticks is due.
    pub(super) next: Instant,
    /// `/proc/vmstat`, for the kernel's `oom_kill` counter.
    vmstat: Option<std::fs::File>,
    /// Recent readings of that counter, oldest first, about a second
    /// apart and at most [`OOM_LOOKBACK`] old (the counter is host-wide:
    /// only a kill close to a target's death is blamed for it).
    oom_seen: VecDeque<(Instant, u64)>,
    /// PIDs a window was already kept for (a death is seen twice: by the
    /// waiter and by the sampler).
    recorded: BTreeSet<u32>,
    rss: Vec<(u32, u64)>,
    gpu: GpuSample,
    /// A CUDA OOM window waiting for its tail.
    pending: Option<PendingWindow>,
}

/// A reported CUDA OOM whose window is kept once its tail is recorded.
struct PendingWindow {
    /// When the report arrived (Unix seconds): the window's moment.
    at: f64,
    pid: Option<u32>,
    summary: Option<String>,
    until: Instant,
}

/// Why a flight window is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cause {
    /// Killed by a signal.
    Signal,
    /// Left while the kernel's OOM killer acted.
    OomKill,
    /// Reported a CUDA out-of-memory error.
    CudaOom,
}

impl Cause {
    /// The window's `reason` as the document writes it.
    fn as_str(self) -> &'static str {
        match self {
            Cause::Signal => "signal",
            Cause::OomKill => "oom_kill",
            Cause::CudaOom => "cuda_oom",
        }
    }
}

/// A death worth a flight window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Death {
    pub(super) cause: Cause,
    pub(super) pid: Option<u32>,
    pub(super) exit: Option<Exit>,
}

/// One point of the ring: each process's RSS and, when `gpu` is given,
/// its GPU memory (summed over devices).
fn point(t: f64, rss: impl Iterator<Item = (u32, u64)>, gpu: Option<&GpuSample>) -> FlightPoint {
    let mut point = FlightPoint {
        t,
        ..FlightPoint::default()
    };
    for (pid, rss) in rss {
        // A process whose memory reads 0 is being torn down (a SIGKILL's
        // exit released its pages): it no longer holds anything, and a
        // point with it would read as a live tree at 0 MiB.
        if rss == 0 {
            continue;
        }
        let gpu: u64 = gpu.map_or(0, |g| {
            g.processes
                .iter()
                .filter(|p| p.pid == pid)
                .filter_map(|p| p.used)
                .sum()
        });
        point.cpu_mb += rss as f64 / MIB;
        point.gpu_mb += gpu as f64 / MIB;
        point
            .processes
            .push([f64::from(pid), rss as f64 / MIB, gpu as f64 / MIB]);
    }
    point
}

/// Keeps one empty point after the last one with processes: it marks the
/// death; more only repeat it while the kernel tears the process down.
fn trim_after_death(mut points: Vec<FlightPoint>) -> Vec<FlightPoint> {
    if let Some(last) = points.iter().rposition(|p| !p.processes.is_empty()) {
        points.truncate((last + 2).min(points.len()));
    }
    points
}

/// What the log says when a window is kept.
fn describe(cause: Cause, pid: Option<u32>, exit: Option<Exit>) -> String {
    let pid = pid.unwrap_or(0);
    match cause {
        Cause::Signal => format!(
            "PID {pid} died by {}",
            exit.and_then(|e| e.signal)
                .map(sys::signal_name)
                .unwrap_or_default()
        ),
        Cause::OomKill => format!("the kernel's OOM killer acted as PID {pid} left"),
        Cause::CudaOom => format!("PID {pid} reported a CUDA out-of-memory error"),
    }
}

impl Flight {
    /// A recorder reading every `interval` and keeping `window` of it.
    /// `oom_counter` is the job's own cgroup counter when there is one;
    /// else the host-wide one in `proc_root`, blamed only for a death
    /// close to a kill.
    pub(super) fn new(
        (interval, window): (Duration, Duration),
        tick: Duration,
        oom_counter: Option<PathBuf>,
        proc_root: &Path,
    ) -> Flight {
        let mut f = Flight {
            interval,
            capacity: ((window.as_secs_f64() / interval.as_secs_f64()).ceil() as usize).max(1),
            ring: VecDeque::new(),
            fast: interval < tick,
            next: Instant::now() + interval,
            vmstat: oom_counter
                .and_then(|p| std::fs::File::open(p).ok())
                .or_else(|| std::fs::File::open(proc_root.join("vmstat")).ok()),
            oom_seen: Default::default(),
            recorded: Default::default(),
            rss: Vec::new(),
            gpu: Default::default(),
            pending: None,
        };
        f.note_oom_kills(Instant::now());
        f
    }

    fn push(&mut self, point: FlightPoint) {
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(point);
    }

    /// Adds a timer sample to the ring.
    pub(super) fn push_sample(&mut self, sample: &Sample) {
        self.note_oom_kills(Instant::now());
        let rss = sample.host.processes.iter().map(|r| (r.pid, r.rss));
        self.push(point(sample.timestamp, rss, Some(&sample.gpu)));
    }

    /// The kernel's `oom_kill` counter now.
    fn read_oom_kills(&self) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let f = self.vmstat.as_ref()?;
        let mut buf = vec![0u8; 16 * 1024];
        let n = f.read_at(&mut buf, 0).ok()?;
        std::str::from_utf8(&buf[..n])
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))?
            .trim()
            .parse()
            .ok()
    }

    /// Keeps the counter's history fresh: a reading a second, the oldest
    /// dropped once a newer one is itself [`OOM_LOOKBACK`] old.
    fn note_oom_kills(&mut self, now: Instant) {
        if self
            .oom_seen
            .back()
            .is_some_and(|(at, _)| now.duration_since(*at) < Duration::from_secs(1))
        {
            return;
        }
        let Some(v) = self.read_oom_kills() else {
            return;
        };
        self.oom_seen.push_back((now, v));
        while self.oom_seen.len() > 2
            && self
                .oom_seen
                .get(1)
                .is_some_and(|(at, _)| now.duration_since(*at) >= OOM_LOOKBACK)
        {
            self.oom_seen.pop_front();
        }
    }

    /// Whether the kernel's OOM killer acted in the last few seconds. A
    /// kill is blamed once: the history restarts from now.
    fn oom_killed(&mut self, now: Instant) -> bool {
        let Some(current) = self.read_oom_kills() else {
            return false;
        };
        let killed = self.oom_seen.front().is_some_and(|&(_, v)| current > v);
        if killed {
            self.oom_seen.clear();
            self.oom_seen.push_back((now, current));
        }
        killed
    }

    /// What a record says about a death worth a flight window.
    pub(super) fn death(&mut self, record: &Record) -> Option<Death> {
        match record {
            Record::Exit { pid, exit, .. } if exit.signal.is_some() => Some(Death {
                cause: Cause::Signal,
                pid: Some(*pid),
                exit: Some(*exit),
            }),
            Record::Sample { sample, .. } if !sample.host.left.is_empty() => {
                let left = &sample.host.left;
                let by_signal = left.iter().find_map(|l| {
                    l.exit.filter(|e| e.signal.is_some()).map(|e| Death {
                        cause: Cause::Signal,
                        pid: Some(l.id.pid),
                        exit: Some(e),
                    })
                });
                // The kernel's OOM killer leaves no exit status we can read
                // for a grandchild, but it counts its kills (host-wide: only
                // a recent kill, and only a target whose end is unknown).
                by_signal.or_else(|| {
                    let victim = left.iter().find(|l| l.exit.is_none())?;
                    self.oom_killed(Instant::now()).then_some(Death {
                        cause: Cause::OomKill,
                        pid: Some(victim.id.pid),
                        exit: victim.exit,
                    })
                })
            }
            _ => None,
        }
    }

    /// The ring as a window for `death`, or `None` when one was already
    /// kept for its PID. `name` is the process's; `at` the window's moment
    /// (now when `None`).
    pub(super) fn window(
        &mut self,
        death: Death,
        name: String,
        cuda_summary: Option<String>,
        at: Option<f64>,
    ) -> Option<FlightWindow> {
        if let Some(p) = death.pid {
            if !self.recorded.insert(p) {
                return None;
            }
        }
        let window = FlightWindow {
            reason: death.cause.as_str().into(),
            timestamp: at.unwrap_or_else(unix_now),
            pid: death.pid,
            name,
            exit: death.exit,
            interval_s: self.interval.as_secs_f64(),
            points: trim_after_death(self.ring.iter().cloned().collect()),
            cuda_summary,
        };
        tracing::warn!(
            "{}: kept the last {:.1} s of memory ({} points) in the flight recorder",
            describe(death.cause, death.pid, death.exit),
            window.points.len() as f64 * window.interval_s,
            window.points.len()
        );
        Some(window)
    }

    /// One fast read into the ring, between timer ticks.
    pub(super) fn tick(&mut self, sampler: &mut Sampler, now: Instant) {
        let gpu_ok = sampler.peek(&mut self.rss, &mut self.gpu);
        let p = point(
            unix_now(),
            self.rss.iter().copied(),
            gpu_ok.then_some(&self.gpu),
        );
        self.push(p);
        self.next = self.next.max(now) + self.interval;
    }

    /// Opens a CUDA OOM window: the process still holds its memory while
    /// the error unwinds, and NVML's per-process figures lag allocations
    /// by a tick or two, so it stays open [`OOM_TAIL`] longer.
    pub(super) fn expect_cuda_oom(&mut self, pid: Option<u32>, summary: Option<String>) {
        self.pending = Some(PendingWindow {
            at: unix_now(),
            pid,
            summary,
            until: Instant::now() + OOM_TAIL,
        });
    }

    /// The pending CUDA OOM window, once it is due: its tail recorded, its
    /// process no longer `followed`, or the run ending (`now`). Returns
    /// the death, the allocator's summary and the report's moment.
    pub(super) fn settle(
        &mut self,
        now: bool,
        followed: impl Fn(u32) -> bool,
    ) -> Option<(Death, Option<String>, f64)> {
        let p = self.pending.as_ref()?;
        let gone = p.pid.is_some_and(|pid| !followed(pid));
        if !(now || gone || Instant::now() >= p.until) {
            return None;
        }
        let p = self.pending.take()?;
        let death = Death {
            cause: Cause::CudaOom,
            pid: p.pid,
            exit: None,
        };
        Some((death, p.summary, p.at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::gpu::ProcessReading;

    fn recorder(dir: &Path, capacity_points: u32) -> Flight {
        let interval = Duration::from_millis(100);
        Flight::new(
            (interval, interval * capacity_points),
            Duration::from_secs(1),
            None,
            dir,
        )
    }

    fn alive(t: f64) -> FlightPoint {
        FlightPoint {
            t,
            processes: vec![[1.0, 1.0, 0.0]],
            ..FlightPoint::default()
        }
    }

    #[test]
    fn a_flight_window_ends_one_point_after_the_death() {
        let point = |n: usize| FlightPoint {
            processes: vec![[1.0, 1.0, 0.0]; n],
            ..FlightPoint::default()
        };
        let kept = trim_after_death(vec![point(1), point(1), point(0), point(0), point(0)]);
        assert_eq!(kept.len(), 3);
        assert_eq!(
            trim_after_death(vec![point(0), point(0)]).len(),
            2,
            "nothing to anchor on"
        );
    }

    #[test]
    fn the_ring_keeps_only_the_last_window_of_points() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = recorder(dir.path(), 3);
        assert!(f.fast, "100 ms is faster than the 1 s tick");
        for t in 0..10 {
            f.push(alive(f64::from(t)));
        }
        let w = f
            .window(
                Death {
                    cause: Cause::Signal,
                    pid: Some(7),
                    exit: Some(Exit::signal(9)),
                },
                "python".into(),
                None,
                Some(42.0),
            )
            .unwrap();
        let ts: Vec<f64> = w.points.iter().map(|p| p.t).collect();
        assert_eq!(ts, [7.0, 8.0, 9.0]);
        assert_eq!(w.reason, "signal");
        assert_eq!(w.timestamp, 42.0);
        assert_eq!(w.name, "python");
        assert_eq!(w.interval_s, 0.1);
    }

    #[test]
    fn a_window_is_kept_once_per_pid() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = recorder(dir.path(), 5);
        f.push(alive(1.0));
        let death = |pid| Death {
            cause: Cause::CudaOom,
            pid,
            exit: None,
        };
        assert!(f
            .window(death(Some(3)), String::new(), None, None)
            .is_some());
        assert!(
            f.window(death(Some(3)), String::new(), None, None)
                .is_none(),
            "the waiter and the sampler both see one death"
        );
        assert!(f
            .window(death(Some(4)), String::new(), None, None)
            .is_some());
        assert!(f.window(death(None), String::new(), None, None).is_some());
        assert!(f.window(death(None), String::new(), None, None).is_some());
    }

    #[test]
    fn a_point_sums_a_process_gpu_memory_over_devices() {
        let mut gpu = GpuSample::default();
        for (pid, used) in [
            (1, Some(100 * MIB as u64)),
            (1, Some(28 * MIB as u64)),
            (2, None),
        ] {
            gpu.processes.push(ProcessReading {
                pid,
                device: 0,
                used,
            });
        }
        let rss = [(1, 64 * MIB as u64), (2, 32 * MIB as u64)];
        let p = point(5.0, rss.iter().copied(), Some(&gpu));
        assert_eq!(p.processes, vec![[1.0, 64.0, 128.0], [2.0, 32.0, 0.0]]);
        assert_eq!((p.cpu_mb, p.gpu_mb), (96.0, 128.0));
        let host_only = point(5.0, rss.iter().copied(), None);
        assert_eq!(host_only.gpu_mb, 0.0, "no GPU figures this read");
    }

    #[test]
    fn a_process_being_torn_down_is_not_a_live_point() {
        // SIGKILL's exit has released the pages: statm reads 0.
        let dying = [(7, 0u64)];
        let p = point(5.0, dying.iter().copied(), None);
        assert!(p.processes.is_empty(), "{:?}", p.processes);
        let mixed = [(7, 0u64), (8, 16 * MIB as u64)];
        let p = point(5.0, mixed.iter().copied(), None);
        assert_eq!(p.processes, vec![[8.0, 16.0, 0.0]]);
    }

    #[test]
    fn a_cuda_oom_window_waits_until_its_process_leaves_or_the_run_ends() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = recorder(dir.path(), 5);
        assert!(f.settle(true, |_| true).is_none(), "nothing pending");
        f.expect_cuda_oom(Some(8), Some("table".into()));
        let (death, summary, _) = f.settle(false, |_| false).expect("the process left");
        assert_eq!((death.cause, death.pid), (Cause::CudaOom, Some(8)));
        assert_eq!(summary.as_deref(), Some("table"));
        assert!(f.settle(true, |_| true).is_none(), "kept once");
        f.expect_cuda_oom(None, None);
        assert!(f.settle(true, |_| true).is_some(), "the run ends");
    }

    #[test]
    fn only_a_kill_by_signal_or_an_oom_kill_is_a_death() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = recorder(dir.path(), 5);
        let exit = |exit| Record::Exit {
            pid: 9,
            exit,
            max_rss: None,
        };
        assert_eq!(
            f.death(&exit(Exit::signal(9))),
            Some(Death {
                cause: Cause::Signal,
                pid: Some(9),
                exit: Some(Exit::signal(9)),
            })
        );
        assert_eq!(f.death(&exit(Exit::code(1))), None, "a plain exit");
        let finish = Record::Finish {
            timestamp: 1.0,
            exit: Some(Exit::signal(9)),
        };
        assert_eq!(f.death(&finish), None);
    }

    #[test]
    fn only_a_recent_oom_kill_is_blamed_and_only_once() {
        let dir = tempfile::tempdir().unwrap();
        let vmstat = dir.path().join("vmstat");
        let set = |n: u64| std::fs::write(&vmstat, format!("pgfault 1\noom_kill {n}\n")).unwrap();
        set(5);
        let mut f = recorder(dir.path(), 10);
        let t0 = Instant::now();
        f.note_oom_kills(t0);
        assert!(!f.oom_killed(t0), "nothing happened");
        // A kill elsewhere on the host, long before a target ends.
        set(6);
        for s in 1..=10 {
            f.note_oom_kills(t0 + Duration::from_secs(s));
        }
        assert!(
            !f.oom_killed(t0 + Duration::from_secs(10)),
            "a kill 10 s before is not this death's cause"
        );
        // A kill just before a target vanishes: blamed, once.
        set(7);
        f.note_oom_kills(t0 + Duration::from_secs(11));
        assert!(f.oom_killed(t0 + Duration::from_millis(11_200)));
        assert!(!f.oom_killed(t0 + Duration::from_millis(11_300)));
    }
}
