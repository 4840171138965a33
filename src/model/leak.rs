//! Leak detection: is a memory series still growing, steadily, at the end
//! of the run? Pure functions over `(time, MiB)` series, so the rule is
//! tested on generated data and the same verdicts appear in the JSON, the
//! report and the plot.
//!
//! docs/leak.md says the same for users: change both together.
//!
//! # The rule
//!
//! A series is judged only when it spans at least
//! `LeakConfig::min_duration_s` (20 s, see `MIN_JUDGED_RUN_S`) and
//! keeps at least `LeakConfig::min_points` (12) samples after warm-up.
//! The first `warmup_fraction` (20 %) of the series — at least
//! `warmup_min_s` (2 s), at most `warmup_max_s` (10 min) — is start-up
//! (imports, model load, CUDA context, allocator pools) and is ignored; the
//! *window* is the rest, at most the last `window_max_s` (24 h). So the
//! warm-up and the window grow with the run: 6 s and 24 s for a 30-second
//! job, 10 min and 7 h 50 min for an 8-hour one.
//!
//! Before judging, **one-time steps are set aside**: a rise between two
//! neighbouring points far beyond the usual ones (more than `jump_sigmas`
//! (8) robust standard deviations of the rises, and more than half of
//! `min_growth_mib`) is subtracted from every later point, when there are
//! at most `max_steps` (2) such jumps (more are a staircase, judged as it
//! is) and it is not a one-sample spike. A plain step then reads as flat,
//! and a leak with an evaluation step at the end reads as the leak alone,
//! at its own rate. Only rises are removed, so this can lower a trend but
//! never create one: a sawtooth's falls are left where they are.
//!
//! A leak is suspected when **all** of these hold on the window:
//!
//! 1. **Statistically significant growth.** The Theil–Sen slope (the
//!    median of the slopes between every pair of points: a noise spike or a
//!    single jump moves it little) has a Sen confidence interval at level
//!    `1 - alpha` (99 %) that lies above 0. The interval comes from the
//!    Mann–Kendall statistic's variance, with the tie correction (memory
//!    figures repeat); without ties it is the same as a Mann–Kendall test
//!    of "no trend" (whose p-value is reported too). With many ties — a
//!    flat line with one jump — more than half the pairwise slopes are 0
//!    and the interval keeps 0 even where Mann–Kendall alone would call the
//!    jump a trend.
//! 2. **Practically significant growth.** The rate is at least
//!    `min_rate_mib_per_hour` (10 MiB/h) and the growth it implies over the
//!    window is at least `min_growth_mib` (32 MiB) *and* at least
//!    `min_growth_fraction` (3 %) of the level at the window's start: a
//!    10 GiB process must gain 300 MiB before anyone is paged.
//! 3. **Steady growth, not a step.** The window is cut into `segments` (4)
//!    consecutive parts of equal sample counts; between neighbours the rate
//!    of their medians (MiB per second, so gaps between spans do not
//!    matter) must be positive everywhere, and the slowest of these rates
//!    must be at least `min_segment_ratio` (25 %) of the fastest. A
//!    one-time step rises in one part and is flat in the others, so it
//!    fails; a sawtooth has equal medians in every part, so it fails too.
//! 4. **Not levelling off.** The Theil–Sen slope of the window's second
//!    half must be at least `min_half_ratio` (50 %) of the first half's. A
//!    cache filling as `1 - exp(-t/τ)` with τ up to half the run is
//!    judged a plateau; one still filling at the same pace at the end is,
//!    as far as the data can tell, a leak.
//!
//! # How short a run can be judged
//!
//! 20 s of samples and 12 points in the window (`MIN_JUDGED_RUN_S`,
//! `MIN_JUDGED_POINTS`). Twelve points is what the rule needs: four
//! parts of three points each for the step test (a median of fewer is one
//! noisy sample), and Sen's 99 % interval cannot exclude 0 with fewer than
//! about 8 points even for a perfectly straight line. 20 s keeps that at
//! memtrack's default 1 s interval (a 20 s run leaves 16 s after its
//! warm-up, 16 samples), and below it what a sampler sees is start-up —
//! loading grows steadily and then stops — so a per-hour rate
//! extrapolated from a few seconds would call every model load a leak. A
//! 30-second job that grows steadily by 600 MiB is therefore judged, and
//! flagged. A run at a 5 s interval needs about 75 s.
//!
//! # Cost
//!
//! The estimators are O(n²) in the points used. Windows with more than
//! `max_points` (512) samples are reduced first to that many buckets of
//! consecutive samples (mean time, median value), so a verdict costs about
//! 130 000 slope evaluations (about a millisecond) however long the run.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use serde_json::Value;

use crate::model::thin::{Mergeable, Thinned};
use crate::model::{Document, Entry, EntryKind, GpuSource, Target};
use crate::units::duration_one_unit;

/// The shortest series, in seconds, that is judged at all (see the module
/// documentation for the reasons).
pub(crate) const MIN_JUDGED_RUN_S: f64 = 20.0;

/// The fewest samples after warm-up that are judged.
pub(crate) const MIN_JUDGED_POINTS: usize = 12;

/// Thresholds of the leak rule. Every field has a default, so a partial
/// TOML or JSON table works.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeakConfig {
    /// Series shorter than this (seconds) are not judged.
    pub(crate) min_duration_s: f64,
    /// Fewer samples than this after warm-up are not judged.
    pub(crate) min_points: usize,
    /// Share of the series treated as warm-up…
    pub(crate) warmup_fraction: f64,
    /// …but at least this many seconds…
    pub(crate) warmup_min_s: f64,
    /// …and at most this many.
    pub(crate) warmup_max_s: f64,
    /// The window judged is at most the last this many seconds.
    pub(crate) window_max_s: f64,
    /// Two-sided level of Sen's confidence interval (0.01: a 99 % interval).
    pub(crate) alpha: f64,
    /// Slower growth is not worth reporting (MiB per hour).
    pub(crate) min_rate_mib_per_hour: f64,
    /// Growth over the window must reach this many MiB…
    pub(crate) min_growth_mib: f64,
    /// …and this share of the level at the window's start.
    pub(crate) min_growth_fraction: f64,
    /// Consecutive parts of the window compared by the step test.
    pub(crate) segments: usize,
    /// The slowest part-to-part rate over the fastest must reach this.
    pub(crate) min_segment_ratio: f64,
    /// The second half's slope over the first half's must reach this.
    pub(crate) min_half_ratio: f64,
    /// Windows with more samples are bucketed down to this many points.
    pub(crate) max_points: usize,
    /// A rise between neighbours larger than this many robust standard
    /// deviations of the rises (and than half `min_growth_mib`) is a jump.
    pub(crate) jump_sigmas: f64,
    /// Up to this many upward jumps are set aside as one-time steps; more
    /// are a staircase, judged as it is.
    pub(crate) max_steps: usize,
}

