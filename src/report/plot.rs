//! `memtrack plot`: one picture of a run, because people would rather look
//! than read a JSON file.
//!
//! The picture (SVG or PNG, chosen by the output's extension) has, from top
//! to bottom: a header (run name, host, command, duration, exit, the peaks
//! and the leak verdict); lanes with the stages (coloured by their status)
//! and each component's phases (rebuilt from the `before_X` / `after_X`
//! marks); and two panels sharing one time axis, in seconds since the run
//! started — host memory (the tree's RSS, the summed `VmHWM`, and each of
//! the largest processes) and GPU memory (the tree's NVML figure and
//! PyTorch's allocated / reserved figures sent with marks, per process).
//! Phases are shaded in both panels; the overall peaks are labelled in MiB;
//! pressure alerts, `experiment_start` / `experiment_end` and a suspected
//! leak's trend are marked. A legend column on the right names everything,
//! capped at the [`TOP_TARGETS`] largest processes plus "others".
//!
//! A bare file (only `detailed_log` and `peak_usage`) plots too: its
//! marks give the host line, the GPU line and the phases.
//!
//! Text in a PNG is rasterised with DejaVu Sans compiled into the binary
//! (`assets/fonts`, Bitstream Vera licence), so neither the build nor the
//! run needs a system font library.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, RGBAColor};
use serde::Serialize;

use crate::model::leak::{self, LeakConfig};
use crate::model::{Document, Entry, EntryKind, GpuSource};

/// Processes drawn one by one; the rest are summed into "others".
pub const TOP_TARGETS: usize = 6;

/// Processes smaller than this share of the tree's peak go to "others".
const MIN_TARGET_SHARE: f64 = 0.05;

/// Component lanes drawn; further components share the last colour and
/// are shaded but get no lane.
const MAX_LANES: usize = 8;

/// What to draw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlotOptions {
    pub width: u32,
    pub height: u32,
    /// Replaces the default title (`memtrack · <run name>`).
    pub title: Option<String>,
}

impl Default for PlotOptions {
    fn default() -> Self {
        PlotOptions {
            width: 1400,
            height: 900,
            title: None,
        }
    }
}

/// The output formats, from the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Svg,
    Png,
}

impl Format {
    /// `.svg` or `.png`, any case.
    pub fn from_path(path: &Path) -> Option<Format> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "svg" => Some(Format::Svg),
            "png" => Some(Format::Png),
            _ => None,
        }
    }
}

/// What was drawn, for the command to print and tests to check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlotSummary {
    pub path: PathBuf,
    pub format: Format,
    pub width: u32,
    pub height: u32,
    /// Every legend entry, in order.
    pub legend: Vec<String>,
    /// Phases shaded (closed or still open at the end).
    pub phases: usize,
    pub stages: usize,
    pub alerts: usize,
    /// The peak and leak labels written on the panels.
    pub annotations: Vec<String>,
    /// Whether a GPU panel was drawn.
    pub gpu_panel: bool,
}

/// Why no picture was written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot plot to {}: unknown format, use a .svg or .png file name", path.display())]
    Format { path: PathBuf },
    #[error(
        "cannot plot a {width}×{height} image: the width must be {MIN_WIDTH} to {MAX_SIDE} \
         pixels and the height {MIN_HEIGHT} to {MAX_SIDE}"
    )]
    Size { width: u32, height: u32 },
    #[error("nothing to plot: the document has no detailed_log entries and no target series")]
    Empty,
    #[error("cannot load the embedded font: {0}")]
    Font(String),
    #[error("cannot draw {}: {message}", path.display())]
    Draw { path: PathBuf, message: String },
}

/// Draws `doc` into `out` (SVG or PNG, from the extension).
pub fn plot(doc: &Document, out: &Path, opts: &PlotOptions) -> Result<PlotSummary, PlotError> {
    let format = Format::from_path(out).ok_or_else(|| PlotError::Format {
        path: out.to_path_buf(),
    })?;
    check_size(opts.width, opts.height)?;
    register_fonts()?;
    let model = Timeline::from_document(doc).ok_or(PlotError::Empty)?;
    let size = (opts.width, opts.height);
    let draw_err = |message: String| PlotError::Draw {
        path: out.to_path_buf(),
        message,
    };
    let mut summary = match format {
        Format::Svg => {
            let root = SVGBackend::new(out, size).into_drawing_area();
            let s = draw(&root, &model, opts).map_err(|e| draw_err(e.to_string()))?;
            root.present().map_err(|e| draw_err(e.to_string()))?;
            s
        }
        Format::Png => {
            // Drawn at SUPERSAMPLE times the size and averaged down: smooth
            // lines and even glyphs from a backend that draws neither.
            let big = PlotOptions {
                width: opts.width * SUPERSAMPLE,
                height: opts.height * SUPERSAMPLE,
                title: opts.title.clone(),
            };
            let mut pixels = vec![0u8; big.width as usize * big.height as usize * 3];
            let mut s = {
                let root = BitMapBackend::with_buffer(&mut pixels, (big.width, big.height))
                    .into_drawing_area();
                let s = draw(&root, &model, &big).map_err(|e| draw_err(e.to_string()))?;
                root.present().map_err(|e| draw_err(e.to_string()))?;
                s
            };
            s.width = opts.width;
            s.height = opts.height;
            let small = shrink(&pixels, big.width as usize, SUPERSAMPLE as usize);
            let mut png = BitMapBackend::new(out, size);
            png.blit_bitmap((0, 0), size, &small)
                .and_then(|()| png.present())
                .map_err(|e| draw_err(e.to_string()))?;
            s
        }
    };
    summary.path = out.to_path_buf();
    summary.format = format;
    Ok(summary)
}

/// PNGs are drawn this many times larger, then averaged down.
const SUPERSAMPLE: u32 = 3;

/// Smallest width and height a readable picture needs, pixels.
pub const MIN_WIDTH: u32 = 480;
pub const MIN_HEIGHT: u32 = 320;
/// Largest width or height drawn, pixels. A PNG is drawn at
/// three times its size first (supersampled): at 4096×4096 that buffer is
/// 12288×12288 RGB, 432 MiB, the most a plot may cost.
pub const MAX_SIDE: u32 = 4096;

/// Refuses sizes outside [`MIN_WIDTH`]…[`MAX_SIDE`] × [`MIN_HEIGHT`]…[`MAX_SIDE`]
/// before anything is allocated or drawn.
pub fn check_size(width: u32, height: u32) -> Result<(), PlotError> {
    if (MIN_WIDTH..=MAX_SIDE).contains(&width) && (MIN_HEIGHT..=MAX_SIDE).contains(&height) {
        Ok(())
    } else {
        Err(PlotError::Size { width, height })
    }
}

