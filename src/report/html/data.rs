//! What the page shows of one run, gathered from its entries one at a
//! time (a million marks cost no more memory than a thousand) and from
//! the rest of its document: each series reduced to columns (`columns`),
//! the marks one per column, the spans of each component as lanes
//! (coarsened when there are too many to draw), the largest processes'
//! lines, and the terminal report's figures as JSON.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use serde_json::Value;

use super::columns::{Bands, Cell, Columns, MAX_COLUMNS};
use crate::model::{Document, Entry, EntryKind, GpuSource, Target};

/// The series of the tree, in this order in [`Bands`].
const SERIES: [&str; 6] = ["host", "hwm", "gpu", "alloc", "reserved", "charge"];

/// Processes drawn with lines of their own (the largest).
pub(crate) const TOP_PROCESSES: usize = 12;
/// Component lanes drawn; further components share one lane.
pub(crate) const MAX_LANES: usize = 64;
/// Span bars held over all lanes before neighbours are merged.
const MAX_BARS: usize = 4000;
/// Spans open at once that are paired; further `before_X` are not.
const MAX_OPEN: usize = 10_000;
/// Longest job-chosen string the page shows, in characters.
pub(crate) const MAX_TEXT: usize = 300;
/// Most rows of any table the page shows (processes, stages, alerts).
pub(crate) const MAX_ROWS: usize = 1000;

/// The name of the lane holding components beyond [`MAX_LANES`].
const OTHER_LANE: &str = "(other components)";

/// A mark, as the page shows it on hover.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct PageMark {
    t: f64,
    component: String,
    operation: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    iteration: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pid: Option<u32>,
    /// Marks in its column (it is the last of them).
    n: u64,
}

/// A column's marks: the last one and how many; the last iteration seen.
#[derive(Debug, Clone, Default)]
struct MarkCell {
    last: Option<PageMark>,
    n: u64,
    iteration: Option<(f64, u64)>,
}

impl Cell for MarkCell {
    fn merge(&mut self, later: MarkCell) {
        if later.last.is_some() {
            self.last = later.last;
        }
        self.n += later.n;
        if later.iteration.is_some() {
            self.iteration = later.iteration;
        }
    }
}

/// A span of a component (one or, coarsened, several merged).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Bar {
    start: f64,
    end: f64,
    /// The operation, or `several` for merged spans of different ones.
    operation: String,
    /// Spans merged into this bar.
    n: u64,
    /// No `after_X` came before the run ended.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    open: bool,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Lane {
    component: String,
    bars: Vec<Bar>,
}

/// Spans rebuilt from `before_X` / `after_X` marks, per component.
#[derive(Debug, Default)]
struct Lanes {
    open: HashMap<(String, String, Option<u32>), Vec<f64>>,
    index: HashMap<String, usize>,
    lanes: Vec<Lane>,
    bars: usize,
    /// Spans closer than this (seconds) merge; none until there are too many.
    gap: Option<f64>,
    first: Option<f64>,
    last: f64,
}

impl Lanes {
    fn observe(&mut self, e: &Entry) {
        self.first.get_or_insert(e.timestamp);
        self.last = self.last.max(e.timestamp);
        if e.kind == EntryKind::Timer {
            return;
        }
        if let Some(op) = e.operation.strip_prefix("before_") {
            // Lanes in the order their first span began.
            self.lane(&e.component);
            let key = (e.component.clone(), op.to_string(), e.pid);
            if self.open.len() < MAX_OPEN || self.open.contains_key(&key) {
                let starts = self.open.entry(key).or_default();
                if starts.len() < MAX_OPEN {
                    starts.push(e.timestamp);
                }
            }
        } else if let Some(op) = e.operation.strip_prefix("after_") {
            let key = (e.component.clone(), op.to_string(), e.pid);
            if let Some(starts) = self.open.get_mut(&key) {
                if let Some(start) = starts.pop() {
                    if starts.is_empty() {
                        self.open.remove(&key);
                    }
                    self.add(&key.0, &key.1, start, e.timestamp, false);
                }
            }
        }
    }

