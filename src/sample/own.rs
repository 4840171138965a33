//! Each process's own cost — USS (the pages it alone maps) and Pss (its
//! proportional share) from `/proc/PID/smaps_rollup` — read on a thread of
//! its own, within a share of one core.
//!
//! A `smaps_rollup` read makes the kernel walk the process's page tables
//! (time grows with the RSS; `cargo bench --bench tick` prints one pass
//! over a tree), so it never runs on the sampling thread: the
//! sampler hands the reader a batch of processes, those whose reading is
//! worth most first ([`super::cost`]),
//! with the CPU time the budget allows; the reader reads until that is
//! spent and hands the figures back, which the next sample picks up. The
//! budget is counted in the reader thread's own CPU time.
//!
//! The same thread reads the tree's distinct pages ([`super::pages`]) in
//! slices within the same budget.

use std::io::{self, Read};
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

use super::pages::{self, Pass, Slice};
use super::parse::{parse_smaps_rollup, smaps_rollup_rss};
use super::pss;
use crate::sys;

/// One process's read: `(pss, uss)` in bytes, or why not, and the
/// resident bytes it found.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OwnRead {
    pub(crate) pid: u32,
    pub(crate) figures: Option<(u64, u64)>,
    pub(crate) rss: u64,
    /// Its page faults (`minflt + majflt`) at the read ([`pages::midway`]).
    pub(crate) faults: Option<u64>,
}

/// What a finished batch found.
#[derive(Debug)]
pub(crate) enum Found {
    Own(Vec<OwnRead>),
    /// A slice of the rolling page count.
    Roll(io::Result<Slice>),
    /// A slice of a Σ Pss pass: the processes read so far in this pass
    /// (all of them, cumulated), whether the pass is complete, and its
    /// result so far.
    Pages {
        pass: io::Result<Pass>,
        /// Processes of the batch read (or found gone).
        read: usize,
        complete: bool,
    },
}

/// A finished batch and the CPU time it cost.
#[derive(Debug)]
struct Done {
    found: Found,
    cpu: Duration,
}

/// What to read, in order, and the CPU time allowed.
enum Batch {
    Own {
        pids: Vec<u32>,
        allowed: Duration,
    },
    /// A slice of the rolling page count over the tree's processes now.
    Roll {
        alive: Vec<u32>,
        allowed: Duration,
    },
    /// The next processes of a Σ Pss pass; `fresh` starts a new one.
    Pss {
        pids: Vec<u32>,
        fresh: bool,
        allowed: Duration,
    },
}

/// The share of the budget the reader spends at a steady pace, and the
/// share of a [`WINDOW`]'s budget it may save up: together with one read
/// that overruns what was left (repaid before the next one starts), at
/// most the budget over any window.
const PACE: f64 = 0.7;
const SAVED: f64 = 0.1;
const WINDOW: Duration = Duration::from_secs(10);

/// The reader thread and the budget it reads within.
pub(crate) struct OwnReader {
    tx: Option<Sender<Batch>>,
    rx: Receiver<Done>,
    share: f64,
    /// CPU seconds the budget allows now (may run negative after a read
    /// that cost more than was left).
    credit: f64,
    credited_at: Option<Instant>,
    busy: bool,
    reads: u64,
    cpu: Duration,
}

impl std::fmt::Debug for OwnReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnReader")
            .field("share", &self.share)
            .field("reads", &self.reads)
            .finish()
    }
}