/// Averages `k`×`k` blocks of an RGB image `width` pixels wide.
fn shrink(rgb: &[u8], width: usize, k: usize) -> Vec<u8> {
    let height = rgb.len() / 3 / width;
    let (w, h) = (width / k, height / k);
    let mut out = vec![0u8; w * h * 3];
    let n = (k * k) as u32;
    for y in 0..h {
        for x in 0..w {
            for c in 0..3 {
                let mut sum = 0u32;
                for dy in 0..k {
                    let row = (y * k + dy) * width;
                    for dx in 0..k {
                        sum += u32::from(rgb[(row + x * k + dx) * 3 + c]);
                    }
                }
                out[(y * w + x) * 3 + c] = ((sum + n / 2) / n) as u8;
            }
        }
    }
    out
}

static REGULAR: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
static BOLD: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans-Bold.ttf");

/// Registers the embedded fonts as plotters' `sans-serif`, once.
fn register_fonts() -> Result<(), PlotError> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let bad = |_| "DejaVu Sans is not a valid font".to_string();
        plotters::style::register_font("sans-serif", FontStyle::Normal, REGULAR).map_err(bad)?;
        plotters::style::register_font("sans-serif", FontStyle::Bold, BOLD).map_err(bad)?;
        Ok(())
    })
    .clone()
    .map_err(PlotError::Font)
}

// ---------------------------------------------------------------------------
// The model: what to draw, in seconds since the start, independent of pixels.

/// A line: `(seconds since start, MiB)`.
type Line = Vec<(f64, f64)>;

#[derive(Debug, Clone, PartialEq)]
struct Phase {
    component: String,
    operation: String,
    start: f64,
    end: f64,
    /// No `after_X` came before the run ended.
    open: bool,
}

#[derive(Debug, Clone, PartialEq)]
struct StageBar {
    name: String,
    status: String,
    start: f64,
    end: f64,
}

#[derive(Debug, Clone, PartialEq)]
struct AlertMark {
    t: f64,
    /// `host` or `gpu<index>`.
    resource: String,
    level: String,
    ratio: f64,
}

#[derive(Debug, Clone, PartialEq)]
struct TargetLine {
    label: String,
    line: Line,
    peak: f64,
}

