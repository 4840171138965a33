//! `memtrack plot`: one picture of a run, because people would rather look
//! than read a JSON file.
//!
//! The picture (SVG or PNG, chosen by the output's extension) has, from top
//! to bottom: a header (run name, host, command, duration, exit, the peaks
//! and the leak verdict); lanes with the stages (coloured by their status)
//! and each component's phases (rebuilt from the `before_X` / `after_X`
//! marks); and two panels sharing one time axis, in seconds since the run
//! started — host memory (the tree's RSS, the summed `VmHWM`, and each of
//! the largest processes) and GPU memory (the tree's NVML figure and
//! PyTorch's allocated / reserved figures sent with marks, per process).
//! Phases are shaded in both panels; the overall peaks are labelled in MiB;
//! pressure alerts, `experiment_start` / `experiment_end` and a suspected
//! leak's trend are marked. A legend column on the right names everything,
//! capped at the [`TOP_TARGETS`] largest processes plus "others".
//!
//! A bare file (only `detailed_log` and `peak_usage`) plots too: its
//! marks give the host line, the GPU line and the phases.
//!
//! Text in a PNG is rasterised with DejaVu Sans compiled into the binary
//! (`assets/fonts`, Bitstream Vera licence), so neither the build nor the
//! run needs a system font library.
//!
//! This file holds the entry point; `options` its types and limits. `timeline` turns a
//! document into what to draw (seconds and MiB, no pixels); `draw` lays
//! the picture out and hands each part to its painter (`lanes`, `panels`,
//! `axes`, `marks`, `legend`), all styled by `style`; `output` writes SVG,
//! or PNG drawn larger and averaged down; `stroke` draws wide lines that a
//! bitmap draws where the data is. `overlay` is `compare --plot`: runs
//! drawn over each other.

mod axes;
mod draw;
mod frame;
mod lanes;
mod legend;
mod marks;
mod options;
mod output;
mod overlay;
mod panels;
mod stroke;
mod style;
mod timeline;

use std::path::Path;

pub use self::options::{
    check_size, ImageFormat, PlotError, PlotOptions, PlotSummary, MAX_SIDE, MIN_HEIGHT, MIN_WIDTH,
    TOP_TARGETS,
};
pub use self::overlay::{overlay, Align};
use self::timeline::Timeline;
use crate::model::Document;

/// Draws `doc` into `out` (SVG or PNG, from the extension).
pub fn plot(doc: &Document, out: &Path, opts: &PlotOptions) -> Result<PlotSummary, PlotError> {
    let format = ImageFormat::from_path(out).ok_or_else(|| PlotError::Format {
        path: out.to_path_buf(),
    })?;
    check_size(opts.width, opts.height)?;
    output::register_fonts()?;
    let model = Timeline::from_document(doc, opts.process_rss).ok_or(PlotError::Empty)?;
    let mut summary = match format {
        ImageFormat::Svg => output::render_svg(out, &model, opts)?,
        ImageFormat::Png => output::render_png(out, &model, opts)?,
    };
    summary.path = out.to_path_buf();
    summary.format = format;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_come_from_the_extension() {
        assert_eq!(
            ImageFormat::from_path(Path::new("a/b.SVG")),
            Some(ImageFormat::Svg)
        );
        assert_eq!(
            ImageFormat::from_path(Path::new("x.png")),
            Some(ImageFormat::Png)
        );
        assert_eq!(ImageFormat::from_path(Path::new("x.pdf")), None);
        assert_eq!(ImageFormat::from_path(Path::new("x")), None);
        let err = plot(
            &Document::default(),
            Path::new("x.jpg"),
            &PlotOptions::default(),
        );
        assert!(matches!(err, Err(PlotError::Format { .. })));
        let err = plot(
            &Document::default(),
            Path::new("x.svg"),
            &PlotOptions::default(),
        );
        assert!(matches!(err, Err(PlotError::Empty)), "{err:?}");
    }
}
