//! Log entries → ClearML scalar points, as a pure fold (no I/O, no clock
//! except the one passed in).
//!
//! Each forwarded entry becomes up to six points under the title
//! `memory/<component>`, one per figure of `detailed_log`
//! (`FIELDS`); an entry without any GPU figure (no GPU, no driver) gives
//! only its two host figures. Timer samples are first folded into windows of
//! `timer_every` per component (the maximum of each figure is kept, so no
//! peak is lost); marks and system entries are all forwarded.
//!
//! **Iterations and collisions.** A point's `iter` is the entry's own
//! `iteration` when the job sent one (so memtrack's charts line up with the
//! job's), else a per-run measurement counter that grows by one for every
//! forwarded entry. ClearML stores one point per (title, series, iter) and
//! silently overwrites a repeat, so memtrack sends each at most once: when
//! a later entry lands on a (title, iter) already taken — e.g.
//! `before_generate` and `after_generate` both at iteration 17 of `model` —
//! its figures go to the series `<field>:<operation>`
//! (`gpu_ram_used_mb:after_generate`) at the same iter; if that is taken
//! too, the entry's points are dropped and counted as duplicates.
//!
//! **The job's own task.** When memtrack reports into the task the job's
//! ClearML SDK made, its points must not move that task's iteration axis
//! (a scalar's `iter` raises the task's `last_iteration`). There the
//! converter runs on the job's axis only (`Converter::use_job_axis`): an
//! entry without an iteration is placed at the iteration the job had
//! reached when it was taken (its marks before it in time, and the task's
//! `last_iteration` the reporter reads from the server; a sample arriving
//! after its iteration's point went out is left out when that point covers
//! it, else goes where the job is now), and every entry of a component at one iteration — its
//! marks and the timer samples taken while the job is there — goes into
//! one window, so each iteration gets one point per figure and component,
//! holding the maxima: one series per figure, with no `:<operation>` or
//! `:timer` series beside it. An entry arriving after its iteration's
//! point went out (a mark with that iteration, or a sample when the job
//! is still there: the run's end closed the window while it was on its
//! way) is left out when the point sent holds its figures, else takes the
//! collision rule above: no key is sent twice.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::export::reached::{self, Reached};
use crate::model::{Entry, EntryKind, GpuSource};

/// The series reported for every entry: the four base figures, then
/// memtrack's NVML and high-water-mark figures.
pub(crate) const FIELDS: [&str; 6] = [
    "cpu_ram_used_mb",
    "gpu_ram_used_mb",
    "gpu_ram_peak_mb",
    "reserved_gpu_ram_mb",
    "gpu_process_used_mb",
    "cpu_ram_hwm_mb",
];

/// The places in [`FIELDS`] of the GPU figures.
const GPU_FIELDS: [usize; 4] = [1, 2, 3, 4];

/// Title prefix: `memory/<component>`.
pub(crate) const TITLE_PREFIX: &str = "memory/";

/// One scalar, without its task (added when sent). This is also the line
/// format of the spool file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub(crate) metric: String,
    pub(crate) variant: String,
    pub(crate) value: f64,
    pub(crate) iter: u64,
    /// Unix milliseconds.
    pub(crate) timestamp: i64,
}

/// Folds `e` into `acc`, keeping the maximum of each figure (NaN-safe:
/// `f64::max` ignores a NaN operand).
fn fold_max(acc: &mut Entry, e: &Entry) {
    acc.absorb_max(e);
    acc.timestamp_end = Some(e.timestamp);
    acc.samples = Some(acc.samples.unwrap_or(1) + e.samples.unwrap_or(1));
}

/// Timer samples of one component waiting for their window to end.
#[derive(Debug)]
struct Window {
    /// Entry time of the first sample (Unix seconds).
    start: f64,
    /// When it was opened, on this machine's clock.
    opened: Instant,
    acc: Entry,
}

/// What the converter dropped, for the final report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Dropped {
    pub(crate) duplicates: u64,
    pub(crate) non_finite: u64,
}

/// The fold: feed entries in, get points out.
#[derive(Debug)]
pub struct Converter {
    timer_every: Duration,
    windows: BTreeMap<String, Window>,
    counter: u64,
    /// Interned titles and operations, so the taken-key set stays small.
    titles: HashMap<String, u32>,
    operations: HashMap<String, u32>,
    /// (title, alternative: 0 = the plain series, else operation + 1, iter).
    taken: HashSet<(u32, u32, u64)>,
    pub(crate) dropped: Dropped,
    duplicate_logged: bool,
    /// Report on the job's iteration axis only (see the module doc).
    job_axis: bool,
    /// The job's latest entries with an iteration, by time, and (as the
    /// floor) the task's `last_iteration` read from the server (see
    /// [`Converter::iteration_at`]).
    reached: Reached,
    /// The run's start (Unix seconds) while the job axis falls back to
    /// time: the job has reported no iteration yet (see the module doc).
    time_from: Option<f64>,
    /// The time axis to take up once the job has reported no iteration
    /// by its `after` (see [`TimeAxis`]).
    time_pending: Option<TimeAxis>,
    /// The largest iteration sent on the time axis: the task's
    /// `last_iteration` up to it is memtrack's own, not the job's.
    time_max: u64,
    /// On the job axis, each component's last window sent: a later entry
    /// for the same iteration that it covers adds nothing.
    last_sent: HashMap<String, Entry>,
}