/// A suspected leak's trend over its window.
#[derive(Debug, Clone, PartialEq)]
struct Trend {
    from: (f64, f64),
    to: (f64, f64),
    rate_mib_per_hour: f64,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Timeline {
    title: String,
    subtitle: String,
    /// Unix time of x = 0.
    t0: f64,
    duration: f64,
    host: Line,
    hwm: Line,
    host_targets: Vec<TargetLine>,
    host_others: Option<TargetLine>,
    host_peak: Option<(f64, f64)>,
    host_trend: Option<Trend>,
    gpu_tree: Line,
    alloc_used: Line,
    alloc_reserved: Line,
    gpu_targets: Vec<TargetLine>,
    gpu_others: Option<TargetLine>,
    gpu_peak: Option<(f64, f64)>,
    gpu_trend: Option<Trend>,
    /// The GPU capacity line: `(label, MiB)` when usage comes near it.
    gpu_capacity: Option<(String, f64)>,
    phases: Vec<Phase>,
    /// Components in order of first appearance.
    components: Vec<String>,
    stages: Vec<StageBar>,
    alerts: Vec<AlertMark>,
    experiment_start: Option<f64>,
    experiment_end: Option<f64>,
    processes: usize,
}

impl Timeline {
    fn from_document(doc: &Document) -> Option<Timeline> {
        let log: Vec<&Entry> = {
            let mut v: Vec<&Entry> = doc.detailed_log.iter().collect();
            v.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
            v
        };
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
        let duration = (end - t0).max(1.0);
        let rel = |t: f64| t - t0;
        let mut m = Timeline {
            t0,
            duration,
            ..Timeline::default()
        };

        // Host: the tree's RSS and summed high-water marks.
        m.host = log
            .iter()
            .map(|e| (rel(mid_time(e)), e.cpu_ram_used_mb))
            .collect();
        if log.iter().any(|e| e.cpu_ram_hwm_mb > 0.0) {
            m.hwm = log
                .iter()
                .filter(|e| e.cpu_ram_hwm_mb > 0.0)
                .map(|e| (rel(mid_time(e)), e.cpu_ram_hwm_mb))
                .collect();
        }
        m.host_peak = peak_of(&m.host);

        // GPU: the tree's NVML figure, and PyTorch's (or a bare file's) figures.
        if log.iter().any(|e| e.gpu_process_used_mb > 0.0) {
            m.gpu_tree = log
                .iter()
                .map(|e| (rel(mid_time(e)), e.gpu_process_used_mb))
                .collect();
        }
        let allocator: Vec<&&Entry> = log
            .iter()
            .filter(|e| {
                e.gpu_source == GpuSource::Allocator
                    || (doc.schema == 0
                        && e.gpu_source == GpuSource::None
                        && (e.gpu_ram_used_mb > 0.0 || e.reserved_gpu_ram_mb > 0.0))
            })
            .collect();
        if !allocator.is_empty() {
            m.alloc_used = allocator
                .iter()
                .map(|e| (rel(e.timestamp), e.gpu_ram_used_mb))
                .collect();
            if allocator.iter().any(|e| e.reserved_gpu_ram_mb > 0.0) {
                m.alloc_reserved = allocator
                    .iter()
                    .map(|e| (rel(e.timestamp), e.reserved_gpu_ram_mb))
                    .collect();
            }
        }
        m.gpu_peak = if m.gpu_tree.is_empty() {
            peak_of(&m.alloc_reserved).or_else(|| peak_of(&m.alloc_used))
        } else {
            peak_of(&m.gpu_tree)
        };

        // Processes, largest first.
        m.processes = doc.targets.len();
        let with_series: Vec<_> = doc
            .targets
            .iter()
            .filter(|t| !t.series.is_empty())
            .collect();
        if with_series.len() >= 2 {
            let grid: Vec<f64> = m.host.iter().map(|p| p.0 + t0).collect();
            let lines = |gpu: bool| -> (Vec<TargetLine>, Option<TargetLine>) {
                let col = if gpu { 2 } else { 1 };
                let mut all: Vec<TargetLine> = with_series
                    .iter()
                    .map(|t| TargetLine {
                        label: format!("{} {}", t.pid, t.name),
                        line: t.series.iter().map(|p| (rel(p[0]), p[col])).collect(),
                        peak: t.series.iter().map(|p| p[col]).fold(0.0, f64::max),
                    })
                    .filter(|l| l.peak > 0.0)
                    .collect();
                all.sort_by(|a, b| b.peak.total_cmp(&a.peak));
                // drawn alone: the largest, if they matter beside the tree
                let tree_peak = if gpu {
                    max_of(&m.gpu_tree)
                } else {
                    max_of(&m.host)
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
            };
            (m.host_targets, m.host_others) = lines(false);
            if with_series
                .iter()
                .any(|t| t.series.iter().any(|p| p[2] > 0.0))
            {
                (m.gpu_targets, m.gpu_others) = lines(true);
            }
        }

        // A leak's trend, as the leak rule sees it.
        let cfg = LeakConfig::default();
        let timer: Vec<&&Entry> = log.iter().filter(|e| e.kind == EntryKind::Timer).collect();
        let source: Vec<(f64, f64, f64)> = if timer.len() >= cfg.min_points {
            timer
                .iter()
                .map(|e| (mid_time(e), e.cpu_ram_used_mb, e.gpu_process_used_mb))
                .collect()
        } else {
            log.iter()
                .map(|e| (mid_time(e), e.cpu_ram_used_mb, e.gpu_process_used_mb))
                .collect()
        };
        let ts: Vec<f64> = source.iter().map(|p| p.0).collect();
        let host_y: Vec<f64> = source.iter().map(|p| p.1).collect();
        m.host_trend = trend(&ts, &host_y, t0, &cfg);
        if !m.gpu_tree.is_empty() {
            let gpu_y: Vec<f64> = source.iter().map(|p| p.2).collect();
            m.gpu_trend = trend(&ts, &gpu_y, t0, &cfg);
        } else if !m.alloc_used.is_empty() {
            let t: Vec<f64> = m.alloc_used.iter().map(|p| p.0 + t0).collect();
            let y: Vec<f64> = m.alloc_used.iter().map(|p| p.1).collect();
            m.gpu_trend = trend(&t, &y, t0, &cfg);
        }

        // GPU capacity, drawn when the tree used at least half a card.
        let gpu_peak = m.gpu_peak.map_or(0.0, |p| p.1);
        if let Some(g) = doc
            .gpus
            .iter()
            .filter(|g| g.total_mb > 0.0)
            .max_by(|a, b| a.peak_tree_used_mb.total_cmp(&b.peak_tree_used_mb))
        {
            if gpu_peak >= 0.5 * g.total_mb {
                m.gpu_capacity = Some((format!("GPU{} capacity", g.index), g.total_mb));
            }
        }

        m.phases = phases(&log, t0, duration);
        for p in &m.phases {
            if !m.components.contains(&p.component) {
                m.components.push(p.component.clone());
            }
        }
        m.stages = doc
            .stages
            .iter()
            .map(|s| StageBar {
                name: s.name.clone(),
                status: s.status.clone(),
                start: rel(s.start),
                end: s.end.map_or(duration, rel),
            })
            .collect();
        m.alerts = doc
            .alerts
            .iter()
            .map(|a| AlertMark {
                t: rel(a.timestamp),
                resource: a.resource.clone(),
                level: a.level.clone(),
                ratio: a.used_ratio,
            })
            .collect();
        m.experiment_start = log
            .iter()
            .find(|e| e.operation == "experiment_start")
            .map(|e| rel(e.timestamp));
        m.experiment_end = log
            .iter()
            .rev()
            .find(|e| e.operation == "experiment_end")
            .map(|e| rel(e.timestamp));

        m.title = if doc.run.name.is_empty() {
            "memtrack · memory timeline".to_string()
        } else {
            format!("memtrack · {}", doc.run.name)
        };
        m.subtitle = subtitle(doc, &m);
        Some(m)
    }

    fn has_gpu(&self) -> bool {
        !self.gpu_tree.is_empty()
            || !self.alloc_used.is_empty()
            || !self.alloc_reserved.is_empty()
            || !self.gpu_targets.is_empty()
    }

    /// The highest value drawn in a panel (at least 1 MiB).
    fn host_max(&self) -> f64 {
        let mut m = max_of(&self.host).max(max_of(&self.hwm));
        for l in self.host_targets.iter().chain(&self.host_others) {
            m = m.max(l.peak);
        }
        m.max(1.0)
    }

    fn gpu_max(&self) -> f64 {
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

fn mid_time(e: &Entry) -> f64 {
    match e.timestamp_end {
        Some(end) if end > e.timestamp => (e.timestamp + end) / 2.0,
        _ => e.timestamp,
    }
}

fn max_of(line: &Line) -> f64 {
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
    })
}

/// Phases rebuilt from marks: `before_X` opens `component/X` (per sender),
/// the next `after_X` closes it; one still open ends with the run.
fn phases(log: &[&Entry], t0: f64, duration: f64) -> Vec<Phase> {
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
                out.push(Phase {
                    component: key.0,
                    operation: key.1,
                    start,
                    end: e.timestamp - t0,
                    open: false,
                });
            }
        }
    }
    let mut still_open: Vec<Phase> = open
        .into_iter()
        .flat_map(|((component, operation, _), starts)| {
            starts.into_iter().map(move |start| Phase {
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
    parts.push(human_duration(m.duration));
    if let Some(exit) = &doc.run.exit {
        parts.push(match exit.signal {
            Some(sig) => format!("killed by signal {sig}"),
            None => format!("exit {}", exit.code),
        });
    } else if !doc.run.status.is_empty() {
        parts.push(doc.run.status.to_string());
    }
    let host_peak = doc
        .peak_usage
        .cpu_ram_used_mb
        .max(m.host_peak.map_or(0.0, |p| p.1));
    parts.push(format!("host peak {}", mib(host_peak)));
    if m.has_gpu() {
        parts.push(format!("GPU peak {}", mib(m.gpu_peak.map_or(0.0, |p| p.1))));
    } else if doc.run.gpu_backend.is_host_only() {
        parts.push("no GPU".into());
    }
    parts.push(match (&m.host_trend, &m.gpu_trend) {
        (None, None) => "no leak suspected".into(),
        (h, g) => {
            let mut s = Vec::new();
            if let Some(h) = h {
                s.push(format!("host +{}/h", short(h.rate_mib_per_hour)));
            }
            if let Some(g) = g {
                s.push(format!("GPU +{}/h", short(g.rate_mib_per_hour)));
            }
            format!("leak suspected: {}", s.join(", "))
        }
    });
    parts.join("  ·  ")
}

// ---------------------------------------------------------------------------
// Drawing.

const INK: RGBColor = RGBColor(0x2b, 0x2f, 0x36);
const MUTED: RGBColor = RGBColor(0x6b, 0x72, 0x80);
const GRID: RGBColor = RGBColor(0xe5, 0xe7, 0xeb);
const HOST: RGBColor = RGBColor(0x1f, 0x4e, 0x8c);
const GPU: RGBColor = RGBColor(0x6a, 0x3d, 0x9a);
const ALLOC: RGBColor = RGBColor(0xd9, 0x6c, 0x06);
const LEAK: RGBColor = RGBColor(0xc0, 0x1c, 0x28);
/// Per-process lines.
const TARGET_COLOURS: [RGBColor; TOP_TARGETS] = [
    RGBColor(0x17, 0x9c, 0x9c),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xed, 0xa9, 0x00),
];
/// Component shading and lanes.
const COMPONENT_COLOURS: [RGBColor; MAX_LANES] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
];

fn status_colour(status: &str) -> RGBColor {
    match status.to_ascii_uppercase().as_str() {
        "SUCCESS" | "OK" | "DONE" => RGBColor(0x2e, 0x8b, 0x57),
        "FAILED" | "ERROR" => RGBColor(0xc0, 0x39, 0x2b),
        "ABANDONED" => RGBColor(0xe6, 0x7e, 0x22),
        "RUNNING" => RGBColor(0x7f, 0x8c, 0x8d),
        _ => RGBColor(0x5d, 0x6d, 0x7e),
    }
}

fn level_colour(level: &str) -> RGBColor {
    match level {
        "high" => RGBColor(0xe6, 0xa7, 0x00),
        "critical" => RGBColor(0xe6, 0x5c, 0x00),
        "emergency" => RGBColor(0xb0, 0x00, 0x20),
        _ => RGBColor(0x2e, 0x8b, 0x57),
    }
}

fn font(size: f64) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&INK)
}

