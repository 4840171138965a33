//! What both panels share: the time grid and its labels, the panel's
//! title, and the phases and stage boundaries shaded behind the lines.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::frame::{Chart, DrawResult};
use super::style::{bold, clock, component_colour, font, status_colour, Scale, GRID, MUTED};
use super::timeline::Timeline;

/// Grid lines at round times, and their labels under the panel.
pub(super) fn time_axis<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    ticks: &[f64],
    duration: f64,
    top: f64,
    s: Scale,
    labels: bool,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    for &t in ticks {
        area.draw(&PathElement::new([(t, 0.0), (t, top)], GRID))?;
        if labels {
            area.draw(
                &(EmptyElement::at((t, 0.0))
                    + PathElement::new([(0, 0), (0, s.px(5.0))], MUTED.mix(0.6))
                    + Text::new(
                        clock(t, duration),
                        (0, s.px(9.0)),
                        font(s.pt(12.0))
                            .color(&MUTED)
                            .pos(Pos::new(HPos::Center, VPos::Top)),
                    )),
            )?;
        }
    }
    Ok(())
}

/// The panel's name, above its top-left corner.
pub(super) fn panel_title<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    title: &str,
    s: Scale,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    let (x, y) = (area.get_x_range().start, area.get_y_range().end);
    area.draw(
        &(EmptyElement::at((x, y))
            + Text::new(
                title.to_string(),
                (0, -s.px(8.0)),
                bold(s.pt(13.5)).pos(Pos::new(HPos::Left, VPos::Bottom)),
            )),
    )?;
    Ok(())
}

/// Phases shaded by component, and stage boundaries as faint lines.
pub(super) fn shade<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    m: &Timeline,
    top: f64,
) -> DrawResult<(), DB> {
    let area = chart.plotting_area();
    for p in &m.phases {
        area.draw(&Rectangle::new(
            [(p.start, 0.0), (p.end.max(p.start), top)],
            component_colour(&m.components, &p.component)
                .mix(0.10)
                .filled(),
        ))?;
    }
    for st in &m.stages {
        for x in [st.start, st.end] {
            area.draw(&PathElement::new(
                [(x, 0.0), (x, top)],
                status_colour(&st.status).mix(0.35),
            ))?;
        }
    }
    Ok(())
}
