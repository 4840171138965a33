//! The run's event log (marks, spans, stages, memtrack's own entries),
//! kept on disk so that memtrack's memory does not grow with the run.
//!
//! Every event entry is kept: a job that marks a few spans per step for a
//! million steps sends millions. Held in memory they cost about 290 bytes
//! each. With a file attached (every daemon run: `.memtrack/entries.jsonl`
//! in the run directory), an entry is appended there as one JSON line and
//! memory holds only the count, the byte length and at most `BATCH`
//! bytes not yet written; writers of `memory_usage.json` read the entries
//! back one at a time. Without a file (a store built in tests or by a
//! library user) they stay in memory, in a `ChunkLog`.
//!
//! The file is append-only and every position in it is known, so a clone
//! of the store (a checkpoint) reads exactly the entries it holds while
//! the live store goes on appending, and recovery cuts the file back to
//! what the last checkpoint's state counted before replaying the journal.
//! A failed write keeps its bytes in memory and is retried at the next
//! one: memory grows only while the disk refuses, and no entry is lost.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::chunked::ChunkLog;
use crate::model::Entry;

/// The entries file inside a run's `.memtrack` folder.
pub(crate) const FILE: &str = "entries.jsonl";

/// The complete event log written beside a `memory_usage.json` whose
/// event entries were thinned (`log.max_event_entries`): one entry per
/// line, gzip'd. With the document's timer entries it is the complete
/// `detailed_log`.
pub(crate) const COMPLETE_LOG: &str = "memory_usage.events.jsonl.gz";

/// Bytes gathered before they are written to the file.
pub(crate) const BATCH: usize = 64 * 1024;

/// Problems with the entries file, with its path.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EntriesError {
    #[error("cannot use the entries file {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("entry {index} of {path} cannot be read back: {message}")]
    Corrupt {
        path: PathBuf,
        index: u64,
        message: String,
    },
    #[error("the entries file of this store was never attached (a state read back without its run directory)")]
    Detached,
}

impl From<EntriesError> for crate::model::StreamError {
    fn from(e: EntriesError) -> Self {
        crate::model::StreamError::Read(Box::new(e))
    }
}

/// The file and the bytes not yet written to it, shared by the store and
/// its clones (only the live store appends).
#[derive(Debug)]
struct Spill {
    path: PathBuf,
    file: File,
    /// Bytes on disk (every one of them a complete line).
    written: u64,
    /// Complete lines not yet written.
    pending: Vec<u8>,
    /// A write failed and has not succeeded since (warned once).
    failing: bool,
}

impl Spill {
    fn flush(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        // A failed write may have left part of the batch on disk: the next
        // try writes the same bytes at the same place.
        match self.file.write_all_at(&self.pending, self.written) {
            Ok(()) => {
                self.written += self.pending.len() as u64;
                self.pending.clear();
                if self.pending.capacity() > 2 * BATCH {
                    self.pending.shrink_to(BATCH + 4096);
                }
                if self.failing {
                    tracing::info!("the entries file {} is written again", self.path.display());
                }
                self.failing = false;
                Ok(())
            }
            Err(e) => {
                if !self.failing {
                    tracing::warn!(
                        "cannot write the entries file {} ({e}); its entries are kept in memory \
                         until it can be written",
                        self.path.display()
                    );
                }
                self.failing = true;
                Err(e)
            }
        }
    }
}

/// Where the entries of a file-backed log are.
#[derive(Debug, Clone)]
struct OnDisk {
    /// `None` in a state read back from `state.json` until recovery
    /// attaches the file again.
    spill: Option<Arc<Mutex<Spill>>>,
    /// Entries in the log (written or pending).
    len: u64,
    /// Their bytes in the file.
    bytes: u64,
}

/// The event log: in memory, or in a file.
#[derive(Debug, Clone)]
pub(crate) struct EntryLog {
    mem: ChunkLog<Entry>,
    disk: Option<OnDisk>,
    /// During recovery: the entries written after the checkpoint, to put
    /// back those no journal record brings back.
    tail: Option<Arc<Mutex<Tail>>>,
}

