//! What the tree's processes cost, read off the sampling thread: each
//! process's own cost (USS, Pss) and, as root, the tree's distinct
//! resident pages, carried forward between passes.
//!
//! # The tree's figure between passes
//!
//! The page count ([`super::pages`]) counts every physical page of the
//! tree once, but costs a page-table walk per process, so it reads one
//! process at a time, within the budget, the most changed first: the
//! figure is the count after the last slice (each process's pages as it
//! was last read) moved by what each process did since its read, as
//! `statm` shows it every tick:
//!
//! - a process read already adds its change of anonymous resident memory
//!   since (file and shared-memory pages it maps may be pages the tree
//!   already had — a library, a `share_memory_()` tensor — so they wait
//!   for its next read, which the page faults that mapped them make due);
//! - a process forked since (same command line as its parent) adds its
//!   anonymous memory beyond its parent's: a fork shares its parent's
//!   pages and adds none until it writes (it may have written before it
//!   was first seen, so its own first reading is no baseline);
//! - any other new process (a spawned or exec'd one) adds its anonymous
//!   memory (its file and shared pages — libraries the tree mostly holds
//!   already — wait for the next pass, due at once);
//! - a process that left takes only its own pages (those it alone held
//!   at its last read, or its last USS) with it: the pages it shared stay
//!   with the others, so the figure does not dip; a process that left a
//!   fork of itself behind (a worker's parent, a daemon forking away from
//!   its parent) takes nothing: its pages may all be its fork's now. The
//!   next slice forgets its pages and counts exactly what is left.
//!
//! A process never takes away more than the pages the last count found it
//! alone holds (none for a fork not read yet, none for a parent once it
//! forked, until its last fork has left): a fork that execs a subprocess,
//! a worker dropping what it inherited, a parent freeing what its workers
//! map, let go of pages others still hold. From the lowest point it
//! reaches, what it gains counts again.
//!
//! Copies on write (a worker touching its parent's Python objects: the
//! DataLoader "copy-on-read") change no `statm` figure; the page faults
//! that made them put the worker first in the next slice.
//!
//! Without root a pass sums each process's Pss instead ([`super::pss`]),
//! over all of them, carried forward by the same rules; such a pass is
//! dropped when a fork or an exit overlapped it (shares are then not
//! consistent) and the next one starts at once.
//!
//! # Each process's own cost
//!
//! Own-cost reads (`smaps_rollup`) and the page count share the reader
//! ([`OWN_SHARE`]), so neither starves the other; they go where a reading
//! lasts ([`Own::rank`]): a young worker once it holds what it grew to.
//! Each page count's read of a process is an own-cost reading too
//! ([`Own::counted`]).
//!
//! The budget does not always stretch to a read of every short-lived
//! worker once it holds its size: one that grew (in anonymous memory, or
//! in page faults, which copies on write take) and held it with no read
//! since is estimated instead, and marked so ([`Own::estimate`]). Young
//! forks' faults are read on the tick every [`FAULTS_EVERY`], so an
//! estimate does not wait for the page count to reach them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::own::{Found, OwnReader};
use super::pages::{Pass, Slice};
use super::pss::PassKind;

/// How often a Σ Pss pass is due when nothing calls for one sooner.
const PAGES_EVERY: Duration = Duration::from_secs(2);

/// How often the page count looks for processes to read again (their
/// fault counts) when nothing calls for it sooner.
const ROLL_EVERY: Duration = Duration::from_millis(500);

/// How often the sampler reads the page faults of young processes itself
/// (one small `/proc/PID/stat` read each), so that a worker copying its
/// parent's pages is estimated even when the page count, which reads them
/// too, cannot keep up.
const FAULTS_EVERY: Duration = Duration::from_millis(500);

/// A process this young is read for its own cost, before the longest
/// unread, once its age has doubled since its last read (at least
/// [`YOUNG_FIRST`] after it was first seen).
const YOUNG: Duration = Duration::from_secs(60);
const YOUNG_FIRST: Duration = Duration::from_millis(250);

/// A rise of a process's file and shared-memory pages beyond this makes a
/// pass (or a slice of the page count) due at once.
const SHARED_RISE: u64 = 4 << 20;

/// Own-cost reads' share of the reader's CPU time while the page count
/// (or a Σ Pss pass) has work too; the count has the rest. Each lends the
/// other what it leaves unused, and neither saves up a share it did not
/// use. Before the first count is whole the count has it all: the
/// headline rests on the pages.
const OWN_SHARE: f64 = 0.5;

/// A young process whose RSS rose beyond this since its last own-cost
/// reading has grown: it is read again first once its RSS has held (moved
/// by no more than [`MOVED`]) for [`HELD`], so the read finds the size it
/// grew to, not a step on the way; while it grows, when its age doubles.
const GREW: u64 = 2 << 20;
const MOVED: u64 = 1 << 20;
const HELD: Duration = Duration::from_millis(300);

/// One process as the sampler reads it every tick.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View {
    pub(crate) pid: u32,
    pub(crate) rss: u64,
    pub(crate) anon: u64,
    /// Forked from a followed process without exec: that process's
    /// anonymous bytes now.
    pub(crate) parent_anon: Option<u64>,
    /// Forked from this followed process (alive or not).
    pub(crate) parent: Option<u32>,
}

/// What is known of one process's cost.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Own {
    pub(crate) pss: Option<u64>,
    pub(crate) uss: Option<u64>,
    /// Read with this sample.
    pub(crate) fresh: bool,
    /// `pss` and `uss` are an estimate ([`Own::estimate`]), not a read.
    pub(crate) estimated: bool,
    /// Its last read USS and Pss (`uss`, `pss` may hold an estimate).
    read_uss: Option<u64>,
    read_pss: Option<u64>,
    /// Its anonymous bytes at its last own-cost reading (a fork's parent's
    /// at the fork, before any): what it wrote since is its own.
    anon_at_read: Option<u64>,
    /// Its page faults as the page count last found them, and at its last
    /// own-cost reading (a fork's start at 0).
    faults: Option<u64>,
    faults_at_read: Option<u64>,
    /// What it was estimated to have written or copied since its last
    /// read, when it was last estimated.
    estimated_wrote: Option<u64>,
    read_at: Option<Instant>,
    /// When it was first seen.
    born: Option<Instant>,
    /// The process it was forked from.
    parent: Option<u32>,
    /// The anonymous bytes its part of the page figure is counted from
    /// (its RSS less the shared part for a process the pass has not seen:
    /// all of it counts); `None` until first seen.
    base: Option<i128>,
    /// Its file and shared-memory bytes when `base` was set (none for a
    /// process spawned since the last pass: all of them wait for its
    /// read).
    shared_at_base: u64,

    /// The pages the last count found it alone holds (a Σ Pss pass: its
    /// USS).
    pass_own: u64,
    /// `pass_own` when it forked (none alone since): its own again once
    /// its last fork has left.
    own_before_fork: Option<u64>,
    rss: u64,
    anon: u64,
    /// Its RSS at its last own-cost reading (a `smaps_rollup` read, or the
    /// page count's read of it).
    rss_at_read: u64,
    /// When its RSS last moved by more than [`MOVED`] in a tick.
    rss_moved_at: Option<Instant>,
    /// Its Pss beyond its USS at its last `smaps_rollup` read: its share
    /// of the pages it shares.
    shared_share: Option<u64>,
}

