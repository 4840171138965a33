//! The I/O side of a run: one small tokio runtime serving the event socket
//! and HTTP, the S3 uploader, the ClearML reporter, and the channel
//! carrying snapshots to them. The uploads themselves are in
//! `uploads.rs`.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;

use anyhow::Context;
use tokio::sync::{mpsc, watch};

use crate::config::Config;
use crate::engine::EventLink;
use crate::event::inbox::Input;
use crate::export::{clearml, http};
use crate::model::RunInfo;
use crate::store::snapshot::Snapshot;
use crate::sys;

/// HTTP connections served at once; more are closed on accept.
const HTTP_CONNECTIONS: usize = 64;

/// The I/O side of a run: one small tokio runtime serving the event
/// socket and HTTP, and the channel carrying snapshots to them.
pub(super) struct Io {
    pub(crate) runtime: tokio::runtime::Runtime,
    pub(crate) shutdown: watch::Sender<bool>,
    socket: Option<crate::event::server::SocketFile>,
    pub(crate) link: Option<EventLink>,
    pub(crate) snapshots: watch::Sender<Arc<Snapshot>>,
    pub(crate) s3: Option<crate::export::s3::Uploader>,
    /// The `[s3]` settings: their limits serve an upload to the job's
    /// ClearML task's own S3 destination too.
    pub(crate) s3_config: crate::export::s3::S3Config,
    /// Failed S3 uploads (checkpoints and the final one).
    pub(crate) s3_errors: Arc<AtomicU64>,
    pub(crate) clearml: Option<clearml::Reporter>,
    /// The job's announcements of its ClearML task, for the reporter.
    job_tasks: Option<mpsc::Receiver<crate::event::inbox::JobTask>>,
    /// The checkpoint uploader: its stop switch and its task.
    pub(crate) checkpoint_uploads: Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
    /// Where `/metrics` is served.
    pub(crate) metrics: Option<std::net::SocketAddr>,
}

/// Why a run does not report to ClearML.
#[derive(Debug, thiserror::Error)]
pub(super) enum ClearmlOff {
    /// Nothing asks for ClearML (the reason says what is missing).
    #[error("{0}")]
    Unconfigured(clearml::NoZeroConfig),
    /// clearml.conf could not be read.
    #[error(transparent)]
    Conf(clearml::ClearmlError),
}

/// The run's ClearML settings, or why the run does not report to ClearML
/// (for a job that announces a task anyway). A half configuration is
/// refused before anything starts; an unreadable clearml.conf costs only
/// the ClearML reporting, not the run. Without any trigger, the SDK's own
/// setup (clearml.conf) is enough to report into a task the job announces.
pub(super) fn clearml_settings(
    config: &Config,
) -> anyhow::Result<Result<clearml::Settings, ClearmlOff>> {
    let env = |v: &str| std::env::var(v).ok();
    let home = std::env::var_os("HOME").map(PathBuf::from);
    match clearml::resolve(&config.clearml, &env, home.as_deref()) {
        Ok(Some(settings)) => Ok(Ok(settings)),
        Ok(None) => Ok(clearml::zero_config(&config.clearml, &env, home.as_deref())
            .map_err(ClearmlOff::Unconfigured)),
        Err(
            e @ (clearml::ClearmlError::Conf { .. }
            | clearml::ClearmlError::ConfRead { .. }
            | clearml::ClearmlError::ConfTooLarge { .. }),
        ) => {
            tracing::error!("ClearML reporting is off for this run: {e}");
            Ok(Err(ClearmlOff::Conf(e)))
        }
        Err(e) => Err(e.into()),
    }
}

impl Io {
    /// Starts the runtime, then the S3 uploader, the event socket and the
    /// HTTP server, each when configured.
    pub(crate) fn start(
        config: &Config,
        engine: SyncSender<Input>,
        self_register: bool,
        first: Snapshot,
        clearml_off: Option<&str>,
    ) -> anyhow::Result<Io> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("memtrack-io")
            .enable_all()
            .build()
            .context("cannot start the I/O runtime")?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        // The run's identity is known before its first sample.
        let (snapshots, snapshots_rx) = watch::channel(Arc::new(first));
        let mut io = Io {
            runtime,
            shutdown,
            socket: None,
            link: None,
            snapshots,
            s3: None,
            s3_config: config.s3.clone(),
            s3_errors: Arc::new(AtomicU64::new(0)),
            clearml: None,
            job_tasks: None,
            checkpoint_uploads: None,
            metrics: None,
        };

        if !config.s3.url.is_empty() {
            io.start_s3(config)?;
        }

        if !config.socket.is_off() {
            io.serve_socket(
                config,
                engine,
                self_register,
                clearml_off.unwrap_or_default(),
                shutdown_rx.clone(),
            )?;
        }

