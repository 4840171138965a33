//! Writing the picture: SVG as plotters draws it, PNG drawn at
//! [`SUPERSAMPLE`] times the size and averaged down, and the embedded
//! fonts both need.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::draw::draw;
use super::options::{PlotError, PlotOptions, PlotSummary};
use super::timeline::Timeline;

/// PNGs are drawn this many times larger, then averaged down.
const SUPERSAMPLE: u32 = 3;

fn draw_error(out: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |message: String| PlotError::Draw {
        path: out.to_path_buf(),
        message,
    }
}

/// Draws `model` into the SVG file `out`.
pub(super) fn render_svg(
    out: &Path,
    model: &Timeline,
    opts: &PlotOptions,
) -> Result<PlotSummary, PlotError> {
    let draw_err = draw_error(out);
    let mut svg = String::new();
    let s = {
        let root = SVGBackend::with_string(&mut svg, (opts.width, opts.height)).into_drawing_area();
        let s = draw(&root, model, opts, false).map_err(|e| draw_err(e.to_string()))?;
        root.present().map_err(|e| draw_err(e.to_string()))?;
        s
    };
    std::fs::write(out, xml_text(&svg).as_bytes()).map_err(|e| draw_err(e.to_string()))?;
    Ok(s)
}

/// The SVG with every character XML does not allow (C0 controls other
/// than tab and newlines: a job's `ESC` in a stage name) and every other
/// control or bidirectional mark written as a visible `\u{1b}`, as on
/// the terminal: plotters escapes `<`, `&` and quotes, not these, and one
/// `ESC` makes the file something no XML reader opens.
fn xml_text(svg: &str) -> std::borrow::Cow<'_, str> {
    let bad = |c: char| {
        crate::logging::terminal::is_control(c) && !matches!(c, '\n' | '\t' | '\r')
            || matches!(c, '\u{fffe}' | '\u{ffff}')
    };
    if !svg.chars().any(bad) {
        return std::borrow::Cow::Borrowed(svg);
    }
    let mut out = String::with_capacity(svg.len() + 16);
    for c in svg.chars() {
        if bad(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Draws `model` into the PNG file `out`: drawn at SUPERSAMPLE times the
/// size and averaged down, for smooth lines and even glyphs from a backend
/// that draws neither.
pub(super) fn render_png(
    out: &Path,
    model: &Timeline,
    opts: &PlotOptions,
) -> Result<PlotSummary, PlotError> {
    let draw_err = draw_error(out);
    let size = (opts.width, opts.height);
    let big = PlotOptions {
        width: opts.width * SUPERSAMPLE,
        height: opts.height * SUPERSAMPLE,
        title: opts.title.clone(),
        process_rss: opts.process_rss,
    };
    let mut pixels = vec![0u8; big.width as usize * big.height as usize * 3];
    let mut s = {
        let root =
            BitMapBackend::with_buffer(&mut pixels, (big.width, big.height)).into_drawing_area();
        let s = draw(&root, model, &big, true).map_err(|e| draw_err(e.to_string()))?;
        root.present().map_err(|e| draw_err(e.to_string()))?;
        s
    };
    s.width = opts.width;
    s.height = opts.height;
    let small = shrink(&pixels, big.width as usize, SUPERSAMPLE as usize);
    let mut png = BitMapBackend::new(out, size);
    png.blit_bitmap((0, 0), size, &small)
        .and_then(|()| png.present())
        .map_err(|e| draw_err(e.to_string()))?;
    Ok(s)
}

/// Averages `k`×`k` blocks of an RGB image `width` pixels wide.
fn shrink(rgb: &[u8], width: usize, k: usize) -> Vec<u8> {
    let height = rgb.len() / 3 / width;
    let (w, h) = (width / k, height / k);
    let mut out = vec![0u8; w * h * 3];
    let n = (k * k) as u32;
    for y in 0..h {
        for x in 0..w {
            for c in 0..3 {
                let mut sum = 0u32;
                for dy in 0..k {
                    let row = (y * k + dy) * width;
                    for dx in 0..k {
                        sum += u32::from(rgb[(row + x * k + dx) * 3 + c]);
                    }
                }
                out[(y * w + x) * 3 + c] = ((sum + n / 2) / n) as u8;
            }
        }
    }
    out
}

static REGULAR: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");
static BOLD: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans-Bold.ttf");

/// Registers the embedded fonts as plotters' `sans-serif`, once.
pub(super) fn register_fonts() -> Result<(), PlotError> {
    // Whether both registered (plotters' error is not `Clone`: kept as a flag).
    static DONE: OnceLock<bool> = OnceLock::new();
    let registered = *DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, REGULAR).is_ok()
            && plotters::style::register_font("sans-serif", FontStyle::Bold, BOLD).is_ok()
    });
    if registered {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}
