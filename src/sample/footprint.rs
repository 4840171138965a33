//! The tree's headline host figure: every resident page counted once.
//!
//! Forked workers share their parent's pages copy-on-write, so a sum of
//! per-process RSS counts each shared page once per worker and can
//! overstate a DataLoader job several times over. The footprint comes from
//! the best source the run can have, chosen once and recorded:
//!
//! 1. [`HostSource::Pages`] (root): the tree's distinct resident pages,
//!    counted by the cost reader (`super::cost`, `super::pages`).
//! 2. [`HostSource::Pss`]: the sum of each process's proportional share
//!    (`smaps_rollup`), read off the sampling thread within a CPU budget
//!    and carried forward in between by the rules the page count uses
//!    (`super::cost`): a fork adds only what it writes beyond its
//!    parent, an exit takes only the pages the process alone had.
//! 3. [`HostSource::Cgroup`] (asked for): the kernel's charge for a memory
//!    cgroup that holds only the job. It leaves out library pages another
//!    cgroup loaded first.
//! 4. [`HostSource::Rss`]: the plain RSS sum, when asked for or when
//!    `smaps_rollup` cannot be read — labelled as such, never silently.
//!
//! A memory cgroup that holds only the job — one memtrack created for it,
//! or the job's own (a container, a SLURM step, a systemd unit) — is a
//! floor under a count (pages or Σ Pss): its anonymous charge now, which
//! moves every tick with pages no `statm` shows (copies on write), plus
//! the file and shared-memory part of the last count; and a ceiling over
//! it (`Ceiling`): between counts the figure rises no more than the
//! charge did since the last whole count. It is checked
//! again every few seconds: once another process shows up in it (or a
//! process of the tree leaves it), the floor is dropped (the cgroup
//! source falls back to Σ Pss) and the run says so.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::cgroup::{self, Cgroup, CgroupError, Hierarchies};
use super::cost::PagesFigure;
use super::host::{Footprint, HostSample};
use super::parse::parse_statm;
use super::procfs::ProcTree;
pub(crate) use crate::model::HostSource;

/// Which sources a run may use (`host.source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceChoice {
    /// The best available: distinct pages (root), else Σ Pss; a cgroup
    /// holding only the job is a floor under either.
    #[default]
    Auto,
    /// The tree's distinct pages (root), else the best other source.
    Pages,
    /// A memory cgroup holding only the job, else Σ Pss (no page count).
    Cgroup,
    /// Σ Pss even where a cgroup could be had (a cgroup holding only the
    /// job is its floor and ceiling, as under the page count).
    Pss,
    /// The plain RSS sum (overcounts shared pages).
    Rss,
}

/// A `host_source` that is none of the choices.
#[derive(Debug, thiserror::Error)]
#[error("unknown host source `{}`: expected auto, pages, cgroup, pss or rss", .0.escape_debug())]
pub struct UnknownSource(String);

impl std::str::FromStr for SourceChoice {
    type Err = UnknownSource;
    fn from_str(s: &str) -> Result<Self, UnknownSource> {
        match s {
            "auto" => Ok(SourceChoice::Auto),
            "pages" => Ok(SourceChoice::Pages),
            "cgroup" => Ok(SourceChoice::Cgroup),
            "pss" => Ok(SourceChoice::Pss),
            "rss" => Ok(SourceChoice::Rss),
            other => Err(UnknownSource(other.to_string())),
        }
    }
}

/// The source a run uses, why, and (cgroup) which one: what
/// `memory_usage.json` records.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct SourceInfo {
    pub(crate) source: HostSource,
    /// Why this source (and not a better one).
    pub(crate) reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cgroup: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cgroup_version: Option<u8>,
    /// memtrack created the cgroup for this run (and removes it).
    #[serde(default)]
    pub(crate) cgroup_created: bool,
    /// Unix seconds when this source took over.
    #[serde(default)]
    pub(crate) since: f64,
}

/// How often an existing cgroup's membership is checked.
const MEMBERSHIP_EVERY: Duration = Duration::from_secs(2);

/// Settings of the footprint reader.
#[derive(Debug, Clone)]
pub struct FootprintOptions {
    pub choice: SourceChoice,
    pub proc_root: PathBuf,
}

enum SourceState {
    /// Not decided yet: look for a usable cgroup once the tree is known.
    Undecided,
    Cgroup {
        cgroup: Cgroup,
        /// memtrack itself is in the cgroup: its own RSS is taken off.
        minus_self: bool,
        checked_at: Instant,
    },
    Pss,
    Rss,
}

/// Whether the tree's distinct pages are the figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PagesMode {
    Off,
    /// Asked for (auto or `pages`, as root): turned on with the first
    /// sample.
    Wanted,
    On,
}

/// Computes the tree's footprint every sample.
pub struct FootprintReader {
    opts: FootprintOptions,
    pages: PagesMode,
    /// The cgroup's anonymous charge bounds the page figure from below
    /// (until a process of the tree leaves the cgroup).
    floor: bool,
    /// Without pages, Σ Pss is the figure over a cgroup holding only the
    /// job (auto), rather than the cgroup's charge.
    pss_over_cgroup: bool,
    state: SourceState,
    /// The cost reader sums Pss (turned on with the first Σ Pss sample).
    pss_on: bool,
    info: SourceInfo,
    /// Set when the source changed: the store records the new one.
    changed: bool,
    /// memtrack's own `statm`, to take its pages off a shared cgroup.
    self_statm: Option<File>,
    self_pid: u32,
    page_size: u64,
    /// The count the ceiling rests on (see [`Ceiling`]).
    ceiling: Ceiling,
}

