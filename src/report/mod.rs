//! After the run: reading `memory_usage.json` files back — the report, the
//! configuration comparison, merging ranks, the timeline plot and leak
//! detection.

pub mod compare;
pub mod html;
pub mod merge;
pub mod plot;
pub mod read;
pub mod text;

use std::path::{Path, PathBuf};

/// The largest document `merge` writes: what `report` and the other
/// readers accept. A merge whose document would be larger writes nothing
/// and says so.
pub const MAX_MERGED: u64 = crate::model::json::MAX_DOCUMENT_BYTES;

/// What a reader was given, as the file to read: a `memory_usage.json`, or
/// a run directory (`outputs/RUN`, what `memtrack recover` takes) holding
/// one. A run directory without its file says why and what to do.
pub fn document_path(path: &Path) -> anyhow::Result<PathBuf> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let file = path.join(crate::model::json::FILE_NAME);
    if file.is_file() {
        return Ok(file);
    }
    if crate::store::journal::has_journal(path) {
        anyhow::bail!(
            "{} holds no {} yet: its memtrack is still running, or was killed \
             (`memtrack recover {}` rebuilds the file)",
            path.display(),
            crate::model::json::FILE_NAME,
            path.display()
        );
    }
    anyhow::bail!(
        "{} is a directory without a {}: give a run directory (outputs/RUN) or the file",
        path.display(),
        crate::model::json::FILE_NAME
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_directory_stands_for_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memory_usage.json");
        assert!(format!("{:#}", document_path(dir.path()).unwrap_err()).contains("without a"));
        let journal = dir.path().join(crate::store::journal::DIR);
        std::fs::create_dir(&journal).unwrap();
        std::fs::write(journal.join("state.json"), "{}").unwrap();
        let err = format!("{:#}", document_path(dir.path()).unwrap_err());
        assert!(err.contains("memtrack recover"), "{err}");
        std::fs::write(&file, "{}").unwrap();
        assert_eq!(document_path(dir.path()).unwrap(), file);
        assert_eq!(document_path(&file).unwrap(), file);
        let missing = dir.path().join("nope.json");
        assert_eq!(
            document_path(&missing).unwrap(),
            missing,
            "the reader names it"
        );
    }
}
