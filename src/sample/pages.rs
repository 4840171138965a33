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
pub struct PfnSet {
    words: Vec<u64>,
    high: std::collections::HashSet<u64>,
    count: u64,
}

impl PfnSet {
    /// Empties the set, keeping its memory.
    pub fn clear(&mut self) {
        self.words.fill(0);
        self.high.clear();
        self.count = 0;
    }

    /// Adds `pfn`; true when it was not there.
    pub fn insert(&mut self, pfn: u64) -> bool {
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
    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// Buffers a pass reuses from one process to the next.
#[derive(Debug, Default)]
pub struct Scratch {
    words: Vec<u8>,
    text: String,
}

/// One process as the pass saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub pid: u32,
    /// Its resident and anonymous resident bytes (`statm`) just after its
    /// pages were read: what carries its figure forward after.
    pub rss: u64,
    pub anon: u64,
    /// Pages of this process no process read before it had (bytes); in a
    /// Σ Pss pass, its USS.
    pub first_seen: u64,
    /// Its Pss, in a Σ Pss pass.
    pub pss: Option<u64>,
}

/// A pass over the tree.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// Distinct resident pages of the processes read, in bytes.
    pub bytes: u64,
    pub seen: Vec<Seen>,
    /// Some present page came without its PFN: no permission to count.
    pub unreadable: bool,
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

/// Reads the pages of `pids` into `set` (cleared first). A process gone
/// meanwhile is left out; any other error is returned.
pub fn pass(root: &Path, pids: &[u32], page_size: u64, set: &mut PfnSet) -> io::Result<Pass> {
    set.clear();
    let mut out = Pass::default();
    let mut scratch = Scratch::default();
    for &pid in pids {
        add(root, pid, page_size, set, &mut out, &mut scratch)?;
    }
    Ok(out)
}

/// Adds one process's pages to a pass. A process gone meanwhile is left
/// out; any other error is returned.
pub fn add(
    root: &Path,
    pid: u32,
    page_size: u64,
    set: &mut PfnSet,
    out: &mut Pass,
    scratch: &mut Scratch,
) -> io::Result<()> {
    let dir = root.join(pid.to_string());
    let before = set.len();
    if scratch.words.is_empty() {
        scratch.words = vec![0u8; CHUNK_PAGES * 8];
    }
    match read_process(
        &dir,
        page_size,
        set,
        &mut scratch.words,
        &mut scratch.text,
        out,
    ) {
        Ok(Some((rss, anon))) => out.seen.push(Seen {
            pid,
            rss,
            anon,
            first_seen: (set.len() - before) * page_size,
            pss: None,
        }),
        Ok(None) => {}
        Err(e) if gone(&e) => {}
        Err(e) => return Err(e),
    }
    out.bytes = set.len() * page_size;
    Ok(())
}

fn gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ESRCH) | Some(libc::ENOENT))
        || e.kind() == io::ErrorKind::NotFound
}

/// One process: `statm`, then its mappings' pages. `None`: a zombie.
fn read_process(
    dir: &Path,
    page_size: u64,
    set: &mut PfnSet,
    words: &mut [u8],
    text: &mut String,
    out: &mut Pass,
) -> io::Result<Option<(u64, u64)>> {
    let statm = std::fs::read_to_string(dir.join("statm"))?;
    let (rss, anon) = parse_statm_anon(&statm, page_size).map_err(io::Error::other)?;
    if rss == 0 {
        return Ok(None);
    }
    text.clear();
    {
        use std::io::Read;
        File::open(dir.join("maps"))?.read_to_string(text)?;
    }
    let pagemap = File::open(dir.join("pagemap"))?;
    for (start, end) in coalesced(mappings(text), page_size) {
        let mut page = start / page_size;
        let last = end / page_size;
        while page < last {
            let n = ((last - page) as usize).min(CHUNK_PAGES);
            let buf = &mut words[..n * 8];
            let got = match pagemap.read_at(buf, page * 8) {
                Ok(got) => got,
                // A mapping removed since `maps` was read.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(e) => return Err(e),
            };
            if got == 0 {
                break;
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
                    out.unreadable = true;
                    continue;
                }
                set.insert(pfn);
            }
            page += (got / 8) as u64;
        }
    }
    // The figure is carried forward from what `statm` says after the pages
    // were read: memory the process took while they were read is then
    // counted once (by the pass, or not until the next one), never twice.
    let statm = std::fs::read_to_string(dir.join("statm"))?;
    let after = parse_statm_anon(&statm, page_size).map_err(io::Error::other)?;
    Ok(Some(if after.0 == 0 { (rss, anon) } else { after }))
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
            assert!(
                p.seen[1].first_seen < p.seen[0].first_seen / 2,
                "{:?}",
                p.seen
            );
        }
    }
}
