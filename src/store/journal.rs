//! Crash safety: an append-only journal of records plus periodic state
//! checkpoints, so a run whose memtrack was killed (`kill -9`, OOM killer,
//! power loss) can be rebuilt.
//!
//! Layout inside the run directory:
//! - `.memtrack/state.json`: the whole [`Store`] at the last checkpoint
//!   (written atomically, first at start);
//! - `.memtrack/journal.jsonl`: one `{"seq":N,"record":{…}}` line per
//!   record applied since; truncated after each checkpoint;
//! - `.memtrack/lock`: held (`flock`) while a daemon owns the run.
//!
//! Recovery loads the state and re-applies every journalled record with a
//! sequence number above the state's, through the same `Store::apply` that
//! built the run live. A torn last line (the kill landed mid-write) is
//! skipped and counted. The `.memtrack` folder is removed once the final
//! `memory_usage.json` is written.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Record, Store};
use crate::export::json::{write_atomic_with, write_document, WriteError, FILE_NAME};

/// Folder of the crash-safety files inside a run directory.
pub const DIR: &str = ".memtrack";

#[derive(Serialize)]
struct LineOut<'a> {
    seq: u64,
    record: &'a Record,
}

#[derive(Deserialize)]
struct LineIn {
    seq: u64,
    record: Record,
}

/// The crash-safety files of one run, owned by its daemon.
#[derive(Debug)]
pub struct Journal {
    run_dir: PathBuf,
    writer: BufWriter<File>,
    _lock: File,
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
    #[error(transparent)]
    Write(#[from] WriteError),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn lock(dir: &Path) -> Result<File, JournalError> {
    let path = dir.join("lock");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(fs::TryLockError::WouldBlock) => Err(JournalError::Locked(dir.to_path_buf())),
        Err(fs::TryLockError::Error(e)) => Err(JournalError::Io { path, source: e }),
    }
}

/// Whether a live memtrack owns `run_dir` (holds its journal lock).
pub fn is_live(run_dir: &Path) -> bool {
    let path = run_dir.join(DIR).join("lock");
    match OpenOptions::new().write(true).open(&path) {
        Ok(f) => matches!(f.try_lock(), Err(fs::TryLockError::WouldBlock)),
        Err(_) => false,
    }
}

impl Journal {
    /// Starts the journal of a new run: takes the lock and writes the
    /// initial state checkpoint.
    pub fn create(run_dir: &Path, store: &Store) -> Result<Journal, JournalError> {
        let dir = run_dir.join(DIR);
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let lock = lock(&dir)?;
        let path = dir.join("journal.jsonl");
        let file = File::create(&path).map_err(io_err(&path))?;
        let mut journal = Journal {
            run_dir: run_dir.to_path_buf(),
            writer: BufWriter::with_capacity(64 * 1024, file),
            _lock: lock,
        };
        journal.write_state(store)?;
        Ok(journal)
    }

    /// Appends a record (buffered; see [`Journal::flush`]).
    pub fn append(&mut self, seq: u64, record: &Record) -> io::Result<()> {
        serde_json::to_writer(&mut self.writer, &LineOut { seq, record })?;
        self.writer.write_all(b"\n")
    }

    /// Hands buffered records to the kernel: after this, they survive a
    /// `kill -9` of memtrack.
    pub fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }

    fn write_state(&mut self, store: &Store) -> Result<(), JournalError> {
        let path = self.run_dir.join(DIR).join("state.json");
        write_atomic_with(&path, |w| {
            serde_json::to_writer(&mut *w, store).map_err(io::Error::other)
        })?;
        Ok(())
    }

    /// Writes `memory_usage.json` and a state checkpoint, then starts the
    /// journal afresh. Records up to `store.seq` are in the checkpoint.
    pub fn checkpoint(&mut self, store: &Store) -> Result<(), JournalError> {
        self.flush().map_err(io_err(&self.run_dir))?;
        write_document(&self.run_dir.join(FILE_NAME), &store.document())?;
        self.write_state(store)?;
        let path = self.run_dir.join(DIR).join("journal.jsonl");
        let file = File::create(&path).map_err(io_err(&path))?;
        self.writer = BufWriter::with_capacity(64 * 1024, file);
        Ok(())
    }

    /// Writes the final document and removes the crash-safety files.
    pub fn finish(mut self, store: &Store) -> Result<(), JournalError> {
        self.flush().map_err(io_err(&self.run_dir))?;
        write_document(&self.run_dir.join(FILE_NAME), &store.document())?;
        let dir = self.run_dir.join(DIR);
        drop(self);
        fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        Ok(())
    }
}