/// A ceiling over a count carried forward, where a memory cgroup holds only
/// the job: the kernel charges the cgroup for every anonymous page when it
/// is made (a copy on write included), so between two counts the tree
/// cannot have gained more anonymous pages than the charge rose, nor more
/// file and shared pages than the counts found.
///
/// It rests on the figure at the last whole count (every process read),
/// and on the lowest charge seen while that count's reads ran (from the
/// tick they began to the tick they were taken in): a charge that
/// rose meanwhile may already be in the count, and then lifts the ceiling
/// only higher, never below the truth.
#[derive(Debug, Default, Clone)]
struct Ceiling {
    /// Whole counts (`passes`) and counts taken in (`commits`) seen.
    passes: u64,
    commits: u64,
    /// The cgroup's shared-memory charge at the last whole count.
    shmem_at_anchor: u64,
    /// The anonymous charge at each tick since the last count was taken
    /// in.
    charges: Vec<(Instant, u64)>,
    /// At the last whole count: the figure, its file and shared part, and
    /// the charge.
    anchor: Option<(u64, u64, u64)>,
}

impl Ceiling {
    /// The ceiling at `now`, over `fig` and the anonymous `charge`, and the
    /// `floor` under it; `None` before the first whole count.
    fn at(
        &mut self,
        now: Instant,
        fig: &PagesFigure,
        (charge, shmem): (u64, u64),
        floor: u64,
    ) -> Option<u64> {
        if self.charges.len() >= 1024 {
            // A count that takes this long: the two oldest as one, their
            // lower charge at the earlier time.
            let low = self.charges[0].1.min(self.charges[1].1);
            self.charges[1] = (self.charges[0].0, low);
            self.charges.remove(0);
        }
        self.charges.push((now, charge));
        let shared = fig.shared.unwrap_or(0);
        let shmem_rise = shmem.saturating_sub(self.shmem_at_anchor);
        let over = |a: (u64, u64, u64)| {
            a.0 + charge.saturating_sub(a.2) + shared.saturating_sub(a.1) + shmem_rise
        };
        if fig.commits != self.commits {
            self.commits = fig.commits;
            if fig.exact && fig.passes != self.passes {
                self.passes = fig.passes;
                // The lowest charge from the tick the reads began (read
                // just after they were handed over).
                let from = fig.counted_from.map_or(0, |t| {
                    self.charges
                        .iter()
                        .position(|c| c.0 >= t)
                        .unwrap_or(self.charges.len() - 1)
                });
                let low = self.charges[from..]
                    .iter()
                    .map(|c| c.1)
                    .min()
                    .unwrap_or(charge);
                // Never above the ceiling before it: an estimate that ran
                // high stays capped.
                let bytes = self.anchor.map_or(fig.used, |a| fig.used.min(over(a)));
                self.anchor = Some((bytes.max(floor), shared, low));
                self.shmem_at_anchor = shmem;
            }
            self.charges.clear();
            self.charges.push((now, charge));
        }
        self.anchor.map(over)
    }
}

impl std::fmt::Debug for FootprintReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FootprintReader")
            .field("info", &self.info)
            .finish()
    }
}

impl FootprintReader {
    /// A reader that decides on the first sample (attach, or a run whose
    /// cgroup could not be created: `why_not` says why).
    pub fn new(opts: FootprintOptions, why_not: Option<String>) -> FootprintReader {
        let self_statm = File::open(opts.proc_root.join("self/statm")).ok();
        let pss_over_cgroup = matches!(opts.choice, SourceChoice::Auto | SourceChoice::Pss);
        // Page frame numbers read as 0 without CAP_SYS_ADMIN; a root
        // without it is found out by the first pass.
        let pages = match opts.choice {
            SourceChoice::Auto | SourceChoice::Pages if crate::sys::euid() == 0 => {
                PagesMode::Wanted
            }
            _ => PagesMode::Off,
        };
        let (state, info) = match opts.choice {
            SourceChoice::Auto | SourceChoice::Pages | SourceChoice::Cgroup | SourceChoice::Pss => {
                (
                    SourceState::Undecided,
                    SourceInfo {
                        reason: why_not.unwrap_or_default(),
                        ..SourceInfo::default()
                    },
                )
            }
            SourceChoice::Rss => (
                SourceState::Rss,
                SourceInfo {
                    source: HostSource::Rss,
                    reason:
                        "host.source = rss: pages shared between processes count once per process"
                            .into(),
                    ..SourceInfo::default()
                },
            ),
        };
        FootprintReader {
            opts,
            pages,
            floor: true,
            pss_over_cgroup,
            state,
            pss_on: false,
            info,
            changed: true,
            self_statm,
            self_pid: std::process::id(),
            page_size: crate::sys::page_size(),
            ceiling: Ceiling::default(),
        }
    }

    /// A reader for a cgroup memtrack created for the job.
    pub fn with_created(opts: FootprintOptions, cgroup: Cgroup) -> FootprintReader {
        let mut r = FootprintReader::new(opts, None);
        r.info = SourceInfo {
            source: HostSource::Cgroup,
            reason: "a memory cgroup memtrack created for the job".into(),
            cgroup: Some(cgroup.dir().to_path_buf()),
            cgroup_version: Some(cgroup.version().number()),
            cgroup_created: true,
            since: 0.0,
        };
        r.state = SourceState::Cgroup {
            cgroup,
            minus_self: false,
            checked_at: Instant::now(),
        };
        r.over_cgroup();
        r
    }

