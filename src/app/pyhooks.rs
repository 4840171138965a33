//! The automatic Python hooks `memtrack run` gives a job: a
//! `sitecustomize.py` on the job's `PYTHONPATH` that adds memtrack's
//! callbacks to Hugging Face and Lightning trainers and reports an
//! uncaught out-of-memory error (see `clients/python/src/memtrack/hooks.py`).
//!
//! The files are compiled into the binary and written, at each run, into
//! a fresh private folder `memtrack-python-<random>` (0700, removed at the
//! end), so an installed binary needs nothing beside it. The folder is
//! made in memtrack's runtime folder (`$XDG_RUNTIME_DIR/memtrack`,
//! `/run/memtrack` for root, else `/tmp/memtrack-<uid>`), checked to be a
//! private place of this user, or, when another user took that name, in a
//! fresh private folder in `/tmp`: the job imports these files by path,
//! so the path must lead only through folders nobody else can rename. Not
//! the temporary directory: in a `TMPDIR` others may write to without the
//! sticky bit, another user could rename the folder and put their own
//! `sitecustomize.py` in its place, run inside the job as its user. Not
//! the run folder either, in an output root others may write to (memtrack
//! itself reaches the run folder through its descriptor, which the job
//! cannot). The Python client goes there too, under `client/`: the hook
//! uses the job's own installed `memtrack` package when it has one, else
//! that copy.
//!
//! Beside each folder is its lock, `memtrack-python-<random>.lock`, held
//! (`flock`) for the run's life. A folder whose lock nobody holds belongs
//! to a memtrack that was killed: the next run, and `memtrack recover`,
//! remove it (and, in the temporary directory, the folders of earlier
//! versions, which made them there without a lock).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// `sitecustomize.py`: installs the hooks, then runs the job's own one.
const SITECUSTOMIZE: &str = include_str!("../../clients/python/hook/sitecustomize.py");

/// The Python client, for a job that has not installed it.
const CLIENT: &[(&str, &str)] = &[
    (
        "__init__.py",
        include_str!("../../clients/python/src/memtrack/__init__.py"),
    ),
    (
        "client.py",
        include_str!("../../clients/python/src/memtrack/client.py"),
    ),
    (
        "frameworks.py",
        include_str!("../../clients/python/src/memtrack/frameworks.py"),
    ),
    (
        "hooks.py",
        include_str!("../../clients/python/src/memtrack/hooks.py"),
    ),
];

/// The variable that switches the hooks off (`0`, `false`, `no`, `off`),
/// read by the job's Python too.
const SWITCH_ENV: &str = "MEMTRACK_AUTO_HOOKS";

/// Prefix of the hook folders' names.
const PREFIX: &str = "memtrack-python-";

/// The hook files' folder and its held lock, both removed when dropped (at
/// the end of the run).
#[derive(Debug)]
pub(super) struct HooksDir {
    dir: PathBuf,
    lock_path: PathBuf,
    _lock: std::fs::File,
}

impl Drop for HooksDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.lock_path);
    }
}

/// Where the hook folders are made: memtrack's runtime folder when it is a
/// private place of this user, else a fresh private folder in `/tmp`.
fn base() -> anyhow::Result<PathBuf> {
    match crate::files::ensure_runtime_dir() {
        Ok(dir) => Ok(dir),
        Err(why) => {
            let fresh = crate::files::fallback_dir()
                .context("cannot make a private folder for the Python hooks")?;
            tracing::warn!(
                "{why}; the Python hooks go into {} instead",
                fresh.display()
            );
            Ok(fresh)
        }
    }
}

/// Writes the hook files into a fresh private folder and returns the job's
/// `PYTHONPATH`: that folder first, then the one memtrack inherited.
/// Folders left by killed runs are removed first.
pub(super) fn job_env() -> anyhow::Result<((String, String), HooksDir)> {
    let base = base()?;
    remove_leftovers_in(&base);
    remove_legacy_in(&std::env::temp_dir());
    job_env_in(&base)
}

fn job_env_in(base: &Path) -> anyhow::Result<((String, String), HooksDir)> {
    let held = make_dir(base).with_context(|| {
        format!(
            "cannot make a folder for the Python hooks in {}",
            base.display()
        )
    })?;
    let dir = held.dir.clone();
    write_files(&dir)
        .with_context(|| format!("cannot write the Python hooks into {}", dir.display()))?;
    let mut path = dir.display().to_string();
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|v| !v.is_empty()) {
        path.push(':');
        path.push_str(&old.to_string_lossy());
    }
    Ok((("PYTHONPATH".to_string(), path), held))
}

/// A fresh `memtrack-python-<random>` folder under `base`, its lock made
/// (`O_EXCL`) and held first: a folder without its lock beside it is never
/// one a live run is making.
fn make_dir(base: &Path) -> std::io::Result<HooksDir> {
    let mut last = std::io::Error::from(std::io::ErrorKind::AlreadyExists);
    for n in 0..64u64 {
        let name = format!("{PREFIX}{:016x}", crate::files::random_word(n));
        let lock_path = base.join(format!("{name}.lock"));
        let lock = match crate::files::create_new(&lock_path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                last = e;
                continue;
            }
            Err(e) => return Err(e),
        };
        if let Err(e) = lock.try_lock() {
            let _ = std::fs::remove_file(&lock_path);
            return Err(std::io::Error::other(e.to_string()));
        }
        let dir = base.join(&name);
        match crate::files::create_dir(&dir) {
            Ok(()) => {
                return Ok(HooksDir {
                    dir,
                    lock_path,
                    _lock: lock,
                })
            }
            Err(e) => {
                let _ = std::fs::remove_file(&lock_path);
                if e.kind() != std::io::ErrorKind::AlreadyExists {
                    return Err(e);
                }
                last = e;
            }
        }
    }
    Err(last)
}

