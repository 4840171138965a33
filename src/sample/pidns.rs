//! PID namespaces and NVML's process IDs.
//!
//! The NVIDIA driver is not PID-namespace aware: NVML lists every process
//! on a GPU by its PID in the host's (init) namespace. memtrack's tree
//! holds PIDs of its own namespace. Inside a container the two differ, so
//! matching them as they are would give the job no GPU memory at all (or,
//! by chance, a stranger's). This module says which namespace memtrack
//! runs in and, when a procfs of the host is readable, turns a host PID
//! into this namespace's PID.
//!
//! The translation reads `/proc/PID/status` of the host's procfs: its
//! `NSpid` line lists the process's PID in every namespace from the host's
//! down to its own. The entry at memtrack's depth is the PID memtrack sees
//! when the process lives in memtrack's namespace (or one below it). A
//! process of a sibling container has an entry at that depth too, of
//! another namespace, so a candidate is only accepted when its start time
//! (`stat` field 22) is the one memtrack's own procfs shows for that PID.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::parse::parse_stat;
use crate::model::{AttributionMode, GpuAttribution, PidNamespaceInfo};

/// The most read of one procfs file here (`status` is about 1.5 KiB).
const PROC_FILE_MAX: u64 = 64 * 1024;

/// Reads a procfs file through `files::read_capped`: `gpu.host_proc` is a
/// setting, and what it names may be anything — a FIFO at `self/status`
/// would hang the open, `/dev/zero` as a `PID/status` would never end, a
/// sparse file would claim gigabytes. Opened without blocking, refused
/// unless a regular file (procfs files are), at most [`PROC_FILE_MAX`]
/// bytes.
fn read_proc(path: &Path) -> std::io::Result<String> {
    let bytes = crate::files::read_capped(path, PROC_FILE_MAX)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The inode of the init PID namespace (`PROC_PID_INIT_INO` in the
/// kernel, fixed since Linux 3.8): `/proc/self/ns/pid` reads
/// `pid:[4026531836]` on the host.
pub const INIT_PID_NS_INODE: u64 = 0xEFFF_FFFC;

/// The PID namespace memtrack runs in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PidNamespace {
    /// The inode of `/proc/self/ns/pid`, when readable.
    pub(crate) inode: Option<u64>,
    /// `NSpid` of memtrack itself, as its procfs shows it (one entry when
    /// that procfs belongs to memtrack's own namespace).
    pub(crate) nspid: Vec<u32>,
}

impl PidNamespace {
    /// Reads memtrack's namespace through the procfs at `proc_root`.
    pub(crate) fn of_self(proc_root: &Path) -> PidNamespace {
        let inode = std::fs::read_link(proc_root.join("self/ns/pid"))
            .ok()
            .and_then(|l| ns_inode(&l.to_string_lossy()));
        let nspid = read_proc(&proc_root.join("self/status"))
            .ok()
            .and_then(|s| nspid(&s))
            .unwrap_or_default();
        PidNamespace { inode, nspid }
    }

    /// Whether this is the host's namespace: `Some(false)` when `NSpid`
    /// shows an outer namespace or the namespace's inode is not the init
    /// one, `None` when neither could be read.
    pub(crate) fn is_init(&self) -> Option<bool> {
        if self.nspid.len() > 1 {
            return Some(false);
        }
        self.inode.map(|i| i == INIT_PID_NS_INODE)
    }
}

/// The inode in a namespace link's text, `pid:[4026531836]`.
pub(crate) fn ns_inode(link: &str) -> Option<u64> {
    link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// The PIDs of the `NSpid:` line of a `status` file, outermost first.
pub(crate) fn nspid(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let pids: Option<Vec<u32>> = line.split_whitespace().map(|p| p.parse().ok()).collect();
    pids.filter(|p| !p.is_empty())
}

/// Turns host PIDs (NVML's) into PIDs of memtrack's namespace, through a
/// procfs of the host mounted at `host_proc`.
#[derive(Debug, Clone)]
pub(crate) struct HostPids {
    host_proc: PathBuf,
    local_proc: PathBuf,
    /// memtrack's index in host-side `NSpid` chains.
    depth: usize,
    /// Answers so far, by host PID, with the process's start time.
    known: HashMap<u32, (u64, PidOwner)>,
}

/// Why a procfs cannot map NVML's host PIDs to the tree's.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotHostProc {
    #[error(
        "{} is not the host's procfs (its PID 1 is not in the init PID namespace)",
        .0.display()
    )]
    NotInit(PathBuf),
    #[error("{}/self/status has no NSpid line", .0.display())]
    NoNspid(PathBuf),
    #[error("cannot read {}: {source}", .path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} is not a procfs of an outer PID namespace (it shows memtrack as {}/self does)",
        host_proc.display(),
        local_proc.display()
    )]
    NotOuter {
        host_proc: PathBuf,
        local_proc: PathBuf,
    },
}

