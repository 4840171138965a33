//! The job's host memory as the kernel charges it: a memory cgroup.
//!
//! The kernel charges every page once, to one cgroup, however many
//! processes map it. A memory cgroup that holds nothing but the job's
//! process tree therefore answers "how much memory does this job use"
//! exactly, where a sum of per-process RSS counts each page shared by
//! forked workers (PyTorch's DataLoader) once per worker. Its peak counter
//! is kept by the kernel, so a spike between two ticks is not missed, and
//! its OOM-kill counter is the kernel's own verdict on a dead job.
//!
//! Both hierarchies are read: cgroup v2 (`memory.current`, `memory.peak`,
//! `memory.stat`, `memory.events`) and cgroup v1's memory controller
//! (`memory.usage_in_bytes`, `memory.max_usage_in_bytes`, `memory.stat`,
//! `memory.oom_control`). Files are opened once and re-read with `pread`.
//!
//! The charge includes page cache the kernel can drop at will (a dataset
//! read through the page cache). The figure memtrack reports is the
//! *working set*, the charge less the inactive file cache — the rule the
//! kubelet uses for a container's memory — so a re-run is not sized for
//! cache it does not need.
//!
//! memtrack creates a cgroup for the job only on cgroup v1 (a child of its
//! own memory cgroup, which v1 allows while memtrack stays in the parent).
//! On cgroup v2 a new cgroup would need memtrack to move itself first (v2
//! keeps processes out of cgroups that have children), so there memtrack
//! uses the job's existing cgroup — a container, a SLURM step, a systemd
//! unit or scope — when that holds nothing but the job (and memtrack).
//!
//! Parsers are pure functions over `&str`; paths are arguments, so tests run
//! against recorded files.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::parse::ParseError;

/// Which cgroup hierarchy a cgroup lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Version {
    V1,
    V2,
}

impl Version {
    pub(crate) fn number(self) -> u8 {
        match self {
            Version::V1 => 1,
            Version::V2 => 2,
        }
    }
}

/// A process's cgroups, from `/proc/PID/cgroup`: the v2 path (`0::/x`)
/// and the path in the v1 hierarchy that has the memory controller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    pub(crate) v2: Option<String>,
    pub v1_memory: Option<String>,
}

/// Parses `/proc/PID/cgroup` (`ID:CONTROLLERS:PATH` per line).
pub fn parse_proc_cgroup(text: &str) -> Membership {
    let mut m = Membership::default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            m.v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            m.v1_memory = Some(path.to_string());
        }
    }
    m
}

/// A mounted cgroup hierarchy, from `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mount {
    pub(crate) version: Version,
    /// The part of the hierarchy mounted there (`/` unless a container
    /// mounted a sub-tree).
    pub(crate) root: String,
    pub(crate) mount_point: PathBuf,
}

/// Parses `/proc/self/mountinfo` into the cgroup2 mount and the cgroup v1
/// mount carrying the memory controller.
pub(crate) fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        // ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL…] - FSTYPE SOURCE SUPER_OPTIONS
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = left.split(' ').collect();
        let theirs: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(point), Some(fstype)) =
            (fields.get(3), fields.get(4), theirs.first())
        else {
            continue;
        };
        let version = match *fstype {
            "cgroup2" => Version::V2,
            "cgroup"
                if theirs
                    .get(2)
                    .is_some_and(|o| o.split(',').any(|x| x == "memory")) =>
            {
                Version::V1
            }
            _ => continue,
        };
        mounts.push(Mount {
            version,
            root: unescape_mount(root),
            mount_point: PathBuf::from(unescape_mount(point)),
        });
    }
    mounts
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The directory of cgroup `path` (as `/proc/PID/cgroup` names it) under a
/// mount, or `None` when that part of the hierarchy is not mounted here.
pub(crate) fn cgroup_dir(mount: &Mount, path: &str) -> Option<PathBuf> {
    let rel = if mount.root == "/" {
        path
    } else {
        let rest = path.strip_prefix(mount.root.as_str())?;
        if !rest.is_empty() && !rest.starts_with('/') {
            return None;
        }
        rest
    };
    let rel = rel.trim_start_matches('/');
    if rel.split('/').any(|c| c == "..") {
        return None;
    }
    Some(if rel.is_empty() {
        mount.mount_point.clone()
    } else {
        mount.mount_point.join(rel)
    })
}

/// The `memory.stat` figures memtrack uses (bytes). v1 reports the
/// hierarchical `total_*` counters, v2's are hierarchical already.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MemStat {
    /// Anonymous memory (heaps, stacks, private mappings).
    pub(crate) anon: u64,
    /// Page cache, shared memory (tmpfs, `/dev/shm`) included.
    pub(crate) file: u64,
    /// Shared memory (tmpfs, shm segments, shared anonymous mappings).
    pub(crate) shmem: u64,
    /// Page cache mapped into the processes.
    pub(crate) file_mapped: u64,
    /// Page cache the kernel considers cold and reclaims first.
    pub(crate) inactive_file: u64,
    pub(crate) active_file: u64,
}

