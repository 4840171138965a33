//! One piece of advice: its code, level, finding, action and figures.
//! Kept apart from the rules so that the document's schema can name the
//! type without depending on them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How much a finding matters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Worth knowing; nothing is wrong.
    #[default]
    Info,
    /// Memory is wasted or at risk.
    Warning,
    /// The run died of it.
    Critical,
}

impl Severity {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Critical => "critical",
        }
    }
}

/// One piece of advice.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Advice {
    /// The rule's stable name (`worker-cost`, `batch-fit`, …).
    pub code: String,
    #[serde(default)]
    pub level: Severity,
    /// What the figures show, in one line.
    pub finding: String,
    /// What to do about it.
    #[serde(default)]
    pub action: String,
    /// The figures the finding rests on (MiB unless the name says
    /// otherwise), for tools.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub figures: BTreeMap<String, f64>,
}

impl Advice {
    pub fn new(code: &str, level: Severity, finding: String, action: String) -> Advice {
        Advice {
            code: code.to_string(),
            level,
            finding,
            action,
            figures: BTreeMap::new(),
        }
    }

    pub(crate) fn figure(mut self, name: &str, value: f64) -> Advice {
        if value.is_finite() {
            self.figures.insert(name.to_string(), round2(value));
        }
        self
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// A size for a sentence: `310 MiB`, `3.1 GiB`.
pub(crate) fn size(mib: f64) -> String {
    if mib.abs() >= 1024.0 {
        format!("{:.1} GiB", mib / 1024.0)
    } else if mib.abs() >= 10.0 {
        format!("{mib:.0} MiB")
    } else {
        format!("{mib:.1} MiB")
    }
}