impl Default for LeakConfig {
    fn default() -> Self {
        LeakConfig {
            min_duration_s: MIN_JUDGED_RUN_S,
            min_points: MIN_JUDGED_POINTS,
            warmup_fraction: 0.2,
            warmup_min_s: 2.0,
            warmup_max_s: 600.0,
            window_max_s: 24.0 * 3600.0,
            alpha: 0.01,
            min_rate_mib_per_hour: 10.0,
            min_growth_mib: 32.0,
            min_growth_fraction: 0.03,
            segments: 4,
            min_segment_ratio: 0.25,
            min_half_ratio: 0.5,
            max_points: 512,
            jump_sigmas: 8.0,
            max_steps: 2,
        }
    }
}

/// The verdict on one series. Read leniently: a field a file lacks takes
/// its value of a series not judged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Verdict {
    /// Every condition of the rule holds.
    pub suspected: bool,
    /// The series was long enough to apply the rule at all.
    pub judged: bool,
    /// Theil–Sen slope over the window (0 when not judged).
    pub rate_mib_per_hour: f64,
    /// Sen's confidence interval of the rate at level `1 - alpha`.
    pub ci_mib_per_hour: (f64, f64),
    /// Mann–Kendall one-sided p-value for "no upward trend" (1 when not
    /// judged).
    pub p_value: f64,
    /// Length of the window judged, seconds.
    pub window_s: f64,
    /// Warm-up skipped before the window, seconds.
    pub warmup_s: f64,
    /// Samples in the window.
    pub samples: usize,
    /// Points the estimators used (samples, or buckets of them).
    pub points: usize,
    /// Median memory at the window's start, MiB.
    pub level_mib: f64,
    /// Growth over the window implied by the rate, MiB.
    pub growth_mib: f64,
    /// One-time upward jumps set aside before judging, and their sum, MiB.
    pub steps: usize,
    pub step_mib: f64,
    /// The condition that decided, in words.
    pub reason: String,
}

impl Default for Verdict {
    fn default() -> Self {
        Verdict::unjudged(String::new())
    }
}

impl Verdict {
    fn unjudged(reason: String) -> Self {
        Verdict {
            suspected: false,
            judged: false,
            rate_mib_per_hour: 0.0,
            ci_mib_per_hour: (0.0, 0.0),
            p_value: 1.0,
            window_s: 0.0,
            warmup_s: 0.0,
            samples: 0,
            points: 0,
            level_mib: 0.0,
            growth_mib: 0.0,
            steps: 0,
            step_mib: 0.0,
            reason,
        }
    }
}

/// The `leak` block of `memory_usage.json`: one run's verdicts
/// ([`analyze`]), or a merged job's (`memtrack merge`: the worst rank's
/// `host` and `gpu`, every rank's block under `ranks`). Fields one of the
/// two shapes lacks are `None` and not written. Read leniently
/// ([`LeakReport::from_value`]): a field a file lacks takes its default.
///
/// The block is written through `LeakReport::to_value`, whose objects
/// keep their keys sorted, as the files have always had them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LeakReport {
    /// Some verdict is suspected.
    pub suspected: bool,
    /// What is suspected: `host`, `gpu`, `target PID (name)[ gpu]`,
    /// `component NAME`; in a merged job prefixed with `rank R: `.
    pub suspects: Vec<String>,
    /// The tree's host memory (timer samples); in a merged job the worst
    /// rank's, `null` when no rank has one.
    pub host: Option<Verdict>,
    /// The tree's GPU memory, where any is non-zero.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Verdict>,
    /// The targets long enough to judge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub targets: Option<Vec<TargetVerdict>>,
    /// How many targets were too short to judge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub targets_not_judged: Option<usize>,
    /// Timer samples taken inside each component's spans.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub components: Option<BTreeMap<String, Verdict>>,
    /// The thresholds the verdicts used (`None` too when a file's table
    /// does not read as this version's).
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "config_or_none"
    )]
    pub config: Option<LeakConfig>,
    /// A merged job: each rank's own block.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<BTreeMap<String, LeakReport>>,
}

/// One target's verdicts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TargetVerdict {
    pub pid: u32,
    pub name: String,
    /// What `host` judged: `uss` (the memory the process alone holds, so a
    /// worker turning shared pages private shows as its own growth) where
    /// its own-cost series is long enough, else `rss`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub figure: String,
    pub host: Verdict,
    /// Its GPU memory, where any is non-zero.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Verdict>,
}

/// A config table that does not read (a key of another version) reads as
/// `None`, not as an unreadable report.
fn config_or_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<LeakConfig>, D::Error> {
    let v = Value::deserialize(d)?;
    Ok(LeakConfig::deserialize(&v).ok())
}

impl LeakReport {
    /// The block as the document holds it (keys sorted).
    pub(crate) fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or_default()
    }

    /// A document's block, read leniently: a field it lacks takes its
    /// default, and a block of another shape reads as an empty report.
    pub fn from_value(v: &Value) -> LeakReport {
        LeakReport::deserialize(v).unwrap_or_default()
    }
}

/// Judges one series. `t`: Unix seconds (sorted here if they are not);
/// `mb`: memory in MiB, same length (extra values of the longer slice are
/// ignored, non-finite pairs dropped). The series may be the max-envelope
/// of merged buckets, as memtrack thins long logs.
pub(crate) fn detect(t: &[f64], mb: &[f64], cfg: &LeakConfig) -> Verdict {
    let mut pts: Vec<(f64, f64)> = t
        .iter()
        .zip(mb)
        .map(|(&t, &y)| (t, y))
        .filter(|(t, y)| t.is_finite() && y.is_finite())
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (Some(&(first, _)), Some(&(last, _))) = (pts.first(), pts.last()) else {
        return Verdict::unjudged("no samples".into());
    };
    let duration = last - first;
    let warmup = (cfg.warmup_fraction * duration)
        .max(cfg.warmup_min_s)
        .min(cfg.warmup_max_s);
    let start = (first + warmup).max(last - cfg.window_max_s);
    let win: Vec<(f64, f64)> = pts.iter().copied().filter(|p| p.0 >= start).collect();
    let mut v = Verdict::unjudged(String::new());
    v.warmup_s = (start - first).max(0.0);
    v.window_s = (last - start).max(0.0);
    v.samples = win.len();
    if duration < cfg.min_duration_s {
        v.reason = format!(
            "not judged: {} of samples, at least {} are needed",
            duration_one_unit(duration),
            duration_one_unit(cfg.min_duration_s)
        );
        return v;
    }
    if win.len() < cfg.min_points.max(4) {
        v.reason = format!(
            "not judged: {} samples after the {} warm-up, at least {} are needed",
            win.len(),
            duration_one_unit(v.warmup_s),
            cfg.min_points.max(4)
        );
        return v;
    }
    let mut used = downsample(&win, cfg.max_points.max(16));
    v.points = used.len();
    (v.steps, v.step_mib) = set_aside_steps(&mut used, cfg);
    let Some(fit) = sen(&used, cfg.alpha) else {
        v.reason = "not judged: every sample has the same time".into();
        return v;
    };
    judge(&mut v, &fit, &used, cfg);
    v
}

