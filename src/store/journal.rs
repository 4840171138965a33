//! Crash safety: an append-only journal of records plus periodic state
//! checkpoints, so a run whose memtrack was killed (`kill -9`, OOM killer,
//! power loss) can be rebuilt.
//!
//! Layout inside the run directory:
//! - `.memtrack/state.json`: the whole [`Store`] at the last checkpoint
//!   (written atomically, first at start), in the checkpoint's own
//!   versioned format (see `super::checkpoint`);
//! - `.memtrack/journal.jsonl`: one `{"seq":N,"record":{…}}` line per
//!   record applied;
//! - `.memtrack/journal.old.jsonl`: the journal before the checkpoint being
//!   written, removed once that checkpoint is on disk;
//! - `.memtrack/entries.jsonl`: every event entry of the run, one JSON
//!   line each (see [`super::entries`]); the state counts how many of its
//!   bytes it covers;
//! - `.memtrack/lock`: held (`flock`) while a daemon owns the run.
//!
//! Checkpoints are written on a thread of their own from a clone of the
//! store (cheap: see `super::chunked`), because serializing a long run's
//! log takes long enough to delay ticks. The engine only flushes the
//! journal and rotates it: everything in `journal.old.jsonl` is in the
//! clone, so the file can go once the checkpoint is written. A rotation
//! that cannot open the new journal (descriptors or inodes exhausted) puts
//! the old name back and goes on appending to it: records are never
//! written into a file that a checkpoint will remove. The failure is an
//! error of its own ([`JournalError::Rotate`]), counted as a journal error.
//!
//! Every file here is created private (0600) and never through a link, in
//! a `.memtrack` folder memtrack made or checked (see [`crate::files`]);
//! recovery refuses a `.memtrack` folder that is not this user's.
//!
//! Recovery loads the state and re-applies every journalled record (old
//! journal first) with a sequence number above the state's, through the
//! same `Store::apply` that built the run live. A torn last line (the kill
//! landed mid-write) is skipped and counted. The `.memtrack` folder is
//! removed once the final `memory_usage.json` is written.

use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use serde::{Deserialize, Serialize};

use super::{Record, Store};
use crate::model::json::{write_atomic_with, write_document, WriteError, FILE_NAME};
use crate::model::RunStatus;

/// Folder of the crash-safety files inside a run directory.
pub(crate) const DIR: &str = ".memtrack";

const JOURNAL: &str = "journal.jsonl";
const OLD_JOURNAL: &str = "journal.old.jsonl";
/// The run's running totals, rewritten in place (see [`Tally`]).
const TALLY: &str = "tally.json";
/// The tally's fixed size: its bytes are written once at the start, so
/// rewriting them later needs no free space.
const TALLY_BYTES: usize = 4096;
/// The largest `state.json` recovery reads. A checkpoint holds the run's
/// bounded state (the event log is in the entries file): with the default
/// limits it stays below 64 MiB.
pub(crate) const MAX_STATE_BYTES: u64 = 256 << 20;
/// A journal line longer than this is not one of memtrack's records (a
/// mark is bounded far below it): it is skipped, never held whole.
const MAX_LINE: usize = 16 << 20;

/// What the live run had, rewritten in place at every journal flush into
/// bytes reserved at the start: when the disk is full and appends fail,
/// this still says how far the run went, so recovery can count what the
/// files lost.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Tally {
    /// The last record's sequence number.
    seq: u64,
    /// Event entries recorded.
    entries: u64,
    journal_errors: u64,
    /// The time of the last sample (or the run's end), Unix seconds.
    last: f64,
}

impl Tally {
    fn of(store: &Store) -> Tally {
        Tally {
            seq: store.seq,
            entries: store.event_entries(),
            journal_errors: store.counters().journal_errors,
            last: store.run.end.unwrap_or(store.current().timestamp),
        }
    }
}

/// The crash-safety files of one run, owned by its daemon.
#[derive(Debug)]
pub(crate) struct Journal {
    run_dir: PathBuf,
    writer: BufWriter<File>,
    _lock: File,
    /// The [`Tally`] file, its bytes reserved; `None` when even that
    /// could not be written.
    tally: Option<File>,
    /// The thread that writes checkpoints, started with the first one.
    writer_thread: Option<Checkpointer>,
    /// A checkpoint was handed to that thread and its outcome not yet read.
    pending: bool,
    /// The writer appends to `journal.old.jsonl`: a rotation renamed the
    /// journal, could not open the new one, and could not rename it back.
    /// No checkpoint starts (none may remove that file) until a rotation
    /// succeeds.
    writing_old: bool,
}

/// One long-lived thread for every checkpoint: a thread per checkpoint
/// would get a fresh malloc arena each time and let the daemon's RSS creep.
#[derive(Debug)]
struct Checkpointer {
    stores: mpsc::Sender<Store>,
    done: mpsc::Receiver<Result<(), JournalError>>,
}

