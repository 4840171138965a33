//! The tree's distinct resident pages: every physical page mapped by any
//! process of the tree, counted once, read from `/proc/PID/pagemap`.
//!
//! For each process the pass lists its mappings (`/proc/PID/maps`, no page
//! walk), skips those that can hold no page (no access at all: guard
//! pages, address-space reservations), and reads the pagemap entries of
//! the rest: one 64-bit word per virtual page, whose bit 63 says the page
//! is resident and whose low 55 bits give its page frame number (PFN).
//! Each process's PFNs are kept as last read ([`Rolling`]), as compact
//! frame sets shared between processes ([`super::frames`]); the tree's
//! figure is the number of distinct PFNs over all of them.
//!
//! PFNs read as 0 without `CAP_SYS_ADMIN` (root): the pass then says it
//! cannot count, and the footprint uses Σ Pss instead. Pages swapped out
//! are not resident and not counted.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::frames::{self, Builder, FrameSet, Interner};
use super::parse::parse_statm_anon;

/// Pagemap words read at a time.
const CHUNK_PAGES: usize = 16 * 1024;

const PRESENT: u64 = 1 << 63;
/// A file page or shared anonymous memory (`/dev/shm`, `MAP_SHARED`).
const FILE_OR_SHARED: u64 = 1 << 61;
/// Mapped once (by this process, at this address): one of the pages its
/// USS counts (`smaps_rollup`'s `Private_Clean + Private_Dirty`).
const EXCLUSIVE: u64 = 1 << 56;
const PFN_MASK: u64 = (1 << 55) - 1;

/// One process as the pass saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) pid: u32,
    /// Its resident and anonymous resident bytes (`statm`) just after its
    /// pages were read: what carries its figure forward after.
    pub(crate) rss: u64,
    pub(crate) anon: u64,
    /// Pages of this process no process read before it had (bytes); in a
    /// Σ Pss pass, its USS.
    pub(crate) first_seen: u64,
    /// Its Pss, in a Σ Pss pass.
    pub(crate) pss: Option<u64>,
    /// Its resident pages mapped by it alone (bytes), in a page count's
    /// read: its USS, as exact as `smaps_rollup`'s, for the price of a bit
    /// test per page the count reads anyway. `None` when its RSS, or its
    /// faults, moved while it was read ([`MOVED_WHILE_READ`]): the
    /// mappings it made meanwhile were not in the read, and pages it
    /// copied may or may not be, so its USS would be a step behind (read
    /// again, it gets one).
    pub(crate) uss: Option<u64>,
    /// Its page faults at the read: just after it (a page count's read,
    /// whose USS is kept only when they moved little meanwhile), midway
    /// through it (a Σ Pss pass's, [`midway`]).
    pub(crate) faults: Option<u64>,
}

/// Processes and their page fault counts.
type Faults = Vec<(u32, u64)>;

/// A process whose RSS moved by more than this while its pages were read
/// has no USS from that read.
const MOVED_WHILE_READ: u64 = 1 << 20;

/// A Σ Pss pass over the tree ([`super::pss`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Pass {
    /// Σ Pss of the processes read, in bytes.
    pub(crate) bytes: u64,
    /// Of that, file pages and shared memory (`Pss_File + Pss_Shmem`).
    pub(crate) shared: u64,
    pub(crate) seen: Vec<Seen>,
}

/// A mapping worth reading: `[start, end)` with some access.
fn mappings(maps: &str) -> impl Iterator<Item = (u64, u64)> + '_ {
    maps.lines().filter_map(|line| {
        let mut f = line.split_ascii_whitespace();
        let range = f.next()?;
        let perms = f.next()?;
        if perms.starts_with("---") {
            return None;
        }
        let (a, b) = range.split_once('-')?;
        let start = u64::from_str_radix(a, 16).ok()?;
        let end = u64::from_str_radix(b, 16).ok()?;
        // [vsyscall] lies above the user address space pagemap covers.
        (end > start && start < 0xffff_0000_0000_0000).then_some((start, end))
    })
}

/// Neighbouring mappings (at most [`GAP_PAGES`] apart) as one range: one
/// read for thousands of small mappings side by side. Pages in a gap read
/// as not present.
const GAP_PAGES: u64 = 64;

fn coalesced(
    ranges: impl Iterator<Item = (u64, u64)>,
    page_size: u64,
) -> impl Iterator<Item = (u64, u64)> {
    let mut ranges = ranges.peekable();
    std::iter::from_fn(move || {
        let (start, mut end) = ranges.next()?;
        while let Some(&(s, e)) = ranges.peek() {
            if s < end || s - end > GAP_PAGES * page_size {
                break;
            }
            end = e;
            ranges.next();
        }
        Some((start, end))
    })
}