impl HostPids {
    /// Checks that `host_proc` is a procfs of an outer namespace that
    /// shows memtrack itself (and, where its PID 1's namespace link is
    /// readable, that this is the init namespace); the error says why it
    /// cannot be used.
    pub(crate) fn open(host_proc: &Path, local_proc: &Path) -> Result<HostPids, NotHostProc> {
        let shown = || host_proc.to_path_buf();
        if let Ok(init) = std::fs::read_link(host_proc.join("1/ns/pid")) {
            if ns_inode(&init.to_string_lossy()) != Some(INIT_PID_NS_INODE) {
                return Err(NotHostProc::NotInit(shown()));
            }
        }
        let status = host_proc.join("self/status");
        let text = read_proc(&status).map_err(|source| NotHostProc::Unreadable {
            path: status.clone(),
            source,
        })?;
        let own = nspid(&text).ok_or_else(|| NotHostProc::NoNspid(shown()))?;
        let local = read_proc(&local_proc.join("self/status"))
            .ok()
            .and_then(|s| nspid(&s))
            .unwrap_or_default();
        if own.len() <= local.len() && host_proc != local_proc {
            return Err(NotHostProc::NotOuter {
                host_proc: shown(),
                local_proc: local_proc.to_path_buf(),
            });
        }
        Ok(HostPids {
            host_proc: host_proc.to_path_buf(),
            local_proc: local_proc.to_path_buf(),
            depth: own.len() - 1,
            known: HashMap::new(),
        })
    }

    /// What the host's `host_pid` is to memtrack. A process keeps its
    /// answer for life (its namespaces never change), so a known one
    /// costs one read: its start time, which tells a reused PID apart.
    pub(crate) fn resolve(&mut self, host_pid: u32) -> PidOwner {
        let dir = self.host_proc.join(host_pid.to_string());
        let host_start = match read_proc(&dir.join("stat")) {
            Ok(text) => match parse_stat(&text) {
                Ok(s) => s.start_ticks,
                Err(_) => return PidOwner::Unknown,
            },
            // Exited since NVML listed it: nobody's memory any more.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return PidOwner::Foreign,
            Err(_) => return PidOwner::Unknown,
        };
        if let Some(&(start, answer)) = self.known.get(&host_pid) {
            if start == host_start {
                return answer;
            }
        }
        let answer = self.look_up(&dir, host_start);
        if answer != PidOwner::Unknown {
            if self.known.len() >= KNOWN_MAX {
                self.known.clear();
            }
            self.known.insert(host_pid, (host_start, answer));
        }
        answer
    }

    /// Reads the `NSpid` chain of the host's process in `dir` (started at
    /// `host_start`) and checks its candidate in memtrack's procfs.
    fn look_up(&self, dir: &Path, host_start: u64) -> PidOwner {
        let status = match read_proc(&dir.join("status")) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return PidOwner::Foreign,
            Err(_) => return PidOwner::Unknown,
        };
        let Some(chain) = nspid(&status) else {
            return PidOwner::Unknown;
        };
        let Some(&candidate) = chain.get(self.depth) else {
            // Not in memtrack's namespace nor below it.
            return PidOwner::Foreign;
        };
        let local = self.local_proc.join(candidate.to_string()).join("stat");
        let local_start = read_proc(&local)
            .ok()
            .and_then(|t| parse_stat(&t).ok())
            .map(|s| s.start_ticks);
        if local_start == Some(host_start) {
            PidOwner::Ours(candidate)
        } else {
            // Another namespace at memtrack's depth (a sibling container).
            PidOwner::Foreign
        }
    }
}

/// Host PIDs whose answer is remembered; beyond, the memory starts over.
const KNOWN_MAX: usize = 4096;

/// A host PID as memtrack sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PidOwner {
    /// This namespace's PID of the same process.
    Ours(u32),
    /// A process of another namespace (another container, the host).
    Foreign,
    /// The host's procfs did not say (unreadable).
    Unknown,
}

