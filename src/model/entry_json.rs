//! A log entry's JSON form: its keys in the document's order.
//!
//! An [`Entry`] holds its six memory figures in one [`Figures`], but the
//! document has always written `gpu_source` among them (after
//! `reserved_gpu_ram_mb`), so a flattened `Figures` would move that key.
//! The entry is written through [`EntryOut`], which borrows each value and
//! puts it in its place, and read through [`EntryIn`], which takes the
//! keys in any order; neither buffers an entry, as `#[serde(flatten)]`
//! would for every one of a long log's entries.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, Serializer};

use super::{Entry, EntryKind, Figures, GpuSource};

/// An entry as written.
#[derive(Serialize)]
struct EntryOut<'a> {
    component: &'a str,
    operation: &'a str,
    timestamp: f64,
    cpu_ram_used_mb: f64,
    gpu_ram_used_mb: f64,
    gpu_ram_peak_mb: f64,
    reserved_gpu_ram_mb: f64,
    gpu_source: GpuSource,
    gpu_process_used_mb: f64,
    cpu_ram_hwm_mb: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    charge_mb: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    charge_hwm_mb: Option<f64>,
    kind: EntryKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    iteration: Option<u64>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    labels: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    span: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stage: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    samples: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timestamp_end: Option<f64>,
}

impl Serialize for Entry {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let f = &self.figures;
        EntryOut {
            component: &self.component,
            operation: &self.operation,
            timestamp: self.timestamp,
            cpu_ram_used_mb: f.cpu_ram_used_mb,
            gpu_ram_used_mb: f.gpu_ram_used_mb,
            gpu_ram_peak_mb: f.gpu_ram_peak_mb,
            reserved_gpu_ram_mb: f.reserved_gpu_ram_mb,
            gpu_source: self.gpu_source,
            gpu_process_used_mb: f.gpu_process_used_mb,
            cpu_ram_hwm_mb: f.cpu_ram_hwm_mb,
            charge_mb: self.charge_mb,
            charge_hwm_mb: self.charge_hwm_mb,
            kind: self.kind,
            pid: self.pid,
            iteration: self.iteration,
            labels: &self.labels,
            span: self.span.as_deref(),
            stage: self.stage.as_deref(),
            samples: self.samples,
            timestamp_end: self.timestamp_end,
        }
        .serialize(serializer)
    }
}

/// An entry as read: every key but the first three may be absent.
#[derive(Deserialize)]
pub(super) struct EntryIn {
    component: String,
    operation: String,
    timestamp: f64,
    #[serde(default)]
    cpu_ram_used_mb: f64,
    #[serde(default)]
    gpu_ram_used_mb: f64,
    #[serde(default)]
    gpu_ram_peak_mb: f64,
    #[serde(default)]
    reserved_gpu_ram_mb: f64,
    #[serde(default)]
    gpu_source: GpuSource,
    #[serde(default)]
    gpu_process_used_mb: f64,
    #[serde(default)]
    cpu_ram_hwm_mb: f64,
    #[serde(default)]
    charge_mb: Option<f64>,
    #[serde(default)]
    charge_hwm_mb: Option<f64>,
    #[serde(default)]
    kind: EntryKind,
    #[serde(default)]
    pid: Option<u32>,
    #[serde(default)]
    iteration: Option<u64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    span: Option<String>,
    #[serde(default)]
    stage: Option<String>,
    #[serde(default)]
    samples: Option<u32>,
    #[serde(default)]
    timestamp_end: Option<f64>,
}

impl From<EntryIn> for Entry {
    fn from(e: EntryIn) -> Entry {
        Entry {
            component: e.component,
            operation: e.operation,
            timestamp: e.timestamp,
            figures: Figures {
                cpu_ram_used_mb: e.cpu_ram_used_mb,
                gpu_ram_used_mb: e.gpu_ram_used_mb,
                gpu_ram_peak_mb: e.gpu_ram_peak_mb,
                reserved_gpu_ram_mb: e.reserved_gpu_ram_mb,
                gpu_process_used_mb: e.gpu_process_used_mb,
                cpu_ram_hwm_mb: e.cpu_ram_hwm_mb,
            },
            gpu_source: e.gpu_source,
            charge_mb: e.charge_mb,
            charge_hwm_mb: e.charge_hwm_mb,
            kind: e.kind,
            pid: e.pid,
            iteration: e.iteration,
            labels: e.labels,
            span: e.span,
            stage: e.stage,
            samples: e.samples,
            timestamp_end: e.timestamp_end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key an entry can have, in the document's order.
    const FULL: &str = r#"{"component":"model","operation":"step","timestamp":1.5,"cpu_ram_used_mb":1.0,"gpu_ram_used_mb":2.0,"gpu_ram_peak_mb":3.0,"reserved_gpu_ram_mb":4.0,"gpu_source":"nvml","gpu_process_used_mb":5.0,"cpu_ram_hwm_mb":6.0,"charge_mb":7.0,"charge_hwm_mb":8.0,"kind":"timer","pid":9,"iteration":10,"labels":{"a":"b"},"span":"s","stage":"t","samples":11,"timestamp_end":12.5}"#;

    #[test]
    fn an_entry_keeps_its_keys_in_the_documents_order() {
        let e: Entry = serde_json::from_str(FULL).unwrap();
        assert_eq!(e.figures.as_array(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(e.gpu_source, GpuSource::Nvml);
        assert_eq!(serde_json::to_string(&e).unwrap(), FULL);
        let bare = r#"{"component":"c","operation":"o","timestamp":0.0,"cpu_ram_used_mb":0.0,"gpu_ram_used_mb":0.0,"gpu_ram_peak_mb":0.0,"reserved_gpu_ram_mb":0.0,"gpu_source":"none","gpu_process_used_mb":0.0,"cpu_ram_hwm_mb":0.0,"kind":"event"}"#;
        let e: Entry =
            serde_json::from_str(r#"{"timestamp":0,"operation":"o","component":"c"}"#).unwrap();
        assert_eq!(serde_json::to_string(&e).unwrap(), bare);
        let err = serde_json::from_str::<Entry>(r#"{"component":"c","operation":"o"}"#);
        assert!(err.is_err(), "the time is required");
    }
}
