//! What is marked on a panel: `experiment_start` / `experiment_end`,
//! pressure alerts, the peak and a suspected leak's trend.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::frame::{Chart, DrawResult};
use super::style::{bold, font, level_colour, Scale, INK, LEAK};
use super::timeline::{AlertMark, Timeline, Trend};
use crate::units::format_mib_short;

/// `experiment_start` / `experiment_end` as vertical lines, named in the
/// host panel.
pub(super) fn draw_marks<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    m: &Timeline,
    top: f64,
    s: Scale,
    named: bool,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    for (t, name, left) in [
        (m.experiment_start, "experiment_start", true),
        (m.experiment_end, "experiment_end", false),
    ] {
        let Some(t) = t else { continue };
        area.draw(&PathElement::new(
            [(t, 0.0), (t, top)],
            INK.mix(0.55).stroke_width(s.px(1.2).max(1) as u32),
        ))?;
        if named {
            let (dx, anchor) = if left {
                (s.px(4.0), HPos::Left)
            } else {
                (-s.px(4.0), HPos::Right)
            };
            area.draw(
                &(EmptyElement::at((t, top))
                    + Text::new(
                        name,
                        (dx, s.px(5.0)),
                        font(s.pt(11.0))
                            .color(&INK.mix(0.7))
                            .pos(Pos::new(anchor, VPos::Top)),
                    )),
            )?;
        }
    }
    Ok(())
}

/// Alerts of the panel's resources: a line and a triangle at the top,
/// then the labels in white boxes, staggered over three rows so that
/// neighbours stay readable.
pub(super) fn draw_alerts<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    m: &Timeline,
    top: f64,
    s: Scale,
    mine: impl Fn(&str) -> bool,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    let alerts: Vec<&AlertMark> = m.alerts.iter().filter(|a| mine(&a.resource)).collect();
    for a in &alerts {
        let c = level_colour(&a.level);
        area.draw(&PathElement::new([(a.t, 0.0), (a.t, top)], c.mix(0.55)))?;
        area.draw(
            &(EmptyElement::at((a.t, top))
                + TriangleMarker::new((0, s.px(7.0)), s.px(6.0), c.filled())),
        )?;
    }
    for (i, a) in alerts.iter().enumerate() {
        let c = level_colour(&a.level);
        let label = format!("{} {} {:.0} %", a.resource, a.level, a.ratio * 100.0);
        let style = font(s.pt(11.0)).color(&c);
        let (w, h) = area.estimate_text_size(&label, &style)?;
        let (w, h) = (w as i32, h as i32);
        let (x0, y0) = (s.px(9.0), s.px(16.0) + (i % 3) as i32 * (h + s.px(6.0)));
        let pad = s.px(2.0);
        area.draw(
            &(EmptyElement::at((a.t, top))
                + Rectangle::new(
                    [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                    WHITE.mix(0.85).filled(),
                )
                + PathElement::new(
                    [(0, s.px(12.0)), (0, y0 + h / 2), (x0 - pad, y0 + h / 2)],
                    c.mix(0.6),
                )
                + Text::new(label, (x0, y0), style)),
        )?;
    }
    Ok(())
}

/// A dot on the peak, and its value in a white box beside it.
pub(super) fn draw_peak<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    at: (f64, f64),
    label: &str,
    colour: RGBColor,
    duration: f64,
    s: Scale,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    let style = bold(s.pt(12.5)).color(&colour);
    let (w, h) = area.estimate_text_size(label, &style)?;
    let (w, h) = (w as i32, h as i32);
    let left = at.0 > duration * 0.7;
    let pad = s.px(4.0);
    let (x0, y0) = if left {
        (-w - s.px(14.0), -h - s.px(12.0))
    } else {
        (s.px(12.0), -h - s.px(12.0))
    };
    area.draw(
        &(EmptyElement::at(at)
            + Circle::new((0, 0), s.px(5.0), colour.filled())
            + Circle::new(
                (0, 0),
                s.px(8.0),
                colour.stroke_width(s.px(1.5).max(1) as u32),
            )
            + PathElement::new(
                [(0, 0), (if left { x0 + w } else { x0 }, y0 + h)],
                colour.mix(0.6),
            )
            + Rectangle::new(
                [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                WHITE.mix(0.9).filled(),
            )
            + Rectangle::new(
                [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                colour.mix(0.5),
            )
            + Text::new(label.to_string(), (x0, y0), style.clone())),
    )?;
    Ok(())
}

pub(super) fn draw_trend<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    tr: &Trend,
    div: f64,
    s: Scale,
) -> DrawResult<String, DB> {
    let area = chart.plotting_area();
    let from = (tr.from.0, tr.from.1 / div);
    let to = (tr.to.0, tr.to.1 / div);
    area.draw(&PathElement::new(
        [from, to],
        LEAK.stroke_width(s.px(2.4).max(1) as u32),
    ))?;
    let label = format!(
        "leak? +{} ({}/h)",
        format_mib_short(tr.growth_mib),
        format_mib_short(tr.rate_mib_per_hour)
    );
    let style = bold(s.pt(12.0)).color(&LEAK);
    let (w, h) = area.estimate_text_size(&label, &style)?;
    let (w, h) = (w as i32, h as i32);
    let (x0, y0) = (-w - s.px(6.0), s.px(10.0));
    let pad = s.px(3.0);
    area.draw(
        &(EmptyElement::at(to)
            + Rectangle::new(
                [(x0 - pad, y0 - pad), (x0 + w + pad, y0 + h + pad)],
                WHITE.mix(0.85).filled(),
            )
            + Text::new(label.clone(), (x0, y0), style)),
    )?;
    Ok(label)
}
