//! `memtrack report FILE`: what a run needed, as a readable terminal report
//! or as JSON.
//!
//! People answer "what GPU do I need?", "is there a leak?" by reading the
//! JSON by hand; this does it. It reads any schema version and bare files
//! (only `detailed_log` and `peak_usage`), recomputing what an
//! older file lacks (the leak verdict, the re-run summary).

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::model::leak::{self, LeakReport, Verdict};
use crate::model::{
    Alert, AttributionMode, Document, Exit, FlightWindow, Gpu, Peaks, RankSummary, RunInfo, Stage,
};
use crate::units::format_mib_one_decimal;

/// GPU memory sizes sold, GiB: the smallest one a run fits in is the
/// answer to "what GPU do I need".
pub(crate) const GPU_CLASSES_GIB: &[f64] = &[
    4.0, 6.0, 8.0, 10.0, 11.0, 12.0, 16.0, 20.0, 24.0, 32.0, 40.0, 48.0, 80.0, 94.0, 141.0, 192.0,
];

/// What a re-run needs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Needs {
    /// Peak host RAM (RSS, or the summed high-water mark when higher), MiB.
    pub(crate) host_peak_mb: f64,
    /// With 10 % headroom, MiB.
    pub(crate) host_needed_mb: f64,
    /// Per GPU: the tree's peak, MiB.
    pub(crate) gpu_peak_mb: BTreeMap<String, f64>,
    /// The largest per-GPU need with 10 % headroom, MiB.
    pub(crate) gpu_needed_mb: f64,
    /// The smallest GPU memory class that fits, GiB (none when no GPU was used).
    pub(crate) gpu_class_gib: Option<f64>,
}

/// Everything the report says, for `--json`. The blocks copied from the
/// document are written with their keys sorted (`sorted_keys`), as
/// `--json` has always written them.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(serialize_with = "sorted_keys")]
    pub(crate) run: RunInfo,
    pub(crate) peak_usage: Peaks,
    pub(crate) peaks_by_component: BTreeMap<String, Peaks>,
    #[serde(serialize_with = "sorted_keys")]
    pub(crate) stages: Vec<Stage>,
    #[serde(serialize_with = "sorted_keys")]
    pub(crate) targets: Vec<TargetRow>,
    #[serde(serialize_with = "sorted_keys")]
    pub(crate) gpus: Vec<Gpu>,
    /// Whose memory the GPU figures are (absent without NVML and in
    /// older files).
    #[serde(
        serialize_with = "sorted_keys",
        skip_serializing_if = "Option::is_none"
    )]
    pub(crate) gpu_attribution: Option<crate::model::GpuAttribution>,
    #[serde(serialize_with = "sorted_keys")]
    pub(crate) alerts: Vec<Alert>,
    /// The document's `leak` block as the file holds it (computed when it
    /// has none); [`LeakReport::from_value`] reads it.
    pub(crate) leak: serde_json::Value,
    #[serde(serialize_with = "sorted_keys")]
    pub(crate) flight_recorder: Vec<FlightWindow>,
    #[serde(serialize_with = "sorted_keys")]
    pub(crate) ranks: Ranks,
    pub(crate) needs: Needs,
    /// Where the host figures came from (absent in older files).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) host: Option<crate::model::HostInfo>,
    /// What the figures say to change (docs/advice.md).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) advice: Vec<crate::model::advice::Advice>,
}

/// A process in the report: its identity, peaks and end, without its
/// series.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct TargetRow {
    pub(crate) pid: u32,
    pub(crate) name: String,
    pub(crate) root: bool,
    pub(crate) peak_rss_mb: f64,
    pub(crate) hwm_mb: f64,
    pub(crate) peak_gpu_mb: f64,
    pub(crate) exit: Option<Exit>,
    pub(crate) first_seen: f64,
    pub(crate) exited_at: Option<f64>,
}

/// A merged job's ranks, and which rank reached each figure's peak.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Ranks {
    pub(crate) ranks: Vec<RankSummary>,
    pub(crate) worst: BTreeMap<String, String>,
}

/// Serializes `v` with every object's keys sorted (through
/// `serde_json::Value`, whose maps keep keys in order).
fn sorted_keys<T: Serialize, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    serde_json::to_value(v)
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
}

const HEADROOM: f64 = 0.10;

