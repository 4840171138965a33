//! The layout of a plot, top to bottom: the header, the lanes, the host
//! panel and the GPU panel, with the legend in a column on the right; each
//! part is handed to its painter, in the order they overlap.

use plotters::coord::Shift;
use plotters::prelude::*;

use super::frame::{DrawResult, Frame, Notes};
use super::options::{ImageFormat, PlotOptions, PlotSummary};
use super::style::{bold, font, time_ticks, Scale, Swatch, MUTED};
use super::timeline::Timeline;
use super::{lanes, legend, panels};

/// Draws the whole picture on `root` (a bitmap when `bitmap`) and says
/// what was drawn.
pub(super) fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    m: &Timeline,
    opts: &PlotOptions,
    bitmap: bool,
) -> DrawResult<PlotSummary, DB> {
    let s = Scale(
        (opts.width as f64 / 1400.0)
            .min(opts.height as f64 / 900.0)
            .max(0.5),
    );
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(s.px(70.0));
    draw_header(&header, m, opts, s)?;

    let legend_w = s.px(300.0);
    let (main, legend_area) = body.split_horizontally(opts.width as i32 - legend_w);
    let lane_names = lanes::lane_names(m);
    let (lanes_area, panels) = main.split_vertically(lanes::lanes_height(&lane_names, s));
    let f = Frame {
        m,
        s,
        y_area: s.px(92.0),
        right: s.px(26.0),
        ticks: time_ticks(m.duration),
        bitmap,
    };
    if !lane_names.is_empty() {
        lanes::draw_lanes(root, &lanes_area, &f, &lane_names)?;
    }

    let gpu = m.has_gpu();
    let (host_area, gpu_area) = split_panels(&panels, gpu);
    let mut notes = Notes::default();
    panels::draw_host_panel(&host_area, &f, gpu, &mut notes)?;
    if let Some(gpu_area) = &gpu_area {
        panels::draw_gpu_panel(gpu_area, &f, &mut notes)?;
    } else if !m.host.is_empty() {
        notes.annotations.push("no GPU data".into());
    }

    legend::add_phases_stages_alerts(m, &mut notes.legend);
    legend::draw_legend(&legend_area, &notes.legend, s)?;
    Ok(summary(m, opts, notes, gpu))
}

/// The title and the subtitle (host, command, duration, exit, peaks and
/// the leak verdict).
fn draw_header<DB: DrawingBackend>(
    header: &DrawingArea<DB, Shift>,
    m: &Timeline,
    opts: &PlotOptions,
    s: Scale,
) -> DrawResult<(), DB> {
    let title = opts.title.clone().unwrap_or_else(|| m.title.clone());
    header.draw(&Text::new(
        title,
        (s.px(24.0), s.px(14.0)),
        bold(s.pt(22.0)),
    ))?;
    header.draw(&Text::new(
        m.subtitle.clone(),
        (s.px(24.0), s.px(44.0)),
        font(s.pt(13.5)).color(&MUTED),
    ))?;
    Ok(())
}

/// The host panel above the GPU panel (54 % of the height), or the host
/// panel alone.
fn split_panels<DB: DrawingBackend>(
    panels: &DrawingArea<DB, Shift>,
    gpu: bool,
) -> (DrawingArea<DB, Shift>, Option<DrawingArea<DB, Shift>>) {
    if gpu {
        let h = panels.dim_in_pixel().1 as f64;
        let (a, b) = panels.split_vertically((h * 0.54) as i32);
        (a, Some(b))
    } else {
        (panels.clone(), None)
    }
}

/// What was drawn; the path and format are the caller's to fill in.
fn summary(m: &Timeline, opts: &PlotOptions, notes: Notes, gpu: bool) -> PlotSummary {
    PlotSummary {
        path: std::path::PathBuf::new(),
        format: ImageFormat::Svg,
        width: opts.width,
        height: opts.height,
        legend: notes
            .legend
            .into_iter()
            .filter(|l| !matches!(l.0, Swatch::Heading))
            .map(|l| l.1)
            .collect(),
        phases: m.phases.len(),
        stages: m.stages.len(),
        alerts: m.alerts.len(),
        annotations: notes.annotations,
        gpu_panel: gpu,
    }
}
