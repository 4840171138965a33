//! Time to OOM: from the recent growth of a figure and the limit it runs
//! into, when the job would reach the limit at this rate.
//!
//! A pure fold over `(time, MiB)` points, one series per resource (the
//! job's host memory against its cgroup limit or the host's available
//! memory, each GPU's used memory against its total). It forecasts only
//! growth that holds across the whole of a window: the window is cut in
//! [`PARTS`] parts, and the highest figure of every part must be above the
//! one before, the lowest of the last part above the first's, and the
//! growth large enough to matter. A steady job (a flat envelope) and a
//! sawtooth of steps (each part holds a whole step's peak) never
//! forecast. Several windows are tried, shortest first, so a fast climb is
//! seen within seconds and a slow one over minutes.

use std::collections::VecDeque;

/// The windows tried, seconds, shortest first.
pub(crate) const WINDOWS_S: [f64; 4] = [15.0, 60.0, 300.0, 1200.0];

/// Parts each window is cut into.
const PARTS: usize = 5;

/// Each part of a window needs at least this many points (fewer, and
/// one noisy point decides a part's highest).
const MIN_PART_POINTS: usize = 5;

/// Growth over a window below this (MiB, and [`MIN_GROWTH_SHARE`] of the
/// limit) is not a climb.
const MIN_GROWTH_MIB: f64 = 16.0;
const MIN_GROWTH_SHARE: f64 = 0.005;

/// Each part must climb by at least this share of the mean climb per
/// part.
const MIN_STEP_SHARE: f64 = 0.25;

/// Forecasts further out than this are not made (seconds: a day).
pub(crate) const MAX_HORIZON_S: f64 = 86_400.0;

/// Each part is read from this many buckets: a window's points are kept
/// as the highest, lowest and count per bucket, so a sample costs the
/// same however long the windows and however short the interval.
const BUCKETS_PER_PART: usize = 8;

/// Buckets per window.
const BUCKETS: usize = PARTS * BUCKETS_PER_PART;

/// What a forecast says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Outlook {
    /// Seconds until the figure reaches the limit at this rate.
    pub(crate) seconds: f64,
    /// The growth rate, MiB per second.
    pub(crate) rate_mib_per_s: f64,
    /// The figure now (the last part's highest), MiB.
    pub(crate) level_mb: f64,
    /// The window the growth held over, seconds.
    pub(crate) window_s: f64,
}

/// The points of one bucket of a window.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Its index on the window's grid (time / bucket width).
    at: i64,
    high: f64,
    low: f64,
    n: usize,
}

/// One window's buckets, the last [`BUCKETS`] of its grid, and its
/// outlook as of the last bucket that closed (read again only then).
#[derive(Debug, Clone, Default)]
struct Buckets {
    buckets: VecDeque<Bucket>,
    /// The climb as last read: (MiB per second, the level), or none.
    climb: Option<(f64, f64)>,
    /// A bucket closed since the climb was read.
    stale: bool,
    /// Seconds per bucket.
    width: f64,
}

/// One resource's recent points.
#[derive(Debug, Clone, Default)]
pub(crate) struct ForecastSeries {
    first: Option<f64>,
    last: f64,
    windows: [Buckets; WINDOWS_S.len()],
}

/// A window's bucket width, seconds.
fn width(window_s: f64) -> f64 {
    window_s / BUCKETS as f64
}

impl ForecastSeries {
    /// Adds a point (time order; an older point is ignored).
    pub(crate) fn push(&mut self, t: f64, mb: f64) {
        if !(t.is_finite() && mb.is_finite()) || (self.first.is_some() && t < self.last) {
            return;
        }
        self.first.get_or_insert(t);
        self.last = t;
        for (w, b) in WINDOWS_S.iter().zip(&mut self.windows) {
            b.width = width(*w);
            let at = (t / b.width).floor() as i64;
            match b.buckets.back_mut() {
                Some(last) if last.at == at => {
                    last.high = last.high.max(mb);
                    last.low = last.low.min(mb);
                    last.n += 1;
                }
                _ => {
                    b.buckets.push_back(Bucket {
                        at,
                        high: mb,
                        low: mb,
                        n: 1,
                    });
                    b.stale = true;
                }
            }
            while b
                .buckets
                .front()
                .is_some_and(|f| f.at <= at - BUCKETS as i64)
            {
                b.buckets.pop_front();
            }
        }
    }