impl Own {
    /// Its part of the page figure beyond the last pass: its change of
    /// anonymous memory since, but no less than minus the pages the last
    /// count found it alone holds. A process can take away only its own
    /// pages: one that lets go of pages it shares (a fork dropping what
    /// it inherited, a fork that execs, a parent freeing what its workers
    /// still map) leaves them with the others.
    fn contribution(&self) -> i128 {
        self.base
            .map_or(0, |b| (self.anon as i128 - b).max(-(self.pass_own as i128)))
    }

    /// Whether it is due for an own-cost read (`None`: not now), and
    /// where it stands among those that are (lowest first): 0, young,
    /// grown since its last reading (or never read) and holding its size
    /// now; 1, never read, holding; 2, young and still growing, once its
    /// age has doubled since its last `smaps_rollup` read (or since its
    /// birth); 3, the rest. A read costs what the process maps (the kernel
    /// walks every resident page), not what it holds alone: a fork is read
    /// when it holds what it grew to, not at each step on the way,
    /// and one that grows all its life is read at ages 0.5, 1, 2, 4 s…:
    /// once in the second half of its life, whenever it ends.
    /// `interval`: a process is read at most this often.
    fn rank(&self, now: Instant, interval: Duration) -> Option<u8> {
        if self
            .read_at
            .is_some_and(|t| now.saturating_duration_since(t) < interval)
        {
            return None;
        }
        let Some(born) = self.born else {
            return Some(1);
        };
        let age = now.saturating_duration_since(born);
        let young = age < YOUNG;
        let grew = self.rss > self.rss_at_read + GREW;
        let held = self
            .rss_moved_at
            .is_none_or(|t| now.saturating_duration_since(t) >= HELD);
        let read_age = self
            .read_at
            .map_or(Duration::ZERO, |t| t.saturating_duration_since(born));
        let doubled = age >= 2 * read_age.max(YOUNG_FIRST);
        match (young, held) {
            (true, true) if grew || self.read_at.is_none() => Some(0),
            (false, true) if self.read_at.is_none() => Some(1),
            (true, false) if doubled => Some(2),
            (true, false) => None,
            _ => Some(3),
        }
    }

    /// The page count read it: its USS as the count found it (the pages
    /// mapped by it alone), its Pss that USS plus the share of its other
    /// pages its last `smaps_rollup` read found (before any, those pages
    /// split evenly among the tree's `processes`).
    fn counted(&mut self, rss: u64, uss: u64, processes: usize, faults: Option<u64>) {
        let rest = rss.saturating_sub(uss);
        let share = self
            .shared_share
            .unwrap_or(rest / processes.max(1) as u64)
            .min(rest);
        self.read(uss, uss + share, rss, faults);
        self.rss_at_read = rss;
    }

    /// A read of its own cost (USS, Pss) when it mapped `rss` bytes and
    /// had taken `faults` page faults.
    fn read(&mut self, uss: u64, pss: u64, rss: u64, faults: Option<u64>) {
        self.uss = Some(uss);
        self.pss = Some(pss);
        self.read_uss = Some(uss);
        self.read_pss = Some(pss);
        self.fresh = true;
        self.estimated = false;
        // Its anonymous bytes then: what it maps now less what it grew
        // by since it was read.
        self.anon_at_read = Some(self.anon.saturating_sub(self.rss.saturating_sub(rss)));
        self.faults_at_read = faults;
        self.estimated_wrote = None;
    }

    /// Its own cost when it grew since its last reading (or was never
    /// read) and has held its size for [`HELD`] since, and no read has
    /// come: its last read USS (none before the first) plus what it
    /// wrote since, its Pss moved by as much (before any read, its share
    /// of the rest split among the tree's `processes`). What it wrote is
    /// the larger of the anonymous memory it gained and, where the page
    /// count reads its faults, a page per fault since its read: a copy on
    /// write (a worker touching its parent's Python objects) turns a
    /// shared page private without moving `statm`, but takes a fault. A
    /// fault on a file page it had not mapped yet counts too, so that part
    /// is high by those; a fresh huge page is one fault, which the
    /// anonymous memory counts. Once per size it holds; a read replaces it.
    fn estimate(&mut self, now: Instant, processes: usize, page_size: u64) {
        let Some(base) = self.anon_at_read else {
            return;
        };
        let held = self
            .rss_moved_at
            .is_some_and(|t| now.saturating_duration_since(t) >= HELD);
        let copied = match (self.faults, self.faults_at_read) {
            (Some(f), Some(at)) => f.saturating_sub(at).saturating_mul(page_size),
            _ => 0,
        };
        let wrote = self.anon.saturating_sub(base).max(copied);
        let grew = wrote > GREW;
        let again = self
            .estimated_wrote
            .is_none_or(|w| w.abs_diff(wrote) > MOVED);
        if !(held && grew && again) {
            return;
        }
        let uss = (self.read_uss.unwrap_or(0) + wrote).min(self.rss);
        let pss = match self.read_pss {
            Some(p) => p + wrote,
            None => uss + self.rss.saturating_sub(uss) / processes.max(1) as u64,
        }
        .min(self.rss);
        self.uss = Some(uss);
        self.pss = Some(pss.max(uss));
        self.fresh = true;
        self.estimated = true;
        self.estimated_wrote = Some(wrote);
    }

    /// Takes its anonymous bytes now. A fall below what it can take away
    /// moves its base down with it, so what it gains from there (an exec'd
    /// program's own memory) counts.
    fn set_anon(&mut self, anon: u64) {
        self.anon = anon;
        if let Some(b) = self.base {
            let lowest = anon as i128 + self.pass_own as i128;
            if b > lowest {
                self.base = Some(lowest);
            }
        }
    }
}

/// Settings of the cost reader.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CostOptions {
    /// Own cost: a process is read again at most this often; `None`: off.
    pub(crate) own_interval: Option<Duration>,
    /// Processes above this RSS are not read for their own cost.
    pub(crate) max_rss: u64,
    /// Share of one core all reads may take.
    pub(crate) share: f64,
}

/// The page figure's state.
#[derive(Debug, Default)]
struct Pages {
    on: bool,
    /// Distinct resident bytes (Σ Pss) at the last count: the last slice
    /// of the page count, the last complete Σ Pss pass.
    total: Option<u64>,
    /// A count has been whole: every process read.
    exact: bool,
    /// The page count's file and shared-memory bytes.
    shared: Option<u64>,
    /// What each departure changed beyond its part of the carried-forward
    /// figure (its own pages go), for processes the last count still
    /// held: an entry goes once a count no longer holds that process.
    exits: Vec<(u32, i128)>,
    /// The Σ Pss pass under way: processes still to read.
    todo: Vec<u32>,
    /// A Σ Pss pass runs, or the page count has processes left to read.
    running: bool,
    urgent: bool,
    /// When the page count's last slice was handed over.
    rolled_at: Option<Instant>,
    committed_at: Option<Instant>,
    /// When the pass under way began, its slices so far, and the CPU time
    /// the reader spent on the pass and on own-cost reads since it began.
    started_at: Option<Instant>,
    slices: u32,
    cpu_pages: Duration,
    cpu_own: Duration,
    /// Why pages cannot be counted (no permission, a read error).
    failed: Option<String>,
    passes: u64,
    commits: u64,
    counted_from: Option<Instant>,
    /// What a pass counts.
    kind: PassKind,
    /// Bumped when a Σ Pss pass is dropped: a slice handed over before
    /// belongs to the dropped pass.
    generation: u64,
    in_flight: Option<u64>,
    /// Σ Pss: a fork, an exit or a remapping this tick.
    changing: bool,
}

