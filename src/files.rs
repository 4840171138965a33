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
//! - a run directory is held open (`HeldDir`) once created and checked,
//!   and everything in it is reached through that descriptor: in an
//!   output root others may write to (no sticky bit), another user can
//!   rename the folder and plant a link under its name, and a path would
//!   follow the link.
//!
//! And every file memtrack reads (its config, the AWS and ClearML files, PID
//! files, `memory_usage.json`, journals and side files) goes through
//! `open_input` / `read_capped`: opened without blocking (a FIFO with no
//! writer would hang), refused unless a regular file (`/dev/zero` never
//! ends, a folder or a socket is no file), and read up to a hard cap
//! whatever its size claims (a `/proc` file says 0, a file may grow while
//! read). Links are followed when reading: a config kept as a link in a
//! dotfiles folder is usual, and reading through a link writes nothing.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The mode of every file memtrack creates.
pub(crate) const FILE_MODE: u32 = 0o600;
/// The mode of every folder memtrack creates.
pub(crate) const DIR_MODE: u32 = 0o700;

/// Open options for memtrack's files: created 0600, never through a link.
pub(crate) fn options() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    o
}

/// Opens `path` for writing, creating it if missing; `truncate` empties it.
pub(crate) fn create(path: &Path, truncate: bool) -> io::Result<File> {
    options()
        .write(true)
        .create(true)
        .truncate(truncate)
        .open(path)
}

/// Creates `path`, which must not exist yet: a name someone planted (a
/// file or a link) is an error, not a target.
pub(crate) fn create_new(path: &Path) -> io::Result<File> {
    options().write(true).create_new(true).open(path)
}

/// Opens an existing file for writing.
pub(crate) fn open_write(path: &Path) -> io::Result<File> {
    options().write(true).open(path)
}

/// A new temporary file beside `path` (`.NAME.tmp-PID-N-R`), for a write
/// that ends with a rename onto `path`. The name is unique in this process
/// and hard to guess from outside; one that exists anyway is skipped.
pub(crate) fn create_temp(path: &Path) -> io::Result<(PathBuf, File)> {
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

/// A fresh private folder under `base` (`PREFIX-XXXXXXXXXXXXXXXX`, 0700),
/// as `mkdtemp` makes one: the name is random, and a name that exists (a
/// folder or a link someone planted) is skipped, never used.
pub(crate) fn create_temp_dir(base: &Path, prefix: &str) -> io::Result<PathBuf> {
    let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
    for n in 0..64u64 {
        let path = base.join(format!("{prefix}-{:016x}", random_word(n)));
        match create_dir(&path) {
            Ok(()) => return Ok(path),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// 64 random bits: the kernel's, else the clock, the PID and `n`.
pub(crate) fn random_word(n: u64) -> u64 {
    use std::io::Read;
    let mut random = [0u8; 8];
    let got = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut random));
    match got {
        Ok(()) => u64::from_ne_bytes(random),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            nanos ^ (u64::from(std::process::id()) << 32) ^ n
        }
    }
}

/// Creates the folder `path` (0700); an existing one is an error.
pub(crate) fn create_dir(path: &Path) -> io::Result<()> {
    DirBuilder::new().mode(DIR_MODE).create(path)
}

/// Creates every missing folder of `path` (0700 each); existing ones are
/// left as they are.
pub(crate) fn create_dir_all(path: &Path) -> io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Creates the folder `path` (0700), or checks an existing one with
/// [`check_dir`].
pub(crate) fn private_dir(path: &Path) -> io::Result<()> {
    match create_dir(path) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => check_dir(path),
        other => other,
    }
}

