//! Where other programs find a live run.
//!
//! - `memtrack ls` and `--run NAME`: every run writes one record (name,
//!   pid, event socket, metrics address, run directory) into the runs
//!   folder of this user, `<runtime>/runs/memtrack-<pid>.json`, at its start
//!   and removes it at its end. Readers look in every runtime folder a run
//!   of this user may have used (a service's `XDG_RUNTIME_DIR` is not a
//!   login shell's). A record whose memtrack died is skipped and removed by
//!   the next reader.
//! - Prometheus: a run serving `/metrics` writes a file-based
//!   service-discovery file (`file_sd_configs`) into the discovery folder,
//!   `<runtime>/sd/memtrack-<pid>.json` unless `discovery.sd_dir` says
//!   otherwise: its address with the labels `run`, `host` (and `rank`),
//!   removed at the end. The file is readable by all (0644) so that a
//!   Prometheus running as another user can read it.
//!
//! `<runtime>` is `$XDG_RUNTIME_DIR/memtrack`, else `/run/memtrack` for
//! root, else `/tmp/memtrack-<uid>` (the socket's folder). It is trusted
//! only as a private place of this user (`files::check_private_place`):
//! this user's, writable by no one else, in folders nobody else can swap
//! it in. A runtime folder another user made first is neither read nor
//! written; the run goes on unlisted, with a warning.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::files;
use crate::model::RunInfo;

/// One live run, as `memtrack ls` prints it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveRun {
    /// The run's name (its `run` label on every metric).
    pub name: String,
    /// memtrack's process id.
    pub pid: u32,
    /// The event socket `status`, `watch`, `mark` and `cleanup` talk to.
    pub socket: Option<PathBuf>,
    /// Where `/metrics` is served.
    pub metrics: Option<SocketAddr>,
    /// The run directory.
    pub dir: PathBuf,
    /// Unix time of the start.
    pub start: f64,
    /// The Prometheus discovery file written for the run.
    #[serde(default)]
    pub sd_file: Option<PathBuf>,
}

/// The folder of run records.
pub(crate) fn runs_dir() -> PathBuf {
    files::runtime_dir().join("runs")
}

/// Every runs folder a run of this user may have written to, this
/// shell's first: its runtime folder is set by `XDG_RUNTIME_DIR`, which
/// differs between a login shell (`/run/user/<uid>`), a service
/// (`memtrack-run@`: `/run/memtrack-<instance>`), root and a user without
/// one (`/tmp/memtrack-<uid>`), so `ls` and `--run` look in each.
fn runs_dirs() -> Vec<PathBuf> {
    let uid = crate::sys::uid();
    let mut places = vec![
        files::runtime_dir(),
        PathBuf::from(format!("/run/user/{uid}/memtrack")),
        PathBuf::from(format!("/tmp/memtrack-{uid}")),
    ];
    if uid == 0 {
        places.push(PathBuf::from("/run/memtrack"));
    }
    // The services' runtime folders, `/run/memtrack-<instance>/memtrack`.
    if let Ok(entries) = std::fs::read_dir("/run") {
        let mut services: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("memtrack-"))
            .map(|e| e.path().join("memtrack"))
            .collect();
        services.sort();
        services.truncate(MAX_SERVICE_PLACES);
        places.extend(services);
    }
    let mut seen = std::collections::HashSet::new();
    places
        .into_iter()
        .map(|p| p.join("runs"))
        .filter(|p| seen.insert(p.clone()))
        .collect()
}

/// Service runtime folders looked in, at most.
const MAX_SERVICE_PLACES: usize = 256;

/// The default folder of Prometheus discovery files.
pub(crate) fn default_sd_dir() -> PathBuf {
    files::runtime_dir().join("sd")
}

/// Creates `dir` (and its parents) with `mode` where missing, then checks
/// it is a folder memtrack may write into.
fn ensure_dir(dir: &Path, mode: u32) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)?;
    files::check_dir(dir)
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that
/// a reader (Prometheus watches the folder) never sees half a file.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let (tmp, mut f) = files::create_temp(path)?;
    let written = f
        .write_all(bytes)
        .and_then(|()| f.set_permissions(std::fs::Permissions::from_mode(mode)))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// The records of live runs, oldest first; records of dead runs (and their
/// discovery files) are removed on the way. Only a runs folder that is a
/// private place of this user is read (`files::check_private_place`),
/// and only records this user owns: another user who made the folder first
/// (or can write to the folder above it) could otherwise list a spoofed
/// run, point `mark --run` at their socket, or have a file deleted as a
/// dead run's discovery file.
pub fn live_runs() -> Vec<LiveRun> {
    let mut runs = Vec::new();
    for (i, dir) in runs_dirs().iter().enumerate() {
        if std::fs::symlink_metadata(dir).is_err() {
            continue;
        }
        if let Err(e) = files::check_private_place(dir) {
            // Said for this shell's own folder; another user's service
            // folder is simply not this user's.
            if i == 0 {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    crate::logging::say(&format!(
                        "memtrack: warning: the run records are not read: {e}"
                    ))
                });
            }
            continue;
        }
        read_runs(dir, &mut runs);
    }
    runs.sort_by(|a, b| a.start.total_cmp(&b.start).then(a.pid.cmp(&b.pid)));
    runs.dedup_by(|a, b| a.pid == b.pid && a.start == b.start);
    runs
}