    /// When the figure reaches `limit_mb` at its recent rate, if it
    /// climbs steadily towards it. A window is read again when one of its
    /// buckets closed (or the limit changed): a sample costs the same
    /// however long the windows.
    pub(crate) fn outlook(&mut self, limit_mb: f64) -> Option<Outlook> {
        if limit_mb.is_nan() || limit_mb <= 0.0 {
            return None;
        }
        let first = self.first?;
        let span = self.last - first;
        let mut found = None;
        for (w, b) in WINDOWS_S.iter().zip(&mut self.windows) {
            if span < 0.9 * w {
                continue;
            }
            if b.stale {
                b.climb = climb(b, limit_mb);
                b.stale = false;
            }
            if found.is_some() {
                continue;
            }
            found = b.climb.and_then(|(rate, level)| {
                let seconds = ((limit_mb - level) / rate).max(0.0);
                (seconds <= MAX_HORIZON_S).then_some(Outlook {
                    seconds,
                    rate_mib_per_s: rate,
                    level_mb: level,
                    window_s: *w,
                })
            });
        }
        found
    }
}

/// The climb over one window's buckets: its rate (MiB per second) and
/// level, when every part climbs.
fn climb(b: &Buckets, limit_mb: f64) -> Option<(f64, f64)> {
    let end = b.buckets.back()?.at;
    let start = end - BUCKETS as i64 + 1;
    // Each part's highest figure, lowest figure and points.
    let mut high = [f64::NEG_INFINITY; PARTS];
    let mut low = [f64::INFINITY; PARTS];
    let mut n = [0usize; PARTS];
    for k in b.buckets.iter().filter(|k| k.at >= start) {
        let i = ((k.at - start) as usize / BUCKETS_PER_PART).min(PARTS - 1);
        high[i] = high[i].max(k.high);
        low[i] = low[i].min(k.low);
        n[i] += k.n;
    }
    if n.iter().any(|n| *n < MIN_PART_POINTS) {
        return None;
    }
    let growth = high[PARTS - 1] - high[0];
    if growth < MIN_GROWTH_MIB.max(MIN_GROWTH_SHARE * limit_mb) {
        return None;
    }
    // Every part climbs by a fair share of the whole (a climb that
    // levelled off, or a step, does not), and the floor rose too.
    let share = MIN_STEP_SHARE * growth / (PARTS - 1) as f64;
    let climbing = high.windows(2).all(|w| w[1] - w[0] >= share) && low[PARTS - 1] > low[0];
    if !climbing {
        return None;
    }
    // The rate of the envelope: each part's highest figure at the part's
    // middle (where in its part the highest point falls is noise; a
    // sawtooth's whole steps are in every part alike).
    // Parts are equally wide: their middles, in parts, are 0.5, 1.5, …
    let envelope: Vec<(f64, f64)> = high
        .iter()
        .enumerate()
        .map(|(i, h)| (i as f64 + 0.5, *h))
        .collect();
    let part_s = b.width * BUCKETS_PER_PART as f64;
    let rate = slope(&envelope)? / part_s;
    (rate > 0.0).then_some((rate, high[PARTS - 1]))
}

