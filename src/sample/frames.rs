//! Sets of physical page frames, kept per process by the page count
//! ([`super::pages`]) in memory that does not grow with the job.
//!
//! A set is split into blocks of [`BLOCK_FRAMES`] consecutive frames (256
//! MiB of physical memory at 4 KiB pages), and each block is stored the
//! smallest of three ways: the runs of consecutive frames it holds (a huge
//! page is one run; memory touched in order is mostly a few runs), the
//! sorted frames (a few scattered pages), or one bit per frame (anything
//! else: at most 8 KiB per block, one bit per physical page). Blocks are
//! immutable and shared: a block equal to one another process holds is
//! kept once ([`Interner`]), so a parent and the forks that have not
//! written to a region of memory hold it in one copy, however many forks.
//!
//! The union of many sets, the frames held more than once and each set's
//! frames no other set holds are counted block by block ([`count`]), in a
//! scratch of two bitmaps of one block each: no bitmap of the whole
//! machine's memory is needed.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Frames per block (a power of two).
pub(crate) const BLOCK_FRAMES: u64 = 1 << 16;
const WORDS: usize = (BLOCK_FRAMES / 64) as usize;

/// The frames of one block, as offsets from its first frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Block {
    /// Runs `(first, last)` of consecutive frames, sorted and disjoint.
    Runs(Box<[(u16, u16)]>),
    /// Sorted frames.
    Frames(Box<[u16]>),
    /// One bit per frame.
    Bits(Box<[u64; WORDS]>),
}

impl Block {
    /// Frames in the block.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        match self {
            Block::Runs(r) => r
                .iter()
                .map(|&(a, b)| u64::from(b) - u64::from(a) + 1)
                .sum(),
            Block::Frames(f) => f.len() as u64,
            Block::Bits(w) => w.iter().map(|w| u64::from(w.count_ones())).sum(),
        }
    }

    /// Heap bytes it takes.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Block::Runs(r) => r.len() * 4,
            Block::Frames(f) => f.len() * 2,
            Block::Bits(_) => WORDS * 8,
        }
    }

    /// The smallest form of the frames set in `bits`, whose non-empty
    /// words are those set in `summary`: only those are visited, so a
    /// block of a few scattered frames costs what it holds.
    fn from_bits(bits: &[u64; WORDS], summary: &[u64; SUMMARY]) -> Block {
        // Frames, and runs: a run starts at each set bit whose predecessor
        // is clear.
        let (mut count, mut runs) = (0usize, 0usize);
        each_word(summary, |i| {
            let w = bits[i];
            let carry = if i > 0 { bits[i - 1] >> 63 } else { 0 };
            count += w.count_ones() as usize;
            runs += (w & !((w << 1) | carry)).count_ones() as usize;
        });
        let (as_runs, as_frames, as_bits) = (runs * 4, count * 2, WORDS * 8);
        if as_runs <= as_frames && as_runs <= as_bits {
            let mut out: Vec<(u16, u16)> = Vec::with_capacity(runs);
            each_word(summary, |i| {
                let mut w = bits[i];
                while w != 0 {
                    let start = w.trailing_zeros() as usize;
                    let len = (!(w >> start)).trailing_zeros() as usize;
                    let (first, last) = (i * 64 + start, i * 64 + start + len - 1);
                    match out.last_mut() {
                        Some(r) if usize::from(r.1) + 1 == first => r.1 = last as u16,
                        _ => out.push((first as u16, last as u16)),
                    }
                    w = if start + len >= 64 {
                        0
                    } else {
                        w & (u64::MAX << (start + len))
                    };
                }
            });
            Block::Runs(out.into_boxed_slice())
        } else if as_frames <= as_bits {
            let mut out = Vec::with_capacity(count);
            each_word(summary, |i| {
                let mut w = bits[i];
                while w != 0 {
                    out.push((i * 64) as u16 + w.trailing_zeros() as u16);
                    w &= w - 1;
                }
            });
            Block::Frames(out.into_boxed_slice())
        } else {
            Block::Bits(Box::new(*bits))
        }
    }

    /// The smallest form of a block being read one bit per frame.
    fn from_dense(bits: &[u64; WORDS]) -> Block {
        let mut summary = [0u64; SUMMARY];
        for (i, &w) in bits.iter().enumerate() {
            if w != 0 {
                summary[i / 64] |= 1u64 << (i % 64);
            }
        }
        Block::from_bits(bits, &summary)
    }

    /// The smallest form of `offsets` (in any order, perhaps repeated),
    /// set as bits in `scratch` (clear before and after): the bitmap sorts
    /// and dedups them in one pass, where a comparison sort of a block's
    /// scattered frames took most of a read's time in a debug build.
    fn from_offsets(offsets: &[u16], scratch: &mut Scratch) -> Block {
        for &o in offsets {
            let i = usize::from(o) / 64;
            scratch.bits[i] |= 1u64 << (o % 64);
            scratch.summary[i / 64] |= 1u64 << (i % 64);
        }
        let block = Block::from_bits(&scratch.bits, &scratch.summary);
        let bits = &mut scratch.bits;
        each_word(&scratch.summary, |i| bits[i] = 0);
        scratch.summary = [0; SUMMARY];
        block
    }

    /// Calls `f(word index, bits)` for each non-empty word of the block.
    fn for_each_word(&self, mut f: impl FnMut(usize, u64)) {
        match self {
            Block::Bits(w) => {
                for (i, &w) in w.iter().enumerate() {
                    if w != 0 {
                        f(i, w);
                    }
                }
            }
            Block::Frames(fr) => {
                let mut at = usize::MAX;
                let mut word = 0u64;
                for &x in fr.iter() {
                    let i = usize::from(x) / 64;
                    if i != at {
                        if word != 0 {
                            f(at, word);
                        }
                        at = i;
                        word = 0;
                    }
                    word |= 1u64 << (x % 64);
                }
                if word != 0 {
                    f(at, word);
                }
            }
            Block::Runs(r) => {
                for &(a, b) in r.iter() {
                    let (a, b) = (usize::from(a), usize::from(b));
                    for i in a / 64..=b / 64 {
                        let lo = if i == a / 64 { a % 64 } else { 0 };
                        let hi = if i == b / 64 { b % 64 } else { 63 };
                        let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
                        f(i, mask);
                    }
                }
            }
        }
    }
}

