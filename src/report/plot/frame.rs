//! What every painter of a plot shares: the drawing result, the panels'
//! chart type, the frame (timeline, scale, geometry) and the notes they
//! gather for the legend and the summary.

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::style::{Scale, Swatch};
use super::timeline::Timeline;

pub(super) type DrawResult<T, DB> =
    Result<T, DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// A panel's chart: seconds since the start against MiB (or GiB).
pub(super) type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// What every painter needs: the timeline, the pixel scale and the
/// geometry the lanes and panels share.
pub(super) struct Frame<'a> {
    pub(super) m: &'a Timeline,
    pub(super) s: Scale,
    /// Width of the labels' column left of the lanes and panels.
    pub(super) y_area: i32,
    /// Margin right of the lanes and panels.
    pub(super) right: i32,
    /// Round times at which the panels have grid lines.
    pub(super) ticks: Vec<f64>,
    /// Drawn on a bitmap, whose wide lines are cut at sharp turns
    /// ([`super::stroke`]).
    pub(super) bitmap: bool,
}

impl Frame<'_> {
    /// The time axis drawn: the run and a little air after it.
    pub(super) fn x_range(&self) -> std::ops::Range<f64> {
        0.0..self.m.duration * 1.01
    }
}

/// What the painters report back: the legend's entries in order, and the
/// labels written on the panels.
#[derive(Default)]
pub(super) struct Notes {
    pub(super) legend: Vec<(Swatch, String)>,
    pub(super) annotations: Vec<String>,
}