fn bold(size: f64) -> TextStyle<'static> {
    ("sans-serif", size, FontStyle::Bold)
        .into_font()
        .color(&INK)
}

/// Pixel sizes scale with the image (designed at 1400×900).
#[derive(Debug, Clone, Copy)]
struct Scale(f64);

impl Scale {
    fn px(self, x: f64) -> i32 {
        (x * self.0).round() as i32
    }
    fn pt(self, x: f64) -> f64 {
        (x * self.0).max(x * 0.75)
    }
}

/// One legend entry: how its swatch looks and its text.
#[derive(Debug, Clone)]
enum Swatch {
    Line(RGBAColor, u32),
    Dashed(RGBAColor),
    Block(RGBAColor),
    Marker(RGBAColor),
    LineDot(RGBAColor),
    Heading,
}

type DrawResult<T, DB> = Result<T, DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    m: &Timeline,
    opts: &PlotOptions,
) -> DrawResult<PlotSummary, DB> {
    let s = Scale(
        (opts.width as f64 / 1400.0)
            .min(opts.height as f64 / 900.0)
            .max(0.5),
    );
    root.fill(&WHITE)?;
    let mut legend: Vec<(Swatch, String)> = Vec::new();
    let mut annotations: Vec<String> = Vec::new();

    // Header.
    let (header, body) = root.split_vertically(s.px(70.0));
    let title = opts.title.clone().unwrap_or_else(|| m.title.clone());
    header.draw(&Text::new(
        title,
        (s.px(24.0), s.px(14.0)),
        bold(s.pt(22.0)),
    ))?;
    header.draw(&Text::new(
        m.subtitle.clone(),
        (s.px(24.0), s.px(44.0)),
        font(s.pt(13.5)).color(&MUTED),
    ))?;

    // Legend column on the right.
    let legend_w = s.px(300.0);
    let (main, legend_area) = body.split_horizontally(opts.width as i32 - legend_w);

    // Lanes: stages, then one per component.
    let lane_names: Vec<String> = {
        let mut v = Vec::new();
        if !m.stages.is_empty() {
            v.push("stages".to_string());
        }
        v.extend(m.components.iter().take(MAX_LANES).cloned());
        v
    };
    let lane_h = s.px(24.0);
    let lanes_h = if lane_names.is_empty() {
        0
    } else {
        lane_h * lane_names.len() as i32 + s.px(10.0)
    };
    let (lanes_area, panels) = main.split_vertically(lanes_h);
    let y_area = s.px(92.0);
    let right = s.px(26.0);
    let x_end = m.duration * 1.01;
    let ticks = time_ticks(m.duration);
    let x_range = || 0.0..x_end;
    let time_fmt = |x: &f64| clock(*x, m.duration);
    let colour_of = |component: &str| -> RGBColor {
        let i = m
            .components
            .iter()
            .position(|c| c == component)
            .unwrap_or(0)
            .min(MAX_LANES - 1);
        COMPONENT_COLOURS[i]
    };

    if !lane_names.is_empty() {
        let lanes = ChartBuilder::on(&lanes_area)
            .margin_right(right)
            .margin_top(s.px(6.0))
            .margin_bottom(s.px(4.0))
            .y_label_area_size(y_area)
            .x_label_area_size(0)
            .build_cartesian_2d(x_range(), 0.0..lane_names.len() as f64)?;
        let row_of = |name: &str| {
            lane_names
                .iter()
                .position(|n| n == name)
                .map(|i| (lane_names.len() - 1 - i) as f64)
        };
        let area = lanes.plotting_area().clone();
        // Faint row backgrounds and names.
        for (i, name) in lane_names.iter().enumerate() {
            let y = (lane_names.len() - 1 - i) as f64;
            area.draw(&Rectangle::new(
                [(0.0, y + 0.08), (m.duration * 1.01, y + 0.92)],
                RGBColor(0xf4, 0xf5, 0xf7).filled(),
            ))?;
            let (px, py) = area.map_coordinate(&(0.0, y + 0.5));
            root.draw(&Text::new(
                name.clone(),
                (px - s.px(10.0), py),
                font(s.pt(12.5))
                    .color(&MUTED)
                    .pos(Pos::new(HPos::Right, VPos::Center)),
            ))?;
        }
        let bar_text = |label: &str, x0: f64, x1: f64, y: f64, dark: bool| -> Option<_> {
            let (a, _) = area.map_coordinate(&(x0, y));
            let (b, _) = area.map_coordinate(&(x1, y));
            let style = font(s.pt(11.5)).color(if dark { &INK } else { &WHITE });
            let (w, _) = area.estimate_text_size(label, &style).ok()?;
            ((b - a) > w as i32 + s.px(8.0)).then(|| {
                Text::new(
                    label.to_string(),
                    ((x0 + x1) / 2.0, y + 0.5),
                    style.pos(Pos::new(HPos::Center, VPos::Center)),
                )
            })
        };
        for st in &m.stages {
            if let Some(y) = row_of("stages") {
                let c = status_colour(&st.status);
                area.draw(&Rectangle::new(
                    [(st.start, y + 0.12), (st.end, y + 0.88)],
                    c.mix(0.85).filled(),
                ))?;
                let label = format!("{} · {}", st.name, st.status);
                if let Some(t) = bar_text(&label, st.start, st.end, y, false)
                    .or_else(|| bar_text(&st.name, st.start, st.end, y, false))
                {
                    area.draw(&t)?;
                }
            }
        }
        for p in &m.phases {
            if let Some(y) = row_of(&p.component) {
                let c = colour_of(&p.component);
                area.draw(&Rectangle::new(
                    [(p.start, y + 0.12), (p.end.max(p.start), y + 0.88)],
                    c.mix(if p.open { 0.45 } else { 0.8 }).filled(),
                ))?;
                if let Some(t) = bar_text(&p.operation, p.start, p.end, y, false) {
                    area.draw(&t)?;
                }
            }
        }
    }

    // The panels.
    let gpu = m.has_gpu();
    let (host_area, gpu_area) = if gpu {
        let h = panels.dim_in_pixel().1 as f64;
        let (a, b) = panels.split_vertically((h * 0.54) as i32);
        (a, Some(b))
    } else {
        (panels.clone(), None)
    };

    let host_max = m.host_max();
    let y_fmt = |y: &f64| format_axis(*y);

    // Host panel.
    {
        let (unit, div) = unit_for(host_max);
        let top = host_max * 1.22 / div;
        let mut chart = ChartBuilder::on(&host_area)
            .margin_right(right)
            .margin_top(s.px(30.0))
            .margin_bottom(if gpu { s.px(6.0) } else { s.px(4.0) })
            .y_label_area_size(y_area)
            .x_label_area_size(if gpu { 0 } else { s.px(46.0) })
            .build_cartesian_2d(x_range(), 0.0..top)?;
        chart
            .configure_mesh()
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .axis_style(MUTED.mix(0.6))
            .x_labels(0)
            .y_labels(6)
            .x_label_formatter(&time_fmt)
            .y_label_formatter(&y_fmt)
            .label_style(font(s.pt(12.0)).color(&MUTED))
            .axis_desc_style(font(s.pt(12.5)).color(&MUTED))
            .x_desc(if gpu {
                String::new()
            } else {
                format!("time since start ({})", clock_unit(m.duration))
            })
            .draw()?;
        panel_title(&chart, &format!("Host memory ({unit})"), s)?;
        time_axis(&chart, &ticks, m.duration, top, s, !gpu)?;
        shade(&chart, m, top, &colour_of)?;
        let scaled = |l: &Line| -> Line { l.iter().map(|p| (p.0, p.1 / div)).collect() };

        legend.push((Swatch::Heading, "Host memory".into()));
        chart.draw_series(
            AreaSeries::new(scaled(&m.host), 0.0, HOST.mix(0.10)).border_style(TRANSPARENT),
        )?;
        if !m.hwm.is_empty() {
            chart.draw_series(DashedLineSeries::new(
                scaled(&m.hwm),
                s.px(6.0),
                s.px(4.0),
                MUTED.mix(0.8).stroke_width(s.px(1.4).max(1) as u32),
            ))?;
        }
        for (i, l) in m.host_targets.iter().enumerate() {
            let c = TARGET_COLOURS[i % TOP_TARGETS];
            chart.draw_series(LineSeries::new(
                scaled(&l.line),
                c.stroke_width(s.px(1.6).max(1) as u32),
            ))?;
        }
        if let Some(o) = &m.host_others {
            chart.draw_series(DashedLineSeries::new(
                scaled(&o.line),
                s.px(3.0),
                s.px(3.0),
                MUTED.stroke_width(s.px(1.4).max(1) as u32),
            ))?;
        }
        chart.draw_series(LineSeries::new(
            scaled(&m.host),
            HOST.stroke_width(s.px(2.6).max(1) as u32),
        ))?;
        legend.push((
            Swatch::Line(HOST.to_rgba(), 3),
            format!(
                "tree host memory ({} process{})",
                m.processes.max(1),
                if m.processes <= 1 { "" } else { "es" }
            ),
        ));
        if !m.hwm.is_empty() {
            legend.push((
                Swatch::Dashed(MUTED.to_rgba()),
                "tree peak between samples".into(),
            ));
        }
        for (i, l) in m.host_targets.iter().enumerate() {
            legend.push((
                Swatch::Line(TARGET_COLOURS[i % TOP_TARGETS].to_rgba(), 2),
                format!("{} · peak {}", l.label, short(l.peak)),
            ));
        }
        if let Some(o) = &m.host_others {
            legend.push((Swatch::Dashed(MUTED.to_rgba()), o.label.clone()));
        }
        if let Some(tr) = &m.host_trend {
            annotations.push(draw_trend(&chart, tr, div, s)?);
            legend.push((
                Swatch::Line(LEAK.to_rgba(), 2),
                "leak trend (Theil–Sen)".into(),
            ));
        }
        if let Some((x, y)) = m.host_peak {
            let label = format!("host peak {}", mib(y));
            draw_peak(&chart, (x, y / div), &label, HOST, m.duration, s)?;
            annotations.push(label);
        }
        draw_marks(&chart, m, top, s, true)?;
        draw_alerts(&chart, m, top, s, |r| r == "host")?;
    }

    // GPU panel.
    if let Some(gpu_area) = &gpu_area {
        let gmax = m.gpu_max();
        let (unit, div) = unit_for(gmax);
        let top = gmax * 1.22 / div;
        let mut chart = ChartBuilder::on(gpu_area)
            .margin_right(right)
            .margin_top(s.px(30.0))
            .margin_bottom(s.px(4.0))
            .y_label_area_size(y_area)
            .x_label_area_size(s.px(46.0))
            .build_cartesian_2d(x_range(), 0.0..top)?;
        chart
            .configure_mesh()
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .axis_style(MUTED.mix(0.6))
            .x_labels(0)
            .y_labels(5)
            .x_label_formatter(&time_fmt)
            .y_label_formatter(&y_fmt)
            .label_style(font(s.pt(12.0)).color(&MUTED))
            .axis_desc_style(font(s.pt(12.5)).color(&MUTED))
            .x_desc(format!("time since start ({})", clock_unit(m.duration)))
            .draw()?;
        panel_title(&chart, &format!("GPU memory ({unit})"), s)?;
        time_axis(&chart, &ticks, m.duration, top, s, true)?;
        shade(&chart, m, top, &colour_of)?;
        let scaled = |l: &Line| -> Line { l.iter().map(|p| (p.0, p.1 / div)).collect() };
        legend.push((Swatch::Heading, "GPU memory".into()));
        if let Some((label, cap)) = &m.gpu_capacity {
            chart.draw_series(DashedLineSeries::new(
                [(0.0, cap / div), (m.duration * 1.01, cap / div)],
                s.px(10.0),
                s.px(5.0),
                LEAK.mix(0.7).stroke_width(s.px(1.4).max(1) as u32),
            ))?;
            let text = format!("{label} {}", short(*cap));
            chart.draw_series(std::iter::once(Text::new(
                text.clone(),
                (m.duration * 0.005, cap / div),
                font(s.pt(11.5))
                    .color(&LEAK)
                    .pos(Pos::new(HPos::Left, VPos::Bottom)),
            )))?;
            legend.push((Swatch::Dashed(LEAK.mix(0.7)), text));
        }
        if !m.gpu_tree.is_empty() {
            chart.draw_series(
                AreaSeries::new(scaled(&m.gpu_tree), 0.0, GPU.mix(0.10)).border_style(TRANSPARENT),
            )?;
        }
        for (i, l) in m.gpu_targets.iter().enumerate() {
            chart.draw_series(LineSeries::new(
                scaled(&l.line),
                TARGET_COLOURS[i % TOP_TARGETS].stroke_width(s.px(1.6).max(1) as u32),
            ))?;
            legend.push((
                Swatch::Line(TARGET_COLOURS[i % TOP_TARGETS].to_rgba(), 2),
                format!("{} · GPU peak {}", l.label, short(l.peak)),
            ));
        }
        if let Some(o) = &m.gpu_others {
            chart.draw_series(DashedLineSeries::new(
                scaled(&o.line),
                s.px(3.0),
                s.px(3.0),
                MUTED.stroke_width(s.px(1.4).max(1) as u32),
            ))?;
            legend.push((Swatch::Dashed(MUTED.to_rgba()), o.label.clone()));
        }
        if !m.gpu_tree.is_empty() {
            chart.draw_series(LineSeries::new(
                scaled(&m.gpu_tree),
                GPU.stroke_width(s.px(2.6).max(1) as u32),
            ))?;
            legend.insert(
                legend.len() - m.gpu_targets.len() - usize::from(m.gpu_others.is_some()),
                (
                    Swatch::Line(GPU.to_rgba(), 3),
                    "tree GPU (NVML, per process)".into(),
                ),
            );
        }
        if !m.alloc_reserved.is_empty() {
            chart.draw_series(DashedLineSeries::new(
                scaled(&m.alloc_reserved),
                s.px(7.0),
                s.px(4.0),
                ALLOC.stroke_width(s.px(1.8).max(1) as u32),
            ))?;
            legend.push((
                Swatch::Dashed(ALLOC.to_rgba()),
                "reserved (PyTorch, at marks)".into(),
            ));
        }
        if !m.alloc_used.is_empty() {
            chart.draw_series(LineSeries::new(
                scaled(&m.alloc_used),
                ALLOC.stroke_width(s.px(2.0).max(1) as u32),
            ))?;
            chart.draw_series(
                scaled(&m.alloc_used)
                    .into_iter()
                    .map(|p| Circle::new(p, s.px(2.8), ALLOC.filled())),
            )?;
            legend.push((
                Swatch::LineDot(ALLOC.to_rgba()),
                "allocated (PyTorch, at marks)".into(),
            ));
        }
        if let Some(tr) = &m.gpu_trend {
            annotations.push(draw_trend(&chart, tr, div, s)?);
            if !legend.iter().any(|l| l.1.starts_with("leak trend")) {
                legend.push((
                    Swatch::Line(LEAK.to_rgba(), 2),
                    "leak trend (Theil–Sen)".into(),
                ));
            }
        }
        if let Some((x, y)) = m.gpu_peak {
            let label = format!("GPU peak {}", mib(y));
            let c = if m.gpu_tree.is_empty() { ALLOC } else { GPU };
            draw_peak(&chart, (x, y / div), &label, c, m.duration, s)?;
            annotations.push(label);
        }
        draw_marks(&chart, m, top, s, false)?;
        draw_alerts(&chart, m, top, s, |r| r.starts_with("gpu"))?;
    } else if !m.host.is_empty() {
        annotations.push("no GPU data".into());
    }

    // Legend: phases, stages, alerts, marks.
    if !m.components.is_empty() {
        legend.push((Swatch::Heading, "Phases (by component)".into()));
        for c in m.components.iter().take(MAX_LANES) {
            let n = m.phases.iter().filter(|p| &p.component == c).count();
            legend.push((
                Swatch::Block(colour_of(c).mix(0.8)),
                format!("{c} ({n} span{})", if n == 1 { "" } else { "s" }),
            ));
        }
        if m.components.len() > MAX_LANES {
            legend.push((
                Swatch::Block(COMPONENT_COLOURS[MAX_LANES - 1].mix(0.8)),
                format!("… {} more components", m.components.len() - MAX_LANES),
            ));
        }
    }
    if !m.stages.is_empty() {
        legend.push((Swatch::Heading, "Stages".into()));
        let mut seen: Vec<String> = Vec::new();
        for st in &m.stages {
            if !seen.contains(&st.status) {
                seen.push(st.status.clone());
                let n = m.stages.iter().filter(|x| x.status == st.status).count();
                legend.push((
                    Swatch::Block(status_colour(&st.status).mix(0.85)),
                    format!("{} ({n})", st.status),
                ));
            }
        }
    }
    if !m.alerts.is_empty() {
        legend.push((Swatch::Heading, "Pressure alerts".into()));
        let mut levels: BTreeMap<usize, &str> = BTreeMap::new();
        for a in &m.alerts {
            let rank = match a.level.as_str() {
                "normal" => 0,
                "high" => 1,
                "critical" => 2,
                _ => 3,
            };
            levels.insert(rank, &a.level);
        }
        for level in levels.values() {
            legend.push((
                Swatch::Marker(level_colour(level).to_rgba()),
                level.to_string(),
            ));
        }
    }
    draw_legend(&legend_area, &legend, s)?;

    Ok(PlotSummary {
        path: PathBuf::new(),
        format: Format::Svg,
        width: opts.width,
        height: opts.height,
        legend: legend
            .into_iter()
            .filter(|l| !matches!(l.0, Swatch::Heading))
            .map(|l| l.1)
            .collect(),
        phases: m.phases.len(),
        stages: m.stages.len(),
        alerts: m.alerts.len(),
        annotations,
        gpu_panel: gpu,
    })
}

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Grid lines at round times, and their labels under the panel.
fn time_axis<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    ticks: &[f64],
    duration: f64,
    top: f64,
    s: Scale,
    labels: bool,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    for &t in ticks {
        area.draw(&PathElement::new([(t, 0.0), (t, top)], GRID))?;
        if labels {
            area.draw(
                &(EmptyElement::at((t, 0.0))
                    + PathElement::new([(0, 0), (0, s.px(5.0))], MUTED.mix(0.6))
                    + Text::new(
                        clock(t, duration),
                        (0, s.px(9.0)),
                        font(s.pt(12.0))
                            .color(&MUTED)
                            .pos(Pos::new(HPos::Center, VPos::Top)),
                    )),
            )?;
        }
    }
    Ok(())
}

