//! `memtrack compare FILE…`: runs side by side.
//!
//! The default table gives each run by name (always: two runs of one model
//! are two names), its duration and exit, its host and GPU peaks with the
//! difference against the first run, then the peak of every stage and of
//! every component the runs have, run by run, with the same differences.
//! `--json` gives the same figures to programs; `--plot` draws the runs'
//! memory over each other ([`super::plot::overlay`]).
//!
//! `--format markdown` and `--format csv` print the configuration table of
//! the Python trackers memtrack replaces — model, precision, CPU RAM, GPU
//! RAM, GPU peak, comment — for the readers that parse it. The model and
//! precision come from run labels (`model`, `precision` / `dtype` /
//! `quantization`, `comment` / `note`), so
//! `memtrack run --label model=SmolLM-1.7B --label precision=INT8 …` fills
//! the table; without them the run name stands in.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::{Document, Peaks};
use crate::units::{duration_two_units, format_gb_rounded, group_thousands};

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Runs, stages and components side by side, with differences
    Table,
    /// The configuration table (model, precision, CPU RAM, GPU RAM, GPU peak, comment) in Markdown
    Markdown,
    /// The configuration table as CSV
    Csv,
    /// Everything the table shows, as JSON
    Json,
}

const HEADER: [&str; 6] = [
    "Model",
    "Precision",
    "CPU RAM",
    "GPU RAM",
    "GPU Peak",
    "Comment",
];

fn label<'a>(doc: &'a Document, keys: &[&str]) -> Option<&'a str> {
    keys.iter()
        .find_map(|k| doc.run.labels.get(*k).map(String::as_str))
}

/// One table row for a run (`name` stands in when the run has no name).
pub(crate) fn row(doc: &Document, name: &str) -> [String; 6] {
    let p = &doc.peak_usage;
    [
        label(doc, &["model"])
            .unwrap_or(if doc.run.name.is_empty() {
                name
            } else {
                &doc.run.name
            })
            .to_string(),
        label(doc, &["precision", "dtype", "quantization"])
            .unwrap_or("-")
            .to_string(),
        format_gb_rounded(p.figures.cpu_ram_used_mb.max(p.figures.cpu_ram_hwm_mb)),
        format_gb_rounded(p.figures.gpu_ram_used_mb),
        format_gb_rounded(p.figures.gpu_ram_peak_mb.max(p.figures.gpu_ram_used_mb)),
        label(doc, &["comment", "note"]).unwrap_or("").to_string(),
    ]
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The output for `(name, document)` pairs in `format`; `name` (the run
/// directory's) stands in for a run without a name.
pub fn render(runs: &[(String, Document)], format: Format) -> String {
    match format {
        Format::Table => render_text(&build(runs)),
        Format::Json => {
            let mut text = serde_json::to_string_pretty(&build(runs)).unwrap_or_default();
            text.push('\n');
            text
        }
        Format::Markdown | Format::Csv => render_configurations(runs, format),
    }
}

/// The configuration table of the Python trackers.
fn render_configurations(runs: &[(String, Document)], format: Format) -> String {
    let rows: Vec<[String; 6]> = runs.iter().map(|(name, doc)| row(doc, name)).collect();
    let mut out = String::new();
    match format {
        Format::Csv => {
            out.push_str(&HEADER.join(","));
            out.push('\n');
            for r in &rows {
                out.push_str(&r.iter().map(|c| csv_field(c)).collect::<Vec<_>>().join(","));
                out.push('\n');
            }
        }
        Format::Markdown => {
            out.push_str(&format!("| {} |\n", HEADER.join(" | ")));
            out.push_str(&format!("|{}\n", "--------|".repeat(HEADER.len())));
            for r in &rows {
                let cells: Vec<String> = r.iter().map(|c| c.replace('|', "\\|")).collect();
                out.push_str(&format!("| {} |\n", cells.join(" | ")));
            }
        }
        Format::Table | Format::Json => {
            let header: Vec<String> = HEADER.iter().map(|h| h.to_string()).collect();
            let rows: Vec<Vec<String>> = rows.iter().map(|r| r.to_vec()).collect();
            out.push_str(&aligned(&header, &rows, 0));
        }
    }
    out
}

/// Rows under a header in columns two spaces apart, the first column
/// left-aligned and the others right-aligned from `numbers_from` on.
fn aligned(header: &[String], rows: &[Vec<String>], numbers_from: usize) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let mut text = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let w = widths[i];
                if numbers_from > 0 && i >= numbers_from {
                    format!("{c:>w$}")
                } else {
                    format!("{c:<w$}")
                }
            })
            .collect::<Vec<_>>()
            .join("  ");
        text.truncate(text.trim_end().len());
        text.push('\n');
        text
    };
    let mut out = line(header);
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// A run's peaks as compared: host memory (the larger of the sampled
/// figure and the kernel's high-water marks) and GPU memory (the largest
/// GPU figure: NVML's, or PyTorch's reserved or peak).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct Peak {
    pub(crate) host_mib: f64,
    pub(crate) gpu_mib: f64,
}

