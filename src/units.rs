//! Units and time: the one place that knows a megabyte is a MiB (as in the
//! trackers' `rss / (1024 * 1024)`, docs/memory_usage.md), how durations
//! are spelled in config files (`100ms`, `1s`), and how wall-clock time
//! becomes Unix seconds.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Bytes in one "MB" of `memory_usage.json`: the trackers divide by 1024².
pub const MIB: f64 = 1024.0 * 1024.0;

/// Bytes → MiB as the JSON reports them.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB
}

/// Wall-clock now as Unix seconds with sub-second precision (the base
/// `timestamp` field).
pub fn unix_now() -> f64 {
    unix_seconds(SystemTime::now())
}

/// A `SystemTime` as Unix seconds; times before the epoch map to 0.
pub fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Parses `100ms`, `1s`, `2m`, `1h 30m` (humantime syntax). A bare number is
/// refused: a unit-less interval in a config file is a bug waiting to happen.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration ({e}); write e.g. `100ms`, `1s`, `5m`"))
}

/// Formats a duration the way `parse_duration` reads it back.
pub fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Serde adapter: durations as humantime strings in TOML and JSON.
pub mod serde_duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

/// Parses a byte size: `512MiB`, `4GiB`, `1024` (bytes), `10MB` (decimal).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a size; write e.g. `512MiB`, `4GiB`"))?;
    let factor: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => MIB,
        "gib" => MIB * 1024.0,
        "tib" => MIB * 1024.0 * 1024.0,
        other => return Err(format!("`{text}`: unknown size unit `{other}`")),
    };
    Ok((value * factor) as u64)
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
    fn sizes() {
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert!(parse_bytes("12 parsecs").is_err());
    }
}
