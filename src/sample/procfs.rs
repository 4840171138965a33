//! Host memory of a process tree, read straight from procfs.
//!
//! The per-tick path is as close to the floor as procfs allows (measured by
//! `benches/tick.rs`): one `pread` of a kept-open `/proc/PID/statm` per
//! process. A kept-open procfs file is bound to the process, not to the
//! number: once the process is gone the read fails with `ESRCH`, so a
//! reused PID can never be mistaken for the old process.
//!
//! New processes are found without listing `/proc` every tick: the last
//! PID the kernel handed out (`/proc/loadavg`, fifth field) tells whether
//! anything was created since the last tick, and PIDs are allocated
//! cyclically, so the new ones lie in the interval between the two values.
//! Only those are probed. A full scan runs at start, when that interval is
//! large, and every few seconds as a safety net.
//!
//! `VmHWM` (the kernel's high-water mark) lives in `/proc/PID/status`,
//! which costs many `statm` reads (`cargo bench --bench tick`: the
//! `sample + VmHWM read` column against `memtrack sample`); it is a running
//! maximum, so it is refreshed at `hwm_interval` rather than every tick
//! without losing anything while the process lives. An exec usually shows
//! there too, as a new `Name`, and has `/proc/PID/cmdline` read at once;
//! every `EXEC_CHECK_EVERY` it is read anyway (an exec of the same program
//! keeps the name). Both files are kept open beside `statm` while
//! descriptors allow (a `pread` of a kept file costs about half of an
//! open, read and close); a process that joins once the members hold half
//! the descriptors memtrack allows itself has them opened by path for each
//! read instead, so they never crowd out a `statm`.
//!
//! Parsers are pure functions over `&str`; the reader takes the procfs root
//! as an argument so tests can run against a fake tree.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::cost::{CostOptions, CostReader, View};
use super::host::{Described, HostProcessReading, HostSample, Identity, Joined, Left};
use super::parse::{
    parse_btime, parse_cmdline, parse_loadavg_last_pid, parse_stat, parse_statm, parse_statm_anon,
    parse_status, ParseError, Stat,
};
use crate::model::Exit;
use crate::sys;

/// Why a root could not be followed.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    #[error("no process with PID {0}")]
    NoSuchProcess(u32),
    #[error("cannot read {path}: {source} (memtrack needs to read the target's /proc entries; run as the same user or with CAP_SYS_PTRACE)")]
    Unreadable { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Parse(#[from] ParseError),
}

/// Options of the procfs reader.
#[derive(Debug, Clone)]
pub struct ProcOptions {
    pub root: PathBuf,
    pub hwm_interval: Duration,
    /// `Some(our pid)` when we are the subreaper of the tree (run mode):
    /// orphans re-parented to us belong to the tree and are ours to reap.
    pub reaper: Option<u32>,
    /// The job `run` spawned: its own waiter thread reaps it, never us.
    pub job: Option<u32>,
    pub smaps: Option<SmapsOptions>,
    /// Share of one core the reads off the sampling thread may take.
    pub read_share: f64,
}

/// Each process's own cost (PSS/USS), read off the sampling thread.
#[derive(Debug, Clone, Copy)]
pub struct SmapsOptions {
    /// A process is read again at most this often.
    pub interval: Duration,
    /// Processes above this RSS are not read.
    pub max_rss: u64,
}

struct Member {
    id: Identity,
    /// Kept open while descriptors last; `None`: read by path (and the
    /// start time checked, so a reused PID is not taken for this one).
    statm: Option<File>,
    /// `status` (`VmHWM`, read once per `hwm_interval`) and `cmdline` (the
    /// exec check): kept open beside `statm` while descriptors allow (see
    /// [`ProcTree::keeps_slow_files`]), else opened by path for each read.
    /// A `pread` of a kept file costs about half an open, read and close.
    status: Option<File>,
    cmdline: Option<File>,
    rss: u64,
    hwm: u64,
    hwm_read_at: Option<Instant>,
    /// This sample's rise of `VmHWM` above what was known.
    hwm_rise: u64,
    /// Anonymous resident bytes (RSS less file and shared memory).
    anon: u64,
    /// Forked without executing anything else from this followed process
    /// (its parent, or for an orphan re-parented to memtrack the process
    /// of the same command line that died), and that process's anonymous
    /// bytes when this one joined.
    fork_of: Option<(u32, u64)>,
    /// This sample's read succeeded (its figures are current).
    read_ok: bool,
    /// Samples left in which to retry an empty command line.
    describe_tries: u8,
    /// Hash of the command line last described: a change means the
    /// process exec'd (a shell wrapper, a pyenv shim) and is re-described.
    cmdline_hash: u64,
    /// When the command line was last read to look for an exec.
    cmdline_read_at: Instant,
    /// Hash of the `Name` its last `status` showed: an exec renames a
    /// process (unless it runs the same program again), so a change has
    /// the command line read at once.
    name_hash: Option<u64>,
}

impl Member {
    /// The descriptors this member holds.
    fn descriptors(&self) -> usize {
        [&self.statm, &self.status, &self.cmdline]
            .iter()
            .filter(|f| f.is_some())
            .count()
    }
}

/// How many samples an empty command line is retried: a process caught in
/// `execve` (a just-spawned job always is) shows none for a moment.
const DESCRIBE_TRIES: u8 = 10;

/// The command line of a process whose name has not changed is read for
/// an exec at most this often: an exec of the same program (a Python
/// wrapper that execs Python) keeps the name, and is described anew within
/// this time; any other exec at the next `VmHWM` read.
const EXEC_CHECK_EVERY: Duration = Duration::from_secs(10);

/// Safety-net full scan period.
const FULL_SCAN_EVERY: Duration = Duration::from_secs(10);
/// Above this many new PIDs in one interval, list `/proc` instead of probing.
const PROBE_LIMIT: u32 = 16;

/// The followed process tree and its kept-open procfs files.
pub struct ProcTree {
    opts: ProcOptions,
    page_size: u64,
    clock_ticks: u64,
    btime: u64,
    loadavg: Option<File>,
    pid_max: u32,
    last_pid: Option<u32>,
    last_full_scan: Option<Instant>,
    members: HashMap<u32, Member>,
    /// Roots added since the last sample, reported with the next one.
    pending: Vec<Joined>,
    roots: Vec<u32>,
    /// Scratch list of members found gone during a sample.
    departed: Vec<u32>,
    buf: Vec<u8>,
    /// Descriptors the members may hold: the descriptor limit less
    /// headroom for the reads, sockets and files memtrack opens besides.
    max_open: usize,
    /// Descriptors the members hold now.
    open_now: usize,
    /// Members that left with the last sample: (pid, command-line hash,
    /// anonymous bytes), for an orphan found a sample late.
    recently_left: Vec<(u32, u64, u64)>,
    /// Own cost and distinct pages, read on a thread of their own.
    cost: CostReader,
    views: Vec<View>,
}

impl std::fmt::Debug for ProcTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcTree")
            .field("root", &self.opts.root)
            .field("members", &self.members.len())
            .finish()
    }
}