/// Parses `memory.stat` of either version.
pub(crate) fn parse_memory_stat(text: &str, version: Version) -> Result<MemStat, ParseError> {
    let mut s = MemStat::default();
    let mut seen = 0u32;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(' ') else {
            continue;
        };
        let key = match version {
            Version::V1 => match key.strip_prefix("total_") {
                Some(k) => k,
                None => continue,
            },
            Version::V2 => key,
        };
        let field = match (version, key) {
            (Version::V1, "rss") | (Version::V2, "anon") => &mut s.anon,
            (Version::V1, "cache") | (Version::V2, "file") => &mut s.file,
            (_, "shmem") => &mut s.shmem,
            (Version::V1, "mapped_file") | (Version::V2, "file_mapped") => &mut s.file_mapped,
            (_, "inactive_file") => &mut s.inactive_file,
            (_, "active_file") => &mut s.active_file,
            _ => continue,
        };
        *field = value.trim().parse().map_err(|_| ParseError {
            file: "memory.stat",
            what: format!("{key} is not a number"),
        })?;
        seen += 1;
    }
    if seen == 0 {
        return Err(ParseError {
            file: "memory.stat",
            what: "none of anon/file/inactive_file present".into(),
        });
    }
    Ok(s)
}

/// Parses a one-number cgroup file (`memory.current`, `memory.peak`,
/// `memory.usage_in_bytes`, …).
pub(crate) fn parse_bytes(file: &'static str, text: &str) -> Result<u64, ParseError> {
    text.trim().parse().map_err(|_| ParseError {
        file,
        what: format!("`{}` is not a number", text.trim().escape_debug()),
    })
}

/// The `oom_kill` counter of `memory.events` (v2) or `memory.oom_control`
/// (v1); older kernels have none.
pub(crate) fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

/// PIDs listed in a `cgroup.procs` file.
pub(crate) fn parse_procs(text: &str) -> Vec<u32> {
    text.split_ascii_whitespace()
        .filter_map(|t| t.parse().ok())
        .collect()
}

/// One reading of a cgroup (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct CgroupReading {
    /// Everything charged, page cache included.
    pub(crate) usage: u64,
    /// The highest charge the kernel saw since the previous reading, when
    /// it can tell (a peak that could be reset, or a new all-time peak).
    pub(crate) interval_peak: Option<u64>,
    /// The kernel's all-time peak of the charge.
    pub(crate) kernel_peak: Option<u64>,
    pub(crate) stat: MemStat,
    pub(crate) oom_kills: Option<u64>,
}

impl CgroupReading {
    /// What the job needs: the charge less cold page cache.
    pub(crate) fn working_set(&self) -> u64 {
        self.usage.saturating_sub(self.stat.inactive_file)
    }

    /// The interval's peak of the working set, assuming the cold cache did
    /// not change within the interval (it is what the kernel reclaims
    /// first, so a spike shrinks it rather than grows it).
    pub(crate) fn interval_peak_working_set(&self) -> Option<u64> {
        self.interval_peak.map(|p| {
            p.saturating_sub(self.stat.inactive_file)
                .max(self.working_set())
        })
    }
}

/// Why a cgroup could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{0}")]
    Unavailable(String),
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Parse(#[from] ParseError),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// An open memory cgroup.
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
    version: Version,
    /// memtrack made it (and removes it at the end).
    created: bool,
    usage: File,
    stat: File,
    /// Opened read-write where the peak can be reset.
    peak: Option<File>,
    resettable: bool,
    events: Option<File>,
    last_peak: u64,
    buf: Vec<u8>,
}

impl Cgroup {
    /// Opens the memory files of an existing cgroup directory.
    pub(crate) fn open(dir: &Path, version: Version) -> Result<Cgroup, CgroupError> {
        Cgroup::open_as(dir, version, false)
    }

    fn open_as(dir: &Path, version: Version, created: bool) -> Result<Cgroup, CgroupError> {
        let (usage, peak, events) = match version {
            Version::V1 => (
                "memory.usage_in_bytes",
                "memory.max_usage_in_bytes",
                "memory.oom_control",
            ),
            Version::V2 => ("memory.current", "memory.peak", "memory.events"),
        };
        let open = |name: &str| {
            let path = dir.join(name);
            File::open(&path).map_err(io_err("open", &path))
        };
        let usage = open(usage)?;
        let stat = open("memory.stat")?;
        // A peak we can reset gives each interval its own peak: v1's when
        // memtrack owns the cgroup (a reset there is global), v2's always
        // (since Linux 6.12 a write resets it for this descriptor only).
        let peak_path = dir.join(peak);
        let want_write = version == Version::V2 || created;
        let peak_file = OpenOptions::new()
            .read(true)
            .write(want_write)
            .open(&peak_path)
            .or_else(|_| File::open(&peak_path))
            .ok();
        let events = File::open(dir.join(events)).ok();
        let mut cg = Cgroup {
            dir: dir.to_path_buf(),
            version,
            created,
            usage,
            stat,
            peak: peak_file,
            resettable: want_write,
            events,
            last_peak: 0,
            buf: Vec::with_capacity(4096),
        };
        // Check that it reads, and start the first interval.
        cg.read()?;
        Ok(cg)
    }