/// Applies the rule's conditions to a fitted window, in order: the first
/// that fails is the reason; when none fails, a leak is suspected.
fn judge(v: &mut Verdict, fit: &Sen, used: &[(f64, f64)], cfg: &LeakConfig) {
    let aside = if v.steps == 0 {
        String::new()
    } else {
        format!(
            " (after setting aside {} one-time step{} of +{} MiB)",
            v.steps,
            if v.steps == 1 { "" } else { "s" },
            num(v.step_mib)
        )
    };
    v.judged = true;
    v.rate_mib_per_hour = fit.slope * 3600.0;
    v.ci_mib_per_hour = (fit.lo * 3600.0, fit.hi * 3600.0);
    v.p_value = fit.p_up;
    v.growth_mib = fit.slope * v.window_s;
    let parts = segments(used, cfg.segments);
    v.level_mib = parts.first().map_or(0.0, |p| p.1);
    let needed_growth = cfg
        .min_growth_mib
        .max(cfg.min_growth_fraction * v.level_mib);
    let ci = format!(
        "{:.0} % CI [{}, {}] MiB/h",
        (1.0 - cfg.alpha) * 100.0,
        num(v.ci_mib_per_hour.0),
        num(v.ci_mib_per_hour.1)
    );

    if fit.hi < 0.0 {
        // The whole interval below 0: it shrank, and said so.
        v.reason = format!(
            "no significant growth{aside}: shrinking at {} MiB/h, {ci}",
            num(v.rate_mib_per_hour)
        );
        return;
    }
    if fit.lo <= 0.0 {
        v.reason = format!(
            "no significant growth{aside}: {} MiB/h, {ci} includes 0 (Mann–Kendall p = {:.2})",
            num(v.rate_mib_per_hour),
            fit.p_up
        );
        return;
    }
    if v.rate_mib_per_hour < cfg.min_rate_mib_per_hour || v.growth_mib < needed_growth {
        v.reason = format!(
            "growth too small to matter{aside}: {} MiB/h, +{} MiB over {} (needs {} MiB/h \
             and +{} MiB)",
            num(v.rate_mib_per_hour),
            num(v.growth_mib),
            duration_one_unit(v.window_s),
            num(cfg.min_rate_mib_per_hour),
            num(needed_growth)
        );
        return;
    }
    if let Some(reason) = unsteady(&parts, cfg, &aside).or_else(|| levelling_off(used, cfg, &aside))
    {
        v.reason = reason;
        return;
    }
    v.suspected = true;
    v.reason = format!(
        "leak suspected: +{} MiB over the last {} ({} MiB/h, {ci}), steadily{aside}",
        num(v.growth_mib),
        duration_one_unit(v.window_s),
        num(v.rate_mib_per_hour)
    );
}

/// Why the growth between the window's parts is not steady (a step or an
/// oscillation), if it is not.
fn unsteady(parts: &[(f64, f64)], cfg: &LeakConfig, aside: &str) -> Option<String> {
    let rates: Vec<f64> = parts
        .windows(2)
        .filter(|w| w[1].0 > w[0].0)
        .map(|w| (w[1].1 - w[0].1) / (w[1].0 - w[0].0))
        .collect();
    let fastest = rates.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let slowest = rates.iter().copied().fold(f64::INFINITY, f64::min);
    if rates.is_empty() || slowest <= 0.0 || slowest < cfg.min_segment_ratio * fastest {
        let list: Vec<String> = rates.iter().map(|r| num(r * 3600.0)).collect();
        return Some(format!(
            "not steady{aside}: a step or an oscillation, not a leak (median growth between \
             the window's {} parts: [{}] MiB/h)",
            parts.len(),
            list.join(", ")
        ));
    }
    None
}

/// Why the growth levels off (a filling cache), if it does: the second
/// half's slope against the first half's.
fn levelling_off(used: &[(f64, f64)], cfg: &LeakConfig, aside: &str) -> Option<String> {
    let half = used.len() / 2;
    let first_half = sen_slope(&used[..half]);
    let second_half = sen_slope(&used[half..]);
    if second_half <= 0.0 || second_half < cfg.min_half_ratio * first_half {
        return Some(format!(
            "levelling off{aside}: the second half grows at {} MiB/h against {} MiB/h \
             before (a filling cache, not a leak)",
            num(second_half * 3600.0),
            num(first_half * 3600.0)
        ));
    }
    None
}

/// One point of a leak series: an entry's time span and figures, or the
/// maximum of each figure over neighbouring entries once a long series is
/// thinned (the same max-envelope memtrack keeps for its timer log).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct LeakPoint {
    /// The first entry's time and the last one's end (Unix seconds).
    pub(crate) t0: f64,
    pub(crate) t1: f64,
    pub(crate) cpu: f64,
    pub(crate) gpu_process: f64,
    pub(crate) gpu_used: f64,
}

impl LeakPoint {
    pub(crate) fn of(e: &Entry) -> LeakPoint {
        LeakPoint {
            t0: e.timestamp,
            t1: e.timestamp_end.unwrap_or(e.timestamp),
            cpu: e.figures.cpu_ram_used_mb,
            gpu_process: e.figures.gpu_process_used_mb,
            gpu_used: e.figures.gpu_ram_used_mb,
        }
    }

    /// The middle of the point's time span (its value stands for all of
    /// it), or the sample's time.
    fn mid(&self) -> f64 {
        if self.t1 > self.t0 {
            (self.t0 + self.t1) / 2.0
        } else {
            self.t0
        }
    }
}

impl Mergeable for LeakPoint {
    fn absorb(&mut self, later: &LeakPoint) {
        self.t1 = self.t1.max(later.t1);
        self.cpu = self.cpu.max(later.cpu);
        self.gpu_process = self.gpu_process.max(later.gpu_process);
        self.gpu_used = self.gpu_used.max(later.gpu_used);
    }
}

/// A timer sample's point and the component of the span it was taken in.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct TimerPoint {
    pub(crate) point: LeakPoint,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) component: Option<String>,
}

impl TimerPoint {
    pub(crate) fn of(e: &Entry) -> TimerPoint {
        TimerPoint {
            point: LeakPoint::of(e),
            component: e
                .span
                .as_ref()
                .map(|s| s.split('/').next().unwrap_or(s).to_string()),
        }
    }
}

impl Mergeable for TimerPoint {
    fn absorb(&mut self, later: &TimerPoint) {
        self.point.absorb(&later.point);
    }

    fn same_phase(&self, later: &TimerPoint) -> bool {
        self.component == later.component
    }

    fn absorb_across(&mut self, later: &TimerPoint) {
        if later.point.cpu > self.point.cpu {
            self.component.clone_from(&later.component);
        }
        self.absorb(later);
    }
}

/// Points each series keeps exactly; a longer series is thinned to a
/// max-envelope of at most this many points (the rule then buckets to
/// [`LeakConfig::max_points`] anyway). Bounds the memory of the fold, in
/// the daemon and in the readers, however long the log.
pub(crate) const SERIES_POINTS: usize = 16_384;