/// The smallest class in [`GPU_CLASSES_GIB`] holding `mb` MiB (beyond the
/// largest, the GiB rounded up). `None` for nothing used, and for a figure
/// above [`MAX_DEVICE_BYTES`](crate::model::MAX_DEVICE_BYTES), which no GPU
/// holds: such a file is corrupt, and no card is named for it.
pub(crate) fn gpu_class(mb: f64) -> Option<f64> {
    if !(mb > 0.0 && mb <= crate::units::mib(crate::model::MAX_DEVICE_BYTES)) {
        return None;
    }
    let gib = mb / 1024.0;
    GPU_CLASSES_GIB
        .iter()
        .copied()
        .find(|c| *c >= gib)
        .or(Some(gib.ceil()))
}

/// What a re-run needs, from whatever the file holds.
pub(crate) fn needs(doc: &Document) -> Needs {
    let p = &doc.peak_usage;
    let host_peak = p
        .figures
        .cpu_ram_used_mb
        .max(p.figures.cpu_ram_hwm_mb)
        .max(doc.summary.peak_host_ram_mb);
    let mut gpu_peak: BTreeMap<String, f64> = BTreeMap::new();
    for g in &doc.gpus {
        if g.peak_tree_used_mb > 0.0 {
            let key = match &g.host {
                Some(h) => format!("{h}:{}", g.index),
                None => g.index.to_string(),
            };
            gpu_peak.insert(key, g.peak_tree_used_mb);
        }
    }
    if gpu_peak.is_empty() {
        // Bare or allocator-only files: PyTorch's reserved pool is
        // the closest figure (it leaves out the CUDA context).
        let alloc = p
            .figures
            .reserved_gpu_ram_mb
            .max(p.figures.gpu_ram_peak_mb)
            .max(p.figures.gpu_process_used_mb);
        if alloc > 0.0 {
            gpu_peak.insert("0".into(), alloc);
        }
    }
    let gpu_max = gpu_peak.values().copied().fold(0.0, f64::max);
    let round_up = |mb: f64| (mb * (1.0 + HEADROOM)).ceil();
    Needs {
        host_peak_mb: host_peak,
        host_needed_mb: round_up(host_peak),
        gpu_needed_mb: round_up(gpu_max),
        gpu_class_gib: gpu_class(round_up(gpu_max)),
        gpu_peak_mb: gpu_peak,
    }
}

/// Builds the report (the leak verdict is computed when the file has none).
pub fn build(doc: &Document) -> Report {
    let leak = doc
        .leak
        .clone()
        .unwrap_or_else(|| leak::analyze(doc, &leak::LeakConfig::default()).to_value());
    Report {
        run: doc.run.clone(),
        peak_usage: doc.peak_usage,
        peaks_by_component: doc.peaks_by_component.clone(),
        stages: doc.stages.clone(),
        targets: doc
            .targets
            .iter()
            .map(|t| TargetRow {
                pid: t.pid,
                name: t.name.clone(),
                root: t.root,
                peak_rss_mb: t.peak_rss_mb,
                hwm_mb: t.hwm_mb,
                peak_gpu_mb: t.peak_gpu_mb,
                exit: t.exit,
                first_seen: t.first_seen,
                exited_at: t.exited_at,
            })
            .collect(),
        gpus: doc.gpus.clone(),
        gpu_attribution: doc.gpu_attribution.clone(),
        alerts: doc.alerts.clone(),
        leak,
        flight_recorder: doc.flight_recorder.clone(),
        ranks: Ranks {
            ranks: doc.ranks.clone(),
            worst: doc.worst_rank.clone(),
        },
        needs: needs(doc),
        host: doc.host.clone(),
        advice: doc.advice.clone(),
    }
}

/// Latest time RFC 3339 can write (9999-12-31T23:59:59Z), Unix seconds.
const LAST_CLOCK: f64 = 253_402_300_799.0;

/// A Unix time as RFC 3339; `?` for what a file may hold but no clock can
/// show (negative, NaN, past year 9999).
fn clock(ts: f64) -> String {
    if !(ts > 0.0 && ts <= LAST_CLOCK) {
        return "?".into();
    }
    match std::time::Duration::try_from_secs_f64(ts) {
        Ok(d) => humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + d).to_string(),
        Err(_) => "?".into(),
    }
}

/// `s` with every terminal control written as a visible escape (`\u{1b}`),
/// newlines included unless `keep_newlines`. The report prints strings the
/// job chose (component, operation and stage names, labels, the command
/// line, the CUDA OOM summary): they are shown, never obeyed.
pub(crate) fn escape_controls(s: &str, keep_newlines: bool) -> std::borrow::Cow<'_, str> {
    if keep_newlines {
        crate::logging::terminal::escape_text(s)
    } else {
        crate::logging::terminal::escape(s)
    }
}