    /// Creates `dir` (a child of memtrack's own v1 memory cgroup) for the
    /// job. The job joins it before it executes (see
    /// [`crate::sys::join_cgroup_before_exec`]), so every page it touches is
    /// charged there.
    pub(crate) fn create_v1(dir: &Path) -> Result<Cgroup, CgroupError> {
        std::fs::create_dir(dir).map_err(io_err("create", dir))?;
        match Cgroup::open_as(dir, Version::V1, true) {
            Ok(cg) => Ok(cg),
            Err(e) => {
                let _ = std::fs::remove_dir(dir);
                Err(e)
            }
        }
    }

    /// Caps the cgroup's memory at `bytes` (`run --memory-limit`): v1's
    /// `memory.limit_in_bytes`, v2's `memory.max`; swap is capped at the
    /// same figure where the kernel accounts it (v1 `memory.memsw`, v2
    /// `memory.swap.max` = 0), so the job meets the limit as a node of that
    /// size without swap would, and the kernel's OOM killer acts at it.
    pub(crate) fn set_limit(&self, bytes: u64) -> Result<(), CgroupError> {
        let (limit, swap, swap_value) = match self.version {
            Version::V1 => (
                "memory.limit_in_bytes",
                "memory.memsw.limit_in_bytes",
                bytes,
            ),
            Version::V2 => ("memory.max", "memory.swap.max", 0),
        };
        let write = |name: &str, value: u64| {
            let path = self.dir.join(name);
            OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|mut f| f.write_all(value.to_string().as_bytes()))
                .map_err(io_err("write", &path))
        };
        write(limit, bytes)?;
        if self.dir.join(swap).exists() {
            write(swap, swap_value)?;
        }
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn version(&self) -> Version {
        self.version
    }

    /// The `cgroup.procs` file a process joins the cgroup through.
    pub(crate) fn procs_path(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn pread(file: &File, buf: &mut Vec<u8>) -> io::Result<usize> {
        buf.clear();
        buf.resize(8192, 0);
        let n = file.read_at(buf, 0)?;
        Ok(n)
    }

    /// Reads the charge, its breakdown, the peak and the OOM-kill count.
    pub(crate) fn read(&mut self) -> Result<CgroupReading, CgroupError> {
        let mut buf = std::mem::take(&mut self.buf);
        let result = self.read_with(&mut buf);
        self.buf = buf;
        result
    }

    fn read_with(&mut self, buf: &mut Vec<u8>) -> Result<CgroupReading, CgroupError> {
        let text = |buf: &Vec<u8>, n: usize| String::from_utf8_lossy(&buf[..n]).into_owned();
        let n = Self::pread(&self.usage, buf).map_err(io_err("read", &self.dir))?;
        let usage = parse_bytes("memory usage", &text(buf, n))?;
        let n = Self::pread(&self.stat, buf).map_err(io_err("read", &self.dir))?;
        let stat = parse_memory_stat(&text(buf, n), self.version)?;
        let mut kernel_peak = None;
        let mut interval_peak = None;
        if let Some(f) = &self.peak {
            if let Ok(n) = Self::pread(f, buf) {
                if let Ok(p) = parse_bytes("memory peak", &text(buf, n)) {
                    let p = p.max(usage);
                    if self.resettable {
                        interval_peak = Some(p);
                        // v1: "0" resets to the current usage; v2: any
                        // write. Failure (a kernel before 6.12) falls
                        // back to new all-time peaks below.
                        let mut f: &File = f;
                        if f.write_all(b"0\n").is_err() {
                            self.resettable = false;
                        }
                    } else if p > self.last_peak {
                        interval_peak = Some(p);
                    }
                    self.last_peak = self.last_peak.max(p);
                    kernel_peak = Some(self.last_peak);
                }
            }
        }
        let oom_kills = self.events.as_ref().and_then(|f| {
            let n = Self::pread(f, buf).ok()?;
            parse_oom_kills(&text(buf, n))
        });
        Ok(CgroupReading {
            usage,
            interval_peak,
            kernel_peak,
            stat,
            oom_kills,
        })
    }

    /// Every PID in the cgroup and the cgroups below it.
    pub(crate) fn procs(&self) -> io::Result<Vec<u32>> {
        let mut pids = Vec::new();
        collect_procs(&self.dir, &mut pids)?;
        Ok(pids)
    }

    /// Removes a cgroup memtrack created: processes still in it (workers
    /// that outlived the job) move back to the parent first. Removal of a
    /// cgroup that was not created by memtrack does nothing.
    pub fn remove(self) -> Result<(), CgroupError> {
        if !self.created {
            return Ok(());
        }
        let dir = self.dir.clone();
        drop(self);
        remove_created(&dir)
    }
}

/// The most cgroup folders walked below one cgroup: a job may nest its
/// own cgroups as deep and as wide as it likes.
const MAX_CGROUPS: usize = 10_000;

/// Every folder of the cgroup tree at `dir`, each parent before its
/// children (breadth first, without recursion: any depth, at most
/// [`MAX_CGROUPS`] folders).
fn subtree(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut next = 0;
    while next < out.len() && out.len() < MAX_CGROUPS {
        if let Ok(entries) = std::fs::read_dir(&out[next]) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) && out.len() < MAX_CGROUPS {
                    out.push(entry.path());
                }
            }
        }
        next += 1;
    }
    out
}

