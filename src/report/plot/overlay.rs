//! `memtrack compare --plot FILE`: the runs' memory drawn over each other,
//! one colour per run, aligned by time since each run's start, by the
//! job's iteration, or by stage (each stage stretched to the same width,
//! in the order the stages first appear).

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::frame::DrawResult;
use super::options::{check_size, ImageFormat, PlotError, PlotOptions};
use super::stroke::{wide_line, Pattern};
use super::style::{bold, font, format_axis, unit_for, Scale, GRID, MUTED, TARGET_COLOURS};
use crate::model::{Document, Entry, GpuSource};

/// What the x axis is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Align {
    /// Seconds since each run's start
    Time,
    /// The job's iteration (sent with marks), the peak per iteration
    Iteration,
    /// Each stage stretched to one width, in order
    Stage,
}

/// One run's lines, in x units of the alignment.
struct RunLines {
    name: String,
    host: Vec<(f64, f64)>,
    gpu: Vec<(f64, f64)>,
}

/// The measured figures of a run's log in time order: (time, host, GPU).
fn samples(doc: &Document) -> Vec<(f64, f64, f64, Option<u64>)> {
    let mut log: Vec<&Entry> = doc.detailed_log.iter().collect();
    log.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    log.iter()
        .map(|e| {
            let gpu = if e.gpu_source == GpuSource::Nvml || e.figures.gpu_process_used_mb > 0.0 {
                e.figures.gpu_process_used_mb
            } else {
                e.figures.gpu_ram_used_mb
            };
            (e.timestamp, e.figures.cpu_ram_used_mb, gpu, e.iteration)
        })
        .filter(|s| s.0.is_finite())
        .collect()
}

/// The stage names of every run, in the order they first appear.
fn stage_order(runs: &[(String, Document)]) -> Vec<String> {
    let mut order: Vec<String> = Vec::new();
    for (_, d) in runs {
        let mut stages: Vec<_> = d.stages.iter().collect();
        stages.sort_by(|a, b| a.start.total_cmp(&b.start));
        for s in stages {
            if !order.contains(&s.name) {
                order.push(s.name.clone());
            }
        }
    }
    order
}

/// A run's samples placed on the x axis of `align`.
fn place(doc: &Document, align: Align, stages: &[String]) -> Vec<(f64, f64, f64)> {
    let all = samples(doc);
    let start = if doc.run.start > 0.0 {
        doc.run.start
    } else {
        all.first().map_or(0.0, |s| s.0)
    };
    match align {
        Align::Time => all.iter().map(|s| (s.0 - start, s.1, s.2)).collect(),
        Align::Iteration => {
            // Each sample belongs to the last iteration announced before
            // it; an iteration's point is its largest figures.
            let mut out: Vec<(f64, f64, f64)> = Vec::new();
            let mut current: Option<u64> = None;
            for s in &all {
                if s.3.is_some() {
                    current = s.3;
                }
                let Some(it) = current else { continue };
                let x = it as f64;
                match out.last_mut() {
                    Some(last) if last.0 == x => {
                        last.1 = last.1.max(s.1);
                        last.2 = last.2.max(s.2);
                    }
                    _ => out.push((x, s.1, s.2)),
                }
            }
            out.sort_by(|a, b| a.0.total_cmp(&b.0));
            out
        }
        Align::Stage => all
            .iter()
            .filter_map(|s| {
                let st = doc.stages.iter().find(|st| {
                    s.0 >= st.start && st.end.is_some_and(|e| s.0 <= e && e > st.start)
                })?;
                let k = stages.iter().position(|n| *n == st.name)? as f64;
                let end = st.end?;
                Some((k + (s.0 - st.start) / (end - st.start), s.1, s.2))
            })
            .collect(),
    }
}