/// A job-provided string on one line of the report.
fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    escape_controls(s, false)
}

/// A fixed-width table.
fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| shown(c).into_owned()).collect())
        .collect();
    let rows = rows.as_slice();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| -> String {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = widths[i] - c.chars().count();
                if i == 0 {
                    format!("{c}{}", " ".repeat(pad))
                } else {
                    format!("{}{c}", " ".repeat(pad))
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    let _ = writeln!(
        out,
        "  {}",
        line(header.iter().map(|h| h.to_string()).collect())
    );
    for r in rows {
        let _ = writeln!(out, "  {}", line(r.clone()));
    }
}

/// Whether the run has GPU memory to speak of: a GPU seen, or a GPU
/// figure above 0 anywhere (PyTorch's allocator figures come without NVML
/// too). Without it the report shows no GPU column: all zeros say nothing.
pub(crate) fn has_gpu(doc: &Document) -> bool {
    !doc.gpus.is_empty()
        || doc.peak_usage.any_gpu()
        || doc.peaks_by_component.values().any(Peaks::any_gpu)
        || doc.ranks.iter().any(|r| r.peak_usage.any_gpu())
        || doc.targets.iter().any(|t| t.peak_gpu_mb > 0.0)
}

/// A table without the columns `drop` names (by header), e.g. the GPU
/// columns of a run without GPU memory.
fn table_without(out: &mut String, header: &[&str], rows: &[Vec<String>], drop: &[&str]) {
    let keep: Vec<bool> = header.iter().map(|h| !drop.contains(h)).collect();
    let pick = |cells: &[String]| -> Vec<String> {
        cells
            .iter()
            .zip(&keep)
            .filter(|(_, k)| **k)
            .map(|(c, _)| c.clone())
            .collect()
    };
    let kept: Vec<&str> = header
        .iter()
        .zip(&keep)
        .filter(|(_, k)| **k)
        .map(|(h, _)| *h)
        .collect();
    let rows: Vec<Vec<String>> = rows.iter().map(|r| pick(r)).collect();
    table(out, &kept, &rows);
}

/// The GPU columns' headers to leave out of `doc`'s tables (none when the
/// run has GPU memory).
fn gpu_columns(doc: &Document) -> &'static [&'static str] {
    if has_gpu(doc) {
        &[]
    } else {
        &[
            "GPU used",
            "GPU peak",
            "GPU reserved",
            "GPU (NVML)",
            "peak GPU",
        ]
    }
}

fn peaks_row(name: &str, p: &Peaks) -> Vec<String> {
    vec![
        name.to_string(),
        format_mib_one_decimal(p.figures.cpu_ram_used_mb),
        format_mib_one_decimal(p.figures.cpu_ram_used_mb.max(p.figures.cpu_ram_hwm_mb)),
        format_mib_one_decimal(p.figures.gpu_ram_used_mb),
        format_mib_one_decimal(p.figures.gpu_ram_peak_mb),
        format_mib_one_decimal(p.figures.reserved_gpu_ram_mb),
        format_mib_one_decimal(p.figures.gpu_process_used_mb),
        p.samples.to_string(),
    ]
}

fn verdict_line(v: Option<&Verdict>) -> String {
    verdict_line_beside(v, false)
}

/// [`verdict_line`]; `beside_suspicion`: a part of the job is suspected,
/// so a verdict of no leak says so instead of giving its reason (an
/// interval around 0 beside a suspicion reads as a contradiction).
fn verdict_line_beside(v: Option<&Verdict>, beside_suspicion: bool) -> String {
    let Some(v) = v else {
        return "not judged".into();
    };
    let rate = v.rate_mib_per_hour;
    if v.suspected {
        // The growth seen first: an hourly rate from a short window
        // extrapolates far beyond what happened.
        format!(
            "LEAK SUSPECTED: +{:.1} MiB over the last {:.0} s ({rate:+.0} MiB/hour)",
            v.growth_mib, v.window_s
        )
    } else if !v.judged {
        let reason = if v.reason.is_empty() {
            "too short"
        } else {
            &v.reason
        };
        format!(
            "not judged ({})",
            reason.strip_prefix("not judged: ").unwrap_or(reason)
        )
    } else if beside_suspicion {
        format!(
            "no leak suspected in this total ({:+.1} MiB over {:.0} s), but in a part of it: \
             see below",
            v.growth_mib, v.window_s
        )
    } else {
        format!(
            "no leak suspected ({:+.1} MiB over {:.0} s, {rate:+.0} MiB/hour: {})",
            v.growth_mib, v.window_s, v.reason
        )
    }
}

