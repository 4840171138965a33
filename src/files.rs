//! Creating the files and folders memtrack writes so that nobody else can
//! redirect, pre-plant or read them.
//!
//! Output roots are often shared (`/shared/outputs`, a scratch folder every
//! user can write to) and memtrack may run as root, so a name another user
//! planted must never decide where memtrack writes:
//!
//! - every file is opened without following a symbolic link at its last
//!   component (`O_NOFOLLOW`);
//! - a temporary file gets a fresh name and is created only if that name is
//!   free (`O_EXCL`);
//! - files go only into folders memtrack created, or checked: a real folder
//!   (not a link), owned by this user, writable by nobody else;
//! - what memtrack creates is private to its user (files 0600, folders
//!   0700): it holds command lines and labels taken from the environment;
//! - a run directory is held open ([`HeldDir`]) once created and checked,
//!   and everything in it is reached through that descriptor: in an
//!   output root others may write to (no sticky bit), another user can
//!   rename the folder and plant a link under its name, and a path would
//!   follow the link.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The mode of every file memtrack creates.
pub const FILE_MODE: u32 = 0o600;
/// The mode of every folder memtrack creates.
pub const DIR_MODE: u32 = 0o700;

/// Open options for memtrack's files: created 0600, never through a link.
pub fn options() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    o
}

/// Opens `path` for writing, creating it if missing; `truncate` empties it.
pub fn create(path: &Path, truncate: bool) -> io::Result<File> {
    options()
        .write(true)
        .create(true)
        .truncate(truncate)
        .open(path)
}

/// Creates `path`, which must not exist yet: a name someone planted (a
/// file or a link) is an error, not a target.
pub fn create_new(path: &Path) -> io::Result<File> {
    options().write(true).create_new(true).open(path)
}

/// Opens an existing file for writing.
pub fn open_write(path: &Path) -> io::Result<File> {
    options().write(true).open(path)
}

