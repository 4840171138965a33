//! The end of a run, once the engine has stopped and the outputs have
//! finished: the closing log line and the exit code. The final document
//! and the report page are an output's (`export::files`), and what goes
//! over the network the others' (`outputs.rs`).

use super::job::own_vm_hwm;
use crate::engine::Ended;
use crate::export::output::FinalFiles;
use crate::model::{AttributionMode, Exit};
use crate::store::Store;

/// The closing line: the run's peaks, where its JSON is, and memtrack's
/// own peak RSS.
pub(super) fn log_end(store: &Store, files: &FinalFiles, export_failed: bool) {
    let (document, written) = (&files.document, files.written);
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