/// Where the host figures came from, in one line.
fn host_line(doc: &Document) -> String {
    let Some(h) = &doc.host else {
        return "RSS summed over the processes (pages shared between processes count once per process)".into();
    };
    let what = match h.source {
        crate::model::HostSource::Pages => {
            "the processes' distinct resident pages (every page once)".into()
        }
        crate::model::HostSource::Cgroup => format!(
            "memory cgroup{} (every page once)",
            h.cgroup
                .as_deref()
                .map(|c| format!(" {c}"))
                .unwrap_or_default()
        ),
        crate::model::HostSource::Pss => "Σ Pss over the processes (every page once)".into(),
        crate::model::HostSource::Rss => {
            "RSS summed over the processes (shared pages count once per process)".into()
        }
    };
    let mut line = what;
    if !h.reason.is_empty() && h.source != crate::model::HostSource::Cgroup {
        line.push_str(&format!(" — {}", h.reason));
    }
    if h.source != crate::model::HostSource::Rss && h.rss_sum_peak_mb > 0.0 {
        line.push_str(&format!(
            "; the RSS sum peaked at {}",
            format_mib_one_decimal(h.rss_sum_peak_mb)
        ));
    }
    line
}

/// The terminal report.
/// The terminal report. Every string the file holds is shown with its
/// control characters escaped (`escape_controls`).
pub fn render(doc: &Document) -> String {
    let out = render_raw(doc);
    // Fields are escaped where they are written; this pass makes sure no
    // control character but the report's own newlines reaches the terminal.
    escape_controls(&out, true).into_owned()
}

fn render_raw(doc: &Document) -> String {
    let r = build(doc);
    let mut out = String::new();
    write_run(&mut out, doc);
    write_advice(&mut out, &doc.advice);
    write_peaks(&mut out, doc);
    write_stages(&mut out, doc);
    write_ranks(&mut out, doc);
    write_processes(&mut out, doc);
    write_gpus(&mut out, doc);
    write_alerts(&mut out, doc);
    write_leak(&mut out, &LeakReport::from_value(&r.leak));
    write_flight_recorder(&mut out, doc);
    let whole_devices = r
        .gpu_attribution
        .as_ref()
        .is_some_and(|a| a.mode != AttributionMode::PerProcess);
    write_needs(&mut out, &r.needs, whole_devices);
    out
}

/// What the figures say to change, first: only when there is something.
fn write_advice(out: &mut String, advice: &[crate::model::advice::Advice]) {
    if advice.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nadvice:");
    for line in crate::model::advice::render(advice).lines() {
        let _ = writeln!(out, "  {}", shown(line));
    }
}

/// The run: its name, where and when it ran, how it ended, the command,
/// where the figures came from and its labels.
fn write_run(out: &mut String, doc: &Document) {
    let run = &doc.run;
    let name = if run.name.is_empty() {
        "(unnamed run)"
    } else {
        &run.name
    };
    let _ = writeln!(out, "memtrack report: {}", shown(name));
    if doc.schema == 0 {
        let _ = writeln!(out, "  (bare file: only detailed_log and peak_usage)");
    } else {
        let duration = run.end.unwrap_or(run.start) - run.start;
        let exit = match run.exit {
            Some(e) if e.signal.is_some() => format!(
                "killed by {} ({})",
                crate::sys::signal_name(e.signal.unwrap_or(0)),
                e.code
            ),
            Some(e) => format!("exit {}", e.code),
            None => "exit unknown".into(),
        };
        let _ = writeln!(
            out,
            "  {} on {}, {} — {}, {exit}, {}",
            run.mode,
            run.host,
            clock(run.start),
            crate::units::format_seconds(duration),
            run.status
        );
        if !run.command.is_empty() {
            let _ = writeln!(out, "  command: {}", shown(&run.command.join(" ")));
        }
        let _ = writeln!(out, "  GPU figures: {}", run.gpu_backend);
        if let Some(line) = attribution_line(doc) {
            let _ = writeln!(out, "  GPU attribution: {line}");
        }
        let _ = writeln!(out, "  host figures: {}", host_line(doc));
        if !run.labels.is_empty() {
            let l: Vec<String> = run.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(out, "  labels: {}", shown(&l.join(" ")));
        }
    }
}