impl OwnReader {
    /// Starts the reader thread for the procfs at `root`, spending at most
    /// `share` of one core (0.02 = 2 %) over any 10 s. `None` when no
    /// thread can start.
    pub(crate) fn start(root: PathBuf, share: f64) -> Option<OwnReader> {
        let (tx, batches) = mpsc::channel::<Batch>();
        let (done_tx, rx) = mpsc::channel::<Done>();
        std::thread::Builder::new()
            .name("memtrack-smaps".into())
            .spawn(move || {
                let mut worker = ReaderThread {
                    root,
                    buf: Vec::with_capacity(4096),
                    text: String::new(),
                    roll: pages::Rolling::new(crate::sys::page_size()),
                    pss: Pass::default(),
                    page_size: crate::sys::page_size(),
                };
                for batch in batches {
                    if done_tx.send(worker.run(batch)).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| tracing::warn!("cannot start the smaps reader: {e}"))
            .ok()?;
        let share = share.clamp(0.0, 1.0);
        Some(OwnReader {
            tx: Some(tx),
            rx,
            share,
            credit: burst(share),
            credited_at: None,
            busy: false,
            reads: 0,
            cpu: Duration::ZERO,
        })
    }

    /// What the last batch found, once it is done (none while it runs).
    pub(crate) fn collect(&mut self) -> Option<Found> {
        match self.rx.try_recv() {
            Ok(done) => {
                self.busy = false;
                self.credit -= done.cpu.as_secs_f64();
                self.cpu += done.cpu;
                self.reads += match &done.found {
                    Found::Own(r) => r.len() as u64,
                    Found::Pages { read, .. } => *read as u64,
                    Found::Roll(Ok(s)) => s.read.len() as u64,
                    Found::Roll(Err(_)) => 0,
                };
                Some(done.found)
            }
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => {
                self.busy = false;
                None
            }
        }
    }

    /// Whether a new batch may be handed over now: none is running and the
    /// budget has credit. Credit accrues with wall time.
    pub(crate) fn ready(&mut self, now: Instant) -> bool {
        let elapsed = self
            .credited_at
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        self.credited_at = Some(now);
        self.credit =
            (self.credit + elapsed.as_secs_f64() * self.share * PACE).min(burst(self.share));
        !self.busy && self.credit > 0.0
    }

    /// Hands `pids` (in the order to read them) to the reader for their
    /// own cost.
    pub(crate) fn submit(&mut self, pids: Vec<u32>) {
        if pids.is_empty() {
            return;
        }
        let allowed = self.allowed();
        self.send(Batch::Own { pids, allowed });
    }

    /// Hands the reader a slice of the rolling page count over `alive`,
    /// the tree's processes now.
    pub(crate) fn submit_roll(&mut self, alive: Vec<u32>) {
        let allowed = self.allowed();
        self.send(Batch::Roll { alive, allowed });
    }

    /// Hands the next processes of a Σ Pss pass to the reader (`fresh`:
    /// the first slice of a new pass).
    pub(crate) fn submit_pss(&mut self, pids: Vec<u32>, fresh: bool) {
        let allowed = self.allowed();
        self.send(Batch::Pss {
            pids,
            fresh,
            allowed,
        });
    }

    fn allowed(&self) -> Duration {
        Duration::from_secs_f64(self.credit.max(0.0))
    }

    fn send(&mut self, batch: Batch) {
        if self.busy {
            return;
        }
        if let Some(tx) = &self.tx {
            if tx.send(batch).is_ok() {
                self.busy = true;
            }
        }
    }

    /// `smaps_rollup` reads done so far and the CPU time of every read
    /// (page passes included).
    pub(crate) fn cost(&self) -> (u64, Duration) {
        (self.reads, self.cpu)
    }
}

/// The credit saved up at most: a tenth of a window's budget, leaving a
/// fifth of it for a read that overruns.
fn burst(share: f64) -> f64 {
    share * SAVED * WINDOW.as_secs_f64()
}

impl Drop for OwnReader {
    fn drop(&mut self) {
        // Closing the channel ends the thread after its batch.
        self.tx = None;
    }
}

/// The reader thread's state: its buffers and the page pass under way.
struct ReaderThread {
    root: PathBuf,
    buf: Vec<u8>,
    text: String,
    /// The rolling page count.
    roll: pages::Rolling,
    /// The Σ Pss pass under way.
    pss: Pass,
    page_size: u64,
}

impl ReaderThread {
    /// Reads the batch's processes in order until its CPU allowance is
    /// spent (at least one, so a process larger than the allowance is
    /// read).
    fn run(&mut self, batch: Batch) -> Done {
        let started = sys::thread_cpu_time();
        let spent = || sys::thread_cpu_time().saturating_sub(started);
        let found = match batch {
            Batch::Own { pids, allowed } => {
                let mut reads = Vec::new();
                for pid in pids {
                    if !reads.is_empty() && spent() >= allowed {
                        break;
                    }
                    let path = self.root.join(pid.to_string()).join("smaps_rollup");
                    let before = pages::faults(&self.root, pid, &mut self.text).map(|f| f.0);
                    self.buf.clear();
                    let text = std::fs::File::open(&path)
                        .and_then(|mut f| f.read_to_end(&mut self.buf))
                        .ok()
                        .and_then(|_| std::str::from_utf8(&self.buf).ok());
                    let figures = text.and_then(|t| parse_smaps_rollup(t).ok());
                    let rss = text.map_or(0, smaps_rollup_rss);
                    reads.push(OwnRead {
                        pid,
                        figures,
                        rss,
                        faults: pages::midway(
                            before,
                            pages::faults(&self.root, pid, &mut self.text).map(|f| f.0),
                        ),
                    });
                }
                Found::Own(reads)
            }
            Batch::Roll { alive, allowed } => Found::Roll(self.roll.slice(
                &self.root,
                &alive,
                Instant::now(),
                &mut || spent() >= allowed,
            )),
            Batch::Pss {
                pids,
                fresh,
                allowed,
            } => self.pss_slice(&pids, fresh, &mut || spent() >= allowed),
        };
        Done {
            found,
            cpu: spent(),
        }
    }

    /// One slice of a Σ Pss pass: each process's `smaps_rollup` (its share
    /// and its own pages) in order, until `stop` says so (checked between
    /// processes, after at least one). Any error but a process gone ends
    /// the pass.
    fn pss_slice(&mut self, pids: &[u32], fresh: bool, stop: &mut dyn FnMut() -> bool) -> Found {
        if fresh {
            self.pss = Pass::default();
        }
        let mut done = 0;
        for &pid in pids {
            if done > 0 && stop() {
                break;
            }
            done += 1;
            if let Err(e) = pss::add(
                &self.root,
                pid,
                self.page_size,
                &mut self.pss,
                &mut self.buf,
                &mut self.text,
            ) {
                return Found::Pages {
                    pass: Err(e),
                    read: done,
                    complete: true,
                };
            }
        }
        Found::Pages {
            pass: Ok(self.pss.clone()),
            read: done,
            complete: done == pids.len(),
        }
    }
}