/// What a process's page faults say, and its parent: `minflt + majflt`
/// and `ppid` from `/proc/PID/stat`. A process gains a page only through a
/// fault (a first touch, a copy on write, a file or shared page mapped in),
/// so one whose count has not moved since its pages were read holds the
/// same pages, but for the kernel's own moves (compaction, huge-page
/// collapse), which a re-read every [`STALE`] covers.
pub(crate) fn faults(root: &Path, pid: u32, buf: &mut String) -> Option<(u64, u32)> {
    use std::io::Read;
    buf.clear();
    File::open(root.join(pid.to_string()).join("stat"))
        .and_then(|mut f| f.read_to_string(buf))
        .ok()?;
    // Fields after the last `)` (the command name may hold anything),
    // numbered from 3 as in proc(5): ppid is 4, minflt 10, majflt 12.
    let rest = &buf[buf.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace().skip(4 - 3);
    let ppid: u32 = f.next()?.parse().ok()?;
    let mut f = f.skip(10 - 5);
    let minflt: u64 = f.next()?.parse().ok()?;
    let majflt: u64 = f.nth(1)?.parse().ok()?;
    Some((minflt + majflt, ppid))
}

/// Its faults at a read that took a while (a `smaps_rollup` walk, which a
/// busy machine can stretch over a copying worker's whole burst): midway
/// between those just before the read and just after it. The copies it
/// made meanwhile may be in the read or not; an estimate counted from the
/// midpoint is off by at most half of them, either way.
pub(crate) fn midway(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    match (before, after) {
        (Some(b), Some(a)) => Some(b + a.saturating_sub(b) / 2),
        (b, a) => a.or(b),
    }
}

/// A process whose faults have not moved is read again after this anyway.
pub(crate) const STALE: Duration = Duration::from_secs(10);

/// A process this young whose faults moved is read again, before the most
/// faulted, once its age has doubled since its last read (at least
/// [`YOUNG_FIRST`] after its birth): short-lived workers are read while
/// they hold their memory.
const YOUNG: Duration = Duration::from_secs(60);
const YOUNG_FIRST: Duration = Duration::from_millis(250);

/// One process's pages as last read.
#[derive(Debug, Default)]
struct Held {
    /// Its private anonymous pages' PFNs (those a fork shares until one
    /// side writes included), and those of its file and shared-memory
    /// pages.
    anon: FrameSet,
    shared: FrameSet,
    /// Its fault count when that read began.
    faults: u64,
    read_at: Option<Instant>,
}

/// A process being read: where the read stopped, and what it found so far.
#[derive(Debug)]
struct Cursor {
    pid: u32,
    pagemap: File,
    /// The ranges to read, in pages, and the next page to read.
    ranges: Vec<(u64, u64)>,
    at: usize,
    page: u64,
    /// Its `statm` (resident, anonymous) and fault count when its read
    /// began.
    statm: (u64, u64),
    faults: u64,
    /// Present pages mapped only here, so far.
    exclusive: u64,
    anon: Builder,
    shared: Builder,
}

/// A slice of the rolling count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Slice {
    /// The tree's distinct resident pages (bytes): every process's pages
    /// as last read, counted once.
    pub(crate) bytes: u64,
    /// Of those, file pages and shared memory: what a cgroup's anonymous
    /// charge leaves out.
    pub(crate) shared_bytes: u64,
    /// The processes read in this slice, in order (`first_seen`: the pages
    /// it alone holds).
    pub(crate) read: Vec<Seen>,
    /// Every counted process and the bytes of pages it alone holds, as
    /// last read.
    pub(crate) alone: Vec<(u32, u64)>,
    /// Every process with pages to read again was read: the figure is
    /// whole.
    pub(crate) whole: bool,
    /// Some present page came without its PFN: no permission to count.
    pub(crate) unreadable: bool,
    /// Each live process's page faults (`minflt + majflt`) as this slice
    /// found them.
    pub(crate) faults: Vec<(u32, u64)>,
}