/// Draws the runs `(name, document)` over each other into `out` (SVG or
/// PNG); `names` are the names the comparison gave them.
pub fn overlay(
    runs: &[(String, Document)],
    names: &[String],
    align: Align,
    out: &Path,
    opts: &PlotOptions,
) -> Result<(), PlotError> {
    let format = ImageFormat::from_path(out).ok_or_else(|| PlotError::Format {
        path: out.to_path_buf(),
    })?;
    check_size(opts.width, opts.height)?;
    super::output::register_fonts()?;
    let stages = stage_order(runs);
    let lines: Vec<RunLines> = runs
        .iter()
        .zip(names)
        .map(|((_, d), name)| {
            let placed = place(d, align, &stages);
            RunLines {
                name: name.clone(),
                host: placed.iter().map(|p| (p.0, p.1)).collect(),
                gpu: placed.iter().map(|p| (p.0, p.2)).collect(),
            }
        })
        .collect();
    if lines.iter().all(|l| l.host.is_empty()) {
        return Err(PlotError::Empty);
    }
    let picture = Picture {
        lines: &lines,
        align,
        stages: &stages,
        title: opts
            .title
            .clone()
            .unwrap_or_else(|| format!("memtrack · {} runs compared", runs.len())),
    };
    let err = |e: String| PlotError::Draw {
        path: out.to_path_buf(),
        message: e,
    };
    match format {
        ImageFormat::Svg => {
            let root = SVGBackend::new(out, (opts.width, opts.height)).into_drawing_area();
            draw(&root, &picture, false).map_err(|e| err(e.to_string()))?;
            root.present().map_err(|e| err(e.to_string()))?;
        }
        ImageFormat::Png => {
            let root = BitMapBackend::new(out, (opts.width, opts.height)).into_drawing_area();
            draw(&root, &picture, true).map_err(|e| err(e.to_string()))?;
            root.present().map_err(|e| err(e.to_string()))?;
        }
    }
    Ok(())
}

/// What the picture shows.
struct Picture<'a> {
    lines: &'a [RunLines],
    align: Align,
    stages: &'a [String],
    title: String,
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    p: &Picture<'_>,
    bitmap: bool,
) -> DrawResult<(), DB> {
    let (w, h) = root.dim_in_pixel();
    let s = Scale((f64::from(w) / 1400.0).min(f64::from(h) / 900.0).max(0.5));
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(s.px(56.0));
    header.draw(&Text::new(
        p.title.clone(),
        (s.px(24.0), s.px(14.0)),
        bold(s.pt(22.0)),
    ))?;
    let (main, legend) = body.split_horizontally(w as i32 - s.px(300.0));
    let gpu = p.lines.iter().any(|l| l.gpu.iter().any(|q| q.1 > 0.0));
    if gpu {
        let (a, b) = main.split_vertically(main.dim_in_pixel().1 as i32 / 2);
        panel(&a, p, |l| &l.host, "Host memory", s, bitmap)?;
        panel(&b, p, |l| &l.gpu, "GPU memory", s, bitmap)?;
    } else {
        panel(&main, p, |l| &l.host, "Host memory", s, bitmap)?;
    }
    for (i, l) in p.lines.iter().enumerate() {
        let y = s.px(30.0) + i as i32 * s.px(24.0);
        let c = TARGET_COLOURS[i % TARGET_COLOURS.len()];
        legend.draw(&PathElement::new(
            [(s.px(8.0), y), (s.px(36.0), y)],
            c.stroke_width(s.px(3.0).max(1) as u32),
        ))?;
        legend.draw(&Text::new(
            l.name.clone(),
            (s.px(44.0), y - s.px(8.0)),
            font(s.pt(13.0)),
        ))?;
    }
    Ok(())
}