impl Default for EntryLog {
    fn default() -> Self {
        EntryLog::new()
    }
}

fn lock(spill: &Mutex<Spill>) -> MutexGuard<'_, Spill> {
    // A panic while holding the lock left at worst a partial batch, which
    // the next write rewrites in full.
    spill.lock().unwrap_or_else(|p| p.into_inner())
}

impl EntryLog {
    /// A log held in memory.
    pub fn new() -> Self {
        EntryLog {
            mem: ChunkLog::new(),
            disk: None,
            tail: None,
        }
    }

    /// Moves the log into a new file at `path` (created or emptied): the
    /// entries already held go first, every later one is appended.
    pub(crate) fn create_file(&mut self, path: &Path) -> Result<(), EntriesError> {
        let io_err = |source| EntriesError::Io {
            path: path.to_path_buf(),
            source,
        };
        // 0600 and never through a link, as every file memtrack writes.
        let file = crate::files::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err)?;
        let spill = Spill {
            path: path.to_path_buf(),
            file,
            written: 0,
            pending: Vec::new(),
            failing: false,
        };
        let old = std::mem::replace(&mut self.mem, ChunkLog::new());
        self.disk = Some(OnDisk {
            spill: Some(Arc::new(Mutex::new(spill))),
            len: 0,
            bytes: 0,
        });
        for e in old.iter() {
            self.push(e).map_err(io_err)?;
        }
        self.flush().map_err(io_err)
    }

    /// Attaches the file of a log read back from a checkpoint's state: the
    /// file is cut back to the bytes the state counted (later entries come
    /// back with the journal's records). A state of a log held in memory
    /// starts a new file instead.
    ///
    /// A damaged file (cut short, a line that is not an entry, the file
    /// gone) loses only what is damaged: the readable entries are kept, in
    /// order, and what was lost comes back as [`Salvaged`].
    pub(crate) fn reattach(&mut self, path: &Path) -> Result<Salvaged, EntriesError> {
        let Some(disk) = &mut self.disk else {
            self.create_file(path)?;
            return Ok(Salvaged::default());
        };
        let io_err = |source| EntriesError::Io {
            path: path.to_path_buf(),
            source,
        };
        let open = || crate::files::options().read(true).write(true).open(path);
        let file = match open() {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let lost = Salvaged {
                    lost_entries: disk.len,
                    missing_bytes: disk.bytes,
                    ..Salvaged::default()
                };
                self.disk = None;
                self.create_file(path)?;
                return Ok(lost);
            }
            Err(e) => return Err(io_err(e)),
        };
        let found = file.metadata().map_err(io_err)?.len();
        // Entries written after the checkpoint: kept aside before the file
        // is cut back, for those the journal no longer holds.
        if found > disk.bytes {
            let tail = Tail::read(&file, path, disk.bytes, found).map_err(io_err)?;
            self.tail = Some(Arc::new(Mutex::new(tail)));
        }
        let Some(disk) = &mut self.disk else {
            return Err(EntriesError::Detached);
        };
        let scan = scan(&file, found.min(disk.bytes)).map_err(io_err)?;
        let lost = Salvaged {
            lost_entries: disk.len.saturating_sub(scan.good),
            missing_bytes: disk.bytes.saturating_sub(found),
            dropped_bytes: found.min(disk.bytes) - scan.good_bytes,
            bad_lines: scan.bad_lines,
        };
        let file = if lost.is_nothing() {
            file.set_len(disk.bytes).map_err(io_err)?;
            file
        } else {
            drop(file);
            keep_good_lines(path, scan.good_bytes).map_err(io_err)?;
            disk.len = scan.good;
            disk.bytes = scan.good_bytes;
            open().map_err(io_err)?
        };
        disk.spill = Some(Arc::new(Mutex::new(Spill {
            path: path.to_path_buf(),
            file,
            written: disk.bytes,
            pending: Vec::new(),
            failing: false,
        })));
        Ok(lost)
    }

    /// Appends an entry. An error means the file could not be written; the
    /// entry is kept (in memory, until a later write succeeds).
    pub(crate) fn push(&mut self, entry: &Entry) -> io::Result<()> {
        if let Some(tail) = self.tail.clone() {
            let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(at) = tail.position(entry) {
                // Entries written live before this one whose records the
                // journal lost, then the entry as it was written live.
                while tail.next < at {
                    let line = tail.next_line()?;
                    tail.only_here += 1;
                    self.push_line(&line)?;
                }
                let line = tail.next_line()?;
                return self.push_line(&line);
            }
        }
        self.push_entry(entry)
    }

    /// Ends recovery's use of the entries written after the checkpoint:
    /// those left (the journal ends before them) are appended. Returns how
    /// many tail entries no journal record brought back, and the latest
    /// time among the tail's entries.
    pub(crate) fn finish_tail(&mut self) -> io::Result<(u64, f64)> {
        let Some(tail) = self.tail.take() else {
            return Ok((0, 0.0));
        };
        let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
        while tail.next < tail.len {
            let line = tail.next_line()?;
            tail.only_here += 1;
            self.push_line(&line)?;
        }
        self.flush()?;
        Ok((tail.only_here, tail.last))
    }

    /// Appends one entry line as it was read (no newline).
    fn push_line(&mut self, line: &[u8]) -> io::Result<()> {
        let Some(disk) = &mut self.disk else {
            let entry: Entry = serde_json::from_slice(line)?;
            self.mem.push(entry);
            return Ok(());
        };
        let Some(spill) = &disk.spill else {
            return Err(io::Error::other(EntriesError::Detached.to_string()));
        };
        let mut s = lock(spill);
        s.pending.extend_from_slice(line);
        s.pending.push(b'\n');
        disk.len += 1;
        disk.bytes += line.len() as u64 + 1;
        if s.pending.len() >= BATCH {
            s.flush()?;
        }
        Ok(())
    }

    fn push_entry(&mut self, entry: &Entry) -> io::Result<()> {
        let Some(disk) = &mut self.disk else {
            self.mem.push(entry.clone());
            return Ok(());
        };
        let Some(spill) = &disk.spill else {
            return Err(io::Error::other(EntriesError::Detached.to_string()));
        };
        let mut s = lock(spill);
        let before = s.pending.len();
        serde_json::to_writer(&mut s.pending, entry)?;
        s.pending.push(b'\n');
        disk.len += 1;
        disk.bytes += (s.pending.len() - before) as u64;
        if s.pending.len() >= BATCH {
            s.flush()?;
        }
        Ok(())
    }

    /// Writes what is pending to the file.
    pub(crate) fn flush(&self) -> io::Result<()> {
        match self.disk.as_ref().and_then(|d| d.spill.as_ref()) {
            Some(spill) => lock(spill).flush(),
            None => Ok(()),
        }
    }

    /// Writes what is pending and makes the file durable: done before a
    /// checkpoint's state, which counts these bytes, is written.
    pub(crate) fn sync(&self) -> io::Result<()> {
        match self.disk.as_ref().and_then(|d| d.spill.as_ref()) {
            Some(spill) => {
                let mut s = lock(spill);
                s.flush()?;
                s.file.sync_data()
            }
            None => Ok(()),
        }
    }

    pub(crate) fn len(&self) -> u64 {
        match &self.disk {
            Some(d) => d.len,
            None => self.mem.len() as u64,
        }
    }

    /// Writes every entry as one JSON line, oldest first. From a file the
    /// lines are copied as they are, without parsing.
    pub(crate) fn copy_lines(&self, w: &mut dyn io::Write) -> io::Result<()> {
        if self.disk.is_none() {
            for e in self.mem.iter() {
                serde_json::to_writer(&mut *w, e)?;
                w.write_all(b"\n")?;
            }
            return Ok(());
        }
        let (mut source, _) = self.raw().map_err(io::Error::other)?;
        io::copy(&mut source, w)?;
        Ok(())
    }

    /// The file's bytes of this log, and the file's path.
    fn raw(&self) -> Result<(impl Read + Send + 'static, PathBuf), EntriesError> {
        let disk = self.disk.as_ref().ok_or(EntriesError::Detached)?;
        let spill = disk.spill.as_ref().ok_or(EntriesError::Detached)?;
        let mut s = lock(spill);
        let path = s.path.clone();
        // Best effort: what cannot be written is read from memory.
        let _ = s.flush();
        let from_file = s.written.min(disk.bytes);
        let rest = usize::try_from(disk.bytes - from_file).unwrap_or(usize::MAX);
        let tail = s.pending[..rest.min(s.pending.len())].to_vec();
        // A descriptor of its own: reading goes on after the run directory
        // is removed, and never moves the writer's position.
        let file = s.file.try_clone().map_err(|source| EntriesError::Io {
            path: path.clone(),
            source,
        })?;
        drop(s);
        let source = At {
            file,
            pos: 0,
            end: from_file,
        }
        .chain(io::Cursor::new(tail));
        Ok((source, path))
    }

    /// Reads the log's entries one at a time, oldest first: the entries of
    /// this log (a clone reads what it holds, however far the live store
    /// has gone on since).
    pub(crate) fn read(&self) -> Result<Reader<'_>, EntriesError> {
        let Some(disk) = &self.disk else {
            return Ok(Reader {
                inner: ReaderKind::Memory(Box::new(self.mem.iter())),
                index: 0,
            });
        };
        let (source, path) = self.raw()?;
        Ok(Reader {
            inner: ReaderKind::File {
                lines: BufReader::with_capacity(BATCH, Box::new(source)),
                left: disk.len,
                path,
                line: Vec::new(),
            },
            index: 0,
        })
    }
}