/// The run's peaks, then each component's the job named, then the time
/// outside its spans (memtrack's own `system` entries: timer samples taken
/// while no span was open, the run's start and end), shown only beside
/// components of the job's: alone it is the run's row again.
fn write_peaks(out: &mut String, doc: &Document) {
    let _ = writeln!(out, "\nPeaks");
    let mut rows = vec![peaks_row("run", &doc.peak_usage)];
    let system = crate::store::SYSTEM;
    for (c, p) in doc.peaks_by_component.iter().filter(|(c, _)| *c != system) {
        rows.push(peaks_row(c, p));
    }
    if let (true, Some(p)) = (rows.len() > 1, doc.peaks_by_component.get(system)) {
        rows.push(peaks_row("outside spans", p));
    }
    table_without(
        out,
        &[
            "component",
            "host sampled",
            "host between samples",
            "GPU used",
            "GPU peak",
            "GPU reserved",
            "GPU (NVML)",
            "samples",
        ],
        &rows,
        gpu_columns(doc),
    );
}

/// Each stage: status, duration and peaks.
fn write_stages(out: &mut String, doc: &Document) {
    if !doc.stages.is_empty() {
        let _ = writeln!(out, "\nStages");
        let rows: Vec<Vec<String>> = doc
            .stages
            .iter()
            .map(|s| {
                vec![
                    s.name.clone(),
                    s.status.clone(),
                    s.duration_s
                        .map(crate::units::format_seconds)
                        .unwrap_or_else(|| "-".into()),
                    format_mib_one_decimal(s.peak.figures.cpu_ram_used_mb),
                    format_mib_one_decimal(
                        s.peak
                            .figures
                            .gpu_ram_peak_mb
                            .max(s.peak.figures.gpu_process_used_mb),
                    ),
                ]
            })
            .collect();
        table_without(
            out,
            &["stage", "status", "duration", "peak host", "peak GPU"],
            &rows,
            gpu_columns(doc),
        );
        // What a failed stage said (the exception), under the table.
        for s in &doc.stages {
            if let Some(m) = s.message.as_deref().filter(|m| !m.trim().is_empty()) {
                let _ = writeln!(
                    out,
                    "  {} {}: {}",
                    shown(&s.name),
                    shown(&s.status),
                    shown(m.trim())
                );
            }
        }
    }
}

/// Each rank of a merged job, and which rank was worst at what.
fn write_ranks(out: &mut String, doc: &Document) {
    if !doc.ranks.is_empty() {
        let _ = writeln!(out, "\nRanks");
        let rows: Vec<Vec<String>> = doc
            .ranks
            .iter()
            .map(|k| {
                vec![
                    k.rank.clone(),
                    k.host.clone(),
                    format_mib_one_decimal(
                        k.peak_usage
                            .figures
                            .cpu_ram_used_mb
                            .max(k.peak_usage.figures.cpu_ram_hwm_mb),
                    ),
                    format_mib_one_decimal(
                        k.peak_usage
                            .figures
                            .gpu_process_used_mb
                            .max(k.peak_usage.figures.gpu_ram_peak_mb),
                    ),
                    k.exit
                        .map(|e| e.code.to_string())
                        .unwrap_or_else(|| "?".into()),
                ]
            })
            .collect();
        table_without(
            out,
            &["rank", "host", "peak host", "peak GPU", "exit"],
            &rows,
            gpu_columns(doc),
        );
        for (figure, rank) in &doc.worst_rank {
            let _ = writeln!(out, "  worst {}: rank {}", shown(figure), shown(rank));
        }
    }
}