/// Words of a block's summary: one bit per word of the block.
const SUMMARY: usize = WORDS / 64;

/// Calls `f(i)` for each word `i` set in `summary`, in order.
fn each_word(summary: &[u64; SUMMARY], mut f: impl FnMut(usize)) {
    for (s, &w) in summary.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            f(s * 64 + w.trailing_zeros() as usize);
            w &= w - 1;
        }
    }
}

/// A block's bits and their summary, clear between uses.
#[derive(Debug)]
struct Scratch {
    bits: [u64; WORDS],
    summary: [u64; SUMMARY],
}

/// One process's frames: its blocks, sorted by block number.
#[derive(Debug, Default, Clone)]
pub(crate) struct FrameSet {
    blocks: Vec<(u64, Arc<Block>)>,
}

impl FrameSet {
    /// Frames in the set.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.blocks.iter().map(|(_, b)| b.len()).sum()
    }

    /// Whether `frame` is in the set.
    #[cfg(test)]
    pub(crate) fn contains(&self, frame: u64) -> bool {
        let key = frame / BLOCK_FRAMES;
        let off = (frame % BLOCK_FRAMES) as u16;
        let Ok(i) = self.blocks.binary_search_by_key(&key, |(k, _)| *k) else {
            return false;
        };
        match &*self.blocks[i].1 {
            Block::Runs(r) => r.iter().any(|&(a, b)| a <= off && off <= b),
            Block::Frames(f) => f.binary_search(&off).is_ok(),
            Block::Bits(w) => w[usize::from(off) / 64] >> (off % 64) & 1 == 1,
        }
    }

    #[cfg(test)]
    pub(crate) fn blocks(&self) -> impl Iterator<Item = &Arc<Block>> {
        self.blocks.iter().map(|(_, b)| b)
    }
}

/// A set being read, block by block: the frames as they come while a
/// block holds few (two bytes each), one bit per frame once it holds more
/// than [`SPARSE_MAX`] (8 KiB): at most one bit per physical page, for one
/// process at a time.
#[derive(Debug, Default)]
pub(crate) struct Builder {
    blocks: Vec<(u64, Building)>,
    /// Where each block numbered below [`NEAR_BLOCKS`] is in `blocks`,
    /// plus one (0: none yet), as long as the highest seen: an entry per
    /// 256 MiB of the machine. A hash lookup per page (the frames of a
    /// process's neighbouring pages are mostly in different blocks) took
    /// a fifth of a read's time in a debug build.
    near: Vec<u32>,
    /// Blocks numbered from [`NEAR_BLOCKS`] on (frames past 16 TiB).
    far: HashMap<u64, usize>,
}

/// Block numbers found by index, not by hash.
const NEAR_BLOCKS: u64 = 1 << 16;

