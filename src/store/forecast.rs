//! Time to OOM, live: each sample's figures go into the forecast's series
//! ([`crate::model::forecast`]) — the job's charge against its memory
//! limit (or, without one, the tree's memory against what the host has
//! available), each GPU's used memory against its total — and the
//! outlooks are kept for exporters. A forecast that starts, or halves
//! since it was last announced, is returned to be pushed to subscribers
//! before the limit is reached.

use std::collections::BTreeMap;

use super::snapshot::{Current, Forecast};
use crate::model::forecast::{in_words, ForecastSeries};
use crate::sample::Sample;
use crate::units::mib;

/// Forecasts further out than this (seconds) are shown but not pushed.
const NOTICE_HORIZON_S: f64 = 3600.0;

/// A forecast is announced again when it halved and came at least this
/// much sooner (seconds): not once more for every tick of its last
/// seconds.
const MIN_SOONER_S: f64 = 5.0;

/// The forecasts' state (not checkpointed: a recovered run starts its
/// series afresh).
#[derive(Debug, Clone, Default)]
pub(super) struct ForecastState {
    series: BTreeMap<String, ForecastSeries>,
    now: BTreeMap<String, Forecast>,
    /// The seconds last announced per resource.
    announced: BTreeMap<String, f64>,
}

impl ForecastState {
    /// The live forecasts, by resource.
    pub(super) fn live(&self) -> impl Iterator<Item = &Forecast> {
        self.now.values()
    }

    /// Folds a sample (whose tree's figures are `c`; the job runs under
    /// `memory_limit_mb`, if any) into the forecasts; returns those to
    /// announce.
    pub(super) fn fold(
        &mut self,
        sample: &Sample,
        c: &Current,
        memory_limit_mb: Option<f64>,
    ) -> Vec<Forecast> {
        let t = sample.timestamp;
        // (resource, figure, limit, the limit's code and words), MiB.
        let mut figures: Vec<(String, f64, f64, &'static str, &'static str)> = Vec::new();
        match (memory_limit_mb, c.charge_mb) {
            // The limit is enforced on the charge, not on the headline.
            (Some(limit), Some(charge)) => {
                figures.push((
                    "host".into(),
                    charge,
                    limit,
                    "memory_limit",
                    "its memory limit",
                ));
            }
            (Some(limit), None) => {
                figures.push((
                    "host".into(),
                    c.cpu_used_mb,
                    limit,
                    "memory_limit",
                    "its memory limit",
                ));
            }
            (None, _) if sample.memory.total > 0 && c.processes > 0 => figures.push((
                "host".into(),
                c.cpu_used_mb,
                c.cpu_used_mb + mib(sample.memory.available),
                "host_available",
                "the host's available memory",
            )),
            _ => {}
        }
        for d in &sample.gpu.devices {
            if d.total > 0 {
                figures.push((
                    format!("gpu{}", d.index),
                    mib(d.used),
                    mib(d.total),
                    "gpu_total",
                    "the GPU's total memory",
                ));
            }
        }
        let mut out = Vec::new();
        for (resource, used, limit, code, what) in figures {
            let series = self.series.entry(resource.clone()).or_default();
            series.push(t, used);
            let Some(o) = series.outlook(limit) else {
                self.now.remove(&resource);
                self.announced.remove(&resource);
                continue;
            };
            let subject = if resource == "host" {
                "the job's host memory".to_string()
            } else {
                format!("GPU {}", &resource[3..])
            };
            let f = Forecast {
                message: format!(
                    "at this rate {subject} reaches {what} ({:.0} MiB) in {}: {:.0} MiB now, \
                     growing {:.1} MiB/s",
                    limit,
                    in_words(o.seconds),
                    used,
                    o.rate_mib_per_s
                ),
                resource: resource.clone(),
                seconds: o.seconds,
                rate_mib_per_s: o.rate_mib_per_s,
                used_mb: used,
                limit_mb: limit,
                limit: code.to_string(),
            };
            let due = o.seconds <= NOTICE_HORIZON_S
                && self
                    .announced
                    .get(&resource)
                    .is_none_or(|last| o.seconds <= 0.5 * last && last - o.seconds >= MIN_SOONER_S);
            if due {
                self.announced.insert(resource.clone(), o.seconds);
                out.push(f.clone());
            }
            self.now.insert(resource, f);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;

    #[test]
    fn a_climbing_gpu_is_forecast_and_announced_once_then_when_it_halves() {
        let mut st = store();
        let mut announced = Vec::new();
        // GPU 0 (80,000 MiB) grows 500 MiB/s from 10,000 MiB; the host's
        // figure holds still.
        for i in 0..=400 {
            let t = 100.0 + 0.1 * i as f64;
            let used = 10_000 + 50 * i as u64;
            let mut s = sample(t, &[(10, 300)], &[(10, used)]);
            if i == 0 {
                join(&mut s, 10);
            }
            let out = timer(&mut st, s);
            announced.extend(out.forecasts.into_iter().map(|f| (t, f)));
        }
        let (t, first) = &announced[0];
        assert_eq!(first.resource, "gpu0");
        assert_eq!(first.limit, "gpu_total");
        // 80,000 MiB is reached at 100 + 140 s.
        let at = t + first.seconds;
        assert!((at - 240.0).abs() <= 0.2 * (240.0 - t), "{announced:?}");
        assert!(
            first.message.starts_with("at this rate GPU 0 reaches"),
            "{}",
            first.message
        );
        // Announced again only when it halved (and came 5 s sooner).
        for w in announced.windows(2) {
            assert!(w[1].1.seconds <= 0.5 * w[0].1.seconds, "{announced:?}");
        }
        let now = st.forecasts();
        assert_eq!(now.len(), 1, "no forecast for the steady host: {now:?}");
        assert_eq!(now[0].resource, "gpu0");
    }
}
