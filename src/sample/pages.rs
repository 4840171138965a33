//! The tree's distinct resident pages: every physical page mapped by any
//! process of the tree, counted once, read from `/proc/PID/pagemap`.
//!
//! For each process the pass lists its mappings (`/proc/PID/maps`, no page
//! walk), skips those that can hold no page (no access at all: guard
//! pages, address-space reservations), and reads the pagemap entries of
//! the rest: one 64-bit word per virtual page, whose bit 63 says the page
//! is resident and whose low 55 bits give its page frame number (PFN).
//! Each PFN is set in a bitmap; the pages newly set are the tree's.
//!
//! PFNs read as 0 without `CAP_SYS_ADMIN` (root): the pass then says it
//! cannot count, and the footprint uses Σ Pss instead. Pages swapped out
//! are not resident and not counted.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::parse::parse_statm_anon;

/// PFNs above this go to a hash set instead of the bitmap (a bitmap that
/// large would cost more memory than the machine's pages justify).
const BITMAP_MAX_PFN: u64 = 1 << 32;

/// Pagemap words read at a time.
const CHUNK_PAGES: usize = 16 * 1024;

const PRESENT: u64 = 1 << 63;
const PFN_MASK: u64 = (1 << 55) - 1;

/// The set of PFNs seen in one pass, reused between passes.
#[derive(Debug, Default)]
pub(crate) struct PfnSet {
    words: Vec<u64>,
    high: std::collections::HashSet<u64>,
    count: u64,
}

impl PfnSet {
    /// Empties the set, keeping its memory.
    pub(crate) fn clear(&mut self) {
        self.words.fill(0);
        self.high.clear();
        self.count = 0;
    }

    /// Adds `pfn`; true when it was not there.
    pub(crate) fn insert(&mut self, pfn: u64) -> bool {
        let new = if pfn < BITMAP_MAX_PFN {
            let w = (pfn / 64) as usize;
            if w >= self.words.len() {
                self.words.resize((w + 1).next_power_of_two(), 0);
            }
            let bit = 1u64 << (pfn % 64);
            let new = self.words[w] & bit == 0;
            self.words[w] |= bit;
            new
        } else {
            self.high.insert(pfn)
        };
        self.count += u64::from(new);
        new
    }

    /// Distinct PFNs inserted since the last clear.
    pub(crate) fn len(&self) -> u64 {
        self.count
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }
}

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
}

/// A pass over the tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Pass {
    /// Distinct resident pages of the processes read, in bytes.
    pub(crate) bytes: u64,
    pub(crate) seen: Vec<Seen>,
    /// Some present page came without its PFN: no permission to count.
    pub(crate) unreadable: bool,
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

#[cfg(test)]
/// Reads the pages of `pids` into `set` (cleared first), in one go. A
/// process gone meanwhile is left out; any other error is returned.
pub(crate) fn pass(
    root: &Path,
    pids: &[u32],
    page_size: u64,
    set: &mut PfnSet,
) -> io::Result<Pass> {
    let mut walk = Walk::new(page_size);
    std::mem::swap(&mut walk.set, set);
    let (pass, _, _) = walk.step(root, pids, true, &mut || false);
    std::mem::swap(&mut walk.set, set);
    pass
}

/// A process being read: where the read stopped.
#[derive(Debug)]
struct Cursor {
    pid: u32,
    pagemap: File,
    /// The ranges to read, in pages, and the next page to read.
    ranges: Vec<(u64, u64)>,
    at: usize,
    page: u64,
    /// The set's size when this process's read began.
    before: u64,
    /// Its `statm` (resident, anonymous) when its read began.
    statm: (u64, u64),
}

/// A page pass read in slices: a slice stops when its CPU time is spent,
/// between two pagemap reads — inside a process if need be, where the
/// next slice resumes — so no slice runs much past what it was allowed.
#[derive(Debug)]
pub(crate) struct Walk {
    page_size: u64,
    set: PfnSet,
    pass: Pass,
    current: Option<Cursor>,
    words: Vec<u8>,
    text: String,
}

