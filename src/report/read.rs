//! Reading `memory_usage.json` files of any length in bounded memory.
//!
//! A long run's file holds millions of `detailed_log` entries (hundreds of
//! MiB). Reading it whole (`fs::read` and `from_slice` into a
//! [`Document`]) costs several times its size in memory. Here the file is
//! parsed from a buffered reader: every part but the log is read as usual
//! (all of them are bounded by memtrack's own limits), and each log entry
//! is handed to the caller as soon as it is parsed, then dropped. The
//! readers fold what they need: the leak rule's bounded series (`report`),
//! nothing (`compare`), a thinned copy of the log (`plot`).
//!
//! A file whose event entries were thinned (`log.max_event_entries`) has
//! its complete event log beside it (`COMPLETE_LOG`, gzip'd JSON lines);
//! `read_complete` reads the log from there.

use std::io::BufReader;
use std::path::Path;

use anyhow::Context;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::model::advice::Facts;
use crate::model::leak;
use crate::model::thin::Thinned;
use crate::model::{Document, Entry, EntryKind};
use crate::store::entries::COMPLETE_LOG;

/// Reads the document at `path`, handing each `detailed_log` entry to
/// `each` in file order; the document comes back with an empty log.
pub(crate) fn read_folded(path: &Path, each: impl FnMut(Entry)) -> anyhow::Result<Document> {
    // A regular file (a FIFO would hang, `/dev/zero` never end), read up
    // to the size memtrack's readers accept.
    let file = crate::files::open_input(path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let reader = BufReader::with_capacity(
        256 * 1024,
        crate::files::Budgeted::new(file, crate::model::json::MAX_DOCUMENT_BYTES),
    );
    read_folded_from(reader, each)
        .with_context(|| format!("{} is not a memory_usage.json document", path.display()))
}

/// [`read_folded`] over any reader.
pub(crate) fn read_folded_from(
    reader: impl std::io::Read,
    mut each: impl FnMut(Entry),
) -> anyhow::Result<Document> {
    let mut de = serde_json::Deserializer::from_reader(reader);
    let rest = Whole { each: &mut each }.deserialize(&mut de)?;
    de.end()?;
    Ok(serde_json::from_value(Value::Object(rest))?)
}

/// Reads the document at `path` like [`read_folded`], handing out its
/// complete log: when its event entries were thinned (an event entry
/// stands for several, `samples`) and the complete event log lies beside
/// it, the event entries come from there, the document's timer entries
/// merged in by time as memtrack merges them.
pub(crate) fn read_complete(path: &Path, mut each: impl FnMut(Entry)) -> anyhow::Result<Document> {
    let side = path.parent().unwrap_or(Path::new(".")).join(COMPLETE_LOG);
    if !side.is_file() {
        return read_folded(path, each);
    }
    let mut timers = Vec::new();
    let mut thinned = false;
    let doc = read_folded(path, |e| {
        if e.kind == EntryKind::Timer {
            timers.push(e);
        } else if e.samples.is_some() {
            thinned = true;
        }
    })?;
    if !thinned {
        // Not this document's complete log (or it was not thinned).
        return read_folded(path, each);
    }
    let file = crate::files::open_input(&side)
        .with_context(|| format!("cannot read {}", side.display()))?;
    let budget = side_budget(file.metadata().map_or(0, |m| m.len()));
    // Decompressed through a budget and read a bounded line at a time: a
    // small gzip of one endless line (a bomb) is an error, not an abort.
    let mut lines = BufReader::with_capacity(
        256 * 1024,
        crate::files::Budgeted::new(
            flate2::bufread::MultiGzDecoder::new(BufReader::new(file)),
            budget,
        ),
    );
    let mut timers = timers.into_iter().peekable();
    let mut line = Vec::new();
    let mut number = 0u64;
    loop {
        number += 1;
        let more = crate::files::read_line_capped(&mut lines, &mut line, MAX_SIDE_LINE)
            .with_context(|| format!("cannot read line {number} of {}", side.display()))?;
        if !more {
            break;
        }
        if line.is_empty() {
            continue;
        }
        let e: Entry = serde_json::from_slice(&line)
            .with_context(|| format!("line {number} of {} is not a log entry", side.display()))?;
        while let Some(t) = timers.next_if(|t| t.timestamp <= e.timestamp) {
            each(t);
        }
        each(e);
    }
    timers.for_each(each);
    Ok(doc)
}

/// Longest line of the complete event log: one entry (a mark is at most a
/// 64 KiB socket line, and memtrack's own fields add little).
pub(crate) const MAX_SIDE_LINE: usize = 1 << 20;

/// How many bytes the complete event log may decompress to: 200 times its
/// compressed size (memtrack's log compresses about 10 to 30 times), at
/// least 1 GiB. A gzip bomb (1,000 times) stops at the budget.
pub(crate) fn side_budget(compressed: u64) -> u64 {
    compressed.saturating_mul(200).max(1 << 30)
}

/// The document for `memtrack report` and `memtrack advise`: its log is
/// not kept, a leak verdict is computed from it (bounded series) when the
/// file has none, and the advice is worked out again from the complete
/// log (the rules of this build, on any file).
pub fn for_report(path: &Path) -> anyhow::Result<Document> {
    for_report_with(path, |_| {})
}

/// [`for_report`], handing each entry of the complete log to `each` on
/// the way (the HTML page's reader).
pub(crate) fn for_report_with(
    path: &Path,
    mut each: impl FnMut(&Entry),
) -> anyhow::Result<Document> {
    let mut series = leak::LeakSeries::default();
    let mut facts = Facts::default();
    let complete = path
        .parent()
        .is_some_and(|d| d.join(COMPLETE_LOG).is_file());
    let mut doc = read_folded(path, |e| {
        series.push(&e);
        if !complete {
            facts.observe(&e);
            each(&e);
        }
    })?;
    if complete {
        series = leak::LeakSeries::default();
        read_complete(path, |e| {
            series.push(&e);
            facts.observe(&e);
            each(&e);
        })?;
    }
    if doc.leak.is_none() {
        doc.leak = Some(
            series
                .analyze(&doc.targets, doc.schema, &leak::LeakConfig::default())
                .to_value(),
        );
    }
    doc.advice = facts.conclude(&doc);
    Ok(doc)
}

/// The document without its log (`compare`, and readers of its run
/// information only).
pub fn without_log(path: &Path) -> anyhow::Result<Document> {
    read_folded(path, |_| {})
}

/// Log entries a plot keeps exactly; a longer log is thinned to at most
/// this many (maxima kept, as memtrack thins its timer log), which a
/// timeline a few thousand pixels wide cannot tell apart.
pub(crate) const PLOT_ENTRIES: usize = 16_384;

/// The document for `memtrack plot`: its log thinned to `PLOT_ENTRIES`
/// when longer.
pub fn for_plot(path: &Path) -> anyhow::Result<Document> {
    let mut log: Thinned<Entry> = Thinned::new(PLOT_ENTRIES);
    let mut doc = read_complete(path, |e| log.push(e))?;
    doc.detailed_log = log.iter().cloned().collect();
    Ok(doc)
}

/// The whole document: every key but `detailed_log` collected as JSON,
/// the log's entries handed out one by one.
struct Whole<'a, F> {
    each: &'a mut F,
}

