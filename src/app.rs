//! Wiring one run together: the run directory, the sampler, the store and
//! its journal, the job (or the attached PIDs), signals, and the engine.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::config::Config;
use crate::engine::{EndWhen, Engine, EngineOptions, EventLink};
use crate::event::inbox::Input;
use crate::export::finish::Deadline;
use crate::export::{clearml, http};
use crate::model::{Exit, RunInfo};
use crate::sample::footprint::{self, FootprintOptions, FootprintReader, SourceChoice};
use crate::sample::procfs::{ProcOptions, ProcTree, SmapsOptions};
use crate::sample::Sampler;
use crate::shutdown::SignalThread;
use crate::store::journal::{self, Journal};
use crate::store::snapshot::Snapshot;
use crate::store::{Limits, Store};
use crate::{sys, target};

/// What to follow.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Spawn this command and follow its tree.
    Run { argv: Vec<String> },
    /// Follow existing processes.
    Attach { pids: Vec<u32> },
}

/// Environment variables turned into run labels (SLURM and torchrun).
pub const LABEL_ENV: &[(&str, &str)] = &[
    ("SLURM_JOB_ID", "slurm_job_id"),
    ("SLURM_PROCID", "slurm_procid"),
    ("SLURM_NODEID", "slurm_nodeid"),
    ("SLURM_LOCALID", "slurm_localid"),
    ("RANK", "rank"),
    ("LOCAL_RANK", "local_rank"),
    ("WORLD_SIZE", "world_size"),
];

/// The run's labels: host, SLURM / torchrun variables, then configured
/// labels (which win).
pub fn run_labels(
    host: &str,
    env: impl Fn(&str) -> Option<String>,
    configured: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    labels.insert("host".to_string(), host.to_string());
    for (var, label) in LABEL_ENV {
        if let Some(v) = env(var).filter(|v| !v.is_empty() && v.len() <= 256) {
            labels.insert((*label).to_string(), v);
        }
    }
    if !labels.contains_key("rank") {
        if let Some(r) = labels.get("slurm_procid").cloned() {
            labels.insert("rank".into(), r);
        }
    }
    labels.extend(configured.iter().map(|(k, v)| (k.clone(), v.clone())));
    labels
}