impl Peak {
    fn of(p: &Peaks) -> Peak {
        Peak {
            host_mib: p.figures.cpu_ram_used_mb.max(p.figures.cpu_ram_hwm_mb),
            gpu_mib: p
                .figures
                .gpu_process_used_mb
                .max(p.figures.reserved_gpu_ram_mb)
                .max(p.figures.gpu_ram_peak_mb)
                .max(p.figures.gpu_ram_used_mb),
        }
    }

    fn minus(self, base: Peak) -> Peak {
        Peak {
            host_mib: self.host_mib - base.host_mib,
            gpu_mib: self.gpu_mib - base.gpu_mib,
        }
    }
}

/// One run in the comparison.
#[derive(Debug, Clone, Serialize)]
pub struct RunColumn {
    /// The run's name (its directory's when two runs share one).
    pub name: String,
    pub(crate) model: Option<String>,
    pub(crate) duration_s: Option<f64>,
    /// `0`, `1`, `SIGKILL`, … (`-` while unknown).
    pub(crate) exit: String,
    pub(crate) status: String,
    pub(crate) peak: Peak,
    /// `peak` minus the first run's.
    pub(crate) diff: Peak,
}

/// A stage or component across the runs: its peak in each run (`None`
/// where the run has none), and the differences against the first run
/// that has it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Part {
    pub(crate) name: String,
    pub(crate) peaks: Vec<Option<Peak>>,
    pub(crate) diffs: Vec<Option<Peak>>,
}

/// Runs, stages and components side by side.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub runs: Vec<RunColumn>,
    pub(crate) stages: Vec<Part>,
    pub(crate) components: Vec<Part>,
    /// Whether any run has GPU figures (else GPU columns are left out of
    /// the table).
    pub(crate) gpu: bool,
}

/// Names the runs: the run's own name, else its directory's; where two
/// runs share a name, their directories'; where those clash too, `#2`,
/// `#3`… after them.
fn run_names(runs: &[(String, Document)]) -> Vec<String> {
    let own: Vec<String> = runs
        .iter()
        .map(|(dir, d)| {
            if d.run.name.is_empty() {
                dir.clone()
            } else {
                d.run.name.clone()
            }
        })
        .collect();
    let mut names: Vec<String> = own
        .iter()
        .zip(runs)
        .map(|(n, (dir, _))| {
            if own.iter().filter(|o| *o == n).count() > 1 {
                dir.clone()
            } else {
                n.clone()
            }
        })
        .collect();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for n in &mut names {
        let count = seen.entry(n.clone()).or_insert(0);
        *count += 1;
        if *count > 1 {
            *n = format!("{n} #{count}");
        }
    }
    names
}

/// The parts (stages or components) of every run, in the order they first
/// appear, with their peaks per run.
fn parts(docs: &[&Document], each: impl Fn(&Document) -> Vec<(String, Peak)>) -> Vec<Part> {
    let per_run: Vec<Vec<(String, Peak)>> = docs.iter().map(|d| each(d)).collect();
    let mut order: Vec<String> = Vec::new();
    for run in &per_run {
        for (name, _) in run {
            if !order.contains(name) {
                order.push(name.clone());
            }
        }
    }
    order
        .into_iter()
        .map(|name| {
            let peaks: Vec<Option<Peak>> = per_run
                .iter()
                .map(|run| {
                    run.iter()
                        .filter(|(n, _)| *n == name)
                        .map(|(_, p)| *p)
                        .reduce(|a, b| Peak {
                            host_mib: a.host_mib.max(b.host_mib),
                            gpu_mib: a.gpu_mib.max(b.gpu_mib),
                        })
                })
                .collect();
            let base = peaks.iter().flatten().next().copied();
            let diffs = peaks
                .iter()
                .map(|p| Some(p.as_ref()?.minus(base?)))
                .collect();
            Part { name, peaks, diffs }
        })
        .collect()
}

