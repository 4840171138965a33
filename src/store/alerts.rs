//! Alerts: each sample's host RAM and GPU use ratios go through the
//! pressure thresholds (see [`super::pressure`]); a change of level is an
//! alert, kept up to [`Limits::max_alerts`](super::limits::Limits::max_alerts)
//! and always returned to the caller.

use std::collections::BTreeMap;

use super::pressure::{Level, Thresholds};
use crate::model::Alert;
use crate::sample::Sample;

/// The alerts' state: the alerts kept, and each resource's level.
#[derive(Debug, Clone, Default)]
pub(super) struct AlertsState {
    pub(super) kept: Vec<Alert>,
    pub(super) levels: BTreeMap<String, Level>,
}

impl AlertsState {
    /// The pressure levels crossed by a sample, as alerts; at most
    /// `max_kept` are kept in the run's list.
    pub(super) fn crossings(
        &mut self,
        sample: &Sample,
        thresholds: &Thresholds,
        max_kept: usize,
    ) -> Vec<Alert> {
        let mut ratios: Vec<(String, f64)> = Vec::new();
        let m = sample.memory;
        if m.total > 0 {
            ratios.push(("host".into(), 1.0 - m.available as f64 / m.total as f64));
        }
        for d in &sample.gpu.devices {
            if d.total > 0 {
                ratios.push((format!("gpu{}", d.index), d.used as f64 / d.total as f64));
            }
        }
        let mut alerts = Vec::new();
        for (resource, ratio) in ratios {
            let previous = self.levels.get(&resource).copied().unwrap_or_default();
            let level = thresholds.level(ratio, previous);
            if level == previous {
                continue;
            }
            self.levels.insert(resource.clone(), level);
            let what = if resource == "host" {
                "host RAM".to_string()
            } else {
                format!("GPU {}", &resource[3..])
            };
            let alert = Alert {
                timestamp: sample.timestamp,
                resource,
                level: level.as_str().into(),
                previous: previous.as_str().into(),
                used_ratio: ratio,
                message: format!(
                    "{what} at {:.1}% used: {} → {}",
                    ratio * 100.0,
                    previous.as_str(),
                    level.as_str()
                ),
            };
            if self.kept.len() < max_kept {
                self.kept.push(alert.clone());
            }
            alerts.push(alert);
        }
        alerts
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;

    #[test]
    fn pressure_crossings_become_alerts() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 1)], &[(10, 70_000)]);
        s.memory.available = 100 * M; // host 90 % used
        let out = timer(&mut st, s);
        let levels: Vec<(&str, &str)> = out
            .alerts
            .iter()
            .map(|a| (a.resource.as_str(), a.level.as_str()))
            .collect();
        assert_eq!(levels, [("host", "emergency"), ("gpu0", "critical")]);
        let out = timer(&mut st, sample(102.0, &[(10, 1)], &[(10, 70_000)]));
        assert_eq!(out.alerts.len(), 1, "host back to normal");
        assert_eq!(out.alerts[0].level, "normal");
        assert_eq!(st.document().alerts.len(), 3);
    }

    #[test]
    fn alerts_past_the_bound_are_returned_but_not_kept() {
        let mut st = Store::new(
            RunInfo::default(),
            Limits {
                max_alerts: 1,
                ..Limits::default()
            },
            Thresholds::default(),
        );
        let mut s = sample(101.0, &[(10, 1)], &[(10, 70_000)]);
        s.memory.available = 100 * M;
        let out = timer(&mut st, s);
        assert_eq!(out.alerts.len(), 2);
        assert_eq!(st.document().alerts.len(), 1);
        assert_eq!(st.levels()["gpu0"], crate::store::pressure::Level::Critical);
        assert!(
            out.alerts[1].message.starts_with("GPU 0 at 87.5% used"),
            "{}",
            out.alerts[1].message
        );
    }
}
