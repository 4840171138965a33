//! The Unix socket server: accepts clients, reads lines, hands requests to
//! the engine, writes replies, pushes notices to subscribers.
//!
//! Nothing a client does can stop sampling: requests reach the engine
//! through its bounded channel with `try_send` (a full queue drops the
//! message and says so), each connection has a bounded outgoing queue and a
//! write timeout (a client that never reads gets no more replies), lines
//! are capped at 64 KiB, and connections beyond the limit are closed at
//! once. Every line a client sent is read and recorded, whether or not it
//! still takes replies.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::inbox::{ClientRequest, Input, TaskClose};
use super::protocol::{self, ErrorCode, Message, Notice, ProtocolError, MAX_LINE};
use crate::units::unix_now;

/// Replies waiting for a client that does not read; beyond this it is
/// disconnected.
const OUT_QUEUE: usize = 256;
/// A reply write that takes longer than this disconnects the client.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection waits for the engine to answer an `ack`.
const ENGINE_TIMEOUT: Duration = Duration::from_secs(30);

/// Who may connect, and how many at once.
#[derive(Debug, Clone)]
pub(crate) struct Access {
    /// Our own uid: always allowed.
    pub(crate) uid: u32,
    pub(crate) allow_uids: Vec<u32>,
    /// With a group, the socket is 0660 and the file system decides.
    pub(crate) group: Option<u32>,
    pub(crate) max_connections: usize,
}

/// Counters the engine copies into the run's counters.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) protocol_errors: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) rejected_connections: AtomicU64,
    /// Clients that stopped reading their replies (sent no more).
    pub(crate) slow_clients: AtomicU64,
    pub(crate) connections: AtomicUsize,
    /// The listening socket (a duplicate), to see connections the kernel
    /// queued that are not accepted yet.
    pub(crate) listener: std::sync::OnceLock<std::os::fd::OwnedFd>,
}

impl Stats {
    /// Whether every client has hung up and none waits to be accepted: a
    /// client may connect, send and leave while memtrack is stopped, and
    /// what it sent is read once the connection is accepted.
    pub(crate) fn clients_gone(&self) -> bool {
        use std::os::fd::AsFd;
        let open = || self.connections.load(Ordering::SeqCst) > 0;
        let queued = || {
            self.listener
                .get()
                .is_some_and(|l| crate::sys::has_input(l.as_fd()))
        };
        // Accepted connections are counted just after they leave the
        // queue: looked at on both sides of it.
        !open() && !queued() && !open()
    }
}