/// The largest processes (at most 20), largest first.
fn write_processes(out: &mut String, doc: &Document) {
    if !doc.targets.is_empty() {
        let _ = writeln!(out, "\nProcesses ({})", doc.targets.len());
        let mut targets: Vec<&crate::model::Target> = doc.targets.iter().collect();
        targets.sort_by(|a, b| b.peak_rss_mb.total_cmp(&a.peak_rss_mb));
        let shown = 20;
        let rows: Vec<Vec<String>> = targets
            .iter()
            .take(shown)
            .map(|t| {
                let exit = match t.exit {
                    Some(e) if e.signal.is_some() => crate::sys::signal_name(e.signal.unwrap_or(0)),
                    Some(e) if e.known => format!("exit {}", e.code),
                    Some(_) => "exited".into(),
                    None => "running".into(),
                };
                let own = |v: Option<f64>| v.map_or_else(|| "-".into(), format_mib_one_decimal);
                vec![
                    t.pid.to_string(),
                    format!(
                        "{}{}",
                        t.display_name(),
                        if t.root { " (root)" } else { "" }
                    ),
                    match t.peak_uss_mb {
                        Some(v) if t.peak_uss_estimated => format!("~{}", own(Some(v))),
                        v => own(v),
                    },
                    own(t.peak_pss_mb),
                    format_mib_one_decimal(t.peak_rss_mb),
                    format_mib_one_decimal(t.hwm_mb),
                    format_mib_one_decimal(t.peak_gpu_mb),
                    exit,
                ]
            })
            .collect();
        table_without(
            out,
            &[
                "pid", "name", "peak USS", "peak PSS", "peak RSS", "HWM", "peak GPU", "end",
            ],
            &rows,
            gpu_columns(doc),
        );
        if targets.len() > shown {
            let _ = writeln!(
                out,
                "  … and {} more (memtrack report --json lists all)",
                targets.len() - shown
            );
        }
        if targets.iter().take(shown).any(|t| t.peak_uss_estimated) {
            let _ = writeln!(
                out,
                "  ~ estimated: no own-cost read came while it held its size (its last read \
                 plus what it wrote since)"
            );
        }
    }
}

/// How the GPU figures were attributed, when it is not simply per-process
/// in the host's PID namespace: the mode, what a device-level figure
/// holds, and why.
fn attribution_line(doc: &Document) -> Option<String> {
    let a = doc.gpu_attribution.as_ref()?;
    let plain = a.mode == AttributionMode::PerProcess && a.pid_namespace.init != Some(false);
    if plain {
        return None;
    }
    let what = match a.mode {
        AttributionMode::PerProcess => "per-process",
        AttributionMode::DeviceLevel => {
            "device-level (includes every process on the device, not only the job's)"
        }
        AttributionMode::Mixed => {
            "mixed (some samples device-level: they include every process on the device)"
        }
    };
    Some(format!("{what}; {}", shown(&a.reason)))
}

/// Each GPU: its size and the peaks of this run and of the device.
fn write_gpus(out: &mut String, doc: &Document) {
    if !doc.gpus.is_empty() {
        let _ = writeln!(out, "\nGPUs");
        if doc
            .gpu_attribution
            .as_ref()
            .is_some_and(|a| a.mode != AttributionMode::PerProcess)
        {
            let _ = writeln!(
                out,
                "  \"this run\" is device-level: it includes every process on the device"
            );
        }
        let rows: Vec<Vec<String>> = doc
            .gpus
            .iter()
            .map(|g| {
                vec![
                    g.host
                        .as_ref()
                        .map_or_else(|| g.index.to_string(), |h| format!("{h}:{}", g.index)),
                    g.name.clone(),
                    format_mib_one_decimal(g.total_mb),
                    format_mib_one_decimal(g.peak_tree_used_mb),
                    format_mib_one_decimal(g.peak_used_mb),
                    format!("{:.0} %", g.peak_utilization_pct),
                    format!("{:.0} °C", g.peak_temperature_c),
                ]
            })
            .collect();
        table(
            out,
            &[
                "gpu",
                "name",
                "total",
                "peak (this run)",
                "peak (device)",
                "peak util",
                "peak temp",
            ],
            &rows,
        );
    }
}

/// The pressure alerts, in seconds since the start.
fn write_alerts(out: &mut String, doc: &Document) {
    if !doc.alerts.is_empty() {
        let _ = writeln!(out, "\nAlerts");
        for a in &doc.alerts {
            let _ = writeln!(
                out,
                "  +{}  {}",
                crate::units::format_seconds(a.timestamp - doc.run.start),
                shown(&a.message)
            );
        }
    }
}