impl<'de, F: FnMut(Entry)> DeserializeSeed<'de> for Whole<'_, F> {
    type Value = Map<String, Value>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, F: FnMut(Entry)> Visitor<'de> for Whole<'_, F> {
    type Value = Map<String, Value>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a memory_usage.json object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut rest = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "detailed_log" {
                map.next_value_seed(Log {
                    each: &mut *self.each,
                })?;
            } else {
                let value: Value = map.next_value()?;
                rest.insert(key, value);
            }
        }
        Ok(rest)
    }
}

/// `detailed_log`: a sequence of entries (or `null`).
struct Log<'a, F> {
    each: &'a mut F,
}

impl<'de, F: FnMut(Entry)> DeserializeSeed<'de> for Log<'_, F> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, F: FnMut(Entry)> Visitor<'de> for Log<'_, F> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a sequence of log entries")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(e) = seq.next_element::<Entry>()? {
            (self.each)(e);
        }
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // Not a log: refused like the whole-document reader refuses it.
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Err(serde::de::Error::custom(
            "detailed_log must be a sequence of entries",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;

    fn doc_with(n: usize) -> Document {
        let mut doc = Document {
            schema: 1,
            ..Document::default()
        };
        doc.run.name = "r".into();
        for i in 0..n {
            doc.detailed_log.push(Entry {
                component: format!("c{}", i % 3),
                operation: "step".into(),
                timestamp: 1_700_000_000.0 + i as f64,
                figures: Figures {
                    cpu_ram_used_mb: 100.0 + (i % 7) as f64,
                    ..Figures::default()
                },
                ..Entry::default()
            });
        }
        doc.peak_usage.figures.cpu_ram_used_mb = 106.0;
        doc
    }

    #[test]
    fn folding_reads_every_entry_and_the_rest_of_the_document() {
        let doc = doc_with(100);
        let text = serde_json::to_vec_pretty(&doc).unwrap();
        let mut seen = Vec::new();
        let back = read_folded_from(&text[..], |e| seen.push(e)).unwrap();
        assert_eq!(seen, doc.detailed_log);
        assert!(back.detailed_log.is_empty());
        assert_eq!(
            Document {
                detailed_log: doc.detailed_log.clone(),
                ..back
            },
            doc
        );
    }

    #[test]
    fn the_report_reader_computes_the_same_leak_verdict_as_the_whole_reader() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.json");
        let doc = doc_with(500);
        std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
        let got = for_report(&path).unwrap();
        assert_eq!(
            got.leak.unwrap(),
            leak::analyze(&doc, &leak::LeakConfig::default()).to_value()
        );
    }

    #[test]
    fn a_long_log_is_thinned_for_the_plot_keeping_its_maximum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.json");
        let mut doc = doc_with(PLOT_ENTRIES * 3);
        doc.detailed_log[12_345].figures.cpu_ram_used_mb = 9000.0;
        std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
        let got = for_plot(&path).unwrap();
        assert!(got.detailed_log.len() <= PLOT_ENTRIES + 1);
        let max = got
            .detailed_log
            .iter()
            .map(|e| e.figures.cpu_ram_used_mb)
            .fold(0.0, f64::max);
        assert_eq!(max, 9000.0);
        // A short log is untouched.
        let short = doc_with(50);
        std::fs::write(&path, serde_json::to_vec(&short).unwrap()).unwrap();
        assert_eq!(for_plot(&path).unwrap(), short);
    }

    #[test]
    fn malformed_and_hostile_files_are_clear_errors() {
        for bad in [
            &b"[1, 2"[..],
            b"{\"detailed_log\": {\"a\": 1}}",
            b"{\"detailed_log\": [1]}",
            b"{\"detailed_log\": [] } trailing",
            b"",
            b"{\"detailed_log\": [{\"component\": \"a\"",
        ] {
            assert!(
                read_folded_from(bad, |_| {}).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // Deep nesting outside the log is refused by the parser's limit.
        let deep = format!("{{\"run\": {}{}}}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(read_folded_from(deep.as_bytes(), |_| {}).is_err());
        // A bare file without a log reads.
        let seed = br#"{"peak_usage": {"cpu_ram_used_mb": 1.0}}"#;
        assert_eq!(
            read_folded_from(&seed[..], |_| {})
                .unwrap()
                .peak_usage
                .figures
                .cpu_ram_used_mb,
            1.0
        );
    }
}