impl Walk {
    pub(crate) fn new(page_size: u64) -> Walk {
        Walk {
            page_size,
            set: PfnSet::default(),
            pass: Pass::default(),
            current: None,
            words: Vec::new(),
            text: String::new(),
        }
    }

    /// Reads `pids` in order (`fresh`: as a new pass; else resuming the
    /// process the last slice stopped in, when it is `pids[0]`) until
    /// `stop` says so, checked after each pagemap read. Returns the pass so
    /// far, how many of `pids` are done (read or found gone), and whether
    /// all are. A process gone meanwhile is left out (what was read of it
    /// stays in the pass); any other error ends the pass.
    pub(crate) fn step(
        &mut self,
        root: &Path,
        pids: &[u32],
        fresh: bool,
        stop: &mut dyn FnMut() -> bool,
    ) -> (io::Result<Pass>, usize, bool) {
        if fresh {
            self.set.clear();
            self.pass = Pass::default();
            self.current = None;
        }
        let mut done = 0;
        for (i, &pid) in pids.iter().enumerate() {
            if i > 0 && stop() {
                break;
            }
            match self.read(root, pid, stop) {
                Ok(true) => done += 1,
                Ok(false) => break,
                Err(e) => {
                    self.current = None;
                    return (Err(e), done, true);
                }
            }
        }
        self.pass.bytes = self.set.len() * self.page_size;
        (Ok(self.pass.clone()), done, done == pids.len())
    }