/// When a job that reports no iteration gets a time axis: its points then
/// go at the whole seconds since `from` (the run's start), once entries
/// reach `after` (Unix seconds) without an iteration from the job, as
/// ClearML's own monitor waits for a first iteration before it falls back
/// to seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TimeAxis {
    pub(crate) from: f64,
    pub(crate) after: f64,
}

/// The largest `iter` a ClearML server stores (a signed 64-bit integer).
pub(crate) const MAX_ITER: u64 = i64::MAX as u64;

impl Converter {
    pub fn new(timer_every: Duration) -> Self {
        Converter {
            timer_every,
            windows: BTreeMap::new(),
            counter: 0,
            titles: HashMap::new(),
            operations: HashMap::new(),
            taken: HashSet::new(),
            dropped: Dropped::default(),
            duplicate_logged: false,
            job_axis: false,
            reached: Reached::default(),
            time_from: None,
            time_pending: None,
            time_max: 0,
            last_sent: HashMap::new(),
        }
    }

    /// From now on, report on the job's iteration axis only. With `time`,
    /// a job that has reported no iteration by `time.after` gets the time
    /// axis instead ([`TimeAxis`]); so does one that reported none by the
    /// end of the run.
    pub(crate) fn use_job_axis(&mut self, time: Option<TimeAxis>) {
        self.job_axis = true;
        self.time_pending = time.filter(|t| t.from.is_finite() && t.after.is_finite());
    }

    /// Takes up the pending time axis when the job still reported no
    /// iteration (`force`: the end of the run; else once `ts` reaches its
    /// `after`). The windows open at iteration 0 then close with time.
    fn time_axis_due(&mut self, ts: f64, force: bool) {
        let Some(t) = self.time_pending else {
            return;
        };
        if self.job_iter() > 0 || !(force || ts >= t.after) {
            return;
        }
        self.time_pending = None;
        self.time_from = Some(t.from);
        for w in self.windows.values_mut() {
            if w.acc.iteration == Some(0) {
                w.acc.iteration = None;
            }
        }
    }

    /// Whether points go on the time axis now.
    pub(crate) fn on_time_axis(&self) -> bool {
        self.job_axis && self.time_from.is_some()
    }

    /// The task's `last_iteration` on the server is `iter`. On the time
    /// axis only a value beyond memtrack's own points is the job's.
    pub(crate) fn raise_axis(&mut self, iter: u64) {
        if self.on_time_axis() && iter <= self.time_max {
            return;
        }
        if iter > 0 {
            self.time_pending = None;
        }
        self.reached.raise_floor(iter.min(MAX_ITER));
        self.leave_time_axis();
    }

    /// A job's entry of time `ts` carried `iter`: the job has an iteration
    /// axis.
    fn job_reached(&mut self, iter: u64, ts: f64) {
        self.time_pending = None;
        let iter = iter.min(MAX_ITER);
        if ts.is_finite() {
            self.reached.keep(reached::micros(ts), iter);
        } else {
            self.reached.raise_floor(iter);
        }
        self.leave_time_axis();
    }

    /// The iteration the job had reached at `ts`: the largest among its
    /// entries strictly before `ts` (an entry of that very instant comes
    /// after it in the run's log), whatever order they arrived in. A timer
    /// sample is stamped when its read begins, and the read can end after
    /// a later mark reached memtrack.
    fn iteration_at(&self, ts: f64) -> u64 {
        if !ts.is_finite() {
            return self.job_iter();
        }
        self.reached.largest_before(reached::micros(ts))
    }

    /// The iteration an entry without one goes to: the one the job was at
    /// when the entry was taken, unless that iteration's point already went
    /// out. The server would only take the entry as a second point then, so
    /// one that raises none of that point's figures is left out (None), and
    /// one that raises a figure goes where the job is now, so that no peak
    /// is lost.
    fn iteration_for(&self, e: &Entry) -> Option<u64> {
        let at = self.iteration_at(e.timestamp);
        if at >= self.job_iter() || !self.sent_at(&e.component, at) {
            return Some(at);
        }
        if self.covers_late(e, at) {
            None
        } else {
            Some(self.job_iter())
        }
    }

    /// Whether the last point sent for `e`'s component is at `iter` and
    /// holds every figure of `e` already (a figure that is not a number
    /// raises nothing): `e` came late and adds nothing.
    fn covers_late(&self, e: &Entry, iter: u64) -> bool {
        self.last_sent
            .get(&e.component)
            .filter(|l| l.iteration == Some(iter))
            .is_some_and(|l| {
                let sent = l.figures.as_array();
                e.figures
                    .as_array()
                    .iter()
                    .zip(sent)
                    .all(|(v, s)| v.partial_cmp(&s) != Some(std::cmp::Ordering::Greater))
            })
    }