const SPARSE_MAX: usize = WORDS * 4;

#[derive(Debug)]
enum Building {
    /// Offsets as inserted (unsorted, perhaps repeated).
    Sparse(Vec<u16>),
    Dense(Box<[u64; WORDS]>),
}

impl Builder {
    pub(crate) fn insert(&mut self, frame: u64) {
        let key = frame / BLOCK_FRAMES;
        let at = if key < NEAR_BLOCKS {
            let k = key as usize;
            if k >= self.near.len() {
                self.near.resize(k + 1, 0);
            }
            match self.near[k] {
                0 => {
                    self.blocks.push((key, Building::Sparse(Vec::new())));
                    self.near[k] = self.blocks.len() as u32;
                    self.blocks.len() - 1
                }
                i => i as usize - 1,
            }
        } else {
            let next = self.blocks.len();
            let i = *self.far.entry(key).or_insert(next);
            if i == next {
                self.blocks.push((key, Building::Sparse(Vec::new())));
            }
            i
        };
        let off = (frame % BLOCK_FRAMES) as u16;
        let block = &mut self.blocks[at].1;
        match block {
            Building::Sparse(v) if v.len() < SPARSE_MAX => v.push(off),
            Building::Sparse(v) => {
                let mut bits = Box::new([0u64; WORDS]);
                for &o in v.iter().chain([&off]) {
                    bits[usize::from(o) / 64] |= 1u64 << (o % 64);
                }
                *block = Building::Dense(bits);
            }
            Building::Dense(bits) => bits[usize::from(off) / 64] |= 1u64 << (off % 64),
        }
    }

    /// The set, its blocks shared with equal ones already held.
    pub(crate) fn finish(self, interner: &mut Interner) -> FrameSet {
        let mut scratch = Box::new(Scratch {
            bits: [0; WORDS],
            summary: [0; SUMMARY],
        });
        let mut blocks: Vec<(u64, Arc<Block>)> = self
            .blocks
            .into_iter()
            .map(|(key, b)| {
                let block = match b {
                    Building::Dense(bits) => Block::from_dense(&bits),
                    Building::Sparse(v) => Block::from_offsets(&v, &mut scratch),
                };
                (key, interner.intern(key, block))
            })
            .collect();
        blocks.sort_unstable_by_key(|(k, _)| *k);
        FrameSet { blocks }
    }
}

/// The blocks held by any set, each kept once.
#[derive(Debug, Default)]
pub(crate) struct Interner {
    blocks: HashMap<(u64, u64), Vec<Arc<Block>>>,
}

impl Interner {
    fn intern(&mut self, key: u64, block: Block) -> Arc<Block> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        block.hash(&mut h);
        let same = self.blocks.entry((key, h.finish())).or_default();
        if let Some(b) = same.iter().find(|b| ***b == block) {
            return Arc::clone(b);
        }
        let b = Arc::new(block);
        same.push(Arc::clone(&b));
        b
    }

    /// Forgets the blocks no set holds any more.
    pub(crate) fn prune(&mut self) {
        self.blocks.retain(|_, v| {
            v.retain(|b| Arc::strong_count(b) > 1);
            !v.is_empty()
        });
    }

    /// Heap bytes of the blocks kept, each counted once.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.blocks.values().flatten().map(|b| b.bytes() + 48).sum()
    }
}

/// What [`count`] found: frames in any set, frames of the `shared` sets,
/// and for each set the frames no other set holds.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Counted {
    pub(crate) union: u64,
    pub(crate) shared: u64,
    pub(crate) alone: Vec<u64>,
}