/// The exit as the report writes it.
fn exit_text(d: &Document) -> String {
    match &d.run.exit {
        Some(e) if e.signal.is_some() => crate::sys::signal_name(e.signal.unwrap_or(0)),
        Some(e) if e.known => e.code.to_string(),
        Some(_) => "unknown".into(),
        None => "-".into(),
    }
}

/// The comparison of `(directory name, document)` pairs.
pub fn build(runs: &[(String, Document)]) -> Comparison {
    let names = run_names(runs);
    let docs: Vec<&Document> = runs.iter().map(|(_, d)| d).collect();
    let first = docs
        .first()
        .map(|d| Peak::of(&d.peak_usage))
        .unwrap_or_default();
    let columns = docs
        .iter()
        .zip(names)
        .map(|(d, name)| {
            let peak = Peak::of(&d.peak_usage);
            RunColumn {
                name,
                model: label(d, &["model"]).map(str::to_string),
                duration_s: d.run.end.map(|e| e - d.run.start).filter(|s| *s >= 0.0),
                exit: exit_text(d),
                status: d.run.status.to_string(),
                peak,
                diff: peak.minus(first),
            }
        })
        .collect::<Vec<_>>();
    let stages = parts(&docs, |d| {
        d.stages
            .iter()
            .map(|s| (s.name.clone(), Peak::of(&s.peak)))
            .collect()
    });
    // memtrack's own `system` entries are the time outside the job's
    // spans: named for what they are, after the job's components.
    let components = parts(&docs, |d| {
        let system = crate::store::SYSTEM;
        let mut named: Vec<(String, Peak)> = d
            .peaks_by_component
            .iter()
            .filter(|(c, _)| *c != system)
            .map(|(c, p)| (c.clone(), Peak::of(p)))
            .collect();
        if let Some(p) = d.peaks_by_component.get(system) {
            named.push(("outside spans".to_string(), Peak::of(p)));
        }
        named
    });
    let gpu = columns.iter().any(|r| r.peak.gpu_mib > 0.0);
    Comparison {
        runs: columns,
        stages,
        components,
        gpu,
    }
}

/// MiB for a table cell: `3.2 MiB` (one decimal below 1 GiB), `1.25 GiB`
/// (two decimals) above.
pub(crate) fn size(mib: f64) -> String {
    if mib.abs() >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// A difference: `+3.2 MiB (+12 %)`, `-1.10 GiB (-50 %)`, `±0` when equal.
fn difference(diff: f64, base: f64) -> String {
    if diff.abs() < 0.05 {
        return "±0".into();
    }
    let sign = if diff > 0.0 { "+" } else { "-" };
    let pct = if base > 0.0 {
        format!(
            " ({sign}{} %)",
            group_thousands((diff.abs() / base * 100.0).round())
        )
    } else {
        String::new()
    };
    format!("{sign}{}{pct}", size(diff.abs()))
}

/// A peak with its difference against the first run's (`first`: this is
/// the first run, no difference shown).
fn with_difference(value: f64, diff: f64, first: bool) -> String {
    if first {
        size(value)
    } else {
        format!("{} {}", size(value), difference(diff, value - diff))
    }
}

/// The default table.
fn render_text(c: &Comparison) -> String {
    let mut out = String::new();
    let Some(first) = c.runs.first() else {
        return out;
    };
    out.push_str(&format!(
        "Runs (differences against the first, {})\n",
        shown(&first.name)
    ));
    let mut header: Vec<String> = ["run", "model", "duration", "exit", "host peak"]
        .map(String::from)
        .to_vec();
    if c.gpu {
        header.push("GPU peak".into());
    }
    let rows: Vec<Vec<String>> = c
        .runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut row = vec![
                shown(&r.name),
                shown(r.model.as_deref().unwrap_or("-")),
                r.duration_s.map_or("-".into(), duration_two_units),
                shown(&r.exit),
                with_difference(r.peak.host_mib, r.diff.host_mib, i == 0),
            ];
            if c.gpu {
                row.push(with_difference(r.peak.gpu_mib, r.diff.gpu_mib, i == 0));
            }
            row
        })
        .collect();
    out.push_str(&indent(&aligned(&header, &rows, 2)));
    for (title, parts) in [("stage", &c.stages), ("component", &c.components)] {
        if parts.is_empty() {
            continue;
        }
        let host: fn(&Peak) -> f64 = |p| p.host_mib;
        let gpu: fn(&Peak) -> f64 = |p| p.gpu_mib;
        let mut figures = vec![("Host peak", host)];
        if c.gpu {
            figures.push(("GPU peak", gpu));
        }
        for (what, figure) in &figures {
            out.push_str(&format!("\n{what} by {title}\n"));
            out.push_str(&indent(&part_table(c, parts, title, *figure)));
        }
    }
    out
}