    /// The job has an iteration axis after all: the windows the time axis
    /// left open go where the job is now, and close once it moves on, like
    /// every window of the job's axis. (Closed by time instead, such a
    /// window's point went out with no iteration to remember it by, and
    /// every later entry at that iteration became a `:<operation>` point.)
    fn leave_time_axis(&mut self) {
        if self.time_from.take().is_none() {
            return;
        }
        let now = self.job_iter();
        for w in self.windows.values_mut() {
            w.acc.iteration.get_or_insert(now);
        }
    }

    /// The latest iteration the job reached, on the job axis (at any
    /// time: the largest its entries and the server's task carried).
    pub(crate) fn job_iter(&self) -> u64 {
        self.reached.largest()
    }

    #[cfg(test)]
    /// Entries forwarded so far (the next counter value).
    pub(crate) fn forwarded(&self) -> u64 {
        self.counter
    }

    /// Takes one entry; appends the points it releases to `out`. `now` is
    /// the machine's monotonic clock (windows also close after
    /// `timer_every` of wall time, so a quiet component is not held back).
    pub fn push(&mut self, e: Entry, now: Instant, out: &mut Vec<Point>) {
        if let Some(i) = e.iteration {
            self.job_reached(i, e.timestamp);
        }
        self.time_axis_due(e.timestamp, false);
        // Any entry's time closes the windows it has passed.
        self.close_passed(e.timestamp, now, out);
        let iteration_axis = self.job_axis && !self.on_time_axis();
        if iteration_axis {
            self.fold_at_iteration(e, now, out);
            return;
        }
        // On the time axis a component's marks join its timer window too:
        // one point per figure and window, at the second it began.
        let windowed = e.kind == EntryKind::Timer || self.on_time_axis();
        if !windowed || (self.timer_every.is_zero() && !self.job_axis) {
            self.forward(&e, out);
            return;
        }
        match self.windows.get_mut(&e.component) {
            Some(w) => fold_max(&mut w.acc, &e),
            None => {
                self.windows.insert(
                    e.component.clone(),
                    Window {
                        start: e.timestamp,
                        opened: now,
                        acc: e,
                    },
                );
            }
        }
    }

    /// On the job's iteration axis, every entry of a component — its marks
    /// and the timer samples taken while the job is at an iteration — goes
    /// into one window per iteration, and the window gives one point per
    /// figure (their maxima): one series per figure, each point at its own
    /// iteration. Once the job has moved on, the component's next entry
    /// closes the window (so does [`Converter::close_passed`]). An entry
    /// for an iteration whose point was already sent goes out on its own
    /// (under `<field>:<operation>`, see the module).
    fn fold_at_iteration(&mut self, e: Entry, now: Instant, out: &mut Vec<Point>) {
        let iter = match e.iteration {
            Some(i) => i,
            None => match self.iteration_for(&e) {
                Some(i) => i,
                None => return,
            },
        }
        .min(MAX_ITER);
        if let Some(w) = self.windows.get_mut(&e.component) {
            match w.acc.iteration {
                Some(i) if i < iter => self.close(vec![e.component.clone()], out),
                // A window of the time axis the job has just left goes
                // where the job is.
                None => w.acc.iteration = Some(iter),
                Some(_) => {}
            }
        }
        let sent = self.sent_at(&e.component, iter);
        match self.windows.get_mut(&e.component) {
            Some(w) if w.acc.iteration == Some(iter) => fold_max(&mut w.acc, &e),
            // A late mark (or a sample taken before the component's window
            // moved on), for an iteration already closed: on its own.
            Some(_) => {
                let mut e = e;
                e.iteration = Some(iter);
                self.forward(&e, out);
            }
            // The iteration's point went out already (the end of the run
            // closed it while this entry was on its way, or the job moved
            // on): ClearML keeps one point per key, so the entry is left out
            // when that point holds its figures, else it goes apart under
            // the collision rule; a point is never sent twice.
            None if sent => {
                if !self.covers_late(&e, iter) {
                    let mut e = e;
                    e.iteration = Some(iter);
                    self.forward(&e, out);
                }
            }
            None => {
                let mut acc = e;
                acc.iteration = Some(iter);
                self.windows.insert(
                    acc.component.clone(),
                    Window {
                        start: acc.timestamp,
                        opened: now,
                        acc,
                    },
                );
            }
        }
    }

    /// Whether a point of `component` went out at `iter`.
    fn sent_at(&self, component: &str, iter: u64) -> bool {
        self.titles
            .get(component)
            .is_some_and(|t| self.taken.contains(&(*t, 0, iter)))
    }

    /// Closes windows whose span has passed in entry time (`ts`) or in
    /// machine time (`now`).
    pub(crate) fn close_passed(&mut self, ts: f64, now: Instant, out: &mut Vec<Point>) {
        if self.windows.is_empty() {
            return;
        }
        let every = self.timer_every.as_secs_f64();
        let due: Vec<String> = self
            .windows
            .iter()
            .filter(|(_, w)| {
                let passed =
                    ts >= w.start + every || now.duration_since(w.opened) >= self.timer_every;
                // On the job axis a window closes only once the job has
                // moved past its iteration (a window of the time axis has
                // none and closes with time).
                passed && (!self.job_axis || w.acc.iteration.is_none_or(|i| self.job_iter() > i))
            })
            .map(|(k, _)| k.clone())
            .collect();
        self.close(due, out);
    }