/// The panel's name, above its top-left corner.
fn panel_title<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    title: &str,
    s: Scale,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    let (x, y) = (area.get_x_range().start, area.get_y_range().end);
    area.draw(
        &(EmptyElement::at((x, y))
            + Text::new(
                title.to_string(),
                (0, -s.px(8.0)),
                bold(s.pt(13.5)).pos(Pos::new(HPos::Left, VPos::Bottom)),
            )),
    )?;
    Ok(())
}

/// Phases shaded by component, and stage boundaries as faint lines.
fn shade<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    m: &Timeline,
    top: f64,
    colour_of: &dyn Fn(&str) -> RGBColor,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    for p in &m.phases {
        area.draw(&Rectangle::new(
            [(p.start, 0.0), (p.end.max(p.start), top)],
            colour_of(&p.component).mix(0.10).filled(),
        ))?;
    }
    for st in &m.stages {
        for x in [st.start, st.end] {
            area.draw(&PathElement::new(
                [(x, 0.0), (x, top)],
                status_colour(&st.status).mix(0.35),
            ))?;
        }
    }
    Ok(())
}

/// `experiment_start` / `experiment_end` as vertical lines, named in the
/// host panel.
fn draw_marks<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    m: &Timeline,
    top: f64,
    s: Scale,
    named: bool,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    for (t, name, left) in [
        (m.experiment_start, "experiment_start", true),
        (m.experiment_end, "experiment_end", false),
    ] {
        let Some(t) = t else { continue };
        area.draw(&PathElement::new(
            [(t, 0.0), (t, top)],
            INK.mix(0.55).stroke_width(s.px(1.2).max(1) as u32),
        ))?;
        if named {
            let (dx, anchor) = if left {
                (s.px(4.0), HPos::Left)
            } else {
                (-s.px(4.0), HPos::Right)
            };
            area.draw(
                &(EmptyElement::at((t, top))
                    + Text::new(
                        name,
                        (dx, s.px(5.0)),
                        font(s.pt(11.0))
                            .color(&INK.mix(0.7))
                            .pos(Pos::new(anchor, VPos::Top)),
                    )),
            )?;
        }
    }
    Ok(())
}