/// Removes the hook folders killed runs left: in memtrack's runtime folder
/// and, from earlier versions, in the temporary directory. How many.
pub fn remove_leftovers() -> usize {
    let mut removed = remove_legacy_in(&std::env::temp_dir());
    let runtime = crate::files::runtime_dir();
    if crate::files::check_private_place(&runtime).is_ok() {
        removed += remove_leftovers_in(&runtime);
    }
    removed
}

/// Removes, in `base`, the hook folders (this user's) whose lock nobody
/// holds, and locks without a folder.
fn remove_leftovers_in(base: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(base) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".lock").filter(|n| n.starts_with(PREFIX)) else {
            continue;
        };
        let lock_path = entry.path();
        let Ok(lock) = crate::files::open_write(&lock_path) else {
            continue;
        };
        if !is_mine(&lock_path) || lock.try_lock().is_err() {
            continue;
        }
        let dir = base.join(stem);
        if is_mine(&dir) {
            let _ = std::fs::remove_dir_all(&dir);
            removed += 1;
        }
        let _ = std::fs::remove_file(&lock_path);
    }
    removed
}

/// Removes, in `base`, hook folders of this user's that have no lock
/// beside them: made by a memtrack before hook folders had locks (which
/// made them in the temporary directory) and left by a killed run.
fn remove_legacy_in(base: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(base) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(PREFIX) || name.ends_with(".lock") {
            continue;
        }
        let dir = entry.path();
        let lock = base.join(format!("{name}.lock"));
        if std::fs::symlink_metadata(&lock).is_err()
            && is_mine(&dir)
            && std::fs::remove_dir_all(&dir).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// Whether `path` is this user's (a folder or file, not a link).
fn is_mine(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .is_ok_and(|m| !m.file_type().is_symlink() && m.uid() == crate::sys::uid())
}

/// Whether the hooks are wanted: the setting, unless the environment's
/// switch says off (then the job's Python sees it too).
pub(super) fn wanted(setting: bool) -> bool {
    let off = std::env::var(SWITCH_ENV).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "no" | "off"
        )
    });
    setting && !off
}

fn write_files(dir: &Path) -> std::io::Result<()> {
    let package: PathBuf = dir.join("client").join("memtrack");
    crate::files::create_dir_all(&package)?;
    write(&dir.join("sitecustomize.py"), SITECUSTOMIZE)?;
    for (name, text) in CLIENT {
        write(&package.join(name), text)?;
    }
    Ok(())
}

fn write(path: &Path, text: &str) -> std::io::Result<()> {
    let mut file = crate::files::create(path, true)?;
    file.write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_hook_and_the_client_first_on_the_path() {
        let run = tempfile::tempdir().unwrap();
        let ((name, value), held) = job_env_in(run.path()).unwrap();
        assert_eq!(name, "PYTHONPATH");
        let first = value.split(':').next().unwrap();
        let dir = Path::new(first);
        assert!(dir.starts_with(run.path()));
        let site = std::fs::read_to_string(dir.join("sitecustomize.py")).unwrap();
        assert!(site.contains("memtrack.hooks"));
        for (file, text) in CLIENT {
            let written = std::fs::read_to_string(dir.join("client/memtrack").join(file)).unwrap();
            assert_eq!(&written, text);
        }
        let mode =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(dir).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o700);
        // A live run's folder is not a leftover.
        assert_eq!(remove_leftovers_in(run.path()), 0);
        assert_eq!(remove_legacy_in(run.path()), 0);
        assert!(dir.is_dir());
        let kept = dir.to_path_buf();
        drop(held);
        assert!(!kept.exists(), "removed at the end of the run");
        assert_eq!(
            std::fs::read_dir(run.path()).unwrap().count(),
            0,
            "lock too"
        );
    }

    #[test]
    fn folders_of_dead_runs_are_removed() {
        let base = tempfile::tempdir().unwrap();
        // A killed run: its folder and an unheld lock.
        let dead = base.path().join(format!("{PREFIX}00000000000000aa"));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("sitecustomize.py"), "").unwrap();
        std::fs::write(
            base.path().join(format!("{PREFIX}00000000000000aa.lock")),
            "",
        )
        .unwrap();
        // An earlier version's folder: no lock.
        let old = base.path().join(format!("{PREFIX}00000000000000bb"));
        std::fs::create_dir(&old).unwrap();
        // Someone else's name.
        std::fs::create_dir(base.path().join("other")).unwrap();
        assert_eq!(remove_leftovers_in(base.path()), 1);
        assert!(!dead.exists());
        assert!(
            old.exists(),
            "only locked folders are taken for this version's"
        );
        assert_eq!(remove_legacy_in(base.path()), 1);
        assert!(!old.exists());
        let left: Vec<_> = std::fs::read_dir(base.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("other")]);
    }
}