/// Longest entry line recovery reads (a mark is bounded far below it); a
/// longer line is damage, never held whole.
const MAX_LINE: usize = 16 << 20;

/// What recovery could not read back from an entries file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Salvaged {
    /// Entries the checkpoint counted that are missing or unreadable.
    pub lost_entries: u64,
    /// Bytes the checkpoint counted that the file no longer has.
    pub missing_bytes: u64,
    /// Bytes of damaged lines, dropped.
    pub dropped_bytes: u64,
    /// 1-based numbers of the damaged lines (at most [`MAX_BAD_LINES`]).
    pub bad_lines: Vec<u64>,
}

/// Damaged lines named one by one; more are only counted.
pub const MAX_BAD_LINES: usize = 20;

impl Salvaged {
    /// Whether nothing was lost.
    pub fn is_nothing(&self) -> bool {
        self.lost_entries == 0
            && self.missing_bytes == 0
            && self.dropped_bytes == 0
            && self.bad_lines.is_empty()
    }
}

/// The readable lines of an entries file, up to `end`.
struct Scan {
    good: u64,
    good_bytes: u64,
    bad_lines: Vec<u64>,
}

/// Reads the file up to `end`, line by line, and marks every line that is
/// not a complete entry. Then [`keep_good_lines`] keeps the others.
fn scan(file: &File, end: u64) -> io::Result<Scan> {
    let mut reader = BufReader::with_capacity(
        BATCH,
        At {
            file: file.try_clone()?,
            pos: 0,
            end,
        },
    );
    let mut out = Scan {
        good: 0,
        good_bytes: 0,
        bad_lines: Vec::new(),
    };
    let mut line = Vec::new();
    let mut number = 0u64;
    while let Some(how) = crate::files::read_line_bounded(&mut reader, &mut line, MAX_LINE)? {
        number += 1;
        let ok =
            how == crate::files::LineEnd::Whole && serde_json::from_slice::<Entry>(&line).is_ok();
        if ok {
            out.good += 1;
            out.good_bytes += line.len() as u64 + 1;
        } else if out.bad_lines.len() < MAX_BAD_LINES {
            out.bad_lines.push(number);
        }
    }
    Ok(out)
}

