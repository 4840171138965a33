//! `memtrack compare FILE…`: a configuration comparison table — model,
//! precision, CPU RAM, GPU RAM, GPU peak, comment — as a terminal table,
//! Markdown or CSV.
//!
//! The model and precision come from run labels (`model`, `precision` /
//! `dtype` / `quantization`, `comment` / `note`), so
//! `memtrack run --label model=SmolLM-1.7B --label precision=INT8 …` fills
//! the table; without them the run name stands in.

use crate::model::Document;
use crate::units::format_gb_rounded;

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Markdown,
    Csv,
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
pub fn row(doc: &Document, name: &str) -> [String; 6] {
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
        format_gb_rounded(p.cpu_ram_used_mb.max(p.cpu_ram_hwm_mb)),
        format_gb_rounded(p.gpu_ram_used_mb),
        format_gb_rounded(p.gpu_ram_peak_mb.max(p.gpu_ram_used_mb)),
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

/// The table for `(name, document)` pairs.
pub fn render(runs: &[(String, Document)], format: Format) -> String {
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
        Format::Table => {
            let mut widths: Vec<usize> = HEADER.iter().map(|h| h.chars().count()).collect();
            for r in &rows {
                for (i, c) in r.iter().enumerate() {
                    widths[i] = widths[i].max(c.chars().count());
                }
            }
            let line = |cells: Vec<&str>| -> String {
                cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
                    .collect::<Vec<_>>()
                    .join("  ")
                    .trim_end()
                    .to_string()
            };
            out.push_str(&line(HEADER.to_vec()));
            out.push('\n');
            for r in &rows {
                out.push_str(&line(r.iter().map(String::as_str).collect()));
                out.push('\n');
            }
        }
    }
    out
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
        d.peak_usage.cpu_ram_used_mb = cpu;
        d.peak_usage.gpu_ram_used_mb = gpu;
        d.peak_usage.gpu_ram_peak_mb = peak;
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
        let table = render(&runs, Format::Table);
        assert_eq!(table.lines().count(), 4);
    }

    #[test]
    fn csv_quotes_what_needs_it() {
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"x\""), "\"say \"\"x\"\"\"");
    }
}