    /// With a cgroup holding only the job and no page count: Σ Pss is the
    /// figure (auto), the cgroup its floor; else the cgroup's charge.
    fn over_cgroup(&mut self) {
        if self.pss_over_cgroup && self.pages == PagesMode::Off {
            self.info.source = HostSource::Pss;
            self.info.reason = format!(
                "Σ Pss of the processes, over {}: its anonymous charge and the shared pages \
                 are a floor",
                self.info.reason
            );
        }
    }

    /// The file with the cgroup's `oom_kill` counter, when the source is a
    /// cgroup: the kernel's own count of the job's OOM kills.
    pub(crate) fn oom_counter(&self) -> Option<PathBuf> {
        match &self.state {
            SourceState::Cgroup { cgroup, .. } => Some(cgroup.dir().join(match cgroup.version() {
                cgroup::Version::V1 => "memory.oom_control",
                cgroup::Version::V2 => "memory.events",
            })),
            _ => None,
        }
    }

    #[cfg(test)]
    /// The source in use and why.
    pub(crate) fn info(&self) -> &SourceInfo {
        &self.info
    }

    /// Takes the source change since the last call, if any.
    pub(crate) fn take_change(&mut self) -> Option<SourceInfo> {
        std::mem::take(&mut self.changed).then(|| self.info.clone())
    }

    /// Computes the footprint of the sample the tree just took.
    pub(crate) fn sample(
        &mut self,
        now: Instant,
        timestamp: f64,
        tree: &mut ProcTree,
        host: &mut HostSample,
    ) {
        self.pages_mode(tree, timestamp);
        if matches!(self.state, SourceState::Undecided) {
            if self.pages == PagesMode::On {
                // The cgroup, if one holds only the job, is the floor.
                if let Ok((cgroup, minus_self)) = self.existing_cgroup(tree) {
                    self.state = SourceState::Cgroup {
                        cgroup,
                        minus_self,
                        checked_at: Instant::now(),
                    };
                } else {
                    self.state = SourceState::Rss;
                }
            } else {
                self.decide(tree, timestamp);
            }
        }
        if let SourceState::Cgroup {
            cgroup,
            minus_self,
            checked_at,
        } = &mut self.state
        {
            let due = now.saturating_duration_since(*checked_at) >= MEMBERSHIP_EVERY;
            let mut fallback = None;
            // A root job can move itself out of even the cgroup memtrack
            // made for it: every cgroup is checked.
            if due && self.floor {
                *checked_at = now;
                if let Err(why) = only_the_tree(cgroup, tree, &self.opts.proc_root, self.self_pid) {
                    fallback = Some(why.to_string());
                }
            }
            if fallback.is_none() {
                match cgroup.read() {
                    Ok(reading) => {
                        let own = if *minus_self {
                            self_rss(&self.self_statm, self.page_size)
                        } else {
                            0
                        };
                        let used = reading.working_set().saturating_sub(own);
                        let peak = reading
                            .interval_peak_working_set()
                            .map_or(used, |p| p.saturating_sub(own).max(used));
                        host.footprint = Some(Footprint {
                            source: HostSource::Cgroup,
                            used,
                            peak,
                            age_s: None,
                            cgroup: Some(reading),
                            ..Footprint::default()
                        });
                        self.count_figure(now, tree, host);
                        return;
                    }
                    Err(e) => fallback = Some(format!("cannot read the cgroup: {e}")),
                }
            }
            if let Some(why) = fallback {
                if self.pages == PagesMode::On {
                    // The pages stay the figure; the cgroup's charge is no
                    // floor any more (it is kept for its OOM counter).
                    tracing::warn!("host memory: {why}; its charge is no longer used");
                    self.floor = false;
                    self.info = SourceInfo {
                        reason: format!(
                            "{}; {why}: its charge is no floor any more",
                            self.info.reason
                        ),
                        since: timestamp,
                        ..self.info.clone()
                    };
                    self.changed = true;
                } else {
                    tracing::warn!("host memory: {why}; using Σ Pss from now on");
                    self.switch(SourceState::Pss, HostSource::Pss, why, timestamp, tree);
                }
            }
        }
        if matches!(self.state, SourceState::Pss) {
            self.pss_state(tree, timestamp);
        }
        let pss = match self.state {
            SourceState::Pss => tree.cost().pages_figure(now),
            _ => None,
        };
        let (used, peak, age_s) = match pss {
            Some(fig) => (fig.used, fig.used + host.tree_hwm_rise(), fig.age_s),
            None => (host.tree_rss(), host.tree_hwm(), None),
        };
        let (pss_reads, pss_time) = if pss.is_some() {
            tree.cost().cost()
        } else {
            (0, Duration::ZERO)
        };
        host.footprint = Some(Footprint {
            source: self.info.source,
            used,
            peak: peak.max(used),
            age_s,
            cgroup: None,
            pss_reads,
            pss_read_s: pss_time.as_secs_f64(),
        });
        self.count_figure(now, tree, host);
    }

    /// Σ Pss: the cost reader sums it from the first sample on; once it
    /// cannot (no permission to read a process's `smaps_rollup`), the RSS
    /// sum takes over, and says why.
    fn pss_state(&mut self, tree: &mut ProcTree, at: f64) {
        if !self.pss_on {
            tree.cost_mut().count_pss();
            self.pss_on = true;
        }
        if let Some(why) = tree.cost().pages_failed().map(str::to_string) {
            tracing::warn!("host memory: {why}; summing RSS from now on");
            self.switch(
                SourceState::Rss,
                HostSource::Rss,
                format!("{why}: shared pages count once per process"),
                at,
                tree,
            );
        }
    }