impl ProcTree {
    /// Opens the procfs root. Fails only when it is not a procfs at all.
    pub fn new(opts: ProcOptions) -> io::Result<ProcTree> {
        let stat = std::fs::read_to_string(opts.root.join("stat"))?;
        let btime = parse_btime(&stat).map_err(io::Error::other)?;
        let loadavg = File::open(opts.root.join("loadavg")).ok();
        let pid_max = std::fs::read_to_string(opts.root.join("sys/kernel/pid_max"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4_194_304);
        let cost = CostReader::new(
            opts.root.clone(),
            CostOptions {
                own_interval: opts.smaps.map(|s| s.interval),
                max_rss: opts.smaps.map_or(0, |s| s.max_rss),
                share: opts.read_share,
            },
        );
        Ok(ProcTree {
            opts,
            cost,
            views: Vec::new(),
            page_size: sys::page_size(),
            clock_ticks: sys::clock_ticks(),
            btime,
            loadavg,
            pid_max,
            last_pid: None,
            last_full_scan: None,
            members: HashMap::new(),
            pending: Vec::new(),
            roots: Vec::new(),
            departed: Vec::new(),
            buf: Vec::with_capacity(4096),
            max_open: {
                let limit = sys::nofile_limit();
                limit.saturating_sub((limit / 2).min(256)) as usize
            },
            open_now: 0,
            recently_left: Vec::new(),
        })
    }

    /// The reads off the sampling thread: own cost and distinct pages.
    pub(crate) fn cost(&self) -> &CostReader {
        &self.cost
    }
    pub(crate) fn cost_mut(&mut self) -> &mut CostReader {
        &mut self.cost
    }

    /// The PIDs memtrack was asked to follow (not their descendants).
    pub(crate) fn roots(&self) -> &[u32] {
        &self.roots
    }

    /// The procfs root this tree reads.
    pub(crate) fn root(&self) -> &Path {
        &self.opts.root
    }

    /// The PIDs followed now.
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.members.keys().copied()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub(crate) fn contains(&self, pid: u32) -> bool {
        self.members.contains_key(&pid)
    }

    /// Follows `pid` and (from the next sample on) its descendants. The
    /// join is reported with the next sample.
    pub fn add_root(&mut self, pid: u32) -> Result<(), RootError> {
        if self.members.contains_key(&pid) {
            return Ok(());
        }
        let path = self.opts.root.join(pid.to_string()).join("stat");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(RootError::NoSuchProcess(pid))
            }
            Err(source) => return Err(RootError::Unreadable { path, source }),
        };
        let stat = parse_stat(&text)?;
        if stat.state == 'Z' || stat.state == 'X' {
            return Err(RootError::NoSuchProcess(pid));
        }
        let statm_path = self.opts.root.join(pid.to_string()).join("statm");
        let statm = File::open(&statm_path).map_err(|source| RootError::Unreadable {
            path: statm_path,
            source,
        })?;
        let mut out = HostSample::default();
        self.roots.push(pid);
        self.join(stat, Some(statm), true, &mut out);
        self.pending.append(&mut out.joined);
        // Existing descendants are found by the full scan this forces.
        self.last_full_scan = None;
        Ok(())
    }

    /// Takes one host sample: discovery, then one read per process.
    pub fn sample(&mut self, now: Instant, out: &mut HostSample) {
        out.joined.append(&mut self.pending);
        self.discover(now, out);
        let mut buf = std::mem::take(&mut self.buf);
        let mut departed = std::mem::take(&mut self.departed);
        for (&pid, m) in &mut self.members {
            match read_member(m, pid, now, &self.opts, self.page_size, &mut buf) {
                MemberRead::Ok => {}
                MemberRead::Gone => departed.push(pid),
                MemberRead::Error => out.errors += 1,
            }
        }
        self.buf = buf;
        self.views.clear();
        self.views.extend(
            self.members
                .iter()
                .filter(|(pid, m)| m.read_ok && !departed.contains(pid))
                .map(|(&pid, m)| View {
                    pid,
                    rss: m.rss,
                    anon: m.anon,
                    // A fork's pages are its parent's until it writes.
                    parent_anon: m
                        .fork_of
                        .map(|(parent, anon)| self.members.get(&parent).map_or(anon, |p| p.anon)),
                    parent: m.fork_of.map(|(parent, _)| parent),
                }),
        );
        self.cost.update(now, &self.views, &departed);
        for (&pid, m) in &self.members {
            if !m.read_ok {
                continue;
            }
            let own = self.cost.own(pid);
            out.processes.push(HostProcessReading {
                pid,
                rss: m.rss,
                hwm: m.hwm.max(m.rss),
                pss: own.and_then(|o| o.pss),
                uss: own.and_then(|o| o.uss),
                own_read: own.is_some_and(|o| o.fresh),
                own_estimated: own.is_some_and(|o| o.fresh && o.estimated),
                hwm_rise: m.hwm_rise,
            });
        }
        if self.members.values().any(|m| m.describe_tries > 0) {
            self.describe_late(out);
        }
        self.recently_left.clear();
        for &pid in &departed {
            if let Some(m) = self.members.get(&pid) {
                self.recently_left.push((pid, m.cmdline_hash, m.anon));
            }
            self.leave(pid, out);
        }
        departed.clear();
        self.departed = departed;
    }

    /// The RSS of every followed process now: one `statm` read each, no
    /// discovery and no exit handling (the next sample deals with those).
    /// The flight recorder's fast path. A process whose `statm` reads zero
    /// is dying (a zombie, or its memory already torn down) and is left
    /// out, so a death never shows as a fall to 0 MiB of a live process.
    pub(crate) fn peek(&self, out: &mut Vec<(u32, u64)>) {
        out.clear();
        let mut buf = [0u8; 128];
        for (&pid, m) in &self.members {
            let Some(statm) = &m.statm else {
                // Followed by path: the next sample deals with it.
                if m.rss > 0 {
                    out.push((pid, m.rss));
                }
                continue;
            };
            if let Ok(n) = statm.read_at(&mut buf, 0) {
                if let Some(rss) = std::str::from_utf8(&buf[..n])
                    .ok()
                    .and_then(|t| parse_statm(t, self.page_size).ok())
                    .filter(|&rss| rss > 0)
                {
                    out.push((pid, rss));
                }
            }
        }
    }

    /// Reads `VmHWM` of every member now, whatever its age (final sample).
    pub(crate) fn refresh_hwm_all(&mut self) {
        for m in self.members.values_mut() {
            m.hwm_read_at = None;
        }
    }

    fn leave(&mut self, pid: u32, out: &mut HostSample) {
        let Some(m) = self.members.remove(&pid) else {
            return;
        };
        self.open_now -= m.descriptors();
        let mut left = Left {
            id: m.id,
            exit: None,
            max_rss: None,
        };
        // A zombie still shows its status; if it is ours to reap, reap it.
        let path = self.opts.root.join(pid.to_string()).join("stat");
        if let Ok(Ok(stat)) = read_small(&path, &mut self.buf).map(parse_stat) {
            if stat.start_ticks == m.id.start_ticks && stat.state == 'Z' {
                left.exit = stat.exit_code.map(Exit::from_wait_status);
                if Some(stat.ppid) == self.opts.reaper && Some(pid) != self.opts.job {
                    if let Ok(Some(r)) = sys::wait_child(pid, false) {
                        left.exit = Some(Exit::from_wait_status(r.status));
                        left.max_rss = Some(r.max_rss_kib * 1024);
                    }
                }
            }
        }
        out.left.push(left);
    }

    /// The command line (bounded) and the hash of its raw bytes, from the
    /// member's kept-open file when it has one.
    fn read_cmdline(&self, pid: u32) -> (Vec<String>, u64) {
        let kept = self.members.get(&pid).and_then(|m| m.cmdline.as_ref());
        self.read_cmdline_from(pid, kept)
    }

    fn read_cmdline_from(&self, pid: u32, kept: Option<&File>) -> (Vec<String>, u64) {
        let mut b = Vec::new();
        read_kept(kept, &self.opts.root, pid, "cmdline", &mut b)
            .map(|_| {
                let mut args = parse_cmdline(&b);
                args.truncate(64);
                for a in &mut args {
                    truncate_utf8(a, 512);
                }
                (args, hash_bytes(&b))
            })
            .unwrap_or_default()
    }

    /// Retries the command line of members that joined mid-`execve`.
    fn describe_late(&mut self, out: &mut HostSample) {
        let pending: Vec<u32> = self
            .members
            .iter()
            .filter(|(_, m)| m.describe_tries > 0)
            .map(|(&pid, _)| pid)
            .collect();
        for pid in pending {
            let (cmdline, hash) = self.read_cmdline(pid);
            let name = read_small(
                &self.opts.root.join(pid.to_string()).join("stat"),
                &mut self.buf,
            )
            .ok()
            .and_then(|t| parse_stat(t).ok())
            .map(|s| s.comm);
            let Some(m) = self.members.get_mut(&pid) else {
                continue;
            };
            if cmdline.is_empty() {
                m.describe_tries -= 1;
            } else {
                m.describe_tries = 0;
                m.cmdline_hash = hash;
                out.described.push(Described {
                    pid,
                    name: name.unwrap_or_default(),
                    cmdline,
                });
            }
        }
    }

    /// Whether a joining member may keep its once-a-second files open
    /// beside its `statm`: only while the members, this one's three
    /// included, hold at most half the descriptors allowed, so those files
    /// never leave a later process's `statm` (read every tick) to be read
    /// by path.
    fn keeps_slow_files(&self) -> bool {
        self.open_now + 3 <= self.max_open / 2
    }

    fn join(&mut self, stat: Stat, statm: Option<File>, root: bool, out: &mut HostSample) {
        let pid = stat.pid;
        let (status, cmdline_file) = if statm.is_some() && self.keeps_slow_files() {
            let dir = self.opts.root.join(pid.to_string());
            (
                File::open(dir.join("status")).ok(),
                File::open(dir.join("cmdline")).ok(),
            )
        } else {
            (None, None)
        };
        let (cmdline, cmdline_hash) = self.read_cmdline_from(pid, cmdline_file.as_ref());
        let describe_tries = if cmdline.is_empty() {
            DESCRIBE_TRIES
        } else {
            0
        };
        let id = Identity {
            pid,
            start_ticks: stat.start_ticks,
        };
        let fork_of = self.fork_of(&stat, cmdline_hash);
        out.joined.push(Joined {
            id,
            ppid: stat.ppid,
            start_time: self.btime as f64 + stat.start_ticks as f64 / self.clock_ticks as f64,
            name: stat.comm,
            cmdline,
            root,
        });
        let member = Member {
            id,
            statm,
            status,
            cmdline: cmdline_file,
            rss: 0,
            hwm: 0,
            hwm_read_at: None,
            hwm_rise: 0,
            anon: 0,
            fork_of,
            read_ok: false,
            describe_tries,
            cmdline_hash,
            cmdline_read_at: Instant::now(),
            name_hash: None,
        };
        self.open_now += member.descriptors();
        self.members.insert(pid, member);
    }

    /// The followed process `stat`'s process was forked from without an
    /// exec since (the same command line), and its anonymous bytes now.
    /// A process whose parent died is re-parented to memtrack (the
    /// subreaper): its parent is then the dead member of the same command
    /// line, the latest started (a daemon forking away from itself, a
    /// worker whose parent exited).
    fn fork_of(&self, stat: &Stat, cmdline_hash: u64) -> Option<(u32, u64)> {
        if cmdline_hash == 0 {
            return None;
        }
        if let Some(p) = self.members.get(&stat.ppid) {
            // Against the parent's command line now: it may have exec'd
            // since it was described (a shell wrapper or a pyenv shim).
            let same =
                p.cmdline_hash == cmdline_hash || self.read_cmdline(stat.ppid).1 == cmdline_hash;
            return same.then_some((stat.ppid, p.anon));
        }
        if Some(stat.ppid) != self.opts.reaper || Some(stat.pid) == self.opts.job {
            return None;
        }
        let mut buf = Vec::new();
        let mut dead = |pid: u32, start: u64| {
            read_small(&self.opts.root.join(pid.to_string()).join("stat"), &mut buf)
                .ok()
                .and_then(|t| parse_stat(t).ok())
                .is_none_or(|s| s.start_ticks != start || s.state == 'Z' || s.state == 'X')
        };
        let mut found = None;
        for (&pid, m) in &self.members {
            if m.cmdline_hash == cmdline_hash
                && m.id.start_ticks <= stat.start_ticks
                && found.is_none_or(|(_, _, start)| m.id.start_ticks > start)
                && dead(pid, m.id.start_ticks)
            {
                found = Some((pid, m.anon, m.id.start_ticks));
            }
        }
        found.map(|(pid, anon, _)| (pid, anon)).or_else(|| {
            self.recently_left
                .iter()
                .rev()
                .find(|(_, hash, _)| *hash == cmdline_hash)
                .map(|&(pid, _, anon)| (pid, anon))
        })
    }

    fn belongs(&self, ppid: u32) -> bool {
        self.members.contains_key(&ppid) || Some(ppid) == self.opts.reaper
    }

    /// Finds processes created since the last sample whose parent is
    /// followed.
    fn discover(&mut self, now: Instant, out: &mut HostSample) {
        if self.members.is_empty() && self.opts.reaper.is_none() {
            return;
        }
        let current = self.read_last_pid();
        let full_due = self
            .last_full_scan
            .is_none_or(|t| now.duration_since(t) >= FULL_SCAN_EVERY);
        match (self.last_pid, current) {
            _ if full_due => self.full_scan(now, out),
            (Some(prev), Some(cur)) if prev == cur => {}
            (Some(prev), Some(cur)) => {
                let span = if cur > prev {
                    cur - prev
                } else {
                    self.pid_max - prev + cur
                };
                if span <= PROBE_LIMIT {
                    let mut pid = prev;
                    for _ in 0..span {
                        pid = if pid + 1 >= self.pid_max { 1 } else { pid + 1 };
                        self.probe(pid, out);
                    }
                } else {
                    self.full_scan(now, out);
                }
            }
            _ => self.full_scan(now, out),
        }
        self.last_pid = current;
    }

    fn read_last_pid(&mut self) -> Option<u32> {
        let f = self.loadavg.as_ref()?;
        self.buf.clear();
        self.buf.resize(128, 0);
        let n = f.read_at(&mut self.buf, 0).ok()?;
        parse_loadavg_last_pid(std::str::from_utf8(&self.buf[..n]).ok()?).ok()
    }

    /// Checks one candidate PID (which may also be a thread id: those are
    /// reachable as `/proc/TID` without being listed).
    fn probe(&mut self, pid: u32, out: &mut HostSample) {
        if self.members.contains_key(&pid) {
            return;
        }
        let dir = self.opts.root.join(pid.to_string());
        let Ok(Ok(stat)) = read_small(&dir.join("stat"), &mut self.buf).map(parse_stat) else {
            return;
        };
        if !self.belongs(stat.ppid) || !self.may_join(&stat) {
            return;
        }
        // A thread of a followed process shows its process's parent as
        // ppid; only a thread-group leader is a process of its own.
        match read_small(&dir.join("status"), &mut self.buf).map(parse_status) {
            Ok(Ok(status)) if status.tgid == pid => {}
            _ => return,
        }
        self.open_and_join(stat, out);
    }

    /// A zombie has left already: it joins only when it is ours to reap
    /// (an orphan re-parented to us), never the job (its waiter reaps it).
    /// Otherwise every full scan until its parent reaps it would add it
    /// again as a new process.
    fn may_join(&self, stat: &Stat) -> bool {
        match stat.state {
            'X' => false,
            'Z' => Some(stat.ppid) == self.opts.reaper && Some(stat.pid) != self.opts.job,
            _ => true,
        }
    }

    /// Joins a process with its `statm` kept open, or followed by path when
    /// memtrack is out of descriptors (counted, never silently dropped).
    fn open_and_join(&mut self, stat: Stat, out: &mut HostSample) {
        let path = self.opts.root.join(stat.pid.to_string()).join("statm");
        if self.open_now >= self.max_open {
            out.fd_fallbacks += 1;
            self.join(stat, None, false, out);
            return;
        }
        match File::open(&path) {
            Ok(statm) => self.join(stat, Some(statm), false, out),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                out.fd_fallbacks += 1;
                self.join(stat, None, false, out);
            }
            Err(_) => {}
        }
    }

    /// Lists `/proc` and adds every descendant of the tree not yet followed.
    fn full_scan(&mut self, now: Instant, out: &mut HostSample) {
        self.last_full_scan = Some(now);
        let Ok(entries) = std::fs::read_dir(&self.opts.root) else {
            out.errors += 1;
            return;
        };
        let mut candidates: Vec<Stat> = Vec::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if self.members.contains_key(&pid) {
                continue;
            }
            if let Ok(Ok(stat)) =
                read_small(&entry.path().join("stat"), &mut self.buf).map(parse_stat)
            {
                if self.may_join(&stat) {
                    candidates.push(stat);
                }
            }
        }
        // Parents before children: repeat until no candidate joins.
        loop {
            let before = candidates.len();
            let mut rest = Vec::with_capacity(candidates.len());
            for stat in candidates {
                if self.belongs(stat.ppid) {
                    self.open_and_join(stat, out);
                } else {
                    rest.push(stat);
                }
            }
            candidates = rest;
            if candidates.len() == before {
                break;
            }
        }
    }
}