/// What the reader is handed next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    Roll,
    Pss,
    Own,
    Nothing,
}

/// The reader's CPU time as each kind of read used it, over that kind's
/// share ([`OWN_SHARE`]): when both have work, the one behind goes next.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Shares {
    pages: f64,
    own: f64,
}

/// The reader of costs and its bookkeeping.
pub(crate) struct CostReader {
    opts: CostOptions,
    /// The procfs the processes are read from.
    root: PathBuf,
    /// When young processes' page faults were last read ([`FAULTS_EVERY`]).
    faults_read_at: Option<Instant>,
    text: String,
    reader: Option<OwnReader>,
    own: HashMap<u32, Own>,
    pages: Pages,
    shares: Shares,
    page_size: u64,
}

impl std::fmt::Debug for CostReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CostReader")
            .field("processes", &self.own.len())
            .field("passes", &self.pages.passes)
            .finish()
    }
}

/// The tree's page figure now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PagesFigure {
    /// Bytes: the last pass carried forward (an estimate from `statm`
    /// until the first pass completes).
    pub(crate) used: u64,
    /// A pass has completed.
    pub(crate) exact: bool,
    /// Seconds since the last complete pass.
    pub(crate) age_s: Option<f64>,
    pub(crate) passes: u64,
    /// Slices of the page count (or Σ Pss passes) taken in so far: a
    /// change says a count was committed since.
    pub(crate) commits: u64,
    /// When the reads of the last count taken in began (its slice, or its
    /// Σ Pss pass, was handed over).
    pub(crate) counted_from: Option<Instant>,
    /// Bytes of file pages and shared memory in the last page count (none
    /// for Σ Pss).
    pub(crate) shared: Option<u64>,
}

impl CostReader {
    pub(crate) fn new(root: PathBuf, opts: CostOptions) -> CostReader {
        CostReader {
            reader: OwnReader::start(root.clone(), opts.share),
            root,
            faults_read_at: None,
            text: String::new(),
            opts,
            own: HashMap::new(),
            pages: Pages::default(),
            shares: Shares::default(),
            page_size: crate::sys::page_size(),
        }
    }

    /// Counts the tree's distinct pages from now on.
    pub(crate) fn count_pages(&mut self) {
        if self.pages.failed.is_none() {
            self.pages.on = true;
            self.pages.urgent = true;
        }
    }

    /// Sums each process's Pss instead of counting pages (no root needed).
    pub(crate) fn count_pss(&mut self) {
        self.pages = Pages {
            on: true,
            urgent: true,
            kind: PassKind::Pss,
            generation: self.pages.generation + 1,
            ..Pages::default()
        };
    }

    /// Why pages cannot be counted, once a pass found out.
    pub(crate) fn pages_failed(&self) -> Option<&str> {
        self.pages.failed.as_deref()
    }

    /// What is known of `pid`'s own cost.
    pub(crate) fn own(&self, pid: u32) -> Option<&Own> {
        self.own.get(&pid)
    }

    /// Reads done and their CPU time.
    pub(crate) fn cost(&self) -> (u64, Duration) {
        self.reader
            .as_ref()
            .map_or((0, Duration::ZERO), OwnReader::cost)
    }

    /// The tree's page figure, when pages are counted.
    pub(crate) fn pages_figure(&self, now: Instant) -> Option<PagesFigure> {
        if !self.pages.on {
            return None;
        }
        let sum: i128 = self.own.values().map(Own::contribution).sum();
        let exits: i128 = self.pages.exits.iter().map(|e| e.1).sum();
        let used = self.pages.total.unwrap_or(0) as i128 + exits + sum;
        Some(PagesFigure {
            used: used.max(0) as u64,
            exact: self.pages.exact,
            age_s: self
                .pages
                .committed_at
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
            passes: self.pages.passes,
            commits: self.pages.commits,
            counted_from: self.pages.counted_from,
            shared: self.pages.shared,
        })
    }

    /// One tick: the tree's processes now (`tree`) and those that left.
    pub(crate) fn update(&mut self, now: Instant, tree: &[View], departed: &[u32]) {
        for o in self.own.values_mut() {
            o.fresh = false;
        }
        let processes = tree.iter().filter(|v| v.rss > 0).count();
        self.pages.changing = false;
        for pid in departed {
            self.leave(*pid, tree);
        }
        for v in tree {
            if v.rss == 0 {
                // Tearing down (its memory is gone before it shows as a
                // zombie): it counts as it was until it has left.
                continue;
            }
            if v.parent.is_some() && self.own.get(&v.pid).is_none_or(|o| o.base.is_none()) {
                // A fork re-divides its parent's pages.
                self.spoil();
                // Its parent holds none of them alone any more.
                if let Some(p) = v.parent.and_then(|p| self.own.get_mut(&p)) {
                    let before = p.own_before_fork.unwrap_or(0).max(p.pass_own);
                    p.own_before_fork = Some(before);
                    p.pass_own = 0;
                }
            }
            let o = self.own.entry(v.pid).or_default();
            o.born.get_or_insert(now);
            // Before any read a fork's own memory is what it wrote beyond
            // its parent's; any other process's, all of its own.
            // A fork that execs drops its parent's pages: from its lowest
            // point on, what it gains is its own.
            let at_read = o
                .anon_at_read
                .get_or_insert(v.parent_anon.map_or(0, |p| p.min(v.anon)));
            if o.read_uss.is_none() {
                *at_read = (*at_read).min(v.anon);
            }
            if v.parent_anon.is_some() && o.read_uss.is_none() && o.faults_at_read.is_none() {
                // A fork's fault count starts at 0.
                o.faults_at_read = Some(0);
            }
            o.parent = v.parent;
            let shared_before = o.base.map(|_| o.rss.saturating_sub(o.anon));
            if o.rss_moved_at.is_none() || v.rss.abs_diff(o.rss) > MOVED {
                o.rss_moved_at = Some(now);
            }
            o.rss = v.rss;
            o.set_anon(v.anon);
            let shared = v.rss.saturating_sub(v.anon);
            // Mapping or unmapping pages others map re-divides their shares.
            let remapped = shared_before.is_some_and(|b| b.abs_diff(shared) > SHARED_RISE);
            if o.base.is_none() && v.rss > 0 {
                // A fork adds what it writes from now on; any other new
                // process its anonymous memory. Their file and shared
                // pages (libraries the tree has loaded already, as a
                // rule) wait for a pass.
                o.base = Some(v.parent_anon.map_or(0, |p| p.min(v.anon) as i128));
                o.shared_at_base = if v.parent_anon.is_some() { shared } else { 0 };
                if shared > o.shared_at_base + SHARED_RISE {
                    self.pages.urgent = true;
                }
            } else if shared > o.shared_at_base + SHARED_RISE {
                self.pages.urgent = true;
            }
            if remapped {
                self.spoil();
            }
        }
        let cpu_before = self.cost().1;
        if let Some(found) = self.reader.as_mut().and_then(OwnReader::collect) {
            let cpu = self.cost().1.saturating_sub(cpu_before);
            self.charge(&found, cpu);
            self.found(now, found);
        }
        if self.opts.own_interval.is_some() {
            self.read_young_faults(now, tree);
            for v in tree.iter().filter(|v| v.rss > 0) {
                if let Some(o) = self.own.get_mut(&v.pid) {
                    if !o.fresh {
                        o.estimate(now, processes, self.page_size);
                    }
                }
            }
        }
        if !self.reader.as_mut().is_some_and(|r| r.ready(now)) {
            return;
        }
        match self.turn(now, tree) {
            Turn::Roll => self.roll(now, tree),
            Turn::Pss => self.pss_slice(now, tree),
            Turn::Own => self.own_batch(now, tree),
            Turn::Nothing => {}
        }
    }