    /// Turns page counting on (first sample), or off once a pass found it
    /// cannot count (no permission): then the best other source takes
    /// over, and says why.
    fn pages_mode(&mut self, tree: &mut ProcTree, at: f64) {
        match self.pages {
            PagesMode::Wanted => {
                tree.cost_mut().count_pages();
                self.pages = PagesMode::On;
                let cgroup = std::mem::take(&mut self.info);
                self.info = SourceInfo {
                    source: HostSource::Pages,
                    reason: "the processes' distinct resident pages, read from pagemap as root"
                        .into(),
                    since: at,
                    ..cgroup
                };
                self.changed = true;
            }
            PagesMode::On => {
                if let Some(why) = tree.cost().pages_failed().map(str::to_string) {
                    tracing::warn!("host memory: {why}; using the next best source");
                    self.pages = PagesMode::Off;
                    self.info.reason = why;
                    match &self.state {
                        SourceState::Cgroup { cgroup, .. } => {
                            self.info.source = HostSource::Cgroup;
                            self.info.cgroup = Some(cgroup.dir().to_path_buf());
                            self.info.since = at;
                            self.changed = true;
                            self.over_cgroup();
                        }
                        _ => {
                            self.state = SourceState::Undecided;
                            self.decide(tree, at);
                        }
                    }
                }
            }
            PagesMode::Off => {}
        }
    }

    /// Whether the cgroup read holds memtrack too (its memory is then taken
    /// off what the cgroup says).
    fn cgroup_holds_self(&self) -> bool {
        matches!(
            self.state,
            SourceState::Cgroup {
                minus_self: true,
                ..
            }
        )
    }

    /// The tree's distinct pages as the figure, over what the source below
    /// read: a cgroup's anonymous charge now, with the file and shared
    /// pages of the last page count, is the floor. The charge moves every
    /// tick with pages `statm` does not see: a worker's copies on write of
    /// its parent's pages are anonymous pages charged to the job.
    fn count_figure(&mut self, now: Instant, tree: &mut ProcTree, host: &mut HostSample) {
        let source = match self.pages {
            PagesMode::On => HostSource::Pages,
            _ if self.info.source == HostSource::Pss
                && matches!(self.state, SourceState::Cgroup { .. }) =>
            {
                if !self.pss_on {
                    tree.cost_mut().count_pss();
                    self.pss_on = true;
                }
                if let Some(why) = tree.cost().pages_failed() {
                    // No Σ Pss to be had: the cgroup's charge is the figure.
                    tracing::warn!("host memory: {why}; using the cgroup's charge");
                    self.info.source = HostSource::Cgroup;
                    self.info.reason = format!("{why}: the cgroup's charge is the figure");
                    self.changed = true;
                    return;
                }
                HostSource::Pss
            }
            _ => return,
        };
        let Some(fig) = tree.cost().pages_figure(now) else {
            return;
        };
        let below = host.footprint.take().unwrap_or_default();
        let own = if self.cgroup_holds_self() {
            self_rss(&self.self_statm, self.page_size)
        } else {
            0
        };
        let charge = below
            .cgroup
            .as_ref()
            .filter(|_| self.floor)
            .map(|r| (r.stat.anon.saturating_sub(own), r.stat.shmem));
        let floor = charge.map_or(0, |c| c.0 + fig.shared.unwrap_or(0));
        let ceiling = charge.and_then(|c| self.ceiling.at(now, &fig, c, floor));
        let used = ceiling.map_or(fig.used, |c| fig.used.min(c)).max(floor);
        let (reads, cpu) = tree.cost().cost();
        host.footprint = Some(Footprint {
            source,
            used,
            peak: used + host.tree_hwm_rise(),
            age_s: fig.age_s,
            cgroup: below.cgroup,
            pss_reads: reads,
            pss_read_s: cpu.as_secs_f64(),
        });
    }

    fn switch(
        &mut self,
        state: SourceState,
        source: HostSource,
        reason: String,
        at: f64,
        tree: &mut ProcTree,
    ) {
        if let SourceState::Cgroup { cgroup, .. } =
            std::mem::replace(&mut self.state, SourceState::Rss)
        {
            if let Err(e) = cgroup.remove() {
                tracing::warn!("{e}");
            }
        }
        if source == HostSource::Pss {
            tree.cost_mut().count_pss();
            self.pss_on = true;
        }
        self.state = state;
        self.info = SourceInfo {
            source,
            reason,
            since: at,
            ..SourceInfo::default()
        };
        self.changed = true;
    }

    /// First sample: use the roots' cgroup when it holds only the tree
    /// (and memtrack), else Σ Pss.
    fn decide(&mut self, tree: &mut ProcTree, at: f64) {
        let why_not_created = std::mem::take(&mut self.info.reason);
        match self.existing_cgroup(tree) {
            Ok((cgroup, minus_self)) => {
                let mut reason = format!(
                    "the job's memory cgroup holds only the job{}",
                    if minus_self {
                        " and memtrack (its own memory is taken off)"
                    } else {
                        ""
                    }
                );
                if !why_not_created.is_empty() {
                    reason = format!("{reason}; {why_not_created}");
                }
                self.info = SourceInfo {
                    source: HostSource::Cgroup,
                    reason,
                    cgroup: Some(cgroup.dir().to_path_buf()),
                    cgroup_version: Some(cgroup.version().number()),
                    cgroup_created: false,
                    since: at,
                };
                self.state = SourceState::Cgroup {
                    cgroup,
                    minus_self,
                    checked_at: Instant::now(),
                };
                self.changed = true;
                self.over_cgroup();
            }
            Err(why) => {
                let reason = if why_not_created.is_empty() {
                    why.to_string()
                } else {
                    format!("{why_not_created}; {why}")
                };
                // Without smaps_rollup (kernels before 4.14, or no
                // permission) Pss cannot be had: say so and sum RSS.
                let readable = tree.roots().first().is_none_or(|pid| {
                    self.opts
                        .proc_root
                        .join(pid.to_string())
                        .join("smaps_rollup")
                        .metadata()
                        .is_ok()
                });
                if readable {
                    self.switch(SourceState::Pss, HostSource::Pss, reason, at, tree);
                } else {
                    self.switch(
                        SourceState::Rss,
                        HostSource::Rss,
                        format!("{reason}; smaps_rollup is not readable, so shared pages count once per process"),
                        at,
                        tree,
                    );
                }
            }
        }
    }