/// What one member's read found.
enum MemberRead {
    Ok,
    Gone,
    Error,
}

/// Reads one followed process: `statm` every time, `VmHWM` when due. The
/// figures land in the member; `smaps_rollup` is read off this thread, by
/// the cost reader.
fn read_member(
    m: &mut Member,
    pid: u32,
    now: Instant,
    opts: &ProcOptions,
    page_size: u64,
    buf: &mut Vec<u8>,
) -> MemberRead {
    m.hwm_rise = 0;
    m.read_ok = false;
    let dir = || opts.root.join(pid.to_string());
    let read = match &m.statm {
        Some(f) => {
            buf.clear();
            buf.resize(256, 0);
            f.read_at(buf, 0).map(|n| {
                buf.truncate(n);
            })
        }
        None => {
            // Followed by path: make sure the number still names the
            // same process.
            match read_small(&dir().join("stat"), buf).map(parse_stat) {
                Ok(Ok(stat)) if stat.start_ticks == m.id.start_ticks => {}
                Ok(_) => return MemberRead::Gone,
                Err(e) if gone(&e) => return MemberRead::Gone,
                Err(_) => return MemberRead::Error,
            }
            read_small(&dir().join("statm"), buf).map(|_| ())
        }
    };
    let (rss, anon) = match read {
        Ok(()) => match std::str::from_utf8(buf)
            .ok()
            .and_then(|t| parse_statm_anon(t, page_size).ok())
        {
            Some(v) => v,
            None => return MemberRead::Error,
        },
        Err(e) if gone(&e) => return MemberRead::Gone,
        Err(_) => return MemberRead::Error,
    };
    if rss == 0 {
        // A zombie's statm reads all zeros: it has left, though its PID
        // still answers until it is reaped.
        match read_small(&dir().join("stat"), buf).map(parse_stat) {
            Ok(Ok(stat)) if stat.state != 'Z' && stat.state != 'X' => {}
            _ => return MemberRead::Gone,
        }
        if m.rss > 0 {
            // Tearing down (its memory is gone before it shows as a
            // zombie): it holds what it held until it has left, so a fork
            // of it is not taken for a process of its own.
            m.read_ok = true;
            return MemberRead::Ok;
        }
    }
    m.rss = rss;
    m.anon = anon;
    let due =
        |at: Option<Instant>, every: Duration| at.is_none_or(|t| now.duration_since(t) >= every);
    if due(m.hwm_read_at, opts.hwm_interval) {
        let mut renamed = false;
        if let Ok(status) = read_kept(m.status.as_ref(), &opts.root, pid, "status", buf)
            .and_then(|_| std::str::from_utf8(buf).map_err(io::Error::other))
            .and_then(|t| parse_status(t).map_err(io::Error::other))
        {
            // A rise of the high-water mark above both the last one and
            // the RSS now is a peak reached since the last read.
            if m.hwm_read_at.is_some() {
                m.hwm_rise = status.vm_hwm.saturating_sub(m.hwm.max(rss));
            }
            m.hwm = m.hwm.max(status.vm_hwm);
            let name = hash_bytes(status.name.as_bytes());
            renamed = m.name_hash.is_some_and(|h| h != name);
            m.name_hash = Some(name);
        }
        // Notice an exec since the process was described: at once when
        // its name changed, else every `EXEC_CHECK_EVERY`.
        if m.describe_tries == 0 && (renamed || due(Some(m.cmdline_read_at), EXEC_CHECK_EVERY)) {
            m.cmdline_read_at = now;
            match read_kept(m.cmdline.as_ref(), &opts.root, pid, "cmdline", buf) {
                // Caught inside an `execve` (renamed, its arguments not yet
                // set): the next samples read it again.
                Ok(0) => m.describe_tries = DESCRIBE_TRIES,
                Ok(n) if hash_bytes(&buf[..n]) != m.cmdline_hash => {
                    m.describe_tries = DESCRIBE_TRIES;
                }
                _ => {}
            }
        }
        m.hwm_read_at = Some(now);
    }
    m.read_ok = true;
    MemberRead::Ok
}