/// The series the leak rule reads, folded from a log one entry at a time
/// (in log order), in memory bounded by [`SERIES_POINTS`] per series:
/// timer samples, every entry, and the entries carrying PyTorch allocator
/// figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct LeakSeries {
    timers: Thinned<TimerPoint>,
    all: Thinned<LeakPoint>,
    alloc: Thinned<LeakPoint>,
}

impl Default for LeakSeries {
    fn default() -> Self {
        LeakSeries {
            timers: Thinned::new(SERIES_POINTS),
            all: Thinned::new(SERIES_POINTS),
            alloc: Thinned::new(SERIES_POINTS),
        }
    }
}

impl LeakSeries {
    /// Folds in the next entry of a log.
    pub(crate) fn push(&mut self, e: &Entry) {
        if e.kind == EntryKind::Timer {
            self.timers.push(TimerPoint::of(e));
        }
        self.push_untimed(e);
    }

    /// Folds in an entry that is not a timer sample, leaving the timer
    /// series to the caller (the store keeps its own timer log).
    pub(crate) fn push_untimed(&mut self, e: &Entry) {
        let p = LeakPoint::of(e);
        self.all.push(p);
        if e.gpu_source == GpuSource::Allocator {
            self.alloc.push(p);
        }
    }

    /// The verdicts of a log whose timer samples are kept apart (the
    /// store's timer log, `timers`, in time order) and whose other
    /// entries were folded here with [`LeakSeries::push_untimed`]; the two
    /// are merged by time as the document's log merges them.
    pub(crate) fn analyze_beside(
        &self,
        timers: &[&Entry],
        targets: &[Target],
        schema: u32,
        cfg: &LeakConfig,
    ) -> LeakReport {
        let points: Vec<TimerPoint> = timers.iter().map(|e| TimerPoint::of(e)).collect();
        let alloc: Vec<LeakPoint> = self.alloc.iter().copied().collect();
        let all = || {
            let mut out = Vec::with_capacity(self.all.len() + timers.len());
            let mut t = timers.iter().peekable();
            for p in self.all.iter() {
                while let Some(e) = t.next_if(|e| e.timestamp <= p.t0) {
                    out.push(LeakPoint::of(e));
                }
                out.push(*p);
            }
            out.extend(t.map(|e| LeakPoint::of(e)));
            out
        };
        analyze_parts(&points, &all, &alloc, targets, schema, cfg)
    }

    /// The verdicts on a log folded here with [`LeakSeries::push`].
    pub(crate) fn analyze(&self, targets: &[Target], schema: u32, cfg: &LeakConfig) -> LeakReport {
        let timers: Vec<TimerPoint> = self.timers.iter().cloned().collect();
        let alloc: Vec<LeakPoint> = self.alloc.iter().copied().collect();
        analyze_parts(
            &timers,
            &|| self.all.iter().copied().collect(),
            &alloc,
            targets,
            schema,
            cfg,
        )
    }
}

/// The `leak` block of `memory_usage.json`: verdicts on the tree's host
/// memory (timer samples), on its GPU memory where any is non-zero, per
/// target (each one's `series`; only the targets long enough to judge are
/// listed, the rest counted), and per component (timer samples taken
/// inside that component's spans).
pub fn analyze(doc: &Document, cfg: &LeakConfig) -> LeakReport {
    let mut series = LeakSeries::default();
    for e in &doc.detailed_log {
        series.push(e);
    }
    series.analyze(&doc.targets, doc.schema, cfg)
}

/// [`analyze`] over a log's series: its timer samples, every entry
/// (`all`, asked for only when the timer samples are too few), the
/// entries with allocator figures, the targets, and the schema version (0
/// for a bare file).
pub(crate) fn analyze_parts(
    timers: &[TimerPoint],
    all: &dyn Fn() -> Vec<LeakPoint>,
    alloc: &[LeakPoint],
    targets: &[Target],
    schema: u32,
    cfg: &LeakConfig,
) -> LeakReport {
    let mut judge = Judge {
        cfg,
        suspects: Vec::new(),
    };
    let (host, gpu) = tree_verdicts(&mut judge, timers, all, alloc, schema);
    let (targets, targets_not_judged) = target_verdicts(&mut judge, targets);
    let components = component_verdicts(&mut judge, timers);
    LeakReport {
        suspected: !judge.suspects.is_empty(),
        suspects: judge.suspects,
        host: Some(host),
        gpu,
        targets: Some(targets),
        targets_not_judged: Some(targets_not_judged),
        components: Some(components),
        config: Some(*cfg),
        ranks: None,
    }
}

/// Judges series one after another, naming the suspected ones in order.
struct Judge<'a> {
    cfg: &'a LeakConfig,
    suspects: Vec<String>,
}

impl Judge<'_> {
    fn verdict(&mut self, name: String, t: &[f64], y: &[f64]) -> Verdict {
        let v = detect(t, y, self.cfg);
        if v.suspected {
            self.suspects.push(name);
        }
        v
    }
}

/// The tree's host memory and, where any is non-zero, its GPU memory.
fn tree_verdicts(
    judge: &mut Judge<'_>,
    timers: &[TimerPoint],
    all: &dyn Fn() -> Vec<LeakPoint>,
    alloc: &[LeakPoint],
    schema: u32,
) -> (Verdict, Option<Verdict>) {
    // The tree's samples: timer entries (uniformly thinned, maxima kept),
    // or every entry of a log that has too few of them (a bare
    // file).
    let log: Vec<LeakPoint> = if timers.len() >= judge.cfg.min_points {
        timers.iter().map(|t| t.point).collect()
    } else {
        all()
    };
    let t: Vec<f64> = log.iter().map(LeakPoint::mid).collect();
    let host: Vec<f64> = log.iter().map(|p| p.cpu).collect();
    let host_v = judge.verdict("host".into(), &t, &host);

    // The tree's GPU memory: NVML's per-process figure when there is one;
    // otherwise PyTorch's `memory_allocated` sent with marks (a leak of
    // tensors shows there, while `reserved` plateaus with the caching
    // pool), or the base `gpu_ram_used_mb`.
    let (gt, gy): (Vec<f64>, Vec<f64>) = if log.iter().any(|p| p.gpu_process > 0.0) {
        (t.clone(), log.iter().map(|p| p.gpu_process).collect())
    } else {
        let seed;
        let pts: &[LeakPoint] = if schema == 0 {
            seed = all();
            &seed
        } else {
            alloc
        };
        (
            pts.iter().map(LeakPoint::mid).collect(),
            pts.iter().map(|p| p.gpu_used).collect(),
        )
    };
    let gpu_v = gy
        .iter()
        .any(|&y| y > 0.0)
        .then(|| judge.verdict("gpu".into(), &gt, &gy));
    (host_v, gpu_v)
}

