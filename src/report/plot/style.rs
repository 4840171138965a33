//! How a plot looks: its colours, fonts, the scale of pixel sizes, the
//! legend's swatches, and how axis numbers and times are written.

use plotters::prelude::*;
use plotters::style::{FontStyle, RGBAColor};

use super::options::{MAX_LANES, TOP_TARGETS};
use crate::units::group_thousands;

pub(super) const INK: RGBColor = RGBColor(0x2b, 0x2f, 0x36);
pub(super) const MUTED: RGBColor = RGBColor(0x6b, 0x72, 0x80);
pub(super) const GRID: RGBColor = RGBColor(0xe5, 0xe7, 0xeb);
pub(super) const HOST: RGBColor = RGBColor(0x1f, 0x4e, 0x8c);
pub(super) const GPU: RGBColor = RGBColor(0x6a, 0x3d, 0x9a);
pub(super) const ALLOC: RGBColor = RGBColor(0xd9, 0x6c, 0x06);
pub(super) const LEAK: RGBColor = RGBColor(0xc0, 0x1c, 0x28);
/// Per-process lines.
pub(super) const TARGET_COLOURS: [RGBColor; TOP_TARGETS] = [
    RGBColor(0x17, 0x9c, 0x9c),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xed, 0xa9, 0x00),
];
/// Component shading and lanes.
pub(super) const COMPONENT_COLOURS: [RGBColor; MAX_LANES] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
];

/// A component's colour: its place in order of first appearance, the
/// components beyond [`MAX_LANES`] sharing the last colour.
pub(super) fn component_colour(components: &[String], component: &str) -> RGBColor {
    let i = components
        .iter()
        .position(|c| c == component)
        .unwrap_or(0)
        .min(MAX_LANES - 1);
    COMPONENT_COLOURS[i]
}

pub(super) fn status_colour(status: &str) -> RGBColor {
    match status.to_ascii_uppercase().as_str() {
        "SUCCESS" | "OK" | "DONE" => RGBColor(0x2e, 0x8b, 0x57),
        "FAILED" | "ERROR" => RGBColor(0xc0, 0x39, 0x2b),
        "ABANDONED" => RGBColor(0xe6, 0x7e, 0x22),
        "RUNNING" => RGBColor(0x7f, 0x8c, 0x8d),
        _ => RGBColor(0x5d, 0x6d, 0x7e),
    }
}

pub(super) fn level_colour(level: &str) -> RGBColor {
    match level {
        "high" => RGBColor(0xe6, 0xa7, 0x00),
        "critical" => RGBColor(0xe6, 0x5c, 0x00),
        "emergency" => RGBColor(0xb0, 0x00, 0x20),
        _ => RGBColor(0x2e, 0x8b, 0x57),
    }
}

pub(super) fn font(size: f64) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&INK)
}

pub(super) fn bold(size: f64) -> TextStyle<'static> {
    ("sans-serif", size, FontStyle::Bold)
        .into_font()
        .color(&INK)
}

/// Pixel sizes scale with the image (designed at 1400×900).
#[derive(Debug, Clone, Copy)]
pub(super) struct Scale(pub(super) f64);

impl Scale {
    pub(super) fn px(self, x: f64) -> i32 {
        (x * self.0).round() as i32
    }
    pub(super) fn pt(self, x: f64) -> f64 {
        (x * self.0).max(x * 0.75)
    }
}

/// One legend entry: how its swatch looks and its text.
#[derive(Debug, Clone)]
pub(super) enum Swatch {
    Line(RGBAColor, u32),
    Dashed(RGBAColor),
    Block(RGBAColor),
    Marker(RGBAColor),
    LineDot(RGBAColor),
    Heading,
}

// Numbers and times for people.

/// MiB up to 10 GiB, GiB beyond: `(unit, divisor)`.
pub(super) fn unit_for(max_mib: f64) -> (&'static str, f64) {
    if max_mib >= 10.0 * 1024.0 {
        ("GiB", 1024.0)
    } else {
        ("MiB", 1.0)
    }
}

pub(super) fn format_axis(y: f64) -> String {
    if y == 0.0 {
        "0".into()
    } else if y.abs() >= 100.0 || y.fract() == 0.0 {
        group_thousands(y.round())
    } else if y.abs() >= 1.0 {
        format!("{y:.1}")
    } else {
        format!("{y:.2}")
    }
}

/// Ticks at a round time step: at most 12 over the run.
pub(super) fn time_ticks(duration: f64) -> Vec<f64> {
    const STEPS: [f64; 24] = [
        0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
        3600.0, 7200.0, 10800.0, 21600.0, 43200.0, 86400.0, 172_800.0, 432_000.0, 864_000.0,
    ];
    let step = STEPS
        .iter()
        .copied()
        .find(|s| duration / s <= 12.0)
        .unwrap_or(duration / 10.0);
    (0..)
        .map(|i| i as f64 * step)
        .take_while(|t| *t <= duration * 1.01)
        .collect()
}

/// Tick labels for `x` seconds on an axis spanning `duration` seconds.
pub(super) fn clock(x: f64, duration: f64) -> String {
    if duration < 10.0 {
        format!("{x:.1}")
    } else if duration < 120.0 {
        format!("{x:.0}")
    } else if duration < 2.0 * 3600.0 {
        let s = x.round().max(0.0) as u64;
        format!("{}:{:02}", s / 60, s % 60)
    } else {
        let m = (x / 60.0).round().max(0.0) as u64;
        format!("{}:{:02}", m / 60, m % 60)
    }
}

pub(super) fn clock_unit(duration: f64) -> &'static str {
    if duration < 120.0 {
        "s"
    } else if duration < 2.0 * 3600.0 {
        "min:s"
    } else {
        "h:min"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_times_read_well() {
        assert_eq!(clock(75.0, 300.0), "1:15");
        assert_eq!(clock(7260.0, 10_000.0), "2:01");
        assert_eq!(clock(12.0, 60.0), "12");
        assert_eq!(unit_for(20_000.0), ("GiB", 1024.0));
        assert_eq!(format_axis(1234.0), "1,234");
        assert_eq!(format_axis(2.5), "2.5");
    }
}
