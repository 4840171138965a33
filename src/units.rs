//! Units and time: the one place that knows a megabyte is a MiB (as in the
//! trackers' `rss / (1024 * 1024)`, docs/memory_usage.md), how durations
//! are spelled in config files (`100ms`, `1s`), and how wall-clock time
//! becomes Unix seconds; and how MiB and seconds are written for people.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Bytes in one "MB" of `memory_usage.json`: the trackers divide by 1024².
pub(crate) const MIB: f64 = 1024.0 * 1024.0;

/// Bytes → MiB as the JSON reports them.
pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB
}

/// Wall-clock now as Unix seconds with sub-second precision (the base
/// `timestamp` field).
pub fn unix_now() -> f64 {
    unix_seconds(SystemTime::now())
}

/// A `SystemTime` as Unix seconds; times before the epoch map to 0.
pub(crate) fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Why a duration or a size could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum UnitError {
    #[error("`{text}` is not a duration ({source}); write e.g. `100ms`, `1s`, `5m`")]
    Duration {
        text: String,
        source: humantime::DurationError,
    },
    /// `examples`: sizes written the way the caller reads them.
    #[error("`{text}` is not a size; write e.g. {examples}")]
    Size {
        text: String,
        examples: &'static str,
    },
    #[error("`{text}`: unknown size unit `{unit}`")]
    SizeUnit { text: String, unit: String },
}

/// Parses `100ms`, `1s`, `2m`, `1h 30m` (humantime syntax). A bare number is
/// refused: a unit-less interval in a config file is a bug waiting to happen.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    humantime::parse_duration(text.trim()).map_err(|source| UnitError::Duration {
        text: text.to_string(),
        source,
    })
}

/// Formats a duration the way `parse_duration` reads it back.
pub(crate) fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Serde adapter: durations as humantime strings in TOML and JSON.
pub(crate) mod serde_duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

/// Parses a byte size: `512MiB`, `4GiB`, `1024` (bytes), `10MB` (decimal).
pub(crate) fn parse_bytes(text: &str) -> Result<u64, UnitError> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| UnitError::Size {
        text: text.to_string(),
        examples: "`512MiB`, `4GiB`",
    })?;
    let factor: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => MIB,
        "gib" => MIB * 1024.0,
        "tib" => MIB * 1024.0 * 1024.0,
        other => {
            return Err(UnitError::SizeUnit {
                text: text.to_string(),
                unit: other.to_string(),
            })
        }
    };
    Ok((value * factor) as u64)
}

/// MiB for people: `1,234 MiB`, `3.2 MiB` below 10 MiB, and
/// `12.3 GiB (12,595 MiB)` from 10 GiB on.
pub(crate) fn format_mib(x: f64) -> String {
    if x >= 10.0 * 1024.0 {
        format!("{:.1} GiB ({} MiB)", x / 1024.0, group_thousands(x.round()))
    } else if x >= 10.0 {
        format!("{} MiB", group_thousands(x.round()))
    } else {
        format!("{x:.1} MiB")
    }
}

/// [`format_mib`] without the MiB figure beside GiB: `1,234 MiB`, or
/// `12.3 GiB` from 10 GiB on.
pub(crate) fn format_mib_short(x: f64) -> String {
    if x >= 10.0 * 1024.0 {
        format!("{:.1} GiB", x / 1024.0)
    } else {
        format_mib(x)
    }
}

/// MiB with one decimal, ungrouped: `1234.5 MiB`, or `12.3 GiB` from
/// 10 GiB on.
pub fn format_mib_one_decimal(x: f64) -> String {
    if x >= 10_240.0 {
        format!("{:.1} GiB", x / 1024.0)
    } else {
        format!("{x:.1} MiB")
    }
}

/// MiB as the GiB of comparison tables, rounded to a tenth and written
/// `GB` without a needless `.0`: `2 GB`, `2.5 GB`.
pub(crate) fn format_gb_rounded(mib: f64) -> String {
    let g = (mib / 1024.0 * 10.0).round() / 10.0;
    if g.fract() == 0.0 {
        format!("{g:.0} GB")
    } else {
        format!("{g:.1} GB")
    }
}

