//! Wide lines that a bitmap draws where the data is.
//!
//! Plotters' bitmap backend turns a path wider than a pixel into one
//! polygon whose corners are the miter joins of its segments. Where a
//! series turns sharply — up and straight back down within a pixel or two,
//! as a dense series does at every sample — the inner corner of the join
//! lies hundreds of pixels away, and the polygon draws a thin spike there:
//! far above (or below) the series, across the lanes, off the image. The
//! SVG backend leaves joins to the viewer, which limits them.
//!
//! So on a bitmap a wide line is cut at every turn sharper than
//! [`SHARPEST_DEG`], where the joins' corners stay within twice the
//! stroke's half-width of the line, and a dot rounds each cut.

use plotters::prelude::*;

use super::frame::{Chart, DrawResult};

/// The sharpest angle between two segments drawn in one piece, in degrees:
/// a join's corner then lies at most 1 / sin(30°) = 2 half-widths away.
const SHARPEST_DEG: f64 = 60.0;

/// How a line is stroked.
#[derive(Debug, Clone, Copy)]
pub(super) enum Pattern {
    Solid,
    /// Dashes and gaps this many pixels long.
    Dashed(i32, i32),
}

/// Draws `points` as a line in `style`; on a bitmap (`bitmap`), cut at
/// sharp turns so that no join draws a spike.
pub(super) fn wide_line<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    points: Vec<(f64, f64)>,
    style: ShapeStyle,
    pattern: Pattern,
    bitmap: bool,
) -> DrawResult<(), DB> {
    let pieces = if bitmap && style.stroke_width > 1 {
        let pixels: Vec<(i32, i32)> = points.iter().map(|p| chart.backend_coord(p)).collect();
        cut_at_sharp_turns(&points, &pixels)
    } else {
        vec![points]
    };
    let cuts: Vec<(f64, f64)> = pieces
        .iter()
        .skip(1)
        .filter_map(|p| p.first().copied())
        .collect();
    for piece in pieces {
        match pattern {
            Pattern::Solid => chart.draw_series(LineSeries::new(piece, style))?,
            Pattern::Dashed(dash, gap) => {
                chart.draw_series(DashedLineSeries::new(piece, dash, gap, style))?
            }
        };
    }
    if matches!(pattern, Pattern::Solid) {
        let r = (style.stroke_width / 2).max(1);
        chart.draw_series(cuts.into_iter().map(|p| Circle::new(p, r, style.filled())))?;
    }
    Ok(())
}

/// `points` (at `pixels` on the image) in pieces, each turning by at most
/// [`SHARPEST_DEG`] at any point; a piece starts where the one before
/// ends. Points on the pixel of the point before add nothing and are left
/// out.
fn cut_at_sharp_turns(points: &[(f64, f64)], pixels: &[(i32, i32)]) -> Vec<Vec<(f64, f64)>> {
    let mut pieces = Vec::new();
    let mut piece: Vec<(f64, f64)> = Vec::new();
    // The last two distinct pixels of the piece, the last with its point.
    let mut before: Option<(i32, i32)> = None;
    let mut last: Option<((i32, i32), (f64, f64))> = None;
    for (&p, &q) in points.iter().zip(pixels) {
        if last.is_some_and(|(l, _)| l == q) {
            continue;
        }
        if let (Some(a), Some((b, b_point))) = (before, last) {
            if sharp(a, b, q) {
                pieces.push(std::mem::take(&mut piece));
                piece.push(b_point);
            }
        }
        piece.push(p);
        before = last.map(|(l, _)| l);
        last = Some((q, p));
    }
    if !piece.is_empty() {
        pieces.push(piece);
    }
    pieces
}

/// Whether the path a → b → c turns at b by more than the sharpest
/// angle drawn in one piece (the angle between b→a and b→c is small).
fn sharp(a: (i32, i32), b: (i32, i32), c: (i32, i32)) -> bool {
    let u = (f64::from(a.0 - b.0), f64::from(a.1 - b.1));
    let v = (f64::from(c.0 - b.0), f64::from(c.1 - b.1));
    let (lu, lv) = (u.0.hypot(u.1), v.0.hypot(v.1));
    if lu == 0.0 || lv == 0.0 {
        return false;
    }
    let cos = (u.0 * v.0 + u.1 * v.1) / (lu * lv);
    cos > SHARPEST_DEG.to_radians().cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reversal_is_cut_a_bend_is_not() {
        // Up 200 pixels and back down one pixel to the right: a cut at the top.
        assert!(sharp((100, 500), (100, 300), (101, 500)));
        // A right angle and a straight line stay one piece.
        assert!(!sharp((0, 0), (10, 0), (10, 10)));
        assert!(!sharp((0, 0), (10, 0), (20, 0)));
        let points = [(0.0, 0.0), (1.0, 10.0), (2.0, 0.0), (3.0, 1.0)];
        let pixels = [(0, 500), (1, 300), (2, 500), (3, 490)];
        let pieces = cut_at_sharp_turns(&points, &pixels);
        assert_eq!(
            pieces,
            vec![
                vec![(0.0, 0.0), (1.0, 10.0)],
                vec![(1.0, 10.0), (2.0, 0.0)],
                vec![(2.0, 0.0), (3.0, 1.0)]
            ]
        );
    }

    #[test]
    fn points_on_one_pixel_are_drawn_once() {
        let points = [(0.0, 0.0), (0.1, 0.1), (1.0, 1.0)];
        let pixels = [(0, 0), (0, 0), (5, 0)];
        assert_eq!(
            cut_at_sharp_turns(&points, &pixels),
            vec![vec![(0.0, 0.0), (1.0, 1.0)]]
        );
    }
}
