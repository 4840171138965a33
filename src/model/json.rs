//! Writing `memory_usage.json` so that no reader ever sees half a file.
//!
//! Every write goes to a temporary file in the same directory, is synced,
//! and replaces the target with `rename`: a full disk, a killed memtrack or
//! a crash leave either the previous complete file or the new complete
//! file, never a truncated one.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::model::{Document, DocumentOf};

/// The file name, as the trackers memtrack replaces name it.
pub(crate) const FILE_NAME: &str = "memory_usage.json";

/// Why a file could not be written, with the path.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {source}{hint}")]
pub struct WriteError {
    pub(crate) path: PathBuf,
    pub(crate) source: io::Error,
    hint: &'static str,
}

impl WriteError {
    fn new(path: &Path, source: io::Error) -> Self {
        let hint = match source.raw_os_error() {
            Some(libc::ENOSPC) => " (disk full; the previous version of the file is intact)",
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
                " (not writable; choose another directory with --output)"
            }
            _ => "",
        };
        WriteError {
            path: crate::files::shown(path),
            source,
            hint,
        }
    }
}

/// Replaces `path` with `bytes` atomically.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// [`write_atomic`] for content written by `fill` through a buffered
/// writer, so a large document never sits whole in memory: a multi-MiB
/// buffer per checkpoint made the allocator's heap creep up.
pub(crate) fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<(), WriteError> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // A fresh name, created only if free and never through a link.
    let (tmp, mut f) = crate::files::create_temp(path).map_err(|e| WriteError::new(path, e))?;
    let _unfinished = Unfinished::note(&tmp);
    let result = (|| {
        let mut w = io::BufWriter::with_capacity(64 * 1024, &mut f);
        fill(&mut w)?;
        w.flush()?;
        drop(w);
        f.sync_data()?;
        fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        WriteError::new(path, e)
    })
}

/// Temporary files being written, for [`remove_unfinished`].
static UNFINISHED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn unfinished() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    UNFINISHED.lock().unwrap_or_else(|p| p.into_inner())
}

/// A temporary file listed while it is written.
struct Unfinished(PathBuf);

impl Unfinished {
    fn note(tmp: &Path) -> Unfinished {
        unfinished().push(tmp.to_path_buf());
        Unfinished(tmp.to_path_buf())
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        unfinished().retain(|p| p != &self.0);
    }
}

/// Removes the temporary files of writes still in progress: for a command
/// ended by a signal, which must leave no half-written file behind.
pub(crate) fn remove_unfinished() {
    for tmp in unfinished().drain(..) {
        let _ = fs::remove_file(&tmp);
    }
}

/// Counts what goes through, and fails once more than `limit` bytes did.
struct Within<W> {
    inner: W,
    written: u64,
    limit: u64,
}

impl<W: Write> Write for Within<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.written + buf.len() as u64 > self.limit {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                TooLarge(self.limit),
            ));
        }
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Why a document was not written: it would be larger than its readers
/// accept.
#[derive(Debug, thiserror::Error)]
#[error(
    "the document would be larger than {} MiB, more than memtrack's readers (`report`, `plot`, \
     `compare`) accept",
    .0 >> 20
)]
pub struct TooLarge(pub u64);

/// The size of `doc` serialized as [`write_document`] writes it, or
/// [`TooLarge`] once it passes `limit` (nothing is kept in memory).
pub fn document_size_within<L: serde::Serialize>(
    doc: &DocumentOf<L>,
    limit: u64,
) -> io::Result<u64> {
    let mut w = Within {
        inner: io::sink(),
        written: 0,
        limit,
    };
    serde_json::to_writer_pretty(&mut w, doc).map_err(io::Error::from)?;
    Ok(w.written)
}

/// [`write_document`], refused once the file would pass `limit` bytes:
/// the temporary file goes and a previous file at `path` stays as it was.
pub fn write_document_within<L: serde::Serialize>(
    path: &Path,
    doc: &DocumentOf<L>,
    limit: u64,
) -> Result<(), WriteError> {
    write_atomic_with(path, |w| {
        let mut w = Within {
            inner: w,
            written: 0,
            limit,
        };
        serde_json::to_writer_pretty(&mut w, doc).map_err(io::Error::from)
    })
}

/// Serializes and writes a document atomically.
pub fn write_document<L: serde::Serialize>(
    path: &Path,
    doc: &DocumentOf<L>,
) -> Result<(), WriteError> {
    write_atomic_with(path, |w| {
        serde_json::to_writer_pretty(&mut *w, doc).map_err(io::Error::other)
    })
}

/// Reads a document (any schema version, or a bare file: only
/// `detailed_log` and `peak_usage`).
pub(crate) fn read_document(path: &Path) -> anyhow::Result<Document> {
    use anyhow::Context;
    let meta = crate::files::open_input(path)
        .and_then(|f| f.metadata())
        .with_context(|| format!("cannot read {}", path.display()))?;
    anyhow::ensure!(
        meta.len() <= MAX_DOCUMENT_BYTES,
        "{} is {} MiB; memtrack reads files up to {} MiB",
        path.display(),
        meta.len() >> 20,
        MAX_DOCUMENT_BYTES >> 20
    );
    let bytes = crate::files::read_capped(path, MAX_DOCUMENT_BYTES)
        .with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a memory_usage.json document", path.display()))
}

/// Files larger than this are refused by the readers (a memtrack file is
/// bounded far below it).
pub(crate) const MAX_DOCUMENT_BYTES: u64 = 1 << 30;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_atomically_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        write_atomic(&path, b"{\"a\":1}").unwrap();
        write_atomic(&path, b"{\"a\":2}").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"{\"a\":2}");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn a_document_past_its_limit_is_not_written_and_the_previous_file_stays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        write_atomic(&path, b"previous").unwrap();
        let mut doc = Document::default();
        doc.run.name = "x".repeat(10_000);
        let size = document_size_within(&doc, u64::MAX).unwrap();
        let err = write_document_within(&path, &doc, size - 1).unwrap_err();
        assert!(err.to_string().contains("would be larger than"), "{err}");
        assert!(document_size_within(&doc, size - 1).is_err());
        assert_eq!(fs::read(&path).unwrap(), b"previous");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        write_document_within(&path, &doc, size).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), size);
    }

    #[test]
    fn unwritable_directory_is_a_clear_error() {
        let err = write_atomic(Path::new("/proc/memtrack-test/x.json"), b"{}").unwrap_err();
        assert!(
            err.to_string().contains("/proc/memtrack-test/x.json"),
            "{err}"
        );
    }

    #[test]
    fn reader_rejects_non_documents_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.json");
        fs::write(&path, b"[1, 2").unwrap();
        let err = read_document(&path).unwrap_err();
        assert!(format!("{err:#}").contains("bad.json"), "{err:#}");
    }
}
