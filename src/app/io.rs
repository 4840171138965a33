//! The I/O side of a run: one small tokio runtime serving the event
//! socket, and the channel carrying snapshots from the engine. The run's
//! outputs (`outputs.rs`: HTTP, S3, ClearML) run their own tasks on the
//! same runtime.

use std::path::Path;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;

use anyhow::Context;
use tokio::sync::{mpsc, watch};

use crate::config::SocketConfig;
use crate::engine::EventLink;
use crate::event::inbox::Input;
use crate::store::snapshot::Snapshot;
use crate::sys;

/// The I/O side of a run: one small tokio runtime serving the event
/// socket, and the channel carrying snapshots to the outputs.
pub(super) struct Io {
    pub(crate) runtime: tokio::runtime::Runtime,
    pub(crate) shutdown: watch::Sender<bool>,
    socket: Option<crate::event::server::SocketFile>,
    pub(crate) link: Option<EventLink>,
    pub(crate) snapshots: watch::Sender<Arc<Snapshot>>,
    /// The job's announcements of its tracker task, for the output that
    /// takes them.
    pub(crate) job_tasks: Option<mpsc::Receiver<crate::event::inbox::JobTask>>,
}

impl Io {
    /// Starts the runtime, then the event socket when configured. `job_task_off` is the socket's answer to a job
    /// announcing a task no output takes.
    pub(crate) fn start(
        socket: &SocketConfig,
        engine: SyncSender<Input>,
        self_register: bool,
        first: Snapshot,
        job_task_off: Option<&str>,
    ) -> anyhow::Result<Io> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("memtrack-io")
            .enable_all()
            .build()
            .context("cannot start the I/O runtime")?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        // The run's identity is known before its first sample.
        let (snapshots, _) = watch::channel(Arc::new(first));
        let mut io = Io {
            runtime,
            shutdown,
            socket: None,
            link: None,
            snapshots,
            job_tasks: None,
        };

        if !socket.is_off() {
            io.serve_socket(
                socket,
                engine,
                self_register,
                job_task_off.unwrap_or_default(),
                shutdown_rx,
            )?;
        }

        Ok(io)
    }

    /// Binds the event socket (or takes the one systemd passed) and serves
    /// it; the engine hears its clients through `engine`.
    fn serve_socket(
        &mut self,
        settings: &SocketConfig,
        engine: SyncSender<Input>,
        self_register: bool,
        job_task_off: &str,
        shutdown_rx: watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        use crate::event::server;
        let group = if settings.group.is_empty() {
            None
        } else {
            sys::group_id(&settings.group)
        };
        let mut file = match sys::systemd_listener() {
            // Socket activation: systemd made the socket and owns its mode.
            Some(listener) => server::SocketFile::from_systemd(listener)
                .context("cannot use the socket systemd passed")?,
            None => {
                let first_free = || -> anyhow::Result<server::SocketFile> {
                    let first = server::default_path().context("cannot choose a socket path")?;
                    Ok(server::bind_first_free(&first, group)?)
                };
                if settings.path.as_os_str().is_empty() {
                    first_free()?
                } else {
                    // A chosen path that cannot be had (another run's,
                    // not a socket) costs the job its chosen path, never
                    // its start: the job is told the path used.
                    match server::bind(&settings.path, group) {
                        Ok(file) => file,
                        Err(e) => {
                            let file = first_free()?;
                            tracing::warn!(
                                "{e}: the event socket is {} instead (the job's MEMTRACK_SOCKET)",
                                file.path.display()
                            );
                            file
                        }
                    }
                }
            }
        };
        let (notices, _) = tokio::sync::broadcast::channel(64);
        let stats = Arc::new(server::Stats::default());
        let (job_tasks_tx, job_tasks_rx) = mpsc::channel(crate::event::inbox::JOB_TASK_QUEUE);
        self.job_tasks = Some(job_tasks_rx);
        let shared = Arc::new(server::Shared {
            job_tasks: Some(job_tasks_tx),
            job_task_off: job_task_off.to_string(),
            job_task_off_said: Default::default(),
            engine,
            notices: notices.clone(),
            stats: Arc::clone(&stats),
            access: server::Access {
                uid: sys::uid(),
                allow_uids: settings.allow_uids.clone(),
                group,
                max_connections: settings.max_connections,
            },
        });
        let std_listener = file.take_listener().context("socket already taken")?;
        // For the end of the run: connections still queued are read too.
        if let Ok(dup) = std_listener.try_clone() {
            let _ = stats.listener.set(dup.into());
        }
        let listener = {
            let _guard = self.runtime.enter();
            tokio::net::UnixListener::from_std(std_listener).context("cannot serve the socket")?
        };
        self.runtime
            .spawn(server::serve(listener, shared, shutdown_rx));
        self.socket = Some(file);
        self.link = Some(EventLink {
            notices,
            stats,
            self_register,
        });
        Ok(())
    }

    /// What the job's environment gains: `MEMTRACK_SOCKET` when the event
    /// socket is served.
    pub(crate) fn job_env(&self, is_run: bool) -> Vec<(String, String)> {
        let mut job_env = Vec::new();
        if let Some(path) = self.socket_path() {
            job_env.push(("MEMTRACK_SOCKET".to_string(), path.display().to_string()));
            if is_run {
                tracing::debug!("event socket {}", path.display());
            } else {
                tracing::info!(
                    "event socket {} (clients: MEMTRACK_SOCKET={})",
                    path.display(),
                    path.display()
                );
            }
        }
        job_env
    }

    pub(crate) fn socket_path(&self) -> Option<&Path> {
        self.socket.as_ref().map(|s| s.path.as_path())
    }

    pub(crate) fn stop(self) {
        let _ = self.shutdown.send(true);
        self.runtime
            .shutdown_timeout(std::time::Duration::from_secs(1));
        // Dropping `socket` removes the socket file.
    }
}