    /// Closes every window (end of the run).
    pub(crate) fn close_all(&mut self, out: &mut Vec<Point>) {
        self.time_axis_due(f64::INFINITY, true);
        let all: Vec<String> = self.windows.keys().cloned().collect();
        self.close(all, out);
    }

    fn close(&mut self, mut keys: Vec<String>, out: &mut Vec<Point>) {
        // Oldest window first, so counters follow time.
        keys.sort_by(|a, b| {
            let ta = self.windows.get(a).map_or(0.0, |w| w.start);
            let tb = self.windows.get(b).map_or(0.0, |w| w.start);
            ta.total_cmp(&tb).then_with(|| a.cmp(b))
        });
        for k in keys {
            if let Some(w) = self.windows.remove(&k) {
                self.forward(&w.acc, out);
                if self.job_axis && w.acc.iteration.is_some() {
                    self.last_sent.insert(k, w.acc);
                }
            }
        }
    }

    fn intern(map: &mut HashMap<String, u32>, s: &str) -> u32 {
        if let Some(id) = map.get(s) {
            return *id;
        }
        let id = u32::try_from(map.len()).unwrap_or(u32::MAX);
        map.insert(s.to_string(), id);
        id
    }

    /// One forwarded entry → its points.
    fn forward(&mut self, e: &Entry, out: &mut Vec<Point>) {
        let iter =
            if let (Some(from), None) = (self.time_from.filter(|_| self.job_axis), e.iteration) {
                // Whole seconds since the run started.
                let t = if e.timestamp.is_finite() {
                    (e.timestamp - from).max(0.0).floor() as u64
                } else {
                    self.time_max
                };
                self.time_max = self.time_max.max(t);
                t
            } else if self.job_axis {
                e.iteration.unwrap_or(self.job_iter())
            } else {
                e.iteration.unwrap_or(self.counter)
            }
            .min(MAX_ITER);
        self.counter += 1;
        let title = Self::intern(&mut self.titles, &e.component);
        let suffix = if self.taken.insert((title, 0, iter)) {
            None
        } else {
            let op = Self::intern(&mut self.operations, &e.operation);
            if self.taken.insert((title, op.saturating_add(1), iter)) {
                Some(e.operation.as_str())
            } else {
                let n = e
                    .figures
                    .as_array()
                    .iter()
                    .filter(|v| v.is_finite())
                    .count() as u64;
                self.dropped.duplicates += n;
                if !self.duplicate_logged {
                    self.duplicate_logged = true;
                    tracing::warn!(
                        "ClearML: {}/{} at iteration {iter} repeats a point already sent for \
                         this title and iteration (also as `<field>:{}`); it is not sent \
                         (further repeats are counted, not logged)",
                        e.component,
                        e.operation,
                        e.operation
                    );
                }
                return;
            }
        };
        self.points(e, iter, suffix, out);
    }

    /// The points of `e` at `iter`, under its figures' series (with
    /// `:<suffix>` when given).
    fn points(&mut self, e: &Entry, iter: u64, suffix: Option<&str>, out: &mut Vec<Point>) {
        let metric = format!("{TITLE_PREFIX}{}", e.component);
        let timestamp = if e.timestamp.is_finite() && e.timestamp > 0.0 {
            (e.timestamp * 1000.0).round() as i64
        } else {
            now_ms()
        };
        // No GPU figures at all (no GPU, no driver): no GPU series of
        // zeros beside the host's.
        let no_gpu = e.gpu_source == GpuSource::None
            && GPU_FIELDS.iter().all(|&i| e.figures.as_array()[i] == 0.0);
        for (i, (field, value)) in FIELDS.iter().zip(e.figures.as_array()).enumerate() {
            if no_gpu && GPU_FIELDS.contains(&i) {
                continue;
            }
            if !value.is_finite() {
                self.dropped.non_finite += 1;
                continue;
            }
            let variant = match suffix {
                None => (*field).to_string(),
                Some(op) => format!("{field}:{op}"),
            };
            out.push(Point {
                metric: metric.clone(),
                variant,
                value,
                iter,
                timestamp,
            });
        }
    }
}