/// What connection tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) engine: SyncSender<Input>,
    pub(crate) notices: broadcast::Sender<Notice>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) access: Access,
    /// The ClearML reporter's intake for `clearml_task` announcements;
    /// `None` (or closed) when the run does not report to ClearML.
    pub(crate) job_tasks: Option<mpsc::Sender<crate::event::inbox::JobTask>>,
    /// Why the run does not report to ClearML, for a job that announces a
    /// task anyway (empty: not known).
    pub(crate) job_task_off: String,
    /// The line that says so, limited by time: a job announcing in a loop
    /// costs a few lines.
    pub(crate) job_task_off_said: std::sync::Mutex<crate::logging::RateLimited>,
}

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BindError {
    #[error("socket {0} is in use by a running memtrack; stop it or choose another --socket")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("socket path {0} is too long for a Unix socket (at most 107 bytes)")]
    TooLong(PathBuf),
    #[error("cannot create socket {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// The socket file; removed when dropped unless systemd owns it.
#[derive(Debug)]
pub(crate) struct SocketFile {
    pub(crate) path: PathBuf,
    listener: Option<std::os::unix::net::UnixListener>,
    /// False for a socket systemd created (socket activation).
    owned: bool,
}

impl SocketFile {
    /// The bound listener, for the runtime that serves it.
    pub(crate) fn take_listener(&mut self) -> Option<std::os::unix::net::UnixListener> {
        self.listener.take()
    }
}

impl SocketFile {
    /// Adopts the socket systemd passed (socket activation).
    pub(crate) fn from_systemd(
        listener: std::os::unix::net::UnixListener,
    ) -> std::io::Result<SocketFile> {
        listener.set_nonblocking(true)?;
        let path = listener
            .local_addr()?
            .as_pathname()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        Ok(SocketFile {
            path,
            listener: Some(listener),
            owned: false,
        })
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if self.owned {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Creates the socket at `path` with its final mode before anyone can
/// reach it: bound inside a private directory, chmod'ed, then hard-linked
/// into place. The link fails if the path exists, so of two memtracks
/// started on one path at once exactly one gets it (a rename would let the
/// second silently take it from the first). A stale socket (nobody answers)
/// is replaced; a live one is not.
pub(crate) fn bind(path: &Path, group: Option<u32>) -> Result<SocketFile, BindError> {
    let io_err = |source| BindError::Io {
        path: path.to_path_buf(),
        source,
    };
    if path.as_os_str().len() > 107 {
        return Err(BindError::TooLong(path.to_path_buf()));
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // A random name: two memtracks with one PID (each PID 1 of its own
    // namespace, sharing /tmp) must not take each other's folder.
    let private = crate::files::create_temp_dir(parent, ".memtrack-bind").map_err(io_err)?;
    let result = (|| {
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err)?;
        let tmp = private.join("s");
        let listener = std::os::unix::net::UnixListener::bind(&tmp).map_err(io_err)?;
        let mode = if group.is_some() { 0o660 } else { 0o600 };
        if let Some(gid) = group {
            std::os::unix::fs::chown(&tmp, None, Some(gid)).map_err(io_err)?;
        }
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).map_err(io_err)?;
        // Twice at most: once more after removing a stale socket.
        for _ in 0..2 {
            match std::fs::hard_link(&tmp, path) {
                Ok(()) => return Ok(listener),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => remove_if_stale(path)?,
                Err(e) => return Err(io_err(e)),
            }
        }
        Err(BindError::InUse(path.to_path_buf()))
    })();
    let _ = std::fs::remove_dir_all(&private);
    let listener = result?;
    listener.set_nonblocking(true).map_err(io_err)?;
    Ok(SocketFile {
        path: path.to_path_buf(),
        listener: Some(listener),
        owned: true,
    })
}

/// Binds the default socket `first` ([`default_path`]) or, when a running
/// memtrack holds it, the first free of `memtrack-PID-2.sock` …
/// `memtrack-PID-16.sock` beside it: memtracks in separate PID namespaces
/// that share `/tmp` all have PID 1, and so ask for one name.
pub fn bind_first_free(first: &Path, group: Option<u32>) -> Result<SocketFile, BindError> {
    for n in 1..=16u32 {
        let path = if n == 1 {
            first.to_path_buf()
        } else {
            first.with_file_name(format!("memtrack-{}-{n}.sock", std::process::id()))
        };
        match bind(&path, group) {
            Err(BindError::InUse(_)) => continue,
            other => return other,
        }
    }
    Err(BindError::InUse(first.to_path_buf()))
}

/// Removes what is at `path` if it is a socket nobody answers on; refuses a
/// live socket and anything that is not a socket.
fn remove_if_stale(path: &Path) -> Result<(), BindError> {
    let io_err = |source| BindError::Io {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => Err(BindError::NotASocket(path.to_path_buf())),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(BindError::InUse(path.to_path_buf())),
            Err(e)
                if e.kind() == io::ErrorKind::ConnectionRefused
                    || e.kind() == io::ErrorKind::NotFound =>
            {
                match std::fs::remove_file(path) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(e)),
                    _ => Ok(()),
                }
            }
            Err(e) => Err(io_err(e)),
        },
        // Gone between the link and the look: try the link again.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(e)),
    }
}