/// A new temporary file beside `path` (`.NAME.tmp-PID-N-R`), for a write
/// that ends with a rename onto `path`. The name is unique in this process
/// and hard to guess from outside; one that exists anyway is skipped.
pub fn create_temp(path: &Path) -> io::Result<(PathBuf, File)> {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
    for _ in 0..16 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = dir.join(format!(
            ".{name}.tmp-{}-{}-{nanos:08x}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        ));
        match create_new(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Creates the folder `path` (0700); an existing one is an error.
pub fn create_dir(path: &Path) -> io::Result<()> {
    DirBuilder::new().mode(DIR_MODE).create(path)
}

/// Creates every missing folder of `path` (0700 each); existing ones are
/// left as they are.
pub fn create_dir_all(path: &Path) -> io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Creates the folder `path` (0700), or checks an existing one with
/// [`check_dir`].
pub fn private_dir(path: &Path) -> io::Result<()> {
    match create_dir(path) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => check_dir(path),
        other => other,
    }
}

/// Whether memtrack may write into the folder `path`: a real folder (not a
/// link), owned by this user, writable by no one else.
pub fn check_dir(path: &Path) -> io::Result<()> {
    check_meta(path, &std::fs::symlink_metadata(path)?)
}

fn check_meta(path: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    let refuse = |why: String| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} {why}; memtrack writes only into its own folders",
                path.display()
            ),
        ))
    };
    if meta.file_type().is_symlink() {
        return refuse("is a symbolic link".into());
    }
    if !meta.is_dir() {
        return refuse("is not a folder".into());
    }
    let me = crate::sys::uid();
    if meta.uid() != me {
        return refuse(format!(
            "belongs to uid {}, not to this user (uid {me})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "is writable by other users (mode {:o})",
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Whether `path` is a real folder (not a link) owned by this user.
pub fn owned_by_me(path: &Path) -> bool {
    std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.is_dir() && !m.file_type().is_symlink() && m.uid() == crate::sys::uid())
}

/// A folder held by an open descriptor. [`HeldDir::path`] is
/// `/proc/self/fd/N`: the kernel resolves it to the folder the descriptor
/// holds, wherever it has been moved since and whatever now has its old
/// name, so every file reached through it is in that folder. Messages
/// show the folder's name instead ([`shown`]).
#[derive(Debug)]
pub struct HeldDir {
    dir: File,
    via: PathBuf,
    shown: PathBuf,
}

impl HeldDir {
    /// Opens the folder `path` — not through a link at its last
    /// component, and only if it is a real folder owned by this user and
    /// writable by no one else (checked on the open descriptor, so no
    /// swap after the check changes what is held).
    pub fn open(path: &Path) -> io::Result<HeldDir> {
        use std::os::fd::AsRawFd;
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::ENOTDIR)
                {
                    io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!(
                            "{} is not a folder (a link?); memtrack writes only into its own folders",
                            path.display()
                        ),
                    )
                } else {
                    e
                }
            })?;
        check_meta(path, &dir.metadata()?)?;
        let via = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
        // Without procfs the descriptor cannot stand for a path.
        let same = std::fs::metadata(&via).is_ok_and(|m| {
            dir.metadata()
                .is_ok_and(|d| d.dev() == m.dev() && d.ino() == m.ino())
        });
        if !same {
            return Err(io::Error::other(format!(
                "cannot hold {} open: {} does not lead to it (is /proc mounted?)",
                path.display(),
                via.display()
            )));
        }
        crate::logging::alias_path(&via, path);
        Ok(HeldDir {
            dir,
            via,
            shown: path.to_path_buf(),
        })
    }

    /// The path every read and write in the folder goes through.
    pub fn path(&self) -> &Path {
        &self.via
    }

    /// The folder's name, for messages.
    pub fn shown(&self) -> &Path {
        &self.shown
    }

    /// Whether `path` still names the held folder (not a folder or link
    /// someone put in its place).
    pub fn is_at(&self, path: &Path) -> bool {
        match (std::fs::symlink_metadata(path), self.dir.metadata()) {
            (Ok(a), Ok(b)) => a.is_dir() && a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
}

/// `path` as a message shows it: a path through a [`HeldDir`]'s
/// descriptor becomes one under the folder's name (log lines get the same
/// rewriting from [`crate::logging`]).
pub fn shown(path: &Path) -> PathBuf {
    let text = path.to_string_lossy();
    match crate::logging::unalias(&text) {
        std::borrow::Cow::Owned(s) => PathBuf::from(s),
        std::borrow::Cow::Borrowed(_) => path.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn files_and_folders_are_private() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("a/b");
        create_dir_all(&sub).unwrap();
        assert_eq!(mode(&sub), DIR_MODE);
        assert_eq!(mode(&dir.path().join("a")), DIR_MODE);
        let f = sub.join("f");
        create(&f, true).unwrap().write_all(b"x").unwrap();
        assert_eq!(mode(&f), FILE_MODE);
        let (tmp, _) = create_temp(&f).unwrap();
        assert_eq!(mode(&tmp), FILE_MODE);
        assert!(tmp
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".f.tmp-"));
    }

    #[test]
    fn links_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(create(&link, true).is_err());
        assert!(create(&link, false).is_err());
        assert!(create_new(&link).is_err());
        assert!(open_write(&link).is_err());
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &dangling).unwrap();
        assert!(create(&dangling, false).is_err());
        assert!(!dir.path().join("elsewhere").exists());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        // A link to a folder is not a folder to write into.
        let dlink = dir.path().join("dlink");
        std::os::unix::fs::symlink(dir.path(), &dlink).unwrap();
        assert!(private_dir(&dlink).is_err());
        assert!(!owned_by_me(&dlink));
        assert!(HeldDir::open(&dlink).is_err());
    }

    #[test]
    fn a_held_folder_is_reached_wherever_it_moves() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        create_dir(&run).unwrap();
        let held = HeldDir::open(&run).unwrap();
        assert_eq!(shown(&held.path().join("f")), run.join("f"));
        assert!(held.is_at(&run));
        // Someone moves it away and plants a link under its name.
        let moved = dir.path().join("moved");
        let elsewhere = dir.path().join("elsewhere");
        create_dir(&elsewhere).unwrap();
        std::fs::rename(&run, &moved).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &run).unwrap();
        assert!(!held.is_at(&run));
        create(&held.path().join("f"), true).unwrap();
        assert!(moved.join("f").is_file());
        assert!(!elsewhere.join("f").exists());
        assert_eq!(
            shown(Path::new("/proc/self/fd/123456/f")),
            Path::new("/proc/self/fd/123456/f")
        );
    }

    #[test]
    fn a_folder_others_can_write_to_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = private_dir(&open).unwrap_err();
        assert!(err.to_string().contains("writable by other users"), "{err}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&open).unwrap();
        assert!(owned_by_me(&open));
    }
}
