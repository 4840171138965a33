//! The two panels sharing the time axis: host memory (the tree's RSS, the
//! summed `VmHWM`, the largest processes) and GPU memory (the tree's NVML
//! figure, the card's capacity, PyTorch's allocated and reserved figures),
//! each with its trend, peak, marks and alerts.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::axes::{panel_title, shade, time_axis};
use super::frame::{Chart, DrawResult, Frame, Notes};
use super::marks::{draw_alerts, draw_marks, draw_peak, draw_trend};
use super::options::TOP_TARGETS;
use super::stroke::{wide_line, Pattern};
use super::style::{
    clock, clock_unit, font, format_axis, unit_for, Scale, Swatch, ALLOC, GPU, GRID, HOST, LEAK,
    MUTED, TARGET_COLOURS,
};
use super::timeline::{Line, Timeline};
use crate::units::{format_mib, format_mib_short};

/// How a panel's chart is laid out.
struct PanelLayout {
    /// The y axis' top, in the panel's unit.
    top: f64,
    margin_bottom: i32,
    /// Height of the time labels under the panel (0: none).
    x_label_area: i32,
    y_labels: usize,
    /// The time axis' name (empty: none).
    x_desc: String,
}

/// A panel's chart with its grid and y labels drawn.
fn panel_chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    f: &Frame<'_>,
    layout: PanelLayout,
) -> DrawResult<Chart<'a, DB>, DB> {
    let s = f.s;
    let duration = f.m.duration;
    let mut chart = ChartBuilder::on(area)
        .margin_right(f.right)
        .margin_top(s.px(30.0))
        .margin_bottom(layout.margin_bottom)
        .y_label_area_size(f.y_area)
        .x_label_area_size(layout.x_label_area)
        .build_cartesian_2d(f.x_range(), 0.0..layout.top)?;
    let time_fmt = |x: &f64| clock(*x, duration);
    let y_fmt = |y: &f64| format_axis(*y);
    chart
        .configure_mesh()
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .axis_style(MUTED.mix(0.6))
        .x_labels(0)
        .y_labels(layout.y_labels)
        .x_label_formatter(&time_fmt)
        .y_label_formatter(&y_fmt)
        .label_style(font(s.pt(12.0)).color(&MUTED))
        .axis_desc_style(font(s.pt(12.5)).color(&MUTED))
        .x_desc(layout.x_desc)
        .draw()?;
    Ok(chart)
}

/// A line in the panel's unit.
fn scaled(l: &Line, div: f64) -> Line {
    l.iter().map(|p| (p.0, p.1 / div)).collect()
}

/// A stroke `w` design pixels wide, at least one.
fn stroke(s: Scale, w: f64) -> u32 {
    s.px(w).max(1) as u32
}

/// The leak trend's legend entry.
fn trend_swatch() -> (Swatch, String) {
    (
        Swatch::Line(LEAK.to_rgba(), 2),
        "leak trend (Theil–Sen)".into(),
    )
}

/// The host panel; with a GPU panel below it, it leaves the time labels
/// to that one.
pub(super) fn draw_host_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    f: &Frame<'_>,
    gpu: bool,
    notes: &mut Notes,
) -> DrawResult<(), DB> {
    let (m, s) = (f.m, f.s);
    let host_max = m.host_max();
    let (unit, div) = unit_for(host_max);
    let top = host_max * 1.22 / div;
    let layout = PanelLayout {
        top,
        margin_bottom: if gpu { s.px(6.0) } else { s.px(4.0) },
        x_label_area: if gpu { 0 } else { s.px(46.0) },
        y_labels: 6,
        x_desc: if gpu {
            String::new()
        } else {
            format!("time since start ({})", clock_unit(m.duration))
        },
    };
    let mut chart = panel_chart(area, f, layout)?;
    panel_title(&chart, &format!("Host memory ({unit})"), s)?;
    time_axis(&chart, &f.ticks, m.duration, top, s, !gpu)?;
    shade(&chart, m, top)?;
    draw_host_lines(&mut chart, m, div, s, f.bitmap)?;
    host_legend(m, &mut notes.legend);
    if let Some(tr) = &m.host_trend {
        notes.annotations.push(draw_trend(&chart, tr, div, s)?);
        notes.legend.push(trend_swatch());
    }
    if let Some((x, y)) = m.host_peak {
        let label = format!("host peak {}", format_mib(y));
        draw_peak(&chart, (x, y / div), &label, HOST, m.duration, s)?;
        notes.annotations.push(label);
    }
    draw_marks(&chart, m, top, s, true)?;
    draw_alerts(&chart, m, top, s, |r| r == "host")?;
    Ok(())
}