    fn lane(&mut self, component: &str) -> usize {
        if let Some(i) = self.index.get(component) {
            return *i;
        }
        let name = if self.lanes.len() + 1 < MAX_LANES {
            component
        } else {
            OTHER_LANE
        };
        if let Some(i) = self.index.get(name) {
            return *i;
        }
        self.lanes.push(Lane {
            component: name.to_string(),
            bars: Vec::new(),
        });
        let i = self.lanes.len() - 1;
        self.index.insert(name.to_string(), i);
        i
    }

    fn add(&mut self, component: &str, operation: &str, start: f64, end: f64, open: bool) {
        let i = self.lane(component);
        let bar = Bar {
            start,
            end: end.max(start),
            operation: operation.to_string(),
            n: 1,
            open,
        };
        if push_bar(&mut self.lanes[i].bars, bar, self.gap) {
            self.bars += 1;
        }
        while self.bars > MAX_BARS {
            self.coarsen();
        }
    }

    /// Merges spans closer than a gap that doubles each time.
    fn coarsen(&mut self) {
        let span = (self.last - self.first.unwrap_or(self.last)).max(1e-3);
        let gap = self
            .gap
            .map_or(span / MAX_COLUMNS as f64, |g| g * 2.0)
            .max(1e-6);
        self.gap = Some(gap);
        self.bars = 0;
        for lane in &mut self.lanes {
            let mut bars = std::mem::take(&mut lane.bars);
            bars.sort_by(|a, b| a.start.total_cmp(&b.start));
            for b in bars {
                push_bar(&mut lane.bars, b, Some(gap));
            }
            self.bars += lane.bars.len();
        }
    }

    /// Closes what is still open at `end` and hands out the lanes, each
    /// in time order.
    fn finish(mut self, end: f64) -> Vec<Lane> {
        let mut open: Vec<_> = std::mem::take(&mut self.open).into_iter().collect();
        open.sort_by(|a, b| a.0.cmp(&b.0));
        for ((component, operation, _), starts) in open {
            for start in starts {
                self.add(&component, &operation, start, end, true);
            }
        }
        for lane in &mut self.lanes {
            lane.bars.sort_by(|a, b| a.start.total_cmp(&b.start));
        }
        self.lanes
    }
}

/// Appends `bar`, or merges it into the last bar when within `gap`; true
/// when a bar was added.
fn push_bar(bars: &mut Vec<Bar>, bar: Bar, gap: Option<f64>) -> bool {
    if let (Some(g), Some(last)) = (gap, bars.last_mut()) {
        if bar.start <= last.end + g && bar.end >= last.start - g {
            last.start = last.start.min(bar.start);
            last.end = last.end.max(bar.end);
            last.n += bar.n;
            last.open |= bar.open;
            if last.operation != bar.operation {
                "several".clone_into(&mut last.operation);
            }
            return false;
        }
    }
    bars.push(bar);
    true
}

/// Everything gathered from the entries, one at a time.
#[derive(Debug, Default)]
pub(crate) struct Gather {
    series: Bands<6>,
    marks: Columns<MarkCell>,
    lanes: Lanes,
    first: Option<f64>,
    last: Option<f64>,
}

impl Gather {
    pub(crate) fn observe(&mut self, e: &Entry) {
        let t = mid_time(e);
        if t.is_finite() && t > 0.0 {
            self.first = Some(self.first.map_or(t, |f| f.min(t)));
            let end = e.timestamp_end.unwrap_or(e.timestamp).max(e.timestamp);
            self.last = Some(self.last.map_or(end, |l| l.max(end)));
        }
        // The lines go through the readings; `experiment_end` repeats one.
        if !e.repeats_a_reading() {
            let allocator = e.gpu_source == GpuSource::Allocator
                || (e.gpu_source == GpuSource::None
                    && (e.figures.gpu_ram_used_mb > 0.0 || e.figures.reserved_gpu_ram_mb > 0.0));
            self.series.push(
                t,
                [
                    Some(e.figures.cpu_ram_used_mb),
                    (e.figures.cpu_ram_hwm_mb > 0.0).then_some(e.figures.cpu_ram_hwm_mb),
                    Some(e.figures.gpu_process_used_mb),
                    allocator.then_some(e.figures.gpu_ram_used_mb),
                    allocator.then_some(e.figures.reserved_gpu_ram_mb),
                    e.charge_mb,
                ],
            );
        }
        if let Some(cell) = self.marks.at(e.timestamp) {
            if let Some(i) = e.iteration {
                cell.iteration = Some((e.timestamp, i));
            }
            if e.kind != EntryKind::Timer {
                // A thinned entry stands for several.
                cell.n += u64::from(e.samples.unwrap_or(1).max(1));
                cell.last = Some(PageMark {
                    t: e.timestamp,
                    component: clip(&e.component),
                    operation: clip(&e.operation),
                    iteration: e.iteration,
                    pid: e.pid,
                    n: 0,
                });
            }
        }
        self.lanes.observe(e);
    }
}