/// One panel: every run's `line` in its colour.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    p: &Picture<'_>,
    line: impl Fn(&RunLines) -> &Vec<(f64, f64)>,
    title: &str,
    s: Scale,
    bitmap: bool,
) -> DrawResult<(), DB> {
    let max_y = p
        .lines
        .iter()
        .flat_map(|l| line(l).iter().map(|q| q.1))
        .fold(1.0, f64::max);
    let max_x = p
        .lines
        .iter()
        .flat_map(|l| line(l).iter().map(|q| q.0))
        .fold(1.0, f64::max);
    let x_end = match p.align {
        Align::Stage => p.stages.len().max(1) as f64,
        _ => max_x * 1.01,
    };
    let (unit, div) = unit_for(max_y);
    let top = max_y * 1.15 / div;
    let x_desc = match p.align {
        Align::Time => "seconds since each run's start",
        Align::Iteration => "iteration",
        Align::Stage => "stage",
    };
    let mut chart = ChartBuilder::on(area)
        .margin(s.px(12.0))
        .y_label_area_size(s.px(80.0))
        .x_label_area_size(s.px(44.0))
        .caption(format!("{title} ({unit})"), bold(s.pt(13.5)))
        .build_cartesian_2d(0.0..x_end, 0.0..top)?;
    let stages = p.stages;
    let number = |x: &f64| format_axis(*x);
    let mut mesh = chart.configure_mesh();
    mesh.bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .axis_style(MUTED.mix(0.6))
        .y_label_formatter(&number)
        .label_style(font(s.pt(12.0)).color(&MUTED))
        .axis_desc_style(font(s.pt(12.5)).color(&MUTED))
        .x_desc(x_desc);
    if p.align == Align::Stage {
        mesh.x_labels(0);
    } else {
        mesh.x_label_formatter(&number);
    }
    mesh.draw()?;
    if p.align == Align::Stage {
        let plotting = chart.plotting_area();
        for (k, name) in stages.iter().enumerate() {
            let x = k as f64;
            plotting.draw(&PathElement::new([(x, 0.0), (x, top)], GRID))?;
            plotting.draw(&Text::new(
                name.clone(),
                (x + 0.02, top * 0.97),
                font(s.pt(11.5)).color(&MUTED),
            ))?;
        }
    }
    for (i, l) in p.lines.iter().enumerate() {
        let c = TARGET_COLOURS[i % TARGET_COLOURS.len()];
        let points: Vec<(f64, f64)> = line(l).iter().map(|q| (q.0, q.1 / div)).collect();
        if p.align == Align::Stage {
            // A line per stage: nothing joins one stage's end to the next.
            let mut piece = Vec::new();
            for q in points {
                if piece
                    .last()
                    .is_some_and(|last: &(f64, f64)| q.0.floor() != last.0.floor())
                {
                    wide_line(
                        &mut chart,
                        std::mem::take(&mut piece),
                        c.stroke_width(s.px(2.0).max(1) as u32),
                        Pattern::Solid,
                        bitmap,
                    )?;
                }
                piece.push(q);
            }
            wide_line(
                &mut chart,
                piece,
                c.stroke_width(s.px(2.0).max(1) as u32),
                Pattern::Solid,
                bitmap,
            )?;
        } else {
            wide_line(
                &mut chart,
                points,
                c.stroke_width(s.px(2.0).max(1) as u32),
                Pattern::Solid,
                bitmap,
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;
    use crate::model::{EntryKind, Stage};

    fn doc() -> Document {
        let mut d = Document::default();
        d.run.start = 100.0;
        for (i, it) in [None, Some(0), None, Some(1), None].iter().enumerate() {
            d.detailed_log.push(Entry {
                timestamp: 100.0 + i as f64,
                figures: Figures {
                    cpu_ram_used_mb: 10.0 * (i + 1) as f64,
                    ..Figures::default()
                },
                iteration: *it,
                kind: EntryKind::Timer,
                ..Entry::default()
            });
        }
        d.stages.push(Stage {
            name: "train".into(),
            start: 101.0,
            end: Some(103.0),
            ..Stage::default()
        });
        d
    }

    #[test]
    fn samples_are_placed_by_time_iteration_and_stage() {
        let d = doc();
        let by_time: Vec<f64> = place(&d, Align::Time, &[]).iter().map(|p| p.0).collect();
        assert_eq!(by_time, [0.0, 1.0, 2.0, 3.0, 4.0]);
        // Iteration 0 holds samples 2 and 3, iteration 1 samples 4 and 5.
        let by_iteration = place(&d, Align::Iteration, &[]);
        assert_eq!(by_iteration, [(0.0, 30.0, 0.0), (1.0, 50.0, 0.0)]);
        let by_stage = place(&d, Align::Stage, &["warmup".into(), "train".into()]);
        assert_eq!(
            by_stage.iter().map(|p| p.0).collect::<Vec<_>>(),
            [1.0, 1.5, 2.0]
        );
    }
}