/// Rewrites the entries file with only its complete entry lines (the ones
/// [`scan`] counted, `good_bytes` in all), through a temporary file and a
/// rename: a crash meanwhile leaves the damaged file, never less.
fn keep_good_lines(path: &Path, good_bytes: u64) -> io::Result<()> {
    use std::io::Write;
    let src = crate::files::open_input(path)?;
    let end = src.metadata()?.len();
    let mut reader = BufReader::with_capacity(
        BATCH,
        At {
            file: src,
            pos: 0,
            end,
        },
    );
    let (tmp, out) = crate::files::create_temp(path)?;
    let written = (|| {
        let mut out = io::BufWriter::new(out);
        let mut line = Vec::new();
        let mut kept = 0u64;
        while kept < good_bytes {
            let Some(how) = crate::files::read_line_bounded(&mut reader, &mut line, MAX_LINE)?
            else {
                break;
            };
            if how == crate::files::LineEnd::Whole && serde_json::from_slice::<Entry>(&line).is_ok()
            {
                out.write_all(&line)?;
                out.write_all(b"\n")?;
                kept += line.len() as u64 + 1;
            }
        }
        out.flush()?;
        out.get_ref().sync_all()
    })();
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// What identifies an entry: the same mark applied live and again from
/// the journal gives the same key.
fn key(e: &Entry) -> u64 {
    use std::hash::{Hash, Hasher};
    // Fixed keys: the same input hashes alike in every process.
    let mut h = std::hash::DefaultHasher::new();
    e.timestamp.to_bits().hash(&mut h);
    e.pid.hash(&mut h);
    e.component.hash(&mut h);
    e.operation.hash(&mut h);
    e.iteration.hash(&mut h);
    serde_json::to_string(&e.kind)
        .unwrap_or_default()
        .hash(&mut h);
    h.finish()
}

/// The entries a run wrote after its last checkpoint, set aside (the good
/// lines only) before recovery cuts the entries file back to what the
/// checkpoint counted. Replaying the journal writes most of them again; an
/// entry whose record the journal lost (a damaged line, a journal cut
/// short or gone) is put back from here, in its place.
pub(crate) struct Tail {
    lines: BufReader<Box<dyn Read + Send>>,
    /// Each entry's [`key`] → its place in the tail.
    index: std::collections::HashMap<u64, u64>,
    len: u64,
    /// Tail entries written back so far.
    next: u64,
    /// Written back with no journal record to give them.
    only_here: u64,
    /// The latest time among the tail's entries.
    last: f64,
}

/// What [`Tail::copy`] found.
#[derive(Default)]
struct Found {
    index: std::collections::HashMap<u64, u64>,
    len: u64,
    last: f64,
}

impl Found {
    fn into_tail(self, lines: Box<dyn Read + Send>) -> Tail {
        Tail {
            lines: BufReader::with_capacity(BATCH, lines),
            index: self.index,
            len: self.len,
            next: 0,
            only_here: 0,
            last: self.last,
        }
    }
}

impl std::fmt::Debug for Tail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tail")
            .field("len", &self.len)
            .field("next", &self.next)
            .finish()
    }
}