/// Alerts of the panel's resources: a line and a triangle at the top,
/// then the labels in white boxes, staggered over three rows so that
/// neighbours stay readable.
fn draw_alerts<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    m: &Timeline,
    top: f64,
    s: Scale,
    mine: impl Fn(&str) -> bool,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    let alerts: Vec<&AlertMark> = m.alerts.iter().filter(|a| mine(&a.resource)).collect();
    for a in &alerts {
        let c = level_colour(&a.level);
        area.draw(&PathElement::new([(a.t, 0.0), (a.t, top)], c.mix(0.55)))?;
        area.draw(
            &(EmptyElement::at((a.t, top))
                + TriangleMarker::new((0, s.px(7.0)), s.px(6.0), c.filled())),
        )?;
    }
    for (i, a) in alerts.iter().enumerate() {
        let c = level_colour(&a.level);
        let label = format!("{} {} {:.0} %", a.resource, a.level, a.ratio * 100.0);
        let style = font(s.pt(11.0)).color(&c);
        let (w, h) = area.estimate_text_size(&label, &style)?;
        let (w, h) = (w as i32, h as i32);
        let (x0, y0) = (s.px(9.0), s.px(16.0) + (i % 3) as i32 * (h + s.px(6.0)));
        let pad = s.px(2.0);
        area.draw(
            &(EmptyElement::at((a.t, top))
                + Rectangle::new(
                    [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                    WHITE.mix(0.85).filled(),
                )
                + PathElement::new(
                    [(0, s.px(12.0)), (0, y0 + h / 2), (x0 - pad, y0 + h / 2)],
                    c.mix(0.6),
                )
                + Text::new(label, (x0, y0), style)),
        )?;
    }
    Ok(())
}