    fn existing_cgroup(&self, tree: &ProcTree) -> Result<(Cgroup, bool), NotJobOnly> {
        let hier = Hierarchies::read(&self.opts.proc_root);
        let mut found: Option<(PathBuf, cgroup::Version)> = None;
        for pid in tree.roots() {
            let Some(cg) = hier.memory_cgroup_of(&self.opts.proc_root, &pid.to_string()) else {
                return Err(NotJobOnly::NoCgroup(*pid));
            };
            match &found {
                Some(f) if *f != cg => return Err(NotJobOnly::Split),
                _ => found = Some(cg),
            }
        }
        let (dir, version) = found.ok_or(NotJobOnly::NoProcess)?;
        if is_hierarchy_root(&hier, &dir) {
            return Err(NotJobOnly::Root(dir));
        }
        let cgroup = Cgroup::open(&dir, version).map_err(NotJobOnly::Unreadable)?;
        only_the_tree(&cgroup, tree, &self.opts.proc_root, self.self_pid)?;
        let procs = cgroup.procs().unwrap_or_default();
        Ok((cgroup, procs.contains(&self.self_pid)))
    }

    /// Removes a cgroup memtrack created (end of run); the footprint falls
    /// back to the RSS sum for any sample after this.
    pub(crate) fn release(&mut self) {
        if let SourceState::Cgroup { cgroup, .. } =
            std::mem::replace(&mut self.state, SourceState::Rss)
        {
            let dir = cgroup.dir().to_path_buf();
            match cgroup.remove() {
                Ok(()) => tracing::debug!("removed memory cgroup {}", dir.display()),
                Err(e) => tracing::warn!("{e}"),
            }
        }
    }
}

impl Drop for FootprintReader {
    fn drop(&mut self) {
        self.release();
    }
}

fn is_hierarchy_root(hier: &Hierarchies, dir: &Path) -> bool {
    hier.mounts.iter().any(|m| m.mount_point == dir)
}

fn self_rss(statm: &Option<File>, page_size: u64) -> u64 {
    let Some(f) = statm else { return 0 };
    let mut buf = [0u8; 128];
    f.read_at(&mut buf, 0)
        .ok()
        .and_then(|n| {
            std::str::from_utf8(&buf[..n])
                .ok()
                .and_then(|t| parse_statm(t, page_size).ok())
        })
        .unwrap_or(0)
}

/// The cgroup holds the tree and nothing else (memtrack aside), and the
/// tree is all in it. Processes born or dead since the tree's last sample
/// are judged by their ancestry and state, not taken for strangers.
fn only_the_tree(
    cgroup: &Cgroup,
    tree: &ProcTree,
    proc_root: &Path,
    self_pid: u32,
) -> Result<(), NotJobOnly> {
    let procs = cgroup.procs().map_err(|source| NotJobOnly::Unlisted {
        dir: cgroup.dir().to_path_buf(),
        source,
    })?;
    let ours = |pid: u32| pid == self_pid || tree.contains(pid);
    let foreign = procs
        .iter()
        .filter(|&&p| !ours(p) && !descends_from(proc_root, p, &ours))
        .count();
    if foreign > 0 {
        return Err(NotJobOnly::Foreign {
            dir: cgroup.dir().to_path_buf(),
            count: foreign,
        });
    }
    let outside = tree
        .pids()
        .filter(|p| !procs.contains(p) && alive(proc_root, *p))
        .count();
    if outside > 0 {
        return Err(NotJobOnly::Outside {
            dir: cgroup.dir().to_path_buf(),
            count: outside,
        });
    }
    Ok(())
}

fn stat_of(proc_root: &Path, pid: u32) -> Option<super::parse::Stat> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    super::parse::parse_stat(&text).ok()
}

/// A process not yet sampled whose ancestors include one of ours.
fn descends_from(proc_root: &Path, pid: u32, ours: &impl Fn(u32) -> bool) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        let Some(stat) = stat_of(proc_root, p) else {
            // Gone already: it cannot hold memory any more.
            return true;
        };
        if ours(stat.ppid) {
            return true;
        }
        if stat.ppid <= 1 {
            return false;
        }
        p = stat.ppid;
    }
    false
}

fn alive(proc_root: &Path, pid: u32) -> bool {
    stat_of(proc_root, pid).is_some_and(|s| s.state != 'Z' && s.state != 'X')
}

/// Removes the cgroups memtrack runs killed before their cleanup left
/// under memtrack's own memory cgroup (empty, their owner gone; their own
/// child cgroups too). How many were removed.
pub fn remove_stale_cgroups(proc_root: &Path) -> usize {
    let hier = Hierarchies::read(proc_root);
    let Some(own) = std::fs::read_to_string(proc_root.join("self/cgroup"))
        .ok()
        .and_then(|t| cgroup::parse_proc_cgroup(&t).v1_memory)
    else {
        return 0;
    };
    let Some(parent) = hier
        .mounts
        .iter()
        .find(|m| m.version == cgroup::Version::V1)
        .and_then(|m| cgroup::cgroup_dir(m, &own))
    else {
        return 0;
    };
    cgroup::remove_stale(&parent, proc_root)
}