/// The system clock as Unix milliseconds.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;

    fn mark(component: &str, op: &str, ts: f64, iteration: Option<u64>, v: f64) -> Entry {
        Entry {
            component: component.into(),
            operation: op.into(),
            timestamp: ts,
            figures: Figures {
                cpu_ram_used_mb: v,
                gpu_ram_used_mb: v + 1.0,
                ..Figures::default()
            },
            iteration,
            kind: EntryKind::Event,
            ..Entry::default()
        }
    }

    fn timer(component: &str, ts: f64, v: f64) -> Entry {
        Entry {
            kind: EntryKind::Timer,
            operation: "timer".into(),
            ..mark(component, "timer", ts, None, v)
        }
    }

    /// The points of `entries` on the job's axis, to the end of the run.
    fn on_the_job_axis(entries: Vec<Entry>) -> Vec<Point> {
        let mut c = Converter::new(Duration::from_secs(1));
        c.use_job_axis(None);
        let mut out = run(&mut c, entries);
        c.close_all(&mut out);
        out
    }

    /// A title's `cpu_ram_used_mb` points, as (iteration, MiB).
    fn host_of(out: &[Point], title: &str) -> Vec<(u64, f64)> {
        out.iter()
            .filter(|p| p.metric == title && p.variant == "cpu_ram_used_mb")
            .map(|p| (p.iter, p.value))
            .collect()
    }

    fn run(c: &mut Converter, entries: Vec<Entry>) -> Vec<Point> {
        let now = Instant::now();
        let mut out = Vec::new();
        for e in entries {
            c.push(e, now, &mut out);
        }
        out
    }

    #[test]
    fn a_mark_becomes_six_points_in_milliseconds() {
        let mut c = Converter::new(Duration::ZERO);
        let pts = run(
            &mut c,
            vec![mark("model", "load", 1_733_000_000.123_4, Some(7), 10.0)],
        );
        assert_eq!(pts.len(), 6);
        assert!(pts
            .iter()
            .all(|p| p.metric == "memory/model" && p.iter == 7));
        assert_eq!(pts[0].timestamp, 1_733_000_000_123);
        assert_eq!(pts[0].variant, "cpu_ram_used_mb");
        assert_eq!(pts[1].value, 11.0);
        assert_eq!(pts[5].variant, "cpu_ram_hwm_mb");
    }

    #[test]
    fn without_an_iteration_the_run_counter_is_used() {
        let mut c = Converter::new(Duration::ZERO);
        let pts = run(
            &mut c,
            vec![
                mark("a", "x", 1.0, None, 1.0),
                mark("b", "x", 2.0, Some(100), 1.0),
                mark("a", "y", 3.0, None, 1.0),
            ],
        );
        let iters: Vec<u64> = pts.iter().step_by(6).map(|p| p.iter).collect();
        assert_eq!(iters, vec![0, 100, 2]);
        assert_eq!(c.forwarded(), 3);
    }

    #[test]
    fn collisions_move_to_the_operation_series_then_drop() {
        let mut c = Converter::new(Duration::ZERO);
        let pts = run(
            &mut c,
            vec![
                mark("model", "before_generate", 1.0, Some(17), 1.0),
                mark("model", "after_generate", 2.0, Some(17), 2.0),
                mark("model", "after_generate", 3.0, Some(17), 3.0),
                mark("data", "after_generate", 3.0, Some(17), 3.0),
            ],
        );
        let names: Vec<&str> = pts.iter().step_by(6).map(|p| p.variant.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "cpu_ram_used_mb",
                "cpu_ram_used_mb:after_generate",
                "cpu_ram_used_mb"
            ]
        );
        assert_eq!(c.dropped.duplicates, 6);
        let mut keys: Vec<_> = pts
            .iter()
            .map(|p| (&p.metric, &p.variant, p.iter))
            .collect();
        keys.sort();
        let n = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), n, "every (metric, variant, iter) once");
    }

    #[test]
    fn non_finite_values_are_skipped_and_counted() {
        let mut c = Converter::new(Duration::ZERO);
        let mut e = mark("m", "x", 1.0, Some(1), f64::NAN);
        e.figures.reserved_gpu_ram_mb = f64::INFINITY;
        let pts = run(&mut c, vec![e]);
        assert_eq!(pts.len(), 3);
        assert_eq!(c.dropped.non_finite, 3);
    }

    #[test]
    fn timer_windows_keep_the_maxima() {
        let mut c = Converter::new(Duration::from_secs(1));
        let mut pts = run(
            &mut c,
            vec![
                timer("system", 10.0, 5.0),
                timer("system", 10.3, 9.0),
                timer("model", 10.4, 1.0),
                timer("system", 10.6, 7.0),
                // Passes the first window of both components.
                timer("system", 11.0, 2.0),
            ],
        );
        // system [10, 11) and model [10.4, …) — model's is not yet over.
        assert_eq!(pts.len(), 6);
        assert_eq!(pts[0].value, 9.0);
        assert_eq!(pts[0].timestamp, 10_000);
        assert_eq!(pts[0].iter, 0);
        c.close_all(&mut pts);
        let firsts: Vec<(String, f64, u64)> = pts
            .iter()
            .step_by(6)
            .map(|p| (p.metric.clone(), p.value, p.iter))
            .collect();
        assert_eq!(
            firsts,
            vec![
                ("memory/system".to_string(), 9.0, 0),
                ("memory/model".to_string(), 1.0, 1),
                ("memory/system".to_string(), 2.0, 2),
            ]
        );
    }

    #[test]
    fn a_mark_closes_passed_windows_and_wall_time_does_too() {
        let mut c = Converter::new(Duration::from_secs(1));
        let t0 = Instant::now();
        let mut out = Vec::new();
        c.push(timer("system", 10.0, 1.0), t0, &mut out);
        c.push(mark("model", "x", 10.5, None, 1.0), t0, &mut out);
        assert_eq!(out.len(), 6, "the mark only");
        c.push(mark("model", "y", 11.5, None, 1.0), t0, &mut out);
        assert_eq!(out.len(), 18, "window closed before the second mark");
        c.push(timer("system", 20.0, 1.0), t0, &mut out);
        c.close_passed(0.0, t0 + Duration::from_millis(999), &mut out);
        assert_eq!(out.len(), 18);
        c.close_passed(0.0, t0 + Duration::from_secs(1), &mut out);
        assert_eq!(out.len(), 24);
    }

    #[test]
    fn iterations_beyond_i64_are_clamped() {
        let mut c = Converter::new(Duration::ZERO);
        let pts = run(&mut c, vec![mark("m", "x", 1.0, Some(u64::MAX), 1.0)]);
        assert!(pts.iter().all(|p| p.iter == MAX_ITER), "{pts:?}");
    }

    #[test]
    fn a_window_the_time_axis_left_open_goes_where_the_job_is() {
        // The job reported no iteration by `after`: the time axis. Its
        // first iteration (7, read from the server) comes while a window
        // of the time axis is open; the entries after it are at 7 too.
        let mut c = Converter::new(Duration::from_secs(1));
        c.use_job_axis(Some(TimeAxis {
            from: 0.0,
            after: 1.0,
        }));
        let t0 = Instant::now();
        let mut out = Vec::new();
        c.push(timer("system", 1.5, 100.0), t0, &mut out);
        assert!(c.on_time_axis());
        c.raise_axis(7);
        assert!(!c.on_time_axis());
        // Time passes; the job is still at 7, so its window stays open.
        c.close_passed(10.0, t0 + Duration::from_secs(5), &mut out);
        c.push(timer("system", 10.0, 130.0), t0, &mut out);
        c.push(
            mark("system", "experiment_end", 10.5, None, 90.0),
            t0,
            &mut out,
        );
        c.close_all(&mut out);
        let host: Vec<(&str, u64, f64)> = out
            .iter()
            .filter(|p| p.variant.starts_with("cpu_ram_used_mb"))
            .map(|p| (p.variant.as_str(), p.iter, p.value))
            .collect();
        assert_eq!(host, vec![("cpu_ram_used_mb", 7, 130.0)], "{out:?}");
    }

    #[test]
    fn a_sample_read_before_the_jobs_next_step_stays_with_the_step_before() {
        // Timer samples are stamped when their read begins and can reach
        // the converter after a later mark: the job held 200 MiB at
        // iteration 1 and 120 at iteration 2.
        let out = on_the_job_axis(vec![
            timer("system", 9.9, 60.0),
            mark("train", "before_step", 10.0, Some(1), 200.0),
            mark("train", "before_step", 11.0, Some(2), 120.0),
            // Read at 10.5 (iteration 1), arrived after iteration 2's mark:
            // iteration 1's point of `train` went out at 200, which covers it.
            timer("train", 10.5, 180.0),
            // `system` has no point at iteration 1 yet: it goes there.
            timer("system", 10.6, 70.0),
            timer("system", 11.5, 65.0),
            mark("train", "before_step", 12.0, Some(3), 110.0),
        ]);
        // Iteration 2 shows what the job held there, not iteration 1's
        // sample (it showed 180 before).
        assert_eq!(
            host_of(&out, "memory/train"),
            vec![(1, 200.0), (2, 120.0), (3, 110.0)]
        );
        assert_eq!(
            host_of(&out, "memory/system"),
            vec![(0, 60.0), (1, 70.0), (2, 65.0)]
        );
        assert!(out.iter().all(|p| !p.variant.contains(':')), "{out:?}");
    }

    #[test]
    fn a_late_sample_above_its_steps_point_goes_where_the_job_is() {
        // Its own iteration's point went out, and the server keeps one
        // point per iteration: the peak goes to the job's iteration now.
        let out = on_the_job_axis(vec![
            mark("train", "before_step", 10.0, Some(1), 100.0),
            mark("train", "before_step", 11.0, Some(2), 120.0),
            timer("train", 10.5, 150.0),
        ]);
        assert_eq!(host_of(&out, "memory/train"), vec![(1, 100.0), (2, 150.0)]);
    }

    #[test]
    fn the_job_axis_never_goes_beyond_the_jobs_iteration() {
        let mut c = Converter::new(Duration::from_secs(1));
        c.use_job_axis(None);
        let t0 = Instant::now();
        let mut out = Vec::new();
        // Before the job reports anything: iteration 0.
        c.push(mark("model", "load", 1.0, None, 1.0), t0, &mut out);
        c.push(timer("system", 1.0, 5.0), t0, &mut out);
        c.push(timer("system", 3.0, 9.0), t0, &mut out);
        // Time passed, but the job is still at iteration 0: the window
        // stays open and keeps the maximum.
        c.close_passed(10.0, t0 + Duration::from_secs(5), &mut out);
        assert_eq!(out.len(), 0, "iteration 0 is still open: {out:?}");
        // The task's last iteration, read from the server, moves on.
        c.raise_axis(4);
        c.close_passed(10.0, t0 + Duration::from_secs(5), &mut out);
        assert_eq!(out.len(), 12);
        assert_eq!((out[6].iter, out[6].value), (0, 9.0));
        c.push(timer("system", 11.0, 2.0), t0, &mut out);
        c.push(mark("model", "step", 12.0, Some(7), 1.0), t0, &mut out);
        c.push(mark("model", "after", 13.0, None, 1.0), t0, &mut out);
        c.close_all(&mut out);
        let iters: Vec<(String, u64)> = out
            .iter()
            .step_by(6)
            .map(|p| (p.metric.clone(), p.iter))
            .collect();
        // The step's mark and the one after it share iteration 7: one
        // point per figure, no `:after` series.
        assert_eq!(
            iters,
            vec![
                ("memory/model".into(), 0),
                ("memory/system".into(), 0),
                ("memory/system".into(), 4),
                ("memory/model".into(), 7),
            ]
        );
        assert!(out.iter().all(|p| !p.variant.contains(':')), "{out:?}");
        assert!(out.iter().all(|p| p.iter <= c.job_iter()));
    }

    #[test]
    fn a_timer_point_holds_only_the_samples_of_its_own_iteration() {
        // Steps shorter than the timer window: a sample taken in step 2
        // must not raise the point of step 1.
        let mut c = Converter::new(Duration::from_secs(10));
        c.use_job_axis(None);
        let t0 = Instant::now();
        let mut out = Vec::new();
        c.push(
            mark("train", "before_step", 1.0, Some(1), 100.0),
            t0,
            &mut out,
        );
        c.push(timer("system", 1.2, 130.0), t0, &mut out);
        c.push(
            mark("train", "before_step", 1.5, Some(2), 120.0),
            t0,
            &mut out,
        );
        c.push(timer("system", 1.7, 204.0), t0, &mut out);
        c.push(
            mark("train", "before_step", 2.0, Some(3), 120.0),
            t0,
            &mut out,
        );
        c.close_all(&mut out);
        let system: Vec<(u64, f64)> = out
            .iter()
            .filter(|p| p.metric == "memory/system" && p.variant == "cpu_ram_used_mb")
            .map(|p| (p.iter, p.value))
            .collect();
        assert_eq!(system, vec![(1, 130.0), (2, 204.0)]);
    }

    #[test]
    fn an_entry_after_its_iterations_point_went_out_never_sends_that_point_twice() {
        // The run's end closed the windows while the last sample and
        // `experiment_end` were on their way: the sample raises the host
        // figure and goes apart, `experiment_end` adds nothing and is left
        // out; no key is sent twice (the server would overwrite the first).
        let mut c = Converter::new(Duration::from_secs(10));
        c.use_job_axis(None);
        let t0 = Instant::now();
        let mut out = Vec::new();
        c.push(
            mark("train", "before_step", 1.0, Some(7), 100.0),
            t0,
            &mut out,
        );
        c.push(timer("system", 1.1, 130.0), t0, &mut out);
        c.close_all(&mut out);
        let sent = out.len();
        c.push(timer("system", 1.2, 150.0), t0, &mut out);
        c.push(
            mark("system", "experiment_end", 1.3, None, 120.0),
            t0,
            &mut out,
        );
        c.close_all(&mut out);
        let late: Vec<(&str, &str, u64, f64)> = out[sent..]
            .iter()
            .map(|p| (p.metric.as_str(), p.variant.as_str(), p.iter, p.value))
            .filter(|p| p.1.starts_with("cpu_ram_used_mb"))
            .collect();
        assert_eq!(late, [("memory/system", "cpu_ram_used_mb:timer", 7, 150.0)]);
        let mut keys = HashSet::new();
        assert!(
            out.iter()
                .all(|p| keys.insert((&p.metric, &p.variant, p.iter))),
            "{out:?}"
        );
        assert_eq!(c.dropped.duplicates, 0);
    }

    #[test]
    fn a_job_without_iterations_gets_seconds_since_the_start() {
        let mut c = Converter::new(Duration::from_secs(2));
        c.use_job_axis(Some(TimeAxis {
            from: 100.0,
            after: 100.0,
        }));
        let t0 = Instant::now();
        let mut out = Vec::new();
        c.push(mark("model", "load", 100.5, None, 1.0), t0, &mut out);
        for ts in [101.0, 102.0, 103.0, 104.0, 105.5] {
            c.push(timer("system", ts, ts), t0, &mut out);
        }
        let iters = |out: &[Point]| -> Vec<(String, u64, f64)> {
            out.iter()
                .filter(|p| p.variant == "cpu_ram_used_mb")
                .map(|p| (p.metric.clone(), p.iter, p.value))
                .collect()
        };
        // Windows close with time, each at the second it started.
        assert_eq!(
            iters(&out),
            vec![
                ("memory/model".into(), 0, 1.0),
                ("memory/system".into(), 1, 102.0),
                ("memory/system".into(), 3, 104.0),
            ]
        );
        // The server's last_iteration up to memtrack's own is not the job's.
        c.raise_axis(3);
        assert!(c.on_time_axis());
        // A mark with an iteration: from now on the job's axis.
        c.push(mark("model", "step", 106.0, Some(40), 1.0), t0, &mut out);
        assert!(!c.on_time_axis());
        c.push(timer("system", 107.0, 7.0), t0, &mut out);
        c.close_all(&mut out);
        let got = iters(&out);
        assert_eq!(got.len(), 5, "{got:?}");
        // The mark at its iteration; the window still open goes where the
        // job is (both close at the end, the older first).
        assert_eq!(
            got[3..],
            [
                ("memory/system".into(), 40, 105.5),
                ("memory/model".into(), 40, 1.0)
            ]
        );
        // The task's iteration beyond memtrack's own also ends the time axis.
        let mut c = Converter::new(Duration::from_secs(2));
        c.use_job_axis(Some(TimeAxis {
            from: 100.0,
            after: 100.0,
        }));
        c.push(timer("system", 100.0, 1.0), Instant::now(), &mut Vec::new());
        c.raise_axis(9);
        assert!(!c.on_time_axis());
        assert_eq!(c.job_iter(), 9);
    }

    #[test]
    fn the_time_axis_waits_for_a_first_iteration() {
        let t0 = Instant::now();
        let axis = Some(TimeAxis {
            from: 100.0,
            after: 110.0,
        });
        // An iteration before `after`: the job's axis for good.
        let mut c = Converter::new(Duration::from_secs(1));
        c.use_job_axis(axis);
        let mut out = Vec::new();
        c.push(timer("system", 101.0, 1.0), t0, &mut out);
        c.push(mark("model", "step", 102.0, Some(3), 1.0), t0, &mut out);
        c.push(timer("system", 120.0, 1.0), t0, &mut out);
        c.close_all(&mut out);
        assert!(out.iter().all(|p| p.iter <= 3), "{out:?}");
        assert!(!c.on_time_axis());
        // None by `after`: the window held at iteration 0 closes with time,
        // at its second, and later ones follow.
        let mut c = Converter::new(Duration::from_secs(1));
        c.use_job_axis(axis);
        let mut out = Vec::new();
        c.push(timer("system", 105.0, 1.0), t0, &mut out);
        assert!(!c.on_time_axis());
        c.push(timer("system", 111.0, 2.0), t0, &mut out);
        assert!(c.on_time_axis());
        c.close_all(&mut out);
        let iters: Vec<u64> = out.iter().step_by(6).map(|p| p.iter).collect();
        assert_eq!(iters, vec![5, 11]);
        // A short run without iterations: the time axis at the end.
        let mut c = Converter::new(Duration::from_secs(1));
        c.use_job_axis(axis);
        let mut out = Vec::new();
        c.push(timer("system", 103.0, 1.0), t0, &mut out);
        c.close_all(&mut out);
        assert_eq!(out[0].iter, 3);
    }

    #[test]
    fn zero_every_forwards_every_timer_sample() {
        let mut c = Converter::new(Duration::ZERO);
        let pts = run(
            &mut c,
            (0..5).map(|i| timer("s", f64::from(i), 1.0)).collect(),
        );
        assert_eq!(pts.len(), 30);
    }

    #[test]
    fn without_any_gpu_figure_only_the_host_series_are_sent() {
        let mut c = Converter::new(Duration::ZERO);
        let loaded = mark("model", "load", 1_733_000_000.0, Some(1), 10.0);
        let host_only = Entry {
            figures: Figures {
                gpu_ram_used_mb: 0.0,
                gpu_ram_peak_mb: 0.0,
                reserved_gpu_ram_mb: 0.0,
                gpu_process_used_mb: 0.0,
                cpu_ram_hwm_mb: 12.0,
                ..loaded.figures
            },
            ..loaded
        };
        let pts = run(&mut c, vec![host_only.clone()]);
        let series: Vec<&str> = pts.iter().map(|p| p.variant.as_str()).collect();
        assert_eq!(series, ["cpu_ram_used_mb", "cpu_ram_hwm_mb"]);
        // A GPU that holds nothing yet still has its series.
        let idle_gpu = Entry {
            gpu_source: GpuSource::Nvml,
            iteration: Some(2),
            ..host_only
        };
        assert_eq!(run(&mut c, vec![idle_gpu]).len(), 6);
    }

    #[test]
    fn points_serialize_compactly() {
        let p = Point {
            metric: "memory/model".into(),
            variant: "gpu_ram_used_mb".into(),
            value: 10240.0,
            iter: 17,
            timestamp: 1_733_000_000_000,
        };
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(
            text,
            r#"{"metric":"memory/model","variant":"gpu_ram_used_mb","value":10240.0,"iter":17,"timestamp":1733000000000}"#
        );
        assert_eq!(serde_json::from_str::<Point>(&text).unwrap(), p);
    }
}
