//! Memory pressure levels (by default 75 % high, 85 % critical, 90 %
//! emergency), per GPU and for host RAM.
//!
//! A pure function from a used ratio and the previous level to the new
//! level. Leaving a level needs the ratio to fall a small margin below its
//! threshold, so a value hovering at 85 % does not flap.

use serde::{Deserialize, Serialize};

/// The levels, in order.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Hash,
)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    #[default]
    Normal,
    High,
    Critical,
    Emergency,
}

impl Level {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Level::Normal => "normal",
            Level::High => "high",
            Level::Critical => "critical",
            Level::Emergency => "emergency",
        }
    }

    /// 0…3, as exported to Prometheus.
    pub(crate) fn as_number(self) -> u8 {
        self as u8
    }
}

/// Thresholds as used ratios (0…1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Thresholds {
    pub high: f64,
    pub critical: f64,
    pub emergency: f64,
    /// How far below a threshold the ratio must fall to leave its level.
    pub hysteresis: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            high: 0.75,
            critical: 0.85,
            emergency: 0.90,
            hysteresis: 0.02,
        }
    }
}

/// Thresholds out of order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("need 0 < high < critical < emergency <= 1 and 0 <= hysteresis < 0.5")]
pub struct ThresholdsOutOfOrder;

impl Thresholds {
    pub fn validate(&self) -> Result<(), ThresholdsOutOfOrder> {
        let ok = 0.0 < self.high
            && self.high < self.critical
            && self.critical < self.emergency
            && self.emergency <= 1.0
            && (0.0..0.5).contains(&self.hysteresis);
        if ok {
            Ok(())
        } else {
            Err(ThresholdsOutOfOrder)
        }
    }

    fn threshold(&self, level: Level) -> f64 {
        match level {
            Level::Normal => 0.0,
            Level::High => self.high,
            Level::Critical => self.critical,
            Level::Emergency => self.emergency,
        }
    }

    /// The level for `ratio`, given the level held before.
    pub(crate) fn level(&self, ratio: f64, previous: Level) -> Level {
        let raw = if ratio >= self.emergency {
            Level::Emergency
        } else if ratio >= self.critical {
            Level::Critical
        } else if ratio >= self.high {
            Level::High
        } else {
            Level::Normal
        };
        if raw >= previous {
            return raw;
        }
        // Going down: stay at the highest level whose threshold the ratio
        // has not yet left by the margin.
        let mut level = previous;
        while level > raw && ratio < self.threshold(level) - self.hysteresis {
            level = match level {
                Level::Emergency => Level::Critical,
                Level::Critical => Level::High,
                _ => Level::Normal,
            };
        }
        level
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_rise_immediately() {
        let t = Thresholds::default();
        assert_eq!(t.level(0.5, Level::Normal), Level::Normal);
        assert_eq!(t.level(0.76, Level::Normal), Level::High);
        assert_eq!(t.level(0.86, Level::Normal), Level::Critical);
        assert_eq!(t.level(0.95, Level::High), Level::Emergency);
    }

    #[test]
    fn levels_fall_with_hysteresis() {
        let t = Thresholds::default();
        assert_eq!(
            t.level(0.84, Level::Critical),
            Level::Critical,
            "within margin"
        );
        assert_eq!(t.level(0.82, Level::Critical), Level::High);
        assert_eq!(t.level(0.10, Level::Emergency), Level::Normal);
        assert_eq!(t.level(0.745, Level::High), Level::High);
    }

    #[test]
    fn validation() {
        assert!(Thresholds::default().validate().is_ok());
        let bad = Thresholds {
            high: 0.9,
            critical: 0.8,
            ..Thresholds::default()
        };
        assert!(bad.validate().is_err());
    }
}