impl Checkpointer {
    fn start(run_dir: PathBuf) -> io::Result<Checkpointer> {
        let (stores, todo) = mpsc::channel::<Store>();
        let (report, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("memtrack-checkpoint".into())
            .spawn(move || {
                for store in todo {
                    // The store is dropped once written.
                    let result = write_checkpoint(&run_dir, store);
                    // A checkpoint allocates and frees the whole document;
                    // without this the daemon's RSS creeps from one to
                    // the next (bench/soak, phase 1).
                    crate::sys::release_free_memory();
                    if report.send(result).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Checkpointer { stores, done })
    }
}

/// Problems opening or recovering a run directory.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot use {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("run directory {0} is in use by a live memtrack (its lock is held)")]
    Locked(PathBuf),
    #[error("{0} holds no memtrack journal (no {DIR}/state.json)")]
    NoJournal(PathBuf),
    #[error("{path} is corrupt: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error(
        "{path} is a checkpoint of version {version}, later than this memtrack reads \
         (up to {known}): recover it with the memtrack that wrote it; nothing was changed"
    )]
    LaterCheckpoint {
        path: PathBuf,
        version: u32,
        known: u32,
    },
    #[error(
        "cannot start a new journal {path} ({source}); records go on into {kept}, \
         which is kept; the checkpoint waits for the next rotation"
    )]
    Rotate {
        path: PathBuf,
        kept: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Write(#[from] WriteError),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: crate::files::shown(path),
        source,
    }
}

fn entries_err(dir: &Path) -> impl FnOnce(super::entries::EntriesError) -> JournalError + '_ {
    move |e| JournalError::Corrupt {
        path: dir.join(super::entries::FILE),
        message: e.to_string(),
    }
}

fn lock(dir: &Path) -> Result<File, JournalError> {
    let path = dir.join("lock");
    let f = crate::files::create(&path, false).map_err(io_err(&path))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(fs::TryLockError::WouldBlock) => Err(JournalError::Locked(dir.to_path_buf())),
        Err(fs::TryLockError::Error(e)) => Err(JournalError::Io { path, source: e }),
    }
}

/// Whether a live memtrack owns `run_dir` (holds its journal lock).
pub(crate) fn is_live(run_dir: &Path) -> bool {
    let path = run_dir.join(DIR).join("lock");
    match crate::files::open_write(&path) {
        Ok(f) => matches!(f.try_lock(), Err(fs::TryLockError::WouldBlock)),
        Err(_) => false,
    }
}

impl Journal {
    /// Starts the journal of a new run: takes the lock, moves the store's
    /// event log into the entries file, and writes the initial state
    /// checkpoint.
    pub(crate) fn create(run_dir: &Path, store: &mut Store) -> Result<Journal, JournalError> {
        let dir = run_dir.join(DIR);
        crate::files::private_dir(&dir).map_err(io_err(&dir))?;
        let lock = lock(&dir)?;
        store
            .keep_entries_in(&dir.join(super::entries::FILE))
            .map_err(entries_err(&dir))?;
        let path = dir.join(JOURNAL);
        let file = crate::files::create(&path, true).map_err(io_err(&path))?;
        let old = dir.join(OLD_JOURNAL);
        match fs::remove_file(&old) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&old)(e)),
        }
        let tally = reserve_tally(&dir.join(TALLY));
        let journal = Journal {
            run_dir: run_dir.to_path_buf(),
            writer: BufWriter::with_capacity(64 * 1024, file),
            _lock: lock,
            tally,
            writer_thread: None,
            pending: false,
            writing_old: false,
        };
        write_state(run_dir, store.clone())?;
        Ok(journal)
    }

    /// Appends a record (buffered; see [`Journal::flush`]).
    pub(crate) fn append(&mut self, seq: u64, record: &Record) -> io::Result<()> {
        serde_json::to_writer(&mut self.writer, &super::wire::LineOut::new(seq, record))?;
        self.writer.write_all(b"\n")
    }

    /// Hands buffered records to the kernel: after this, they survive a
    /// `kill -9` of memtrack.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }

    /// Rewrites the run's [`Tally`] in its reserved bytes (no free space
    /// needed). Best effort: the tally only helps recovery count losses.
    pub(crate) fn note_tally(&self, store: &Store) {
        use std::os::unix::fs::FileExt;
        let Some(f) = &self.tally else {
            return;
        };
        let Ok(mut bytes) = serde_json::to_vec(&Tally::of(store)) else {
            return;
        };
        if bytes.len() < TALLY_BYTES {
            bytes.resize(TALLY_BYTES, b' ');
            if let Err(e) = f.write_all_at(&bytes, 0) {
                tracing::debug!("cannot update the run's tally: {e}");
            }
        }
    }

    /// The run's document a checkpoint writes (`memory_usage.json`).
    pub(crate) fn document(&self) -> PathBuf {
        self.run_dir.join(FILE_NAME)
    }

    /// Starts a checkpoint of `store` (a clone taken now) on a thread of
    /// its own: `memory_usage.json` and the state are written there. Here
    /// the journal is flushed and, unless an earlier rotated journal is
    /// still waiting for its checkpoint, rotated. `Ok(false)`: the previous
    /// checkpoint is still being written, and this one is skipped.
    pub(crate) fn start_checkpoint(&mut self, store: Store) -> Result<bool, JournalError> {
        if self.pending {
            match self.poll_checkpoint() {
                None => return Ok(false),
                Some(Err(e)) => tracing::debug!("an earlier checkpoint failed: {e}"),
                Some(Ok(())) => {}
            }
        }
        self.flush().map_err(io_err(&self.run_dir))?;
        let dir = self.run_dir.join(DIR);
        let old = dir.join(OLD_JOURNAL);
        let current = dir.join(JOURNAL);
        if !self.writing_old && !old.exists() {
            fs::rename(&current, &old).map_err(io_err(&current))?;
            self.writing_old = true;
        }
        if self.writing_old {
            match crate::files::create_new(&current) {
                Ok(file) => {
                    self.writer = BufWriter::with_capacity(64 * 1024, file);
                    self.writing_old = false;
                }
                Err(source) => {
                    // Back to the name no checkpoint removes; a rename
                    // needs neither a descriptor nor an inode.
                    let kept = if fs::rename(&old, &current).is_ok() {
                        self.writing_old = false;
                        current.clone()
                    } else {
                        old
                    };
                    return Err(JournalError::Rotate {
                        path: current,
                        kept,
                        source,
                    });
                }
            }
        }
        if self.writer_thread.is_none() {
            let thread =
                Checkpointer::start(self.run_dir.clone()).map_err(io_err(&self.run_dir))?;
            self.writer_thread = Some(thread);
        }
        let sent = self
            .writer_thread
            .as_ref()
            .is_some_and(|t| t.stores.send(store).is_ok());
        if !sent {
            self.writer_thread = None;
            return Err(self.thread_died());
        }
        self.pending = true;
        Ok(true)
    }

    /// The outcome of the checkpoint being written, once it is done.
    pub(crate) fn poll_checkpoint(&mut self) -> Option<Result<(), JournalError>> {
        if !self.pending {
            return None;
        }
        let polled = self.writer_thread.as_ref()?.done.try_recv();
        match polled {
            Ok(result) => {
                self.pending = false;
                Some(result)
            }
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(self.lost_thread()),
        }
    }

    /// Waits for the checkpoint being written, if any.
    pub(crate) fn wait_checkpoint(&mut self) -> Option<Result<(), JournalError>> {
        if !self.pending {
            return None;
        }
        let received = self.writer_thread.as_ref()?.done.recv();
        match received {
            Ok(result) => {
                self.pending = false;
                Some(result)
            }
            Err(mpsc::RecvError) => Some(self.lost_thread()),
        }
    }

    /// The checkpoint thread is gone (it panicked): the next checkpoint
    /// starts another.
    fn lost_thread(&mut self) -> Result<(), JournalError> {
        self.pending = false;
        self.writer_thread = None;
        Err(self.thread_died())
    }

    fn thread_died(&self) -> JournalError {
        JournalError::Corrupt {
            path: self.run_dir.clone(),
            message: "the checkpoint thread stopped".into(),
        }
    }

    /// A checkpoint, written before returning.
    #[cfg(test)]
    pub(crate) fn checkpoint(&mut self, store: &Store) -> Result<(), JournalError> {
        if let Some(Err(e)) = self.wait_checkpoint() {
            tracing::debug!("an earlier checkpoint failed: {e}");
        }
        self.start_checkpoint(store.clone())?;
        self.wait_checkpoint().unwrap_or(Ok(()))
    }

    /// Writes the final document and removes the crash-safety files.
    pub(crate) fn finish(mut self, store: &Store) -> Result<(), JournalError> {
        // A checkpoint still being written must not land after the final
        // document.
        let _ = self.wait_checkpoint();
        // Left behind if the document cannot be written: recovery then
        // knows how far the run went.
        self.note_tally(store);
        self.flush().map_err(io_err(&self.run_dir))?;
        write_final(&self.run_dir, store)?;
        let dir = self.run_dir.join(DIR);
        drop(self);
        fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        Ok(())
    }
}