/// The live runs recorded in `dir`, a private place of this user.
fn read_runs(dir: &Path, runs: &mut Vec<LiveRun>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Some(run) = read_record(&path) else {
            continue;
        };
        if crate::sys::pid_exists(run.pid) {
            runs.push(run);
        } else {
            if let Some(sd) = &run.sd_file {
                remove_sd_file(sd, run.pid);
            }
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// A run record, if it is a regular file of this user's (bounded: the
/// folder may hold anything).
fn read_record(path: &Path) -> Option<LiveRun> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let file = files::open_input(path).ok()?;
    if file.metadata().ok()?.uid() != crate::sys::uid() {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(RECORD_MAX + 1).read_to_end(&mut bytes).ok()?;
    if bytes.len() as u64 > RECORD_MAX {
        return None;
    }
    serde_json::from_slice(&bytes).ok()
}

/// The largest run record read.
const RECORD_MAX: u64 = 64 * 1024;

/// Removes a dead run's discovery file — only a file of this user's that
/// has the name memtrack gives it (`memtrack-<pid>.json`), never another
/// file a record names.
fn remove_sd_file(sd: &Path, pid: u32) {
    use std::os::unix::fs::MetadataExt;
    let name = format!("memtrack-{pid}.json");
    if sd.file_name() != Some(std::ffi::OsStr::new(&name)) {
        return;
    }
    let ours =
        std::fs::symlink_metadata(sd).is_ok_and(|m| m.is_file() && m.uid() == crate::sys::uid());
    if ours {
        let _ = std::fs::remove_file(sd);
    }
}

/// The runs as a table: name, pid, age, metrics address, socket.
pub fn format_runs(runs: &[LiveRun], now: f64) -> String {
    if runs.is_empty() {
        return "no live memtrack run for this user on this machine\n".into();
    }
    let rows: Vec<[String; 5]> = runs
        .iter()
        .map(|r| {
            // Names come from the job's command line and labels: shown,
            // never obeyed by the terminal.
            let shown = |s: &str| crate::report::text::escape_controls(s, false).into_owned();
            [
                shown(&r.name),
                r.pid.to_string(),
                crate::units::duration_one_unit((now - r.start).max(0.0)),
                r.metrics
                    .map_or("-".into(), |a| format!("http://{a}/metrics")),
                r.socket
                    .as_ref()
                    .map_or("-".into(), |p| shown(&p.display().to_string())),
            ]
        })
        .collect();
    let head = ["NAME", "PID", "RUNNING", "METRICS", "SOCKET"];
    let mut widths = head.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 5]| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.push('\n');
        out
    };
    let mut text = line(head);
    for row in &rows {
        text.push_str(&line([
            row[0].as_str(),
            row[1].as_str(),
            row[2].as_str(),
            row[3].as_str(),
            row[4].as_str(),
        ]));
    }
    text
}