/// The tree's distinct pages, counted by re-reading one process at a time.
///
/// Each process's page frame numbers are kept as last read. A slice reads
/// the processes whose pages may have changed — never read, then those
/// with the most page faults since their last read, then any not read for
/// [`STALE`] — until its CPU time is spent, stopping between two pagemap
/// reads if need be (the next slice resumes there). The union of the lists
/// is then counted again: the figure moves after each process, not after
/// a pass over all of them, and a process that left takes exactly the
/// pages it alone held.
///
/// Memory: each process's frames as compact blocks ([`super::frames`]),
/// a block equal to one another process holds kept once; at most one bit
/// per physical page for a block, whatever the job maps.
#[derive(Debug)]
pub(crate) struct Rolling {
    page_size: u64,
    held: HashMap<u32, Held>,
    current: Option<Cursor>,
    /// Every block any process's frames hold, kept once.
    blocks: Interner,
    counted: Slice,
    words: Vec<u8>,
    text: String,
    /// When each process was first among those to read.
    born: HashMap<u32, Instant>,
}

impl Rolling {
    pub(crate) fn new(page_size: u64) -> Rolling {
        Rolling {
            page_size,
            held: HashMap::new(),
            current: None,
            blocks: Interner::default(),
            counted: Slice::default(),
            words: Vec::new(),
            text: String::new(),
            born: HashMap::new(),
        }
    }

    /// One slice over the tree's processes now (`alive`): forgets those
    /// that left, reads those due in order until `stop` says so (checked
    /// after each pagemap read), and counts the union again. A process
    /// gone meanwhile is left out; any other error is returned.
    pub(crate) fn slice(
        &mut self,
        root: &Path,
        alive: &[u32],
        now: Instant,
        stop: &mut dyn FnMut() -> bool,
    ) -> io::Result<Slice> {
        let before = self.held.len();
        self.held.retain(|pid, _| alive.contains(pid));
        let mut changed = self.held.len() != before;
        if self
            .current
            .as_ref()
            .is_some_and(|c| !alive.contains(&c.pid))
        {
            self.current = None;
        }
        let (order, all_faults) = self.due(root, alive, now);
        let mut read = Vec::new();
        let mut whole = true;
        for (i, &(pid, faults)) in order.iter().enumerate() {
            if i > 0 && stop() {
                whole = false;
                break;
            }
            match self.read(root, pid, faults, now, stop) {
                Ok(Some(Some(seen))) => {
                    read.push(seen);
                    changed = true;
                }
                Ok(Some(None)) => {}
                Ok(None) => {
                    whole = false;
                    break;
                }
                Err(e) => {
                    self.current = None;
                    return Err(e);
                }
            }
        }
        if changed {
            self.count();
        }
        let alone: HashMap<u32, u64> = self.counted.alone.iter().copied().collect();
        for s in &mut read {
            s.first_seen = alone.get(&s.pid).copied().unwrap_or(0);
        }
        Ok(Slice {
            read,
            whole,
            faults: all_faults,
            ..self.counted.clone()
        })
    }

    /// The processes to read, in order, with their fault counts now.
    ///
    /// The one a slice stopped in; the never read, each after its parent
    /// when that is due too (a fork's pages are its parent's: read before
    /// its parent's own read has caught up, they would bring in the
    /// parent's pages its carried-forward figure already counts); the
    /// young whose faults moved and whose age has doubled since their last
    /// read (a worker living 4 s is read at about 0.5, 1 and 2 s: once in
    /// the second half of its life, whenever it ends); the most faulted;
    /// the stale.
    /// Also every live process's fault count.
    fn due(&mut self, root: &Path, alive: &[u32], now: Instant) -> (Faults, Faults) {
        self.born.retain(|pid, _| alive.contains(pid));
        let mut all = Vec::with_capacity(alive.len());
        // (class, after its parent, -faults since, pid, faults now, ppid)
        let mut order: Vec<(u8, u8, i128, u32, u64, u32)> = Vec::new();
        for &pid in alive {
            let Some((now_faults, ppid)) = faults(root, pid, &mut self.text) else {
                continue;
            };
            all.push((pid, now_faults));
            let born = *self.born.entry(pid).or_insert(now);
            let resuming = self.current.as_ref().is_some_and(|c| c.pid == pid);
            let young = |read_at: Instant| {
                let age = now.saturating_duration_since(born);
                let age_at_read = read_at.saturating_duration_since(born);
                age < YOUNG && age >= 2 * age_at_read.max(YOUNG_FIRST)
            };
            let entry = match self.held.get(&pid) {
                _ if resuming => (0, 0),
                None => (1, 0),
                Some(h) if now_faults > h.faults && h.read_at.is_some_and(young) => {
                    (2, -i128::from(now_faults - h.faults))
                }
                Some(h) if now_faults > h.faults => (3, -i128::from(now_faults - h.faults)),
                Some(h)
                    if h.read_at
                        .is_none_or(|t| now.saturating_duration_since(t) >= STALE) =>
                {
                    (4, 0)
                }
                Some(_) => continue,
            };
            order.push((entry.0, 0, entry.1, pid, now_faults, ppid));
        }
        // A parent due to be read goes before its never-read children.
        let parents: Vec<u32> = order.iter().filter(|o| o.0 == 1).map(|o| o.5).collect();
        for o in &mut order {
            if o.0 > 1 && parents.contains(&o.3) {
                o.0 = 1;
            } else if o.0 == 1 {
                o.1 = 1;
            }
        }
        order.sort_unstable();
        (order.into_iter().map(|o| (o.3, o.4)).collect(), all)
    }

