//! The automatic Python hooks `memtrack run` gives a job: a
//! `sitecustomize.py` on the job's `PYTHONPATH` that adds memtrack's
//! callbacks to Hugging Face and Lightning trainers and reports an
//! uncaught out-of-memory error (see `clients/python/src/memtrack/hooks.py`).
//!
//! The files are compiled into the binary and written, at each run, into
//! a fresh private folder in the temporary directory (`memtrack-python-*`,
//! 0700, a random name; removed at the end), so an installed binary needs
//! nothing beside it. Not into the run folder: the job imports these files
//! by path, and in an output root others may write to, a path into the
//! run folder could be swapped for one leading to someone else's code
//! (memtrack itself reaches the run folder through its descriptor, which
//! the job cannot). The Python client goes there too, under `client/`:
//! the hook uses the job's own installed `memtrack` package when it has
//! one, else that copy.

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

/// The hook files' folder, removed when dropped (at the end of the run).
#[derive(Debug)]
pub(super) struct HooksDir(PathBuf);

impl Drop for HooksDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes the hook files into a fresh private folder under `base` and
/// returns the job's `PYTHONPATH`: that folder first, then the one memtrack
/// inherited.
pub(super) fn job_env(base: &Path) -> anyhow::Result<((String, String), HooksDir)> {
    let dir = crate::files::create_temp_dir(base, "memtrack-python").with_context(|| {
        format!(
            "cannot make a folder for the Python hooks in {}",
            base.display()
        )
    })?;
    let held = HooksDir(dir.clone());
    write_files(&dir)
        .with_context(|| format!("cannot write the Python hooks into {}", dir.display()))?;
    let mut path = dir.display().to_string();
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|v| !v.is_empty()) {
        path.push(':');
        path.push_str(&old.to_string_lossy());
    }
    Ok((("PYTHONPATH".to_string(), path), held))
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
        let ((name, value), held) = job_env(run.path()).unwrap();
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
        let kept = dir.to_path_buf();
        drop(held);
        assert!(!kept.exists(), "removed at the end of the run");
    }
}
