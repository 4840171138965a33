//! The end of a run, once the engine has stopped: the final document kept
//! somewhere, the report page beside it, the closing log line, and the
//! exit code. What goes over the network is the outputs' (`outputs.rs`).

use std::path::{Path, PathBuf};

use super::job::own_vm_hwm;
use super::run_dir::supersede_journal;
use crate::engine::Ended;
use crate::export::output::{absolute, RunEnd};
use crate::model::{AttributionMode, Exit};
use crate::store::Store;

/// Where the run's document is, and whether it was written at all.
pub(super) struct Saved {
    pub(crate) document: PathBuf,
    pub(crate) written: bool,
    /// The report page written beside the document (`html_report`).
    pub(crate) page: Option<PathBuf>,
}

/// Writes the run's report page beside its document in the run
/// directory. The page is a convenience: a failure is a warning, never
/// the run's failure; a document that had to go elsewhere (a full disk)
/// gets no page, so no fixed name is written into a shared folder.
pub(super) fn write_page(saved: &Saved, store: &Store, run_dir: &Path) -> Option<PathBuf> {
    if !saved.written {
        return None;
    }
    if saved.document.parent() != Some(run_dir) {
        tracing::warn!(
            "the report page was not written: the run's JSON is not in {} \
             (`memtrack report --html {}` writes it later)",
            run_dir.display(),
            saved.document.display()
        );
        return None;
    }
    let out = crate::report::html::beside(&saved.document);
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
                saved.document.display()
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
pub(super) fn save_document(
    ended: &Ended,
    store: &Store,
    document: PathBuf,
    run_dir: &Path,
) -> Saved {
    let Some(e) = &ended.write_error else {
        return Saved {
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
                return Saved {
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
        crate::store::journal::DIR,
        crate::export::s3::shell_quote(&absolute(&shown_dir).display().to_string())
    );
    set_aside_checkpoint(&document);
    Saved {
        document,
        written: false,
        page: None,
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
        &super::naming::random_id()[..12],
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

/// What the last checkpoint is renamed to when the final document could not
/// be written in the run directory.
pub(crate) const PARTIAL_FILE: &str = "memory_usage.partial.json";

/// What the outputs end the run with.
pub(super) fn run_end<'a>(
    runtime: &'a tokio::runtime::Runtime,
    (ended, store): (&'a Ended, &'a Store),
    run_dir: &'a Path,
    saved: &'a Saved,
    job_failed: bool,
) -> RunEnd<'a> {
    RunEnd {
        runtime,
        ended,
        store,
        run_dir,
        document: &saved.document,
        written: saved.written,
        page: saved.page.as_deref(),
        job_failed,
    }
}

/// The closing line: the run's peaks, where its JSON is, and memtrack's
/// own peak RSS.
pub(super) fn log_end(store: &Store, saved: &Saved, export_failed: bool) {
    let (document, written) = (&saved.document, saved.written);
    let peaks = store.peaks();
    // memtrack's own high-water mark, the final write included: what the
    // monitor itself cost the machine (bench/soak reads this line).
    let own_peak = crate::units::mib(own_vm_hwm());
    let whose = match store.gpu_attribution().map(|a| a.mode) {
        Some(AttributionMode::DeviceLevel) => " (device-level: every process on the job's GPUs)",
        Some(AttributionMode::Mixed) => " (partly device-level: every process on the job's GPUs)",
        _ => "",
    };
    tracing::info!(
        "run {} ended: peak host RAM {:.1} MiB sampled, {:.1} MiB between samples; peak GPU {:.1} MiB{whose}; {}; memtrack's own peak RSS {own_peak:.1} MiB",
        store.run.name,
        peaks.figures.cpu_ram_used_mb,
        peaks.figures.cpu_ram_used_mb.max(peaks.figures.cpu_ram_hwm_mb),
        peaks.figures.gpu_process_used_mb.max(peaks.figures.reserved_gpu_ram_mb),
        match (written, export_failed) {
            (true, false) => format!("wrote {}", document.display()),
            (true, true) => format!("wrote {}; an export failed (see above)", document.display()),
            (false, _) => "the JSON could not be written (see above)".to_string(),
        }
    );
}

/// `run` exits as its job did. `attach` ends normally on a signal; a
/// `run` stopped before its job ended reports the signal, as a shell would.
/// An export failure never hides the job's status; in `attach` mode it
/// is the status.
pub(super) fn exit_code(
    ended: &Ended,
    first_signal: Option<i32>,
    is_run: bool,
    export_failed: bool,
) -> i32 {
    match (ended.job_exit, first_signal) {
        (Some(exit), _) => exit.code,
        (None, Some(sig)) if is_run => Exit::signal(sig).code,
        (None, _) if ended.write_error.is_some() || export_failed => 1,
        (None, _) => 0,
    }
}