    /// Every [`FAULTS_EVERY`], the page faults of the forks (without exec)
    /// still [`YOUNG`] whose fault count an estimate can start from: only
    /// a fork copies its parent's pages. Copies on write move no `statm`
    /// figure, only the faults; the page count reads them too, but only
    /// when the reader's budget allows a slice, and on a busy machine a
    /// short-lived worker could copy its last pages and exit unseen.
    fn read_young_faults(&mut self, now: Instant, tree: &[View]) {
        if self
            .faults_read_at
            .is_some_and(|t| now.saturating_duration_since(t) < FAULTS_EVERY)
        {
            return;
        }
        self.faults_read_at = Some(now);
        for v in tree.iter().filter(|v| v.rss > 0 && v.parent_anon.is_some()) {
            let Some(o) = self.own.get_mut(&v.pid) else {
                continue;
            };
            let young = o
                .born
                .is_some_and(|b| now.saturating_duration_since(b) < YOUNG);
            if young && o.faults_at_read.is_some() {
                if let Some((faults, _)) = super::pages::faults(&self.root, v.pid, &mut self.text) {
                    o.faults = Some(o.faults.map_or(faults, |f| f.max(faults)));
                }
            }
        }
    }

    /// Counts a batch's CPU time against its kind's share.
    fn charge(&mut self, found: &Found, cpu: Duration) {
        match found {
            Found::Own(_) => {
                self.pages.cpu_own += cpu;
                self.shares.own += cpu.as_secs_f64() / OWN_SHARE;
            }
            Found::Pages { .. } | Found::Roll(_) => {
                self.pages.cpu_pages += cpu;
                self.shares.pages += cpu.as_secs_f64() / (1.0 - OWN_SHARE);
            }
        }
    }

    /// What the reader does next. The page count (or a Σ Pss pass) and
    /// own-cost reads each have a share of the reader ([`OWN_SHARE`]):
    /// when both have work the one behind its share goes (an urgent count
    /// first); one with nothing to do lends its turn, and is not owed it
    /// afterwards.
    fn turn(&mut self, now: Instant, tree: &[View]) -> Turn {
        let since = |t: Option<Instant>, every: Duration| {
            t.is_none_or(|t| now.saturating_duration_since(t) >= every)
        };
        let pages_due = self.pages.on
            && match self.pages.kind {
                PassKind::Pages => {
                    self.pages.running
                        || self.pages.urgent
                        || since(self.pages.rolled_at, ROLL_EVERY)
                }
                PassKind::Pss => {
                    self.pages.running
                        || (!self.pages.changing
                            && (self.pages.urgent || since(self.pages.committed_at, PAGES_EVERY)))
                }
            };
        let own_waits = self.pages.on && !self.pages.exact;
        let own_due = !own_waits && self.own_due(now, tree);
        if !own_due {
            self.shares.own = self.shares.own.max(self.shares.pages);
        }
        if !pages_due {
            self.shares.pages = self.shares.pages.max(self.shares.own);
        }
        // An urgent count (new file or shared-memory pages, which the
        // carried-forward figure cannot hold until they are read) goes
        // first; what it spends is charged, and own-cost reads catch up.
        let own_turn =
            own_due && (!pages_due || (!self.pages.urgent && self.shares.own < self.shares.pages));
        match (pages_due && !own_turn, self.pages.kind) {
            (true, PassKind::Pages) => Turn::Roll,
            (true, PassKind::Pss) => Turn::Pss,
            (false, _) if own_turn => Turn::Own,
            (false, _) => Turn::Nothing,
        }
    }

    /// Hands the reader a slice of the page count.
    fn roll(&mut self, now: Instant, tree: &[View]) {
        if !self.pages.running {
            self.pages.started_at = Some(now);
            self.pages.slices = 0;
            self.pages.cpu_pages = Duration::ZERO;
            self.pages.cpu_own = Duration::ZERO;
        }
        self.pages.urgent = false;
        self.pages.rolled_at = Some(now);
        self.pages.slices += 1;
        let mut alive: Vec<u32> = tree.iter().filter(|v| v.rss > 0).map(|v| v.pid).collect();
        alive.sort_unstable();
        if let Some(reader) = &mut self.reader {
            reader.submit_roll(alive);
        }
    }

    /// Hands the reader the next slice of a Σ Pss pass.
    fn pss_slice(&mut self, now: Instant, tree: &[View]) {
        let fresh = !self.pages.running;
        if fresh {
            // Parents (older, lower PIDs as a rule) first.
            self.pages.todo = tree.iter().filter(|v| v.rss > 0).map(|v| v.pid).collect();
            self.pages.todo.sort_unstable();
            self.pages.running = true;
            self.pages.urgent = false;
            self.pages.started_at = Some(now);
            self.pages.slices = 0;
            self.pages.cpu_pages = Duration::ZERO;
            self.pages.cpu_own = Duration::ZERO;
        }
        self.pages.slices += 1;
        let todo = self.pages.todo.clone();
        if let Some(reader) = &mut self.reader {
            reader.submit_pss(todo, fresh);
            self.pages.in_flight = Some(self.pages.generation);
        }
    }

    /// Hands the reader the processes whose own cost is due, never read
    /// first.
    fn own_batch(&mut self, now: Instant, tree: &[View]) {
        if let Some(interval) = self.own_interval() {
            // In the order of their rank ([`Own::rank`]), the longest
            // unread first within each.
            let mut order: Vec<(u8, Option<Instant>, u32)> = tree
                .iter()
                .filter(|v| v.rss > 0 && v.rss <= self.opts.max_rss)
                .filter_map(|v| {
                    let o = self.own.get(&v.pid);
                    let rank = o.map_or(Some(1), |o| o.rank(now, interval))?;
                    Some((rank, o.and_then(|o| o.read_at), v.pid))
                })
                .collect();
            order.sort_unstable();
            if let Some(reader) = &mut self.reader {
                reader.submit(order.into_iter().map(|(_, _, pid)| pid).collect());
            }
        }
    }

    /// How often own costs are read on their own: never while Σ Pss passes
    /// run, which read them too.
    fn own_interval(&self) -> Option<Duration> {
        self.opts
            .own_interval
            .filter(|_| !(self.pages.on && self.pages.kind == PassKind::Pss))
    }

    fn own_due(&self, now: Instant, tree: &[View]) -> bool {
        let Some(interval) = self.own_interval() else {
            return false;
        };
        tree.iter().any(|v| {
            v.rss > 0
                && v.rss <= self.opts.max_rss
                && self
                    .own
                    .get(&v.pid)
                    .is_none_or(|o| o.rank(now, interval).is_some())
        })
    }

    /// A Σ Pss pass under way no longer adds up (a fork or an exit): it is
    /// dropped and the next one is due at once.
    /// No new one starts in the same tick: it would be dropped as well
    /// while the tree is still changing, spending the budget for nothing.
    fn spoil(&mut self) {
        if self.pages.kind != PassKind::Pss {
            return;
        }
        self.pages.changing = true;
        if !self.pages.running {
            return;
        }
        self.pages.generation += 1;
        self.pages.running = false;
        self.pages.urgent = true;
        self.pages.todo.clear();
    }