/// Counts the union of `sets` (each `(owner, set, shared)`), the frames
/// of the union held by a `shared` set (file pages and shared memory), and
/// for each owner the frames of its sets no other owner holds. An owner
/// may hand in several sets (its anonymous and its shared pages); a frame
/// two owners hold is alone to neither.
pub(crate) fn count(sets: &[(usize, &FrameSet, bool)], owners: usize) -> Counted {
    // (block number, block, owner, shared), grouped by block number.
    let mut all: Vec<(u64, &Arc<Block>, usize, bool)> = sets
        .iter()
        .flat_map(|&(owner, set, shared)| {
            set.blocks.iter().map(move |(k, b)| (*k, b, owner, shared))
        })
        .collect();
    all.sort_unstable_by_key(|e| (e.0, e.2));
    let mut out = Counted {
        alone: vec![0; owners],
        ..Counted::default()
    };
    // Scratch for one block number at a time; only the words touched are
    // visited and cleared, so a sparse block costs what it holds.
    let mut once = vec![0u64; WORDS];
    let mut twice = vec![0u64; WORDS];
    let mut shared = vec![0u64; WORDS];
    // One owner's frames in this block: a frame an owner holds in two of
    // its sets is still its alone.
    let mut mine = vec![0u64; WORDS];
    let mut touched: Vec<usize> = Vec::new();
    let mut mine_touched: Vec<usize> = Vec::new();
    let gather = |owner: &[(u64, &Arc<Block>, usize, bool)],
                  mine: &mut [u64],
                  mine_touched: &mut Vec<usize>,
                  shared: &mut [u64]| {
        mine_touched.clear();
        for &(_, block, _, is_shared) in owner {
            block.for_each_word(|i, w| {
                if mine[i] == 0 {
                    mine_touched.push(i);
                }
                mine[i] |= w;
                if is_shared {
                    shared[i] |= w;
                }
            });
        }
    };
    let mut no_shared = vec![0u64; WORDS];
    for group in all.chunk_by(|a, b| a.0 == b.0) {
        touched.clear();
        for owner in group.chunk_by(|a, b| a.2 == b.2) {
            gather(owner, &mut mine, &mut mine_touched, &mut shared);
            for &i in &mine_touched {
                if once[i] == 0 {
                    touched.push(i);
                }
                twice[i] |= once[i] & mine[i];
                once[i] |= mine[i];
                mine[i] = 0;
            }
        }
        for &i in &touched {
            out.union += u64::from(once[i].count_ones());
            out.shared += u64::from(shared[i].count_ones());
        }
        for owner in group.chunk_by(|a, b| a.2 == b.2) {
            gather(owner, &mut mine, &mut mine_touched, &mut no_shared);
            let mut n = 0u64;
            for &i in &mine_touched {
                n += u64::from((mine[i] & !twice[i]).count_ones());
                mine[i] = 0;
            }
            out.alone[owner[0].2] += n;
        }
        for &i in &touched {
            once[i] = 0;
            twice[i] = 0;
            shared[i] = 0;
            no_shared[i] = 0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn set(frames: impl IntoIterator<Item = u64>, interner: &mut Interner) -> FrameSet {
        let mut b = Builder::default();
        for f in frames {
            b.insert(f);
        }
        b.finish(interner)
    }

    /// The same count, the plain way: each frame's owners.
    fn naive(sets: &[(usize, Vec<u64>, bool)], owners: usize) -> Counted {
        // Frame -> (an owner, held by another too).
        let mut holders: HashMap<u64, (usize, bool)> = HashMap::new();
        let mut shared = BTreeSet::new();
        for (o, frames, s) in sets {
            for &f in frames {
                let h = holders.entry(f).or_insert((*o, false));
                h.1 |= h.0 != *o;
                if *s {
                    shared.insert(f);
                }
            }
        }
        let mut alone = vec![0; owners];
        for &(o, more) in holders.values() {
            if !more {
                alone[o] += 1;
            }
        }
        Counted {
            union: holders.len() as u64,
            shared: shared.len() as u64,
            alone,
        }
    }

    /// A small deterministic generator (xorshift), so the test needs no
    /// crate and fails the same way every time.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    fn check(sets: Vec<(usize, Vec<u64>, bool)>, owners: usize) -> (Counted, usize) {
        let mut interner = Interner::default();
        let built: Vec<(usize, FrameSet, bool)> = sets
            .iter()
            .map(|(o, f, s)| (*o, set(f.iter().copied(), &mut interner), *s))
            .collect();
        for ((_, frames, _), (_, s, _)) in sets.iter().zip(&built) {
            let distinct: BTreeSet<u64> = frames.iter().copied().collect();
            assert_eq!(s.len(), distinct.len() as u64);
            assert!(frames.iter().all(|&f| s.contains(f)));
            assert!(!s.contains(u64::MAX / 2), "a frame never inserted");
        }
        let refs: Vec<(usize, &FrameSet, bool)> =
            built.iter().map(|(o, s, sh)| (*o, s, *sh)).collect();
        let got = count(&refs, owners);
        assert_eq!(got, naive(&sets, owners));
        (got, interner.bytes())
    }

    #[test]
    fn scattered_frames_count_exactly() {
        // Three processes, 50,000 frames each scattered over 2^40 frames
        // and over a dense 2^20 (a few hits in common), one of them file
        // pages.
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        let sets: Vec<(usize, Vec<u64>, bool)> = (0..3)
            .map(|o| {
                let frames = (0..50_000)
                    .map(|i| {
                        if i % 2 == 0 {
                            r.next() % (1 << 40)
                        } else {
                            r.next() % (1 << 20)
                        }
                    })
                    .collect();
                (o, frames, o == 2)
            })
            .collect();
        check(sets, 3);
    }

    #[test]
    fn long_runs_and_huge_pages_take_a_few_bytes() {
        // 2 GiB in 2 MiB huge pages (512 frames each), consecutive: a run
        // per block, whatever its size.
        let frames: Vec<u64> = (1_000_000..1_000_000 + (2u64 << 30) / 4096).collect();
        let (got, bytes) = check(vec![(0, frames.clone(), false)], 1);
        assert_eq!(got.union, frames.len() as u64);
        assert!(bytes < 1024, "{bytes} bytes for 2 GiB of runs");
        // Runs broken every other huge page: still one entry per run.
        let holes: Vec<u64> = frames
            .iter()
            .copied()
            .filter(|f| (f / 512) % 2 == 0)
            .collect();
        let (_, bytes) = check(vec![(0, holes, false)], 1);
        assert!(bytes < 16 << 10, "{bytes} bytes for 1,024 huge pages");
    }

    #[test]
    fn many_processes_sharing_keep_one_copy() {
        // 64 forks of a parent holding 128 MiB scattered over 512 MiB of
        // physical memory (no runs at all), each with 100 pages of its own
        // and 100 of the parent's copied away (no longer mapped).
        let mut r = Rng(12345);
        let mut parent = BTreeSet::new();
        while parent.len() < (128 << 20) / 4096 {
            parent.insert(r.next() % (1 << 17));
        }
        let parent: Vec<u64> = parent.into_iter().collect();
        let mut sets = vec![(0, parent.clone(), false)];
        for o in 1..=64 {
            let start = (o * 100) % parent.len();
            let gone: BTreeSet<u64> = parent[start..start + 100].iter().copied().collect();
            let mut frames: Vec<u64> = parent
                .iter()
                .copied()
                .filter(|f| !gone.contains(f))
                .collect();
            frames.extend((0..100).map(|i| (1 << 30) + (o as u64) * 1000 + i));
            sets.push((o, frames, false));
        }
        let (got, bytes) = check(sets, 65);
        assert_eq!(got.union, parent.len() as u64 + 64 * 100);
        // The parent's pages copied away by a fork are alone to whoever
        // still holds them only if one process does: here every other
        // fork still maps them.
        assert_eq!(got.alone[0], 0);
        assert!(got.alone[1..].iter().all(|&a| a == 100));
        // 2 blocks of one bit per frame (16 KiB) for the parent's; each
        // fork differs in one or two of them: far from 65 copies of 128
        // MiB of frame numbers (65 × 128 KiB at four bytes a page).
        assert!(bytes < (65 * 20) << 10, "{bytes} bytes");
    }

    #[test]
    fn runs_crossing_words_are_kept_whole() {
        // A few frames (read as a sparse block), in runs that cross word
        // boundaries, a full word, the block's last frame, out of order.
        let mut frames: Vec<u64> = (60..200).chain(319..322).chain(448..512).collect();
        frames.push(BLOCK_FRAMES - 1);
        frames.reverse();
        let mut interner = Interner::default();
        let s = set(frames.iter().copied(), &mut interner);
        let blocks: Vec<&Arc<Block>> = s.blocks().collect();
        assert_eq!(blocks.len(), 1);
        let last = (BLOCK_FRAMES - 1) as u16;
        assert_eq!(
            **blocks[0],
            Block::Runs(vec![(60, 199), (319, 321), (448, 511), (last, last)].into())
        );
        check(vec![(0, frames, false)], 1);
    }

    #[test]
    fn identical_sets_share_their_blocks() {
        let mut interner = Interner::default();
        let a = set(0..100_000u64, &mut interner);
        let b = set(0..100_000u64, &mut interner);
        for (x, y) in a.blocks().zip(b.blocks()) {
            assert!(Arc::ptr_eq(x, y));
        }
        let one = interner.bytes();
        drop(a);
        drop(b);
        interner.prune();
        assert_eq!(interner.bytes(), 0);
        assert!(one > 0);
    }

    #[test]
    fn an_owner_holding_a_frame_twice_still_holds_it_alone() {
        let sets = vec![
            (0, vec![1, 2, 3], false),
            (0, vec![3, 4], true),
            (1, vec![4, 5], true),
        ];
        let (got, _) = check(sets, 2);
        assert_eq!(got.union, 5);
        assert_eq!(got.alone, [3, 1]);
        assert_eq!(got.shared, 3);
    }
}