/// Creates a memory cgroup for the job under memtrack's own (cgroup v1's
/// memory controller, where memtrack may write), removing empty ones that
/// a killed memtrack left behind. The error says why there is none.
pub fn job_cgroup(proc_root: &Path, run_id: &str) -> Result<Cgroup, NoJobCgroup> {
    let hier = Hierarchies::read(proc_root);
    if let Some((dir, cgroup::Version::V2)) = hier.memory_cgroup_of(proc_root, "self") {
        return Err(NoJobCgroup::V2(dir));
    }
    let text = std::fs::read_to_string(proc_root.join("self/cgroup")).map_err(|source| {
        NoJobCgroup::OwnUnreadable {
            proc_root: proc_root.to_path_buf(),
            source,
        }
    })?;
    let own = cgroup::parse_proc_cgroup(&text)
        .v1_memory
        .ok_or(NoJobCgroup::NoController)?;
    let mount = hier
        .mounts
        .iter()
        .find(|m| m.version == cgroup::Version::V1)
        .ok_or(NoJobCgroup::NoController)?;
    let parent = cgroup::cgroup_dir(mount, &own).ok_or(NoJobCgroup::NotMounted(own))?;
    cgroup::remove_stale(&parent, proc_root);
    let name = cgroup::Creator::this_process(proc_root).cgroup_name(run_id);
    Ok(Cgroup::create_v1(&parent.join(name))?)
}

/// Why the job's existing memory cgroup is not its footprint's source.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotJobOnly {
    #[error("no memory cgroup found for PID {0}")]
    NoCgroup(u32),
    #[error("the job's processes are in different memory cgroups")]
    Split,
    #[error("no process to follow yet")]
    NoProcess,
    #[error("the job runs in the root memory cgroup {}", .0.display())]
    Root(PathBuf),
    #[error("cannot read the job's memory cgroup: {0}")]
    Unreadable(#[source] CgroupError),
    #[error("cannot list {}: {source}", dir.display())]
    Unlisted {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the job's memory cgroup {} also holds {count} other process{}",
        dir.display(),
        if *count == 1 { "" } else { "es" }
    )]
    Foreign { dir: PathBuf, count: usize },
    #[error("{count} of the job's processes are outside its memory cgroup {}", dir.display())]
    Outside { dir: PathBuf, count: usize },
}