    /// A process left: its own pages leave the figure, the ones it shared
    /// stay with the others until the next pass counts them again.
    fn leave(&mut self, pid: u32, tree: &[View]) {
        let Some(o) = self.own.remove(&pid) else {
            return;
        };
        if o.rss > 0 {
            self.spoil();
        }
        let c = o.contribution();
        // Its own pages: those the pass found first in it and what it wrote
        // since, or its last USS (read perhaps before it wrote) if larger.
        // Once a fork of it lives on, none is known to be its own.
        let forked = tree.iter().any(|v| v.parent == Some(pid));
        let private = if forked {
            0
        } else {
            (i128::from(o.pass_own) + c.max(0))
                .max(o.uss.map_or(0, i128::from))
                .min(i128::from(o.rss.max(o.anon)))
        };
        // Its own pages stay in the count until a count no longer holds it.
        self.pages.exits.push((pid, c - private));
        // Its parent's last fork gone, what the parent held alone before
        // it forked is its own again.
        if let Some(parent) = o.parent {
            if !tree
                .iter()
                .any(|v| v.parent == Some(parent) && v.pid != pid)
            {
                if let Some(p) = self.own.get_mut(&parent) {
                    if let Some(before) = p.own_before_fork.take() {
                        p.pass_own = p.pass_own.max(before);
                    }
                }
            }
        }
    }

    fn found(&mut self, now: Instant, found: Found) {
        match found {
            Found::Own(reads) => {
                for r in reads {
                    let Some(o) = self.own.get_mut(&r.pid) else {
                        continue;
                    };
                    o.read_at = Some(now);
                    // What it mapped when read (it may have grown since).
                    o.rss_at_read = if r.rss > 0 { r.rss } else { o.rss };
                    if let Some((pss, uss)) = r.figures {
                        o.read(uss, pss, o.rss_at_read, r.faults);
                        o.shared_share = Some(pss.saturating_sub(uss));
                    }
                }
            }
            Found::Pages { .. }
                if self.pages.kind == PassKind::Pss
                    && std::mem::take(&mut self.pages.in_flight) != Some(self.pages.generation) =>
            {
                // A slice of a dropped pass.
            }
            Found::Roll(Err(e)) => self.pages_fail(format!("cannot read the tree's pages: {e}")),
            Found::Roll(Ok(s)) if s.unreadable => {
                self.pages_fail("page frame numbers read as 0 (reading them needs root)".into())
            }
            Found::Roll(Ok(s)) => self.commit_slice(now, &s),
            Found::Pages {
                pass,
                read,
                complete,
            } => match pass {
                Err(e) => self.pages_fail(format!("cannot read a process's smaps_rollup: {e}")),
                Ok(p) => {
                    let slice: Vec<u32> = self
                        .pages
                        .todo
                        .drain(..read.min(self.pages.todo.len()))
                        .collect();
                    // A Σ Pss pass reads each process's own cost too.
                    for s in p.seen.iter().filter(|s| slice.contains(&s.pid)) {
                        if let (Some(pss), Some(o)) = (s.pss, self.own.get_mut(&s.pid)) {
                            o.read_at = Some(now);
                            o.read(s.first_seen, pss, s.rss, s.faults);
                        }
                    }
                    if complete || self.pages.todo.is_empty() {
                        self.commit(now, &p);
                    }
                }
            },
        }
    }

    fn pages_fail(&mut self, why: String) {
        tracing::debug!("{why}");
        self.pages.failed = Some(why);
        self.pages.on = false;
        self.pages.running = false;
    }

    /// Each process read counted from its anonymous memory then.
    fn rebase(&mut self, seen: &[super::pages::Seen]) {
        for s in seen {
            if let Some(o) = self.own.get_mut(&s.pid) {
                o.base = Some(s.anon as i128);
                o.shared_at_base = s.rss.saturating_sub(s.anon);
                o.pass_own = s.first_seen;
            }
        }
    }

    /// A slice of the page count: its figure, each process it read
    /// counted from then, and the departures it no longer holds done with.
    fn commit_slice(&mut self, now: Instant, s: &Slice) {
        self.rebase(&s.read);
        for &(pid, faults) in &s.faults {
            if let Some(o) = self.own.get_mut(&pid) {
                o.faults = Some(faults);
            }
        }
        if self.own_interval().is_some() {
            // Each process read has its own cost read with it.
            let processes = s.alone.len();
            for r in &s.read {
                if let (Some(o), Some(uss)) = (self.own.get_mut(&r.pid), r.uss) {
                    o.counted(r.rss, uss, processes, r.faults);
                }
            }
        }
        for &(pid, alone) in &s.alone {
            if let Some(o) = self.own.get_mut(&pid) {
                o.pass_own = alone;
            }
        }
        self.pages.total = Some(s.bytes);
        self.pages.shared = Some(s.shared_bytes);
        self.pages.commits += 1;
        self.pages.counted_from = self.pages.rolled_at;
        self.pages
            .exits
            .retain(|(pid, _)| s.alone.iter().any(|a| a.0 == *pid));
        self.pages.running = !s.whole;
        if s.whole {
            self.whole(now, "page count", s.bytes, s.alone.len());
        }
    }

    /// A complete Σ Pss pass: its sum, and each process it read counted
    /// from its anonymous memory then.
    fn commit(&mut self, now: Instant, p: &Pass) {
        self.rebase(&p.seen);
        self.pages.total = Some(p.bytes);
        self.pages.shared = Some(p.shared);
        self.pages.commits += 1;
        self.pages.counted_from = self.pages.started_at;
        self.pages
            .exits
            .retain(|(pid, _)| p.seen.iter().any(|s| s.pid == *pid));
        self.pages.running = false;
        self.whole(now, "Σ Pss pass", p.bytes, p.seen.len());
    }