        io.serve_http(config, snapshots_rx, shutdown_rx)?;
        Ok(io)
    }

    /// The S3 uploader, with a warning now when its credentials will not do.
    fn start_s3(&mut self, config: &Config) -> anyhow::Result<()> {
        let uploader = self
            .runtime
            .block_on(crate::export::s3::Uploader::new(&config.s3))?;
        if let Some(why) = self.runtime.block_on(uploader.credentials_problem()) {
            tracing::warn!(
                "no usable AWS credentials ({why}): the upload to {} will fail; \
                 memory_usage.json stays local and `memtrack upload` can send it later",
                config.s3.url
            );
        } else if let Some(unknown) = uploader.resolved.unknown_profile() {
            tracing::warn!("{unknown}");
        }
        self.s3 = Some(uploader);
        Ok(())
    }

    /// Binds the event socket (or takes the one systemd passed) and serves
    /// it; the engine hears its clients through `engine`.
    fn serve_socket(
        &mut self,
        config: &Config,
        engine: SyncSender<Input>,
        self_register: bool,
        clearml_off: &str,
        shutdown_rx: watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        use crate::event::server;
        let group = if config.socket.group.is_empty() {
            None
        } else {
            sys::group_id(&config.socket.group)
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
                if config.socket.path.as_os_str().is_empty() {
                    first_free()?
                } else {
                    // A chosen path that cannot be had (another run's,
                    // not a socket) costs the job its chosen path, never
                    // its start: the job is told the path used.
                    match server::bind(&config.socket.path, group) {
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
            clearml: Some(job_tasks_tx),
            clearml_off: clearml_off.to_string(),
            clearml_off_said: Default::default(),
            engine,
            notices: notices.clone(),
            stats: Arc::clone(&stats),
            access: server::Access {
                uid: sys::uid(),
                allow_uids: config.socket.allow_uids.clone(),
                group,
                max_connections: config.socket.max_connections,
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

    /// Serves `/metrics` and `/memory-info` on `listen` unless it is off.
    /// An address that is taken (by another run on this machine, or by
    /// every rank of a job given one `--listen`) gives way to a free port
    /// on the same interface, with a warning when it was chosen; the job
    /// starts either way, without `/metrics` when no port can be had.
    fn serve_http(
        &mut self,
        config: &Config,
        snapshots_rx: watch::Receiver<Arc<Snapshot>>,
        shutdown_rx: watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let Some(addr) = crate::config::parse_listen(&config.listen).map_err(anyhow::Error::msg)?
        else {
            return Ok(());
        };
        let bind = |a| self.runtime.block_on(tokio::net::TcpListener::bind(a));
        let listener = match bind(addr) {
            Ok(listener) => listener,
            Err(e) => {
                let any = std::net::SocketAddr::new(addr.ip(), 0);
                match bind(any) {
                    Ok(listener) => {
                        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
                        if config.listen == crate::config::DEFAULT_LISTEN {
                            tracing::info!(
                                "{addr} is taken ({e}; another run?): metrics on port {port} instead"
                            );
                        } else {
                            tracing::warn!(
                                "cannot listen on {addr} ({e}): metrics on port {port} of the \
                                 same host instead (the file_sd target and `memtrack ls` say so)"
                            );
                        }
                        listener
                    }
                    Err(e2) => {
                        tracing::warn!(
                            "cannot listen on {addr} ({e}) nor on a free port ({e2}); \
                             going on without /metrics (set --listen)"
                        );
                        return Ok(());
                    }
                }
            }
        };
        let local = listener.local_addr().unwrap_or(addr);
        tracing::debug!("metrics on http://{local}/metrics");
        self.metrics = Some(local);
        let state = http::HttpState {
            snapshots: snapshots_rx,
            notices: self.link.as_ref().map(|l| l.notices.clone()),
        };
        self.runtime
            .spawn(http::serve(listener, state, HTTP_CONNECTIONS, shutdown_rx));
        Ok(())
    }

    /// Starts the ClearML reporter when the run reports to ClearML; it
    /// hears the job's announcements of its own task. Returns the channel
    /// the engine forwards its log entries on.
    pub(crate) fn start_clearml(
        &mut self,
        clearml_settings: Result<clearml::Settings, ClearmlOff>,
        run: &RunInfo,
        run_dir: &Path,
    ) -> anyhow::Result<Option<mpsc::UnboundedSender<crate::model::Entry>>> {
        // Taken first, so that without ClearML the intake closes here and
        // the socket answers a job's `clearml_task` with "clearml":false at
        // once instead of waiting for a reporter that does not exist.
        let job_tasks = self.job_tasks.take();
        let Ok(mut settings) = clearml_settings else {
            return Ok(None);
        };
        if settings.job_task_only {
            if job_tasks.is_none() {
                // No socket: the job cannot announce a task.
                return Ok(None);
            }
            tracing::debug!(
                "ClearML: {} found; memtrack reports into the task the job announces \
                 (Task.init), if it does",
                settings.host_source
            );
        }
        // The task memtrack may create is named now: a name the server
        // would refuse is adapted for ClearML only, and said once.
        clearml::fit_task_name(&mut settings, &run.name);
        if !settings.adapted.is_empty() {
            tracing::warn!(
                "ClearML refuses names shorter than {} characters and unknown task types; \
                 for ClearML only: {}",
                clearml::MIN_NAME,
                settings.adapted.join("; ")
            );
        }
        // Without S3, the task gets the document where its other artifacts
        // go: its output_uri, clearml.conf's default_output_uri, else the
        // ClearML fileserver (nowhere when none is set: no upload).
        settings.files_upload = self.s3.is_none();
        settings.artifact_expected = self.s3.is_some() || settings.files_upload;
        let (entries_tx, entries_rx) = mpsc::unbounded_channel();
        let _guard = self.runtime.enter();
        self.clearml = Some(clearml::Reporter::start(
            settings,
            run.clone(),
            run_dir.to_path_buf(),
            entries_rx,
            job_tasks,
        ));
        Ok(Some(entries_tx))
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
