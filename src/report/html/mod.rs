//! `memtrack report --html`: one page per run that opens anywhere, offline,
//! and that people explore rather than read — the advice first, then the
//! host and GPU timelines (zoom with the wheel or a drag, pan with
//! shift-drag, hover for the time, the values, the mark, the span and the
//! iteration at that moment) over lanes of stages and of each component's
//! spans, each process's own cost or RSS, the peaks by component and stage,
//! the leak verdicts, what a re-run needs, and how the figures were
//! measured. `compare --html` overlays runs on one page, aligned by time,
//! iteration or stage.
//!
//! The page is one file: the template, its style and its script
//! (`page.html`, `page.css`, `page.js`, compiled in) with the run's data
//! as JSON in a `<script type="application/json">` element, every `<`,
//! `>` and `&` in it written as a `\u` escape so that no string of the
//! job's (a run name, a mark) can close the element. The script puts
//! every string on the page as text, never as markup.
//!
//! A run of any length makes a page of bounded size: each series is
//! reduced to at most `columns::MAX_COLUMNS` columns, keeping each
//! column's lowest and highest point, so the page's peaks are the
//! document's exactly (`data`).

mod columns;
mod data;

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use self::data::{Gather, RunPage};
use crate::model::Document;
use crate::store::Store;

/// The page's name beside `memory_usage.json` at the end of a run.
pub const FILE_NAME: &str = "memory_report.html";

const TEMPLATE: &str = include_str!("page.html");
const STYLE: &str = include_str!("page.css");
const SCRIPT: &str = include_str!("page.js");

/// Everything the page's script reads.
#[derive(Debug, Serialize)]
struct Page<'a> {
    /// `run` (one run) or `compare` (runs overlaid).
    kind: &'static str,
    memtrack_version: &'a str,
    runs: Vec<RunPage>,
}

/// Reads the document at `path` (and its complete event log) for the page.
fn read_run(path: &Path, label: Option<&str>) -> anyhow::Result<RunPage> {
    let mut gather = Gather::default();
    let mut entries = 0u64;
    let doc = crate::report::read::for_report_with(path, |e| {
        entries += 1;
        gather.observe(e);
    })?;
    let label = match label {
        Some(l) => l.to_string(),
        None => run_label(&doc, path),
    };
    Ok(RunPage::build(&label, &doc, gather, entries))
}

fn run_label(doc: &Document, path: &Path) -> String {
    if !doc.run.name.is_empty() {
        return doc.run.name.clone();
    }
    path.parent().and_then(|p| p.file_name()).map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// The page of the run whose document is at `path`.
pub fn run_page(path: &Path) -> anyhow::Result<String> {
    let run = read_run(path, None)?;
    let title = format!("memtrack · {}", run.label);
    render("run", &title, vec![run])
}

/// The page of a run as memtrack holds it at its end (the document it
/// has just written), its log read back from the store rather than from
/// the file: no second parse of a long JSON document adds to memtrack's
/// own footprint.
pub(crate) fn store_page(store: &Store) -> anyhow::Result<String> {
    let view = store.document_view();
    let mut gather = Gather::default();
    let mut entries = 0u64;
    view.detailed_log
        .try_for_each(|e| {
            entries += 1;
            gather.observe(e);
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("cannot read the run's log back: {e}"))?;
    let doc = view.map_log(|_| Vec::new());
    let label = if doc.run.name.is_empty() {
        doc.run.id.clone()
    } else {
        doc.run.name.clone()
    };
    let run = RunPage::build(&label, &doc, gather, entries);
    let title = format!("memtrack · {}", run.label);
    render("run", &title, vec![run])
}

/// The page overlaying the runs at `paths`, each named as given
/// (the first is the reference).
pub fn compare_page(paths: &[(String, PathBuf)]) -> anyhow::Result<String> {
    let mut runs = Vec::new();
    for (name, path) in paths {
        runs.push(read_run(path, Some(name)).with_context(|| path.display().to_string())?);
    }
    let names: Vec<&str> = runs.iter().map(|r| r.label.as_str()).collect();
    let title = format!("memtrack · compare {}", names.join(" · "));
    render("compare", &title, runs)
}

fn render(kind: &'static str, title: &str, runs: Vec<RunPage>) -> anyhow::Result<String> {
    let page = Page {
        kind,
        memtrack_version: env!("CARGO_PKG_VERSION"),
        runs,
    };
    let json = serde_json::to_string(&page).context("cannot write the page's data")?;
    // Replaced in one pass, so text in one part never becomes a slot.
    let mut out = String::with_capacity(TEMPLATE.len() + STYLE.len() + SCRIPT.len() + json.len());
    let mut rest = TEMPLATE;
    while let Some(at) = rest.find("{{") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[at..]);
            rest = "";
            break;
        };
        match &after[..end] {
            "title" => out.push_str(&escape_html(&data::clip(title))),
            "style" => out.push_str(STYLE),
            "script" => out.push_str(SCRIPT),
            "data" => out.push_str(&escape_json_for_script(&json)),
            other => anyhow::bail!("the page template has an unknown slot {other:?}"),
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// JSON made safe inside a `<script>` element: `<`, `>` and `&` as `\u`
/// escapes (still the same JSON), and the two line separators JavaScript
/// once refused.
pub(crate) fn escape_json_for_script(json: &str) -> String {
    let mut out = String::with_capacity(json.len() + json.len() / 64);
    for c in json.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// Text made safe in HTML.
pub(crate) fn escape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// Writes `html` to `out` atomically.
pub fn write(out: &Path, html: &str) -> anyhow::Result<()> {
    crate::model::json::write_atomic(out, html.as_bytes())
        .with_context(|| format!("cannot write {}", out.display()))
}

/// The default place of a run's page: beside its document.
pub fn beside(document: &Path) -> PathBuf {
    document.parent().unwrap_or(Path::new(".")).join(FILE_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_cannot_close_its_script_element() {
        let json = serde_json::to_string(&serde_json::json!({
            "name": "</script><script>alert(1)</script><!-- & \u{2028}"
        }))
        .unwrap();
        let safe = escape_json_for_script(&json);
        assert!(!safe.contains('<') && !safe.contains('>') && !safe.contains('&'));
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(
            back["name"],
            "</script><script>alert(1)</script><!-- & \u{2028}"
        );
        assert_eq!(
            escape_html("<b>\"x\" & 'y'</b>"),
            "&lt;b&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/b&gt;"
        );
    }

    #[test]
    fn the_template_fills_every_slot_once() {
        let html = render("run", "t <x>", Vec::new()).unwrap();
        assert!(!html.contains("{{"), "a slot left unfilled");
        assert_eq!(html.matches("id=\"memtrack-data\"").count(), 1);
        assert!(html.contains("<title>t &lt;x&gt;</title>"));
        // Offline: nothing is fetched.
        for remote in [
            "src=",
            "href=",
            "url(http",
            "url(//",
            "fetch(",
            "XMLHttpRequest",
            "import(",
            "@import",
        ] {
            assert!(!html.contains(remote), "{remote}");
        }
    }
}
