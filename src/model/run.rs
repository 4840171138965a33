//! The two closed-but-open vocabularies of [`super::RunInfo`]: where the
//! GPU figures came from, and how far the run got; and how the tree's GPU
//! memory was told apart from other processes' ([`GpuAttribution`]).
//!
//! Both are written as the plain strings older builds wrote (`"nvml"`,
//! `"none: <reason>"`, `"finished"`, …) and read back from any string: a
//! value this build does not know is kept as `Other`, so reading an old or
//! newer file never fails and writing it again gives the same bytes.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where a run's GPU figures came from (`run.gpu_backend`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuBackend {
    /// NVIDIA's management library: `nvml`.
    Nvml,
    /// Host-only mode, and why: `none: <reason>`.
    None { reason: String },
    /// Any other string, kept as it was read (empty in a file without it).
    Other(String),
}

impl Default for GpuBackend {
    /// Unknown: an empty string, as a file without the field reads.
    fn default() -> Self {
        GpuBackend::Other(String::new())
    }
}

impl GpuBackend {
    /// Reads the written form; never fails.
    pub(crate) fn parse(s: &str) -> GpuBackend {
        if s == "nvml" {
            GpuBackend::Nvml
        } else if let Some(reason) = s.strip_prefix("none: ") {
            GpuBackend::None {
                reason: reason.to_string(),
            }
        } else {
            GpuBackend::Other(s.to_string())
        }
    }

    /// The backend's name without its reason: `nvml`, `none`, or the part
    /// of an unknown string before its first `:` (the metrics' label).
    pub(crate) fn kind(&self) -> &str {
        match self {
            GpuBackend::Nvml => "nvml",
            GpuBackend::None { .. } => "none",
            GpuBackend::Other(s) => s.split(':').next().unwrap_or(""),
        }
    }

    /// Whether the run had no GPU figures (`none`, with or without a
    /// reason).
    pub(crate) fn is_host_only(&self) -> bool {
        match self {
            GpuBackend::Nvml => false,
            GpuBackend::None { .. } => true,
            GpuBackend::Other(s) => s.starts_with("none"),
        }
    }

    /// Why there are no GPU figures, for host-only mode.
    #[cfg(test)]
    pub(crate) fn reason(&self) -> Option<&str> {
        match self {
            GpuBackend::None { reason } => Some(reason),
            _ => None,
        }
    }
}

impl From<&str> for GpuBackend {
    fn from(s: &str) -> Self {
        GpuBackend::parse(s)
    }
}

impl PartialEq<&str> for GpuBackend {
    /// Compares the written form.
    fn eq(&self, other: &&str) -> bool {
        match self {
            GpuBackend::Nvml => *other == "nvml",
            GpuBackend::None { reason } => other.strip_prefix("none: ") == Some(reason.as_str()),
            GpuBackend::Other(s) => s == other,
        }
    }
}

impl fmt::Display for GpuBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuBackend::Nvml => f.write_str("nvml"),
            GpuBackend::None { reason } => write!(f, "none: {reason}"),
            GpuBackend::Other(s) => f.write_str(s),
        }
    }
}

impl Serialize for GpuBackend {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GpuBackend {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(GpuBackend::parse(&s))
    }
}

/// How far a run got (`run.status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunStatus {
    /// Checkpointed while the job runs.
    Running,
    /// Written after a clean end.
    Finished,
    /// Rebuilt from the journal after memtrack died.
    Recovered,
    /// Combined from several runs' files by `merge`.
    Merged,
    /// Any other string, kept as it was read (empty in a file without it).
    Other(String),
}

impl Default for RunStatus {
    /// Not set: an empty string, as a file without the field reads.
    fn default() -> Self {
        RunStatus::Other(String::new())
    }
}

impl RunStatus {
    /// The written form.
    pub(crate) fn as_str(&self) -> &str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Finished => "finished",
            RunStatus::Recovered => "recovered",
            RunStatus::Merged => "merged",
            RunStatus::Other(s) => s,
        }
    }

    /// Whether no status was recorded (an older file, or a run not yet
    /// written).
    pub(crate) fn is_empty(&self) -> bool {
        self.as_str().is_empty()
    }
}

impl From<&str> for RunStatus {
    /// Reads the written form; never fails.
    fn from(s: &str) -> Self {
        match s {
            "running" => RunStatus::Running,
            "finished" => RunStatus::Finished,
            "recovered" => RunStatus::Recovered,
            "merged" => RunStatus::Merged,
            other => RunStatus::Other(other.to_string()),
        }
    }
}

impl PartialEq<&str> for RunStatus {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for RunStatus {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for RunStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(RunStatus::from(s.as_str()))
    }
}

/// How the tree's GPU memory was told apart from other processes' on the
/// same GPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttributionMode {
    /// NVML's per-process figures of the tree's own processes.
    #[default]
    PerProcess,
    /// NVML's PIDs could not be matched to the tree's (memtrack in a PID
    /// namespace without the host's procfs): the job's figure is the used
    /// memory of the GPUs it was given, every process on them included.
    DeviceLevel,
    /// Some samples per-process, others device-level.
    Mixed,
}

