//! `mlflow-spool.jsonl`: what a run could not deliver to MLflow, kept in
//! its run directory for `memtrack mlflow-resend`.
//!
//! The first line is a [`Header`] (which run, whether memtrack created
//! it, whether the artifacts and the run's end are still owed); each
//! further line is one metric value as `runs/log-batch` takes it. The file
//! is replaced whole (written beside, then renamed), so it is never half a
//! file; a resend that delivers everything removes it, one that delivers
//! part rewrites it with the rest, so a second resend sends nothing twice.
//!
//! Reading it back is strict, because a spool file is input: at most
//! [`MAX_SPOOL`] bytes, a known version, run and experiment ids of plain
//! characters (they go into URLs), only memtrack's own metric names, and
//! no unknown field. A file that breaks any of these is refused whole with
//! the line that broke it, and left as it is.

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::api::Metric;
use super::settings::Experiment;
use super::values::known_key;

/// The spool's name in the run directory.
pub(crate) const SPOOL_FILE: &str = "mlflow-spool.jsonl";

/// The largest spool file read back. The live queue holds at most
/// `QUEUE_MAX` values of under 100 bytes each, so a real spool is far
/// smaller.
pub(crate) const MAX_SPOOL: u64 = 64 << 20;

/// The spool format's version.
const VERSION: u32 = 1;

/// The longest id (run, experiment) accepted from a spool file.
const MAX_ID: usize = 256;
/// The longest experiment name accepted from a spool file.
const MAX_NAME: usize = 500;

/// The first line: where the values go and what else is owed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Header {
    pub(crate) mlflow_spool: u32,
    /// The tracking server without user information (used when the
    /// resend's configuration and environment name none).
    pub(crate) tracking_uri: String,
    /// The MLflow run, when known.
    pub(crate) run_id: Option<String>,
    /// memtrack created that run (it ends it).
    pub(crate) created: bool,
    /// Where to create the run when none is known.
    pub(crate) experiment_id: Option<String>,
    pub(crate) experiment_name: Option<String>,
    /// The memtrack run's name and id, for a run created at resend.
    pub(crate) run_name: String,
    pub(crate) memtrack_run: String,
    /// `memory_usage.json` (and the report page) not attached yet.
    pub(crate) artifacts: bool,
    /// The run memtrack created is still to be ended: `FINISHED` or `FAILED`.
    pub(crate) end: Option<String>,
}

impl Header {
    pub(crate) fn new(tracking_uri: &str, run_name: &str, memtrack_run: &str) -> Header {
        Header {
            mlflow_spool: VERSION,
            tracking_uri: strip_userinfo(tracking_uri),
            run_id: None,
            created: false,
            experiment_id: None,
            experiment_name: None,
            run_name: run_name.to_string(),
            memtrack_run: memtrack_run.to_string(),
            artifacts: false,
            end: None,
        }
    }

    pub(crate) fn set_experiment(&mut self, experiment: &Experiment) {
        match experiment {
            Experiment::Id(id) => self.experiment_id = Some(id.clone()),
            Experiment::Name(name) => self.experiment_name = Some(name.clone()),
        }
    }

    /// The experiment a run created at resend goes into.
    pub(crate) fn experiment(&self) -> Option<Experiment> {
        self.experiment_name
            .clone()
            .map(Experiment::Name)
            .or_else(|| self.experiment_id.clone().map(Experiment::Id))
    }

    fn check(&self) -> Result<(), String> {
        if self.mlflow_spool != VERSION {
            return Err(format!(
                "spool version {} is not the one this memtrack reads ({VERSION})",
                self.mlflow_spool
            ));
        }
        for (what, id) in [
            ("run_id", &self.run_id),
            ("experiment_id", &self.experiment_id),
        ] {
            if let Some(id) = id {
                if !plain_id(id) {
                    return Err(format!(
                        "{what} is not an id (1 to {MAX_ID} letters, digits, `-` or `_`)"
                    ));
                }
            }
        }
        if self
            .experiment_name
            .as_ref()
            .is_some_and(|n| n.is_empty() || n.len() > MAX_NAME)
        {
            return Err(format!("experiment_name is empty or over {MAX_NAME} bytes"));
        }
        if let Some(end) = &self.end {
            if !matches!(end.as_str(), "FINISHED" | "FAILED") {
                return Err("end is neither FINISHED nor FAILED".into());
            }
        }
        if !(self.tracking_uri.is_empty()
            || self.tracking_uri.starts_with("http://")
            || self.tracking_uri.starts_with("https://"))
        {
            return Err("tracking_uri is not an http(s) URL".into());
        }
        Ok(())
    }
}

/// Ids travel in URLs: letters, digits, `-` and `_` only.
pub(crate) fn plain_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// `http://user:pw@host/x` → `http://host/x`: a password never goes into
/// a file.
fn strip_userinfo(uri: &str) -> String {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return uri.to_string();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}://{host}{tail}")
}

/// One value line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    key: String,
    value: f64,
    timestamp: i64,
    step: i64,
}

/// What a spool file holds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Spool {
    pub(crate) header: Header,
    pub(crate) values: Vec<Metric>,
}