/// Accepts connections until `shutdown` turns true.
pub(crate) async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::debug!("accept failed: {e}");
                        // Out of descriptors: let some close before retrying.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let open = shared.stats.connections.fetch_add(1, Ordering::Relaxed) + 1;
                if open > shared.access.max_connections {
                    shared.stats.connections.fetch_sub(1, Ordering::Relaxed);
                    shared.stats.rejected_connections.fetch_add(1, Ordering::Relaxed);
                    drop(stream);
                    continue;
                }
                let shared = Arc::clone(&shared);
                tokio::spawn(async move {
                    connection(stream, &shared).await;
                    shared.stats.connections.fetch_sub(1, Ordering::Relaxed);
                });
            }
        }
    }
}

enum LineRead {
    Line,
    TooLong,
    Eof,
}

/// Reads one line into `buf` (without its newline), never holding more
/// than [`MAX_LINE`] bytes.
async fn read_line(
    reader: &mut BufReader<OwnedReadHalf>,
    buf: &mut Vec<u8>,
) -> io::Result<LineRead> {
    buf.clear();
    loop {
        let available = match reader.fill_buf().await {
            Ok(a) => a,
            // A client that hung up without reading its replies: its last
            // line, cut off, is read as a line as at the end of the stream.
            Err(_) if !buf.is_empty() => return Ok(LineRead::Line),
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(if buf.is_empty() {
                LineRead::Eof
            } else {
                LineRead::Line
            });
        }
        if let Some(i) = available.iter().position(|b| *b == b'\n') {
            if buf.len() + i >= MAX_LINE {
                return Ok(LineRead::TooLong);
            }
            buf.extend_from_slice(&available[..i]);
            reader.consume(i + 1);
            return Ok(LineRead::Line);
        }
        let n = available.len();
        if buf.len() + n >= MAX_LINE {
            return Ok(LineRead::TooLong);
        }
        buf.extend_from_slice(available);
        reader.consume(n);
    }
}

/// Serves one client: checks who it is, then reads its lines until it
/// hangs up, answering each through its outgoing queue.
async fn connection(stream: UnixStream, shared: &Shared) {
    let (pid, uid) = peer(&stream);
    let (read, mut write) = stream.into_split();
    if !may_connect(uid, &shared.access) {
        refuse(&mut write, uid, &shared.stats).await;
        return;
    }
    let (outbox, writer) = Outbox::spawn(write, &shared.stats);
    let mut session = Session {
        pid,
        shared,
        outbox,
        answering: true,
        subscription: None,
    };
    session.read_lines(read).await;
    if let Some(s) = session.subscription {
        s.abort();
    }
    drop(session.outbox);
    let _ = writer.await;
}

/// The client's PID and uid, from the socket's peer credentials.
fn peer(stream: &UnixStream) -> (Option<u32>, Option<u32>) {
    let cred = stream.peer_cred().ok();
    let pid = cred
        .as_ref()
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok());
    (pid, cred.as_ref().map(|c| c.uid()))
}

/// Whether a client of this uid may use the socket: our own uid, an
/// allowed one, or anyone the group's file mode let in.
fn may_connect(uid: Option<u32>, access: &Access) -> bool {
    match uid {
        Some(u) => u == access.uid || access.allow_uids.contains(&u) || access.group.is_some(),
        None => false,
    }
}

/// Tells a client it may not connect (and counts it).
async fn refuse(write: &mut OwnedWriteHalf, uid: Option<u32>, stats: &Stats) {
    stats.refused.fetch_add(1, Ordering::Relaxed);
    stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
    let e = ProtocolError::new(
        ErrorCode::Refused,
        format!(
            "user {} may not use this socket (see socket.allow_uids)",
            uid.map_or("?".into(), |u| u.to_string())
        ),
    );
    let _ = tokio::time::timeout(WRITE_TIMEOUT, write.write_all(&protocol::error_line(&e))).await;
}

