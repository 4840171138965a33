//! The run's files as an output: the final `memory_usage.json` kept
//! somewhere, and the report page beside it. Registered last in the app's
//! list, it finishes first, and hands the paths it leaves to every other
//! output through [`Links::set_files`]: S3, ClearML and MLflow upload
//! what it says was written.
//!
//! The journal writes the document into the run directory as its last
//! act (the same atomic write as a checkpoint: the crash files go only
//! once the document is on disk). This output takes over from there: a
//! run directory that could not take it (a full disk) must not lose the
//! run, so the document goes to a fallback file; then the page. The
//! checkpoints written while the run goes on (`memory_usage.json` with
//! `state.json`) stay the journal's.
//!
//! It is always on: `html_report` turns off the page, never the document.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::engine::Feed;
use crate::export::finish::Deadline;
use crate::export::output::{absolute, FinalFiles, Finished, Links, Output, RunEnd, Start};
use crate::store::journal;
use crate::store::Store;

/// What the last checkpoint is renamed to when the final document could not
/// be written in the run directory.
pub(crate) const PARTIAL_FILE: &str = "memory_usage.partial.json";

/// The final document and the report page.
pub(crate) struct FilesOutput {
    /// Write the report page (`html_report`).
    page: bool,
    /// Where the journal writes the document: the run directory's.
    document: PathBuf,
    links: Arc<Links>,
}

impl FilesOutput {
    /// Always built: `page` (the `html_report` setting) says only whether
    /// the report page is written beside the document.
    pub(crate) fn build(page: bool) -> FilesOutput {
        FilesOutput {
            page,
            document: PathBuf::new(),
            links: Arc::default(),
        }
    }
}

impl Output for FilesOutput {
    fn name(&self) -> &'static str {
        "files"
    }

    fn start(&mut self, ctx: &Start<'_>) -> anyhow::Result<Feed> {
        self.document = ctx.document.to_path_buf();
        self.links = Arc::clone(&ctx.links);
        Ok(Feed::default())
    }

    /// Keeps the document, writes the page (not when the stop is urgent),
    /// and tells the others where both are. Never fails the run: a
    /// document written nowhere fails it through the engine's end.
    fn finish(self: Box<Self>, end: &RunEnd<'_>, _: &Deadline) -> Finished {
        let mut kept = save_document(end, self.document);
        if self.page && !end.ended.urgent {
            kept.page = write_page(&kept, end.store, end.run_dir);
        }
        self.links.set_files(kept);
        Finished::default()
    }
}

/// Writes the run's report page beside its document in the run
/// directory. The page is a convenience: a failure is a warning, never
/// the run's failure; a document that had to go elsewhere (a full disk)
/// gets no page, so no fixed name is written into a shared folder.
fn write_page(kept: &FinalFiles, store: &Store, run_dir: &Path) -> Option<PathBuf> {
    if !kept.written {
        return None;
    }
    if kept.document.parent() != Some(run_dir) {
        tracing::warn!(
            "the report page was not written: the run's JSON is not in {} \
             (`memtrack report --html {}` writes it later)",
            run_dir.display(),
            kept.document.display()
        );
        return None;
    }
    let out = crate::report::html::beside(&kept.document);
    let written = crate::report::html::store_page(store)
        .and_then(|page| crate::report::html::write(&out, &page));
    match written {
        Ok(()) => {
            tracing::info!("wrote the report page {}", out.display());
            Some(out)
        }
        Err(e) => {
            tracing::warn!(
                "the report page was not written: {e:#}; `memtrack report --html {}` writes it later",
                kept.document.display()
            );
            None
        }
    }
}