/// How NVML's PIDs become the tree's.
#[derive(Debug, Clone)]
pub(crate) enum PidMap {
    /// memtrack is in the host's namespace: they are the same.
    Same,
    /// Through a procfs of the host.
    Host(HostPids),
    /// They cannot be: the GPU figures are device-level.
    Unmappable,
}

/// Chooses the [`PidMap`] for memtrack's namespace (read through
/// `proc_root`) and the `host_proc` setting (empty: none), with the
/// run's [`GpuAttribution`] as it starts.
pub(crate) fn plan(proc_root: &Path, host_proc: &Path) -> (PidMap, GpuAttribution) {
    let ns = PidNamespace::of_self(proc_root);
    let init = ns.is_init();
    let mut attribution = GpuAttribution {
        pid_namespace: PidNamespaceInfo {
            inode: ns.inode,
            init,
            nspid: ns.nspid.clone(),
        },
        ..GpuAttribution::default()
    };
    let name = ns
        .inode
        .map_or_else(|| "unknown".to_string(), |i| format!("pid:[{i}]"));
    let map = match init {
        Some(true) => {
            attribution.reason =
                "memtrack runs in the host's PID namespace: NVML's PIDs are the tree's".into();
            PidMap::Same
        }
        None => {
            attribution.reason = "memtrack's PID namespace cannot be read: NVML's PIDs are taken \
                                  as the tree's"
                .into();
            PidMap::Same
        }
        Some(false) if host_proc.as_os_str().is_empty() => {
            attribution.reason = format!(
                "memtrack runs in a PID namespace of its own ({name}) and NVML reports host \
                 PIDs, which cannot be matched to the job's without the host's procfs \
                 (gpu.host_proc)"
            );
            PidMap::Unmappable
        }
        Some(false) => match HostPids::open(host_proc, proc_root) {
            Ok(map) => {
                attribution.reason = format!(
                    "memtrack runs in a PID namespace of its own ({name}): NVML's host PIDs are \
                     mapped to the job's through the host's procfs at {}",
                    host_proc.display()
                );
                attribution.host_proc = Some(host_proc.display().to_string());
                PidMap::Host(map)
            }
            Err(why) => {
                attribution.reason = format!(
                    "memtrack runs in a PID namespace of its own ({name}) and NVML reports host \
                     PIDs; gpu.host_proc cannot map them: {why}"
                );
                PidMap::Unmappable
            }
        },
    };
    if matches!(map, PidMap::Unmappable) {
        attribution.mode = AttributionMode::DeviceLevel;
    }
    (map, attribution)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_lines() {
        assert_eq!(ns_inode("pid:[4026531836]"), Some(INIT_PID_NS_INODE));
        assert_eq!(ns_inode("net:[4026531836]"), None);
        let status = "Name:\tpython3\nTgid:\t7\nNSpid:\t81234\t7\nNSpgid:\t1\n";
        assert_eq!(nspid(status), Some(vec![81234, 7]));
        assert_eq!(nspid("Name:\tx\n"), None);
        let inner = PidNamespace {
            inode: Some(INIT_PID_NS_INODE),
            nspid: vec![81234, 7],
        };
        assert_eq!(inner.is_init(), Some(false), "NSpid wins");
        let container = PidNamespace {
            inode: Some(4026532999),
            nspid: vec![7],
        };
        assert_eq!(container.is_init(), Some(false));
        assert_eq!(PidNamespace::default().is_init(), None);
    }

    #[test]
    fn on_the_host_every_pid_is_its_own() {
        let proc_root = Path::new("/proc");
        let ns = PidNamespace::of_self(proc_root);
        if ns.is_init() != Some(true) {
            // This test runs on a host; a containerised CI would need
            // MEMTRACK_ALLOW_SKIP to say so.
            assert!(
                std::env::var_os("MEMTRACK_ALLOW_SKIP").is_some(),
                "not in the init PID namespace: {ns:?}"
            );
            return;
        }
        let mut map = HostPids::open(proc_root, proc_root).unwrap();
        let me = std::process::id();
        assert_eq!(map.resolve(me), PidOwner::Ours(me));
        assert_eq!(map.resolve(me), PidOwner::Ours(me), "remembered");
        assert_eq!(map.resolve(u32::MAX), PidOwner::Foreign, "gone");
        let (pids, attribution) = plan(proc_root, Path::new(""));
        assert!(matches!(pids, PidMap::Same), "{pids:?}");
        assert_eq!(attribution.mode, AttributionMode::PerProcess);
        assert_eq!(attribution.pid_namespace.init, Some(true));
    }
}