fn mid_time(e: &Entry) -> f64 {
    match e.timestamp_end {
        Some(end) if end > e.timestamp => (e.timestamp + end) / 2.0,
        _ => e.timestamp,
    }
}

/// A job-chosen string, cut to [`MAX_TEXT`] characters.
pub(crate) fn clip(s: &str) -> String {
    match s.char_indices().nth(MAX_TEXT) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// A process's lines, MiB over seconds since the start (flat `[t, v, …]`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Process {
    pid: u32,
    name: String,
    root: bool,
    peak_rss_mb: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_uss_mb: Option<f64>,
    /// `peak_uss_mb` is an estimate, not a read.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    peak_uss_estimated: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_pss_mb: Option<f64>,
    peak_gpu_mb: f64,
    rss: Vec<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    uss: Vec<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pss: Vec<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    gpu: Vec<f64>,
}

fn process(t: &Target, t0: f64) -> Process {
    let mut main: Bands<2> = Bands::default();
    for p in &t.series {
        main.push(p[0], [Some(p[1]), Some(p[2])]);
    }
    let mut own: Bands<2> = Bands::default();
    for p in &t.own_series {
        own.push(p[0], [Some(p[1]), Some(p[2])]);
    }
    let gpu = if main.max(1).unwrap_or(0.0) > 0.0 {
        main.line(1, t0)
    } else {
        Vec::new()
    };
    Process {
        pid: t.pid,
        name: clip(&t.display_name()),
        root: t.root,
        peak_rss_mb: t.peak_rss_mb,
        peak_uss_mb: t.peak_uss_mb,
        peak_uss_estimated: t.peak_uss_estimated,
        peak_pss_mb: t.peak_pss_mb,
        peak_gpu_mb: t.peak_gpu_mb,
        rss: main.line(0, t0),
        uss: own.line(0, t0),
        pss: own.line(1, t0),
        gpu,
    }
}

/// One run on the page.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunPage {
    /// What the page calls the run (its name, or its folder in a comparison).
    pub(crate) label: String,
    /// Unix time of x = 0.
    t0: f64,
    /// Seconds shown (at least one).
    duration: f64,
    /// Width of one column of the reduced series, seconds.
    column_s: f64,
    /// Entries read from the log (and its complete event log).
    entries: u64,
    /// The tree's series; absent when never measured (`gpu`: all zero).
    series: BTreeMap<&'static str, Vec<f64>>,
    /// The highest value of each series.
    series_peak: BTreeMap<&'static str, f64>,
    marks: Vec<PageMark>,
    marks_total: u64,
    /// `[t, iteration, …]`: the last iteration seen in each column.
    iterations: Vec<f64>,
    lanes: Vec<Lane>,
    processes: Vec<Process>,
    processes_total: usize,
    /// The terminal report's figures (`memtrack report --json`), with
    /// job-chosen strings and long lists cut.
    report: Value,
    counters: Value,
    summary: Value,
}