/// The run's final files: `memory_usage.json` and, when its event entries
/// were thinned, the complete event log beside it (gzip'd JSON lines,
/// copied from the entries file); a complete log left from an earlier run
/// in the same directory goes.
fn write_final(run_dir: &Path, store: &Store) -> Result<(), JournalError> {
    write_document(&run_dir.join(FILE_NAME), &store.document_view())?;
    let complete = run_dir.join(super::entries::COMPLETE_LOG);
    if store.events_thinned() {
        write_atomic_with(&complete, |w| {
            let mut gz = flate2::write::GzEncoder::new(w, flate2::Compression::fast());
            store.write_complete_events(&mut gz)?;
            gz.finish()?;
            Ok(())
        })?;
    } else {
        match fs::remove_file(&complete) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&complete)(e)),
        }
    }
    Ok(())
}

/// Creates the tally file with its bytes written (spaces), so that
/// rewriting them later needs no free space.
fn reserve_tally(path: &Path) -> Option<File> {
    let reserved = crate::files::create(path, true).and_then(|mut f| {
        f.write_all(&[b' '; TALLY_BYTES])?;
        f.flush()?;
        Ok(f)
    });
    match reserved {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::debug!("cannot reserve {}: {e}", path.display());
            None
        }
    }
}

/// The tally a run left, if it is readable.
fn read_tally(dir: &Path) -> Option<Tally> {
    let bytes = crate::files::read_capped(&dir.join(TALLY), TALLY_BYTES as u64).ok()?;
    serde_json::from_slice(bytes.trim_ascii()).ok()
}

/// Writes the checkpoint of `store` (the checkpoint thread's clone, or one
/// made for it) as `state.json`.
fn write_state(run_dir: &Path, store: Store) -> Result<(), JournalError> {
    let path = run_dir.join(DIR).join("state.json");
    write_atomic_with(&path, |w| {
        super::checkpoint::write(&mut *w, store).map_err(io::Error::other)
    })?;
    Ok(())
}

/// The checkpoint thread's work: the document, then the state; then the
/// rotated journal, whose every record the state now holds, goes.
fn write_checkpoint(run_dir: &Path, store: Store) -> Result<(), JournalError> {
    write_document(&run_dir.join(FILE_NAME), &store.document_view())?;
    // The state counts the entries file's bytes: they are on disk first.
    let entries = run_dir.join(DIR).join(super::entries::FILE);
    store.sync_entries().map_err(io_err(&entries))?;
    write_state(run_dir, store)?;
    let old = run_dir.join(DIR).join(OLD_JOURNAL);
    match fs::remove_file(&old) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&old)(e)),
    }
}