/// The tree's area, its high-water marks, the processes, "others", and
/// the tree's line on top.
fn draw_host_lines<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    m: &Timeline,
    div: f64,
    s: Scale,
    bitmap: bool,
) -> DrawResult<(), DB> {
    chart.draw_series(
        AreaSeries::new(scaled(&m.host, div), 0.0, HOST.mix(0.10)).border_style(TRANSPARENT),
    )?;
    if !m.hwm.is_empty() {
        wide_line(
            chart,
            scaled(&m.hwm, div),
            MUTED.mix(0.8).stroke_width(stroke(s, 1.4)),
            Pattern::Dashed(s.px(6.0), s.px(4.0)),
            bitmap,
        )?;
    }
    for (i, l) in m.host_targets.iter().enumerate() {
        let c = TARGET_COLOURS[i % TOP_TARGETS];
        wide_line(
            chart,
            scaled(&l.line, div),
            c.stroke_width(stroke(s, 1.6)),
            Pattern::Solid,
            bitmap,
        )?;
    }
    if let Some(o) = &m.host_others {
        wide_line(
            chart,
            scaled(&o.line, div),
            MUTED.stroke_width(stroke(s, 1.4)),
            Pattern::Dashed(s.px(3.0), s.px(3.0)),
            bitmap,
        )?;
    }
    wide_line(
        chart,
        scaled(&m.host, div),
        HOST.stroke_width(stroke(s, 2.6)),
        Pattern::Solid,
        bitmap,
    )
}

/// The host panel's legend entries, before its trend's.
fn host_legend(m: &Timeline, legend: &mut Vec<(Swatch, String)>) {
    legend.push((Swatch::Heading, "Host memory".into()));
    legend.push((
        Swatch::Line(HOST.to_rgba(), 3),
        format!(
            "tree host memory ({} process{})",
            m.processes.max(1),
            if m.processes <= 1 { "" } else { "es" }
        ),
    ));
    if !m.hwm.is_empty() {
        legend.push((
            Swatch::Dashed(MUTED.to_rgba()),
            "tree peak between samples".into(),
        ));
    }
    let what = if m.host_targets_own {
        "own peak"
    } else {
        "peak"
    };
    for (i, l) in m.host_targets.iter().enumerate() {
        legend.push((
            Swatch::Line(TARGET_COLOURS[i % TOP_TARGETS].to_rgba(), 2),
            format!("{} · {what} {}", l.label, format_mib_short(l.peak)),
        ));
    }
    if let Some(o) = &m.host_others {
        legend.push((Swatch::Dashed(MUTED.to_rgba()), o.label.clone()));
    }
}

/// The GPU panel, with the time labels under it.
pub(super) fn draw_gpu_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    f: &Frame<'_>,
    notes: &mut Notes,
) -> DrawResult<(), DB> {
    let (m, s) = (f.m, f.s);
    let gmax = m.gpu_max();
    let (unit, div) = unit_for(gmax);
    let top = gmax * 1.22 / div;
    let layout = PanelLayout {
        top,
        margin_bottom: s.px(4.0),
        x_label_area: s.px(46.0),
        y_labels: 5,
        x_desc: format!("time since start ({})", clock_unit(m.duration)),
    };
    let mut chart = panel_chart(area, f, layout)?;
    panel_title(&chart, &format!("GPU memory ({unit})"), s)?;
    time_axis(&chart, &f.ticks, m.duration, top, s, true)?;
    shade(&chart, m, top)?;
    notes.legend.push((Swatch::Heading, "GPU memory".into()));
    if let Some(capacity) = &m.gpu_capacity {
        let entry = draw_capacity(&mut chart, m, capacity, div, s)?;
        notes.legend.push(entry);
    }
    draw_gpu_lines(&mut chart, m, div, s, f.bitmap)?;
    gpu_legend(m, &mut notes.legend);
    if let Some(tr) = &m.gpu_trend {
        notes.annotations.push(draw_trend(&chart, tr, div, s)?);
        if !notes.legend.iter().any(|l| l.1.starts_with("leak trend")) {
            notes.legend.push(trend_swatch());
        }
    }
    if let Some((x, y)) = m.gpu_peak {
        let label = format!("GPU peak {}", format_mib(y));
        let c = if m.gpu_tree.is_empty() { ALLOC } else { GPU };
        draw_peak(&chart, (x, y / div), &label, c, m.duration, s)?;
        notes.annotations.push(label);
    }
    draw_marks(&chart, m, top, s, false)?;
    draw_alerts(&chart, m, top, s, |r| r.starts_with("gpu"))?;
    Ok(())
}

