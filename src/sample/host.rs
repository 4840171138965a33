//! What one host sample holds: the tree's processes with their figures,
//! who joined and left since the previous sample, and the tree's headline
//! figure. Filled by the procfs reader and the footprint reader; folded by
//! the store. Pure data, kept in the journal as it is.

use serde::{Deserialize, Serialize};

use super::cgroup;
use crate::model::{Exit, HostSource};

/// A process's identity: PIDs are reused, (pid, start time) is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct Identity {
    pub(crate) pid: u32,
    pub(crate) start_ticks: u64,
}

/// A process that joined the tree, with what is known about it once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Joined {
    pub(crate) id: Identity,
    pub(crate) ppid: u32,
    /// Process start as Unix seconds.
    pub(crate) start_time: f64,
    pub(crate) name: String,
    pub(crate) cmdline: Vec<String>,
    pub(crate) root: bool,
}

/// A member's name and command line, read after it joined (it joined in
/// the middle of `execve`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Described {
    pub(crate) pid: u32,
    pub(crate) name: String,
    pub(crate) cmdline: Vec<String>,
}

/// A process that left the tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Left {
    pub(crate) id: Identity,
    /// Known when we reaped it or read a zombie's status.
    pub(crate) exit: Option<Exit>,
    /// Exact peak RSS from `wait4`, when we reaped it.
    pub(crate) max_rss: Option<u64>,
}

/// One process's figures in a sample (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub(crate) struct HostProcessReading {
    pub(crate) pid: u32,
    pub(crate) rss: u64,
    /// The last `VmHWM` read (at most `hwm_interval` old).
    pub(crate) hwm: u64,
    pub(crate) pss: Option<u64>,
    pub(crate) uss: Option<u64>,
    /// `pss` and `uss` were read with this sample (not carried from an
    /// earlier one): a point of the process's own-cost series.
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) own_read: bool,
    /// That reading is an estimate (its growth since its last read), not
    /// a read: no read came while it held its size.
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) own_estimated: bool,
    /// How far `VmHWM` rose above what was known since the last read: a
    /// peak this process reached between two samples.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) hwm_rise: u64,
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The host part of one sample.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct HostSample {
    pub(crate) processes: Vec<HostProcessReading>,
    pub(crate) joined: Vec<Joined>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) described: Vec<Described>,
    pub(crate) left: Vec<Left>,
    /// Reads that failed for a reason other than the process being gone.
    pub(crate) errors: u32,
    /// Processes that joined without a kept-open file because memtrack ran
    /// out of descriptors: they are followed by path instead.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub(crate) fd_fallbacks: u32,
    /// The tree's headline figure (every page once), when computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) footprint: Option<Footprint>,
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

impl HostSample {
    pub fn clear(&mut self) {
        self.processes.clear();
        self.joined.clear();
        self.described.clear();
        self.left.clear();
        self.errors = 0;
        self.fd_fallbacks = 0;
        self.footprint = None;
    }

    pub(crate) fn tree_rss(&self) -> u64 {
        self.processes.iter().map(|p| p.rss).sum()
    }

    pub(crate) fn tree_hwm(&self) -> u64 {
        self.processes.iter().map(|p| p.hwm.max(p.rss)).sum()
    }

    /// The peaks processes reached between two samples beyond what they
    /// hold now, summed (as if they coincided: an upper bound).
    pub(crate) fn tree_hwm_rise(&self) -> u64 {
        self.processes.iter().map(|p| p.hwm_rise).sum()
    }
}

/// The tree's figure in one sample (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Footprint {
    pub(crate) source: HostSource,
    /// Resident memory of the tree now, every page once.
    pub(crate) used: u64,
    /// The highest `used` since the previous sample, as far as the source
    /// can tell (the kernel's peak; rises of processes' `VmHWM`).
    pub(crate) peak: u64,
    /// Pages or Σ Pss: seconds since the last complete pass behind `used`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) age_s: Option<f64>,
    /// Cgroup: the reading behind `used`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cgroup: Option<cgroup::CgroupReading>,
    /// Pages or Σ Pss: reads so far off the sampling thread and the CPU
    /// seconds they took.
    #[serde(default)]
    pub(crate) pss_reads: u64,
    #[serde(default)]
    pub(crate) pss_read_s: f64,
}