impl Tail {
    /// Copies the good entry lines of `file` between `from` and `to` into
    /// an unnamed file beside `path`, or into memory when the disk cannot
    /// take them.
    fn read(file: &File, path: &Path, from: u64, to: u64) -> io::Result<Tail> {
        if let Ok((tmp, out)) = crate::files::create_temp(path) {
            let mut out = io::BufWriter::with_capacity(BATCH, out);
            let copied = Tail::copy(file, from, to, &mut out)
                .and_then(|found| Ok((found, out.into_inner().map_err(|e| e.into_error())?)));
            let reopened = crate::files::open_input(&tmp);
            let _ = std::fs::remove_file(&tmp);
            if let (Ok((found, _)), Ok(back)) = (copied, reopened) {
                return Ok(found.into_tail(Box::new(back)));
            }
        }
        let mut kept = Vec::new();
        let found = Tail::copy(file, from, to, &mut kept)?;
        Ok(found.into_tail(Box::new(io::Cursor::new(kept))))
    }

    /// Writes the good entry lines of `file` between `from` and `to` to
    /// `out`, noting each one's key.
    fn copy(file: &File, from: u64, to: u64, out: &mut dyn io::Write) -> io::Result<Found> {
        let mut reader = BufReader::with_capacity(
            BATCH,
            At {
                file: file.try_clone()?,
                pos: from,
                end: to,
            },
        );
        let mut found = Found::default();
        let mut line = Vec::new();
        while let Some(how) = crate::files::read_line_bounded(&mut reader, &mut line, MAX_LINE)? {
            if how != crate::files::LineEnd::Whole {
                continue;
            }
            let Ok(entry) = serde_json::from_slice::<Entry>(&line) else {
                continue;
            };
            found.index.entry(key(&entry)).or_insert(found.len);
            found.last = found.last.max(entry.timestamp);
            found.len += 1;
            out.write_all(&line)?;
            out.write_all(b"\n")?;
        }
        out.flush()?;
        Ok(found)
    }