/// The card's capacity as a dashed line, named at its left end; returns
/// its legend entry.
fn draw_capacity<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    m: &Timeline,
    (label, cap): &(String, f64),
    div: f64,
    s: Scale,
) -> DrawResult<(Swatch, String), DB> {
    chart.draw_series(DashedLineSeries::new(
        [(0.0, cap / div), (m.duration * 1.01, cap / div)],
        s.px(10.0),
        s.px(5.0),
        LEAK.mix(0.7).stroke_width(stroke(s, 1.4)),
    ))?;
    let text = format!("{label} {}", format_mib_short(*cap));
    chart.draw_series(std::iter::once(Text::new(
        text.clone(),
        (m.duration * 0.005, cap / div),
        font(s.pt(11.5))
            .color(&LEAK)
            .pos(Pos::new(HPos::Left, VPos::Bottom)),
    )))?;
    Ok((Swatch::Dashed(LEAK.mix(0.7)), text))
}

/// The tree's area, the processes, "others", the tree's line, and
/// PyTorch's reserved and allocated figures with a dot at each mark.
fn draw_gpu_lines<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    m: &Timeline,
    div: f64,
    s: Scale,
    bitmap: bool,
) -> DrawResult<(), DB> {
    if !m.gpu_tree.is_empty() {
        chart.draw_series(
            AreaSeries::new(scaled(&m.gpu_tree, div), 0.0, GPU.mix(0.10)).border_style(TRANSPARENT),
        )?;
    }
    for (i, l) in m.gpu_targets.iter().enumerate() {
        wide_line(
            chart,
            scaled(&l.line, div),
            TARGET_COLOURS[i % TOP_TARGETS].stroke_width(stroke(s, 1.6)),
            Pattern::Solid,
            bitmap,
        )?;
    }
    if let Some(o) = &m.gpu_others {
        wide_line(
            chart,
            scaled(&o.line, div),
            MUTED.stroke_width(stroke(s, 1.4)),
            Pattern::Dashed(s.px(3.0), s.px(3.0)),
            bitmap,
        )?;
    }
    if !m.gpu_tree.is_empty() {
        wide_line(
            chart,
            scaled(&m.gpu_tree, div),
            GPU.stroke_width(stroke(s, 2.6)),
            Pattern::Solid,
            bitmap,
        )?;
    }
    if !m.alloc_reserved.is_empty() {
        wide_line(
            chart,
            scaled(&m.alloc_reserved, div),
            ALLOC.stroke_width(stroke(s, 1.8)),
            Pattern::Dashed(s.px(7.0), s.px(4.0)),
            bitmap,
        )?;
    }
    if !m.alloc_used.is_empty() {
        wide_line(
            chart,
            scaled(&m.alloc_used, div),
            ALLOC.stroke_width(stroke(s, 2.0)),
            Pattern::Solid,
            bitmap,
        )?;
        chart.draw_series(
            scaled(&m.alloc_used, div)
                .into_iter()
                .map(|p| Circle::new(p, s.px(2.8), ALLOC.filled())),
        )?;
    }
    Ok(())
}

/// The GPU panel's legend entries after the capacity's: the tree, the
/// processes, "others", reserved and allocated.
fn gpu_legend(m: &Timeline, legend: &mut Vec<(Swatch, String)>) {
    if !m.gpu_tree.is_empty() {
        legend.push((
            Swatch::Line(GPU.to_rgba(), 3),
            "tree GPU (NVML, per process)".into(),
        ));
    }
    for (i, l) in m.gpu_targets.iter().enumerate() {
        legend.push((
            Swatch::Line(TARGET_COLOURS[i % TOP_TARGETS].to_rgba(), 2),
            format!("{} · GPU peak {}", l.label, format_mib_short(l.peak)),
        ));
    }
    if let Some(o) = &m.gpu_others {
        legend.push((Swatch::Dashed(MUTED.to_rgba()), o.label.clone()));
    }
    if !m.alloc_reserved.is_empty() {
        legend.push((
            Swatch::Dashed(ALLOC.to_rgba()),
            "reserved (PyTorch, at marks)".into(),
        ));
    }
    if !m.alloc_used.is_empty() {
        legend.push((
            Swatch::LineDot(ALLOC.to_rgba()),
            "allocated (PyTorch, at marks)".into(),
        ));
    }
}