impl AttributionMode {
    /// The written form.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AttributionMode::PerProcess => "per-process",
            AttributionMode::DeviceLevel => "device-level",
            AttributionMode::Mixed => "mixed",
        }
    }
}

/// memtrack's own PID namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidNamespaceInfo {
    /// The namespace's inode (`/proc/self/ns/pid`), when readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inode: Option<u64>,
    /// Whether it is the host's (init) namespace; absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<bool>,
    /// memtrack's PID in each namespace its procfs shows, outermost first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nspid: Vec<u32>,
}

/// The document's `gpu_attribution` block: whose memory the GPU figures
/// are, and why.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuAttribution {
    /// Over the whole run.
    #[serde(default)]
    pub mode: AttributionMode,
    /// One line: why this mode.
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub pid_namespace: PidNamespaceInfo,
    /// The host's procfs NVML's PIDs were mapped through, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_proc: Option<String>,
    /// GPU samples of each kind.
    #[serde(default)]
    pub per_process_samples: u64,
    #[serde(default)]
    pub device_level_samples: u64,
}

impl GpuAttribution {
    /// Counts one GPU sample and sets the run's mode from the counts.
    pub(crate) fn count(&mut self, device_level: bool) {
        if device_level {
            self.device_level_samples += 1;
        } else {
            self.per_process_samples += 1;
        }
        self.mode = match (self.per_process_samples, self.device_level_samples) {
            (0, _) => AttributionMode::DeviceLevel,
            (_, 0) => AttributionMode::PerProcess,
            _ => AttributionMode::Mixed,
        };
    }

    /// Folds another rank's attribution into a merged job's: the counts
    /// add up, and ranks of different modes make the job's `mixed`.
    pub(crate) fn merge(&mut self, other: &GpuAttribution) {
        self.per_process_samples += other.per_process_samples;
        self.device_level_samples += other.device_level_samples;
        if self.mode != other.mode {
            self.mode = AttributionMode::Mixed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip<T: Serialize + for<'de> Deserialize<'de>>(written: &str) -> (T, String) {
        let json = serde_json::to_string(written).unwrap();
        let value: T = serde_json::from_str(&json).unwrap();
        let again = serde_json::to_string(&value).unwrap();
        assert_eq!(again, json, "{written:?} must be written back unchanged");
        (value, again)
    }

    #[test]
    fn a_gpu_backend_reads_and_writes_the_strings_older_files_hold() {
        assert_eq!(roundtrip::<GpuBackend>("nvml").0, GpuBackend::Nvml);
        let (none, _) = roundtrip::<GpuBackend>("none: no NVIDIA driver (libnvidia-ml.so.1)");
        assert_eq!(none.reason(), Some("no NVIDIA driver (libnvidia-ml.so.1)"));
        assert_eq!(none.kind(), "none");
        assert!(none.is_host_only());
        for odd in ["", "none", "none:x", "rocm: 2 devices", "NVML"] {
            let (v, _) = roundtrip::<GpuBackend>(odd);
            assert_eq!(v, GpuBackend::Other(odd.into()));
            assert_eq!(v.to_string(), odd);
        }
        assert_eq!(GpuBackend::parse("rocm: 2 devices").kind(), "rocm");
        assert!(GpuBackend::parse("none").is_host_only());
        assert!(!GpuBackend::Nvml.is_host_only());
        assert_eq!(GpuBackend::from("none: x"), "none: x");
        assert_ne!(GpuBackend::from("none: x"), "none: y");
        assert_eq!(GpuBackend::default().to_string(), "");
    }

    #[test]
    fn a_run_status_reads_and_writes_the_strings_older_files_hold() {
        for (s, v) in [
            ("running", RunStatus::Running),
            ("finished", RunStatus::Finished),
            ("recovered", RunStatus::Recovered),
            ("merged", RunStatus::Merged),
        ] {
            assert_eq!(roundtrip::<RunStatus>(s).0, v);
            assert_eq!(v, s);
        }
        let (odd, _) = roundtrip::<RunStatus>("paused-by-a-newer-build");
        assert_eq!(odd, RunStatus::Other("paused-by-a-newer-build".into()));
        assert!(RunStatus::default().is_empty());
        assert!(!RunStatus::Finished.is_empty());
    }

    #[test]
    fn ranks_of_different_attribution_make_a_mixed_job() {
        let mut job = GpuAttribution::default();
        job.count(false);
        let mut other = GpuAttribution::default();
        other.count(true);
        other.count(true);
        assert_eq!(other.mode, AttributionMode::DeviceLevel);
        let mut same = job.clone();
        same.merge(&job);
        assert_eq!(same.mode, AttributionMode::PerProcess);
        job.merge(&other);
        assert_eq!(
            (job.mode, job.per_process_samples, job.device_level_samples),
            (AttributionMode::Mixed, 1, 2)
        );
        let text = serde_json::to_string(&job.mode).unwrap();
        assert_eq!(text, "\"mixed\"");
        assert_eq!(AttributionMode::DeviceLevel.as_str(), "device-level");
    }
}