/// Least-squares slope of `(x, y)` points; `None` when the x are equal.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// A duration for a sentence: `45 s`, `12 min`, `3.5 h`.
pub(crate) fn in_words(seconds: f64) -> String {
    if seconds < 90.0 {
        format!("{seconds:.0} s")
    } else if seconds < 5400.0 {
        format!("{:.0} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays `f` at `interval` s for `secs` s, with deterministic noise
    /// of ±`noise` MiB; returns every outlook made on the way (time, the
    /// outlook).
    fn replay(
        secs: f64,
        interval: f64,
        noise: f64,
        limit: f64,
        f: impl Fn(f64) -> f64,
    ) -> Vec<(f64, Outlook)> {
        let mut s = ForecastSeries::default();
        let mut out = Vec::new();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut t = 0.0;
        while t <= secs {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let jitter = (seed % 2001) as f64 / 1000.0 - 1.0;
            let y = f(t) + noise * jitter;
            s.push(t, y);
            if let Some(o) = s.outlook(limit) {
                out.push((t, o));
            }
            t += interval;
        }
        out
    }

    /// The time `f` first reaches `limit`.
    fn reaches(f: impl Fn(f64) -> f64, limit: f64, interval: f64) -> f64 {
        let mut t = 0.0;
        while f(t) < limit {
            t += interval;
        }
        t
    }

    #[test]
    fn growth_reaches_the_limit_when_forecast() {
        // (base MiB, MiB per second, noise, limit, interval)
        let cases = [
            (500.0, 10.0, 2.0, 4096.0, 0.1),
            (2000.0, 1.0, 5.0, 4096.0, 1.0),
            (1000.0, 0.2, 3.0, 8192.0, 1.0),
            (300.0, 40.0, 8.0, 1024.0, 0.1),
        ];
        for (base, rate, noise, limit, interval) in cases {
            let f = move |t: f64| base + rate * t;
            let actual = reaches(f, limit, interval);
            let seen = replay(actual, interval, noise, limit, f);
            assert!(!seen.is_empty(), "no forecast for {rate} MiB/s");
            for (t, o) in &seen {
                let forecast_at = t + o.seconds;
                assert!(
                    (forecast_at - actual).abs() <= 0.2 * actual.max(1.0),
                    "{rate} MiB/s: at {t:.1} s forecast {forecast_at:.1} s, reached at {actual:.1} s"
                );
            }
            // Forecast within the first window's time once it climbs.
            let first = seen[0].0;
            assert!(first <= 1.0 + WINDOWS_S[3], "{rate}: first at {first}");
        }
    }

    #[test]
    fn growth_on_a_sawtooth_of_steps_is_forecast_from_its_envelope() {
        // Steps of 1 s allocating 300 MiB at once, on a floor growing
        // 5 MiB/s.
        let limit = 3000.0;
        let f = |t: f64| 400.0 + 5.0 * t + if t % 1.0 < 0.6 { 300.0 } else { 0.0 };
        let actual = reaches(f, limit, 0.1);
        let seen = replay(actual, 0.1, 2.0, limit, f);
        assert!(!seen.is_empty());
        for (t, o) in &seen {
            let at = t + o.seconds;
            assert!(
                (at - actual).abs() <= 0.2 * actual,
                "at {t:.1}: {at:.1} against {actual:.1}"
            );
        }
    }

    #[test]
    fn steady_jobs_and_sawtooth_steps_never_forecast() {
        // Steady, noisy.
        assert_eq!(replay(3000.0, 1.0, 20.0, 4096.0, |_| 3000.0), vec![]);
        assert_eq!(replay(120.0, 0.1, 3.0, 1024.0, |_| 600.0), vec![]);
        // Steps allocating at once and freeing at their end, at several
        // periods.
        for period in [0.5, 1.0, 3.0, 10.0, 45.0, 200.0] {
            let f = move |t: f64| {
                let phase = (t % period) / period;
                800.0 + if phase < 0.7 { 1500.0 } else { 0.0 }
            };
            let seen = replay(2400.0, 0.5, 4.0, 4096.0, f);
            assert!(seen.is_empty(), "period {period}: {:?}", seen.first());
        }
        // A one-time climb (a dataset loaded), then flat: silent once
        // flat.
        let f = |t: f64| 500.0 + 20.0 * t.min(30.0);
        let seen = replay(400.0, 0.5, 2.0, 4096.0, f);
        assert!(
            seen.iter()
                .all(|(t, _)| *t <= 30.0 + 2.0 * WINDOWS_S[0] / PARTS as f64),
            "{:?}",
            seen.last()
        );
    }

    #[test]
    fn durations_read_as_words() {
        assert_eq!(in_words(45.0), "45 s");
        assert_eq!(in_words(720.0), "12 min");
        assert_eq!(in_words(12_600.0), "3.5 h");
    }
}