    /// Reads (on) `pid`: true when done with it.
    fn read(&mut self, root: &Path, pid: u32, stop: &mut dyn FnMut() -> bool) -> io::Result<bool> {
        if self.current.as_ref().is_none_or(|c| c.pid != pid) {
            self.current = None;
            match self.open(root, pid) {
                Ok(Some(c)) => self.current = Some(c),
                Ok(None) => return Ok(true),
                Err(e) if gone(&e) => return Ok(true),
                Err(e) => return Err(e),
            }
        }
        let Some(cur) = self.current.as_mut() else {
            return Ok(true);
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
                let pfn = v & PFN_MASK;
                if pfn == 0 {
                    self.pass.unreadable = true;
                    continue;
                }
                self.set.insert(pfn);
            }
            cur.page = page + (got / 8) as u64;
            if stop() {
                return Ok(false);
            }
        }
        // The figure is carried forward from what `statm` says after the
        // pages were read: memory the process took while they were read is
        // then counted once (by the pass, or not until the next one), never
        // twice. A process that left mid-read keeps what was read of it.
        let after = if left {
            None
        } else {
            std::fs::read_to_string(root.join(pid.to_string()).join("statm"))
                .ok()
                .and_then(|t| parse_statm_anon(&t, self.page_size).ok())
                .filter(|s| s.0 > 0)
        };
        let (rss, anon) = after.unwrap_or(cur.statm);
        self.pass.seen.push(Seen {
            pid,
            rss,
            anon,
            first_seen: (self.set.len() - cur.before) * self.page_size,
            pss: None,
        });
        self.current = None;
        Ok(true)
    }

    /// Starts reading `pid`: its `statm`, mappings and pagemap. `None`: a
    /// zombie.
    fn open(&mut self, root: &Path, pid: u32) -> io::Result<Option<Cursor>> {
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
            before: self.set.len(),
            statm,
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
    fn a_pfn_counts_once_wherever_it_is_seen() {
        let mut s = PfnSet::default();
        assert!(s.insert(5));
        assert!(!s.insert(5));
        assert!(s.insert(1 << 40));
        assert!(!s.insert(1 << 40));
        assert!(s.insert(100_000));
        assert_eq!(s.len(), 3);
        s.clear();
        assert!(s.is_empty());
        assert!(s.insert(5));
    }

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

    /// A procfs stand-in: each process's `statm`, `maps` and a `pagemap`
    /// file holding `(page, pfn)` entries (present), the rest not present.
    /// A process: its PID, mapped page ranges and `(page, pfn)` entries.
    type FakeProcess<'a> = (u32, &'a [(u64, u64)], &'a [(u64, u64)]);

    fn fake_proc(procs: &[FakeProcess<'_>]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for (pid, ranges, pages) in procs {
            let d = dir.path().join(pid.to_string());
            std::fs::create_dir(&d).expect("dir");
            std::fs::write(d.join("statm"), "1000 300 100 1 0 200 0\n").expect("statm");
            let maps: String = ranges
                .iter()
                .map(|(a, b)| format!("{:x}-{:x} rw-p 00000000 00:00 0\n", a * 4096, b * 4096))
                .collect();
            std::fs::write(d.join("maps"), maps).expect("maps");
            let end = ranges.iter().map(|r| r.1).max().unwrap_or(0);
            let mut words = vec![0u8; end as usize * 8];
            for (page, pfn) in pages.iter() {
                let v = PRESENT | pfn;
                words[*page as usize * 8..][..8].copy_from_slice(&v.to_le_bytes());
            }
            std::fs::write(d.join("pagemap"), words).expect("pagemap");
        }
        dir
    }

    #[test]
    fn a_pass_stopped_anywhere_resumes_to_the_same_count() {
        // Two processes over more than one pagemap read each; the second
        // shares half the first's pages (a fork) and has 3 of its own.
        let big = CHUNK_PAGES as u64 * 2 + 10;
        let first: Vec<(u64, u64)> = (0..big).step_by(7).map(|p| (p, 1000 + p)).collect();
        let mut second: Vec<(u64, u64)> = first.iter().step_by(2).copied().collect();
        second.extend([(big + 1, 9), (big + 2, 10), (big + 3, 11)]);
        let r1: &[(u64, u64)] = &[(0, big)];
        let r2: &[(u64, u64)] = &[(0, big), (big + 1, big + 4)];
        let proc = fake_proc(&[(10, r1, &first), (11, r2, &second), (12, r1, &[])]);
        let pids = [10, 11, 12, 13];
        let mut whole = Walk::new(4096);
        let (one_go, done, complete) = whole.step(proc.path(), &pids, true, &mut || false);
        let one_go = one_go.expect("pass");
        assert_eq!(
            (done, complete),
            (4, true),
            "a missing process counts as done"
        );
        assert_eq!(one_go.bytes, (first.len() as u64 + 3) * 4096);
        assert_eq!(one_go.seen.len(), 3);
        assert_eq!(one_go.seen[1].first_seen, 3 * 4096, "the fork's own pages");
        assert_eq!(one_go.seen[0].rss, 300 * 4096, "statm after the read");

        // Stopped after every pagemap read: several slices per process.
        let mut walk = Walk::new(4096);
        let mut todo: Vec<u32> = pids.to_vec();
        let mut fresh = true;
        let mut slices = 0;
        let last = loop {
            let (p, done, complete) = walk.step(proc.path(), &todo, fresh, &mut || true);
            fresh = false;
            slices += 1;
            todo.drain(..done);
            if complete {
                break p.expect("pass");
            }
            assert!(slices < 100, "no progress");
        };
        assert!(slices >= 5, "{slices} slices");
        assert_eq!(last, one_go);
    }

    #[test]
    fn this_process_pages_are_counted_or_unreadable() {
        let page = crate::sys::page_size();
        let mut set = PfnSet::default();
        let me = std::process::id();
        let p = pass(Path::new("/proc"), &[me, me], page, &mut set).expect("pass");
        assert_eq!(p.seen.len(), 2);
        if p.unreadable {
            // Without root the PFNs read as 0.
            assert_eq!(p.bytes, 0);
        } else {
            assert!(
                p.bytes > 0 && p.bytes <= p.seen[1].rss,
                "{} bytes of pages, RSS {} then {}",
                p.bytes,
                p.seen[0].rss,
                p.seen[1].rss
            );
            // The same pages again add nothing but what this process (the
            // pass, tests on other threads) touched in between.
            let grew = p.seen[1].rss.saturating_sub(p.seen[0].rss);
            assert!(
                p.seen[1].first_seen < p.seen[0].first_seen / 2 + grew,
                "{:?}",
                p.seen
            );
        }
    }
}