/// Whether memtrack may write into the folder `path`: a real folder (not a
/// link), owned by this user, writable by no one else.
pub(crate) fn check_dir(path: &Path) -> io::Result<()> {
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

/// Whether the folder `path` may hold this user's private state (run
/// records, sockets, the Python hooks): [`check_dir`] on the folder itself,
/// and, on the way to it, every folder owned by this user or root and,
/// where others may write to it, sticky (so nobody else can rename or
/// replace what it holds: `/tmp` passes, a folder every user may write to
/// without the sticky bit does not), and every link owned by this user or
/// root. A folder another user made, or one in a place another user can
/// swap, is refused with the reason.
pub(crate) fn check_private_place(path: &Path) -> io::Result<()> {
    let me = crate::sys::uid();
    let refuse = |what: &Path, why: String| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} {why}; memtrack keeps its state only in places no other user can change",
                what.display()
            ),
        ))
    };
    let abs = std::path::absolute(path)?;
    let mut prefix = PathBuf::new();
    for part in abs.components() {
        prefix.push(part);
        let meta = std::fs::symlink_metadata(&prefix)?;
        if meta.file_type().is_symlink() && meta.uid() != me && meta.uid() != 0 {
            return refuse(
                &prefix,
                format!(
                    "is a link owned by uid {}, not this user or root",
                    meta.uid()
                ),
            );
        }
    }
    let real = std::fs::canonicalize(&abs)?;
    check_meta(path, &std::fs::symlink_metadata(&real)?)?;
    for above in real.ancestors().skip(1) {
        let meta = std::fs::metadata(above)?;
        if meta.uid() != me && meta.uid() != 0 {
            return refuse(
                above,
                format!("belongs to uid {}, not this user or root", meta.uid()),
            );
        }
        if meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0 {
            return refuse(
                above,
                format!(
                    "is writable by other users without the sticky bit (mode {:o})",
                    meta.mode() & 0o7777
                ),
            );
        }
    }
    Ok(())
}

/// Refuses a path through a link another user could have planted: each
/// link on the way must belong to this user, root, or the owner of the
/// folder it is in (the rule of the kernel's `fs.protected_symlinks`, here
/// for every folder, sticky or not). An output root `/shared/out` that
/// another user made a link to their own folder would otherwise have
/// memtrack create its run folders in theirs. Parts that do not exist yet
/// are not checked (memtrack creates them).
pub(crate) fn check_links(path: &Path) -> io::Result<()> {
    let me = crate::sys::uid();
    let abs = std::path::absolute(path)?;
    let mut prefix = PathBuf::new();
    for part in abs.components() {
        let holder = std::fs::metadata(&prefix).map(|m| m.uid()).ok();
        prefix.push(part);
        let Ok(meta) = std::fs::symlink_metadata(&prefix) else {
            break;
        };
        let owner = meta.uid();
        if meta.file_type().is_symlink() && owner != me && owner != 0 && Some(owner) != holder {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} is a link owned by uid {owner}, not by this user, root or the owner \
                     of the folder it is in; memtrack does not follow a link another user \
                     may have planted (give the real folder)",
                    prefix.display()
                ),
            ));
        }
    }
    Ok(())
}

/// `$XDG_RUNTIME_DIR`, when it is set, a folder, and a private place of
/// this user ([`check_private_place`]); otherwise `None`, and the reason
/// is logged once.
pub(crate) fn xdg_runtime_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty())?);
    if !dir.is_dir() {
        return None;
    }
    match check_private_place(&dir) {
        Ok(()) => Some(dir),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| tracing::warn!("XDG_RUNTIME_DIR is not used: {e}"));
            None
        }
    }
}

/// The folder memtrack keeps its per-user runtime state in:
/// `$XDG_RUNTIME_DIR/memtrack` (when [`xdg_runtime_dir`] accepts it), else
/// `/run/memtrack` for root, else `/tmp/memtrack-<uid>` (the socket's
/// folder). Not checked here: readers check it with
/// [`check_private_place`], writers make it with [`ensure_runtime_dir`].
pub(crate) fn runtime_dir() -> PathBuf {
    if let Some(dir) = xdg_runtime_dir() {
        return dir.join("memtrack");
    }
    if crate::sys::uid() == 0 {
        PathBuf::from("/run/memtrack")
    } else {
        PathBuf::from(format!("/tmp/memtrack-{}", crate::sys::uid()))
    }
}