    /// Where `entry` is in the tail, if it is there and not passed yet.
    fn position(&self, entry: &Entry) -> Option<u64> {
        self.index
            .get(&key(entry))
            .copied()
            .filter(|at| *at >= self.next)
    }

    /// The next tail line (without its newline).
    fn next_line(&mut self) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        self.lines.read_until(b'\n', &mut line)?;
        if line.pop() != Some(b'\n') {
            return Err(io::Error::other("the set-aside entries end early"));
        }
        self.next += 1;
        Ok(line)
    }
}

/// A file read from `pos` up to `end` with positioned reads.
struct At {
    file: File,
    pos: u64,
    end: u64,
}

impl Read for At {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end.saturating_sub(self.pos);
        let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if n == 0 {
            return Ok(0);
        }
        let got = self.file.read_at(&mut buf[..n], self.pos)?;
        self.pos += got as u64;
        Ok(got)
    }
}

enum ReaderKind<'a> {
    Memory(Box<dyn Iterator<Item = &'a Entry> + 'a>),
    File {
        lines: BufReader<Box<dyn Read + Send>>,
        left: u64,
        path: PathBuf,
        line: Vec<u8>,
    },
}

/// The entries of an [`EntryLog`], oldest first.
pub(crate) struct Reader<'a> {
    inner: ReaderKind<'a>,
    index: u64,
}

impl std::fmt::Debug for Reader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("index", &self.index)
            .finish()
    }
}

impl Iterator for Reader<'_> {
    type Item = Result<Entry, EntriesError>;

    fn next(&mut self) -> Option<Self::Item> {
        let index = self.index;
        self.index += 1;
        match &mut self.inner {
            ReaderKind::Memory(it) => it.next().map(|e| Ok(e.clone())),
            ReaderKind::File {
                lines,
                left,
                path,
                line,
            } => {
                if *left == 0 {
                    return None;
                }
                *left -= 1;
                line.clear();
                let corrupt = |message: String| EntriesError::Corrupt {
                    path: path.clone(),
                    index,
                    message,
                };
                let result = match lines.read_until(b'\n', line) {
                    Ok(0) => Err(corrupt("the file ends early".into())),
                    Ok(_) => serde_json::from_slice(line).map_err(|e| corrupt(e.to_string())),
                    Err(e) => Err(EntriesError::Io {
                        path: path.clone(),
                        source: e,
                    }),
                };
                if result.is_err() {
                    // One error ends the reading: later lines cannot be
                    // trusted to line up.
                    *left = 0;
                }
                Some(result)
            }
        }
    }
}