/// A dot on the peak, and its value in a white box beside it.
fn draw_peak<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    at: (f64, f64),
    label: &str,
    colour: RGBColor,
    duration: f64,
    s: Scale,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    let style = bold(s.pt(12.5)).color(&colour);
    let (w, h) = area.estimate_text_size(label, &style)?;
    let (w, h) = (w as i32, h as i32);
    let left = at.0 > duration * 0.7;
    let pad = s.px(4.0);
    let (x0, y0) = if left {
        (-w - s.px(14.0), -h - s.px(12.0))
    } else {
        (s.px(12.0), -h - s.px(12.0))
    };
    area.draw(
        &(EmptyElement::at(at)
            + Circle::new((0, 0), s.px(5.0), colour.filled())
            + Circle::new(
                (0, 0),
                s.px(8.0),
                colour.stroke_width(s.px(1.5).max(1) as u32),
            )
            + PathElement::new(
                [(0, 0), (if left { x0 + w } else { x0 }, y0 + h)],
                colour.mix(0.6),
            )
            + Rectangle::new(
                [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                WHITE.mix(0.9).filled(),
            )
            + Rectangle::new(
                [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                colour.mix(0.5),
            )
            + Text::new(label.to_string(), (x0, y0), style.clone())),
    )?;
    Ok(())
}

fn draw_trend<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    tr: &Trend,
    div: f64,
    s: Scale,
) -> DrawResult<String, DB> {
    let area = chart.plotting_area();
    let from = (tr.from.0, tr.from.1 / div);
    let to = (tr.to.0, tr.to.1 / div);
    area.draw(&PathElement::new(
        [from, to],
        LEAK.stroke_width(s.px(2.4).max(1) as u32),
    ))?;
    let label = format!("leak? +{}/h", short(tr.rate_mib_per_hour));
    let style = bold(s.pt(12.0)).color(&LEAK);
    let (w, h) = area.estimate_text_size(&label, &style)?;
    let (w, h) = (w as i32, h as i32);
    let (x0, y0) = (-w - s.px(6.0), s.px(10.0));
    let pad = s.px(3.0);
    area.draw(
        &(EmptyElement::at(to)
            + Rectangle::new(
                [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                WHITE.mix(0.85).filled(),
            )
            + Text::new(label.clone(), (x0, y0), style)),
    )?;
    Ok(label)
}

fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    items: &[(Swatch, String)],
    s: Scale,
) -> DrawResult<(), DB> {
    let x = s.px(10.0);
    let mut y = s.px(16.0);
    let (_, height) = area.dim_in_pixel();
    let row = s.px(21.0);
    let max_chars = 38;
    for (swatch, text) in items {
        if y + row > height as i32 {
            area.draw(&Text::new("…", (x, y), font(s.pt(12.0))))?;
            break;
        }
        let text: String = if text.chars().count() > max_chars {
            text.chars().take(max_chars - 1).collect::<String>() + "…"
        } else {
            text.clone()
        };
        let mid = y + row / 2;
        let sw = s.px(26.0);
        match swatch {
            Swatch::Heading => {
                if y > s.px(16.0) {
                    y += s.px(8.0);
                }
                area.draw(&Text::new(
                    text,
                    (x, y + row / 2),
                    bold(s.pt(13.0)).pos(Pos::new(HPos::Left, VPos::Center)),
                ))?;
                y += row;
                continue;
            }
            Swatch::Line(c, w) => {
                area.draw(&PathElement::new(
                    [(x, mid), (x + sw, mid)],
                    c.stroke_width(s.px(*w as f64).max(1) as u32),
                ))?;
            }
            Swatch::Dashed(c) => {
                for k in 0..3 {
                    let a = x + k * s.px(10.0);
                    area.draw(&PathElement::new(
                        [(a, mid), (a + s.px(6.0), mid)],
                        c.stroke_width(s.px(2.0).max(1) as u32),
                    ))?;
                }
            }
            Swatch::Block(c) => {
                area.draw(&Rectangle::new(
                    [(x, mid - s.px(7.0)), (x + sw, mid + s.px(7.0))],
                    c.filled(),
                ))?;
            }
            Swatch::LineDot(c) => {
                area.draw(&PathElement::new(
                    [(x, mid), (x + sw, mid)],
                    c.stroke_width(s.px(2.0).max(1) as u32),
                ))?;
                area.draw(&Circle::new((x + sw / 2, mid), s.px(3.5), c.filled()))?;
            }
            Swatch::Marker(c) => {
                area.draw(&TriangleMarker::new(
                    (x + sw / 2, mid + s.px(2.0)),
                    s.px(6.0),
                    c.filled(),
                ))?;
            }
        }
        area.draw(&Text::new(
            text,
            (x + sw + s.px(10.0), mid),
            font(s.pt(12.5)).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        y += row;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Numbers and times for people.

/// MiB up to 10 GiB, GiB beyond: `(unit, divisor)`.
fn unit_for(max_mib: f64) -> (&'static str, f64) {
    if max_mib >= 10.0 * 1024.0 {
        ("GiB", 1024.0)
    } else {
        ("MiB", 1.0)
    }
}

fn format_axis(y: f64) -> String {
    if y == 0.0 {
        "0".into()
    } else if y.abs() >= 100.0 || y.fract() == 0.0 {
        group_thousands(y.round())
    } else if y.abs() >= 1.0 {
        format!("{y:.1}")
    } else {
        format!("{y:.2}")
    }
}

/// `1,234 MiB`, or `12.3 GiB` from 10 GiB on.
fn short(x: f64) -> String {
    if x >= 10.0 * 1024.0 {
        format!("{:.1} GiB", x / 1024.0)
    } else {
        mib(x)
    }
}

/// `1,234 MiB`, or `12.3 GiB (12,595 MiB)` from 10 GiB on.
fn mib(x: f64) -> String {
    if x >= 10.0 * 1024.0 {
        format!("{:.1} GiB ({} MiB)", x / 1024.0, group_thousands(x.round()))
    } else if x >= 10.0 {
        format!("{} MiB", group_thousands(x.round()))
    } else {
        format!("{x:.1} MiB")
    }
}

fn group_thousands(x: f64) -> String {
    let neg = x < 0.0;
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if neg {
        format!("-{out}")
    } else {
        out
    }
}

/// Ticks at a round time step: at most 12 over the run.
fn time_ticks(duration: f64) -> Vec<f64> {
    const STEPS: [f64; 24] = [
        0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
        3600.0, 7200.0, 10800.0, 21600.0, 43200.0, 86400.0, 172_800.0, 432_000.0, 864_000.0,
    ];
    let step = STEPS
        .iter()
        .copied()
        .find(|s| duration / s <= 12.0)
        .unwrap_or(duration / 10.0);
    (0..)
        .map(|i| i as f64 * step)
        .take_while(|t| *t <= duration * 1.01)
        .collect()
}

/// Tick labels for `x` seconds on an axis spanning `duration` seconds.
fn clock(x: f64, duration: f64) -> String {
    if duration < 10.0 {
        format!("{x:.1}")
    } else if duration < 120.0 {
        format!("{x:.0}")
    } else if duration < 2.0 * 3600.0 {
        let s = x.round().max(0.0) as u64;
        format!("{}:{:02}", s / 60, s % 60)
    } else {
        let m = (x / 60.0).round().max(0.0) as u64;
        format!("{}:{:02}", m / 60, m % 60)
    }
}

fn clock_unit(duration: f64) -> &'static str {
    if duration < 120.0 {
        "s"
    } else if duration < 2.0 * 3600.0 {
        "min:s"
    } else {
        "h:min"
    }
}

fn human_duration(s: f64) -> String {
    let s = s.max(0.0);
    if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 2.0 * 3600.0 {
        format!("{} min {:02} s", (s / 60.0).floor(), (s % 60.0).floor())
    } else {
        format!(
            "{} h {:02} min",
            (s / 3600.0).floor(),
            ((s % 3600.0) / 60.0).floor()
        )
    }
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
    fn formats_come_from_the_extension() {
        assert_eq!(Format::from_path(Path::new("a/b.SVG")), Some(Format::Svg));
        assert_eq!(Format::from_path(Path::new("x.png")), Some(Format::Png));
        assert_eq!(Format::from_path(Path::new("x.pdf")), None);
        assert_eq!(Format::from_path(Path::new("x")), None);
        let err = plot(
            &Document::default(),
            Path::new("x.jpg"),
            &PlotOptions::default(),
        );
        assert!(matches!(err, Err(PlotError::Format { .. })));
        let err = plot(
            &Document::default(),
            Path::new("x.svg"),
            &PlotOptions::default(),
        );
        assert!(matches!(err, Err(PlotError::Empty)), "{err:?}");
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
    fn numbers_and_times_read_well() {
        assert_eq!(mib(1234.4), "1,234 MiB");
        assert_eq!(mib(20480.0), "20.0 GiB (20,480 MiB)");
        assert_eq!(mib(3.25), "3.2 MiB");
        assert_eq!(group_thousands(1234567.0), "1,234,567");
        assert_eq!(clock(75.0, 300.0), "1:15");
        assert_eq!(clock(7260.0, 10_000.0), "2:01");
        assert_eq!(clock(12.0, 60.0), "12");
        assert_eq!(human_duration(3725.0), "62 min 05 s");
        assert_eq!(unit_for(20_000.0), ("GiB", 1024.0));
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
