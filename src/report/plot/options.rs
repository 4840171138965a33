//! What a plot is asked for and what it answers: the options, the
//! formats, the summary of what was drawn, the errors, and the limits on
//! size and on how many processes and components are drawn.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// Processes drawn one by one; the rest are summed into "others".
pub const TOP_TARGETS: usize = 6;

/// Processes smaller than this share of the tree's peak go to "others".
pub(super) const MIN_TARGET_SHARE: f64 = 0.05;

/// Component lanes drawn; further components share the last colour and
/// are shaded but get no lane.
pub(super) const MAX_LANES: usize = 8;

/// What to draw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlotOptions {
    pub width: u32,
    pub height: u32,
    /// Replaces the default title (`memtrack · <run name>`).
    pub title: Option<String>,
    /// Draws each process's RSS instead of what it alone costs (its USS,
    /// where read).
    pub process_rss: bool,
}

impl Default for PlotOptions {
    fn default() -> Self {
        PlotOptions {
            width: 1400,
            height: 900,
            title: None,
            process_rss: false,
        }
    }
}

/// The output formats, from the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    Svg,
    Png,
}

impl ImageFormat {
    /// `.svg` or `.png`, any case.
    pub(crate) fn from_path(path: &Path) -> Option<ImageFormat> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "svg" => Some(ImageFormat::Svg),
            "png" => Some(ImageFormat::Png),
            _ => None,
        }
    }
}

/// What was drawn, for the command to print and tests to check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlotSummary {
    pub path: PathBuf,
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
    /// Every legend entry, in order.
    pub legend: Vec<String>,
    /// Phases shaded (closed or still open at the end).
    pub phases: usize,
    pub stages: usize,
    pub alerts: usize,
    /// The peak and leak labels written on the panels.
    pub annotations: Vec<String>,
    /// Whether a GPU panel was drawn.
    pub gpu_panel: bool,
}

/// Why no picture was written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot plot to {}: unknown format, use a .svg or .png file name", path.display())]
    Format { path: PathBuf },
    #[error(
        "cannot plot a {width}×{height} image: the width must be {MIN_WIDTH} to {MAX_SIDE} \
         pixels and the height {MIN_HEIGHT} to {MAX_SIDE}"
    )]
    Size { width: u32, height: u32 },
    #[error("nothing to plot: the document has no detailed_log entries and no target series")]
    Empty,
    #[error("cannot load the embedded font: DejaVu Sans is not a valid font")]
    Font,
    #[error("cannot draw {}: {message}", path.display())]
    Draw { path: PathBuf, message: String },
}

/// Smallest width and height a readable picture needs, pixels.
pub const MIN_WIDTH: u32 = 480;
pub const MIN_HEIGHT: u32 = 320;
/// Largest width or height drawn, pixels. A PNG is drawn at
/// three times its size first (supersampled): at 4096×4096 that buffer is
/// 12288×12288 RGB, 432 MiB, the most a plot may cost.
pub const MAX_SIDE: u32 = 4096;

/// Refuses sizes outside [`MIN_WIDTH`]…[`MAX_SIDE`] × [`MIN_HEIGHT`]…[`MAX_SIDE`]
/// before anything is allocated or drawn.
pub fn check_size(width: u32, height: u32) -> Result<(), PlotError> {
    if (MIN_WIDTH..=MAX_SIDE).contains(&width) && (MIN_HEIGHT..=MAX_SIDE).contains(&height) {
        Ok(())
    } else {
        Err(PlotError::Size { width, height })
    }
}