/// What recovery found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub replayed: u64,
    pub skipped_lines: u64,
    /// What a damaged entries file lost (nothing, usually).
    pub lost: super::entries::Salvaged,
    /// Journal records found missing: gaps in the numbering, and records
    /// past the journal's end that the run's tally counted.
    pub records_lost: u64,
    /// Log entries put back from the entries file whose journal records
    /// were lost (they are in the log; what their records carried beyond
    /// the entry is not).
    pub from_entries_only: u64,
    /// Event entries the run had that no file holds any more (the tally
    /// counted them).
    pub entries_missing: u64,
    /// Where the crash-safety files were kept, when anything was lost
    /// (they are evidence; never removed then).
    pub kept: Option<PathBuf>,
}

impl Recovered {
    /// Whether the recovered document lacks anything the run had. A
    /// damaged journal line shows as a gap in the numbering; a torn last
    /// line (the kill landed mid-write) is a record whose write never
    /// completed, and no loss of what was on disk.
    pub fn lost_anything(&self) -> bool {
        !self.lost.is_nothing()
            || self.records_lost > 0
            || self.from_entries_only > 0
            || self.entries_missing > 0
    }
}

/// Whether `run_dir` holds an unfinished journal.
pub fn has_journal(run_dir: &Path) -> bool {
    run_dir.join(DIR).join("state.json").is_file()
}

/// Reads a checkpoint's state: at most [`MAX_STATE_BYTES`], parsed as it
/// is read (never held whole as text); one of a later version than this
/// memtrack knows is refused as such.
fn read_state(path: &Path) -> Result<Store, JournalError> {
    let file = crate::files::open_input(path).map_err(io_err(path))?;
    let size = file.metadata().map_err(io_err(path))?.len();
    let too_large = || JournalError::Corrupt {
        path: path.to_path_buf(),
        message: format!(
            "larger than {MAX_STATE_BYTES} bytes ({size}): not a checkpoint memtrack wrote; \
             nothing was changed"
        ),
    };
    if size > MAX_STATE_BYTES {
        return Err(too_large());
    }
    use super::checkpoint::ReadError;
    super::checkpoint::read(file, MAX_STATE_BYTES).map_err(|e| match e {
        ReadError::Later(version) => JournalError::LaterCheckpoint {
            path: path.to_path_buf(),
            version,
            known: super::checkpoint::VERSION,
        },
        ReadError::Io(source) => io_err(path)(source),
        ReadError::Json(e) => JournalError::Corrupt {
            path: path.to_path_buf(),
            message: e.to_string(),
        },
    })
}

/// The time a record carries, if any.
fn record_time(record: &Record) -> Option<f64> {
    match record {
        Record::Sample { sample, .. } => Some(sample.timestamp),
        Record::Mark(m) => Some(m.timestamp),
        Record::SpanBegin(b) | Record::SpanEnd(b) | Record::StageBegin(b) | Record::StageEnd(b) => {
            Some(b.mark.timestamp)
        }
        Record::Finish { timestamp, .. } => Some(*timestamp),
        Record::Exit { .. } | Record::Flight(_) | Record::JournalErrors { .. } => None,
    }
}

/// Rebuilds the store of a run whose daemon died, without writing its
/// document. Every source that survived is used: the state, the journal
/// (a damaged line or a gap loses only its records), the entries file
/// (entries written after the checkpoint whose records the journal lost
/// are put back in their place), and the run's tally, which says how far
/// the run went when the files stop earlier (a full disk). What is missing
/// is counted in the store (`entries_lost`, `records_lost`,
/// `journal_errors`), and the last time any source saw is returned.
pub(crate) fn replay(run_dir: &Path) -> Result<(Store, Recovered, f64), JournalError> {
    let dir = run_dir.join(DIR);
    let state_path = dir.join("state.json");
    if !state_path.is_file() {
        return Err(JournalError::NoJournal(run_dir.to_path_buf()));
    }
    let mut store = read_state(&state_path)?;
    // Entries written after the checkpoint are set aside and the file cut
    // back; they come back with the journal's records, or from there.
    let lost = store
        .reattach_entries(&dir.join(super::entries::FILE))
        .map_err(entries_err(&dir))?;
    let mut report = Recovered {
        replayed: 0,
        skipped_lines: 0,
        lost,
        records_lost: 0,
        from_entries_only: 0,
        entries_missing: 0,
        kept: None,
    };
    let mut last = 0.0f64;
    // The rotated journal (a checkpoint was being written) comes first.
    for journal_path in [dir.join(OLD_JOURNAL), dir.join(JOURNAL)] {
        let Ok(f) = crate::files::open_input(&journal_path) else {
            continue;
        };
        let mut reader = BufReader::new(f);
        let mut line = Vec::new();
        while let Some(how) = crate::files::read_line_bounded(&mut reader, &mut line, MAX_LINE)
            .map_err(io_err(&journal_path))?
        {
            if line.is_empty() {
                continue;
            }
            let parsed = match how {
                crate::files::LineEnd::TooLong => None,
                _ => super::wire::read_line(&line),
            };
            match parsed {
                Some((seq, record)) if seq > store.seq => {
                    // Records the journal should hold between the two.
                    report.records_lost += seq - store.seq - 1;
                    if let Some(t) = record_time(&record) {
                        last = last.max(t);
                    }
                    store.apply(&record);
                    store.seq = seq;
                    report.replayed += 1;
                }
                Some(_) => {}
                None => report.skipped_lines += 1,
            }
        }
    }
    let (from_entries_only, tail_last) = store
        .finish_entries_tail()
        .map_err(io_err(&dir.join(super::entries::FILE)))?;
    report.from_entries_only = from_entries_only;
    last = last.max(tail_last);
    let mut entries_lost = report.lost.lost_entries;
    if let Some(tally) = read_tally(&dir) {
        // Past the journal's end: appends the disk refused, a journal cut
        // short or gone.
        report.records_lost += tally.seq.saturating_sub(store.seq);
        report.entries_missing = tally.entries.saturating_sub(store.event_entries());
        entries_lost = entries_lost.max(report.entries_missing);
        let c = store.counters_mut();
        c.journal_errors = c.journal_errors.max(tally.journal_errors);
        last = last.max(tally.last);
    }
    // Recorded in the document: its log lacks these entries, and what
    // these records carried.
    store.counters_mut().entries_lost += entries_lost;
    store.counters_mut().records_lost += report.records_lost;
    Ok((store, report, last))
}