/// The verdicts of the targets long enough to judge, and how many were not.
fn target_verdicts(judge: &mut Judge<'_>, targets: &[Target]) -> (Vec<TargetVerdict>, usize) {
    let mut judged = Vec::new();
    let mut unjudged = 0usize;
    for target in targets {
        let t: Vec<f64> = target.series.iter().map(|p| p[0]).collect();
        let label = format!("target {} ({})", target.pid, target.name);
        // Its own memory (USS) where read often enough to judge, else RSS.
        let own_t: Vec<f64> = target.own_series.iter().map(|p| p[0]).collect();
        let uss: Vec<f64> = target.own_series.iter().map(|p| p[1]).collect();
        let own = judge.verdict(format!("{label} own memory"), &own_t, &uss);
        let (figure, v) = if own.judged {
            ("uss", own)
        } else {
            let rss: Vec<f64> = target.series.iter().map(|p| p[1]).collect();
            ("rss", judge.verdict(label.clone(), &t, &rss))
        };
        if !v.judged {
            unjudged += 1;
            continue;
        }
        let mut item = TargetVerdict {
            pid: target.pid,
            name: target.name.clone(),
            figure: figure.into(),
            host: v,
            gpu: None,
        };
        if target.series.iter().any(|p| p[2] > 0.0) {
            let gpu: Vec<f64> = target.series.iter().map(|p| p[2]).collect();
            item.gpu = Some(judge.verdict(format!("{label} gpu"), &t, &gpu));
        }
        judged.push(item);
    }
    (judged, unjudged)
}

/// Per component: the timer samples taken inside its spans.
fn component_verdicts(judge: &mut Judge<'_>, timers: &[TimerPoint]) -> BTreeMap<String, Verdict> {
    let mut components = BTreeMap::new();
    let mut by_component: BTreeMap<&str, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for tp in timers {
        if let Some(component) = &tp.component {
            let (t, y) = by_component.entry(component).or_default();
            t.push(tp.point.mid());
            y.push(tp.point.cpu);
        }
    }
    for (component, (t, y)) in by_component {
        let v = judge.verdict(format!("component {component}"), &t, &y);
        components.insert(component.to_string(), v);
    }
    components
}

/// Theil–Sen slope with Sen's interval and the Mann–Kendall test.
#[derive(Debug, Clone, Copy)]
struct Sen {
    slope: f64,
    lo: f64,
    hi: f64,
    p_up: f64,
}

fn sen(p: &[(f64, f64)], alpha: f64) -> Option<Sen> {
    let n = p.len();
    let mut slopes = Vec::with_capacity(n * n.saturating_sub(1) / 2);
    let mut s: i64 = 0;
    for (i, a) in p.iter().enumerate() {
        for b in &p[i + 1..] {
            let dy = b.1 - a.1;
            if dy > TIE {
                s += 1;
            } else if dy < -TIE {
                s -= 1;
            }
            let dt = b.0 - a.0;
            if dt > 0.0 {
                slopes.push(dy / dt);
            }
        }
    }
    if slopes.is_empty() {
        return None;
    }
    let var = kendall_variance(p);
    let z = if var > 0.0 {
        (s - s.signum()) as f64 / var.sqrt()
    } else {
        0.0
    };
    let p_up = 0.5 * erfc(z / std::f64::consts::SQRT_2);
    let big_n = slopes.len();
    let c = normal_quantile(1.0 - alpha / 2.0) * var.sqrt();
    let last = (big_n - 1) as f64;
    let lo_rank = ((big_n as f64 - c) / 2.0).floor().clamp(0.0, last) as usize;
    let hi_rank = ((big_n as f64 + c) / 2.0).ceil().clamp(0.0, last) as usize;
    let slope = median_in_place(&mut slopes);
    let lo = nth(&mut slopes, lo_rank);
    let hi = nth(&mut slopes, hi_rank);
    Some(Sen {
        slope,
        lo,
        hi,
        p_up,
    })
}

/// Values closer than this (MiB) count as tied.
const TIE: f64 = 1e-9;

/// Var(S) of Mann–Kendall under "no trend", corrected for tied values.
fn kendall_variance(p: &[(f64, f64)]) -> f64 {
    let n = p.len() as f64;
    let mut ys: Vec<f64> = p.iter().map(|q| q.1).collect();
    ys.sort_by(f64::total_cmp);
    let mut ties = 0.0;
    let mut i = 0;
    while i < ys.len() {
        let mut j = i + 1;
        while j < ys.len() && ys[j] - ys[i] <= TIE {
            j += 1;
        }
        let g = (j - i) as f64;
        ties += g * (g - 1.0) * (2.0 * g + 5.0);
        i = j;
    }
    (n * (n - 1.0) * (2.0 * n + 5.0) - ties) / 18.0
}

/// Theil–Sen slope alone (0 for fewer than two distinct times).
fn sen_slope(p: &[(f64, f64)]) -> f64 {
    let mut slopes = Vec::with_capacity(p.len() * p.len().saturating_sub(1) / 2);
    for (i, a) in p.iter().enumerate() {
        for b in &p[i + 1..] {
            if b.0 > a.0 {
                slopes.push((b.1 - a.1) / (b.0 - a.0));
            }
        }
    }
    if slopes.is_empty() {
        0.0
    } else {
        median_in_place(&mut slopes)
    }
}

fn nth(v: &mut [f64], k: usize) -> f64 {
    let (_, x, _) = v.select_nth_unstable_by(k, f64::total_cmp);
    *x
}

/// The median of a non-empty slice (reordered).
fn median_in_place(v: &mut [f64]) -> f64 {
    let n = v.len();
    let upper = nth(v, n / 2);
    if n % 2 == 1 {
        upper
    } else {
        let lower = v[..n / 2].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lower + upper) / 2.0
    }
}

/// At most `max` points: buckets of consecutive samples, each as its mean
/// time and median value.
fn downsample(p: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if p.len() <= max {
        return p.to_vec();
    }
    (0..max)
        .map(|b| {
            let bucket = &p[b * p.len() / max..(b + 1) * p.len() / max];
            let t = bucket.iter().map(|q| q.0).sum::<f64>() / bucket.len() as f64;
            let mut ys: Vec<f64> = bucket.iter().map(|q| q.1).collect();
            (t, median_in_place(&mut ys))
        })
        .collect()
}

/// Sets aside one-time upward steps: rises between neighbours far beyond
/// the usual ones (robustly: median and MAD of the rises), at most
/// `max_steps` of them, are subtracted from every later point. A rise
/// followed at once by an equal fall is a one-sample spike, left to the
/// robust estimators. Only rises are removed, so this can lower a trend,
/// never create one. Returns how many steps and their sum.
fn set_aside_steps(p: &mut [(f64, f64)], cfg: &LeakConfig) -> (usize, f64) {
    if p.len() < 4 {
        return (0, 0.0);
    }
    let d: Vec<f64> = p.windows(2).map(|w| w[1].1 - w[0].1).collect();
    let mut tmp = d.clone();
    let med = median_in_place(&mut tmp);
    let mut dev: Vec<f64> = d.iter().map(|x| (x - med).abs()).collect();
    let scale = 1.4826 * median_in_place(&mut dev);
    let limit = (cfg.jump_sigmas * scale).max(0.5 * cfg.min_growth_mib);
    let jumps: Vec<usize> = (0..d.len())
        .filter(|&i| d[i] - med > limit)
        .filter(|&i| !d.get(i + 1).is_some_and(|&next| med - next > limit))
        .collect();
    if jumps.is_empty() || jumps.len() > cfg.max_steps {
        return (0, 0.0);
    }
    let mut total = 0.0;
    let mut k = 0;
    for (i, point) in p.iter_mut().enumerate().skip(1) {
        while k < jumps.len() && jumps[k] < i {
            total += d[jumps[k]] - med;
            k += 1;
        }
        point.1 -= total;
    }
    (jumps.len(), total)
}