impl RunPage {
    /// The page's view of `doc` (whose log was handed to `gather`, and
    /// whose leak verdict and advice are worked out).
    pub(crate) fn build(label: &str, doc: &Document, gather: Gather, entries: u64) -> RunPage {
        let (t0, duration) = time_span(doc, &gather);
        let mut series = BTreeMap::new();
        let mut series_peak = BTreeMap::new();
        for (k, name) in SERIES.iter().enumerate() {
            let Some(max) = gather.series.max(k) else {
                continue;
            };
            if *name == "gpu" && max <= 0.0 {
                continue;
            }
            series.insert(*name, gather.series.line(k, t0));
            series_peak.insert(*name, max);
        }
        let mut marks = Vec::new();
        let mut marks_total = 0;
        let mut iterations = Vec::new();
        for cell in gather.marks.cells() {
            marks_total += cell.n;
            if let Some(m) = &cell.last {
                marks.push(PageMark {
                    t: m.t - t0,
                    n: cell.n,
                    ..m.clone()
                });
            }
            if let Some((t, i)) = cell.iteration {
                iterations.extend([t - t0, i as f64]);
            }
        }
        let column_s = gather.series_width();
        let end = t0 + duration;
        let mut lanes = gather.lanes.finish(end);
        for lane in &mut lanes {
            lane.component = clip(&lane.component);
            for b in &mut lane.bars {
                b.start -= t0;
                b.end -= t0;
                b.operation = clip(&b.operation);
            }
        }
        // Components with figures but no span still get their lane.
        for c in doc.peaks_by_component.keys() {
            if lanes.len() >= MAX_LANES {
                break;
            }
            let c = clip(c);
            if !lanes.iter().any(|l| l.component == c) {
                lanes.push(Lane {
                    component: c,
                    bars: Vec::new(),
                });
            }
        }
        let mut by_size: Vec<&Target> = doc.targets.iter().collect();
        by_size.sort_by(|a, b| size(b).total_cmp(&size(a)));
        let processes = by_size
            .iter()
            .take(TOP_PROCESSES)
            .map(|t| process(t, t0))
            .collect();
        let mut report = serde_json::to_value(crate::report::text::build(doc)).unwrap_or_default();
        trim_report(&mut report);
        RunPage {
            label: clip(label),
            t0,
            duration,
            column_s,
            entries,
            series,
            series_peak,
            marks,
            marks_total,
            iterations,
            lanes,
            processes,
            processes_total: doc.targets.len(),
            report,
            counters: serde_json::to_value(&doc.counters).unwrap_or_default(),
            summary: serde_json::to_value(&doc.summary).unwrap_or_default(),
        }
    }
}

impl Gather {
    fn series_width(&self) -> f64 {
        self.marks.width()
    }
}

fn size(t: &Target) -> f64 {
    t.peak_rss_mb
        .max(t.hwm_mb)
        .max(t.peak_uss_mb.unwrap_or(0.0))
        .max(t.peak_gpu_mb)
}

/// x = 0 (the run's start, or the first time seen) and the seconds shown.
fn time_span(doc: &Document, g: &Gather) -> (f64, f64) {
    let series = doc
        .targets
        .iter()
        .flat_map(|t| t.series.iter().map(|p| p[0]))
        .filter(|t| t.is_finite() && *t > 0.0);
    let first = g.first.into_iter().chain(series.clone()).reduce(f64::min);
    let last = g.last.into_iter().chain(series).reduce(f64::max);
    let (first, last) = match (first, last) {
        (Some(f), Some(l)) => (f, l),
        _ => {
            let s = if doc.run.start > 0.0 {
                doc.run.start
            } else {
                0.0
            };
            (s, doc.run.end.unwrap_or(s))
        }
    };
    let t0 = if doc.run.start.is_finite() && doc.run.start > 0.0 && doc.run.start <= first + 1.0 {
        doc.run.start
    } else {
        first
    };
    let end = doc
        .run
        .end
        .filter(|e| e.is_finite() && *e >= last)
        .unwrap_or(last);
    let duration = end - t0;
    // A file's absurd times (NaN, infinities) still make a drawable axis.
    if !t0.is_finite() || !duration.is_finite() {
        return (0.0, 1.0);
    }
    (t0, if duration >= 1.0 { duration } else { 1.0 })
}