/// What recovery found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub replayed: u64,
    pub skipped_lines: u64,
}

/// Whether `run_dir` holds an unfinished journal.
pub fn has_journal(run_dir: &Path) -> bool {
    run_dir.join(DIR).join("state.json").is_file()
}

/// Rebuilds the store of a run whose daemon died, without writing.
pub fn replay(run_dir: &Path) -> Result<(Store, Recovered), JournalError> {
    let dir = run_dir.join(DIR);
    let state_path = dir.join("state.json");
    if !state_path.is_file() {
        return Err(JournalError::NoJournal(run_dir.to_path_buf()));
    }
    let bytes = fs::read(&state_path).map_err(io_err(&state_path))?;
    let mut store: Store = serde_json::from_slice(&bytes).map_err(|e| JournalError::Corrupt {
        path: state_path.clone(),
        message: e.to_string(),
    })?;
    let mut report = Recovered {
        replayed: 0,
        skipped_lines: 0,
    };
    let journal_path = dir.join("journal.jsonl");
    if let Ok(f) = File::open(&journal_path) {
        for line in BufReader::new(f).split(b'\n') {
            let line = line.map_err(io_err(&journal_path))?;
            if line.is_empty() {
                continue;
            }
            match serde_json::from_slice::<LineIn>(&line) {
                Ok(l) if l.seq > store.seq => {
                    store.apply(&l.record);
                    store.seq = l.seq;
                    report.replayed += 1;
                }
                Ok(_) => {}
                Err(_) => report.skipped_lines += 1,
            }
        }
    }
    Ok((store, report))
}

/// `memtrack recover DIR`: rebuilds `memory_usage.json` of a run whose
/// daemon died, marks it `recovered`, and removes the journal.
pub fn recover(run_dir: &Path) -> Result<Recovered, JournalError> {
    let dir = run_dir.join(DIR);
    if !dir.join("state.json").is_file() {
        return Err(JournalError::NoJournal(run_dir.to_path_buf()));
    }
    let lock = lock(&dir)?;
    let (mut store, report) = replay(run_dir)?;
    if !store.is_finished() {
        let end = store.current().timestamp.max(store.run.start);
        store.run.end = Some(end);
        store.run.status = "recovered".into();
    }
    write_document(&run_dir.join(FILE_NAME), &store.document())?;
    drop(lock);
    fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Document, RunInfo};
    use crate::sample::procfs::Reading;
    use crate::sample::Sample;
    use crate::store::pressure::Thresholds;
    use crate::store::{Limits, SampleKind};

    fn sample(ts: f64, rss_mb: u64) -> Record {
        let mut s = Sample {
            timestamp: ts,
            ..Sample::default()
        };
        s.host.processes.push(Reading {
            pid: 1,
            rss: rss_mb << 20,
            hwm: rss_mb << 20,
            pss: None,
            uss: None,
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
        let mut journal = Journal::create(dir.path(), &store).unwrap();
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
        assert_eq!(
            report,
            Recovered {
                replayed: 5,
                skipped_lines: 1
            }
        );
        let doc: Document =
            serde_json::from_slice(&fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap();
        assert_eq!(doc.run.status, "recovered");
        assert_eq!(doc.detailed_log.len(), 10, "every journalled sample");
        assert_eq!(doc.peak_usage.cpu_ram_used_mb, 109.0);
        assert!(!dir.path().join(DIR).exists());
    }

    #[test]
    fn a_live_run_cannot_be_recovered_under_its_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let _journal = Journal::create(dir.path(), &store).unwrap();
        assert!(matches!(recover(dir.path()), Err(JournalError::Locked(_))));
    }

    #[test]
    fn nothing_to_recover_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = recover(dir.path()).unwrap_err();
        assert!(err.to_string().contains("no .memtrack/state.json"), "{err}");
    }
}