fn hash_bytes(b: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

fn gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ESRCH) | Some(libc::ENOENT))
}

fn read_small<'b>(path: &Path, buf: &'b mut Vec<u8>) -> io::Result<&'b str> {
    read_whole(&File::open(path)?, buf)?;
    std::str::from_utf8(buf).map_err(io::Error::other)
}

/// Reads a process's procfs file `name` whole into `buf`: from `kept` when
/// the member keeps it open, else opened by path for this read.
fn read_kept(
    kept: Option<&File>,
    root: &Path,
    pid: u32,
    name: &str,
    buf: &mut Vec<u8>,
) -> io::Result<usize> {
    match kept {
        Some(f) => read_whole(f, buf),
        None => read_whole(&File::open(root.join(pid.to_string()).join(name))?, buf),
    }
}

/// First read of a [`read_whole`]: a page holds any `stat`, `statm` or
/// `status` of a process with a usual group list and CPU mask.
const WHOLE_FIRST: usize = 4096;

/// Reads `f` whole from its start into `buf` (its length), in as few
/// `pread`s as procfs allows, so a kept-open file is read again the same
/// way. A procfs file of a process (`stat`, `status`, `cmdline`) hands
/// out all it holds that fits in one read, so a read that leaves room in
/// the buffer reached the end: no size probe first and no empty read after
/// (`read_to_end` makes both, three system calls where the floor makes
/// one). A read that fills the buffer may have more behind it: the buffer
/// grows and reading goes on from there.
fn read_whole(f: &File, buf: &mut Vec<u8>) -> io::Result<usize> {
    buf.clear();
    buf.resize(WHOLE_FIRST, 0);
    let mut len = 0;
    loop {
        match f.read_at(&mut buf[len..], len as u64) {
            Ok(n) => {
                len += n;
                if n == 0 || len < buf.len() {
                    break;
                }
                buf.resize(buf.len() * 2, 0);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                buf.truncate(len);
                return Err(e);
            }
        }
    }
    buf.truncate(len);
    Ok(len)
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

/// memtrack's own footprint, for the metrics (read at scrape time, not by
/// the sampler).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SelfUsage {
    pub rss_bytes: u64,
    pub cpu_seconds: f64,
}