/// A connection's bounded queue of outgoing lines, written by its own
/// task so that a client that does not read never holds up another.
struct Outbox<'a> {
    out: mpsc::Sender<Vec<u8>>,
    stats: &'a Stats,
}

impl<'a> Outbox<'a> {
    /// The queue and the task that writes it (each line within
    /// [`WRITE_TIMEOUT`], else the client is dropped).
    fn spawn(mut write: OwnedWriteHalf, stats: &'a Stats) -> (Self, JoinHandle<()>) {
        let (out, mut out_rx) = mpsc::channel::<Vec<u8>>(OUT_QUEUE);
        let writer = tokio::spawn(async move {
            while let Some(line) = out_rx.recv().await {
                match tokio::time::timeout(WRITE_TIMEOUT, write.write_all(&line)).await {
                    Ok(Ok(())) => {}
                    _ => break,
                }
            }
        });
        (Outbox { out, stats }, writer)
    }

    /// Queues a line; false when the client takes no more replies: it
    /// stopped reading and its replies piled up (counted), or its socket
    /// cannot be written (it hung up).
    fn send(&self, line: Vec<u8>) -> bool {
        match self.out.try_send(line) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.stats.slow_clients.fetch_add(1, Ordering::Relaxed);
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

/// One admitted client.
struct Session<'a> {
    pid: Option<u32>,
    shared: &'a Shared,
    outbox: Outbox<'a>,
    /// The client takes replies: false once one could not be queued (its
    /// socket is closed, or 256 replies wait unread).
    answering: bool,
    /// Forwards notices once the client subscribed.
    subscription: Option<JoinHandle<()>>,
}

impl Session<'_> {
    /// Reads and answers lines until the client hangs up or sends a line
    /// that is too long. A client that cannot take replies (it hung up
    /// without reading them, or stopped reading) gets no more of them, but
    /// every line it sent is still read and recorded: a message that
    /// reached the daemon is in the log.
    async fn read_lines(&mut self, read: OwnedReadHalf) {
        let stats = &self.shared.stats;
        let mut reader = BufReader::with_capacity(16 * 1024, read);
        let mut buf = Vec::with_capacity(1024);
        loop {
            match read_line(&mut reader, &mut buf).await {
                Ok(LineRead::Line) => {}
                Ok(LineRead::TooLong) => {
                    stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    let e = ProtocolError::new(
                        ErrorCode::TooLong,
                        format!("a line may be at most {MAX_LINE} bytes; closing"),
                    );
                    self.reply(protocol::error_line(&e));
                    return;
                }
                Ok(LineRead::Eof) | Err(_) => return,
            }
            if buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match protocol::parse(&buf) {
                Ok(request) => self.answer(request).await,
                Err(e) => {
                    stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    self.reply(protocol::error_line(&e));
                }
            }
        }
    }

    /// Queues a reply while the client takes them; once one cannot be
    /// queued, replies stop for good (the lines go on being read).
    fn reply(&mut self, line: Vec<u8>) {
        if self.answering && !self.outbox.send(line) {
            self.answering = false;
        }
    }

    /// Answers one request.
    async fn answer(&mut self, mut request: protocol::Request) {
        let id = request.id.clone();
        if !self.answering {
            // Recorded all the same; nobody waits for the reply.
            request.ack = false;
        }
        match request.message {
            Message::Subscribe => {
                if self.answering && self.subscription.is_none() {
                    self.subscription = Some(tokio::spawn(forward_notices(
                        self.shared.notices.subscribe(),
                        self.outbox.out.clone(),
                    )));
                }
                self.reply(protocol::ok_line("subscribed", &id, Default::default()));
            }
            Message::Cleanup => {
                let notified = self
                    .shared
                    .notices
                    .send(Notice::Cleanup {
                        reason: "socket".into(),
                        timestamp: unix_now(),
                    })
                    .unwrap_or(0);
                let mut fields = serde_json::Map::new();
                fields.insert("notified".into(), notified.into());
                self.reply(protocol::ok_line("cleanup", &id, fields));
            }
            Message::ClearmlTask { task } => {
                if let Some(line) = announce_task(self.shared, task, None, &id, request.ack).await {
                    self.reply(line);
                }
            }
            Message::ClearmlClose {
                task,
                status,
                reason,
            } => {
                let close = TaskClose { status, reason };
                if let Some(line) =
                    announce_task(self.shared, task, Some(close), &id, request.ack).await
                {
                    self.reply(line);
                }
            }
            _ => {
                if let Some(line) = self.forward(request).await {
                    self.reply(line);
                }
            }
        }
    }