fn random_id() -> String {
    let mut bytes = [0u8; 16];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
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

fn base_name(arg: &str) -> String {
    Path::new(arg)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The interpreter of `python3 … -c CODE` (not a shell: a shell's `-c`
/// command line names the real job).
fn inline_code(argv: &[String]) -> Option<String> {
    let launcher = base_name(argv.first()?);
    let shell = matches!(launcher.as_str(), "sh" | "bash" | "dash" | "zsh");
    (!shell && is_launcher(&launcher) && argv.iter().any(|a| a == "-c")).then_some(launcher)
}

/// Programs that start the real job, skipped when naming a run.
fn is_launcher(name: &str) -> bool {
    let bare = name.trim_end_matches(|c: char| c.is_ascii_digit() || c == '.');
    matches!(
        bare,
        "" | "env"
            | "sh"
            | "bash"
            | "dash"
            | "zsh"
            | "exec"
            | "nohup"
            | "time"
            | "python"
            | "python3"
            | "torchrun"
            | "accelerate"
            | "deepspeed"
            | "uv"
            | "poetry"
            | "srun"
            | "mpirun"
            | "nice"
            | "taskset"
    ) || matches!(name, "run" | "launch")
}

/// `<script>-<UTC date>-<time>`, e.g. `train-20261122-144302`.
pub fn default_run_name(mode: &Mode) -> String {
    let base = match mode {
        // Named after the script, not the launcher: `python3 train.py`,
        // `torchrun --nproc-per-node 8 train.py` and
        // `sh -c 'python train.py'` are all `train`.
        // `python3 -c CODE` is named after the interpreter: CODE is no file.
        Mode::Run { argv } if inline_code(argv).is_some() => inline_code(argv).unwrap_or_default(),
        Mode::Run { argv } => argv
            .iter()
            .flat_map(|a| a.split_whitespace())
            .filter(|a| !a.starts_with('-') && !a.contains('='))
            .map(|a| {
                Path::new(a)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
            .find(|n| !is_launcher(n))
            .map(|n| n.strip_suffix(".py").map(str::to_string).unwrap_or(n))
            .unwrap_or_else(|| "job".into()),
        Mode::Attach { pids } if !pids.is_empty() => format!("attach-{}", pids[0]),
        Mode::Attach { .. } => "attach".into(),
    };
    let base: String = base
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(48)
        .collect();
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let stamp: String = stamp.chars().filter(char::is_ascii_digit).collect();
    format!(
        "{base}-{}-{}",
        &stamp[..8.min(stamp.len())],
        &stamp[8.min(stamp.len())..]
    )
}

/// Creates the run directory, private to this user (0700). A chosen name
/// is used as is, if it is free or this user's own folder; an automatic one
/// gets `-2`, `-3`… when taken. Runs left behind by a killed memtrack under
/// the same output root are recovered first.
pub fn prepare_run_dir(output: &Path, name: &str, explicit: bool) -> anyhow::Result<PathBuf> {
    crate::files::create_dir_all(output)
        .with_context(|| format!("cannot create output directory {}", output.display()))?;
    recover_leftovers(output);
    let mut dir = output.join(name);
    if explicit {
        if let Some(parent) = dir.parent() {
            crate::files::create_dir_all(parent)
                .with_context(|| format!("cannot create run directory {}", dir.display()))?;
        }
        crate::files::private_dir(&dir)
            .with_context(|| format!("cannot use run directory {}", dir.display()))?;
        return Ok(dir);
    }
    // Created, not found: a folder someone else made under the name is
    // skipped like any taken name.
    let mut n = 2;
    loop {
        match crate::files::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 10_000 => {
                dir = output.join(format!("{name}-{n}"));
                n += 1;
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("cannot create run directory {}", dir.display()))
            }
        }
    }
}

/// Rebuilds `memory_usage.json` of runs whose daemon died. Live runs (lock
/// held) are left alone.
pub fn recover_leftovers(output: &Path) {
    let Ok(entries) = std::fs::read_dir(output) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        // Another user's folder (a shared output root) is theirs to recover.
        if !crate::files::owned_by_me(&dir) || !journal::has_journal(&dir) {
            continue;
        }
        match journal::recover(&dir) {
            Ok(r) => tracing::info!(
                "recovered the run in {} left by a memtrack that did not finish ({} journalled records replayed)",
                dir.display(),
                r.replayed
            ),
            Err(journal::JournalError::Locked(_)) => {}
            Err(e) => tracing::warn!("cannot recover {}: {e}", dir.display()),
        }
    }
}

/// The complete document went to `fallback`: the partial journal left in
/// the run directory must never be recovered over it.
fn supersede_journal(run_dir: &Path, fallback: &Path) {
    match journal::supersede(run_dir, fallback) {
        Ok(kept) => tracing::warn!(
            "the journal in {} holds part of the run only: kept as {}, never recovered",
            run_dir.display(),
            kept.display()
        ),
        Err(e) => tracing::error!(
            "the partial journal in {} may be recovered over nothing better: {e}",
            run_dir.display()
        ),
    }
}

/// Removes what a run created when it fails before its engine starts, so
/// a job that cannot start leaves no half-written run behind.
struct Cleanup {
    dir: PathBuf,
    existed: bool,
    /// Whether `.memtrack/` was already there: then it belongs to another
    /// memtrack (a live run holding the lock, or a dead one's journal
    /// waiting for recovery) and is never removed.
    journal_existed: bool,
    armed: bool,
}

impl Cleanup {
    fn new(dir: &Path) -> Cleanup {
        // prepare_run_dir has just created it unless a chosen name reused it.
        let existed = std::fs::read_dir(dir)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true);
        Cleanup {
            dir: dir.to_path_buf(),
            existed,
            journal_existed: dir.join(journal::DIR).exists(),
            armed: true,
        }
    }

    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if !self.journal_existed {
            let _ = std::fs::remove_dir_all(self.dir.join(journal::DIR));
        }
        if !self.existed {
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// The I/O side of a run: one small tokio runtime serving the event
/// socket and HTTP, and the channel carrying snapshots to them.
struct Io {
    runtime: tokio::runtime::Runtime,
    shutdown: tokio::sync::watch::Sender<bool>,
    socket: Option<crate::event::server::SocketFile>,
    link: Option<EventLink>,
    snapshots: tokio::sync::watch::Sender<Arc<Snapshot>>,
    s3: Option<crate::export::s3::Uploader>,
    /// Failed S3 uploads (checkpoints and the final one).
    s3_errors: Arc<AtomicU64>,
    clearml: Option<clearml::Reporter>,
    /// The job's announcements of its ClearML task, for the reporter.
    job_tasks: Option<tokio::sync::mpsc::UnboundedReceiver<crate::event::inbox::JobTask>>,
    /// The checkpoint uploader: its stop switch and its task.
    checkpoint_uploads: Option<(
        tokio::sync::watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    )>,
}

impl Io {
    fn start(
        config: &Config,
        engine: SyncSender<Input>,
        self_register: bool,
        first: Snapshot,
    ) -> anyhow::Result<Io> {
        use crate::event::server;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("memtrack-io")
            .enable_all()
            .build()
            .context("cannot start the I/O runtime")?;
        let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
        // The run's identity is known before its first sample.
        let (snapshots, snapshots_rx) = tokio::sync::watch::channel(Arc::new(first));
        let mut io = Io {
            runtime,
            shutdown,
            socket: None,
            link: None,
            snapshots,
            s3: None,
            s3_errors: Arc::new(AtomicU64::new(0)),
            clearml: None,
            job_tasks: None,
            checkpoint_uploads: None,
        };

        if !config.s3.url.is_empty() {
            let uploader = io
                .runtime
                .block_on(crate::export::s3::Uploader::new(&config.s3))?;
            if let Some(why) = io.runtime.block_on(uploader.credentials_problem()) {
                tracing::warn!(
                    "no usable AWS credentials ({why}): the upload to {} will fail; \
                     memory_usage.json stays local and `memtrack upload` can send it later",
                    config.s3.url
                );
            } else if let Some(unknown) = uploader.resolved.unknown_profile() {
                tracing::warn!("{unknown}");
            }
            io.s3 = Some(uploader);
        }

        if !config.socket.is_off() {
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
                    let path = if config.socket.path.as_os_str().is_empty() {
                        server::default_path().context("cannot choose a socket path")?
                    } else {
                        config.socket.path.clone()
                    };
                    server::bind(&path, group)?
                }
            };
            let (notices, _) = tokio::sync::broadcast::channel(64);
            let stats = Arc::new(server::Stats::default());
            let (job_tasks_tx, job_tasks_rx) = tokio::sync::mpsc::unbounded_channel();
            io.job_tasks = Some(job_tasks_rx);
            let shared = Arc::new(server::Shared {
                clearml: Some(job_tasks_tx),
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
            let listener = {
                let _guard = io.runtime.enter();
                tokio::net::UnixListener::from_std(std_listener)
                    .context("cannot serve the socket")?
            };
            io.runtime
                .spawn(server::serve(listener, shared, shutdown_rx.clone()));
            io.socket = Some(file);
            io.link = Some(EventLink {
                notices,
                stats,
                self_register,
            });
        }

        if let Some(addr) =
            crate::config::parse_listen(&config.listen).map_err(anyhow::Error::msg)?
        {
            let bound = io.runtime.block_on(tokio::net::TcpListener::bind(addr));
            match bound {
                Ok(listener) => {
                    let local = listener.local_addr().unwrap_or(addr);
                    tracing::info!("metrics on http://{local}/metrics");
                    let state = http::State {
                        snapshots: snapshots_rx,
                        notices: io.link.as_ref().map(|l| l.notices.clone()),
                    };
                    io.runtime
                        .spawn(http::serve(listener, state, HTTP_CONNECTIONS, shutdown_rx));
                }
                Err(e) if config.listen == crate::config::DEFAULT_LISTEN => {
                    tracing::warn!(
                        "cannot listen on {addr} ({e}); going on without /metrics (set --listen)"
                    );
                }
                Err(e) => return Err(anyhow::anyhow!("cannot listen on {addr}: {e}")),
            }
        }
        Ok(io)
    }

    /// Uploads the run's document within the deadline; logs the outcome
    /// and, on failure, the command that uploads it later. `None` when S3
    /// is off.
    fn upload(
        &self,
        document: &Path,
        run: &RunInfo,
        task: Option<clearml::TaskRef>,
        deadline: &Deadline,
    ) -> Option<Result<crate::export::s3::Uploaded, crate::export::s3::S3Error>> {
        let s3 = self.s3.as_ref()?;
        let key = object_key(s3, run, task);
        let what = format!("the upload to {}", s3.endpoint);
        let result = self
            .runtime
            .block_on(deadline.bound(&what, s3.upload(document, &key)))
            .unwrap_or_else(|| {
                Err(crate::export::s3::S3Error::Deadline {
                    endpoint: s3.endpoint.clone(),
                    bucket: s3.dest.bucket.clone(),
                    after: crate::units::format_duration(deadline.limit()),
                })
            });
        if result.is_err() {
            self.s3_errors.fetch_add(1, Ordering::Relaxed);
        }
        match &result {
            Ok(u) => tracing::info!(
                "uploaded {} ({} bytes, {} part{})",
                u.uri,
                u.size,
                u.parts,
                if u.parts == 1 { "" } else { "s" }
            ),
            Err(e) => tracing::error!(
                "upload failed: {e}; {} is intact; to upload it later, run: {}",
                document.display(),
                s3.retry_command(&absolute(document))
            ),
        }
        Some(result)
    }

    /// Uploads the document after every checkpoint: always with
    /// `s3.upload_checkpoints` (`always`), else once memtrack reports into
    /// the job's own ClearML task, where each upload is handed to the
    /// reporter to register as the `memory_usage` artifact while the task
    /// takes it. When that task becomes known, an early checkpoint is asked
    /// of the engine, so the artifact is there long before the job's SDK
    /// closes the task.
    fn upload_checkpoints(
        &mut self,
        document: PathBuf,
        run: &RunInfo,
        always: bool,
        engine: SyncSender<Input>,
    ) -> Option<tokio::sync::watch::Sender<u64>> {
        let s3 = self.s3.clone()?;
        let (tx, mut rx) = tokio::sync::watch::channel(0u64);
        let run = run.clone();
        let task = self.clearml.as_ref().map(|r| r.task_updates());
        let mut job_task = self.clearml.as_ref().map(|r| r.job_task());
        let artifacts = self.clearml.as_ref().and_then(|r| r.artifacts());
        let mut shutdown = self.shutdown.subscribe();
        let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
        let errors = Arc::clone(&self.s3_errors);
        let handle = self.runtime.spawn(async move {
            loop {
                // An upload under way is never cut: stopping waits for it.
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = stop.changed() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                    changed = clearml::reporter::job_task_changed(&mut job_task) => {
                        if changed && clearml::reporter::job_task_known(&job_task) {
                            let _ = engine.try_send(Input::Checkpoint);
                        }
                        continue;
                    }
                }
                let for_job_task = clearml::reporter::job_task_known(&job_task);
                if !always && !for_job_task {
                    continue;
                }
                let key = object_key(&s3, &run, task.as_ref().and_then(|t| t.borrow().clone()));
                let uploaded = s3.upload(&document, &key).await;
                if let Err(e) = &uploaded {
                    errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "checkpoint upload failed (the final upload will try again): {e}"
                    );
                }
                if let (true, Some(a)) = (for_job_task, &artifacts) {
                    let _ = a.send(
                        uploaded
                            .map(|u| clearml::Artifact {
                                uri: u.uri,
                                size: u.size,
                                sha256: u.sha256,
                            })
                            .map_err(|e| e.to_string()),
                    );
                }
            }
        });
        self.checkpoint_uploads = Some((stop_tx, handle));
        Some(tx)
    }

    /// Stops the checkpoint uploader, waiting for an upload under way, so
    /// that no checkpoint lands on the object after the final document.
    /// Past the deadline the upload under way is abandoned (the final
    /// upload then has no time left either).
    fn stop_checkpoint_uploads(&mut self, deadline: &Deadline) {
        if let Some((stop, mut handle)) = self.checkpoint_uploads.take() {
            let _ = stop.send(true);
            let done = self
                .runtime
                .block_on(deadline.bound("a checkpoint upload under way", &mut handle));
            if done.is_none() {
                handle.abort();
            }
        }
    }

    fn socket_path(&self) -> Option<&Path> {
        self.socket.as_ref().map(|s| s.path.as_path())
    }

    fn stop(self) {
        let _ = self.shutdown.send(true);
        self.runtime
            .shutdown_timeout(std::time::Duration::from_secs(1));
        // Dropping `socket` removes the socket file.
    }
}

/// `path` made absolute (for a command printed to be run elsewhere).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The document's S3 key: ClearML's artifact layout
/// (`<project>/<task name>.<task id>/…`) once a ClearML task is known,
/// else `<run>/…`.
fn object_key(
    s3: &crate::export::s3::Uploader,
    run: &RunInfo,
    task: Option<clearml::TaskRef>,
) -> String {
    let task = task.map(|t| crate::export::s3::TaskKey {
        project: t.project,
        name: t.name,
        id: t.id,
    });
    crate::export::s3::object_key(
        &s3.dest,
        &run.name,
        task.as_ref(),
        &crate::export::s3::file_name(&run.labels),
    )
}

/// What `memtrack clearml-resend` achieved.
#[derive(Debug)]
pub struct Resent {
    /// One line for the user.
    pub summary: String,
    /// Nothing is left to send and nothing was refused.
    pub complete: bool,
    pub report: clearml::FinishReport,
}

/// Sends what an ended run left for ClearML in `run_dir`: the points of its
/// spool file, into the task it reported into (`clearml-task.json`) unless
/// the configuration names one, or into a task created now when the run
/// never got one. A task that run created and could not end is ended as the
/// job did. What still cannot be sent stays in the spool.
pub fn clearml_resend(
    run_dir: &Path,
    config: &Config,
    timeout: Duration,
) -> anyhow::Result<Resent> {
    if journal::is_live(run_dir) {
        anyhow::bail!(
            "{} belongs to a live memtrack, which is still sending its points",
            run_dir.display()
        );
    }
    let spool = run_dir.join(clearml::SPOOL_FILE);
    let task_file = run_dir.join(clearml::TASK_FILE);
    if !spool.exists() && !task_file.exists() {
        return Ok(Resent {
            summary: format!(
                "nothing to send: {} holds no {}",
                run_dir.display(),
                clearml::SPOOL_FILE
            ),
            complete: true,
            report: clearml::FinishReport::default(),
        });
    }
    let document = run_dir.join(crate::model::json::FILE_NAME);
    let doc = crate::report::read::without_log(&document).with_context(|| {
        format!(
            "the run's JSON is needed for its name and exit (after a killed memtrack, run              `memtrack recover {}` first)",
            run_dir.display()
        )
    })?;
    // Asking for a resend turns ClearML on unless it is turned off.
    let mut cc = config.clearml.clone();
    if cc.enabled.trim().eq_ignore_ascii_case("auto") || cc.enabled.trim().is_empty() {
        cc.enabled = "true".into();
    }
    let mut settings = clearml::resolve(
        &cc,
        &|v| std::env::var(v).ok(),
        std::env::var_os("HOME").map(PathBuf::from).as_deref(),
    )?
    .ok_or_else(|| anyhow::anyhow!("ClearML is turned off (clearml.enabled = false)"))?;
    if settings.task.is_none() {
        if let Some(note) = clearml::read_task_note(&task_file)? {
            settings.task = Some(note.id);
            settings.owns_task = note.created;
        }
    }
    let run = clearml::RunInfoLite {
        name: doc.run.name.clone(),
        id: doc.run.id.clone(),
        host: doc.run.host.clone(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (report, bad) = runtime.block_on(async {
        let (reporter, bad) = clearml::Reporter::resend(settings, run, run_dir.to_path_buf())
            .with_context(|| format!("cannot read {}", spool.display()))?;
        let end = clearml::RunEnd {
            exit: doc.run.exit,
            artifact: None,
        };
        anyhow::Ok((reporter.finish(end, timeout).await, bad))
    })?;
    if bad > 0 {
        tracing::warn!(
            "{bad} lines of {} were not points (torn by a kill?) and were skipped",
            spool.display()
        );
    }
    let task = report
        .task
        .as_ref()
        .map_or_else(|| "no task".to_string(), |t| format!("task {}", t.id));
    let complete = report.unsent == 0 && report.refused == 0 && report.discarded == 0 && bad == 0;
    let mut summary = format!("ClearML ({task}): {} points sent", report.sent);
    if report.unsent > 0 {
        summary.push_str(&format!(
            ", {} still unsent in {}",
            report.unsent,
            spool.display()
        ));
    }
    if report.refused > 0 {
        summary.push_str(&format!(", {} refused by the server", report.refused));
    }
    if let Some(status) = &report.final_status {
        summary.push_str(&format!("; task marked {status}"));
    }
    if !report.errors.is_empty() {
        summary.push_str(&format!("; {}", report.errors.join("; ")));
    }
    Ok(Resent {
        summary,
        complete,
        report,
    })
}

/// Logs what the ClearML reporter achieved; true when something was lost
/// or left unsent.
fn log_clearml(report: &clearml::FinishReport) -> bool {
    let task = report
        .task
        .as_ref()
        .map_or_else(|| "no task".to_string(), |t| format!("task {}", t.id));
    let failed = report.unsent > 0 || report.refused > 0 || report.task.is_none();
    if failed {
        tracing::error!(
            "ClearML ({task}): {} points sent, {} unsent{}, {} refused; {}",
            report.sent,
            report.unsent,
            report
                .spool
                .as_ref()
                .map(|p| format!(
                    " (kept in {}; `memtrack clearml-resend {}` sends them)",
                    p.display(),
                    p.parent().unwrap_or(Path::new(".")).display()
                ))
                .unwrap_or_default(),
            report.refused,
            report.errors.join("; ")
        );
    } else {
        tracing::info!(
            "ClearML ({task}): {} points sent{}{}",
            report.sent,
            if report.artifact_registered {
                ", artifact registered"
            } else {
                ""
            },
            report
                .final_status
                .as_ref()
                .map(|s| format!(", task {s}"))
                .unwrap_or_default()
        );
    }
    failed
}

/// HTTP connections served at once; more are closed on accept.
const HTTP_CONNECTIONS: usize = 64;

/// memtrack's own high-water mark (bytes).
fn own_vm_hwm() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|text| crate::sample::parse::parse_status(&text).ok())
        .map_or(0, |s| s.vm_hwm)
}

/// Starts the job, in a memory cgroup of its own when one can be had (the
/// exact source of the tree's host figure), else as it is, the reader then
/// choosing the job's existing cgroup or Σ Pss.
fn spawn_job(
    argv: &[String],
    env: &[(String, String)],
    opts: FootprintOptions,
    run_id: &str,
) -> Result<(std::process::Child, FootprintReader), target::TargetError> {
    if opts.choice != SourceChoice::Auto {
        return Ok((target::spawn(argv, env)?, FootprintReader::new(opts, None)));
    }
    let why = match footprint::job_cgroup(&opts.proc_root, run_id) {
        Ok(cgroup) => {
            let joined = std::fs::OpenOptions::new()
                .write(true)
                .open(cgroup.procs_path())
                .map_err(|e| e.to_string())
                .and_then(|procs| {
                    target::spawn_in(argv, env, Some(procs)).map_err(|e| e.to_string())
                });
            match joined {
                Ok(child) => {
                    tracing::debug!("the job runs in memory cgroup {}", cgroup.dir().display());
                    return Ok((child, FootprintReader::with_created(opts, cgroup)));
                }
                Err(e) => {
                    let why = format!(
                        "the job could not join memory cgroup {}: {e}",
                        cgroup.dir().display()
                    );
                    if let Err(e) = cgroup.remove() {
                        tracing::warn!("{e}");
                    }
                    why
                }
            }
        }
        Err(why) => why,
    };
    tracing::debug!("no memory cgroup of its own for the job: {why}");
    let child = target::spawn(argv, env)?;
    Ok((child, FootprintReader::new(opts, Some(why))))
}

/// What a finished daemon reports to `main`.
#[derive(Debug)]
pub struct Outcome {
    /// The process exit status memtrack should use.
    pub exit_code: i32,
    pub document: PathBuf,
}

/// Runs `memtrack run` or `memtrack attach` to the end.
pub fn run_daemon(mode: Mode, config: Config) -> anyhow::Result<Outcome> {
    let explicit = !config.name.is_empty();
    let name = if explicit {
        config.name.clone()
    } else {
        default_run_name(&mode)
    };
    if let Mode::Attach { pids } = &mode {
        for pid in pids {
            if !sys::pid_exists(*pid) {
                bail!("no process with PID {pid}");
            }
        }
    }

    // A half configuration is refused before anything starts; an unreadable
    // clearml.conf costs only the ClearML reporting, not the run.
    let clearml_settings = match clearml::resolve(
        &config.clearml,
        &|v| std::env::var(v).ok(),
        std::env::var_os("HOME").map(PathBuf::from).as_deref(),
    ) {
        Ok(settings) => settings,
        Err(
            e @ (clearml::ClearmlError::Conf { .. }
            | clearml::ClearmlError::ConfRead { .. }
            | clearml::ClearmlError::ConfTooLarge { .. }),
        ) => {
            tracing::error!("ClearML reporting is off for this run: {e}");
            None
        }
        Err(e) => return Err(e.into()),
    };

    let is_run = matches!(mode, Mode::Run { .. });
    if is_run {
        // Orphaned workers then stay in the tree and their exits reach us.
        if let Err(e) = sys::become_subreaper() {
            tracing::debug!("cannot become a child subreaper: {e}");
        }
    }
    let host = sysinfo::System::host_name().unwrap_or_else(|_| "unknown".into());
    let labels = run_labels(&host, |v| std::env::var(v).ok(), &config.labels);
    // One rank of a multi-node job shares the job's run name; its own
    // directory (and journal) carries the rank.
    let dir_name = match labels.get("rank") {
        Some(rank) => format!("{name}.rank{rank}"),
        None => name.clone(),
    };
    let run_dir = prepare_run_dir(&config.output, &dir_name, explicit)?;
    let mut cleanup = Cleanup::new(&run_dir);
    let gpu = crate::sample::open_gpu(
        &config.gpu,
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
    );
    let backend = gpu.backend();
    if backend == "nvml" {
        let names: Vec<String> = gpu
            .devices()
            .iter()
            .map(|d| format!("{} {}", d.index, d.name))
            .collect();
        tracing::info!("GPU figures from NVML: {}", names.join(", "));
    } else {
        tracing::info!(
            "host-only mode, GPU figures are 0: {}",
            backend.trim_start_matches("none: ")
        );
    }

    let document = run_dir.join(crate::model::json::FILE_NAME);
    let run = RunInfo {
        id: random_id(),
        // A rank's run name is the job's, shared by all its ranks; otherwise
        // the directory's (an automatic name may have gained a `-2`).
        name: if labels.contains_key("rank") {
            name
        } else {
            run_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or(name)
        },
        host: host.clone(),
        mode: if is_run { "run" } else { "attach" }.into(),
        command: match &mode {
            Mode::Run { argv } => argv.clone(),
            Mode::Attach { .. } => Vec::new(),
        },
        start: crate::units::unix_now(),
        labels: labels.clone(),
        interval_s: config.interval.as_secs_f64(),
        memtrack_version: env!("CARGO_PKG_VERSION").into(),
        gpu_backend: backend,
        ..RunInfo::default()
    };
    let limits = Limits {
        max_timer_entries: config.log.max_timer_entries,
        max_event_entries: config.log.max_event_entries,
        target_series_points: config.log.target_series_points,
        max_targets: config.log.max_targets,
        max_components: config.log.max_components,
        max_event_kinds: config.log.max_event_kinds,
        max_open_spans: config.log.max_open_spans,
        max_stages: config.log.max_stages,
        ..Limits::default()
    };
    let mut store = Store::new(run, limits, config.pressure);
    store.describe_gpus(gpu.devices());
    let journal = Journal::create(&run_dir, &mut store)
        .with_context(|| format!("cannot write to the run directory {}", run_dir.display()))?;

    sys::raise_nofile_limit();
    let (tx, rx) = sync_channel::<Input>(65_536);
    let self_register = matches!(&mode, Mode::Attach { pids } if pids.is_empty());
    let mut io = Io::start(&config, tx.clone(), self_register, store.snapshot())?;
    let mut entries = None;
    let job_tasks = io.job_tasks.take();
    if let Some(mut settings) = clearml_settings {
        // The task memtrack may create is named now: refuse a name the
        // server would refuse before the job starts.
        clearml::check_task_name(&settings, &store.run.name)?;
        settings.artifact_expected = io.s3.is_some();
        let (entries_tx, entries_rx) = tokio::sync::mpsc::unbounded_channel();
        let _guard = io.runtime.enter();
        io.clearml = Some(clearml::Reporter::start(
            settings,
            clearml::RunInfoLite {
                name: store.run.name.clone(),
                id: store.run.id.clone(),
                host: store.run.host.clone(),
            },
            run_dir.clone(),
            entries_rx,
            job_tasks,
        ));
        entries = Some(entries_tx);
    }
    let mut job_env = Vec::new();
    if let Some(path) = io.socket_path() {
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
    let mut opts = ProcOptions {
        root: config.host.proc_root.clone(),
        hwm_interval: config.host.hwm_interval,
        reaper: is_run.then(std::process::id),
        job: None,
        smaps: config.host.smaps.then_some(SmapsOptions {
            interval: config.host.smaps_interval,
            max_rss: config.host.smaps_max_rss_mb << 20,
        }),
    };

    let footprint_opts = FootprintOptions {
        choice: config.host.source,
        proc_root: config.host.proc_root.clone(),
        pss_budget: config.host.pss_budget,
    };

    // Signals are handled before the job exists, so none can kill
    // memtrack between the spawn and the handlers.
    let signals =
        SignalThread::start(is_run, tx.clone()).context("cannot install signal handlers")?;
    // Start the job last, once everything that can fail has succeeded.
    let (tree, end_when, footprint) = match &mode {
        Mode::Run { argv } => {
            // The job's wait4 peak starts from memtrack's own (the child
            // is a copy of memtrack until it executes): only a peak above
            // that one is the job's.
            let inherited_hwm = own_vm_hwm();
            let (child, footprint) = spawn_job(argv, &job_env, footprint_opts, &store.run.id)?;
            let pid = child.id();
            signals.set_job(pid);
            opts.job = Some(pid);
            let mut tree = ProcTree::new(opts).context("cannot read procfs")?;
            if let Err(e) = tree.add_root(pid) {
                // A job that ends at once is gone before we look.
                tracing::debug!("cannot follow the job: {e}");
            }
            let waiter_tx = tx.clone();
            std::thread::Builder::new()
                .name("memtrack-wait".into())
                .spawn(move || {
                    // The Child handle is not used to wait: wait4 also gives
                    // the exact peak RSS.
                    let _child = child;
                    match sys::wait_child(pid, true) {
                        Ok(Some(mut reaped)) => {
                            if reaped.max_rss_kib * 1024 <= inherited_hwm {
                                reaped.max_rss_kib = 0;
                            }
                            let _ = waiter_tx.send(Input::JobExited { pid, reaped });
                        }
                        other => tracing::error!("cannot wait for the job: {other:?}"),
                    }
                })
                .context("cannot start the waiter thread")?;
            (tree, EndWhen::JobExits, footprint)
        }
        Mode::Attach { pids } => {
            let mut tree = ProcTree::new(opts).context("cannot read procfs")?;
            for pid in pids {
                tree.add_root(*pid)
                    .with_context(|| format!("cannot follow PID {pid}"))?;
            }
            let end = if pids.is_empty() {
                EndWhen::Stopped
            } else {
                EndWhen::TreeEmpty
            };
            (tree, end, FootprintReader::new(footprint_opts, None))
        }
    };
    let meminfo = File::open(config.host.proc_root.join("meminfo")).ok();
    let sampler = Sampler::new(tree, footprint, gpu, meminfo);
    let mut engine = Engine::new(
        sampler,
        store,
        Some(journal),
        EngineOptions {
            interval: config.interval,
            checkpoint_interval: config.checkpoint_interval,
            journal_flush: std::time::Duration::from_secs(1),
            end_when,
            flight: config
                .flight
                .enabled
                .then_some((config.flight.interval, config.flight.window)),
        },
        io.link.clone(),
        Some(io.snapshots.clone()),
    );
    if config.s3.upload_checkpoints || io.clearml.is_some() {
        let always = config.s3.upload_checkpoints;
        if let Some(tx) =
            io.upload_checkpoints(document.clone(), &engine.store().run, always, tx.clone())
        {
            engine.notify_checkpoints(tx);
        }
    }
    if io.s3.is_some() {
        engine.count_export_errors("s3", Arc::clone(&io.s3_errors));
    }
    if let Some(reporter) = &io.clearml {
        engine.count_export_errors("clearml", reporter.errors());
    }
    if let Some(tx) = entries {
        engine.forward_entries(tx);
    }
    drop(tx);
    cleanup.disarm();
    let (ended, store) = engine.run(&rx);
    // A run directory that cannot take the final JSON (a full disk) must
    // not lose the run: the document goes to the temporary directory.
    let mut document = document;
    let written = match &ended.write_error {
        None => true,
        Some(e) => {
            let fallback = std::env::temp_dir().join(format!(
                "memtrack-{}-{}",
                store.run.id,
                crate::model::json::FILE_NAME
            ));
            match crate::model::json::write_document(&fallback, &store.document_view()) {
                Ok(()) => {
                    tracing::error!(
                        "{} could not be written ({e}); the run's JSON is in {} instead",
                        document.display(),
                        fallback.display()
                    );
                    supersede_journal(&run_dir, &fallback);
                    document = fallback;
                    true
                }
                Err(e2) => {
                    tracing::error!("the run's JSON could not be written anywhere: {e}; {e2}");
                    false
                }
            }
        }
    };
    let first_signal = signals.stop();

    // The local file is written; now what goes over the network, unless a
    // second signal asked to stop at once.
    let mut export_failed = false;
    let clearml = io.clearml.take();
    if ended.urgent {
        if let Some(s3) = &io.s3 {
            tracing::warn!(
                "stopping at once: the upload was skipped; to upload it later, run: {}",
                s3.retry_command(&absolute(&document))
            );
        }
        if let Some(reporter) = clearml {
            // No network wait: what is not sent yet goes to the spool file.
            let end = clearml::RunEnd {
                exit: ended.job_exit,
                artifact: None,
            };
            let report = io.runtime.block_on(reporter.finish(end, Duration::ZERO));
            if report.unsent > 0 {
                tracing::warn!(
                    "stopping at once: {} points not yet sent to ClearML stay in {}",
                    report.unsent,
                    run_dir.join(clearml::SPOOL_FILE).display()
                );
            }
        }
    } else {
        // Everything from here on shares one deadline.
        let deadline = Deadline::start(config.finish_timeout);
        // The key follows ClearML's layout when the task is known: give a
        // task still being created a moment.
        let task = match (&clearml, &io.s3) {
            (Some(reporter), Some(_)) => {
                let wait = config
                    .clearml
                    .final_flush_timeout
                    .min(Duration::from_secs(10))
                    .min(deadline.remaining());
                io.runtime.block_on(
                    deadline.announce("the ClearML task to be created", reporter.settle(wait)),
                )
            }
            _ => None,
        };
        io.stop_checkpoint_uploads(&deadline);
        let uploaded = if written {
            io.upload(&document, &store.run, task.clone(), &deadline)
        } else {
            None
        };
        let upload_failed = matches!(uploaded, Some(Err(_)));
        export_failed |= upload_failed;
        if let Some(reporter) = clearml {
            let artifact = match uploaded {
                Some(Ok(u)) => Some(clearml::Artifact {
                    uri: u.uri,
                    size: u.size,
                    sha256: u.sha256,
                }),
                _ => None,
            };
            let end = clearml::RunEnd {
                exit: ended.job_exit,
                artifact,
            };
            // What the deadline leaves; points not sent by then stay in the
            // spool, and the log says how to send them.
            let wait = config.clearml.final_flush_timeout.min(deadline.remaining());
            let report = io
                .runtime
                .block_on(deadline.announce("ClearML's last points", reporter.finish(end, wait)));
            export_failed |= log_clearml(&report);
        }
        // A failed upload keeps the task noted, so that `memtrack upload`
        // later puts the file under the task's key too.
        if let (true, Some(task)) = (upload_failed, &task) {
            clearml::note_task(&run_dir, task, false);
        }
    }
    io.stop();

    let peaks = store.peaks();
    // memtrack's own high-water mark, the final write included: what the
    // monitor itself cost the machine (bench/soak reads this line).
    let own_peak = crate::units::mib(own_vm_hwm());
    tracing::info!(
        "run {} ended: peak host RAM {:.1} MiB, peak GPU {:.1} MiB; {}; memtrack's own peak RSS {own_peak:.1} MiB",
        store.run.name,
        peaks.cpu_ram_used_mb.max(peaks.cpu_ram_hwm_mb),
        peaks.gpu_process_used_mb.max(peaks.reserved_gpu_ram_mb),
        match (written, export_failed) {
            (true, false) => format!("wrote {}", document.display()),
            (true, true) => format!("wrote {}; an export failed (see above)", document.display()),
            (false, _) => "the JSON could not be written (see above)".to_string(),
        }
    );
    // `run` exits as its job did. `attach` ends normally on a signal; a
    // `run` stopped before its job ended reports the signal, as a shell would.
    // An export failure never hides the job's status; in `attach` mode it
    // is the status.
    let exit_code = match (ended.job_exit, first_signal) {
        (Some(exit), _) => exit.code,
        (None, Some(sig)) if is_run => Exit::signal(sig).code,
        (None, _) if ended.write_error.is_some() || export_failed => 1,
        (None, _) => 0,
    };
    Ok(Outcome {
        exit_code,
        document,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_from_slurm_and_torchrun() {
        let env = |v: &str| match v {
            "SLURM_JOB_ID" => Some("4242".to_string()),
            "SLURM_PROCID" => Some("3".to_string()),
            "LOCAL_RANK" => Some("1".to_string()),
            _ => None,
        };
        let mut configured = BTreeMap::new();
        configured.insert("team".to_string(), "nlp".to_string());
        let l = run_labels("node7", env, &configured);
        assert_eq!(l["host"], "node7");
        assert_eq!(l["slurm_job_id"], "4242");
        assert_eq!(l["rank"], "3", "SLURM_PROCID stands in for RANK");
        assert_eq!(l["local_rank"], "1");
        assert_eq!(l["team"], "nlp");

        // torchrun under SLURM: torchrun's RANK is the global rank.
        let env = |v: &str| match v {
            "SLURM_PROCID" => Some("1".to_string()),
            "RANK" => Some("9".to_string()),
            "WORLD_SIZE" => Some("16".to_string()),
            _ => None,
        };
        let l = run_labels("node7", env, &BTreeMap::new());
        assert_eq!(l["rank"], "9", "RANK wins over SLURM_PROCID");
        assert_eq!(l["world_size"], "16");
        assert_eq!(l["slurm_procid"], "1");
    }

    #[test]
    fn run_names() {
        let name = |argv: &[&str]| {
            default_run_name(&Mode::Run {
                argv: argv.iter().map(|a| a.to_string()).collect(),
            })
        };
        let n = name(&["/usr/bin/python3", "train.py"]);
        assert!(n.starts_with("train-2"), "{n}");
        assert!(name(&["python3.11", "-u", "examples/demo_job.py"]).starts_with("demo_job-2"));
        assert!(name(&["torchrun", "--nproc-per-node=8", "train.py"]).starts_with("train-2"));
        assert!(name(&["sh", "-c", "exec python finetune.py --lr 3e-4"]).starts_with("finetune-2"));
        assert!(name(&["./bin/serve"]).starts_with("serve-2"));
        assert!(name(&["sh", "-c", "exit 7"]).starts_with("exit-"));
        assert!(name(&["python3", "-c", "import time"]).starts_with("python3-"));
        assert!(name(&["/usr/bin/python3.11", "-u", "-c", "x"]).starts_with("python3.11-"));
        let dir = tempfile::tempdir().unwrap();
        let a = prepare_run_dir(dir.path(), "x", false).unwrap();
        let b = prepare_run_dir(dir.path(), "x", false).unwrap();
        assert_ne!(a, b);
        assert!(b.ends_with("x-2"));
    }
}