/// The live run `wanted` names: its name, or memtrack's pid.
pub fn find_run(wanted: &str) -> anyhow::Result<LiveRun> {
    let runs = live_runs();
    let named: Vec<&LiveRun> = runs.iter().filter(|r| r.name == wanted).collect();
    match named.as_slice() {
        [one] => return Ok((*one).clone()),
        [] => {}
        several => anyhow::bail!(
            "{} live runs are named `{wanted}` (memtrack pids {}); pass --run PID",
            several.len(),
            several
                .iter()
                .map(|r| r.pid.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
    if let Some(run) = runs.iter().find(|r| r.pid.to_string() == wanted) {
        return Ok(run.clone());
    }
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    anyhow::bail!(
        "no live run named `{wanted}` on this machine for this user ({}; `memtrack ls` lists them)",
        if names.is_empty() {
            "none is running".to_string()
        } else {
            format!("running: {}", names.join(", "))
        }
    )
}

/// A run's record and discovery file, removed when dropped.
#[derive(Debug)]
pub(super) struct Registration {
    record: Option<PathBuf>,
    sd_file: Option<PathBuf>,
}

impl Registration {
    /// Writes the run's record and, when it serves metrics and discovery
    /// is not `off`, its discovery file. Neither can fail the run: a
    /// problem is warned about.
    pub(super) fn register(
        run: &RunInfo,
        run_dir: &Path,
        socket: Option<&Path>,
        metrics: Option<SocketAddr>,
        sd_dir: &Path,
    ) -> Registration {
        let pid = std::process::id();
        let file_name = format!("memtrack-{pid}.json");
        // A runtime folder another user made (or can swap) is not written
        // into: no record, and no discovery file in its default place.
        let runtime = ensure_runtime_dir();
        let said = runtime.is_err();
        if let Err(e) = &runtime {
            tracing::warn!("`memtrack ls` will not list this run: {e:#}");
        }
        // Records of runs that died unannounced go first.
        if !said {
            let _ = live_runs();
        }
        let sd_file = match metrics {
            Some(_) if sd_dir.as_os_str().is_empty() && runtime.is_err() => None,
            Some(addr) if sd_dir.as_os_str() != "off" => {
                let dir = if sd_dir.as_os_str().is_empty() {
                    default_sd_dir()
                } else {
                    sd_dir.to_path_buf()
                };
                match write_sd_file(&dir.join(&file_name), run, addr) {
                    Ok(path) => Some(path),
                    Err(e) => {
                        tracing::warn!("no Prometheus discovery file in {}: {e:#}", dir.display());
                        None
                    }
                }
            }
            _ => None,
        };
        let live = LiveRun {
            name: run.name.clone(),
            pid,
            socket: socket.map(Path::to_path_buf),
            metrics,
            // The folder's name, not the descriptor path memtrack reaches
            // it through (which means nothing to another process).
            dir: {
                let shown = crate::files::shown(run_dir);
                std::path::absolute(&shown).unwrap_or(shown)
            },
            start: run.start,
            sd_file: sd_file.clone(),
        };
        let record = match runtime.and_then(|()| write_record(&runs_dir().join(&file_name), &live))
        {
            Ok(path) => Some(path),
            // Said above when the runtime folder itself was refused.
            Err(e) if !said => {
                tracing::warn!("`memtrack ls` will not list this run: {e:#}");
                None
            }
            Err(_) => None,
        };
        Registration { record, sd_file }
    }

    /// Where the discovery file went, if one was written.
    pub(super) fn sd_file(&self) -> Option<&Path> {
        self.sd_file.as_deref()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        for path in [self.sd_file.take(), self.record.take()]
            .into_iter()
            .flatten()
        {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Creates the runtime folder (see [`files::ensure_runtime_dir`]).
fn ensure_runtime_dir() -> anyhow::Result<()> {
    let dir = files::runtime_dir().display().to_string();
    files::ensure_runtime_dir().map(drop).map_err(|e| {
        // A refusal names the folder already; an error of mkdir does not.
        if e.to_string().contains(&dir) {
            anyhow::Error::new(e)
        } else {
            anyhow::Error::new(e).context(dir)
        }
    })
}

fn write_record(path: &Path, live: &LiveRun) -> anyhow::Result<PathBuf> {
    let dir = runs_dir();
    ensure_dir(&dir, 0o700)
        .and_then(|()| files::check_private_place(&dir))
        .with_context(|| dir.display().to_string())?;
    write_atomic(path, &serde_json::to_vec_pretty(live)?, files::FILE_MODE)
        .with_context(|| path.display().to_string())?;
    Ok(path.to_path_buf())
}

/// The discovery file's content: one target group, Prometheus'
/// `file_sd_configs` format.
fn sd_json(run: &RunInfo, addr: SocketAddr) -> serde_json::Value {
    let mut labels = serde_json::Map::new();
    labels.insert("run".into(), run.name.clone().into());
    if !run.host.is_empty() {
        labels.insert("host".into(), run.host.clone().into());
    }
    if let Some(rank) = run.labels.get("rank") {
        labels.insert("rank".into(), rank.clone().into());
    }
    serde_json::json!([{ "targets": [addr.to_string()], "labels": labels }])
}

fn write_sd_file(path: &Path, run: &RunInfo, addr: SocketAddr) -> anyhow::Result<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    ensure_dir(dir, 0o755)
        .and_then(|()| files::check_private_place(dir))
        .with_context(|| dir.display().to_string())?;
    let text = serde_json::to_vec_pretty(&sd_json(run, addr))?;
    write_atomic(path, &text, 0o644).with_context(|| path.display().to_string())?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_names_without_obeying_them() {
        let run = LiveRun {
            name: "a\u{1b}[2Jb".into(),
            pid: 42,
            socket: Some("/tmp/m.sock".into()),
            metrics: Some("127.0.0.1:9465".parse().unwrap()),
            dir: "/out/a".into(),
            start: 100.0,
            sd_file: None,
        };
        let text = format_runs(&[run], 130.0);
        assert!(!text.contains('\u{1b}'), "{text}");
        assert!(text.contains("42") && text.contains("30 s"), "{text}");
        assert!(text.contains("http://127.0.0.1:9465/metrics"), "{text}");
    }

    #[test]
    fn sd_file_is_a_target_group_with_the_run_label() {
        let mut run = RunInfo {
            name: "bs128".into(),
            host: "node-1".into(),
            ..RunInfo::default()
        };
        run.labels.insert("rank".into(), "3".into());
        let v = sd_json(&run, "127.0.0.1:9465".parse().unwrap());
        assert_eq!(
            v,
            serde_json::json!([{
                "targets": ["127.0.0.1:9465"],
                "labels": {"run": "bs128", "host": "node-1", "rank": "3"}
            }])
        );
    }
}