fn collect_procs(dir: &Path, out: &mut Vec<u32>) -> io::Result<()> {
    let text = std::fs::read_to_string(dir.join("cgroup.procs"))?;
    out.extend(parse_procs(&text));
    for below in subtree(dir).iter().skip(1) {
        if let Ok(text) = std::fs::read_to_string(below.join("cgroup.procs")) {
            out.extend(parse_procs(&text));
        }
    }
    Ok(())
}

/// Moves what is left in `dir` and the cgroups a job made inside it to
/// `dir`'s parent and removes them all, deepest first (a cgroup with
/// children is busy, EBUSY, until they are gone), however deep they nest.
pub(crate) fn remove_created(dir: &Path) -> Result<(), CgroupError> {
    let parent_procs = dir
        .parent()
        .map(|p| p.join("cgroup.procs"))
        .ok_or_else(|| CgroupError::Unavailable(format!("{} has no parent", dir.display())))?;
    // Breadth-first order reversed: every child before its parent.
    for cgroup in subtree(dir).iter().rev() {
        remove_one(cgroup, &parent_procs)?;
    }
    Ok(())
}

/// How often removing one cgroup is tried while it is busy (an exiting
/// task still charged to it), 20 ms apart.
const REMOVE_TRIES: u32 = 50;

fn remove_one(dir: &Path, parent_procs: &Path) -> Result<(), CgroupError> {
    for attempt in 0..REMOVE_TRIES {
        if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in parse_procs(&text) {
                // One PID per write, as the kernel requires.
                let _ = OpenOptions::new()
                    .write(true)
                    .open(parent_procs)
                    .and_then(|mut f| f.write_all(format!("{pid}\n").as_bytes()));
            }
        }
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if attempt + 1 < REMOVE_TRIES && e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(source) => {
                return Err(CgroupError::Io {
                    what: "remove",
                    path: dir.to_path_buf(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// Prefix of the cgroups memtrack creates:
/// `memtrack-<pid>-t<start>-n<pid namespace>-<run id>` (older versions:
/// `memtrack-<pid>-<run id>`).
pub(crate) const CREATED_PREFIX: &str = "memtrack-";

/// The memtrack that created a cgroup, as its name records it: its PID
/// and, from this version on, its start time (clock ticks after boot,
/// `stat` field 22) and the inode of its PID namespace. PID and namespace
/// together name one process even where PIDs repeat (every container's
/// memtrack is PID 1); the start time tells a reused PID apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Creator {
    pid: u32,
    start: Option<u64>,
    pid_ns: Option<u64>,
}

impl Creator {
    /// This process, read through `proc_root`.
    pub(crate) fn this_process(proc_root: &Path) -> Creator {
        let start = std::fs::read_to_string(proc_root.join("self/stat"))
            .ok()
            .and_then(|t| super::parse::parse_stat(&t).ok())
            .map(|s| s.start_ticks);
        Creator {
            pid: std::process::id(),
            start,
            pid_ns: pid_ns_of(proc_root, "self"),
        }
    }

    /// The name of a cgroup this process creates for run `run_id`.
    pub(crate) fn cgroup_name(&self, run_id: &str) -> String {
        let id: String = run_id
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .take(32)
            .collect();
        match (self.start, self.pid_ns) {
            (Some(start), Some(ns)) => {
                format!("{CREATED_PREFIX}{}-t{start}-n{ns}-{id}", self.pid)
            }
            _ => format!("{CREATED_PREFIX}{}-{id}", self.pid),
        }
    }

    /// The creator a cgroup's name records.
    fn of_name(name: &str) -> Option<Creator> {
        let mut parts = name.strip_prefix(CREATED_PREFIX)?.split('-');
        let pid = parts.next()?.parse().ok()?;
        let number = |part: Option<&str>, tag: char| {
            part.and_then(|p| p.strip_prefix(tag))
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse::<u64>().ok())
        };
        let start = number(parts.next(), 't');
        let pid_ns = start.and_then(|_| number(parts.next(), 'n'));
        Some(match pid_ns {
            Some(_) => Creator { pid, start, pid_ns },
            None => Creator {
                pid,
                start: None,
                pid_ns: None,
            },
        })
    }
}

/// The inode of `<proc_root>/<pid>/ns/pid`.
fn pid_ns_of(proc_root: &Path, pid: &str) -> Option<u64> {
    let link = std::fs::read_link(proc_root.join(pid).join("ns/pid")).ok()?;
    super::pidns::ns_inode(&link.to_string_lossy())
}

/// Which creators are alive, asked of the procfs at `proc_root`.
struct Living<'a> {
    proc_root: &'a Path,
    own_ns: Option<u64>,
    /// Every process this procfs shows, read once when a creator of
    /// another namespace is asked about.
    seen: Option<Seen>,
}

/// The live processes a procfs shows: (PID namespace, PID in it, start)
/// of each, and (PID in its namespace, start) of those whose namespace
/// link cannot be read (another user's, or one the kernel hides).
#[derive(Default)]
struct Seen {
    known: std::collections::HashSet<(u64, u32, u64)>,
    unsure: std::collections::HashSet<(u32, u64)>,
}

impl<'a> Living<'a> {
    fn new(proc_root: &'a Path) -> Living<'a> {
        Living {
            proc_root,
            own_ns: pid_ns_of(proc_root, "self"),
            seen: None,
        }
    }

    /// Whether `c` may still be running (unsure is alive: a live run's
    /// cgroup is never taken for stale).
    fn alive(&mut self, c: Creator) -> bool {
        let (Some(start), Some(ns)) = (c.start, c.pid_ns) else {
            return self.alive_by_pid(c.pid);
        };
        if self.own_ns == Some(ns) {
            return self.started_at(c.pid) == Some(start);
        }
        let proc_root = self.proc_root;
        let seen = self.seen.get_or_insert_with(|| every_process(proc_root));
        if seen.known.contains(&(ns, c.pid, start)) || seen.unsure.contains(&(c.pid, start)) {
            return true;
        }
        // Only the host's procfs shows every process: from inside a PID
        // namespace, one of a sibling namespace is out of sight, alive or
        // not.
        self.own_ns != Some(super::pidns::INIT_PID_NS_INODE)
    }

    /// An older name (no start, no namespace): alive while its PID is.
    /// PID 1 is the exception: on the host it is init, and inside a PID
    /// namespace it is memtrack itself, whose own cgroup has a name of this
    /// version; either way not the memtrack that made the cgroup.
    fn alive_by_pid(&self, pid: u32) -> bool {
        pid != 1 && crate::sys::pid_exists(pid)
    }

    fn started_at(&self, pid: u32) -> Option<u64> {
        let text =
            std::fs::read_to_string(self.proc_root.join(pid.to_string()).join("stat")).ok()?;
        let stat = super::parse::parse_stat(&text).ok()?;
        (stat.state != 'Z' && stat.state != 'X').then_some(stat.start_ticks)
    }
}

/// Every live process `proc_root` shows, as [`Seen`] records them.
fn every_process(proc_root: &Path) -> Seen {
    let mut seen = Seen::default();
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return seen;
    };
    for entry in entries.flatten() {
        let numeric = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()));
        if !numeric {
            continue;
        }
        let dir = entry.path();
        // The PID in its own namespace (the last of `NSpid`) and the start.
        let inner = std::fs::read_to_string(dir.join("status"))
            .ok()
            .and_then(|s| super::pidns::nspid(&s))
            .and_then(|chain| chain.last().copied());
        let start = std::fs::read_to_string(dir.join("stat"))
            .ok()
            .and_then(|t| super::parse::parse_stat(&t).ok())
            .filter(|s| s.state != 'Z' && s.state != 'X')
            .map(|s| s.start_ticks);
        let (Some(inner), Some(start)) = (inner, start) else {
            continue;
        };
        match std::fs::read_link(dir.join("ns/pid")) {
            Ok(link) => match super::pidns::ns_inode(&link.to_string_lossy()) {
                Some(ns) => {
                    seen.known.insert((ns, inner, start));
                }
                None => {
                    seen.unsure.insert((inner, start));
                }
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(_) => {
                seen.unsure.insert((inner, start));
            }
        }
    }
    seen
}

/// Removes cgroups that a memtrack killed before its cleanup left under
/// `parent`: their creator is gone (exactly: the same PID in the same PID
/// namespace with the same start time, asked of the procfs at
/// `proc_root`) and no process is left in them or below them.
pub(crate) fn remove_stale(parent: &Path, proc_root: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return 0;
    };
    let mut living = Living::new(proc_root);
    let mut removed = 0;
    for entry in entries.flatten() {
        let Some(creator) = entry.file_name().to_str().and_then(Creator::of_name) else {
            continue;
        };
        if living.alive(creator) {
            continue;
        }
        let path = entry.path();
        // Empty all the way down: a job's own child cgroups included.
        let mut procs = Vec::new();
        let empty = collect_procs(&path, &mut procs).is_ok() && procs.is_empty();
        if empty && remove_created(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Where cgroups are found: the mounts and a process's membership.
#[derive(Debug, Clone)]
pub(crate) struct Hierarchies {
    pub(crate) mounts: Vec<Mount>,
}

impl Hierarchies {
    /// Reads `<proc_root>/self/mountinfo`.
    pub(crate) fn read(proc_root: &Path) -> Hierarchies {
        let mounts = std::fs::read_to_string(proc_root.join("self/mountinfo"))
            .map(|t| parse_mountinfo(&t))
            .unwrap_or_default();
        Hierarchies { mounts }
    }

    /// The memory cgroup directory of a process: v2 when the unified
    /// hierarchy has the memory controller there, else v1's.
    pub(crate) fn memory_cgroup_of(
        &self,
        proc_root: &Path,
        pid: &str,
    ) -> Option<(PathBuf, Version)> {
        let text = std::fs::read_to_string(proc_root.join(pid).join("cgroup")).ok()?;
        let m = parse_proc_cgroup(&text);
        if let (Some(path), Some(mount)) =
            (&m.v2, self.mounts.iter().find(|x| x.version == Version::V2))
        {
            if let Some(dir) = cgroup_dir(mount, path) {
                if dir.join("memory.stat").exists() {
                    return Some((dir, Version::V2));
                }
            }
        }
        let path = m.v1_memory?;
        let mount = self.mounts.iter().find(|x| x.version == Version::V1)?;
        let dir = cgroup_dir(mount, &path)?;
        dir.join("memory.stat")
            .exists()
            .then_some((dir, Version::V1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recorded on a cgroup v2 host (Linux 6.x), trimmed.
    const V2_STAT: &str = "anon 566231040\nfile 21889024\nkernel 4579328\nkernel_stack 81920\npagetables 1343488\nsec_pagetables 0\npercpu 0\nsock 0\nvmalloc 0\nshmem 1048576\nzswap 0\nzswapped 0\nfile_mapped 13058048\nfile_dirty 0\nfile_writeback 0\nswapcached 0\nanon_thp 0\nfile_thp 0\nshmem_thp 0\ninactive_anon 567279616\nactive_anon 0\ninactive_file 15966208\nactive_file 4874240\nunevictable 0\nslab_reclaimable 1146880\nslab_unreclaimable 672256\nslab 1819136\nworkingset_refault_anon 0\npgfault 146012\n";
    const V2_EVENTS: &str = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n";

    /// Recorded on a cgroup v1 host (Linux 6.18), trimmed.
    const V1_STAT: &str = "cache 4096\nrss 1000\nshmem 0\nmapped_file 0\ninactive_file 4096\nactive_file 0\nhierarchical_memory_limit 9223372036854771712\ntotal_cache 20971520\ntotal_rss 524288000\ntotal_rss_huge 0\ntotal_shmem 0\ntotal_mapped_file 8388608\ntotal_dirty 0\ntotal_inactive_anon 0\ntotal_active_anon 524288000\ntotal_inactive_file 16777216\ntotal_active_file 4194304\ntotal_unevictable 0\n";
    const V1_OOM: &str = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n";

    #[test]
    fn v2_stat_and_events() {
        let s = parse_memory_stat(V2_STAT, Version::V2).unwrap();
        assert_eq!(s.anon, 566231040);
        assert_eq!(s.file, 21889024);
        assert_eq!(s.shmem, 1048576);
        assert_eq!(s.file_mapped, 13058048);
        assert_eq!(s.inactive_file, 15966208);
        assert_eq!(s.active_file, 4874240);
        assert_eq!(parse_oom_kills(V2_EVENTS), Some(1));
    }

    #[test]
    fn v1_stat_uses_the_hierarchical_totals() {
        let s = parse_memory_stat(V1_STAT, Version::V1).unwrap();
        assert_eq!(s.anon, 500 << 20);
        assert_eq!(s.file, 20 << 20);
        assert_eq!(s.file_mapped, 8 << 20);
        assert_eq!(s.inactive_file, 16 << 20);
        assert_eq!(parse_oom_kills(V1_OOM), Some(2));
        assert_eq!(parse_oom_kills("under_oom 0\n"), None);
    }

    #[test]
    fn stat_rejects_garbage() {
        assert!(parse_memory_stat("", Version::V2).is_err());
        assert!(parse_memory_stat("anon lots\n", Version::V2).is_err());
        assert!(
            parse_memory_stat("rss 5\n", Version::V1).is_err(),
            "no totals"
        );
        assert!(parse_bytes("memory.current", "max\n").is_err());
        assert_eq!(parse_bytes("memory.current", "4096\n").unwrap(), 4096);
    }

    #[test]
    fn working_set_leaves_out_cold_cache() {
        let r = CgroupReading {
            usage: 600 << 20,
            interval_peak: Some(900 << 20),
            kernel_peak: Some(900 << 20),
            stat: MemStat {
                inactive_file: 100 << 20,
                ..MemStat::default()
            },
            oom_kills: None,
        };
        assert_eq!(r.working_set(), 500 << 20);
        assert_eq!(r.interval_peak_working_set(), Some(800 << 20));
        let cold = CgroupReading {
            usage: 10,
            stat: MemStat {
                inactive_file: 20,
                ..MemStat::default()
            },
            ..r
        };
        assert_eq!(cold.working_set(), 0);
    }

    #[test]
    fn proc_cgroup_of_both_hierarchies() {
        let text = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/user.slice/x.scope\n";
        let m = parse_proc_cgroup(text);
        assert_eq!(m.v1_memory.as_deref(), Some("/process_api/abc"));
        assert_eq!(m.v2.as_deref(), Some("/user.slice/x.scope"));
        let only_v2 = parse_proc_cgroup("0::/system.slice/job.service\n");
        assert_eq!(only_v2.v1_memory, None);
        assert_eq!(parse_proc_cgroup("garbage\n\n::\n"), Membership::default());
    }

    #[test]
    fn mountinfo_finds_cgroup_mounts() {
        let text = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                    32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
                    41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n\
                    50 31 0:40 /kubepods/pod1 /sys/fs/cgroup\\040x rw shared:5 - cgroup2 cgroup2 rw\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].version, Version::V1);
        assert_eq!(m[0].mount_point, PathBuf::from("/sys/fs/cgroup/memory"));
        assert_eq!(m[1].version, Version::V2);
        assert_eq!(m[2].root, "/kubepods/pod1");
        assert_eq!(m[2].mount_point, PathBuf::from("/sys/fs/cgroup x"));
        assert_eq!(
            cgroup_dir(&m[2], "/kubepods/pod1/c1"),
            Some(PathBuf::from("/sys/fs/cgroup x/c1"))
        );
        assert_eq!(cgroup_dir(&m[2], "/kubepods/pod10"), None);
        assert_eq!(cgroup_dir(&m[2], "/elsewhere"), None);
        assert_eq!(cgroup_dir(&m[0], "/a/../../etc"), None);
        assert_eq!(
            cgroup_dir(&m[0], "/"),
            Some(PathBuf::from("/sys/fs/cgroup/memory"))
        );
    }

    fn fake_cgroup(dir: &Path, version: Version) {
        std::fs::create_dir_all(dir).unwrap();
        match version {
            Version::V2 => {
                std::fs::write(dir.join("memory.current"), "614400000\n").unwrap();
                std::fs::write(dir.join("memory.peak"), "900000000\n").unwrap();
                std::fs::write(dir.join("memory.stat"), V2_STAT).unwrap();
                std::fs::write(dir.join("memory.events"), V2_EVENTS).unwrap();
            }
            Version::V1 => {
                std::fs::write(dir.join("memory.usage_in_bytes"), "545259520\n").unwrap();
                std::fs::write(dir.join("memory.max_usage_in_bytes"), "600000000\n").unwrap();
                std::fs::write(dir.join("memory.stat"), V1_STAT).unwrap();
                std::fs::write(dir.join("memory.oom_control"), V1_OOM).unwrap();
            }
        }
        std::fs::write(dir.join("cgroup.procs"), "12\n13\n").unwrap();
    }

    #[test]
    fn a_limit_caps_memory_and_swap_in_each_hierarchy() {
        let tmp = tempfile::tempdir().unwrap();
        let v1 = tmp.path().join("v1");
        fake_cgroup(&v1, Version::V1);
        std::fs::write(v1.join("memory.limit_in_bytes"), "").unwrap();
        std::fs::write(v1.join("memory.memsw.limit_in_bytes"), "").unwrap();
        Cgroup::open(&v1, Version::V1)
            .unwrap()
            .set_limit(2 << 30)
            .unwrap();
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        assert_eq!(read(v1.join("memory.limit_in_bytes")), "2147483648");
        assert_eq!(read(v1.join("memory.memsw.limit_in_bytes")), "2147483648");
        let v2 = tmp.path().join("v2");
        fake_cgroup(&v2, Version::V2);
        std::fs::write(v2.join("memory.max"), "").unwrap();
        Cgroup::open(&v2, Version::V2)
            .unwrap()
            .set_limit(1 << 30)
            .unwrap();
        assert_eq!(read(v2.join("memory.max")), "1073741824");
        assert!(
            !v2.join("memory.swap.max").exists(),
            "no swap file, none made"
        );
        // A cgroup whose limit file cannot be written is a clear error.
        let gone = tmp.path().join("gone");
        fake_cgroup(&gone, Version::V1);
        let cg = Cgroup::open(&gone, Version::V1).unwrap();
        let e = cg.set_limit(1 << 30).unwrap_err().to_string();
        assert!(e.contains("memory.limit_in_bytes"), "{e}");
    }

    #[test]
    fn reads_recorded_v2_files() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("job.scope");
        fake_cgroup(&dir, Version::V2);
        std::fs::create_dir(dir.join("child")).unwrap();
        std::fs::write(dir.join("child/cgroup.procs"), "14\n").unwrap();
        let mut cg = Cgroup::open(&dir, Version::V2).unwrap();
        // v2's peak is reset after each read (on cgroupfs a write leaves
        // the file's text alone; here it does not, so write it again).
        std::fs::write(dir.join("memory.peak"), "900000000\n").unwrap();
        let r = cg.read().unwrap();
        assert_eq!(r.interval_peak, Some(900000000));
        assert_eq!(r.usage, 614400000);
        assert_eq!(r.working_set(), 614400000 - 15966208);
        assert_eq!(r.kernel_peak, Some(900000000));
        assert_eq!(r.oom_kills, Some(1));
        let mut procs = cg.procs().unwrap();
        procs.sort_unstable();
        assert_eq!(procs, vec![12, 13, 14]);
        // Not created by memtrack: removal leaves it alone.
        cg.remove().unwrap();
        assert!(dir.exists());
    }

    #[test]
    fn reads_recorded_v1_files_and_a_new_peak_only_once() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("job");
        fake_cgroup(&dir, Version::V1);
        let mut cg = Cgroup::open(&dir, Version::V1).unwrap();
        // open() took the first reading: the same peak is not new again.
        let r = cg.read().unwrap();
        assert_eq!(r.usage, 545259520);
        assert_eq!(r.stat.anon, 500 << 20);
        assert_eq!(r.interval_peak, None);
        assert_eq!(r.kernel_peak, Some(600000000));
        assert_eq!(r.oom_kills, Some(2));
        std::fs::write(dir.join("memory.max_usage_in_bytes"), "700000000\n").unwrap();
        assert_eq!(cg.read().unwrap().interval_peak, Some(700000000));
    }

    #[test]
    fn missing_files_are_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let err = Cgroup::open(tmp.path(), Version::V2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("memory.current"), "{err}");
    }

    #[test]
    fn creators_of_created_cgroups() {
        let of = Creator::of_name;
        let c = |pid, start, pid_ns| Some(Creator { pid, start, pid_ns });
        assert_eq!(
            of("memtrack-1-t4567-n4026532999-abc"),
            c(1, Some(4567), Some(4026532999))
        );
        assert_eq!(of("memtrack-123-abc"), c(123, None, None));
        assert_eq!(of("memtrack-9"), c(9, None, None));
        assert_eq!(
            of("memtrack-9-t12-abc"),
            c(9, None, None),
            "both or neither"
        );
        assert_eq!(of("memtrack-x-1"), None);
        assert_eq!(of("other-1-2"), None);
        assert_eq!(of("memtrack--"), None);
        let me = Creator {
            pid: 7,
            start: Some(99),
            pid_ns: Some(5),
        };
        assert_eq!(of(&me.cgroup_name("ab-CD/12")), Some(me));
        assert_eq!(me.cgroup_name("ab-CD/12"), "memtrack-7-t99-n5-abCD12");
    }

    #[test]
    fn only_a_creator_that_is_gone_is_stale() {
        let proc_root = Path::new("/proc");
        let mut living = Living::new(proc_root);
        let me = Creator::this_process(proc_root);
        assert!(me.start.is_some() && me.pid_ns.is_some(), "{me:?}");
        assert!(living.alive(me));
        // Another start time: the PID was reused.
        let reused = Creator {
            start: me.start.map(|s| s + 1),
            ..me
        };
        assert!(!living.alive(reused));
        // PID 1 of a namespace that is gone: stale, seen from the host.
        let gone = Creator {
            pid: 1,
            start: Some(1),
            pid_ns: Some(1),
        };
        let on_host = living.own_ns == Some(super::super::pidns::INIT_PID_NS_INODE);
        assert_eq!(living.alive(gone), !on_host);
        // An older name of PID 1: never this memtrack.
        assert!(!living.alive(Creator {
            pid: 1,
            start: None,
            pid_ns: None
        }));
    }

    #[test]
    fn a_tree_is_listed_parents_first_at_any_depth() {
        let tmp = tempfile::tempdir().unwrap();
        let mut deep = tmp.path().to_path_buf();
        for _ in 0..40 {
            deep.push("a");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::create_dir(tmp.path().join("b")).unwrap();
        let tree = subtree(tmp.path());
        assert_eq!(tree.len(), 42);
        assert_eq!(tree.last().unwrap(), &deep);
        for (i, d) in tree.iter().enumerate() {
            if let Some(parent) = d.parent().filter(|_| i > 0) {
                let at = tree.iter().position(|x| x == parent).unwrap();
                assert!(at < i, "{} before {}", parent.display(), d.display());
            }
        }
    }
}
