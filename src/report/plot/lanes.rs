//! The lanes above the panels: one row of stages (coloured by their
//! status), then one row per component with its phases as bars, each bar
//! named when its name fits.

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::frame::{DrawResult, Frame};
use super::options::MAX_LANES;
use super::style::{component_colour, font, status_colour, Scale, INK, MUTED};
use super::timeline::Timeline;

/// The lanes' plotting area: seconds against rows (row 0 at the bottom).
type LaneArea<DB> = DrawingArea<DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The lanes drawn, top to bottom: stages, then one per component.
pub(super) fn lane_names(m: &Timeline) -> Vec<String> {
    let mut v = Vec::new();
    if !m.stages.is_empty() {
        v.push("stages".to_string());
    }
    v.extend(m.components.iter().take(MAX_LANES).cloned());
    v
}

/// Pixels the lanes take (none without lanes).
pub(super) fn lanes_height(lane_names: &[String], s: Scale) -> i32 {
    let lane_h = s.px(24.0);
    if lane_names.is_empty() {
        0
    } else {
        lane_h * lane_names.len() as i32 + s.px(10.0)
    }
}

/// Draws the lanes in `lanes_area`; their names go left of it, on `root`.
pub(super) fn draw_lanes<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    lanes_area: &DrawingArea<DB, Shift>,
    f: &Frame<'_>,
    lane_names: &[String],
) -> DrawResult<(), DB> {
    let s = f.s;
    let lanes = ChartBuilder::on(lanes_area)
        .margin_right(f.right)
        .margin_top(s.px(6.0))
        .margin_bottom(s.px(4.0))
        .y_label_area_size(f.y_area)
        .x_label_area_size(0)
        .build_cartesian_2d(f.x_range(), 0.0..lane_names.len() as f64)?;
    let area = lanes.plotting_area().clone();
    draw_rows(root, &area, f, lane_names)?;
    draw_stage_bars(&area, f, lane_names)?;
    draw_phase_bars(&area, f, lane_names)?;
    Ok(())
}

/// The row a lane is drawn in (row 0 at the bottom).
fn row_of(lane_names: &[String], name: &str) -> Option<f64> {
    lane_names
        .iter()
        .position(|n| n == name)
        .map(|i| (lane_names.len() - 1 - i) as f64)
}

/// Faint row backgrounds and names.
fn draw_rows<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    area: &LaneArea<DB>,
    f: &Frame<'_>,
    lane_names: &[String],
) -> DrawResult<(), DB> {
    let s = f.s;
    for (i, name) in lane_names.iter().enumerate() {
        let y = (lane_names.len() - 1 - i) as f64;
        area.draw(&Rectangle::new(
            [(0.0, y + 0.08), (f.m.duration * 1.01, y + 0.92)],
            RGBColor(0xf4, 0xf5, 0xf7).filled(),
        ))?;
        let (px, py) = area.map_coordinate(&(0.0, y + 0.5));
        root.draw(&Text::new(
            name.clone(),
            (px - s.px(10.0), py),
            font(s.pt(12.5))
                .color(&MUTED)
                .pos(Pos::new(HPos::Right, VPos::Center)),
        ))?;
    }
    Ok(())
}

/// A bar's name centred on it, if it fits between `x0` and `x1`.
fn bar_text<DB: DrawingBackend>(
    area: &LaneArea<DB>,
    s: Scale,
    label: &str,
    (x0, x1): (f64, f64),
    y: f64,
    dark: bool,
) -> Option<Text<'static, (f64, f64), String>> {
    let (a, _) = area.map_coordinate(&(x0, y));
    let (b, _) = area.map_coordinate(&(x1, y));
    let style = font(s.pt(11.5)).color(if dark { &INK } else { &WHITE });
    let (w, _) = area.estimate_text_size(label, &style).ok()?;
    ((b - a) > w as i32 + s.px(8.0)).then(|| {
        Text::new(
            label.to_string(),
            ((x0 + x1) / 2.0, y + 0.5),
            style.pos(Pos::new(HPos::Center, VPos::Center)),
        )
    })
}

/// Stages as bars coloured by status, named `name · status` (or `name`).
fn draw_stage_bars<DB: DrawingBackend>(
    area: &LaneArea<DB>,
    f: &Frame<'_>,
    lane_names: &[String],
) -> DrawResult<(), DB> {
    for st in &f.m.stages {
        if let Some(y) = row_of(lane_names, "stages") {
            let c = status_colour(&st.status);
            area.draw(&Rectangle::new(
                [(st.start, y + 0.12), (st.end, y + 0.88)],
                c.mix(0.85).filled(),
            ))?;
            let label = format!("{} · {}", st.name, st.status);
            let span = (st.start, st.end);
            if let Some(t) = bar_text(area, f.s, &label, span, y, false)
                .or_else(|| bar_text(area, f.s, &st.name, span, y, false))
            {
                area.draw(&t)?;
            }
        }
    }
    Ok(())
}

/// Phases as bars in their component's lane, paler while still open.
fn draw_phase_bars<DB: DrawingBackend>(
    area: &LaneArea<DB>,
    f: &Frame<'_>,
    lane_names: &[String],
) -> DrawResult<(), DB> {
    for p in &f.m.phases {
        if let Some(y) = row_of(lane_names, &p.component) {
            let c = component_colour(&f.m.components, &p.component);
            area.draw(&Rectangle::new(
                [(p.start, y + 0.12), (p.end.max(p.start), y + 0.88)],
                c.mix(if p.open { 0.45 } else { 0.8 }).filled(),
            ))?;
            if let Some(t) = bar_text(area, f.s, &p.operation, (p.start, p.end), y, false) {
                area.draw(&t)?;
            }
        }
    }
    Ok(())
}