/// A run directory that cannot take the final JSON (a full disk) must
/// not lose the run: the document goes to a fresh file in the temporary
/// directory, else in `/var/tmp`, else in the home folder. Each name is
/// unguessable and created only if free (`O_EXCL`, never through a link,
/// 0600), so no name another user planted can make this fail or redirect
/// it. The partial checkpoint left in the run directory is renamed
/// `memory_usage.partial.json` (a rename needs no free space): it must not
/// pass for the run's result. When no place takes the document, nothing is
/// deleted: the journal stays for `memtrack recover`, and the error says
/// so.
fn save_document(end: &RunEnd<'_>, document: PathBuf) -> FinalFiles {
    let (store, run_dir) = (end.store, end.run_dir);
    let Some(e) = &end.ended.write_error else {
        return FinalFiles {
            document,
            written: true,
            page: None,
        };
    };
    let shown_dir = crate::files::shown(run_dir);
    let mut errors = vec![e.clone()];
    for place in fallback_dirs() {
        match write_fallback(&place, store) {
            Ok(fallback) => {
                tracing::error!(
                    "{} could not be written ({e}); the run's JSON is in {} instead",
                    document.display(),
                    fallback.display()
                );
                supersede_journal(run_dir, &fallback);
                set_aside_checkpoint(&document);
                return FinalFiles {
                    document: fallback,
                    written: true,
                    page: None,
                };
            }
            Err(e) => errors.push(format!("{}: {e}", place.display())),
        }
    }
    tracing::error!(
        "the run's JSON could not be written anywhere: {}",
        errors.join("; ")
    );
    tracing::error!(
        "nothing was deleted: the journal in {}/{} holds what reached the disk; \
         free some space, then run: memtrack recover {}",
        shown_dir.display(),
        journal::DIR,
        crate::export::s3::shell_quote(&absolute(&shown_dir).display().to_string())
    );
    set_aside_checkpoint(&document);
    FinalFiles {
        document,
        written: false,
        page: None,
    }
}

/// The complete document went to `fallback`: the partial journal left in
/// the run directory must never be recovered over it.
fn supersede_journal(run_dir: &Path, fallback: &Path) {
    match journal::supersede(run_dir, fallback) {
        Ok(kept) => tracing::warn!(
            "the journal in {} holds part of the run only: kept as {}, never recovered",
            run_dir.display(),
            kept.display()
        ),
        Err(e) => tracing::error!(
            "the partial journal in {} may be recovered over nothing better: {e}",
            run_dir.display()
        ),
    }
}

/// Where the final document goes when the run directory cannot take it.
fn fallback_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![std::env::temp_dir(), PathBuf::from("/var/tmp")];
    if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        dirs.push(PathBuf::from(home));
    }
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let key = std::fs::canonicalize(d).unwrap_or_else(|_| d.clone());
        let fresh = !seen.contains(&key);
        seen.push(key);
        fresh
    });
    dirs
}

/// Writes the document to a new file in `dir`: `memtrack-<run id>-<random>-memory_usage.json`.
fn write_fallback(dir: &Path, store: &Store) -> std::io::Result<PathBuf> {
    use std::io::Write;
    let path = dir.join(format!(
        "memtrack-{}-{}-{}",
        store.run.id,
        &crate::files::random_id()[..12],
        crate::model::json::FILE_NAME
    ));
    let file = crate::files::create_new(&path)?;
    let written = (|| {
        let mut w = std::io::BufWriter::with_capacity(64 * 1024, &file);
        serde_json::to_writer_pretty(&mut w, &store.document_view())
            .map_err(std::io::Error::other)?;
        w.flush()?;
        drop(w);
        file.sync_data()
    })();
    match written {
        Ok(()) => Ok(path),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e)
        }
    }
}

/// The last checkpoint in the run directory says `running` and holds part
/// of the run: renamed so that nobody takes it for the result.
fn set_aside_checkpoint(document: &Path) {
    let partial = document.with_file_name(PARTIAL_FILE);
    match std::fs::rename(document, &partial) {
        Ok(()) => tracing::warn!(
            "the last checkpoint, which holds part of the run only, is kept as {}",
            partial.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            "{} holds part of the run only (cannot rename it: {e})",
            document.display()
        ),
    }
}
