//! The legend column: the entries of phases, stages and alerts (the
//! panels add their own), and how every entry is drawn.

use std::collections::BTreeMap;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::frame::DrawResult;
use super::options::MAX_LANES;
use super::style::{
    bold, component_colour, font, level_colour, status_colour, Scale, Swatch, COMPONENT_COLOURS,
};
use super::timeline::Timeline;

/// The entries after the panels': phases by component, stages by
/// status, alerts by level.
pub(super) fn add_phases_stages_alerts(m: &Timeline, legend: &mut Vec<(Swatch, String)>) {
    add_phases(m, legend);
    add_stages(m, legend);
    add_alerts(m, legend);
}

/// One entry per component drawn in a lane, with its count of spans.
fn add_phases(m: &Timeline, legend: &mut Vec<(Swatch, String)>) {
    if m.components.is_empty() {
        return;
    }
    legend.push((Swatch::Heading, "Phases (by component)".into()));
    for c in m.components.iter().take(MAX_LANES) {
        let n = m.phases.iter().filter(|p| &p.component == c).count();
        legend.push((
            Swatch::Block(component_colour(&m.components, c).mix(0.8)),
            format!("{c} ({n} span{})", if n == 1 { "" } else { "s" }),
        ));
    }
    if m.components.len() > MAX_LANES {
        legend.push((
            Swatch::Block(COMPONENT_COLOURS[MAX_LANES - 1].mix(0.8)),
            format!("… {} more components", m.components.len() - MAX_LANES),
        ));
    }
}

/// One entry per stage status, in order of first appearance.
fn add_stages(m: &Timeline, legend: &mut Vec<(Swatch, String)>) {
    if m.stages.is_empty() {
        return;
    }
    legend.push((Swatch::Heading, "Stages".into()));
    let mut seen: Vec<String> = Vec::new();
    for st in &m.stages {
        if !seen.contains(&st.status) {
            seen.push(st.status.clone());
            let n = m.stages.iter().filter(|x| x.status == st.status).count();
            legend.push((
                Swatch::Block(status_colour(&st.status).mix(0.85)),
                format!("{} ({n})", st.status),
            ));
        }
    }
}

/// One entry per alert level seen, mildest first.
fn add_alerts(m: &Timeline, legend: &mut Vec<(Swatch, String)>) {
    if m.alerts.is_empty() {
        return;
    }
    legend.push((Swatch::Heading, "Pressure alerts".into()));
    let mut levels: BTreeMap<usize, &str> = BTreeMap::new();
    for a in &m.alerts {
        let rank = match a.level.as_str() {
            "normal" => 0,
            "high" => 1,
            "critical" => 2,
            _ => 3,
        };
        levels.insert(rank, &a.level);
    }
    for level in levels.values() {
        legend.push((
            Swatch::Marker(level_colour(level).to_rgba()),
            level.to_string(),
        ));
    }
}

pub(super) fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    items: &[(Swatch, String)],
    s: Scale,
) -> DrawResult<(), DB> {
    let x = s.px(10.0);
    let mut y = s.px(16.0);
    let (_, height) = area.dim_in_pixel();
    let row = s.px(21.0);
    let max_chars = 38;
    for (swatch, text) in items {
        if y + row > height as i32 {
            area.draw(&Text::new("…", (x, y), font(s.pt(12.0))))?;
            break;
        }
        let text: String = if text.chars().count() > max_chars {
            text.chars().take(max_chars - 1).collect::<String>() + "…"
        } else {
            text.clone()
        };
        let mid = y + row / 2;
        let sw = s.px(26.0);
        if let Swatch::Heading = swatch {
            if y > s.px(16.0) {
                y += s.px(8.0);
            }
            area.draw(&Text::new(
                text,
                (x, y + row / 2),
                bold(s.pt(13.0)).pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
            y += row;
            continue;
        }
        draw_swatch(area, swatch, (x, mid), sw, s)?;
        area.draw(&Text::new(
            text,
            (x + sw + s.px(10.0), mid),
            font(s.pt(12.5)).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        y += row;
    }
    Ok(())
}

/// A legend entry's swatch, `sw` pixels wide, starting at `x` on the row
/// whose middle is `mid`.
fn draw_swatch<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    swatch: &Swatch,
    (x, mid): (i32, i32),
    sw: i32,
    s: Scale,
) -> DrawResult<(), DB> {
    match swatch {
        Swatch::Heading => {}
        Swatch::Line(c, w) => {
            area.draw(&PathElement::new(
                [(x, mid), (x + sw, mid)],
                c.stroke_width(s.px(*w as f64).max(1) as u32),
            ))?;
        }
        Swatch::Dashed(c) => {
            for k in 0..3 {
                let a = x + k * s.px(10.0);
                area.draw(&PathElement::new(
                    [(a, mid), (a + s.px(6.0), mid)],
                    c.stroke_width(s.px(2.0).max(1) as u32),
                ))?;
            }
        }
        Swatch::Block(c) => {
            area.draw(&Rectangle::new(
                [(x, mid - s.px(7.0)), (x + sw, mid + s.px(7.0))],
                c.filled(),
            ))?;
        }
        Swatch::LineDot(c) => {
            area.draw(&PathElement::new(
                [(x, mid), (x + sw, mid)],
                c.stroke_width(s.px(2.0).max(1) as u32),
            ))?;
            area.draw(&Circle::new((x + sw / 2, mid), s.px(3.5), c.filled()))?;
        }
        Swatch::Marker(c) => {
            area.draw(&TriangleMarker::new(
                (x + sw / 2, mid + s.px(2.0)),
                s.px(6.0),
                c.filled(),
            ))?;
        }
    }
    Ok(())
}