    /// A count is whole (every process read): the figure is exact from
    /// now on, and its round is logged.
    fn whole(&mut self, now: Instant, what: &str, bytes: u64, processes: usize) {
        self.pages.exact = true;
        self.pages.committed_at = Some(now);
        self.pages.passes += 1;
        tracing::debug!(
            "{what} {}: {:.1} MiB in {processes} processes, {} slices, {:.1} ms of CPU \
             ({:.1} ms on own-cost reads meanwhile) over {:.2} s",
            self.pages.passes,
            bytes as f64 / f64::from(1u32 << 20),
            self.pages.slices,
            self.pages.cpu_pages.as_secs_f64() * 1e3,
            self.pages.cpu_own.as_secs_f64() * 1e3,
            self.pages
                .started_at
                .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::pages::Seen;

    /// A whole slice of the page count that read `read` (pid, rss, anon,
    /// alone) and holds `alone` (pid, alone), in MiB.
    fn slice(read: &[(u32, u64, u64, u64)], alone: &[(u32, u64)], bytes: u64) -> Found {
        Found::Roll(Ok(Slice {
            bytes: bytes * M,
            read: read
                .iter()
                .map(|&(pid, rss, anon, own)| Seen {
                    pid,
                    rss: rss * M,
                    anon: anon * M,
                    first_seen: own * M,
                    pss: None,
                    uss: None,
                    faults: None,
                })
                .collect(),
            alone: alone.iter().map(|&(pid, a)| (pid, a * M)).collect(),
            faults: Vec::new(),
            shared_bytes: 0,
            whole: true,
            unreadable: false,
        }))
    }

    const M: u64 = 1 << 20;

    /// A reader with own-cost reads on (every second) and no budget, on
    /// the procfs at `root`: the test plays the reader thread's part.
    fn own_reader(root: &std::path::Path) -> CostReader {
        CostReader::new(
            root.into(),
            CostOptions {
                own_interval: Some(Duration::from_secs(1)),
                max_rss: u64::MAX,
                share: 0.0,
            },
        )
    }

    fn reader() -> CostReader {
        // No budget: no batch is ever handed over, the test plays the
        // reader's part.
        let mut r = CostReader::new(
            "/nonexistent".into(),
            CostOptions {
                own_interval: None,
                max_rss: u64::MAX,
                share: 0.0,
            },
        );
        r.count_pages();
        r
    }

    fn view(pid: u32, rss: u64, anon: u64, forked: bool) -> View {
        View {
            pid,
            rss: rss * M,
            anon: anon * M,
            parent_anon: forked.then_some(480 * M),
            parent: forked.then_some(1),
        }
    }

    fn used(r: &CostReader, now: Instant) -> u64 {
        r.pages_figure(now).expect("pages on").used / M
    }

    #[test]
    fn forks_add_nothing_writes_add_and_exits_keep_shared_pages() {
        let now = Instant::now();
        let mut r = reader();
        r.update(now, &[view(1, 500, 480, false)], &[]);
        assert_eq!(
            used(&r, now),
            480,
            "before any pass: a new process counts its anonymous memory"
        );
        assert!(r.pages.urgent, "its shared pages make a slice due");
        // The count finds 400 MiB of distinct pages.
        r.found(now, slice(&[(1, 500, 480, 400)], &[(1, 400)], 400));
        assert_eq!(used(&r, now), 400);
        assert!(r.pages_figure(now).expect("on").exact);
        // A fork shares everything: nothing new.
        let tree = [view(1, 500, 480, false), view(2, 500, 480, true)];
        r.update(now, &tree, &[]);
        assert_eq!(used(&r, now), 400, "a fork adds no page");
        // The worker writes 20 MiB of its own.
        let tree = [view(1, 500, 480, false), view(2, 520, 500, true)];
        r.update(now, &tree, &[]);
        assert_eq!(used(&r, now), 420);
        // Its own cost read says so; then it exits: only its own pages go.
        r.found(
            now,
            Found::Own(vec![super::super::own::OwnRead {
                pid: 2,
                figures: Some((250 * M, 20 * M)),
                rss: 520 * M,
                faults: None,
            }]),
        );
        r.update(now, &[view(1, 500, 480, false)], &[2]);
        assert_eq!(used(&r, now), 400, "no dip: the shared pages stay");
        // A fork first seen after it wrote 30 MiB counts them.
        let tree = [view(1, 500, 480, false), view(3, 530, 510, true)];
        r.update(now, &tree, &[]);
        assert_eq!(used(&r, now), 430, "what it wrote before it was seen");
        r.update(now, &[view(1, 500, 480, false)], &[3]);
        // The parent frees 100 MiB.
        r.update(now, &[view(1, 400, 380, false)], &[]);
        assert_eq!(used(&r, now), 300);
    }

    fn pss_pass(pid_figures: &[(u32, u64, u64, u64)], bytes: u64) -> Found {
        Found::Pages {
            pass: Ok(Pass {
                bytes: bytes * M,
                shared: 0,
                seen: pid_figures
                    .iter()
                    .map(|&(pid, rss, anon, own)| Seen {
                        pid,
                        rss: rss * M,
                        anon: anon * M,
                        first_seen: own * M,
                        pss: None,
                        uss: None,
                        faults: None,
                    })
                    .collect(),
            }),
            read: pid_figures.len(),
            complete: true,
        }
    }

    #[test]
    fn a_fork_that_execs_takes_none_of_its_parents_pages_and_adds_its_own() {
        // A 1 GiB parent runs a subprocess: the fork (or vfork) shows its
        // parent's memory, then execs a small program, which exits.
        let now = Instant::now();
        let mut r = reader();
        r.update(now, &[view(1, 1044, 1024, false)], &[]);
        r.found(now, slice(&[(1, 1044, 1024, 1030)], &[(1, 1030)], 1030));
        let fork = View {
            parent_anon: Some(1024 * M),
            ..view(2, 1044, 1024, true)
        };
        r.update(now, &[view(1, 1044, 1024, false), fork], &[]);
        assert_eq!(used(&r, now), 1030, "a fork adds no page");
        // The count reads it before it execs: all its pages are its
        // parent's too.
        r.found(now, slice(&[(2, 1044, 1024, 0)], &[(1, 0), (2, 0)], 1030));
        // It execs: its anonymous memory falls to 5 MiB.
        let execd = view(2, 9, 5, true);
        r.update(now, &[view(1, 1044, 1024, false), execd], &[]);
        assert_eq!(
            used(&r, now),
            1030,
            "the exec takes none of the parent's pages"
        );
        // The program writes 30 MiB of its own: they count.
        r.update(
            now,
            &[view(1, 1044, 1024, false), view(2, 39, 35, true)],
            &[],
        );
        assert_eq!(used(&r, now), 1060);
        // It exits: its own pages go, no more.
        r.update(now, &[view(1, 1044, 1024, false)], &[2]);
        assert_eq!(used(&r, now), 1030);
        // The same in a Σ Pss pass's terms: no collapse either.
        let mut r = reader();
        r.count_pss();
        r.update(now, &[view(1, 1044, 1024, false)], &[]);
        r.pages.running = true;
        r.pages.todo = vec![1];
        r.pages.in_flight = Some(r.pages.generation);
        r.found(now, pss_pass(&[(1, 1044, 1024, 1024)], 1030));
        assert_eq!(used(&r, now), 1030);
        r.update(now, &[view(1, 1044, 1024, false), fork], &[]);
        r.update(now, &[view(1, 1044, 1024, false), execd], &[]);
        assert_eq!(used(&r, now), 1030, "Σ Pss: no collapse on exec");
        r.update(now, &[view(1, 1044, 1024, false)], &[2]);
        assert_eq!(used(&r, now), 1030);
    }

    #[test]
    fn a_parent_freeing_what_its_forks_still_map_keeps_them_counted() {
        let now = Instant::now();
        let mut r = reader();
        r.update(now, &[view(1, 500, 480, false)], &[]);
        r.found(now, slice(&[(1, 500, 480, 480)], &[(1, 480)], 480));
        let tree = [view(1, 500, 480, false), view(2, 500, 480, true)];
        r.update(now, &tree, &[]);
        // The parent drops 200 MiB its fork still maps.
        r.update(now, &[view(1, 300, 280, false), tree[1]], &[]);
        assert_eq!(used(&r, now), 480, "the fork still holds them");
        // What it allocates afterwards counts.
        r.update(now, &[view(1, 350, 330, false), tree[1]], &[]);
        assert_eq!(used(&r, now), 530);
    }

    #[test]
    fn copies_on_write_count_once_read_and_leave_exactly_with_their_process() {
        let now = Instant::now();
        let mut r = reader();
        r.update(now, &[view(1, 500, 480, false)], &[]);
        r.found(now, slice(&[(1, 500, 480, 400)], &[(1, 400)], 400));
        let tree = [view(1, 500, 480, false), view(2, 500, 480, true)];
        r.update(now, &tree, &[]);
        assert_eq!(used(&r, now), 400, "a fork adds no page");
        // The worker copies 30 MiB of its parent's pages on write: no
        // `statm` figure moves, the next slice reads it and they count.
        r.found(now, slice(&[(2, 500, 480, 30)], &[(1, 30), (2, 30)], 430));
        r.update(now, &tree, &[]);
        assert_eq!(used(&r, now), 430);
        // It writes 10 MiB more of its own, then exits: its own pages go,
        // at once and after the next slice forgets it, no more, no less.
        r.update(now, &[tree[0], view(2, 510, 490, true)], &[]);
        assert_eq!(used(&r, now), 440);
        r.update(now, &[tree[0]], &[2]);
        assert_eq!(used(&r, now), 400, "its 30 + 10 MiB left with it");
        r.found(now, slice(&[], &[(1, 400)], 400));
        assert_eq!(used(&r, now), 400, "the count without it agrees");
    }

    #[test]
    fn own_cost_reads_and_the_count_each_have_a_share_and_lend_what_they_leave() {
        let mut r = own_reader(std::path::Path::new("/nonexistent"));
        r.count_pages();
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let tree = [view(1, 500, 480, false), view(2, 100, 90, false)];
        r.update(t0, &tree, &[]);
        assert_eq!(r.turn(t0, &tree), Turn::Roll, "the page count comes first");
        r.roll(t0, &tree);
        // A slice that stops with a process left to read: the count's turn
        // again, whatever it cost.
        let mut part = slice(&[(1, 500, 480, 400)], &[(1, 400)], 400);
        if let Found::Roll(Ok(s)) = &mut part {
            s.whole = false;
        }
        r.charge(&part, ms(60));
        r.found(t0, part);
        let t1 = t0 + ms(400);
        assert_eq!(
            r.turn(t1, &tree),
            Turn::Roll,
            "no own read before a whole count"
        );
        r.roll(t1, &tree);
        let whole = slice(&[(2, 100, 90, 80)], &[(1, 400), (2, 80)], 480);
        r.charge(&whole, ms(30));
        r.found(t1, whole);
        // The count is whole and not due: it lends own-cost reads its
        // turn. While they waited for it they saved nothing up: they are
        // owed only what the count used since they were last asked.
        let t2 = t1 + ms(100);
        assert_eq!(r.turn(t2, &tree), Turn::Own);
        assert!(
            (r.shares.pages - r.shares.own - 0.030 / (1.0 - OWN_SHARE)).abs() < 1e-9,
            "{:?}",
            r.shares
        );
        // The count is due again (its 500 ms): own-cost reads spent 10 ms,
        // under their share of what both spent since: theirs again.
        let own = |r: &mut CostReader, t: Instant, cpu: u64| {
            let reads = tree
                .iter()
                .map(|v| super::super::own::OwnRead {
                    pid: v.pid,
                    figures: Some((v.rss, v.anon)),
                    rss: v.rss,
                    faults: None,
                })
                .collect();
            let f = Found::Own(reads);
            r.charge(&f, ms(cpu));
            r.found(t, f);
        };
        own(&mut r, t2, 10);
        let t3 = t1 + ms(600);
        let before = r.shares;
        r.shares.pages += 0.060 / (1.0 - OWN_SHARE);
        let mut tree3 = tree;
        tree3[1].rss += 10 * M;
        tree3[1].anon += 10 * M;
        r.update(t3, &tree3, &[]);
        assert_eq!(
            r.turn(t3, &tree3),
            Turn::Roll,
            "own reads read every process within the second: the count goes"
        );
        r.shares = before;
        // A second on, both are due: the one behind its share goes.
        let t4 = t2 + ms(1000);
        r.shares.pages = r.shares.own + 0.001;
        assert_eq!(r.turn(t4, &tree3), Turn::Own);
        r.shares.own = r.shares.pages + 0.001;
        assert_eq!(r.turn(t4, &tree3), Turn::Roll);
        // New shared pages the figure cannot carry: the count first,
        // however far behind own-cost reads are.
        r.shares.pages = r.shares.own + 1.0;
        r.pages.urgent = true;
        assert_eq!(r.turn(t4, &tree3), Turn::Roll);
    }

    #[test]
    fn a_young_process_that_grew_is_read_first_once_it_holds_its_size() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let every = s(1);
        let mut o = Own {
            born: Some(t0),
            read_at: Some(t0 + s(10)),
            rss: 100 * M,
            rss_at_read: 100 * M,
            rss_moved_at: Some(t0 + s(10)),
            ..Own::default()
        };
        assert_eq!(o.rank(t0 + s(10) + ms(500), every), None, "read just now");
        assert_eq!(o.rank(t0 + s(11), every), Some(3), "unchanged");
        // It grows: not read on the way (its age has not doubled), read
        // first once it holds.
        o.rss += GREW + 1;
        o.rss_moved_at = Some(t0 + s(11));
        assert_eq!(o.rank(t0 + s(11) + ms(100), every), None, "still growing");
        assert_eq!(o.rank(t0 + s(11) + HELD, every), Some(0), "it holds");
        o.rss_moved_at = Some(t0 + s(20));
        assert_eq!(o.rank(t0 + s(20), every), Some(2), "growing, age doubled");
        assert_eq!(o.rank(t0 + YOUNG, every), Some(3), "no longer young");
        // Never read: holding, before the rest; growing, from 0.5 s old.
        let never = Own {
            born: Some(t0),
            rss: 100 * M,
            rss_moved_at: Some(t0),
            ..Own::default()
        };
        assert_eq!(never.rank(t0 + ms(100), every), None, "just born");
        assert_eq!(never.rank(t0 + HELD, every), Some(0));
        let growing = Own {
            rss_moved_at: Some(t0 + ms(400)),
            ..never
        };
        assert_eq!(growing.rank(t0 + ms(450), every), None);
        assert_eq!(growing.rank(t0 + ms(500), every), Some(2));
        let old = Own {
            rss_moved_at: None,
            ..never
        };
        assert_eq!(
            old.rank(t0 + YOUNG, every),
            Some(1),
            "never read, not young"
        );
        // The page count read it at that size: not grown since.
        o.rss = 100 * M;
        o.counted(o.rss, 60 * M, 5, None);
        assert_eq!(o.rank(t0 + s(40), every), Some(3));
        assert!(o.fresh);
        assert_eq!(
            (o.uss, o.pss),
            (Some(60 * M), Some(68 * M)),
            "before any smaps_rollup read its other 40 MiB split among 5"
        );
        o.shared_share = Some(10 * M);
        o.counted(o.rss, 70 * M, 5, None);
        assert_eq!(
            (o.uss, o.pss),
            (Some(70 * M), Some(80 * M)),
            "its share of what it shares as smaps_rollup last found it"
        );
    }

    #[test]
    fn a_process_that_forks_away_and_exits_leaves_its_pages_to_the_fork() {
        // A daemon holding 2 GiB forks and exits in a loop: each fork holds
        // the pages, the exits take none of them.
        let now = Instant::now();
        let mut r = reader();
        r.update(now, &[view(1, 2060, 2048, false)], &[]);
        r.found(now, slice(&[(1, 2060, 2048, 2048)], &[(1, 2048)], 2050));
        assert_eq!(used(&r, now), 2050);
        let mut parent = 1;
        for child in 2..20 {
            let fork = View {
                parent: Some(parent),
                parent_anon: Some(2048 * M),
                ..view(child, 2060, 2048, true)
            };
            r.update(now, &[view(parent, 2060, 2048, false), fork], &[]);
            assert_eq!(used(&r, now), 2050, "a fork adds nothing");
            r.update(now, &[fork], &[parent]);
            assert_eq!(used(&r, now), 2050, "its parent's exit takes nothing");
            parent = child;
        }
    }

    #[test]
    fn a_pss_pass_overlapped_by_a_fork_or_an_exit_is_dropped() {
        let now = Instant::now();
        let mut r = reader();
        r.count_pss();
        let tree = [view(1, 500, 480, false), view(2, 100, 90, false)];
        r.update(now, &tree, &[]);
        // A pass is handed over; a fork shows up before it comes back.
        r.pages.running = true;
        r.pages.todo = vec![1, 2];
        r.pages.in_flight = Some(r.pages.generation);
        let fork = View {
            parent: Some(1),
            parent_anon: Some(480 * M),
            ..view(3, 500, 480, true)
        };
        r.update(now, &[tree[0], tree[1], fork], &[]);
        assert!(!r.pages.running && r.pages.urgent, "the pass is dropped");
        r.found(now, pss_pass(&[(1, 500, 480, 200), (2, 100, 90, 80)], 450));
        assert!(
            !r.pages_figure(now).expect("on").exact,
            "its late result is not taken"
        );
        // The next pass, undisturbed, is.
        r.pages.running = true;
        r.pages.todo = vec![1, 2, 3];
        r.pages.in_flight = Some(r.pages.generation);
        r.found(
            now,
            pss_pass(
                &[(1, 500, 480, 10), (2, 100, 90, 80), (3, 500, 480, 10)],
                600,
            ),
        );
        assert_eq!(used(&r, now), 600);
        // An exit drops a pass under way too.
        r.pages.running = true;
        r.pages.in_flight = Some(r.pages.generation);
        r.update(now, &[tree[0], fork], &[2]);
        assert!(!r.pages.running);
        assert_eq!(used(&r, now), 600 - 80, "the exit takes its own pages");
    }

    #[test]
    fn unreadable_frame_numbers_turn_pages_off() {
        let now = Instant::now();
        let mut r = reader();
        r.found(
            now,
            Found::Roll(Ok(Slice {
                unreadable: true,
                ..Slice::default()
            })),
        );
        assert!(r.pages_figure(now).is_none());
        assert!(r.pages_failed().is_some_and(|w| w.contains("root")));
    }

    /// A worker that grew and held its size with no read since has an
    /// estimate: its last read USS plus what it wrote since (before any
    /// read, what it wrote beyond its parent), marked as such, once per
    /// size it holds; a read replaces it.
    #[test]
    fn a_worker_grown_and_unread_is_estimated_and_marked_until_read() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut r = own_reader(std::path::Path::new("/nonexistent"));
        let worker = |rss: u64, anon: u64| View {
            pid: 2,
            rss: rss * M,
            anon: anon * M,
            parent_anon: Some(480 * M),
            parent: Some(1),
        };
        let parent = view(1, 500, 480, false);
        r.update(at(0), &[parent, worker(500, 480)], &[]);
        r.update(at(100), &[parent, worker(540, 520)], &[]);
        assert!(r.own(2).is_some_and(|o| o.uss.is_none()), "not held yet");
        r.update(at(500), &[parent, worker(540, 520)], &[]);
        let o = *r.own(2).expect("seen");
        assert!(o.fresh && o.estimated, "{o:?}");
        assert_eq!(o.uss, Some(40 * M), "what it wrote beyond its parent");
        r.update(at(600), &[parent, worker(540, 520)], &[]);
        assert!(!r.own(2).expect("seen").fresh, "once per size it holds");
        // A read: 50 MiB (it copied 10 MiB of its parent's pages too).
        r.found(
            at(700),
            Found::Own(vec![super::super::own::OwnRead {
                pid: 2,
                figures: Some((60 * M, 50 * M)),
                rss: 540 * M,
                faults: None,
            }]),
        );
        let o = *r.own(2).expect("seen");
        assert!(o.fresh && !o.estimated && o.uss == Some(50 * M), "{o:?}");
        // It grows 24 MiB more and holds: the read plus what it wrote.
        r.update(at(800), &[parent, worker(564, 544)], &[]);
        r.update(at(1200), &[parent, worker(564, 544)], &[]);
        let o = *r.own(2).expect("seen");
        assert!(o.fresh && o.estimated, "{o:?}");
        assert_eq!((o.uss, o.pss), (Some(74 * M), Some(84 * M)));
        // Read again at 74 MiB, 1,000 faults in; then it copies 16 MiB of
        // its parent's pages (statm does not move) and the page count
        // finds its faults: the read plus a page per fault.
        r.found(
            at(1300),
            Found::Own(vec![super::super::own::OwnRead {
                pid: 2,
                figures: Some((84 * M, 74 * M)),
                rss: 564 * M,
                faults: Some(1000),
            }]),
        );
        assert!(!r.own(2).expect("seen").estimated);
        let Found::Roll(Ok(mut s)) = slice(&[], &[(1, 400), (2, 74)], 474) else {
            unreachable!()
        };
        s.faults = vec![(2, 1000 + 16 * M / r.page_size)];
        r.found(at(1400), Found::Roll(Ok(s)));
        r.update(at(1500), &[parent, worker(564, 544)], &[]);
        let o = *r.own(2).expect("seen");
        assert!(o.fresh && o.estimated, "{o:?}");
        assert_eq!(
            o.uss,
            Some(90 * M),
            "copies on write are counted from faults"
        );
    }