/// A whole number with commas between thousands: `1,234,567`.
pub(crate) fn group_thousands(x: f64) -> String {
    let neg = x < 0.0;
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if neg {
        format!("-{out}")
    } else {
        out
    }
}

/// Longest span memtrack shows as a duration: 10 years. A longer one (a
/// clock set wrong, a file edited by hand) is shown as unknown.
pub(crate) const MAX_SHOWN_SECONDS: f64 = 10.0 * 365.25 * 86_400.0;

/// Whether `s` seconds can be shown: finite, not negative, not absurd.
pub(crate) fn plausible_seconds(s: f64) -> bool {
    s.is_finite() && (0.0..=MAX_SHOWN_SECONDS).contains(&s)
}

/// Seconds with one decimal (`12.5 s`), or `unknown` for a negative, absurd
/// or missing span.
pub(crate) fn format_seconds(s: f64) -> String {
    if plausible_seconds(s) {
        format!("{s:.1} s")
    } else {
        "unknown".into()
    }
}

/// Seconds in the two largest units, for a run's length: `75.0 s` below
/// two minutes, `62 min 05 s` below two hours, `3 h 05 min` beyond.
pub(crate) fn duration_two_units(s: f64) -> String {
    if !plausible_seconds(s) {
        return "unknown".into();
    }
    if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 2.0 * 3600.0 {
        format!("{} min {:02} s", (s / 60.0).floor(), (s % 60.0).floor())
    } else {
        format!(
            "{} h {:02} min",
            (s / 3600.0).floor(),
            ((s % 3600.0) / 60.0).floor()
        )
    }
}

/// Seconds in one unit, for a sentence: `30 s` below two minutes,
/// `2.5 min` below two hours, `3.1 h` beyond.
pub(crate) fn duration_one_unit(s: f64) -> String {
    if !plausible_seconds(s) {
        return "unknown".into();
    }
    if s < 120.0 {
        format!("{s:.0} s")
    } else if s < 2.0 * 3600.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mib_matches_the_trackers_definition() {
        assert_eq!(mib(300 * 1024 * 1024), 300.0);
        assert_eq!(mib(1536), 0.00146484375);
    }

    #[test]
    fn durations_round_trip() {
        for text in ["10ms", "100ms", "1s", "30s", "5m", "1h 30m"] {
            let d = parse_duration(text).unwrap();
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d, "{text}");
        }
        assert!(parse_duration("100").is_err());
        assert!(parse_duration("fast").is_err());
    }

    #[test]
    fn mib_and_durations_read_well() {
        assert_eq!(format_mib(1234.4), "1,234 MiB");
        assert_eq!(format_mib(20480.0), "20.0 GiB (20,480 MiB)");
        assert_eq!(format_mib(3.25), "3.2 MiB");
        assert_eq!(format_mib_short(20480.0), "20.0 GiB");
        assert_eq!(format_mib_one_decimal(1234.56), "1234.6 MiB");
        assert_eq!(format_gb_rounded(2048.0), "2 GB");
        assert_eq!(format_gb_rounded(2560.0), "2.5 GB");
        assert_eq!(group_thousands(1234567.0), "1,234,567");
        assert_eq!(group_thousands(-1234.0), "-1,234");
        assert_eq!(duration_two_units(3725.0), "62 min 05 s");
        assert_eq!(duration_two_units(7500.0), "2 h 05 min");
        assert_eq!(duration_one_unit(30.0), "30 s");
        assert_eq!(duration_one_unit(150.0), "2.5 min");
        for absurd in [-251_606_681_963.9, -0.1, f64::NAN, f64::INFINITY, 1e12] {
            assert_eq!(format_seconds(absurd), "unknown");
            assert_eq!(duration_one_unit(absurd), "unknown");
            assert_eq!(duration_two_units(absurd), "unknown");
        }
        assert_eq!(format_seconds(12.34), "12.3 s");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert!(parse_bytes("12 parsecs").is_err());
    }
}