/// One figure of each part, run by run, with differences against the
/// first run that has the part.
fn part_table(c: &Comparison, parts: &[Part], title: &str, figure: fn(&Peak) -> f64) -> String {
    let mut header = vec![title.to_string()];
    header.extend(c.runs.iter().map(|r| shown(&r.name)));
    let rows: Vec<Vec<String>> =
        parts
            .iter()
            .map(|p| {
                let base = p.peaks.iter().position(Option::is_some);
                let mut row = vec![shown(&p.name)];
                row.extend(p.peaks.iter().zip(&p.diffs).enumerate().map(|(i, (v, d))| {
                    match (v, d) {
                        (Some(v), Some(d)) => {
                            with_difference(figure(v), figure(d), Some(i) == base)
                        }
                        _ => "-".into(),
                    }
                }));
                row
            })
            .collect();
    aligned(&header, &rows, 1)
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// A string the job chose, safe for the terminal.
fn shown(s: &str) -> String {
    super::text::escape_controls(s, false).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(
        model: &str,
        precision: &str,
        cpu: f64,
        gpu: f64,
        peak: f64,
        comment: &str,
    ) -> (String, Document) {
        let mut d = Document::default();
        d.run.labels.insert("model".into(), model.into());
        d.run.labels.insert("precision".into(), precision.into());
        d.run.labels.insert("comment".into(), comment.into());
        d.peak_usage.figures.cpu_ram_used_mb = cpu;
        d.peak_usage.figures.gpu_ram_used_mb = gpu;
        d.peak_usage.figures.gpu_ram_peak_mb = peak;
        (model.into(), d)
    }

    #[test]
    fn renders_the_comparison_table() {
        let runs = vec![
            doc(
                "SmolLM-135M",
                "FP32",
                1024.0,
                2048.0,
                2560.0,
                "Легкая модель",
            ),
            doc(
                "SmolLM-1.7B",
                "FP32",
                2048.0,
                8192.0,
                10240.0,
                "Средняя модель",
            ),
            doc(
                "SmolLM-1.7B",
                "INT8",
                2048.0,
                4096.0,
                5120.0,
                "С квантизацией",
            ),
        ];
        let md = render(&runs, Format::Markdown);
        assert_eq!(
            md,
            "| Model | Precision | CPU RAM | GPU RAM | GPU Peak | Comment |\n\
             |--------|--------|--------|--------|--------|--------|\n\
             | SmolLM-135M | FP32 | 1 GB | 2 GB | 2.5 GB | Легкая модель |\n\
             | SmolLM-1.7B | FP32 | 2 GB | 8 GB | 10 GB | Средняя модель |\n\
             | SmolLM-1.7B | INT8 | 2 GB | 4 GB | 5 GB | С квантизацией |\n"
        );
        let csv = render(&runs, Format::Csv);
        assert!(csv.starts_with(
            "Model,Precision,CPU RAM,GPU RAM,GPU Peak,Comment\nSmolLM-135M,FP32,1 GB,2 GB,2.5 GB,"
        ));
        // The default table names every run, the second of one name by
        // its number.
        let table = render(&runs, Format::Table);
        assert!(
            table.starts_with("Runs (differences against the first, SmolLM-135M)\n"),
            "{table}"
        );
        assert!(table.contains("SmolLM-1.7B #2"), "{table}");
        assert!(table.contains("+1.00 GiB (+100 %)"), "{table}");
    }

    #[test]
    fn csv_quotes_what_needs_it() {
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"x\""), "\"say \"\"x\"\"\"");
    }
}