/// `memtrack recover DIR`: rebuilds `memory_usage.json` of a run whose
/// daemon died and marks it `recovered`, ending at the last time any of
/// its files saw. A `.memtrack` folder that is not this user's own
/// (another user's, a link) is refused before anything in it is opened.
/// The crash-safety files are removed only when the document holds
/// everything they did; when anything was lost they are evidence, kept as
/// `.memtrack.recovered` (never recovered again), and the report says
/// where.
pub fn recover(run_dir: &Path) -> Result<Recovered, JournalError> {
    let dir = run_dir.join(DIR);
    if !dir.join("state.json").is_file() {
        return Err(JournalError::NoJournal(run_dir.to_path_buf()));
    }
    crate::files::check_dir(&dir).map_err(io_err(&dir))?;
    let lock = lock(&dir)?;
    let (mut store, mut report, last) = replay(run_dir)?;
    if !store.is_finished() {
        let end = store.current().timestamp.max(last).max(store.run.start);
        store.run.end = Some(end);
        store.run.status = RunStatus::Recovered;
    }
    write_final(run_dir, &store)?;
    drop(store);
    drop(lock);
    if report.lost_anything() {
        report.kept = Some(set_aside(run_dir, RECOVERED_DIR)?);
    } else {
        fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    }
    Ok(report)
}

/// Where the crash-safety files of a recovery that lost something are
/// kept: never recovered again, never removed by memtrack.
pub(crate) const RECOVERED_DIR: &str = ".memtrack.recovered";

/// Renames the run's `.memtrack` to `name` (or `name-2`, `-3`, … when
/// taken); a rename needs no free space. Returns the new path.
fn set_aside(run_dir: &Path, name: &str) -> Result<PathBuf, JournalError> {
    let dir = run_dir.join(DIR);
    let mut kept = run_dir.join(name);
    let mut n = 2;
    while fs::symlink_metadata(&kept).is_ok() {
        kept = run_dir.join(format!("{name}-{n}"));
        n += 1;
    }
    fs::rename(&dir, &kept).map_err(io_err(&dir))?;
    Ok(kept)
}

/// Where the crash-safety files go when the run's final document was
/// written elsewhere: kept for a reader, never recovered.
pub(crate) const SUPERSEDED_DIR: &str = ".memtrack.superseded";

/// Inside [`SUPERSEDED_DIR`]: the path of the complete document.
pub(crate) const FINAL_NOTE: &str = "final-document";

