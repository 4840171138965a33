//! The points waiting for the server: at most `queue_max` in memory, the
//! rest in a spool file, in one overall order.
//!
//! While the server is away a long run can produce more points than
//! memtrack should hold, so the newest go to `clearml-spool.jsonl` (one
//! [`Point`] as JSON per line). The order is memory first, then the spool
//! from its read position, so once anything is spooled every newer point
//! is spooled too, and memory is refilled from the head of the spool as
//! batches leave. A fully read spool is truncated. A batch the server
//! keeps failing with internal errors is set aside (`Queue::set_aside`)
//! so later ones go on, and kept: it is tried again at the end of the run.
//! At the end `Queue::persist` rewrites the spool to hold every unsent
//! point, set-aside ones first, then memory, so nothing is lost when the
//! server never came back.
//!
//! The file is local and written in small buffered appends; no network
//! call ever waits on it, and it never waits on the network.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::points::Point;

/// Longest spool line read back; a point is a few hundred bytes.
const MAX_SPOOL_LINE: usize = 64 * 1024;

/// Reads one line into `buf` (without its newline), keeping at most `max`
/// bytes of it. `None` at the end of the file; `Some(false)` for a line cut
/// short by the end of the file or over `max` bytes.
fn read_line_bounded(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<Option<bool>> {
    buf.clear();
    let mut whole = true;
    let mut any = false;
    loop {
        let chunk = reader.fill_buf()?;
        if chunk.is_empty() {
            return Ok(any.then_some(false));
        }
        any = true;
        let (part, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (&chunk[..i], Some(i + 1)),
            None => (chunk, None),
        };
        if buf.len() + part.len() > max {
            whole = false;
        } else {
            buf.extend_from_slice(part);
        }
        let used = done.unwrap_or(chunk.len());
        reader.consume(used);
        if done.is_some() {
            return Ok(Some(whole));
        }
    }
}

/// The bounded queue.
#[derive(Debug)]
pub struct Queue {
    mem: VecDeque<Point>,
    /// Points taken out for sending and not yet settled: they count
    /// against the memory bound.
    held: usize,
    /// Batches the server failed with internal errors, oldest first: not
    /// sent again until [`Queue::restore_aside`], counted against the
    /// memory bound.
    aside: Vec<Point>,
    max: usize,
    path: PathBuf,
    spool: Option<Spool>,
    /// Points in the spool not yet read back.
    spooled: u64,
    /// Points lost because the spool could not be written.
    pub(crate) lost: u64,
    spool_error_logged: bool,
}

#[derive(Debug)]
struct Spool {
    writer: BufWriter<File>,
    reader: BufReader<File>,
    /// Byte offset of the next unread line.
    read_at: u64,
}

impl Queue {
    pub fn new(max: usize, path: PathBuf) -> Self {
        Queue {
            mem: VecDeque::new(),
            held: 0,
            aside: Vec::new(),
            max: max.max(1),
            path,
            spool: None,
            spooled: 0,
            lost: 0,
            spool_error_logged: false,
        }
    }

    /// Adopts the spool an earlier run left behind (`memtrack
    /// clearml-resend`): its points come first, in their order. Lines that
    /// are not points (one torn by a `kill -9`, an over-long one) are
    /// dropped; the second number says how many.
    pub(crate) fn resume(max: usize, path: PathBuf) -> io::Result<(Queue, u64)> {
        let mut q = Queue::new(max, path);
        let src = match crate::files::open_input(&q.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((q, 0)),
            Err(e) => return Err(e),
        };
        let tmp = q.path.with_extension("jsonl.tmp");
        let (mut good, mut bad) = (0u64, 0u64);
        {
            let mut reader = BufReader::new(src);
            let mut out = BufWriter::new(crate::files::create(&tmp, true)?);
            let mut line = Vec::new();
            while let Some(complete) = read_line_bounded(&mut reader, &mut line, MAX_SPOOL_LINE)? {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                match serde_json::from_slice::<Point>(&line) {
                    Ok(p) if complete => {
                        serde_json::to_writer(&mut out, &p)?;
                        out.write_all(b"\n")?;
                        good += 1;
                    }
                    _ => bad += 1,
                }
            }
            out.flush()?;
            out.get_ref().sync_all()?;
        }
        std::fs::rename(&tmp, &q.path)?;
        if good == 0 {
            std::fs::remove_file(&q.path)?;
            return Ok((q, bad));
        }
        let file = crate::files::options()
            .read(true)
            .write(true)
            .open(&q.path)?;
        let reader = BufReader::new(file.try_clone()?);
        q.spool = Some(Spool {
            writer: BufWriter::new(file),
            reader,
            read_at: 0,
        });
        q.spooled = good;
        Ok((q, bad))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Points waiting (memory and spool, not counting held ones).
    pub fn len(&self) -> u64 {
        self.mem.len() as u64 + self.spooled
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[cfg(test)]
    /// Points waiting in the spool file.
    pub(crate) fn spooled(&self) -> u64 {
        self.spooled
    }

    /// Points in memory, including those out for sending and set aside.
    pub(crate) fn in_memory(&self) -> usize {
        self.mem.len() + self.held + self.aside.len()
    }

    /// Points set aside ([`Queue::set_aside`]).
    pub(crate) fn aside(&self) -> usize {
        self.aside.len()
    }

    /// Appends points, spilling to the spool once memory is full (or
    /// anything is already spooled, to keep the order).
    pub fn extend(&mut self, points: impl IntoIterator<Item = Point>) {
        let mut spill = Vec::new();
        for p in points {
            if self.spooled == 0 && spill.is_empty() && self.in_memory() < self.max {
                self.mem.push_back(p);
            } else {
                spill.push(p);
            }
        }
        if !spill.is_empty() {
            let n = spill.len() as u64;
            match self.append(&spill) {
                Ok(()) => self.spooled += n,
                Err(e) => {
                    self.lost += n;
                    if !self.spool_error_logged {
                        self.spool_error_logged = true;
                        tracing::error!(
                            "ClearML: cannot write the spool file {}: {e}; points beyond \
                             the in-memory queue are dropped",
                            self.path.display()
                        );
                    }
                }
            }
        }
    }

    fn open(&mut self) -> io::Result<&mut Spool> {
        if self.spool.is_none() {
            if let Some(dir) = self.path.parent() {
                crate::files::create_dir_all(dir)?;
            }
            let file = crate::files::options()
                .create(true)
                .read(true)
                .write(true)
                .truncate(true)
                .open(&self.path)?;
            let reader = BufReader::new(file.try_clone()?);
            self.spool = Some(Spool {
                writer: BufWriter::new(file),
                reader,
                read_at: 0,
            });
        }
        self.spool
            .as_mut()
            .ok_or_else(|| io::Error::other("spool not open"))
    }

    fn append(&mut self, points: &[Point]) -> io::Result<()> {
        let spool = self.open()?;
        spool.writer.seek(SeekFrom::End(0))?;
        for p in points {
            serde_json::to_writer(&mut spool.writer, p)?;
            spool.writer.write_all(b"\n")?;
        }
        spool.writer.flush()
    }

    /// Takes up to `n` points from the front for sending (refilling memory
    /// from the spool first). They are held until [`Queue::settle`] or
    /// [`Queue::put_back`].
    pub(crate) fn take(&mut self, n: usize) -> Vec<Point> {
        self.refill();
        let k = n.min(self.mem.len());
        let batch: Vec<Point> = self.mem.drain(..k).collect();
        self.held += batch.len();
        batch
    }

    /// The held batch left for good (delivered or dropped).
    pub(crate) fn settle(&mut self, n: usize) {
        self.held = self.held.saturating_sub(n);
        self.refill();
    }

    /// The held batch leaves the line but is kept: after the points set
    /// aside before it, ahead of everything waiting.
    pub(crate) fn set_aside(&mut self, batch: Vec<Point>) {
        self.held = self.held.saturating_sub(batch.len());
        self.aside.extend(batch);
    }

    /// The points set aside go back to the front, in their order.
    pub(crate) fn restore_aside(&mut self) {
        for p in std::mem::take(&mut self.aside).into_iter().rev() {
            self.mem.push_front(p);
        }
    }

    /// The held batch goes back to the front, in its order.
    pub(crate) fn put_back(&mut self, batch: Vec<Point>) {
        self.held = self.held.saturating_sub(batch.len());
        for p in batch.into_iter().rev() {
            self.mem.push_front(p);
        }
    }

    /// Moves points from the head of the spool into free memory.
    fn refill(&mut self) {
        if self.spooled == 0 {
            return;
        }
        let room = self.max.saturating_sub(self.in_memory());
        if room == 0 {
            return;
        }
        match self.read_front(room) {
            Ok(points) => {
                self.spooled = self.spooled.saturating_sub(points.len() as u64);
                self.mem.extend(points);
            }
            Err(e) => {
                // An unreadable spool cannot be replayed: count it as lost.
                tracing::error!(
                    "ClearML: cannot read back the spool file {}: {e}; {} spooled points are lost",
                    self.path.display(),
                    self.spooled
                );
                self.lost += self.spooled;
                self.spooled = 0;
            }
        }
        if self.spooled == 0 {
            self.reset_spool();
        }
    }

    fn read_front(&mut self, max: usize) -> io::Result<Vec<Point>> {
        let spool = self.open()?;
        spool.writer.flush()?;
        spool.reader.seek(SeekFrom::Start(spool.read_at))?;
        let mut out = Vec::with_capacity(max.min(4096));
        let mut line = String::new();
        while out.len() < max {
            line.clear();
            let n = spool.reader.read_line(&mut line)?;
            if n == 0 {
                break;
            }
            spool.read_at += n as u64;
            match serde_json::from_str::<Point>(line.trim_end()) {
                Ok(p) => out.push(p),
                Err(e) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("bad line at byte {}: {e}", spool.read_at - n as u64),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Everything was read back: empty the file.
    fn reset_spool(&mut self) {
        if let Some(spool) = self.spool.as_mut() {
            let reset = spool
                .writer
                .flush()
                .and_then(|()| spool.writer.get_ref().set_len(0))
                .and_then(|()| spool.writer.seek(SeekFrom::Start(0)).map(|_| ()));
            spool.read_at = 0;
            if reset.is_err() {
                self.spool = None;
            }
        }
    }

    /// Writes every unsent point (set aside, memory, then the unread
    /// spool) to the spool file, replacing it atomically, and returns how
    /// many. Removes the file when there is nothing left. Held points must
    /// have been put back first.
    pub(crate) fn persist(&mut self) -> io::Result<u64> {
        self.restore_aside();
        let unread: Option<u64> = match self.spool.as_mut() {
            Some(s) => {
                s.writer.flush()?;
                Some(s.read_at)
            }
            None => None,
        };
        let total = self.mem.len() as u64 + self.spooled;
        if total == 0 {
            self.spool = None;
            match std::fs::remove_file(&self.path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            return Ok(0);
        }
        if let Some(dir) = self.path.parent() {
            crate::files::create_dir_all(dir)?;
        }
        let tmp = self.path.with_extension("jsonl.tmp");
        {
            let mut out = BufWriter::new(crate::files::create(&tmp, true)?);
            for p in &self.mem {
                serde_json::to_writer(&mut out, p)?;
                out.write_all(b"\n")?;
            }
            if let (Some(offset), true) = (unread, self.spooled > 0) {
                let mut src = crate::files::open_input(&self.path)?;
                src.seek(SeekFrom::Start(offset))?;
                io::copy(&mut src, &mut out)?;
            }
            out.flush()?;
            out.get_ref().sync_all()?;
        }
        self.spool = None;
        std::fs::rename(&tmp, &self.path)?;
        self.spooled = total;
        self.mem.clear();
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(i: u64) -> Point {
        Point {
            metric: "memory/m".into(),
            variant: "cpu_ram_used_mb".into(),
            value: i as f64,
            iter: i,
            timestamp: 1_700_000_000_000 + i as i64,
        }
    }

    fn lines(path: &Path) -> Vec<u64> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Point>(l).unwrap().iter)
            .collect()
    }

    #[test]
    fn set_aside_points_count_against_the_bound_and_persist_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/clearml-spool.jsonl");
        let mut q = Queue::new(4, path.clone());
        q.extend((0..4).map(pt));
        let b = q.take(2);
        q.set_aside(b);
        assert_eq!((q.len(), q.aside(), q.in_memory()), (2, 2, 4));
        // Memory is full with the set-aside batch: newer points spill.
        q.extend((4..6).map(pt));
        assert_eq!(q.spooled(), 2);
        let b = q.take(2);
        assert_eq!(b.iter().map(|p| p.iter).collect::<Vec<_>>(), vec![2, 3]);
        q.settle(2);
        assert_eq!(q.persist().unwrap(), 4);
        assert_eq!(lines(&path), vec![0, 1, 4, 5], "set aside first, in order");
        assert_eq!(q.aside(), 0);
    }

    #[test]
    fn spills_beyond_the_bound_and_keeps_the_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/clearml-spool.jsonl");
        let mut q = Queue::new(4, path.clone());
        q.extend((0..10).map(pt));
        assert_eq!((q.in_memory(), q.spooled()), (4, 6));
        assert_eq!(lines(&path), vec![4, 5, 6, 7, 8, 9]);
        let mut seen = Vec::new();
        // A failed send goes back to the front.
        let b = q.take(3);
        q.put_back(b);
        loop {
            let b = q.take(3);
            if b.is_empty() {
                break;
            }
            assert!(q.in_memory() <= 4);
            seen.extend(b.iter().map(|p| p.iter));
            let n = b.len();
            q.settle(n);
            // New points arriving meanwhile go behind the spool.
            if seen.len() == 3 {
                q.extend((10..12).map(pt));
            }
        }
        assert_eq!(seen, (0..12).collect::<Vec<_>>());
        assert!(q.is_empty());
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            0,
            "drained spool is emptied"
        );
        // And it is reused afterwards.
        q.extend((20..27).map(pt));
        assert_eq!(q.spooled(), 3);
        assert_eq!(lines(&path), vec![24, 25, 26]);
    }

    #[test]
    fn persist_writes_memory_then_spool() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("clearml-spool.jsonl");
        let mut q = Queue::new(3, path.clone());
        q.extend((0..8).map(pt));
        let b = q.take(2);
        q.settle(b.len());
        let held = q.take(1);
        q.put_back(held);
        assert_eq!(q.persist().unwrap(), 6);
        assert_eq!(lines(&path), vec![2, 3, 4, 5, 6, 7]);
        assert_eq!(q.len(), 6);
    }

    #[test]
    fn persist_removes_an_empty_spool() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("clearml-spool.jsonl");
        let mut q = Queue::new(1, path.clone());
        q.extend((0..3).map(pt));
        assert!(path.exists());
        while !q.take(1).is_empty() {
            q.settle(1);
        }
        assert_eq!(q.persist().unwrap(), 0);
        assert!(!path.exists());
    }

    #[test]
    fn an_unwritable_spool_counts_losses() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("file"), "x").unwrap();
        let mut q = Queue::new(2, dir.path().join("file/spool.jsonl"));
        q.extend((0..5).map(pt));
        assert_eq!((q.in_memory(), q.lost), (2, 3));
    }

    #[test]
    fn resume_adopts_a_spool_and_drops_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spool.jsonl");
        let mut text = String::new();
        for i in 0..5 {
            text.push_str(&serde_json::to_string(&pt(i)).unwrap());
            text.push('\n');
        }
        text.push_str("not a point\n");
        text.push_str(&format!("{}\n", "x".repeat(MAX_SPOOL_LINE + 10)));
        text.push_str(&serde_json::to_string(&pt(5)).unwrap());
        text.push('\n');
        // A kill mid-write leaves half a line.
        text.push_str(&serde_json::to_string(&pt(6)).unwrap()[..20]);
        std::fs::write(&path, text).unwrap();

        let (mut q, bad) = Queue::resume(2, path.clone()).unwrap();
        assert_eq!((q.len(), bad), (6, 3));
        // New points go after the adopted ones, in one order.
        q.extend([pt(7)]);
        let mut got = Vec::new();
        loop {
            let batch = q.take(2);
            if batch.is_empty() {
                break;
            }
            got.extend(batch.iter().map(|p| p.value as u64));
            q.settle(batch.len());
        }
        assert_eq!(got, vec![0, 1, 2, 3, 4, 5, 7]);
        assert_eq!(q.persist().unwrap(), 0);
        assert!(!path.exists());
    }

    #[test]
    fn resume_without_a_spool_is_an_empty_queue() {
        let dir = tempfile::tempdir().unwrap();
        let (q, bad) = Queue::resume(4, dir.path().join("none.jsonl")).unwrap();
        assert_eq!((q.len(), bad), (0, 0));
    }
}