    /// Hands a request to the engine; the line to send back, if any: the
    /// engine's reply when the client waits for one (and still takes
    /// replies), or `overloaded` when the message was dropped.
    async fn forward(&self, request: protocol::Request) -> Option<Vec<u8>> {
        let id = request.id.clone();
        let wants_reply = self.answering
            && (request.ack || matches!(request.message, Message::Status | Message::Register));
        let (tx, rx) = if wants_reply {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let input = Input::Client(Box::new(ClientRequest {
            pid: self.pid,
            received: unix_now(),
            request,
            reply: tx,
        }));
        if !to_engine(&self.shared.engine, input).await {
            self.shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
            let mut e = ProtocolError::new(
                ErrorCode::Overloaded,
                "the daemon's queue stayed full; the message was dropped",
            );
            e.id = id;
            return Some(protocol::error_line(&e));
        }
        let rx = rx?;
        Some(match tokio::time::timeout(ENGINE_TIMEOUT, rx).await {
            Ok(Ok(line)) => line,
            _ => {
                let mut e =
                    ProtocolError::new(ErrorCode::Overloaded, "the daemon did not answer in time");
                e.id = id;
                protocol::error_line(&e)
            }
        })
    }
}

/// Hands the job's ClearML task to the reporter, or (`close`) its SDK's
/// closing of it. With `ack`, the reply comes once the reporter has taken
/// the task up (and registered the artifact, when there is one to
/// register) or turned it down, or has taken the close over or not, at
/// most [`ENGINE_TIMEOUT`] later; `"clearml":false` when this run does not
/// report to ClearML.
async fn announce_task(
    shared: &Shared,
    task: String,
    close: Option<TaskClose>,
    id: &Option<protocol::Id>,
    ack: bool,
) -> Option<Vec<u8>> {
    use super::inbox::{JobTask, JobTaskReply};
    let kind = if close.is_some() {
        "clearml_close"
    } else {
        "clearml_task"
    };
    let (tx, rx) = oneshot::channel();
    let announcement = JobTask {
        id: task.clone(),
        close,
        reply: ack.then_some(tx),
    };
    // A full queue holds this connection back, as the engine's does.
    let sent = match &shared.job_tasks {
        Some(c) => matches!(
            tokio::time::timeout(ENGINE_TIMEOUT, c.send(announcement)).await,
            Ok(Ok(()))
        ),
        None => false,
    };
    if !sent {
        // The one line that says why a job's `Task.init` gets no charts.
        let due = shared
            .job_task_off_said
            .lock()
            .map_or(None, |mut said| said.hit());
        if let Some(n) = due {
            let times = if n > 1 {
                format!(" ({n} announcements so far)")
            } else {
                String::new()
            };
            tracing::info!(
                "ClearML: the job announced its task {task}{times}; {}",
                off_message(shared)
            );
        }
    }
    if !ack {
        return None;
    }
    let reply = if sent {
        match tokio::time::timeout(ENGINE_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            _ => JobTaskReply {
                reporting: false,
                artifact: false,
                deferred: false,
                message: "the ClearML reporter did not answer in time".into(),
            },
        }
    } else {
        JobTaskReply {
            reporting: false,
            artifact: false,
            deferred: false,
            message: off_message(shared),
        }
    };
    let mut fields = serde_json::Map::new();
    fields.insert("clearml".into(), sent.into());
    fields.insert("task".into(), task.into());
    fields.insert("reporting".into(), reply.reporting.into());
    fields.insert("artifact".into(), reply.artifact.into());
    fields.insert("deferred".into(), reply.deferred.into());
    fields.insert("message".into(), reply.message.into());
    Some(protocol::ok_line(kind, id, fields))
}

/// Why a `clearml_task` announcement is not taken up.
fn off_message(shared: &Shared) -> String {
    if shared.job_task_off.is_empty() {
        "this memtrack does not report to ClearML".into()
    } else {
        format!(
            "this memtrack does not report to ClearML: {}",
            shared.job_task_off
        )
    }
}

/// Hands a request to the engine. A full queue is backpressure: this
/// connection waits (and its client's socket buffer fills) rather than
/// losing the message; only after [`ENGINE_TIMEOUT`] is it dropped.
async fn to_engine(engine: &SyncSender<Input>, mut input: Input) -> bool {
    let deadline = tokio::time::Instant::now() + ENGINE_TIMEOUT;
    loop {
        match engine.try_send(input) {
            Ok(()) => return true,
            Err(TrySendError::Disconnected(_)) => return false,
            Err(TrySendError::Full(back)) => {
                if tokio::time::Instant::now() >= deadline {
                    return false;
                }
                input = back;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

async fn forward_notices(mut rx: broadcast::Receiver<Notice>, out: mpsc::Sender<Vec<u8>>) {
    loop {
        match rx.recv().await {
            Ok(notice) => {
                // A slow subscriber misses notices; it never slows anyone.
                if let Err(mpsc::error::TrySendError::Closed(_)) =
                    out.try_send(protocol::notice_line(&notice))
                {
                    return;
                }
            }
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// The socket path used when none is configured: in `$XDG_RUNTIME_DIR`
/// when it is a private place of this user, else in a private
/// `/tmp/memtrack-<uid>` directory, else (another user took that name) in
/// a fresh private folder beside it (see [`crate::files::socket_dir`]).
pub(crate) fn default_path() -> io::Result<PathBuf> {
    let name = format!("memtrack-{}.sock", std::process::id());
    Ok(crate::files::socket_dir()?.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn of_binds_racing_for_one_path_exactly_one_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.sock");
        let start = std::sync::Barrier::new(8);
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        bind(&path, None)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let won: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(won.len(), 1, "{results:?}");
        assert!(results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .all(|e| matches!(e, BindError::InUse(_))));
        // The socket at the path is the winner's: it answers.
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // No private bind folders are left behind.
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("m.sock")]);
    }

    #[test]
    fn a_default_socket_held_by_a_running_memtrack_gives_the_next_name() {
        let dir = tempfile::tempdir().unwrap();
        let first = dir
            .path()
            .join(format!("memtrack-{}.sock", std::process::id()));
        let held = bind(&first, None).unwrap();
        let second = bind_first_free(&first, None).unwrap();
        assert_eq!(
            second.path,
            dir.path()
                .join(format!("memtrack-{}-2.sock", std::process::id()))
        );
        assert_eq!(held.path, first, "the first one keeps its socket");
        assert!(std::os::unix::net::UnixStream::connect(&first).is_ok());
        // A stale socket at the first name is taken over, not skipped.
        drop(held);
        let stale = std::os::unix::net::UnixListener::bind(&first).unwrap();
        drop(stale);
        assert_eq!(bind_first_free(&first, None).unwrap().path, first);
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().starts_with(".memtrack-bind"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_file_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let socket = bind(&path, None).unwrap();
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok());
        drop(socket);
        assert!(!path.exists(), "an owned socket is removed when dropped");
        std::fs::write(&path, "data").unwrap();
        assert!(matches!(bind(&path, None), Err(BindError::NotASocket(_))));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
    }
}
