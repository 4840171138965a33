//! The run directory: creating or claiming it, recovering what killed
//! runs left under the same output root, removing what a run that failed
//! to start created, and setting aside a journal the final document
//! outgrew.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::files::HeldDir;
use crate::store::journal;

/// Creates the run directory, private to this user (0700). A chosen name
/// is used as is, if it is free or this user's own folder; an automatic one
/// gets `-2`, `-3`… when taken. Runs left behind by a killed memtrack under
/// the same output root are recovered first.
pub(crate) fn prepare_run_dir(
    output: &Path,
    name: &str,
    explicit: bool,
) -> anyhow::Result<PathBuf> {
    crate::files::check_links(output)
        .with_context(|| format!("cannot use output directory {}", output.display()))?;
    crate::files::create_dir_all(output)
        .with_context(|| format!("cannot create output directory {}", output.display()))?;
    recover_leftovers(output);
    let mut dir = output.join(name);
    if explicit {
        if let Some(parent) = dir.parent() {
            crate::files::create_dir_all(parent)
                .with_context(|| format!("cannot create run directory {}", dir.display()))?;
        }
        crate::files::private_dir(&dir)
            .with_context(|| format!("cannot use run directory {}", dir.display()))?;
        return Ok(dir);
    }
    // Created, not found: a folder someone else made under the name is
    // skipped like any taken name.
    let mut n = 2;
    loop {
        match crate::files::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 10_000 => {
                dir = output.join(format!("{name}-{n}"));
                n += 1;
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("cannot create run directory {}", dir.display()))
            }
        }
    }
}

/// Rebuilds `memory_usage.json` of runs whose daemon died. Live runs (lock
/// held) are left alone.
pub(crate) fn recover_leftovers(output: &Path) {
    let Ok(entries) = std::fs::read_dir(output) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        // Another user's folder (a shared output root) is theirs to recover.
        if !crate::files::owned_by_me(&dir) || !journal::has_journal(&dir) {
            continue;
        }
        // Held open: a folder swapped for a link meanwhile is not followed.
        let Ok(held) = HeldDir::open(&dir) else {
            continue;
        };
        match journal::recover(held.path()) {
            Ok(r) => {
                tracing::info!(
                    "recovered the run in {} left by a memtrack that did not finish ({} journalled records replayed)",
                    dir.display(),
                    r.replayed
                );
                if let Some(kept) = &r.kept {
                    tracing::warn!(
                        "the recovered run in {} lacks part of what it recorded ({} log entries \
                         and {} journal records lost, counted in its JSON); its crash-safety \
                         files are kept in {}",
                        dir.display(),
                        r.lost.lost_entries.max(r.entries_missing),
                        r.records_lost,
                        kept.display()
                    );
                }
            }
            Err(journal::JournalError::Locked(_)) => {}
            Err(e) => tracing::warn!("cannot recover {}: {e}", dir.display()),
        }
    }
}

/// Removes what a run created when it fails before its engine starts, so
/// a job that cannot start leaves no half-written run behind.
pub(super) struct Cleanup<'a> {
    dir: &'a HeldDir,
    existed: bool,
    /// Whether `.memtrack/` was already there: then it belongs to another
    /// memtrack (a live run holding the lock, or a dead one's journal
    /// waiting for recovery) and is never removed.
    journal_existed: bool,
    armed: bool,
}

impl Cleanup<'_> {
    pub fn new(dir: &HeldDir) -> Cleanup<'_> {
        // prepare_run_dir has just created it unless a chosen name reused it.
        let existed = std::fs::read_dir(dir.path())
            .map(|mut d| d.next().is_some())
            .unwrap_or(true);
        Cleanup {
            dir,
            existed,
            journal_existed: dir.path().join(journal::DIR).exists(),
            armed: true,
        }
    }

    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if !self.journal_existed {
            let _ = std::fs::remove_dir_all(self.dir.path().join(journal::DIR));
        }
        // Only the folder memtrack made, not what took its name since.
        if !self.existed && self.dir.is_at(self.dir.shown()) {
            let _ = std::fs::remove_dir(self.dir.shown());
        }
    }
}