/// Creates [`runtime_dir`] where missing — readable by all where it may
/// be (so that a Prometheus of another user reaches `sd/`), private under
/// `/tmp`, where it is also the socket's folder — and checks it is a
/// private place of this user. A folder another user made under its name
/// is an error saying so (the caller goes on without it).
pub(crate) fn ensure_runtime_dir() -> io::Result<PathBuf> {
    let dir = runtime_dir();
    let mode = if dir.starts_with("/tmp") {
        0o700
    } else {
        0o755
    };
    DirBuilder::new().recursive(true).mode(mode).create(&dir)?;
    check_private_place(&dir)?;
    Ok(dir)
}

/// The folder of the default event socket: `$XDG_RUNTIME_DIR` (when
/// [`xdg_runtime_dir`] accepts it), else `/tmp/memtrack-<uid>`, created
/// 0700 or checked to be this user's private folder. When another user has
/// taken that name, a fresh private folder `/tmp/memtrack-<uid>-<random>`
/// is used instead, with a warning: a planted folder must not stop a run.
pub(crate) fn socket_dir() -> io::Result<PathBuf> {
    if let Some(dir) = xdg_runtime_dir() {
        return Ok(dir);
    }
    let dir = PathBuf::from(format!("/tmp/memtrack-{}", crate::sys::uid()));
    let private = match create_dir(&dir) {
        Ok(()) => check_private_place(&dir),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            check_private_place(&dir).and_then(|()| {
                let mode = std::fs::symlink_metadata(&dir)?.mode();
                if mode & 0o077 == 0 {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!(
                            "{} is open to other users (mode {:o})",
                            dir.display(),
                            mode & 0o7777
                        ),
                    ))
                }
            })
        }
        Err(e) => Err(e),
    };
    match private {
        Ok(()) => Ok(dir),
        Err(why) => {
            let fresh = fallback_dir()?;
            tracing::warn!(
                "{why}; the event socket goes into {} instead",
                fresh.display()
            );
            Ok(fresh)
        }
    }
}

/// A fresh private folder `/tmp/memtrack-<uid>-<random>` (0700, a name
/// nobody could plant), made once per process: where the socket and the
/// Python hooks go when the usual place is another user's.
pub(crate) fn fallback_dir() -> io::Result<PathBuf> {
    FALLBACK
        .get_or_init(|| {
            let base = Path::new("/tmp");
            let dir = create_temp_dir(base, &format!("memtrack-{}", crate::sys::uid()))
                .map_err(|e| format!("cannot make a private folder in /tmp: {e}"))?;
            check_private_place(&dir).map_err(|e| e.to_string())?;
            Ok(dir)
        })
        .clone()
        .map_err(io::Error::other)
}

/// The folder [`fallback_dir`] made, once made.
static FALLBACK: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();

/// Removes the folder [`fallback_dir`] made, if any, when dropped — once
/// what went into it (the socket, the hooks) is gone: a non-empty folder
/// stays.
#[derive(Debug)]
pub(crate) struct FallbackCleanup;

impl Drop for FallbackCleanup {
    fn drop(&mut self) {
        if let Some(Ok(dir)) = FALLBACK.get() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Whether `path` is a real folder (not a link) owned by this user.
pub(crate) fn owned_by_me(path: &Path) -> bool {
    std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.is_dir() && !m.file_type().is_symlink() && m.uid() == crate::sys::uid())
}

/// What a non-regular file is, for messages.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens an input file for reading: without blocking (`O_NONBLOCK`: a FIFO
/// with no writer would hang the open), without becoming the controlling
/// terminal, not inherited by the job; anything but a regular file is an
/// error saying what it is ("it is a FIFO (named pipe), not a regular
/// file"). Errors do not repeat the path: callers name it.
pub(crate) fn open_input(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it is {}, not a regular file", kind_of(&meta)),
        ));
    }
    Ok(file)
}