/// The run's complete document went to `final_doc` because the run
/// directory could not take it (a full disk). The journal left in the run
/// directory holds only part of the run (appends failed too), so it must
/// never be recovered over anything: it is renamed to
/// [`SUPERSEDED_DIR`] (a rename needs no free space) with a note naming
/// `final_doc`, written if the disk allows. Returns where it now is.
pub(crate) fn supersede(run_dir: &Path, final_doc: &Path) -> Result<PathBuf, JournalError> {
    let dir = run_dir.join(DIR);
    let mut kept = run_dir.join(SUPERSEDED_DIR);
    let mut n = 2;
    while fs::symlink_metadata(&kept).is_ok() {
        kept = run_dir.join(format!("{SUPERSEDED_DIR}-{n}"));
        n += 1;
    }
    if fs::rename(&dir, &kept).is_err() {
        // Without its state, nothing recovers the journal.
        let state = dir.join("state.json");
        fs::remove_file(&state).map_err(io_err(&state))?;
        kept = dir;
    }
    let note = format!("{}\n", final_doc.display());
    if let Err(e) = crate::model::json::write_atomic(&kept.join(FINAL_NOTE), note.as_bytes()) {
        tracing::debug!("cannot note where the final document went: {e}");
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{every_fold_gpus, every_fold_records, every_fold_run_info};
    use super::*;
    use crate::model::{Document, RunInfo};
    use crate::sample::host::HostProcessReading;
    use crate::sample::Sample;
    use crate::store::pressure::Thresholds;
    use crate::store::{Limits, SampleKind};
    use std::fs::OpenOptions;

    fn sample(ts: f64, rss_mb: u64) -> Record {
        let mut s = Sample {
            timestamp: ts,
            ..Sample::default()
        };
        s.host.processes.push(HostProcessReading {
            pid: 1,
            rss: rss_mb << 20,
            hwm: rss_mb << 20,
            ..HostProcessReading::default()
        });
        Record::Sample {
            kind: SampleKind::Timer,
            sample: Box::new(s),
        }
    }

    #[test]
    fn killed_daemon_is_recovered_from_checkpoint_and_journal() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let mut journal = Journal::create(dir.path(), &mut store).unwrap();
        for i in 0..10u64 {
            let r = sample(i as f64, 100 + i);
            store.apply(&r);
            journal.append(store.seq, &r).unwrap();
            if i == 4 {
                journal.checkpoint(&store).unwrap();
            }
        }
        journal.flush().unwrap();
        // A torn line, as a kill mid-write leaves.
        let jpath = dir.path().join(DIR).join("journal.jsonl");
        let mut f = OpenOptions::new().append(true).open(&jpath).unwrap();
        f.write_all(b"{\"seq\":11,\"record\":{\"rec").unwrap();
        // The daemon "dies": its lock goes with it.
        drop(journal);

        let report = recover(dir.path()).unwrap();
        assert_eq!((report.replayed, report.skipped_lines), (5, 1));
        let doc: Document =
            serde_json::from_slice(&fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        assert_eq!(doc.run.status, "recovered");
        assert_eq!(doc.detailed_log.len(), 10, "every journalled sample");
        assert_eq!(doc.peak_usage.figures.cpu_ram_used_mb, 109.0);
        assert!(!dir.path().join(DIR).exists());
    }

    #[test]
    fn a_kill_while_a_checkpoint_is_written_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let mut journal = Journal::create(dir.path(), &mut store).unwrap();
        let add = |store: &mut Store, journal: &mut Journal, i: u64| {
            let r = sample(i as f64, 100 + i);
            store.apply(&r);
            journal.append(store.seq, &r).unwrap();
        };
        for i in 0..5 {
            add(&mut store, &mut journal, i);
        }
        // A background checkpoint, and records arriving meanwhile.
        assert!(journal.start_checkpoint(store.clone()).unwrap());
        for i in 5..8 {
            add(&mut store, &mut journal, i);
        }
        journal.wait_checkpoint().unwrap().unwrap();
        assert!(!dir.path().join(DIR).join(OLD_JOURNAL).exists());
        // The next checkpoint rotates the journal and is killed before it
        // writes anything: the rotated journal still holds its records.
        journal.flush().unwrap();
        let d = dir.path().join(DIR);
        fs::rename(d.join(JOURNAL), d.join(OLD_JOURNAL)).unwrap();
        for i in 8..10 {
            add(&mut store, &mut journal, i);
        }
        journal.flush().unwrap();
        File::create(d.join(JOURNAL)).unwrap();
        drop(journal);

        let report = recover(dir.path()).unwrap();
        assert_eq!(report.replayed, 5, "{report:?}");
        let doc: Document =
            serde_json::from_slice(&fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        assert_eq!(doc.detailed_log.len(), 10, "every journalled sample");
        assert_eq!(doc.peak_usage.figures.cpu_ram_used_mb, 109.0);
    }

    fn mark(ts: f64, i: u64) -> Record {
        Record::Mark(crate::store::Mark {
            timestamp: ts,
            pid: Some(1),
            component: format!("c{}", i % 5),
            operation: "step".into(),
            iteration: Some(i),
            labels: Default::default(),
            allocator: None,
            kind: crate::model::EntryKind::Event,
        })
    }

    #[test]
    fn marks_after_the_last_checkpoint_are_recovered_once_each() {
        // The entries file holds marks written after the checkpoint; the
        // state's count cuts them off and the journal brings them back.
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let mut journal = Journal::create(dir.path(), &mut store).unwrap();
        for i in 0..3000u64 {
            let r = mark(i as f64, i);
            store.apply(&r);
            journal.append(store.seq, &r).unwrap();
            if i == 1000 {
                journal.checkpoint(&store).unwrap();
            }
        }
        journal.flush().unwrap();
        store.sync_entries().unwrap();
        drop(journal);
        let report = recover(dir.path()).unwrap();
        assert_eq!(report.replayed, 1999);
        let doc: Document =
            serde_json::from_slice(&fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        let got: Vec<u64> = doc
            .detailed_log
            .iter()
            .filter_map(|e| e.iteration)
            .collect();
        assert!(got.iter().copied().eq(0..3000), "{} marks", got.len());
    }

    #[test]
    fn a_thinned_run_keeps_its_complete_log_beside_the_json_and_readers_use_it() {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits {
            max_event_entries: 1024,
            ..Limits::default()
        };
        let mut store = Store::new(RunInfo::default(), limits, Thresholds::default());
        let mut plain = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let mut journal = Journal::create(dir.path(), &mut store).unwrap();
        for i in 0..20_000u64 {
            let t = i as f64 * 0.01;
            for r in [sample(t, 100 + i % 300), mark(t + 0.005, i)] {
                if i % 10 == 0 || matches!(r, Record::Mark(_)) {
                    store.apply(&r);
                    plain.apply(&r);
                    journal.append(store.seq, &r).unwrap();
                }
            }
        }
        let end = Record::Finish {
            timestamp: 300.0,
            exit: None,
        };
        store.apply(&end);
        plain.apply(&end);
        journal.finish(&store).unwrap();
        let doc: Document =
            serde_json::from_slice(&fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        assert!(doc.detailed_log.len() < 4000, "{}", doc.detailed_log.len());
        let complete = dir.path().join(crate::store::entries::COMPLETE_LOG);
        assert!(complete.is_file());
        // Readers see the complete log: what an unbounded run writes.
        let mut log = Vec::new();
        let back = crate::report::read::read_complete(&dir.path().join(FILE_NAME), |e| log.push(e))
            .unwrap();
        let expected = plain.document();
        assert_eq!(log.len(), expected.detailed_log.len());
        assert!(log == expected.detailed_log, "the complete logs differ");
        assert_eq!(back.peak_usage, expected.peak_usage);
        // A later, short run in the same directory removes it.
        let mut short = Store::new(RunInfo::default(), limits, Thresholds::default());
        let journal = Journal::create(dir.path(), &mut short).unwrap();
        short.apply(&mark(1.0, 1));
        journal.finish(&short).unwrap();
        assert!(!complete.exists());
    }

    #[test]
    fn a_live_run_cannot_be_recovered_under_its_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let _journal = Journal::create(dir.path(), &mut store).unwrap();
        assert!(matches!(recover(dir.path()), Err(JournalError::Locked(_))));
    }

    #[test]
    fn a_superseded_journal_is_kept_and_never_recovered() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let journal = Journal::create(dir.path(), &mut store).unwrap();
        drop(journal);
        assert!(has_journal(dir.path()));
        let elsewhere = dir.path().join("complete.json");
        let kept = supersede(dir.path(), &elsewhere).unwrap();
        assert_eq!(kept, dir.path().join(SUPERSEDED_DIR));
        assert!(!has_journal(dir.path()));
        assert!(matches!(
            recover(dir.path()),
            Err(JournalError::NoJournal(_))
        ));
        let note = fs::read_to_string(kept.join(FINAL_NOTE)).unwrap();
        assert_eq!(note.trim(), elsewhere.display().to_string());
        assert!(kept.join("journal.jsonl").exists(), "kept for a reader");
        // A second superseded run in the same folder keeps the first.
        let journal = Journal::create(dir.path(), &mut store).unwrap();
        drop(journal);
        let second = supersede(dir.path(), &elsewhere).unwrap();
        assert_eq!(second, dir.path().join(format!("{SUPERSEDED_DIR}-2")));
    }

    #[test]
    fn a_linked_journal_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = tempfile::tempdir().unwrap();
        let mut store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        drop(Journal::create(real.path(), &mut store).unwrap());
        std::os::unix::fs::symlink(real.path().join(DIR), dir.path().join(DIR)).unwrap();
        let err = recover(dir.path()).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert!(!dir.path().join(FILE_NAME).exists());
        let err = Journal::create(dir.path(), &mut store).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }

    /// Runs the records of [`every_fold_records`] as a daemon does:
    /// GPUs described, the journal created, a checkpoint after the first
    /// part, the rest journalled only; then the daemon "dies" (its lock
    /// goes, the journal is not finished). Returns the store it held.
    fn run_every_fold(run_dir: &Path) -> Store {
        let mut store = Store::new(
            every_fold_run_info(),
            Limits::default(),
            Thresholds::default(),
        );
        let (devices, attribution) = every_fold_gpus();
        store.describe_gpus(&devices, attribution);
        let mut journal = Journal::create(run_dir, &mut store).unwrap();
        let (before, after) = every_fold_records();
        for r in &before {
            store.apply(r);
            journal.append(store.seq, r).unwrap();
        }
        journal.checkpoint(&store).unwrap();
        for r in &after {
            store.apply(r);
            journal.append(store.seq, r).unwrap();
        }
        journal.flush().unwrap();
        drop(journal);
        store
    }

    /// The `.memtrack` folder of [`run_every_fold`] as an older memtrack
    /// wrote it: produced with the store of commit 40aa9bc (before each
    /// fold kept its state in a struct of its own) by calling
    /// `run_every_fold` on a temporary directory and copying its
    /// `state.json`, `entries.jsonl` and `journal.jsonl` here unchanged.
    /// Never regenerate it: it stands for the checkpoints that runs of
    /// that version left behind.
    fn old_checkpoint(file: &str) -> Vec<u8> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/old_checkpoint")
            .join(file);
        fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// Keys of log entries added after the old checkpoint was written: a
    /// run today has them from the fixture's samples, a checkpoint of then
    /// cannot.
    const ADDED_SINCE_FIXTURE: &[&str] = &["charge_mb", "charge_hwm_mb"];

    /// `v` without the keys of [`ADDED_SINCE_FIXTURE`], at any depth.
    fn without_added(mut v: serde_json::Value) -> serde_json::Value {
        match &mut v {
            serde_json::Value::Object(m) => {
                for k in ADDED_SINCE_FIXTURE {
                    m.remove(*k);
                }
                for x in m.values_mut() {
                    *x = without_added(x.take());
                }
            }
            serde_json::Value::Array(a) => {
                for x in a.iter_mut() {
                    *x = without_added(x.take());
                }
            }
            _ => {}
        }
        v
    }

    /// Every value `old` holds is in `now`, the same (objects may have
    /// gained keys): names the first path that differs.
    fn holds(now: &serde_json::Value, old: &serde_json::Value, path: &str) -> Result<(), String> {
        use serde_json::Value;
        match (now, old) {
            (Value::Object(n), Value::Object(o)) => o.iter().try_for_each(|(k, v)| {
                let at = format!("{path}.{k}");
                match n.get(k) {
                    Some(nv) => holds(nv, v, &at),
                    None => Err(format!("{at} is gone")),
                }
            }),
            (Value::Array(n), Value::Array(o)) if n.len() == o.len() => n
                .iter()
                .zip(o)
                .enumerate()
                .try_for_each(|(i, (nv, ov))| holds(nv, ov, &format!("{path}[{i}]"))),
            _ if now == old => Ok(()),
            _ => Err(format!("{path}: was {old}, now {now}")),
        }
    }

    #[test]
    fn holds_names_a_lost_or_changed_value() {
        let old = serde_json::json!({"a": {"b": [1, {"c": 2}]}, "d": 3});
        let mut now = old.clone();
        now["e"] = 4.into();
        assert_eq!(holds(&now, &old, "s"), Ok(()), "a new key is no loss");
        now["a"]["b"][1]["c"] = 5.into();
        assert_eq!(
            holds(&now, &old, "s"),
            Err("s.a.b[1].c: was 2, now 5".into())
        );
        let mut now = old.clone();
        now.as_object_mut().unwrap().remove("d");
        assert_eq!(holds(&now, &old, "s"), Err("s.d is gone".into()));
    }

    fn value<T: Serialize + ?Sized>(v: &T) -> serde_json::Value {
        serde_json::to_value(v).unwrap()
    }

    fn is_empty(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(m) => m.is_empty(),
            serde_json::Value::Array(a) => a.is_empty(),
            _ => v.is_null(),
        }
    }

    #[test]
    fn an_old_checkpoint_loads_with_every_value_it_held() {
        let bytes = old_checkpoint("state.json");
        let old: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert!(
            old.get("v").is_none(),
            "written before checkpoints had a version"
        );
        let store = super::super::checkpoint::read(io::Cursor::new(&bytes), MAX_STATE_BYTES)
            .unwrap_or_else(|e| panic!("the old checkpoint does not load: {e}"));
        let now = super::super::checkpoint::to_value(&store);
        if let Err(e) = holds(&now, &old, "state") {
            panic!("the old checkpoint does not come back whole: {e}");
        }
        // What the accessors read is what the file held.
        assert_eq!(old["seq"], store.seq);
        assert_eq!(old["run"], value(&store.run));
        assert_eq!(old["current"], value(store.current()));
        assert_eq!(old["peaks"], value(store.peaks()));
        assert_eq!(old["counters"], value(store.counters()));
        assert_eq!(old["levels"], value(store.levels()));
        assert_eq!(old["stages"], value(&store.stages()));
        assert_eq!(old["gpu_attribution"], value(&store.gpu_attribution()));
        let gpus: Vec<&crate::model::Gpu> = store.gpus().collect();
        let old_gpus: Vec<&serde_json::Value> = old["gpus"].as_object().unwrap().values().collect();
        assert_eq!(
            serde_json::to_value(&gpus).unwrap(),
            serde_json::json!(old_gpus)
        );
        let live: Vec<&crate::model::Target> = store.live_targets().collect();
        let old_live: Vec<&serde_json::Value> = old["live"]
            .as_object()
            .unwrap()
            .values()
            .map(|l| &l["target"])
            .collect();
        assert_eq!(
            serde_json::to_value(&live).unwrap(),
            serde_json::json!(old_live)
        );
        let spans: Vec<String> = store.open_spans().collect();
        let old_spans: Vec<String> = old["spans"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s["component"].as_str().unwrap(),
                    s["operation"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(spans, old_spans);
        let gone = &old["gone"][0];
        assert_eq!(
            store
                .target_name(gone["pid"].as_u64().unwrap() as u32)
                .as_deref(),
            gone["name"].as_str()
        );
        // The fixture is what its comment says: no fold left empty.
        for key in [
            "live",
            "gone",
            "gpus",
            "spans",
            "stages",
            "alerts",
            "levels",
            "by_component",
            "event_counts",
            "allocator_now",
            "flights",
        ] {
            assert!(!is_empty(&old[key]), "the old checkpoint's {key} is empty");
        }
        assert!(!is_empty(&old["timer"]["done"]));
        assert!(!old["host"]["earlier"].as_array().unwrap().is_empty());
        assert!(old["gone"][0]["exit"].is_object());
    }

    #[test]
    fn an_old_checkpoint_and_its_journal_recover_what_the_run_held() {
        let dir = tempfile::tempdir().unwrap();
        let memtrack = dir.path().join(DIR);
        crate::files::private_dir(&memtrack).unwrap();
        for file in ["state.json", super::super::entries::FILE, JOURNAL] {
            let mut f = crate::files::create(&memtrack.join(file), true).unwrap();
            f.write_all(&old_checkpoint(file)).unwrap();
        }
        let (recovered, report, _) = replay(dir.path()).unwrap();
        let (_, after) = every_fold_records();
        assert_eq!(report.replayed, after.len() as u64);
        assert!(!report.lost_anything(), "{report:?}");
        // The same run today, never killed: recovery gives what it holds.
        let live_dir = tempfile::tempdir().unwrap();
        let live = run_every_fold(live_dir.path());
        live.sync_entries().unwrap();
        recovered.sync_entries().unwrap();
        let state = |s: &Store| {
            let mut v = super::super::checkpoint::to_value(s);
            v.as_object_mut().unwrap().remove("events");
            without_added(v)
        };
        let (got, want) = (state(&recovered), state(&live));
        if let Err(e) = holds(&got, &want, "live").and(holds(&want, &got, "recovered")) {
            panic!("recovery differs from the live run: {e}");
        }
        assert!(
            without_added(value(&recovered.document())) == without_added(value(&live.document())),
            "the documents differ"
        );
        assert_eq!(recovered.event_entries(), live.event_entries());
    }

    #[test]
    fn nothing_to_recover_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = recover(dir.path()).unwrap_err();
        assert!(err.to_string().contains("no .memtrack/state.json"), "{err}");
    }
}
