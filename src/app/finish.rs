//! The end of a run, once the engine has stopped: the final document kept
//! somewhere, what goes over the network (the S3 upload, ClearML's last
//! points) within one deadline, the closing log line, and the exit code.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::io::Io;
use super::job::own_vm_hwm;
use super::run_dir::supersede_journal;
use super::uploads::absolute;
use crate::config::Config;
use crate::engine::Ended;
use crate::export::clearml;
use crate::export::finish::Deadline;
use crate::model::{AttributionMode, Exit, RunInfo};
use crate::store::Store;

/// Where the run's document is, and whether it was written at all.
pub(super) struct Saved {
    pub(crate) document: PathBuf,
    pub(crate) written: bool,
    /// The run's advice as text, for the ClearML task (empty: none, or
    /// no ClearML).
    pub(crate) advice: String,
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
            advice: String::new(),
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
                    advice: String::new(),
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
        advice: String::new(),
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

/// The local file is written; now what goes over the network, unless a
/// second signal asked to stop at once. True when an export failed.
pub(super) fn flush_exports(
    io: &mut Io,
    config: &Config,
    ended: &Ended,
    run: &RunInfo,
    saved: &Saved,
    run_dir: &Path,
) -> bool {
    let clearml = io.clearml.take();
    if ended.urgent {
        stop_at_once(io, clearml, ended, &saved.document, run_dir);
        false
    } else {
        flush_within_deadline(io, clearml, config, ended, run, saved, run_dir)
    }
}

/// A second signal: no upload, and ClearML's unsent points go to the
/// spool file without waiting on the network.
fn stop_at_once(
    io: &Io,
    clearml: Option<clearml::Reporter>,
    ended: &Ended,
    document: &Path,
    run_dir: &Path,
) {
    if let Some(s3) = &io.s3 {
        tracing::warn!(
            "stopping at once: the upload was skipped; to upload it later, run: {}",
            s3.retry_command(&absolute(document))
        );
    }
    if let Some(reporter) = clearml {
        // No network wait: what is not sent yet goes to the spool file.
        let end = clearml::RunEnd {
            exit: ended.job_exit,
            artifact: None,
            page: None,
        };
        let report = io.runtime.block_on(reporter.finish(end, Duration::ZERO));
        if report.unsent > 0 {
            tracing::warn!(
                "stopping at once: {} points not yet sent to ClearML stay in {}; \
                 to send them, run: memtrack clearml-resend {}",
                report.unsent,
                run_dir.join(clearml::SPOOL_FILE).display(),
                absolute(run_dir).display()
            );
        }
    }
}

/// The final upload and ClearML's last points, sharing one deadline.
/// True when an export failed.
fn flush_within_deadline(
    io: &mut Io,
    clearml: Option<clearml::Reporter>,
    config: &Config,
    ended: &Ended,
    run: &RunInfo,
    saved: &Saved,
    run_dir: &Path,
) -> bool {
    let mut export_failed = false;
    // Everything from here on shares one deadline.
    let deadline = Deadline::start(config.finish_timeout);
    let mut task = settled_task(io, clearml.as_ref(), config, &deadline);
    io.stop_checkpoint_uploads(&deadline);
    let uploaded = if saved.written {
        io.upload(&saved.document, run, task.clone(), &deadline)
    } else {
        None
    };
    let mut upload_failed = matches!(uploaded, Some(Err(_)));
    export_failed |= upload_failed;
    // The report page beside the document's object (a failure is a
    // warning: the page is a convenience).
    let page = match (&uploaded, &saved.page) {
        (Some(Ok(_)), Some(page)) => io.upload_page(page, run, task.clone(), &deadline),
        _ => None,
    };
    if let Some(reporter) = clearml {
        let mut artifact = s3_artifact(uploaded);
        let page = s3_artifact(page.map(Ok));
        if artifact.is_none() && saved.written {
            // Where the job's task keeps its artifacts (no S3 of memtrack's).
            artifact = io.upload_to_files(
                &reporter,
                &saved.document,
                (run, run_dir),
                &deadline,
                &mut upload_failed,
            );
        }
        let (failed, reported) =
            finish_clearml(io, reporter, config, ended, (artifact, page), &deadline);
        export_failed |= failed;
        if task.is_none() {
            task.clone_from(&reported);
        }
        if let (Some(task), false) = (reported, saved.advice.is_empty()) {
            advise_task(io, config, &task.id, &run.id, &saved.advice, &deadline);
        }
    }
    // A failed upload keeps the task noted, so that `memtrack upload`
    // later puts the file under the task's key too.
    if let (true, Some(task)) = (upload_failed, &task) {
        clearml::note_task(run_dir, task, false);
    }
    export_failed
}

/// The key follows ClearML's layout when the task is known: give a
/// task still being created a moment.
fn settled_task(
    io: &Io,
    clearml: Option<&clearml::Reporter>,
    config: &Config,
    deadline: &Deadline,
) -> Option<clearml::TaskRef> {
    match clearml {
        // The key or the path follows the task: wait for it when the
        // document goes to S3 or where ClearML keeps the task's artifacts.
        Some(reporter) if io.s3.is_some() || reporter.outputs().is_some() => {
            let wait = config
                .clearml
                .final_flush_timeout
                .min(Duration::from_secs(10))
                .min(deadline.remaining());
            io.runtime.block_on(
                deadline.announce("the ClearML task to be created", reporter.settle(wait)),
            )
        }
        _ => None,
    }
}

/// The S3 upload as the artifact to register.
fn s3_artifact(
    uploaded: Option<Result<crate::export::s3::Uploaded, crate::export::s3::S3Error>>,
) -> Option<clearml::Artifact> {
    match uploaded {
        Some(Ok(u)) => Some(clearml::Artifact {
            uri: u.uri,
            size: u.size,
            sha256: u.sha256,
        }),
        _ => None,
    }
}

/// Puts the run's advice on its ClearML task (its description); a
/// failure costs only that, and is logged.
fn advise_task(
    io: &Io,
    config: &Config,
    task: &str,
    run_id: &str,
    advice: &str,
    deadline: &Deadline,
) {
    let Ok(Ok(settings)) = super::io::clearml_settings(config) else {
        return;
    };
    let work = clearml::advice::describe(&settings, task, run_id, advice);
    match io
        .runtime
        .block_on(deadline.bound("the advice on the ClearML task", work))
    {
        Some(Ok(())) => tracing::debug!("ClearML: the advice is on task {task}"),
        Some(Err(e)) => tracing::warn!("ClearML: the advice could not be put on the task: {e}"),
        None => tracing::warn!("ClearML: no time was left to put the advice on task {task}"),
    }
}

/// Ends the ClearML reporting with the job's exit and the uploaded
/// document (and report page) as its artifacts. True when something was
/// lost or left unsent; the task reported into.
fn finish_clearml(
    io: &Io,
    reporter: clearml::Reporter,
    config: &Config,
    ended: &Ended,
    (artifact, page): (Option<clearml::Artifact>, Option<clearml::Artifact>),
    deadline: &Deadline,
) -> (bool, Option<clearml::TaskRef>) {
    let end = clearml::RunEnd {
        exit: ended.job_exit,
        artifact,
        page,
    };
    // What the deadline leaves; points not sent by then stay in the
    // spool, and the log says how to send them.
    let wait = config.clearml.final_flush_timeout.min(deadline.remaining());
    let report = io
        .runtime
        .block_on(deadline.announce("ClearML's last points", reporter.finish(end, wait)));
    (log_clearml(&report), report.task)
}

/// Logs what the ClearML reporter achieved; true when something was lost
/// or left unsent.
fn log_clearml(report: &clearml::FinishReport) -> bool {
    if let Some(why) = &report.stood_down {
        tracing::debug!("ClearML: nothing reported: {why}");
        return false;
    }
    let task = report
        .task
        .as_ref()
        .map_or_else(|| "no task".to_string(), |t| format!("task {}", t.id));
    let failed = report.unsent > 0 || report.refused > 0 || report.task.is_none();
    if failed {
        tracing::error!(
            "ClearML ({task}): {} points sent, {} unsent{}, {} refused; {}",
            report.sent,
            report.unsent,
            report
                .spool
                .as_ref()
                .map(|p| format!(
                    " (kept in {}; `memtrack clearml-resend {}` sends them)",
                    p.display(),
                    p.parent().unwrap_or(Path::new(".")).display()
                ))
                .unwrap_or_default(),
            report.refused,
            report.errors.join("; ")
        );
    } else {
        tracing::info!(
            "ClearML ({task}): {} points sent{}{}",
            report.sent,
            if report.artifact_registered {
                ", artifact registered"
            } else {
                ""
            },
            report
                .final_status
                .as_ref()
                .map(|s| format!(", task {s}"))
                .unwrap_or_default()
        );
    }
    failed
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
        peaks.cpu_ram_used_mb,
        peaks.cpu_ram_used_mb.max(peaks.cpu_ram_hwm_mb),
        peaks.gpu_process_used_mb.max(peaks.reserved_gpu_ram_mb),
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