/// Cuts the report's job-chosen strings to [`MAX_TEXT`] characters (the
/// CUDA summary of an OOM keeps more) and its lists to [`MAX_ROWS`], and
/// leaves out the flight recorder's points (its windows stay).
fn trim_report(v: &mut Value) {
    if let Some(windows) = v.get_mut("flight_recorder").and_then(Value::as_array_mut) {
        for w in windows.iter_mut() {
            if let Some(o) = w.as_object_mut() {
                if let Some(points) = o.remove("points") {
                    o.insert(
                        "points".into(),
                        Value::from(points.as_array().map_or(0, Vec::len)),
                    );
                }
            }
        }
    }
    trim(v);
}

fn trim(v: &mut Value) {
    match v {
        Value::String(s) => {
            let cap = MAX_TEXT * 20;
            if s.chars().count() > cap {
                *s = format!("{}…", s.chars().take(cap).collect::<String>());
            }
        }
        Value::Array(a) => {
            a.truncate(MAX_ROWS);
            a.iter_mut().for_each(trim);
        }
        Value::Object(o) => {
            if o.len() > MAX_ROWS {
                let keep: Vec<String> = o.keys().take(MAX_ROWS).cloned().collect();
                o.retain(|k, _| keep.contains(k));
            }
            o.values_mut().for_each(trim);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(c: &str, op: &str, t: f64) -> Entry {
        Entry {
            component: c.into(),
            operation: op.into(),
            timestamp: t,
            ..Entry::default()
        }
    }

    #[test]
    fn spans_pair_into_lanes_and_coarsen_when_too_many() {
        let mut lanes = Lanes::default();
        lanes.observe(&mark("data", "before_load", 10.0));
        lanes.observe(&mark("model", "before_step", 11.0));
        lanes.observe(&mark("model", "after_step", 12.0));
        let out = lanes.finish(20.0);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].component, "data");
        assert_eq!(out[1].component, "model");
        assert!(out[0].bars[0].open);
        assert_eq!((out[0].bars[0].start, out[0].bars[0].end), (10.0, 20.0));
        assert_eq!(out[1].bars[0].operation, "step");

        let mut lanes = Lanes::default();
        for i in 0..100_000 {
            let t = i as f64;
            lanes.observe(&mark("model", "before_step", t));
            lanes.observe(&mark("model", "after_step", t + 0.5));
        }
        let out = lanes.finish(100_000.0);
        let bars: usize = out.iter().map(|l| l.bars.len()).sum();
        assert!(bars <= MAX_BARS, "{bars}");
        let spans: u64 = out.iter().flat_map(|l| &l.bars).map(|b| b.n).sum();
        assert_eq!(spans, 100_000);
    }

    #[test]
    fn components_beyond_the_lanes_share_one() {
        let mut lanes = Lanes::default();
        for i in 0..500 {
            let c = format!("c{i}");
            lanes.observe(&mark(&c, "before_x", i as f64));
            lanes.observe(&mark(&c, "after_x", i as f64 + 0.5));
        }
        let out = lanes.finish(600.0);
        assert_eq!(out.len(), MAX_LANES);
        assert_eq!(out.last().unwrap().component, OTHER_LANE);
    }

    #[test]
    fn absurd_times_still_make_an_axis() {
        let mut doc = Document::default();
        doc.run.start = f64::NAN;
        doc.run.end = Some(f64::INFINITY);
        let mut g = Gather::default();
        for t in [1e300, 5.0, f64::NAN] {
            g.observe(&mark("a", "x", t));
        }
        let (t0, d) = time_span(&doc, &g);
        assert!(t0.is_finite() && d.is_finite() && d >= 1.0, "{t0} {d}");
        let empty = time_span(&Document::default(), &Gather::default());
        assert_eq!(empty, (0.0, 1.0));
    }

    #[test]
    fn long_strings_are_cut() {
        let long = "é".repeat(10_000);
        assert_eq!(clip(&long).chars().count(), MAX_TEXT + 1);
        assert_eq!(clip("short"), "short");
        let mut v = serde_json::json!({"run": {"name": long}, "targets": vec![1; 5000]});
        trim_report(&mut v);
        assert!(v["run"]["name"].as_str().unwrap().chars().count() <= MAX_TEXT * 20 + 1);
        assert_eq!(v["targets"].as_array().unwrap().len(), MAX_ROWS);
    }
}