/// In `state.json`: a log in memory is its entries (as before files);
/// a log in a file is its count and byte length.
#[derive(Serialize, Deserialize)]
struct FileState {
    file: String,
    entries: u64,
    bytes: u64,
}

impl Serialize for EntryLog {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.disk {
            None => self.mem.serialize(serializer),
            Some(d) => FileState {
                file: FILE.into(),
                entries: d.len,
                bytes: d.bytes,
            }
            .serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for EntryLog {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Either;
        impl<'de> Visitor<'de> for Either {
            type Value = EntryLog;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence of log entries or an entries file's length")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                let mem = ChunkLog::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))?;
                Ok(EntryLog {
                    mem,
                    disk: None,
                    tail: None,
                })
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let f = FileState::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(EntryLog {
                    mem: ChunkLog::new(),
                    disk: Some(OnDisk {
                        spill: None,
                        len: f.entries,
                        bytes: f.bytes,
                    }),
                    tail: None,
                })
            }
        }
        deserializer.deserialize_any(Either)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;

    fn entry(i: u64) -> Entry {
        Entry {
            component: format!("c{}", i % 3),
            operation: "step".into(),
            timestamp: 1_700_000_000.0 + i as f64 * 0.001_3,
            figures: Figures {
                cpu_ram_used_mb: 100.0 + (i % 17) as f64 / 3.0,
                ..Figures::default()
            },
            iteration: Some(i),
            ..Entry::default()
        }
    }

    fn all(log: &EntryLog) -> Vec<Entry> {
        log.read().unwrap().map(|e| e.unwrap()).collect()
    }