/// The leak verdicts: the tree's host and GPU memory, then each
/// suspected process and component.
fn write_leak(out: &mut String, leak: &LeakReport) {
    let _ = writeln!(out, "\nLeak check");
    // A part suspected (a process, a component): the totals' "no leak"
    // points to it rather than contradicting it.
    let part = leak
        .targets
        .iter()
        .flatten()
        .any(|t| t.host.suspected || t.gpu.as_ref().is_some_and(|g| g.suspected))
        || leak.components.iter().flatten().any(|(_, v)| v.suspected);
    let _ = writeln!(
        out,
        "  host: {}",
        verdict_line_beside(leak.host.as_ref(), part)
    );
    if let Some(gpu) = &leak.gpu {
        let _ = writeln!(out, "  GPU:  {}", verdict_line_beside(Some(gpu), part));
    }
    for t in leak.targets.iter().flatten() {
        if t.host.suspected {
            let _ = writeln!(
                out,
                "  PID {} {}{}: {}",
                t.pid,
                t.name,
                if t.figure == "uss" {
                    " (own memory, USS)"
                } else {
                    ""
                },
                verdict_line(Some(&t.host))
            );
        }
        if let Some(g) = t.gpu.as_ref().filter(|g| g.suspected) {
            let _ = writeln!(
                out,
                "  PID {} {} GPU: {}",
                t.pid,
                t.name,
                verdict_line(Some(g))
            );
        }
    }
    for (c, v) in leak.components.iter().flatten() {
        if v.suspected {
            let _ = writeln!(out, "  component {}: {}", shown(c), verdict_line(Some(v)));
        }
    }
}

/// What the flight recorder kept around each death: the points
/// (sparse far from the event) and PyTorch's memory summary.
fn write_flight_recorder(out: &mut String, doc: &Document) {
    for w in &doc.flight_recorder {
        let what = match w.reason.as_str() {
            "signal" => format!(
                "died by {}",
                w.exit
                    .and_then(|e| e.signal)
                    .map(crate::sys::signal_name)
                    .unwrap_or_default()
            ),
            "oom_kill" => "killed by the kernel's OOM killer".into(),
            "cuda_oom" => "hit CUDA out of memory".into(),
            other => shown(other).into_owned(),
        };
        let _ = writeln!(
            out,
            "\nFlight recorder: PID {} {} {what} at +{} ({} points, every {:.0} ms)",
            w.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
            shown(&w.name),
            crate::units::format_seconds(w.timestamp - doc.run.start),
            w.points.len(),
            w.interval_s * 1000.0
        );
        let n = w.points.len();
        let step = (n / 12).max(1);
        let rows: Vec<Vec<String>> = w
            .points
            .iter()
            .enumerate()
            // Sparse far from the event, every point in the second around it.
            .filter(|(i, p)| i % step == 0 || *i + 1 == n || (p.t - w.timestamp).abs() <= 1.0)
            .map(|(_, p)| {
                vec![
                    format!("{:+.2} s", p.t - w.timestamp),
                    format_mib_one_decimal(p.cpu_mb),
                    format_mib_one_decimal(p.gpu_mb),
                    p.processes.len().to_string(),
                ]
            })
            .collect();
        table(out, &["vs the event", "host", "GPU", "processes"], &rows);
        if let Some(s) = &w.cuda_summary {
            let _ = writeln!(out, "  torch.cuda.memory_summary():");
            for line in s.lines().take(40) {
                let _ = writeln!(out, "    {}", shown(line));
            }
        }
    }
}

