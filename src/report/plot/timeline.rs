//! What a plot shows, in seconds since the start and MiB, independent of
//! pixels: the lines of each panel, the largest processes, phases rebuilt
//! from marks, stages, alerts, a suspected leak's trend and the header's
//! text, built from a document in named steps.

use std::collections::HashMap;

use super::options::{MIN_TARGET_SHARE, TOP_TARGETS};
use crate::model::leak::{self, LeakConfig};
use crate::model::{Document, Entry, EntryKind, GpuSource, Target};
use crate::units::{duration_two_units, format_mib, format_mib_one_decimal, format_mib_short};

/// A line: `(seconds since start, MiB)`.
pub(super) type Line = Vec<(f64, f64)>;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct PhaseBar {
    pub(super) component: String,
    pub(super) operation: String,
    pub(super) start: f64,
    pub(super) end: f64,
    /// No `after_X` came before the run ended.
    pub(super) open: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct StageBar {
    pub(super) name: String,
    pub(super) status: String,
    pub(super) start: f64,
    pub(super) end: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct AlertMark {
    pub(super) t: f64,
    /// `host` or `gpu<index>`.
    pub(super) resource: String,
    pub(super) level: String,
    pub(super) ratio: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct TargetLine {
    pub(super) label: String,
    pub(super) line: Line,
    pub(super) peak: f64,
}

/// A suspected leak's trend over its window.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Trend {
    pub(super) from: (f64, f64),
    pub(super) to: (f64, f64),
    pub(super) rate_mib_per_hour: f64,
    /// Growth over the window judged, MiB.
    pub(super) growth_mib: f64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Timeline {
    pub(super) title: String,
    pub(super) subtitle: String,
    /// Unix time of x = 0.
    pub(super) t0: f64,
    pub(super) duration: f64,
    pub(super) host: Line,
    pub(super) hwm: Line,
    pub(super) host_targets: Vec<TargetLine>,
    /// The tree's host series was long enough for the leak rule.
    pub(super) host_judged: bool,
    /// The process lines are what each alone costs (USS), not RSS.
    pub(super) host_targets_own: bool,
    pub(super) host_others: Option<TargetLine>,
    pub(super) host_peak: Option<(f64, f64)>,
    pub(super) host_trend: Option<Trend>,
    pub(super) gpu_tree: Line,
    pub(super) alloc_used: Line,
    pub(super) alloc_reserved: Line,
    pub(super) gpu_targets: Vec<TargetLine>,
    pub(super) gpu_others: Option<TargetLine>,
    pub(super) gpu_peak: Option<(f64, f64)>,
    pub(super) gpu_trend: Option<Trend>,
    /// The GPU capacity line: `(label, MiB)` when usage comes near it.
    pub(super) gpu_capacity: Option<(String, f64)>,
    pub(super) phases: Vec<PhaseBar>,
    /// Components in order of first appearance.
    pub(super) components: Vec<String>,
    pub(super) stages: Vec<StageBar>,
    pub(super) alerts: Vec<AlertMark>,
    pub(super) experiment_start: Option<f64>,
    pub(super) experiment_end: Option<f64>,
    pub(super) processes: usize,
}

impl Timeline {
    /// What to draw of `doc`, or `None` when it has no time at all.
    pub(super) fn from_document(doc: &Document, process_rss: bool) -> Option<Timeline> {
        let log = sorted_log(doc);
        let (t0, duration) = time_span(doc, &log)?;
        let mut m = Timeline {
            t0,
            duration,
            ..Timeline::default()
        };
        // The lines go through the readings; `experiment_end` repeats one.
        let readings: Vec<&Entry> = log
            .iter()
            .copied()
            .filter(|e| !e.repeats_a_reading())
            .collect();
        m.add_host(&readings);
        m.add_gpu(doc, &readings);
        m.add_targets(doc, process_rss);
        m.add_trends(&log);
        m.add_gpu_capacity(doc);
        m.add_phases_and_stages(doc, &log);
        m.add_marks_and_titles(doc, &log);
        Some(m)
    }

    /// Seconds since the start.
    fn rel(&self, t: f64) -> f64 {
        t - self.t0
    }

    /// Host: the tree's RSS and summed high-water marks.
    fn add_host(&mut self, log: &[&Entry]) {
        self.host = log
            .iter()
            .map(|e| (self.rel(mid_time(e)), e.figures.cpu_ram_used_mb))
            .collect();
        if log.iter().any(|e| e.figures.cpu_ram_hwm_mb > 0.0) {
            self.hwm = log
                .iter()
                .filter(|e| e.figures.cpu_ram_hwm_mb > 0.0)
                .map(|e| (self.rel(mid_time(e)), e.figures.cpu_ram_hwm_mb))
                .collect();
        }
        self.host_peak = peak_of(&self.host);
    }

    /// GPU: the tree's NVML figure, and PyTorch's (or a bare file's) figures.
    fn add_gpu(&mut self, doc: &Document, log: &[&Entry]) {
        if log.iter().any(|e| e.figures.gpu_process_used_mb > 0.0) {
            self.gpu_tree = log
                .iter()
                .map(|e| (self.rel(mid_time(e)), e.figures.gpu_process_used_mb))
                .collect();
        }
        let allocator: Vec<&&Entry> = log
            .iter()
            .filter(|e| {
                e.gpu_source == GpuSource::Allocator
                    || (doc.schema == 0
                        && e.gpu_source == GpuSource::None
                        && (e.figures.gpu_ram_used_mb > 0.0 || e.figures.reserved_gpu_ram_mb > 0.0))
            })
            .collect();
        if !allocator.is_empty() {
            self.alloc_used = allocator
                .iter()
                .map(|e| (self.rel(e.timestamp), e.figures.gpu_ram_used_mb))
                .collect();
            if allocator
                .iter()
                .any(|e| e.figures.reserved_gpu_ram_mb > 0.0)
            {
                self.alloc_reserved = allocator
                    .iter()
                    .map(|e| (self.rel(e.timestamp), e.figures.reserved_gpu_ram_mb))
                    .collect();
            }
        }
        self.gpu_peak = if self.gpu_tree.is_empty() {
            peak_of(&self.alloc_reserved).or_else(|| peak_of(&self.alloc_used))
        } else {
            peak_of(&self.gpu_tree)
        };
    }

    /// Processes, largest first, when there are at least two to tell apart.
    /// A process's host line is what it alone costs (its USS series) where
    /// that was read, else (or with `process_rss`) its RSS.
    fn add_targets(&mut self, doc: &Document, process_rss: bool) {
        self.processes = doc.targets.len();
        let with_series: Vec<&Target> = doc
            .targets
            .iter()
            .filter(|t| !t.series.is_empty())
            .collect();
        if with_series.len() >= 2 {
            let own = !process_rss && with_series.iter().any(|t| !t.own_series.is_empty());
            (self.host_targets, self.host_others) = if own {
                self.own_lines(&with_series)
            } else {
                self.target_lines(&with_series, false)
            };
            self.host_targets_own = own;
            if with_series
                .iter()
                .any(|t| t.series.iter().any(|p| p[2] > 0.0))
            {
                (self.gpu_targets, self.gpu_others) = self.target_lines(&with_series, true);
            }
        }
    }

    /// The largest processes' lines (host or GPU memory), drawn alone if
    /// they matter beside the tree, and the rest summed into "others" on
    /// the host line's time grid.
    fn target_lines(
        &self,
        with_series: &[&Target],
        gpu: bool,
    ) -> (Vec<TargetLine>, Option<TargetLine>) {
        let t0 = self.t0;
        let rel = |t: f64| t - t0;
        let grid: Vec<f64> = self.host.iter().map(|p| p.0 + t0).collect();
        let col = if gpu { 2 } else { 1 };
        let mut all: Vec<TargetLine> = with_series
            .iter()
            .map(|t| TargetLine {
                label: format!("{} {}", t.pid, t.display_name()),
                line: t.series.iter().map(|p| (rel(p[0]), p[col])).collect(),
                peak: t.series.iter().map(|p| p[col]).fold(0.0, f64::max),
            })
            .filter(|l| l.peak > 0.0)
            .collect();
        all.sort_by(|a, b| b.peak.total_cmp(&a.peak));
        // drawn alone: the largest, if they matter beside the tree
        let tree_peak = if gpu {
            max_of(&self.gpu_tree)
        } else {
            max_of(&self.host)
        };
        let floor = MIN_TARGET_SHARE * all.first().map_or(0.0, |l| l.peak).max(tree_peak);
        let alone = all
            .iter()
            .take(TOP_TARGETS)
            .take_while(|l| l.peak >= floor)
            .count();
        let rest: Vec<TargetLine> = all.split_off(alone);
        let others = (!rest.is_empty()).then(|| {
            let line: Line = grid
                .iter()
                .map(|&t| (rel(t), rest.iter().map(|l| value_at(&l.line, rel(t))).sum()))
                .collect();
            TargetLine {
                label: format!(
                    "others ({} process{})",
                    rest.len(),
                    if rest.len() == 1 { "" } else { "es" }
                ),
                peak: line.iter().map(|p| p.1).fold(0.0, f64::max),
                line,
            }
        });
        (all, others)
    }

    /// Each process's own-cost line: its USS series, or its RSS where no
    /// USS was read (labelled so).
    fn own_lines(&self, with_series: &[&Target]) -> (Vec<TargetLine>, Option<TargetLine>) {
        let swapped: Vec<Target> = with_series
            .iter()
            .map(|t| {
                let mut t = (*t).clone();
                if !t.own_series.is_empty() {
                    t.series = t.own_series.iter().map(|p| [p[0], p[1], 0.0]).collect();
                } else {
                    t.name = format!("{} (RSS)", t.name);
                }
                t
            })
            .collect();
        let refs: Vec<&Target> = swapped.iter().collect();
        self.target_lines(&refs, false)
    }

    /// A leak's trend, as the leak rule sees it.
    fn add_trends(&mut self, log: &[&Entry]) {
        let t0 = self.t0;
        let cfg = LeakConfig::default();
        let timer: Vec<&&Entry> = log.iter().filter(|e| e.kind == EntryKind::Timer).collect();
        let source: Vec<(f64, f64, f64)> = if timer.len() >= cfg.min_points {
            timer
                .iter()
                .map(|e| {
                    (
                        mid_time(e),
                        e.figures.cpu_ram_used_mb,
                        e.figures.gpu_process_used_mb,
                    )
                })
                .collect()
        } else {
            log.iter()
                .map(|e| {
                    (
                        mid_time(e),
                        e.figures.cpu_ram_used_mb,
                        e.figures.gpu_process_used_mb,
                    )
                })
                .collect()
        };
        let ts: Vec<f64> = source.iter().map(|p| p.0).collect();
        let host_y: Vec<f64> = source.iter().map(|p| p.1).collect();
        self.host_trend = trend(&ts, &host_y, t0, &cfg);
        self.host_judged = leak::detect(&ts, &host_y, &cfg).judged;
        if !self.gpu_tree.is_empty() {
            let gpu_y: Vec<f64> = source.iter().map(|p| p.2).collect();
            self.gpu_trend = trend(&ts, &gpu_y, t0, &cfg);
        } else if !self.alloc_used.is_empty() {
            let t: Vec<f64> = self.alloc_used.iter().map(|p| p.0 + t0).collect();
            let y: Vec<f64> = self.alloc_used.iter().map(|p| p.1).collect();
            self.gpu_trend = trend(&t, &y, t0, &cfg);
        }
    }

    /// GPU capacity, drawn when the tree used at least half a card.
    fn add_gpu_capacity(&mut self, doc: &Document) {
        let gpu_peak = self.gpu_peak.map_or(0.0, |p| p.1);
        if let Some(g) = doc
            .gpus
            .iter()
            .filter(|g| g.total_mb > 0.0)
            .max_by(|a, b| a.peak_tree_used_mb.total_cmp(&b.peak_tree_used_mb))
        {
            if gpu_peak >= 0.5 * g.total_mb {
                self.gpu_capacity = Some((format!("GPU{} capacity", g.index), g.total_mb));
            }
        }
    }

    /// Phases (and their components, in order of first appearance),
    /// stages and alerts, in seconds since the start.
    fn add_phases_and_stages(&mut self, doc: &Document, log: &[&Entry]) {
        let duration = self.duration;
        self.phases = phases(log, self.t0, duration);
        for p in &self.phases {
            if !self.components.contains(&p.component) {
                self.components.push(p.component.clone());
            }
        }
        self.stages = doc
            .stages
            .iter()
            .map(|s| StageBar {
                name: s.name.clone(),
                status: s.status.clone(),
                start: self.rel(s.start),
                end: s.end.map_or(duration, |e| self.rel(e)),
            })
            .collect();
        self.alerts = doc
            .alerts
            .iter()
            .map(|a| AlertMark {
                t: self.rel(a.timestamp),
                resource: a.resource.clone(),
                level: a.level.clone(),
                ratio: a.used_ratio,
            })
            .collect();
    }

    /// `experiment_start` / `experiment_end`, the title and the subtitle.
    fn add_marks_and_titles(&mut self, doc: &Document, log: &[&Entry]) {
        self.experiment_start = log
            .iter()
            .find(|e| e.operation == "experiment_start")
            .map(|e| self.rel(e.timestamp));
        self.experiment_end = log
            .iter()
            .rev()
            .find(|e| e.operation == "experiment_end")
            .map(|e| self.rel(e.timestamp));
        self.title = if doc.run.name.is_empty() {
            "memtrack · memory timeline".to_string()
        } else {
            format!("memtrack · {}", doc.run.name)
        };
        self.subtitle = subtitle(doc, self);
    }

    pub(super) fn has_gpu(&self) -> bool {
        !self.gpu_tree.is_empty()
            || !self.alloc_used.is_empty()
            || !self.alloc_reserved.is_empty()
            || !self.gpu_targets.is_empty()
    }

    /// The highest value drawn in a panel (at least 1 MiB).
    pub(super) fn host_max(&self) -> f64 {
        let mut m = max_of(&self.host).max(max_of(&self.hwm));
        for l in self.host_targets.iter().chain(&self.host_others) {
            m = m.max(l.peak);
        }
        m.max(1.0)
    }

    pub(super) fn gpu_max(&self) -> f64 {
        let mut m = max_of(&self.gpu_tree)
            .max(max_of(&self.alloc_used))
            .max(max_of(&self.alloc_reserved));
        for l in self.gpu_targets.iter().chain(&self.gpu_others) {
            m = m.max(l.peak);
        }
        if let Some((_, cap)) = &self.gpu_capacity {
            m = m.max(*cap);
        }
        m.max(1.0)
    }
}

/// The log in time order.
fn sorted_log(doc: &Document) -> Vec<&Entry> {
    let mut v: Vec<&Entry> = doc.detailed_log.iter().collect();
    v.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    v
}

/// x = 0 (the run's start, or the first time seen) and the seconds drawn
/// (at least one), from every time in the log and the target series.
fn time_span(doc: &Document, log: &[&Entry]) -> Option<(f64, f64)> {
    let series_times = doc
        .targets
        .iter()
        .flat_map(|t| t.series.iter().map(|p| p[0]));
    let all_times: Vec<f64> = log
        .iter()
        .flat_map(|e| [e.timestamp, e.timestamp_end.unwrap_or(e.timestamp)])
        .chain(series_times)
        .filter(|t| t.is_finite() && *t > 0.0)
        .collect();
    let first = all_times.iter().copied().reduce(f64::min)?;
    let last = all_times.iter().copied().fold(first, f64::max);
    let t0 = if doc.run.start > 0.0 && doc.run.start <= first + 1.0 {
        doc.run.start
    } else {
        first
    };
    let end = doc.run.end.filter(|e| *e >= last).unwrap_or(last);
    Some((t0, (end - t0).max(1.0)))
}

fn mid_time(e: &Entry) -> f64 {
    match e.timestamp_end {
        Some(end) if end > e.timestamp => (e.timestamp + end) / 2.0,
        _ => e.timestamp,
    }
}

pub(super) fn max_of(line: &Line) -> f64 {
    line.iter().map(|p| p.1).fold(0.0, f64::max)
}

/// The highest point; of a plateau at the maximum, its middle point.
fn peak_of(line: &Line) -> Option<(f64, f64)> {
    let max = line.iter().map(|p| p.1).fold(0.0, f64::max);
    let at: Vec<&(f64, f64)> = line
        .iter()
        .filter(|p| max > 0.0 && p.1 >= max - 1e-9)
        .collect();
    at.get(at.len() / 2).map(|p| **p)
}

/// The value of a sampled line at `t` (the last sample at or before `t`),
/// 0 outside its life.
fn value_at(line: &Line, t: f64) -> f64 {
    match (line.first(), line.last()) {
        (Some(f), Some(l)) if t >= f.0 && t <= l.0 => {
            let i = line.partition_point(|p| p.0 <= t);
            line[i.saturating_sub(1)].1
        }
        _ => 0.0,
    }
}

/// The trend line of a suspected leak over its window.
fn trend(t: &[f64], y: &[f64], t0: f64, cfg: &LeakConfig) -> Option<Trend> {
    let v = leak::detect(t, y, cfg);
    if !v.suspected {
        return None;
    }
    let end = t.iter().copied().fold(f64::MIN, f64::max);
    let start = end - v.window_s;
    let slope = v.rate_mib_per_hour / 3600.0;
    let mut offsets: Vec<f64> = t
        .iter()
        .zip(y)
        .filter(|(t, _)| **t >= start)
        .map(|(t, y)| y - slope * (t - start))
        .collect();
    offsets.sort_by(f64::total_cmp);
    let intercept = *offsets.get(offsets.len() / 2)?;
    Some(Trend {
        from: (start - t0, intercept),
        to: (end - t0, intercept + slope * v.window_s),
        rate_mib_per_hour: v.rate_mib_per_hour,
        growth_mib: v.growth_mib,
    })
}

/// Phases rebuilt from marks: `before_X` opens `component/X` (per sender),
/// the next `after_X` closes it; one still open ends with the run.
fn phases(log: &[&Entry], t0: f64, duration: f64) -> Vec<PhaseBar> {
    let mut open: HashMap<(String, String, Option<u32>), Vec<f64>> = HashMap::new();
    let mut out = Vec::new();
    for e in log.iter().filter(|e| e.kind != EntryKind::Timer) {
        if let Some(op) = e.operation.strip_prefix("before_") {
            open.entry((e.component.clone(), op.to_string(), e.pid))
                .or_default()
                .push(e.timestamp - t0);
        } else if let Some(op) = e.operation.strip_prefix("after_") {
            let key = (e.component.clone(), op.to_string(), e.pid);
            if let Some(start) = open.get_mut(&key).and_then(Vec::pop) {
                out.push(PhaseBar {
                    component: key.0,
                    operation: key.1,
                    start,
                    end: e.timestamp - t0,
                    open: false,
                });
            }
        }
    }
    let mut still_open: Vec<PhaseBar> = open
        .into_iter()
        .flat_map(|((component, operation, _), starts)| {
            starts.into_iter().map(move |start| PhaseBar {
                component: component.clone(),
                operation: operation.clone(),
                start,
                end: duration,
                open: true,
            })
        })
        .collect();
    out.append(&mut still_open);
    out.sort_by(|a, b| a.start.total_cmp(&b.start));
    out
}

fn subtitle(doc: &Document, m: &Timeline) -> String {
    let mut parts: Vec<String> = Vec::new();
    if !doc.run.host.is_empty() {
        parts.push(doc.run.host.clone());
    }
    if !doc.run.command.is_empty() {
        let mut cmd = doc
            .run
            .command
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if cmd.chars().count() > 60 {
            cmd = cmd.chars().take(57).collect::<String>() + "…";
        }
        parts.push(cmd);
    }
    parts.push(duration_two_units(m.duration));
    if let Some(exit) = &doc.run.exit {
        parts.push(match exit.signal {
            Some(sig) => format!("killed by signal {sig}"),
            None => format!("exit {}", exit.code),
        });
    } else if !doc.run.status.is_empty() {
        parts.push(doc.run.status.to_string());
    }
    // The run's peaks as the JSON holds them, named as everywhere else.
    let p = &doc.peak_usage;
    let sampled = if p.figures.cpu_ram_used_mb > 0.0 {
        p.figures.cpu_ram_used_mb
    } else {
        m.host_peak.map_or(0.0, |p| p.1)
    };
    let between = sampled.max(p.figures.cpu_ram_hwm_mb);
    parts.push(if between > sampled {
        format!(
            "host peak {} sampled, {} between samples",
            format_mib_one_decimal(sampled),
            format_mib_one_decimal(between)
        )
    } else {
        format!("host peak {} sampled", format_mib_one_decimal(sampled))
    });
    if m.has_gpu() {
        parts.push(format!(
            "GPU peak {}",
            format_mib(m.gpu_peak.map_or(0.0, |p| p.1))
        ));
    } else if doc.run.gpu_backend.is_host_only() {
        parts.push("no GPU".into());
    }
    parts.push(match (&m.host_trend, &m.gpu_trend) {
        (None, None) if m.host_judged => "no leak suspected".into(),
        (None, None) => "leak not judged (too short)".into(),
        (h, g) => {
            let mut s = Vec::new();
            for (what, t) in [("host", h), ("GPU", g)] {
                if let Some(t) = t {
                    s.push(format!(
                        "{what} +{} ({}/h)",
                        format_mib_short(t.growth_mib),
                        format_mib_short(t.rate_mib_per_hour)
                    ));
                }
            }
            format!("leak suspected: {}", s.join(", "))
        }
    });
    parts.join("  ·  ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(component: &str, op: &str, t: f64, pid: Option<u32>) -> Entry {
        Entry {
            component: component.into(),
            operation: op.into(),
            timestamp: t,
            pid,
            ..Entry::default()
        }
    }

    #[test]
    fn phases_pair_before_and_after_per_sender_and_close_at_the_end() {
        let log = [
            event("model", "before_generate", 10.0, Some(1)),
            event("model", "before_generate", 11.0, Some(2)),
            event("data", "before_load", 12.0, Some(1)),
            event("model", "after_generate", 15.0, Some(2)),
            event("model", "after_generate", 16.0, Some(1)),
            event("model", "after_orphan", 17.0, Some(1)),
        ];
        let refs: Vec<&Entry> = log.iter().collect();
        let p = phases(&refs, 10.0, 20.0);
        let got: Vec<(&str, &str, f64, f64, bool)> = p
            .iter()
            .map(|p| {
                (
                    p.component.as_str(),
                    p.operation.as_str(),
                    p.start,
                    p.end,
                    p.open,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("model", "generate", 0.0, 6.0, false),
                ("model", "generate", 1.0, 5.0, false),
                ("data", "load", 2.0, 20.0, true),
            ]
        );
    }

    #[test]
    fn the_lines_end_at_the_last_reading_not_at_experiment_ends_repeat() {
        // The job freed its memory before it exited; `experiment_end`
        // carries the last sample taken while it was alive (500 MiB).
        let mut doc = Document::default();
        doc.run.start = 100.0;
        for (t, host, gpu, kind, op) in [
            (100.0, 10.0, 0.0, EntryKind::System, "experiment_start"),
            (101.0, 500.0, 4000.0, EntryKind::Timer, "timer"),
            (102.0, 30.0, 0.0, EntryKind::Timer, "timer"),
            (102.5, 500.0, 4000.0, EntryKind::System, "experiment_end"),
        ] {
            let mut e = event("system", op, t, None);
            e.kind = kind;
            e.figures.cpu_ram_used_mb = host;
            e.figures.gpu_process_used_mb = gpu;
            doc.detailed_log.push(e);
        }
        let m = Timeline::from_document(&doc, false).unwrap();
        assert_eq!(m.host.last(), Some(&(2.0, 30.0)), "{:?}", m.host);
        assert_eq!(m.gpu_tree.last(), Some(&(2.0, 0.0)), "{:?}", m.gpu_tree);
        assert_eq!(m.host_peak.map(|p| p.1), Some(500.0));
        assert_eq!(m.experiment_end, Some(2.5));
    }

    #[test]
    fn value_at_steps_and_is_zero_outside_the_life() {
        let l: Line = vec![(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)];
        assert_eq!(value_at(&l, 0.5), 0.0);
        assert_eq!(value_at(&l, 1.0), 10.0);
        assert_eq!(value_at(&l, 2.5), 20.0);
        assert_eq!(value_at(&l, 3.0), 30.0);
        assert_eq!(value_at(&l, 3.5), 0.0);
    }
}