/// Reads an input file whole, at most `cap` bytes whatever its size claims
/// (a file growing while read cannot grow memtrack): a larger one is an
/// error ("is larger than N bytes"), never a truncated read.
pub(crate) fn read_capped(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let file = open_input(path)?;
    let mut bytes = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(too_large(cap));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub(crate) fn read_text_capped(path: &Path, cap: u64) -> io::Result<String> {
    String::from_utf8(read_capped(path, cap)?).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is not UTF-8 text (byte {})",
                path.display(),
                e.utf8_error().valid_up_to() + 1
            ),
        )
    })
}

fn too_large(cap: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("it is larger than {cap} bytes, the most memtrack reads of it"),
    )
}

/// How [`read_line_bounded`] found a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LineEnd {
    /// Ended by a newline, within the cap.
    Whole,
    /// Cut short by the end of the input (a torn last line).
    Torn,
    /// Longer than the cap: `buf` holds its first bytes, the rest was read
    /// and dropped.
    TooLong,
}

/// Reads one line into `buf` (without its newline), holding at most `cap`
/// bytes of it however long it is. `None` at the end of the input.
pub(crate) fn read_line_bounded(
    reader: &mut impl io::BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> io::Result<Option<LineEnd>> {
    buf.clear();
    let mut long = false;
    let mut any = false;
    loop {
        let chunk = reader.fill_buf()?;
        if chunk.is_empty() {
            return Ok(any.then_some(if long {
                LineEnd::TooLong
            } else {
                LineEnd::Torn
            }));
        }
        any = true;
        let (part, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (&chunk[..i], Some(i + 1)),
            None => (chunk, None),
        };
        if long || buf.len() + part.len() > cap {
            long = true;
            let room = cap.saturating_sub(buf.len());
            buf.extend_from_slice(&part[..room.min(part.len())]);
        } else {
            buf.extend_from_slice(part);
        }
        let used = done.unwrap_or(chunk.len());
        reader.consume(used);
        if done.is_some() {
            return Ok(Some(if long {
                LineEnd::TooLong
            } else {
                LineEnd::Whole
            }));
        }
    }
}

/// Reads one line into `buf` (without its newline), failing as soon as it
/// passes `cap` bytes: for input where an over-long line means the whole
/// input is wrong (a decompression bomb), so nothing more of it is read.
/// `Ok(false)` at the end of the input.
pub(crate) fn read_line_capped(
    reader: &mut impl io::BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> io::Result<bool> {
    use std::io::{BufRead, Read};
    buf.clear();
    let n = reader
        .by_ref()
        .take(cap as u64 + 1)
        .read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(false);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    }
    if buf.len() > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a line longer than {cap} bytes"),
        ));
    }
    Ok(true)
}

/// A reader that fails once more than a budget of bytes has come through:
/// a decompressing reader wrapped in it cannot turn a small file into an
/// unbounded stream (a gzip bomb).
#[derive(Debug)]
pub(crate) struct Budgeted<R> {
    inner: R,
    left: u64,
    budget: u64,
}

impl<R> Budgeted<R> {
    /// `inner`, failing after `budget` bytes.
    pub fn new(inner: R, budget: u64) -> Self {
        Budgeted {
            inner,
            left: budget,
            budget,
        }
    }
}

impl<R: io::Read> io::Read for Budgeted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            // One byte more than the budget means over it; exactly the
            // budget then the end is fine.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "more than {} bytes once decompressed (the limit)",
                        self.budget
                    ),
                )),
            };
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// A folder held by an open descriptor. [`HeldDir::path`] is
/// `/proc/self/fd/N`: the kernel resolves it to the folder the descriptor
/// holds, wherever it has been moved since and whatever now has its old
/// name, so every file reached through it is in that folder. Messages
/// show the folder's name instead ([`shown`]).
#[derive(Debug)]
pub(crate) struct HeldDir {
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
    pub(crate) fn path(&self) -> &Path {
        &self.via
    }

    /// The folder's name, for messages.
    pub(crate) fn shown(&self) -> &Path {
        &self.shown
    }