/// Why a spool file cannot be read back.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpoolError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} line {line}: {why}; the file is left as it is")]
    Bad {
        path: String,
        line: usize,
        why: String,
    },
}

/// Writes `spool` to `path`, replacing what was there in one step.
pub(crate) fn write<'a>(
    path: &Path,
    header: &Header,
    values: impl IntoIterator<Item = &'a Metric>,
) -> std::io::Result<()> {
    let (tmp, file) = crate::files::create_temp(path)?;
    let result = (|| {
        let mut out = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut out, header)?;
        out.write_all(b"\n")?;
        for m in values {
            serde_json::to_writer(&mut out, m)?;
            out.write_all(b"\n")?;
        }
        out.flush()?;
        out.get_ref().sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Reads a spool file back (see the module for what is refused). `None`
/// when there is none.
pub(crate) fn read(path: &Path) -> Result<Option<Spool>, SpoolError> {
    let shown = path.display().to_string();
    let text = match crate::files::read_text_capped(path, MAX_SPOOL) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SpoolError::Read {
                path: shown,
                source,
            })
        }
    };
    parse(&text)
        .map(Some)
        .map_err(|(line, why)| SpoolError::Bad {
            path: shown,
            line,
            why,
        })
}

/// A spool's text; the error names the line (from 1) and what is wrong.
fn parse(text: &str) -> Result<Spool, (usize, String)> {
    if !text.is_empty() && !text.ends_with('\n') {
        return Err((
            text.lines().count(),
            "the last line is cut short (the file was not written whole)".into(),
        ));
    }
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    let (_, first) = lines.next().ok_or((1, "the file is empty".to_string()))?;
    let header: Header =
        serde_json::from_str(first).map_err(|e| (1, format!("not a spool header: {e}")))?;
    header.check().map_err(|why| (1, why))?;
    let mut values = Vec::new();
    for (n, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(line).map_err(|e| (n, format!("not a value: {e}")))?;
        let key = known_key(&l.key)
            .ok_or_else(|| (n, format!("`{}` is not a metric memtrack logs", l.key)))?;
        values.push(Metric {
            key,
            value: l.value,
            timestamp: l.timestamp,
            step: l.step,
        });
    }
    Ok(Spool { header, values })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metric(step: i64) -> Metric {
        Metric {
            key: "memtrack/host_mb",
            value: 1.5,
            timestamp: 1_700_000_000_000,
            step,
        }
    }

    fn header() -> Header {
        let mut h = Header::new("http://alice:pw@127.0.0.1:5000", "r", "abc");
        h.run_id = Some("0123abcd".into());
        h
    }

    #[test]
    fn written_and_read_back_without_the_password() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SPOOL_FILE);
        let values = vec![metric(1), metric(2)];
        write(&path, &header(), &values).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("alice") && !text.contains("pw@"), "{text}");
        let back = read(&path).unwrap().unwrap();
        assert_eq!(back.values, values);
        assert_eq!(back.header.tracking_uri, "http://127.0.0.1:5000");
        assert_eq!(back.header.run_id.as_deref(), Some("0123abcd"));
        assert!(read(&dir.path().join("none")).unwrap().is_none());
    }

    #[test]
    fn a_bad_file_is_refused_whole_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SPOOL_FILE);
        let head = serde_json::to_string(&header()).unwrap();
        let good = serde_json::to_string(&metric(1)).unwrap();
        let hostile_run = head.replace("0123abcd", "x&run_id=other");
        let other_version = head.replace("\"mlflow_spool\":1", "\"mlflow_spool\":9");
        let cases = [
            (String::new(), 1, "empty"),
            ("{\"a\":1}\n".to_string(), 1, "not a spool header"),
            (format!("{hostile_run}\n"), 1, "run_id is not an id"),
            (format!("{other_version}\n"), 1, "version 9"),
            (format!("{head}\n{good}\nnot json\n"), 3, "not a value"),
            (
                format!("{head}\n{}\n", good.replace("memtrack/host_mb", "loss")),
                2,
                "`loss` is not a metric",
            ),
            (
                format!("{head}\n{}\n", good.replace("}", ",\"extra\":1}")),
                2,
                "unknown field",
            ),
            (format!("{head}\n{good}\n{}", &good[..10]), 3, "cut short"),
        ];
        for (text, line, says) in cases {
            std::fs::write(&path, &text).unwrap();
            let err = read(&path).unwrap_err().to_string();
            assert!(
                err.contains(&format!("line {line}:")) && err.contains(says),
                "{text:?}: {err}"
            );
            assert!(err.contains("left as it is"), "{err}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "untouched");
        }
    }

    #[test]
    fn an_oversized_file_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SPOOL_FILE);
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(MAX_SPOOL + 1).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("larger than"), "{err}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), MAX_SPOOL + 1);
    }

    #[test]
    fn passwords_are_stripped_from_uris() {
        assert_eq!(strip_userinfo("https://a:b@h:1/p?x=@"), "https://h:1/p?x=@");
        assert_eq!(strip_userinfo("http://h"), "http://h");
    }
}