impl SelfUsage {
    /// Reads `/proc/self`; `None` where procfs is missing.
    pub(crate) fn read() -> Option<SelfUsage> {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let rss_bytes = parse_statm(&statm, sys::page_size()).ok()?;
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
        // utime and stime are fields 14 and 15 of proc(5); `rest` starts at 3.
        let ticks: f64 =
            fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
        Some(SelfUsage {
            rss_bytes,
            cpu_seconds: ticks / sys::clock_ticks() as f64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::parse::{parse_smaps_rollup, ProcStatus};

    const STAT: &str = "1234 (python3 (worker) x) S 1000 1234 1000 0 -1 4194560 100 0 0 0 5 1 0 0 20 0 4 0 98765 123456789 2500 18446744073709551615 1 1 0 0 0 0 0 16781312 134234626 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n";

    #[test]
    fn stat_with_parens_in_comm() {
        let s = parse_stat(STAT).unwrap();
        assert_eq!(s.pid, 1234);
        assert_eq!(s.comm, "python3 (worker) x");
        assert_eq!(s.state, 'S');
        assert_eq!(s.ppid, 1000);
        assert_eq!(s.start_ticks, 98765);
        assert_eq!(s.exit_code, Some(0));
    }

    #[test]
    fn read_whole_reads_past_a_full_first_buffer() {
        let dir = std::env::temp_dir().join(format!("memtrack-read-whole-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut buf = Vec::new();
        for len in [
            0,
            1,
            WHOLE_FIRST - 1,
            WHOLE_FIRST,
            WHOLE_FIRST + 1,
            3 * WHOLE_FIRST + 17,
        ] {
            let path = dir.join(format!("f{len}"));
            let data: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            std::fs::write(&path, &data).unwrap();
            assert_eq!(
                read_whole(&File::open(&path).unwrap(), &mut buf).unwrap(),
                len
            );
            assert_eq!(buf, data, "{len} bytes");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn read_whole_reads_a_live_procfs_file_whole() {
        // A process's status is read in one go; its lines end where the
        // kernel's do.
        let mut buf = Vec::new();
        let text = read_small(Path::new("/proc/self/status"), &mut buf).unwrap();
        assert!(text.starts_with("Name:"), "{text}");
        assert!(text.ends_with('\n'));
        assert!(parse_status(text).unwrap().vm_hwm > 0);
        // A command line longer than the first read comes back whole
        // (`sleep` sums its arguments: a long run of zeros adds nothing).
        let long = "0".repeat(3 * WHOLE_FIRST);
        let mut child = std::process::Command::new("sleep")
            .args(["30", &long])
            .spawn()
            .unwrap();
        let path = PathBuf::from(format!("/proc/{}/cmdline", child.id()));
        let mut n = 0;
        for _ in 0..200 {
            n = read_whole(&File::open(&path).unwrap(), &mut buf).unwrap();
            if n > WHOLE_FIRST {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(n, "sleep".len() + "30".len() + long.len() + 3);
        assert!(buf.ends_with(format!("{long}\0").as_bytes()));
    }

    #[test]
    fn stat_rejects_garbage() {
        assert!(parse_stat("").is_err());
        assert!(parse_stat("12 (x").is_err());
        assert!(parse_stat("12 (x) S").is_err());
        assert!(parse_stat("x (y) S 1 2").is_err());
    }

    #[test]
    fn statm_resident_in_pages() {
        assert_eq!(
            parse_statm("5000 1200 300 10 0 900 0\n", 4096).unwrap(),
            1200 * 4096
        );
        assert!(parse_statm("5000\n", 4096).is_err());
    }

    #[test]
    fn status_fields_and_zombies() {
        let text = "Name:\tpython3\nState:\tS (sleeping)\nTgid:\t42\nPid:\t42\nPPid:\t7\nVmHWM:\t  409600 kB\nVmRSS:\t  102400 kB\n";
        let s = parse_status(text).unwrap();
        assert_eq!(
            s,
            ProcStatus {
                name: "python3".into(),
                tgid: 42,
                ppid: 7,
                vm_rss: 100 << 20,
                vm_hwm: 400 << 20
            }
        );
        let zombie = parse_status("Name:\tx\nState:\tZ (zombie)\nTgid:\t9\nPPid:\t1\n").unwrap();
        assert_eq!((zombie.vm_rss, zombie.vm_hwm), (0, 0));
        assert!(parse_status("Name: x\n").is_err());
        assert!(parse_status("Tgid:\t1\nVmRSS:\tlots kB\n").is_err());
    }

    #[test]
    fn loadavg_and_btime() {
        assert_eq!(
            parse_loadavg_last_pid("0.00 0.01 0.05 1/76 2103\n").unwrap(),
            2103
        );
        assert!(parse_loadavg_last_pid("0.00 0.01").is_err());
        assert_eq!(
            parse_btime("cpu 1 2 3\nbtime 1700000000\nprocesses 5\n").unwrap(),
            1_700_000_000
        );
    }

    #[test]
    fn smaps_rollup() {
        let text = "00400000-7fff [rollup]\nRss: 2048 kB\nPss: 1024 kB\nPrivate_Clean: 100 kB\nPrivate_Dirty: 400 kB\n";
        assert_eq!(parse_smaps_rollup(text).unwrap(), (1024 * 1024, 500 * 1024));
    }

    #[test]
    fn cmdline_split() {
        assert_eq!(
            parse_cmdline(b"python3\0-c\0print(1)\0"),
            vec!["python3", "-c", "print(1)"]
        );
        assert!(parse_cmdline(b"").is_empty());
    }

    fn live_tree(reaper: Option<u32>) -> ProcTree {
        ProcTree::new(ProcOptions {
            root: "/proc".into(),
            hwm_interval: Duration::from_millis(0) + Duration::from_nanos(1),
            reaper,
            job: None,
            smaps: None,
            read_share: 0.02,
        })
        .unwrap()
    }

    #[test]
    fn follows_a_real_child_and_sees_it_leave() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut tree = live_tree(None);
        let mut out = HostSample::default();
        tree.add_root(child.id()).unwrap();
        tree.sample(Instant::now(), &mut out);
        assert_eq!(out.joined.len(), 1);
        assert!(out.joined[0].root);
        // Caught mid-execve, the command line arrives with a later sample.
        let mut cmdline = out.joined[0].cmdline.clone();
        for _ in 0..DESCRIBE_TRIES {
            if let Some(d) = out.described.first() {
                cmdline = d.cmdline.clone();
            }
            if !cmdline.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            out.clear();
            tree.sample(Instant::now(), &mut out);
        }
        assert_eq!(cmdline, vec!["sleep", "30"]);
        assert_eq!(out.processes.len(), 1);
        assert!(out.processes[0].rss > 0);
        assert!(out.processes[0].hwm >= out.processes[0].rss);
        child.kill().unwrap();
        child.wait().unwrap();
        out.clear();
        tree.sample(Instant::now(), &mut out);
        assert!(out.processes.is_empty());
        assert_eq!(out.left.len(), 1);
        assert_eq!(out.left[0].id.pid, child.id());
    }

    #[test]
    fn peek_leaves_out_a_dying_process() {
        // Regression: the flight recorder showed a killed job as a live
        // process holding 0 MiB.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut tree = live_tree(None);
        let mut out = HostSample::default();
        tree.add_root(child.id()).unwrap();
        tree.sample(Instant::now(), &mut out);
        let mut rss = Vec::new();
        tree.peek(&mut rss);
        assert!(matches!(rss.as_slice(), [(pid, r)] if *pid == child.id() && *r > 0));
        child.kill().unwrap();
        // Not reaped yet: a zombie, whose statm reads zeros.
        let stat = format!("/proc/{}/stat", child.id());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(&stat).unwrap().contains(") Z ") {
            assert!(Instant::now() < deadline, "the child never became a zombie");
            std::thread::sleep(Duration::from_millis(5));
        }
        tree.peek(&mut rss);
        assert!(rss.is_empty(), "{rss:?}");
        child.wait().unwrap();
    }

    #[test]
    fn kept_files_follow_an_exec_and_are_counted() {
        // sh starts a long sleep beside it, then execs into another: its
        // kept `status` and `cmdline` read the process it became.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & sleep 0.2; exec sleep 30"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut tree = live_tree(None);
        tree.max_open = 8;
        tree.add_root(pid).unwrap();
        let mut out = HostSample::default();
        tree.sample(Instant::now(), &mut out);
        assert_eq!(
            tree.members[&pid].descriptors(),
            3,
            "statm, status, cmdline"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut became = None;
        while became.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            out.clear();
            tree.sample(Instant::now(), &mut out);
            became = out
                .described
                .iter()
                .find(|d| d.pid == pid)
                .map(|d| d.cmdline.clone());
            let root = out.processes.iter().find(|p| p.pid == pid).unwrap();
            assert!(root.rss > 0);
            // VmHWM as the kept `status` gave it (0 until a read succeeds;
            // the reading's own `hwm` is never below its RSS).
            assert!(tree.members[&pid].hwm > 0);
        }
        assert_eq!(became, Some(vec!["sleep".to_string(), "30".to_string()]));
        // The sleeps joined with the slow files' half of the descriptors
        // spent: each keeps its statm alone, and is read all the same.
        let others: Vec<u32> = tree.pids().filter(|&p| p != pid).collect();
        assert!(!others.is_empty(), "the background sleep joined");
        for p in &others {
            assert_eq!(tree.members[p].descriptors(), 1);
            let read = out.processes.iter().find(|r| r.pid == *p).unwrap();
            assert!(read.rss > 0);
            // VmHWM from `status` opened by path.
            assert!(tree.members[p].hwm > 0);
        }
        assert_eq!(tree.open_now, 3 + others.len());
        for p in tree.pids() {
            let _ = sys::kill(p, libc::SIGKILL);
        }
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !tree.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            out.clear();
            tree.sample(Instant::now(), &mut out);
        }
        assert!(tree.is_empty());
        assert_eq!(tree.open_now, 0, "every descriptor given back");
    }

    #[test]
    fn an_exec_of_the_same_program_is_seen_by_the_periodic_check() {
        // sh execs another sh: the name stays, so only the periodic read
        // of the command line notices.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 0.2; exec sh -c 'sleep 30; true'"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut tree = live_tree(None);
        tree.add_root(pid).unwrap();
        let mut out = HostSample::default();
        tree.sample(Instant::now(), &mut out);
        let cmdline = format!("/proc/{pid}/cmdline");
        let deadline = Instant::now() + Duration::from_secs(5);
        // (The first command line holds that text too: wait for it alone.)
        while std::fs::read_to_string(&cmdline).unwrap() != "sh\0-c\0sleep 30; true\0" {
            assert!(Instant::now() < deadline, "the exec never came");
            std::thread::sleep(Duration::from_millis(10));
        }
        let described = |out: &HostSample| {
            out.described
                .iter()
                .find(|d| d.pid == pid)
                .map(|d| d.cmdline.clone())
        };
        for _ in 0..3 {
            out.clear();
            tree.sample(Instant::now(), &mut out);
            assert_eq!(described(&out), None, "read before it was due");
        }
        let m = tree.members.get_mut(&pid).unwrap();
        m.cmdline_read_at = m.cmdline_read_at.checked_sub(EXEC_CHECK_EVERY).unwrap();
        out.clear();
        tree.sample(Instant::now(), &mut out);
        assert_eq!(
            described(&out),
            Some(vec![
                "sh".to_string(),
                "-c".to_string(),
                "sleep 30; true".to_string()
            ])
        );
        for p in tree.pids() {
            let _ = sys::kill(p, libc::SIGKILL);
        }
        child.wait().unwrap();
    }

    #[test]
    fn nonexistent_root_is_a_clear_error() {
        let mut tree = live_tree(None);
        let err = tree.add_root(u32::MAX - 1).unwrap_err();
        assert!(matches!(err, RootError::NoSuchProcess(_)), "{err}");
    }

    #[test]
    fn discovers_grandchildren_started_later() {
        // sh starts, then after a moment forks two sleeps.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 0.3; sleep 5 & sleep 5 & wait"])
            .spawn()
            .unwrap();
        let mut tree = live_tree(None);
        let mut out = HostSample::default();
        tree.add_root(child.id()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while tree.len() < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            tree.sample(Instant::now(), &mut out);
        }
        assert_eq!(tree.len(), 3, "sh and both sleeps");
        child.kill().unwrap();
        child.wait().unwrap();
        let _ = std::process::Command::new("pkill")
            .args(["-P", &child.id().to_string()])
            .status();
    }
}