/// What a re-run needs: host RAM and the GPU card that fits (from whole
/// devices' use, every process on them, when `whole_devices`).
fn write_needs(out: &mut String, needs: &Needs, whole_devices: bool) {
    let n = needs;
    let _ = writeln!(out, "\nWhat a re-run needs (peak + 10 %)");
    let _ = writeln!(
        out,
        "  host RAM: {} (peak {})",
        format_mib_one_decimal(n.host_needed_mb),
        format_mib_one_decimal(n.host_peak_mb)
    );
    match n.gpu_class_gib {
        Some(class) => {
            let per: Vec<String> = n
                .gpu_peak_mb
                .iter()
                .map(|(g, v)| format!("GPU {g}: {}", format_mib_one_decimal(*v)))
                .collect();
            let _ = writeln!(
                out,
                "  GPU memory: {} per GPU — a {class:.0} GB card fits ({}){}",
                format_mib_one_decimal(n.gpu_needed_mb),
                per.join(", "),
                if whole_devices {
                    "; device-level: every process on the job's GPUs"
                } else {
                    ""
                }
            );
        }
        None if n.gpu_needed_mb > 0.0 => {
            let _ = writeln!(
                out,
                "  GPU memory: {} per GPU — more than any GPU holds: the file's GPU figures are not real",
                format_mib_one_decimal(n.gpu_needed_mb)
            );
        }
        None => {
            let _ = writeln!(out, "  GPU memory: none used");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_classes() {
        assert_eq!(gpu_class(0.0), None);
        assert_eq!(gpu_class(11_000.0), Some(11.0));
        assert_eq!(gpu_class(12_288.0 * 1.1), Some(16.0));
        assert_eq!(gpu_class(300_000.0), Some(293.0));
        assert_eq!(gpu_class(f64::NAN), None);
        let most = crate::units::mib(crate::model::MAX_DEVICE_BYTES);
        assert_eq!(gpu_class(most), Some(16_384.0));
        assert_eq!(gpu_class(most * 1.01), None);
        assert_eq!(gpu_class(crate::units::mib(u64::MAX)), None);
    }

    #[test]
    fn job_strings_reach_the_terminal_escaped() {
        let mut doc = Document {
            schema: crate::model::SCHEMA_VERSION,
            ..Document::default()
        };
        doc.run.name = "run\u{1b}]0;pwned\u{7}".into();
        doc.run.command = vec!["python".into(), "x\u{1b}[2J\nfake: line".into()];
        doc.run.labels.insert("k".into(), "v\u{9b}31m".into());
        doc.peaks_by_component
            .insert("\u{1b}[31mred".into(), Peaks::default());
        doc.flight_recorder.push(crate::model::FlightWindow {
            name: "py\u{202e}thon".into(),
            cuda_summary: Some("|===|\n\u{1b}[1mbold\r|".into()),
            ..Default::default()
        });
        let text = render(&doc);
        assert!(
            !text
                .chars()
                .any(|c| crate::logging::terminal::is_control(c) && c != '\n'),
            "{text:?}"
        );
        for shown in [
            "run\\u{1b}]0;pwned\\u{7}",
            "x\\u{1b}[2J\\u{a}fake: line",
            "v\\u{9b}31m",
            "\\u{1b}[31mred",
            "py\\u{202e}thon",
            "\\u{1b}[1mbold\\u{d}|",
        ] {
            assert!(text.contains(shown), "{shown} missing from {text}");
        }
        assert!(!text.contains("\nfake: line"), "{text}");
    }

    #[test]
    fn times_no_clock_can_show_print_as_a_question_mark() {
        for ts in [
            f64::NAN,
            -1.0,
            f64::INFINITY,
            253_402_300_800.0,
            1e15,
            f64::MAX,
        ] {
            assert_eq!(clock(ts), "?", "{ts}");
        }
        assert_eq!(clock(253_402_300_799.0), "9999-12-31T23:59:59Z");
        let mut doc = Document {
            schema: crate::model::SCHEMA_VERSION,
            ..Document::default()
        };
        doc.run.start = 1e15;
        doc.run.end = Some(f64::MAX);
        assert!(render(&doc).contains(", ? — "));
    }

    #[test]
    fn a_bare_file_reports_what_it_can() {
        let doc: Document = serde_json::from_str(
            r#"{"detailed_log":[{"component":"model","operation":"before_generate","timestamp":1.0,
               "cpu_ram_used_mb":2048,"gpu_ram_used_mb":8192,"gpu_ram_peak_mb":10240,"reserved_gpu_ram_mb":12288}],
               "peak_usage":{"cpu_ram_used_mb":2048,"gpu_ram_used_mb":8192,"gpu_ram_peak_mb":10240,"reserved_gpu_ram_mb":12288}}"#,
        )
        .unwrap();
        let text = render(&doc);
        assert!(text.contains("bare file"), "{text}");
        // A 12 GB peak needs, with headroom, a 16 GB card.
        assert!(text.contains("a 16 GB card fits"), "{text}");
        assert_eq!(needs(&doc).host_needed_mb, 2253.0);
    }

    #[test]
    fn an_estimated_own_cost_is_marked_in_the_process_table() {
        let mut doc = Document {
            schema: crate::model::SCHEMA_VERSION,
            ..Document::default()
        };
        for (pid, estimated) in [(10, false), (11, true)] {
            doc.targets.push(crate::model::Target {
                pid,
                name: "python3".into(),
                peak_rss_mb: 250.0,
                peak_uss_mb: Some(48.8),
                peak_uss_estimated: estimated,
                ..Default::default()
            });
        }
        let text = render(&doc);
        let row = |pid: &str| {
            text.lines()
                .find(|l| l.trim_start().starts_with(pid))
                .unwrap_or_else(|| panic!("no row {pid} in {text}"))
                .to_string()
        };
        assert!(row("11").contains("~48.8"), "{text}");
        assert!(!row("10").contains('~'), "{text}");
        assert!(
            text.contains("~ estimated: no own-cost read came"),
            "{text}"
        );
        doc.targets[1].peak_uss_estimated = false;
        assert!(!render(&doc).contains("~ estimated"));
    }
}