    /// Whether `path` still names the held folder (not a folder or link
    /// someone put in its place).
    pub(crate) fn is_at(&self, path: &Path) -> bool {
        match (std::fs::symlink_metadata(path), self.dir.metadata()) {
            (Ok(a), Ok(b)) => a.is_dir() && a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
}

/// 32 hex digits from `/dev/urandom` (the clock and the PID when it cannot
/// be read): a run's id, and the part of a fallback file's name nobody can
/// guess.
pub(crate) fn random_id() -> String {
    let mut bytes = [0u8; 16];
    if File::open("/dev/urandom")
        .and_then(|mut f| io::Read::read_exact(&mut f, &mut bytes))
        .is_err()
    {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            ^ u128::from(std::process::id());
        bytes = seed.to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `path` as a message shows it: a path through a [`HeldDir`]'s
/// descriptor becomes one under the folder's name (log lines get the same
/// rewriting from [`crate::logging`]).
pub(crate) fn shown(path: &Path) -> PathBuf {
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
        let t1 = create_temp_dir(dir.path(), "m").unwrap();
        let t2 = create_temp_dir(dir.path(), "m").unwrap();
        assert_ne!(t1, t2);
        assert_eq!(mode(&t1), DIR_MODE);
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

    #[test]
    fn inputs_are_regular_files_read_up_to_a_cap() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, "0123456789").unwrap();
        assert_eq!(read_capped(&f, 10).unwrap(), b"0123456789");
        let err = read_capped(&f, 9).unwrap_err();
        assert!(err.to_string().contains("larger than 9 bytes"), "{err}");
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let err = read_capped(&fifo, 10).unwrap_err();
        assert!(err.to_string().contains("a FIFO"), "{err}");
        let err = read_capped(Path::new("/dev/zero"), 10).unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
        let err = read_capped(dir.path(), 10).unwrap_err();
        assert!(err.to_string().contains("a folder"), "{err}");
        // A /proc file claims 0 bytes and is read all the same.
        assert!(!read_capped(Path::new("/proc/self/status"), 1 << 20)
            .unwrap()
            .is_empty());
        std::fs::write(&f, b"ok\xff").unwrap();
        assert!(read_text_capped(&f, 10)
            .unwrap_err()
            .to_string()
            .contains("not UTF-8"));
    }

    #[test]
    fn lines_and_decompressed_streams_are_capped() {
        use std::io::Read;
        // A small buffer: lines span several fills.
        let mut r = io::BufReader::with_capacity(2, &b"abc\nabcdefgh\nabcd\nab"[..]);
        let mut buf = Vec::new();
        let mut next = || {
            let l = read_line_bounded(&mut r, &mut buf, 4).unwrap();
            (l, String::from_utf8(buf.clone()).unwrap())
        };
        assert_eq!(next(), (Some(LineEnd::Whole), "abc".into()));
        assert_eq!(next(), (Some(LineEnd::TooLong), "abcd".into()));
        assert_eq!(next(), (Some(LineEnd::Whole), "abcd".into()));
        assert_eq!(next(), (Some(LineEnd::Torn), "ab".into()));
        assert_eq!(next(), (None, "".into()));
        let mut r = io::Cursor::new(b"abcd\nabcdefgh\n".to_vec());
        assert!(read_line_capped(&mut r, &mut buf, 4).unwrap());
        assert_eq!(buf, b"abcd");
        let err = read_line_capped(&mut r, &mut buf, 4).unwrap_err();
        assert!(err.to_string().contains("longer than 4"), "{err}");
        assert_eq!(r.position(), 5 + 5, "no more of the line was read");
        let mut out = Vec::new();
        Budgeted::new(&b"12345"[..], 5)
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, b"12345");
        let err = Budgeted::new(&b"123456"[..], 5)
            .read_to_end(&mut out)
            .unwrap_err();
        assert!(err.to_string().contains("more than 5 bytes"), "{err}");
    }
}