    /// Counts the union of every process's pages, and the pages each
    /// alone holds.
    fn count(&mut self) {
        let pids: Vec<u32> = self.held.keys().copied().collect();
        let sets: Vec<(usize, &FrameSet, bool)> = pids
            .iter()
            .enumerate()
            .filter_map(|(i, pid)| self.held.get(pid).map(|h| (i, h)))
            .flat_map(|(i, h)| [(i, &h.anon, false), (i, &h.shared, true)])
            .collect();
        let counted = frames::count(&sets, pids.len());
        let mut alone: Vec<(u32, u64)> = pids
            .iter()
            .zip(&counted.alone)
            .map(|(&pid, &n)| (pid, n * self.page_size))
            .collect();
        alone.sort_unstable();
        self.counted.bytes = counted.union * self.page_size;
        self.counted.shared_bytes = counted.shared * self.page_size;
        self.counted.alone = alone;
        self.blocks.prune();
    }

    /// Heap bytes of the frame sets kept (each shared block once).
    #[cfg(test)]
    pub(crate) fn kept_bytes(&self) -> usize {
        self.blocks.bytes()
    }

    /// Reads (on) `pid`: `Some(Some(seen))` when done with it, `Some(None)`
    /// when it is gone or a zombie, `None` when stopped inside it.
    fn read(
        &mut self,
        root: &Path,
        pid: u32,
        faults: u64,
        now: Instant,
        stop: &mut dyn FnMut() -> bool,
    ) -> io::Result<Option<Option<Seen>>> {
        if self.current.as_ref().is_none_or(|c| c.pid != pid) {
            self.current = None;
            match self.open(root, pid, faults) {
                Ok(Some(c)) => self.current = Some(c),
                Ok(None) => return Ok(Some(None)),
                Err(e) if gone(&e) => return Ok(Some(None)),
                Err(e) => return Err(e),
            }
        }
        let Some(cur) = self.current.as_mut() else {
            return Ok(Some(None));
        };
        if self.words.is_empty() {
            self.words = vec![0u8; CHUNK_PAGES * 8];
        }
        let mut left = false;
        while let Some(&(start, end)) = cur.ranges.get(cur.at) {
            let page = cur.page.max(start);
            if page >= end {
                cur.at += 1;
                continue;
            }
            let n = ((end - page) as usize).min(CHUNK_PAGES);
            let buf = &mut self.words[..n * 8];
            let got = match cur.pagemap.read_at(buf, page * 8) {
                Ok(got) => got,
                // A mapping removed since `maps` was read.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => 0,
                Err(e) if gone(&e) => {
                    left = true;
                    break;
                }
                Err(e) => return Err(e),
            };
            if got < 8 {
                cur.at += 1;
                continue;
            }
            for w in buf[..got - got % 8].chunks_exact(8) {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                let v = u64::from_le_bytes(b);
                if v & PRESENT == 0 {
                    continue;
                }
                cur.exclusive += u64::from(v & EXCLUSIVE != 0);
                match v & PFN_MASK {
                    0 => self.counted.unreadable = true,
                    pfn if v & FILE_OR_SHARED != 0 => cur.shared.insert(pfn),
                    pfn => cur.anon.insert(pfn),
                }
            }
            cur.page = page + (got / 8) as u64;
            let more = cur.page < end || cur.at + 1 < cur.ranges.len();
            if more && stop() {
                return Ok(None);
            }
        }
        let Some(mut cur) = self.current.take() else {
            return Ok(Some(None));
        };
        if left {
            // Gone mid-read: it leaves with the next slice's `alive`.
            return Ok(Some(None));
        }
        // The figure is carried forward from what `statm` says after the
        // pages were read: memory the process took while they were read is
        // then counted once (by this read, or not until the next one),
        // never twice.
        let after = std::fs::read_to_string(root.join(pid.to_string()).join("statm"))
            .ok()
            .and_then(|t| parse_statm_anon(&t, self.page_size).ok())
            .filter(|s| s.0 > 0);
        let (rss, anon) = after.unwrap_or(cur.statm);
        // Its faults after the read: copies on write taken while it was
        // read (no RSS moves) may be in it or not.
        let faults_after = self::faults(root, pid, &mut self.text).map_or(cur.faults, |f| f.0);
        let still = rss.abs_diff(cur.statm.0) <= MOVED_WHILE_READ
            && faults_after.saturating_sub(cur.faults) * self.page_size <= MOVED_WHILE_READ;
        let held = Held {
            anon: std::mem::take(&mut cur.anon).finish(&mut self.blocks),
            shared: std::mem::take(&mut cur.shared).finish(&mut self.blocks),
            faults: cur.faults,
            read_at: Some(now),
        };
        self.held.insert(pid, held);
        Ok(Some(Some(Seen {
            pid,
            rss,
            anon,
            first_seen: 0,
            pss: None,
            uss: still.then_some(cur.exclusive * self.page_size),
            faults: Some(faults_after),
        })))
    }