    /// With no page count at all (its budget spent elsewhere), a young
    /// worker's faults are still read by the sampler: a fork that copies
    /// 16 MiB of its parent's pages (4,096 faults, no `statm` move) is
    /// estimated from them. The procfs is a folder holding its `stat`.
    #[test]
    fn a_young_workers_faults_are_read_without_a_page_count() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let proc = tempfile::tempdir().expect("a folder");
        std::fs::create_dir(proc.path().join("2")).expect("its folder");
        let faults = |n: u64| {
            // proc(5): pid (comm) state ppid … minflt (10) cminflt majflt (12)
            let stat = format!("2 (python (worker)) S 1 2 2 0 -1 0 {n} 0 0 0 1 1 0 0 20 0\n");
            std::fs::write(proc.path().join("2/stat"), stat).expect("stat");
        };
        let mut r = own_reader(proc.path());
        let parent = view(1, 500, 480, false);
        let worker = View {
            pid: 2,
            rss: 500 * M,
            anon: 480 * M,
            parent_anon: Some(480 * M),
            parent: Some(1),
        };
        faults(100);
        r.update(at(0), &[parent, worker], &[]);
        r.update(at(400), &[parent, worker], &[]);
        assert!(
            r.own(2).is_some_and(|o| o.uss.is_none()),
            "nothing copied yet"
        );
        faults(100 + 16 * M / r.page_size);
        r.update(at(450), &[parent, worker], &[]);
        assert!(
            r.own(2).is_some_and(|o| o.uss.is_none()),
            "read every 500 ms"
        );
        r.update(at(600), &[parent, worker], &[]);
        let o = *r.own(2).expect("seen");
        assert!(o.fresh && o.estimated, "{o:?}");
        assert_eq!(o.uss, Some(16 * M + 100 * r.page_size), "{o:?}");
    }
}