/// Why memtrack cannot create a memory cgroup for the job.
#[derive(Debug, thiserror::Error)]
pub enum NoJobCgroup {
    #[error(
        "memtrack does not create cgroups on cgroup v2 (its own is {}): \
         it uses the job's cgroup when that holds only the job",
        .0.display()
    )]
    V2(PathBuf),
    #[error("cannot read {}/self/cgroup: {source}", proc_root.display())]
    OwnUnreadable {
        proc_root: PathBuf,
        source: std::io::Error,
    },
    #[error("no cgroup memory controller is mounted")]
    NoController,
    #[error("memtrack's memory cgroup {0} is not mounted here")]
    NotMounted(String),
    #[error(transparent)]
    Create(#[from] CgroupError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::procfs::ProcOptions;

    /// Files recorded from a real cgroup v2 memory cgroup (Linux 6.18),
    /// whose `cgroup.procs` lists 4 processes.
    const RECORDED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/cgroup_v2");

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }

    /// A process of a fake procfs, in the cgroup `/job.scope`.
    fn process(proc_root: &Path, pid: u32, ppid: u32) {
        let dir = proc_root.join(pid.to_string());
        write(
            &dir.join("stat"),
            &format!("{pid} (python3) S {ppid} {pid} {ppid} 0 -1 4194560 100 0 0 0 5 1 0 0 20 0 1 0 {} 123456789 2500 0\n", 1000 + pid),
        );
        write(&dir.join("statm"), "50000 1536 512 10 0 900 0\n");
        write(
            &dir.join("status"),
            &format!("Name:\tpython3\nState:\tS (sleeping)\nTgid:\t{pid}\nPid:\t{pid}\nPPid:\t{ppid}\nVmHWM:\t    6144 kB\nVmRSS:\t    6144 kB\n"),
        );
        write(&dir.join("cmdline"), "python3\0train.py\0");
        write(&dir.join("cgroup"), "0::/job.scope\n");
    }

    /// The recorded v2 cgroup holding only the job (its four processes, the
    /// first the job and the others its workers) in a fake procfs.
    struct RecordedJob {
        _tmp: tempfile::TempDir,
        proc_root: PathBuf,
        job: PathBuf,
        procs: String,
        pids: Vec<u32>,
    }

    impl RecordedJob {
        fn new() -> RecordedJob {
            let tmp = tempfile::tempdir().expect("tempdir");
            let proc_root = tmp.path().join("proc");
            let mount = tmp.path().join("cgroup");
            let job = mount.join("job.scope");
            std::fs::create_dir_all(&job).expect("mkdir");
            for f in [
                "cgroup.procs",
                "memory.current",
                "memory.peak",
                "memory.stat",
                "memory.events",
            ] {
                std::fs::copy(Path::new(RECORDED).join(f), job.join(f))
                    .expect("copy the recording");
            }
            let procs = std::fs::read_to_string(job.join("cgroup.procs")).expect("procs");
            let pids = cgroup::parse_procs(&procs);
            write(&proc_root.join("stat"), "cpu 1 2 3\nbtime 1700000000\n");
            write(
                &proc_root.join("self/mountinfo"),
                &format!(
                    "32 23 0:28 / {} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n",
                    mount.display()
                ),
            );
            write(&proc_root.join("self/cgroup"), "0::/memtrack.scope\n");
            process(&proc_root, pids[0], 1);
            for &pid in &pids[1..] {
                process(&proc_root, pid, pids[0]);
            }
            RecordedJob {
                _tmp: tmp,
                proc_root,
                job,
                procs,
                pids,
            }
        }

        /// The tree, the job its root.
        fn tree(&self) -> ProcTree {
            let mut tree = ProcTree::new(ProcOptions {
                root: self.proc_root.clone(),
                hwm_interval: Duration::from_secs(1),
                reaper: None,
                job: None,
                smaps: None,
                read_share: 0.02,
            })
            .expect("fake procfs");
            tree.add_root(self.pids[0]).expect("the job");
            tree
        }
    }

    /// [`RecordedJob`] with the cgroup's anonymous charge set to `anon` (as
    /// copies on write raise it before any pass sees them) and pagemaps
    /// that cannot be read (as root, the page count fails). Each process's
    /// `smaps_rollup` says Pss 1 MiB, of which 512 KiB file and shared;
    /// `smaps: false` makes it unreadable.
    fn recorded_job_with_charge(anon: u64, smaps: bool) -> (RecordedJob, ProcTree) {
        let rec = RecordedJob::new();
        let stat = std::fs::read_to_string(rec.job.join("memory.stat")).expect("stat");
        let raised: String = stat
            .lines()
            .map(|l| match l.split_once(' ') {
                Some(("anon", _)) => format!("anon {anon}\n"),
                _ => format!("{l}\n"),
            })
            .collect();
        write(&rec.job.join("memory.stat"), &raised);
        for &pid in &rec.pids {
            let dir = rec.proc_root.join(pid.to_string());
            write(
                &dir.join("maps"),
                "00400000-00452000 r-xp 00000000 08:02 1 /usr/bin/python3\n",
            );
            std::fs::create_dir_all(dir.join("pagemap")).expect("an unreadable pagemap");
            let rollup = dir.join("smaps_rollup");
            if smaps {
                write(
                    &rollup,
                    "Rss: 6144 kB\nPss: 1024 kB\nPss_Anon: 512 kB\nPss_File: 500 kB\n\
                     Pss_Shmem: 12 kB\nPrivate_Clean: 0 kB\nPrivate_Dirty: 512 kB\n",
                );
            } else {
                std::fs::create_dir_all(&rollup).expect("an unreadable smaps_rollup");
            }
        }
        let tree = rec.tree();
        (rec, tree)
    }

    /// Samples `tree` under an auto reader until `done` holds of a figure
    /// (the reads run on the reader thread); that figure.
    fn sample_until(
        tree: &mut ProcTree,
        reader: &mut FootprintReader,
        done: impl Fn(&Footprint) -> bool,
    ) -> Footprint {
        let mut now = Instant::now();
        for _ in 0..400 {
            let mut host = HostSample::default();
            tree.sample(now, &mut host);
            reader.sample(now, 1.0, tree, &mut host);
            let f = host.footprint.expect("a figure");
            if done(&f) {
                return f;
            }
            std::thread::sleep(Duration::from_millis(10));
            now += Duration::from_millis(100);
        }
        panic!("no such figure within 400 samples: {:?}", reader.info());
    }

    fn auto_reader(tree: &ProcTree) -> FootprintReader {
        FootprintReader::new(
            FootprintOptions {
                choice: SourceChoice::Auto,
                proc_root: tree.root().to_path_buf(),
            },
            Some("memtrack does not create cgroups on cgroup v2".into()),
        )
    }

    /// The ceiling over a count carried forward: the figure at the last
    /// whole count plus the rise of the cgroup's anonymous charge since
    /// (and of the count's file and shared pages); never lower than the
    /// floor, and never raised by an estimate that runs high.
    #[test]
    fn between_counts_the_figure_rises_no_more_than_the_charge() {
        const M: u64 = 1 << 20;
        let t0 = Instant::now();
        let tick = |n: u64| t0 + Duration::from_millis(100 * n);
        let fig = |used: u64, passes: u64, commits: u64, from: u64, shared: u64| PagesFigure {
            used: used * M,
            exact: passes > 0,
            age_s: None,
            passes,
            commits,
            counted_from: Some(tick(from)),
            shared: Some(shared * M),
        };
        let mut c = Ceiling::default();
        // Before any whole count: none.
        assert_eq!(
            c.at(tick(0), &fig(100, 0, 1, 0, 10), (90 * M, 0), 100 * M),
            None
        );
        // The job grows to 480 MiB; a count is handed over at tick 5 and
        // taken in at tick 7, whole: 500 MiB, of which 20 file and shared.
        for n in 1..7 {
            let charge = (90 + 78 * n.min(5)) * M;
            assert_eq!(c.at(tick(n), &fig(100, 0, 1, 0, 10), (charge, 0), 0), None);
        }
        assert_eq!(
            c.at(tick(7), &fig(500, 1, 2, 5, 20), (480 * M, 0), 500 * M),
            Some(500 * M),
            "the lowest charge since its reads began: 480"
        );
        // The job writes 50 MiB: the ceiling rises with the charge.
        assert_eq!(
            c.at(tick(8), &fig(520, 1, 2, 5, 20), (530 * M, 0), 550 * M),
            Some(550 * M)
        );
        // Forks appear and the estimate runs 470 MiB high: capped.
        let f = fig(1000, 1, 2, 5, 20);
        assert_eq!(c.at(tick(9), &f, (530 * M, 0), 550 * M), Some(550 * M));
        // A slice brings 30 MiB more of file pages: they lift it.
        assert_eq!(
            c.at(tick(10), &fig(1000, 1, 3, 9, 50), (530 * M, 0), 580 * M),
            Some(580 * M)
        );
        // The next whole count read high: the anchor stays under the
        // ceiling it had.
        assert_eq!(
            c.at(tick(11), &fig(1000, 2, 4, 10, 50), (530 * M, 0), 580 * M),
            Some(580 * M)
        );
        // The charge falls: the ceiling stays on the count it rests on
        // (the floor follows the charge down).
        assert_eq!(
            c.at(tick(12), &fig(400, 2, 4, 10, 50), (300 * M, 0), 350 * M),
            Some(580 * M)
        );
    }

    /// Auto, without a page count (no root, or pages that cannot be read):
    /// a cgroup holding only the job is no longer the figure but the floor
    /// under Σ Pss: its anonymous charge plus the file and shared part of
    /// Σ Pss.
    #[test]
    fn auto_over_a_cgroup_holding_only_the_job_is_pss_with_the_charge_as_floor() {
        let anon = 100 * 1024 * 1024u64;
        let (rec, mut tree) = recorded_job_with_charge(anon, true);
        let job = &rec.job;
        let mut reader = auto_reader(&tree);
        // A complete Σ Pss pass behind the figure.
        let f = sample_until(&mut tree, &mut reader, |f| {
            f.source == HostSource::Pss && f.age_s.is_some()
        });
        let info = reader.info().clone();
        assert_eq!(info.source, HostSource::Pss, "{info:?}");
        assert_eq!(info.cgroup.as_deref(), Some(job.as_path()));
        assert!(info.reason.contains("floor"), "{}", info.reason);
        let shared = 4 * 512 * 1024;
        assert_eq!(
            f.used,
            anon + shared,
            "the charge and the shared part, over Σ Pss (4 MiB)"
        );
        assert!(f.cgroup.is_some(), "the cgroup's reading is kept");
        assert_eq!(reader.oom_counter(), Some(job.join("memory.events")));
    }

    /// Where Σ Pss cannot be read either, the cgroup's charge is the
    /// figure, and says so.
    #[test]
    fn auto_over_a_cgroup_without_pss_takes_the_charge() {
        let (_rec, mut tree) = recorded_job_with_charge(100 * 1024 * 1024, false);
        let mut reader = auto_reader(&tree);
        let f = sample_until(&mut tree, &mut reader, |f| f.source == HostSource::Cgroup);
        let info = reader.info().clone();
        assert_eq!(info.source, HostSource::Cgroup, "{info:?}");
        assert!(
            info.reason.contains("the cgroup's charge is the figure"),
            "{}",
            info.reason
        );
        assert!(f.used > 0);
    }

    #[test]
    fn a_recorded_cgroup_v2_holding_only_the_job_is_the_source_until_a_stranger_joins() {
        let rec = RecordedJob::new();
        assert_eq!(rec.pids.len(), 4, "{}", rec.procs);
        let (proc_root, job, procs) = (&rec.proc_root, &rec.job, &rec.procs);
        let mut tree = rec.tree();
        let mut reader = FootprintReader::new(
            FootprintOptions {
                choice: SourceChoice::Cgroup,
                proc_root: proc_root.clone(),
            },
            Some("memtrack does not create cgroups on cgroup v2".into()),
        );
        let now = Instant::now();
        let mut host = HostSample::default();
        tree.sample(now, &mut host);
        assert_eq!(tree.len(), 4, "the job and its 3 workers");
        reader.sample(now, 1.0, &mut tree, &mut host);
        let info = reader.info().clone();
        assert_eq!(info.source, HostSource::Cgroup, "{info:?}");
        assert_eq!(info.cgroup_version, Some(2));
        assert_eq!(info.cgroup.as_deref(), Some(job.as_path()));
        assert!(!info.cgroup_created);
        assert!(
            info.reason.contains("holds only the job"),
            "{}",
            info.reason
        );
        let number = |f: &str| -> u64 {
            std::fs::read_to_string(Path::new(RECORDED).join(f))
                .expect("recorded")
                .trim()
                .parse()
                .expect("a number")
        };
        let stat = cgroup::parse_memory_stat(
            &std::fs::read_to_string(Path::new(RECORDED).join("memory.stat")).expect("stat"),
            cgroup::Version::V2,
        )
        .expect("recorded stat");
        let f = host.footprint.expect("a figure");
        assert_eq!(f.source, HostSource::Cgroup);
        // The charge less cold page cache. (The peak is not checked here:
        // opening the cgroup resets `memory.peak` by a write, which on
        // cgroupfs leaves the text alone and here does not; the cgroup
        // module's own tests read the recorded peak.)
        assert_eq!(f.used, number("memory.current") - stat.inactive_file);
        assert!(f.peak >= f.used);
        assert_eq!(
            reader.oom_counter(),
            Some(job.join("memory.events")),
            "v2 counts OOM kills in memory.events"
        );

        // A process that is not the job's joins the cgroup: from the next
        // membership check on, the figure is Σ Pss, and says why.
        process(proc_root, 999, 1);
        write(&job.join("cgroup.procs"), &format!("{procs}999\n"));
        let later = now + MEMBERSHIP_EVERY + Duration::from_millis(100);
        host.clear();
        tree.sample(later, &mut host);
        reader.sample(later, 3.0, &mut tree, &mut host);
        let info = reader.take_change().expect("the source changed");
        assert_eq!(info.source, HostSource::Pss, "{info:?}");
        assert!(info.reason.contains("1 other process"), "{}", info.reason);
        assert_eq!(host.footprint.map(|f| f.source), Some(HostSource::Pss));
        assert!(
            job.exists(),
            "a cgroup memtrack did not create is left alone"
        );
    }
}