    #[test]
    fn a_file_log_reads_back_what_a_memory_log_holds() {
        let dir = tempfile::tempdir().unwrap();
        let mut mem = EntryLog::new();
        let mut file = EntryLog::new();
        file.create_file(&dir.path().join(FILE)).unwrap();
        // Enough entries for several batches, and a pending tail.
        for i in 0..3000 {
            mem.push(&entry(i)).unwrap();
            file.push(&entry(i)).unwrap();
        }
        assert_eq!((mem.len(), file.len()), (3000, 3000));
        let (a, b) = (all(&mem), all(&file));
        assert_eq!(a, b);
        // Exact figures: what went through the file is bit for bit the same.
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.timestamp.to_bits() == y.timestamp.to_bits()
                && x.figures.cpu_ram_used_mb.to_bits() == y.figures.cpu_ram_used_mb.to_bits()));
    }

    #[test]
    fn entries_held_before_the_file_is_attached_go_first() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = EntryLog::new();
        log.push(&entry(0)).unwrap();
        log.create_file(&dir.path().join(FILE)).unwrap();
        log.push(&entry(1)).unwrap();
        let got: Vec<u64> = all(&log).iter().map(|e| e.iteration.unwrap()).collect();
        assert_eq!(got, [0, 1]);
    }

    #[test]
    fn a_clone_reads_only_what_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = EntryLog::new();
        log.create_file(&dir.path().join(FILE)).unwrap();
        for i in 0..10 {
            log.push(&entry(i)).unwrap();
        }
        let copy = log.clone();
        for i in 10..5000 {
            log.push(&entry(i)).unwrap();
        }
        assert_eq!(all(&copy).len(), 10);
        assert_eq!(all(&log).len(), 5000);
        // Reading never disturbs appending.
        log.push(&entry(5000)).unwrap();
        assert_eq!(all(&log).last().unwrap().iteration, Some(5000));
    }

    #[test]
    fn a_state_is_cut_back_to_its_count_on_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let mut log = EntryLog::new();
        log.create_file(&path).unwrap();
        for i in 0..100 {
            log.push(&entry(i)).unwrap();
        }
        log.sync().unwrap();
        let state = serde_json::to_string(&log).unwrap();
        assert!(state.starts_with("{\"file\":\"entries.jsonl\""), "{state}");
        // Entries after the checkpoint reach the file, then the daemon dies.
        for i in 100..150 {
            log.push(&entry(i)).unwrap();
        }
        log.flush().unwrap();
        drop(log);
        let mut back: EntryLog = serde_json::from_str(&state).unwrap();
        assert!(matches!(back.read(), Err(EntriesError::Detached)));
        back.reattach(&path).unwrap();
        assert_eq!(all(&back).len(), 100);
        // The journal's records come back on top.
        back.push(&entry(100)).unwrap();
        let got: Vec<u64> = all(&back).iter().map(|e| e.iteration.unwrap()).collect();
        assert!(got.iter().copied().eq(0..101));
    }

    #[test]
    fn a_damaged_file_loses_only_its_damaged_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let mut log = EntryLog::new();
        log.create_file(&path).unwrap();
        for i in 0..10 {
            log.push(&entry(i)).unwrap();
        }
        log.sync().unwrap();
        let state = serde_json::to_string(&log).unwrap();
        let whole = std::fs::read(&path).unwrap();
        // Line 3 overwritten, the last line cut in half.
        let starts: Vec<usize> = std::iter::once(0)
            .chain(
                whole
                    .iter()
                    .enumerate()
                    .filter(|(_, &b)| b == b'\n')
                    .map(|(i, _)| i + 1),
            )
            .collect();
        let mut bytes = whole.clone();
        bytes[starts[2]] = b'#';
        bytes.truncate(starts[9] + 5);
        std::fs::write(&path, &bytes).unwrap();
        let mut back: EntryLog = serde_json::from_str(&state).unwrap();
        let lost = back.reattach(&path).unwrap();
        assert_eq!(lost.lost_entries, 2, "{lost:?}");
        assert_eq!(lost.bad_lines, vec![3, 10]);
        assert_eq!(lost.missing_bytes, (whole.len() - bytes.len()) as u64);
        assert_eq!(
            lost.dropped_bytes,
            (starts[3] - starts[2] + 5) as u64,
            "{lost:?}"
        );
        let got: Vec<u64> = all(&back).iter().map(|e| e.iteration.unwrap()).collect();
        assert_eq!(got, vec![0, 1, 3, 4, 5, 6, 7, 8]);
        // Appending goes on after the kept lines.
        back.push(&entry(10)).unwrap();
        assert_eq!(all(&back).last().unwrap().iteration, Some(10));
        // The file gone: every entry lost, recovery goes on.
        std::fs::remove_file(&path).unwrap();
        let mut back: EntryLog = serde_json::from_str(&state).unwrap();
        let lost = back.reattach(&path).unwrap();
        assert_eq!(lost.lost_entries, 10);
        assert!(all(&back).is_empty());
    }

    #[test]
    fn a_damaged_line_is_reported_with_its_place_and_ends_the_reading() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let mut log = EntryLog::new();
        log.create_file(&path).unwrap();
        for i in 0..3 {
            log.push(&entry(i)).unwrap();
        }
        log.flush().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        let second = bytes.iter().position(|&b| b == b'\n').unwrap() + 1;
        bytes[second] = b'#';
        std::fs::write(&path, &bytes).unwrap();
        let got: Vec<Result<Entry, EntriesError>> = log.read().unwrap().collect();
        assert_eq!(got.len(), 2);
        assert!(got[0].is_ok());
        let err = got[1].as_ref().unwrap_err().to_string();
        assert!(err.contains("entry 1 of") && err.contains(FILE), "{err}");
    }

    #[test]
    fn a_memory_state_reads_as_before_files() {
        let mut log = EntryLog::new();
        log.push(&entry(0)).unwrap();
        let state = serde_json::to_string(&log).unwrap();
        assert!(state.starts_with('['), "{state}");
        let back: EntryLog = serde_json::from_str(&state).unwrap();
        assert_eq!(all(&back), all(&log));
    }
}