/// The window cut into `k` consecutive parts of (nearly) equal sample
/// counts, at least three samples each: each part's median time and
/// median value.
fn segments(p: &[(f64, f64)], k: usize) -> Vec<(f64, f64)> {
    let k = k.min(p.len() / 3).max(2).min(p.len());
    (0..k)
        .map(|s| {
            let part = &p[s * p.len() / k..(s + 1) * p.len() / k];
            let mut ts: Vec<f64> = part.iter().map(|q| q.0).collect();
            let mut ys: Vec<f64> = part.iter().map(|q| q.1).collect();
            (median_in_place(&mut ts), median_in_place(&mut ys))
        })
        .collect()
}

/// The complementary error function (Numerical Recipes' `erfcc`,
/// fractional error below 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// The standard normal quantile (Acklam's rational approximation, relative
/// error below 1.2e-9), for `p` in (0, 1).
fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// A number for a sentence: no decimals from 100 on, three significant
/// digits below.
fn num(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;
    use crate::model::Target;
    use serde_json::json;

    /// A small deterministic generator: SplitMix64 and Box–Muller.
    struct Rng(u64);

    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn uniform(&mut self) -> f64 {
            ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn gauss(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
    }

    /// `n` samples every `dt` seconds from a realistic Unix time, with
    /// Gaussian noise of `sigma` MiB on `f(seconds since start)`.
    fn series(
        n: usize,
        dt: f64,
        sigma: f64,
        seed: u64,
        f: impl Fn(f64) -> f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut rng = Rng(seed);
        let t0 = 1_700_000_000.0;
        let t: Vec<f64> = (0..n).map(|i| t0 + i as f64 * dt).collect();
        let y = t.iter().map(|&t| f(t - t0) + sigma * rng.gauss()).collect();
        (t, y)
    }

    fn judge(s: &(Vec<f64>, Vec<f64>)) -> Verdict {
        detect(&s.0, &s.1, &LeakConfig::default())
    }

    fn assert_rate(v: &Verdict, expected_mib_per_hour: f64) {
        assert!(v.suspected, "should be flagged: {v:?}");
        let err = (v.rate_mib_per_hour - expected_mib_per_hour).abs() / expected_mib_per_hour;
        assert!(
            err <= 0.10,
            "rate {} vs {expected_mib_per_hour}: {v:?}",
            v.rate_mib_per_hour
        );
        assert!(v.ci_mib_per_hour.0 > 0.0 && v.ci_mib_per_hour.0 <= v.rate_mib_per_hour);
        assert!(v.ci_mib_per_hour.1 >= v.rate_mib_per_hour);
    }

    fn assert_not_flagged(v: &Verdict, why: &str) {
        assert!(v.judged, "should be judged: {v:?}");
        assert!(!v.suspected, "false alarm: {v:?}");
        assert!(v.reason.contains(why), "expected {why:?} in {:?}", v.reason);
    }

    #[test]
    fn the_thirty_second_job_growing_600_mib_is_a_leak() {
        // 600 MiB in 30 s = 72000 MiB/h, at a 100 ms and at a 1 s interval.
        for (n, dt) in [(301, 0.1), (31, 1.0)] {
            let s = series(n, dt, 8.0, 1, |t| 1000.0 + 20.0 * t);
            let v = judge(&s);
            assert_rate(&v, 72_000.0);
            assert!((v.warmup_s - 6.0).abs() < 1e-6, "{v:?}");
            assert!(v.reason.contains("leak suspected"), "{}", v.reason);
        }
    }

    #[test]
    fn linear_growth_is_flagged_with_its_rate_at_several_rates_and_noise_levels() {
        // (samples, interval s, base MiB, rate MiB/h, noise sigma MiB)
        let cases = [
            (120, 0.5, 500.0, 36_000.0, 2.0),    // a minute, fast
            (600, 1.0, 2_000.0, 3_600.0, 20.0),  // 10 min, 1 MiB/s
            (2160, 10.0, 4_000.0, 200.0, 15.0),  // 6 h, slow
            (4096, 21.1, 8_000.0, 50.0, 10.0),   // 24 h thinned, very slow
            (3600, 1.0, 1_000.0, 1_000.0, 60.0), // an hour, very noisy
            (40, 1.0, 300.0, 100_000.0, 30.0),   // 40 s, noisy
        ];
        for (i, &(n, dt, base, rate, sigma)) in cases.iter().enumerate() {
            for seed in 0..5 {
                let s = series(n, dt, sigma, 100 * i as u64 + seed, |t| {
                    base + rate * t / 3600.0
                });
                assert_rate(&judge(&s), rate);
            }
        }
    }

    #[test]
    fn a_leak_on_a_max_envelope_of_merged_buckets_is_flagged() {
        // memtrack's thinning keeps each bucket's maximum: a leaking job with
        // per-step jitter becomes the envelope of its teeth, still growing.
        let raw = series(64_000, 0.25, 0.0, 0, |t| {
            3000.0 + 0.05 * t + 200.0 * ((t * 4.0) as u64 % 3) as f64
        });
        let (t, y): (Vec<f64>, Vec<f64>) = raw
            .0
            .chunks(16)
            .zip(raw.1.chunks(16))
            .map(|(t, y)| (t[0], y.iter().copied().fold(f64::MIN, f64::max)))
            .unzip();
        assert_rate(&detect(&t, &y, &LeakConfig::default()), 180.0);
    }

    #[test]
    fn a_sawtooth_is_not_a_leak() {
        // allocate for five steps, free, repeat: at several periods
        for period in [5usize, 37, 300] {
            for seed in 0..3 {
                let s = series(3000, 0.2, 5.0, seed, |t| {
                    let step = (t / 0.2).round() as usize;
                    1500.0 + 400.0 * (step % period) as f64 / period as f64
                });
                let v = judge(&s);
                assert!(v.judged && !v.suspected, "period {period}: {v:?}");
            }
        }
        // one allocate/free per sample
        let s = series(500, 1.0, 0.0, 0, |t| {
            if (t as u64).is_multiple_of(2) {
                900.0
            } else {
                2900.0
            }
        });
        assert_not_flagged(&judge(&s), "no significant growth");
    }

    #[test]
    fn a_one_time_step_is_not_a_leak() {
        for at in [0.1, 0.3, 0.45, 0.5, 0.62, 0.8, 0.95] {
            for (sigma, seed) in [(0.0, 0), (5.0, 1), (40.0, 2)] {
                let s = series(1200, 1.0, sigma, seed, |t| {
                    if t < at * 1200.0 {
                        2000.0
                    } else {
                        2600.0
                    }
                });
                let v = judge(&s);
                assert!(
                    v.judged && !v.suspected,
                    "step at {at}, sigma {sigma}: {v:?}"
                );
            }
        }
        let s = series(
            1200,
            1.0,
            3.0,
            7,
            |t| if t < 600.0 { 2000.0 } else { 2600.0 },
        );
        let v = judge(&s);
        assert_not_flagged(&v, "setting aside 1 one-time step");
        assert_eq!(v.steps, 1);
        assert!((v.step_mib - 600.0).abs() < 20.0, "{v:?}");
        // a step spread over 20 samples (a model load) is not a jump: the
        // parts around it are flat
        let s = series(1200, 1.0, 3.0, 8, |t| {
            2000.0 + 600.0 * ((t - 590.0) / 20.0).clamp(0.0, 1.0)
        });
        let v = judge(&s);
        assert_not_flagged(&v, "not steady");
        assert_eq!(v.steps, 0);
        // two steps up, and a step down
        let s = series(1200, 1.0, 3.0, 9, |t| {
            2000.0 + if t > 500.0 { 300.0 } else { 0.0 } + if t > 900.0 { 300.0 } else { 0.0 }
        });
        assert!(!judge(&s).suspected, "{:?}", judge(&s));
        let s = series(
            1200,
            1.0,
            3.0,
            10,
            |t| if t < 600.0 { 2600.0 } else { 2000.0 },
        );
        assert_not_flagged(&judge(&s), "no significant growth");
    }

    #[test]
    fn a_leak_with_a_one_time_step_is_flagged_at_the_leak_s_rate() {
        // 1.5 MiB/s, and evaluation adds 900 MiB for good at 80 %
        let s = series(600, 1.0, 10.0, 11, |t| {
            3000.0 + 1.5 * t + if t > 480.0 { 900.0 } else { 0.0 }
        });
        let v = judge(&s);
        assert_rate(&v, 5400.0);
        assert_eq!(v.steps, 1);
        assert!(
            v.reason.contains("setting aside 1 one-time step"),
            "{}",
            v.reason
        );
        // a one-sample spike is not a step: the estimators are robust to it
        let s = series(600, 1.0, 10.0, 12, |t| {
            3000.0 + 1.5 * t + if t == 300.0 { 5000.0 } else { 0.0 }
        });
        let v = judge(&s);
        assert_rate(&v, 5400.0);
        assert_eq!(v.steps, 0);
    }

    #[test]
    fn a_staircase_of_many_steps_is_a_leak() {
        // +100 MiB every 60 s for an hour: growth in steps is still growth
        let s = series(3600, 1.0, 2.0, 13, |t| 2000.0 + 100.0 * (t / 60.0).floor());
        let v = judge(&s);
        assert_rate(&v, 6000.0);
        assert_eq!(v.steps, 0);
    }

    #[test]
    fn allocate_and_free_in_long_blocks_is_not_a_leak() {
        // a square wave of two or three long teeth: the rises could be set
        // aside as steps, the falls never are
        for teeth in [2.0, 3.0] {
            let s = series(1200, 1.0, 3.0, 14, |t| {
                let phase = (t / (1200.0 / teeth)).fract();
                if phase > 0.3 && phase < 0.8 {
                    3000.0
                } else {
                    2000.0
                }
            });
            let v = judge(&s);
            assert!(v.judged && !v.suspected, "{teeth} teeth: {v:?}");
        }
    }

    #[test]
    fn a_cache_that_fills_and_plateaus_is_not_a_leak() {
        // 1 - exp(-t/tau), tau from a tenth to half of the run
        for frac in [0.1, 0.25, 1.0 / 3.0, 0.5] {
            for seed in 0..3 {
                let run = 3600.0;
                let s = series(3600, 1.0, 10.0, seed, |t| {
                    4000.0 + 3000.0 * (1.0 - (-t / (frac * run)).exp())
                });
                let v = judge(&s);
                assert!(v.judged && !v.suspected, "tau = {frac} run: {v:?}");
            }
        }
        let s = series(3600, 1.0, 10.0, 9, |t| {
            4000.0 + 3000.0 * (1.0 - (-t / 1200.0).exp())
        });
        assert_not_flagged(&judge(&s), "levelling off");
    }

    #[test]
    fn a_shrinking_series_says_so_and_no_interval_below_0_includes_it() {
        let s = series(900, 1.0, 5.0, 4, |t| 3000.0 - 0.1 * t);
        let v = judge(&s);
        assert!(v.judged && !v.suspected, "{v:?}");
        assert!(v.ci_mib_per_hour.1 < 0.0, "{v:?}");
        assert!(
            v.reason.starts_with("no significant growth: shrinking at"),
            "{}",
            v.reason
        );
        assert!(!v.reason.contains("includes 0"), "{}", v.reason);
    }

    #[test]
    fn noisy_flat_memory_is_not_a_leak() {
        for seed in 0..20 {
            let s = series(900, 1.0, 50.0, seed, |_| 3000.0);
            let v = judge(&s);
            assert!(v.judged && !v.suspected, "seed {seed}: {v:?}");
        }
        // quantised to whole MiB: mostly ties
        let (t, y) = series(900, 1.0, 0.3, 3, |_| 3000.0);
        let y: Vec<f64> = y.iter().map(|y| y.round()).collect();
        assert_not_flagged(
            &detect(&t, &y, &LeakConfig::default()),
            "no significant growth",
        );
    }

    #[test]
    fn small_drift_is_below_the_practical_threshold() {
        // 5 MiB/h on 6 GiB for 2 h is significant but does not matter
        let s = series(7200, 1.0, 0.5, 4, |t| 6144.0 + 5.0 * t / 3600.0);
        let v = judge(&s);
        assert_not_flagged(&v, "too small");
        assert!(v.ci_mib_per_hour.0 > 0.0, "significant all the same: {v:?}");
    }

    #[test]
    fn a_too_short_run_is_not_judged() {
        let s = series(150, 0.1, 1.0, 0, |t| 1000.0 + 40.0 * t); // 15 s
        let v = judge(&s);
        assert!(!v.judged && !v.suspected, "{v:?}");
        assert!(v.reason.contains("not judged: 15 s"), "{}", v.reason);
        // long enough, but sampled every 5 s: 4 samples after warm-up
        let s = series(6, 5.0, 1.0, 0, |t| 1000.0 + 40.0 * t);
        let v = judge(&s);
        assert!(!v.judged && v.reason.contains("samples after"), "{v:?}");
        assert!(!detect(&[], &[], &LeakConfig::default()).judged);
        // the shortest judged run at the default 1 s interval
        let s = series(21, 1.0, 1.0, 0, |t| 1000.0 + 40.0 * t);
        assert!(judge(&s).suspected, "{:?}", judge(&s));
    }

    #[test]
    fn large_inputs_are_bucketed_to_bound_the_cost() {
        let s = series(100_000, 0.1, 20.0, 5, |t| 2000.0 + 0.2 * t); // 720 MiB/h
        let cfg = LeakConfig::default();
        let v = detect(&s.0, &s.1, &cfg);
        assert_eq!(v.points, cfg.max_points);
        assert!(v.samples > 70_000, "{v:?}");
        assert_rate(&v, 720.0);
    }

    #[test]
    fn the_window_is_capped_for_very_long_runs() {
        let cfg = LeakConfig {
            window_max_s: 3600.0,
            ..LeakConfig::default()
        };
        // grew for the first day, flat for the last hours: no longer leaking
        let (t, y) = series(4000, 30.0, 2.0, 2, |t| 1000.0 + t.min(24.0 * 3600.0) / 60.0);
        let v = detect(&t, &y, &cfg);
        assert!(
            v.judged && !v.suspected && (v.window_s - 3600.0).abs() < 1e-6,
            "{v:?}"
        );
    }

    #[test]
    fn unsorted_and_non_finite_input_is_tolerated() {
        let (mut t, mut y) = series(200, 1.0, 1.0, 3, |t| 100.0 + t);
        t.reverse();
        y.reverse();
        y[10] = f64::NAN;
        assert_rate(&detect(&t, &y, &LeakConfig::default()), 3600.0);
    }

    #[test]
    fn statistics_helpers_are_accurate() {
        assert!((normal_quantile(0.995) - 2.575_829).abs() < 1e-5);
        assert!((normal_quantile(0.5)).abs() < 1e-9);
        assert!((normal_quantile(0.025) + 1.959_964).abs() < 1e-5);
        assert!((erfc(0.0) - 1.0).abs() < 1e-6);
        assert!((0.5 * erfc(1.959_964 / std::f64::consts::SQRT_2) - 0.025).abs() < 1e-6);
        assert_eq!(median_in_place(&mut [3.0, 1.0, 2.0, 10.0]), 2.5);
        // Var(S) without ties: n(n-1)(2n+5)/18
        let p: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, i as f64)).collect();
        assert_eq!(kendall_variance(&p), 125.0);
    }

    #[test]
    fn config_reads_partial_tables_and_round_trips() {
        let cfg: LeakConfig = serde_json::from_str(r#"{"min_growth_mib": 64}"#).unwrap();
        assert_eq!(cfg.min_growth_mib, 64.0);
        assert_eq!(cfg.min_points, MIN_JUDGED_POINTS);
        let back: LeakConfig = serde_json::from_value(serde_json::to_value(cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
        assert!(serde_json::from_str::<LeakConfig>(r#"{"min_growht_mib": 1}"#).is_err());
    }

    fn timer(t: f64, cpu: f64, gpu: f64, span: Option<&str>) -> Entry {
        Entry {
            component: span
                .map_or("system", |s| s.split('/').next().unwrap())
                .into(),
            operation: "timer".into(),
            timestamp: t,
            figures: Figures {
                cpu_ram_used_mb: cpu,
                gpu_process_used_mb: gpu,
                gpu_ram_used_mb: gpu,
                ..Figures::default()
            },
            kind: EntryKind::Timer,
            span: span.map(String::from),
            ..Entry::default()
        }
    }

    #[test]
    fn analyze_reports_overall_per_target_and_per_component() {
        let t0 = 1_700_000_000.0;
        let mut doc = Document {
            schema: 1,
            ..Document::default()
        };
        // 10 minutes at 1 s: host leaks while "model" spans are open (every
        // other minute), GPU is flat.
        for i in 0..600 {
            let t = t0 + i as f64;
            let in_model = (i / 60) % 2 == 1;
            let span = in_model.then_some("model/generate");
            let leak = i as f64 * 0.5; // 1800 MiB/h
            let cpu = 2000.0 + leak + if in_model { 300.0 } else { 0.0 };
            doc.detailed_log
                .push(timer(t, cpu, 5000.0 + (i % 7) as f64, span));
        }
        let leaky = Target {
            pid: 42,
            name: "python".into(),
            series: (0..600)
                .map(|i| [t0 + i as f64, 1500.0 + i as f64 * 0.5, 5000.0])
                .collect(),
            ..Target::default()
        };
        let worker = Target {
            pid: 43,
            name: "pt_data_worker".into(),
            series: (0..600).map(|i| [t0 + i as f64, 500.0, 0.0]).collect(),
            ..Target::default()
        };
        let brief = Target {
            pid: 44,
            name: "sh".into(),
            series: vec![[t0, 1.0, 0.0], [t0 + 1.0, 1.0, 0.0]],
            ..Target::default()
        };
        doc.targets = vec![leaky, worker, brief];

        let out = analyze(&doc, &LeakConfig::default()).to_value();
        assert_eq!(out["suspected"], true);
        assert_eq!(out["host"]["suspected"], true, "{out:#}");
        let rate = out["host"]["rate_mib_per_hour"].as_f64().unwrap();
        assert!((rate - 1800.0).abs() < 180.0, "{rate}");
        assert_eq!(out["gpu"]["suspected"], false, "{out:#}");
        assert_eq!(out["gpu"]["judged"], true);
        let targets = out["targets"].as_array().unwrap();
        assert_eq!(targets.len(), 2);
        assert_eq!(out["targets_not_judged"], 1);
        assert_eq!(targets[0]["pid"], 42);
        assert_eq!(targets[0]["host"]["suspected"], true);
        assert_eq!(targets[0]["gpu"]["suspected"], false);
        assert_eq!(targets[1]["host"]["suspected"], false);
        assert!(targets[1].get("gpu").is_none());
        assert_eq!(out["components"]["model"]["suspected"], true, "{out:#}");
        let suspects: Vec<&str> = out["suspects"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect();
        assert_eq!(suspects, ["host", "target 42 (python)", "component model"]);
        assert_eq!(out["config"]["min_points"], 12);
        // the verdicts read back as `Verdict`
        let v: Verdict = serde_json::from_value(out["host"].clone()).unwrap();
        assert!(v.judged && v.window_s > 400.0);
    }

    #[test]
    fn analyze_reads_a_bare_file() {
        let mut doc = Document::default();
        for i in 0..40 {
            doc.detailed_log.push(Entry {
                component: "model".into(),
                operation: if i % 2 == 0 {
                    "before_generate"
                } else {
                    "after_generate"
                }
                .into(),
                timestamp: 1_700_000_000.0 + i as f64,
                figures: Figures {
                    cpu_ram_used_mb: 1000.0,
                    gpu_ram_used_mb: 8000.0 + 50.0 * i as f64,
                    ..Figures::default()
                },
                ..Entry::default()
            });
        }
        let out = analyze(&doc, &LeakConfig::default()).to_value();
        assert_eq!(out["host"]["suspected"], false);
        assert_eq!(out["gpu"]["suspected"], true, "{out:#}");
        assert_eq!(out["suspects"], json!(["gpu"]));
        assert_eq!(out["targets"], json!([]));
        assert_eq!(out["components"], json!({}));
    }
}