    /// Starts reading `pid`: its `statm`, mappings and pagemap. `None`: a
    /// zombie.
    fn open(&mut self, root: &Path, pid: u32, faults: u64) -> io::Result<Option<Cursor>> {
        let dir = root.join(pid.to_string());
        let statm = std::fs::read_to_string(dir.join("statm"))?;
        let statm = parse_statm_anon(&statm, self.page_size).map_err(io::Error::other)?;
        if statm.0 == 0 {
            return Ok(None);
        }
        self.text.clear();
        {
            use std::io::Read;
            File::open(dir.join("maps"))?.read_to_string(&mut self.text)?;
        }
        let pagemap = File::open(dir.join("pagemap"))?;
        let ps = self.page_size;
        let ranges = coalesced(mappings(&self.text), ps)
            .map(|(a, b)| (a / ps, b / ps))
            .collect();
        Ok(Some(Cursor {
            pid,
            pagemap,
            ranges,
            at: 0,
            page: 0,
            statm,
            faults,
            exclusive: 0,
            anon: Builder::default(),
            shared: Builder::default(),
        }))
    }
}

fn gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ESRCH) | Some(libc::ENOENT))
        || e.kind() == io::ErrorKind::NotFound
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_mappings_are_read_as_one() {
        let r = [
            (0x1000, 0x2000),
            (0x2000, 0x3000),
            (0x5000, 0x6000),
            (0x100000, 0x101000),
        ];
        let c: Vec<(u64, u64)> = coalesced(r.into_iter(), 4096).collect();
        assert_eq!(c, [(0x1000, 0x6000), (0x100000, 0x101000)]);
    }

    #[test]
    fn mappings_without_access_are_skipped() {
        let maps = "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/dbus\n\
                    7f0000000000-7f0040000000 ---p 00000000 00:00 0\n\
                    7ffd000-7ffe000 rw-p 00000000 00:00 0 [stack]\n\
                    ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]\n";
        let m: Vec<(u64, u64)> = mappings(maps).collect();
        assert_eq!(m, [(0x400000, 0x452000), (0x7ffd000, 0x7ffe000)]);
    }

    /// A procfs stand-in: each process's `statm`, `stat` (its fault
    /// count), `maps` and a `pagemap` holding `(page, pfn)` entries
    /// (present), the rest not present.
    struct FakeProcess<'a> {
        pid: u32,
        ranges: &'a [(u64, u64)],
        pages: &'a [(u64, u64)],
        /// Of `pages`, those from this page on are file pages.
        file_from: u64,
        faults: u64,
    }

    fn write_proc(dir: &Path, p: &FakeProcess<'_>) {
        let d = dir.join(p.pid.to_string());
        std::fs::create_dir_all(&d).expect("dir");
        std::fs::write(d.join("statm"), "1000 300 100 1 0 200 0\n").expect("statm");
        std::fs::write(
            d.join("stat"),
            format!(
                "{} (py thon) S 1 1 1 0 -1 0 {} 0 0 0 1 1\n",
                p.pid, p.faults
            ),
        )
        .expect("stat");
        let maps: String = p
            .ranges
            .iter()
            .map(|(a, b)| format!("{:x}-{:x} rw-p 00000000 00:00 0\n", a * 4096, b * 4096))
            .collect();
        std::fs::write(d.join("maps"), maps).expect("maps");
        let end = p.ranges.iter().map(|r| r.1).max().unwrap_or(0);
        let mut words = vec![0u8; end as usize * 8];
        for (page, pfn) in p.pages {
            let file = if *page >= p.file_from {
                FILE_OR_SHARED
            } else {
                0
            };
            let v = PRESENT | file | pfn;
            words[*page as usize * 8..][..8].copy_from_slice(&v.to_le_bytes());
        }
        std::fs::write(d.join("pagemap"), words).expect("pagemap");
    }

    fn fake_proc(procs: &[FakeProcess<'_>]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for p in procs {
            write_proc(dir.path(), p);
        }
        dir
    }

    fn whole(r: &mut Rolling, root: &Path, alive: &[u32], now: Instant) -> Slice {
        r.slice(root, alive, now, &mut || false).expect("slice")
    }

    #[test]
    fn a_count_stopped_anywhere_resumes_to_the_same_figure() {
        // Two processes over more than one pagemap read each; the second
        // shares half the first's pages (a fork) and has 3 of its own.
        let big = CHUNK_PAGES as u64 * 2 + 10;
        let first: Vec<(u64, u64)> = (0..big).step_by(7).map(|p| (p, 1000 + p)).collect();
        let mut second: Vec<(u64, u64)> = first.iter().step_by(2).copied().collect();
        second.extend([(big + 1, 9), (big + 2, 10), (big + 3, 11)]);
        let r1: &[(u64, u64)] = &[(0, big)];
        let r2: &[(u64, u64)] = &[(0, big), (big + 1, big + 4)];
        let proc = fake_proc(&[
            FakeProcess {
                pid: 10,
                ranges: r1,
                pages: &first,
                file_from: u64::MAX,
                faults: 5,
            },
            FakeProcess {
                pid: 11,
                ranges: r2,
                pages: &second,
                file_from: u64::MAX,
                faults: 5,
            },
            FakeProcess {
                pid: 12,
                ranges: r1,
                pages: &[],
                file_from: u64::MAX,
                faults: 5,
            },
        ]);
        let pids = [10, 11, 12, 13];
        let now = Instant::now();
        let mut at_once = Rolling::new(4096);
        let one_go = whole(&mut at_once, proc.path(), &pids, now);
        assert!(one_go.whole, "a missing process is no work left");
        assert_eq!(one_go.bytes, (first.len() as u64 + 3) * 4096);
        assert_eq!(one_go.read.len(), 3);
        assert_eq!(one_go.read[1].first_seen, 3 * 4096, "the fork's own pages");
        assert_eq!(
            one_go.read[0].first_seen,
            (first.len() - second.len() + 3) as u64 * 4096
        );
        assert_eq!(one_go.read[0].rss, 300 * 4096, "statm after the read");

        // Stopped after every pagemap read: several slices per process.
        let mut sliced = Rolling::new(4096);
        let mut slices = 0;
        let last = loop {
            let s = sliced
                .slice(proc.path(), &pids, now, &mut || true)
                .expect("slice");
            slices += 1;
            if s.whole {
                break s;
            }
            assert!(slices < 100, "no progress");
        };
        assert!(slices >= 5, "{slices} slices");
        assert_eq!(last.bytes, one_go.bytes);
        assert_eq!(last.alone, one_go.alone);
    }

    /// What once went wrong under load: a worker copying 8 MiB bursts was
    /// read, then its faults were taken a burst later; the burst was in
    /// neither the read nor the estimate counted from those faults, which
    /// ended 8 MiB low. Counted from midway, it is off by at most half.
    #[test]
    fn a_read_that_took_a_while_counts_faults_from_midway() {
        assert_eq!(midway(Some(1000), Some(3048)), Some(2024));
        assert_eq!(midway(Some(1000), Some(1000)), Some(1000));
        assert_eq!(midway(None, Some(7)), Some(7));
        assert_eq!(midway(Some(7), None), Some(7), "gone before the second");
        assert_eq!(midway(Some(9), Some(7)), Some(9), "never backwards");
    }

    #[test]
    fn a_process_is_read_again_when_its_faults_move_or_it_is_stale() {
        let parent: Vec<(u64, u64)> = (0..100).map(|p| (p, 5000 + p)).collect();
        let r: &[(u64, u64)] = &[(0, 100)];
        let proc = fake_proc(&[
            FakeProcess {
                pid: 20,
                ranges: r,
                pages: &parent,
                file_from: 60,
                faults: 7,
            },
            FakeProcess {
                pid: 21,
                ranges: r,
                pages: &parent,
                file_from: 60,
                faults: 7,
            },
        ]);
        let t0 = Instant::now();
        let mut roll = Rolling::new(4096);
        let s = whole(&mut roll, proc.path(), &[20, 21], t0);
        assert_eq!(
            (s.bytes, s.read.len()),
            (100 * 4096, 2),
            "a fork shares all"
        );
        assert_eq!(s.alone, [(20, 0), (21, 0)]);
        assert_eq!(s.shared_bytes, 40 * 4096, "the file pages, once");

        // Nothing moved: nothing is read, the figure stands.
        let s = whole(
            &mut roll,
            proc.path(),
            &[20, 21],
            t0 + Duration::from_secs(1),
        );
        assert_eq!((s.bytes, s.read.len(), s.whole), (100 * 4096, 0, true));

        // The fork writes to 30 of the shared pages: copies on write, no
        // change of its RSS, 30 faults. It alone is read, and the copies
        // count.
        let mut copied = parent.clone();
        for (page, pfn) in copied.iter_mut().take(30) {
            *pfn = 90_000 + *page;
        }
        write_proc(
            proc.path(),
            &FakeProcess {
                pid: 21,
                ranges: r,
                pages: &copied,
                file_from: 60,
                faults: 37,
            },
        );
        let s = whole(
            &mut roll,
            proc.path(),
            &[20, 21],
            t0 + Duration::from_secs(2),
        );
        assert_eq!(s.read.iter().map(|s| s.pid).collect::<Vec<_>>(), [21]);
        assert_eq!(s.bytes, 130 * 4096);
        assert_eq!(s.alone, [(20, 30 * 4096), (21, 30 * 4096)]);
        assert_eq!(s.shared_bytes, 40 * 4096, "copies are anonymous");

        // Stale: read again though its faults did not move.
        let s = whole(
            &mut roll,
            proc.path(),
            &[20, 21],
            t0 + STALE + Duration::from_secs(1),
        );
        assert_eq!(s.read.iter().map(|s| s.pid).collect::<Vec<_>>(), [20]);

        // The most faulted first: a slice that stops after one process
        // reads the one with more faults since.
        write_proc(
            proc.path(),
            &FakeProcess {
                pid: 20,
                ranges: r,
                pages: &parent,
                file_from: u64::MAX,
                faults: 9,
            },
        );
        write_proc(
            proc.path(),
            &FakeProcess {
                pid: 21,
                ranges: r,
                pages: &copied,
                file_from: u64::MAX,
                faults: 500,
            },
        );
        let s = roll
            .slice(
                proc.path(),
                &[20, 21],
                t0 + STALE + Duration::from_secs(2),
                &mut || true,
            )
            .expect("slice");
        assert_eq!(s.read.iter().map(|s| s.pid).collect::<Vec<_>>(), [21]);
        assert!(!s.whole);

        // The parent leaves: exactly the pages it alone held go with it.
        let s = whole(
            &mut roll,
            proc.path(),
            &[21],
            t0 + STALE + Duration::from_secs(3),
        );
        assert_eq!(s.bytes, 100 * 4096);
        assert_eq!(s.alone, [(21, 100 * 4096)]);
    }

    #[test]
    fn a_parent_due_is_read_before_its_never_read_forks() {
        // A parent read when it held 40 pages writes 60 more and forks: the
        // fork maps all 100. Read first, the fork would bring the 60 into
        // the count while the parent's carried-forward figure holds them.
        let early: Vec<(u64, u64)> = (0..40).map(|p| (p, 7000 + p)).collect();
        let all: Vec<(u64, u64)> = (0..100).map(|p| (p, 7000 + p)).collect();
        let r: &[(u64, u64)] = &[(0, 100)];
        let parent = |pages, faults| FakeProcess {
            pid: 40,
            ranges: r,
            pages,
            file_from: u64::MAX,
            faults,
        };
        let proc = fake_proc(&[parent(&early, 40)]);
        let t0 = Instant::now();
        let mut roll = Rolling::new(4096);
        whole(&mut roll, proc.path(), &[40], t0);
        write_proc(proc.path(), &parent(&all, 100));
        write_proc(
            proc.path(),
            &FakeProcess {
                pid: 41,
                ..parent(&all, 100)
            },
        );
        let stat = proc.path().join("41/stat");
        let text = std::fs::read_to_string(&stat).expect("stat");
        std::fs::write(&stat, text.replacen(" S 1 ", " S 40 ", 1)).expect("ppid");
        let s = roll
            .slice(proc.path(), &[40, 41], t0, &mut || true)
            .expect("slice");
        assert_eq!(s.read.iter().map(|s| s.pid).collect::<Vec<_>>(), [40]);
        let s = whole(&mut roll, proc.path(), &[40, 41], t0);
        assert_eq!(s.read.iter().map(|s| s.pid).collect::<Vec<_>>(), [41]);
        assert_eq!(s.bytes, 100 * 4096);
    }

    #[test]
    fn this_process_pages_are_counted_or_unreadable() {
        let page = crate::sys::page_size();
        let me = std::process::id();
        let mut roll = Rolling::new(page);
        let s = whole(&mut roll, Path::new("/proc"), &[me], Instant::now());
        assert_eq!(s.read.len(), 1);
        if s.unreadable {
            // Without root the PFNs read as 0.
            assert_eq!(s.bytes, 0);
        } else {
            assert!(
                s.bytes > 0 && s.bytes <= s.read[0].rss,
                "{} bytes of pages, RSS {}",
                s.bytes,
                s.read[0].rss
            );
            assert_eq!(s.alone.len(), 1);
            assert!(s.alone[0].0 == me && s.alone[0].1 > 0 && s.alone[0].1 <= s.bytes);
        }
    }

    /// The USS a read of the count gives (pages mapped once) is the one
    /// `smaps_rollup` gives (its private pages), for a real process holding
    /// still (stopped).
    #[test]
    fn a_reads_uss_is_smaps_rollups_private_pages() {
        use std::process::{Command, Stdio};
        let mut child = Command::new("python3")
            .args([
                "-c",
                "import os, signal\nb = bytearray(32 << 20)\n\
                 for i in range(0, len(b), 4096): b[i] = 1\n\
                 os.kill(os.getpid(), signal.SIGSTOP)\n",
            ])
            .stdin(Stdio::null())
            .spawn()
            .expect("python3");
        let pid = child.id();
        let stat = format!("/proc/{pid}/stat");
        let stopped = (0..6000).any(|_| {
            let s = std::fs::read_to_string(&stat).unwrap_or_default();
            let state = s
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next());
            if state == Some("T") {
                return true;
            }
            std::thread::yield_now();
            std::thread::sleep(Duration::from_millis(10));
            false
        });
        let read = stopped.then(|| {
            let mut roll = Rolling::new(crate::sys::page_size());
            let s = whole(&mut roll, Path::new("/proc"), &[pid], Instant::now());
            let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).expect("smaps");
            (
                s,
                crate::sample::parse::parse_smaps_rollup(&text).expect("parse"),
            )
        });
        let _ = child.kill();
        let _ = child.wait();
        let (s, (_, private)) = read.expect("the child stopped itself within 60 s");
        let uss = s.read[0].uss.expect("a count's read gives a USS");
        assert!(uss > 32 << 20, "{uss}");
        assert!(
            uss.abs_diff(private) <= private / 100,
            "pagemap USS {uss} vs smaps_rollup private {private}"
        );
    }

    #[test]
    fn forks_holding_the_same_pages_keep_one_copy_of_them() {
        // A parent and 15 forks map the same 100,000 pages (390 MiB) in
        // runs of 10,000 frames; one fork has copied 3 pages on write.
        let parent: Vec<(u64, u64)> = (0..100_000)
            .map(|p| (p, 1_000_000 + (p / 10_000) * 20_000 + p % 10_000))
            .collect();
        let mut copied = parent.clone();
        for (i, e) in copied.iter_mut().take(3).enumerate() {
            e.1 = 50_000_000 + i as u64;
        }
        let r: &[(u64, u64)] = &[(0, 100_000)];
        let procs: Vec<FakeProcess<'_>> = (0..16u32)
            .map(|i| FakeProcess {
                pid: 40 + i,
                ranges: r,
                pages: if i == 5 { &copied } else { &parent },
                file_from: u64::MAX,
                faults: 1,
            })
            .collect();
        let proc = fake_proc(&procs);
        let pids: Vec<u32> = (40..56).collect();
        let mut roll = Rolling::new(4096);
        let s = whole(&mut roll, proc.path(), &pids, Instant::now());
        assert_eq!(s.bytes, (100_000 + 3) * 4096);
        let fork = s.alone.iter().find(|a| a.0 == 45).expect("fork");
        assert_eq!(fork.1, 3 * 4096, "its copies alone");
        assert!(s.alone.iter().filter(|a| a.0 != 45).all(|a| a.1 == 0));
        // Four bytes a page per process would be 6.4 MiB.
        assert!(roll.kept_bytes() < 4096, "{} bytes kept", roll.kept_bytes());
    }
}
