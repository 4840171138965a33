//! ClearML settings: memtrack's `[clearml]` section, and the settings the
//! reporter runs with, resolved from that section, the `CLEARML_*`
//! environment and `clearml.conf` ([`resolve`]).
//!
//! Credentials never appear in logs or errors: [`Credentials`] prints
//! masked, and every [`ClearmlError`] names a source, never a secret.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::hocon;
use super::output::ConfProblem;
use crate::switch::Switch;
use crate::units::serde_duration;

/// `clearml.conf` files larger than this are refused before parsing.
pub(crate) const MAX_CONF_BYTES: u64 = 1 << 20;

/// Longest wait between two attempts of a failing request.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// First wait after a failed attempt (doubled each time up to the cap).
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(500);

/// ClearML scalars (docs/clearml.md). Credentials are never set here:
/// they come from `CLEARML_*` variables or `clearml.conf`, as ClearML users
/// have them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClearmlConfig {
    /// `auto`: on when `CLEARML_TASK_ID` or `CLEARML_API_HOST` is set, or a
    /// task or project is given here, else with only `clearml.conf` for a
    /// task the job announces (`zero_config`); `true`: on; `false`: off.
    pub enabled: Switch,
    /// Report into this task (else `CLEARML_TASK_ID`; else one is created).
    pub task: String,
    /// Project of a task memtrack creates (made if missing).
    pub project: String,
    /// Name of a task memtrack creates. Empty: the run name.
    pub task_name: String,
    /// Type of a task memtrack creates (training, inference, monitor, …).
    pub task_type: String,
    /// Without a given task, how long memtrack waits for the job to
    /// announce the task its ClearML SDK made before creating one.
    #[serde(with = "serde_duration")]
    pub job_task_wait: Duration,
    /// Timer samples are forwarded at most this often (the maxima of the
    /// window); marks are all forwarded. `0s`: every timer sample.
    #[serde(with = "serde_duration")]
    pub timer_every: Duration,
    /// In the job's own task: without an iteration from the job this long
    /// after it announced the task, memtrack's points use the seconds since
    /// the run's start as their iteration (as ClearML's own monitor does
    /// after 3 minutes).
    #[serde(with = "serde_duration")]
    pub time_axis_after: Duration,
    /// Points per `events.add_batch` request.
    pub batch_max: usize,
    /// A batch is sent at least this often.
    #[serde(with = "serde_duration")]
    pub flush_interval: Duration,
    /// Points kept in memory while the server is unreachable; beyond it
    /// they spill to `clearml-spool.jsonl` in the run directory.
    pub queue_max: usize,
    /// How long the end of the run waits for the last points.
    #[serde(with = "serde_duration")]
    pub final_flush_timeout: Duration,
    #[serde(with = "serde_duration")]
    pub request_timeout: Duration,
    /// API server (else `CLEARML_API_HOST`, else `clearml.conf`).
    pub api_host: String,
    /// `clearml.conf` to read (else `CLEARML_CONFIG_FILE`, else
    /// `~/clearml.conf`).
    pub config_file: PathBuf,
}

impl Default for ClearmlConfig {
    fn default() -> Self {
        ClearmlConfig {
            enabled: Switch::Auto,
            task: String::new(),
            project: "memtrack".into(),
            task_name: String::new(),
            task_type: "training".into(),
            job_task_wait: Duration::from_secs(30),
            timer_every: Duration::from_secs(10),
            time_axis_after: Duration::from_secs(180),
            batch_max: 100,
            flush_interval: Duration::from_secs(5),
            queue_max: 100_000,
            final_flush_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(10),
            api_host: String::new(),
            config_file: PathBuf::new(),
        }
    }
}

/// How the reporter authenticates.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    /// `access_key:secret_key`, exchanged for a token with `auth.login`.
    Keys {
        access_key: String,
        secret_key: String,
    },
    /// `CLEARML_AUTH_TOKEN` (agent container mode): used as the bearer and
    /// refreshed through `auth.login` with itself.
    Token(String),
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credentials::Keys { access_key, .. } => write!(
                f,
                "Keys {{ access_key: {}, secret_key: *** }}",
                mask(access_key)
            ),
            Credentials::Token(_) => write!(f, "Token(***)"),
        }
    }
}

/// Shows at most the first 4 characters of a key.
pub(crate) fn mask(secret: &str) -> String {
    let head: String = secret.chars().take(4).collect();
    if secret.chars().count() > 8 {
        format!("{head}***")
    } else {
        "***".into()
    }
}

/// Everything the reporter needs, resolved from every source.
#[derive(Debug, Clone)]
pub struct Settings {
    /// API server without a trailing `/` (`https://api.clear.ml`).
    pub(crate) api_host: String,
    /// Web UI, for the task link in the log (may be empty).
    pub(crate) web_host: String,
    pub credentials: Credentials,
    /// Report into this existing task; `None`: create one.
    pub task: Option<String>,
    /// memtrack created `task` in an earlier run (`clearml-resend`): end it
    /// as that run ended if it is still in progress.
    pub(crate) owns_task: bool,
    pub(crate) project: String,
    /// Name of a created task; empty: the run name.
    pub(crate) task_name: String,
    pub(crate) task_type: String,
    /// Without a given task, how long to wait for the job to announce the
    /// task its ClearML SDK made (`Task.init`) before creating one.
    pub(crate) job_task_wait: Duration,
    /// `memory_usage.json` will be uploaded (S3 is on), so a job's task
    /// announcement is answered once the artifact is registered.
    pub(crate) artifact_expected: bool,
    /// Found with nothing but the SDK's own setup (`clearml.conf`, no
    /// trigger): report only into a task the job announces, never create
    /// one, and stay silent when none is announced ([`zero_config`]).
    pub(crate) job_task_only: bool,
    /// The ClearML fileserver (`CLEARML_FILES_HOST`, else
    /// `api.files_server` in the file), where a job's task keeps its
    /// artifacts by default; empty when not known.
    pub(crate) files_host: String,
    /// No S3 destination: the job's task gets `memory_usage.json` on the
    /// fileserver ([`Settings::files_host`]), as its other artifacts.
    pub(crate) files_upload: bool,
    /// Where the SDK would put the task's artifacts, from `clearml.conf`
    /// (`sdk.development.default_output_uri`, `sdk.aws.s3`).
    pub(crate) output: super::output::OutputConf,
    /// `X-ClearML-Worker`.
    pub(crate) worker: String,
    pub(crate) verify_certificate: bool,
    pub timer_every: Duration,
    /// See [`ClearmlConfig::time_axis_after`].
    pub(crate) time_axis_after: Duration,
    pub batch_max: usize,
    pub flush_interval: Duration,
    pub queue_max: usize,
    pub(crate) request_timeout: Duration,
    /// First and longest wait between attempts of a failing request.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Where each setting came from, for messages (`CLEARML_API_HOST`, …).
    pub(crate) host_source: String,
    pub(crate) credentials_source: String,
    /// Names the server would refuse, changed for ClearML only
    /// (`the run name `ab` → task `ab_``), for one warning at the start.
    pub(crate) adapted: Vec<String>,
}

/// A configuration problem, naming its source. Never contains a secret.
#[derive(Debug, thiserror::Error)]
pub enum ClearmlError {
    #[error("cannot read the ClearML config file {path}: {source}")]
    ConfRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the ClearML config file {path} is {size} bytes; files over 1 MiB are refused")]
    ConfTooLarge { path: PathBuf, size: u64 },
    #[error("malformed ClearML config file {path}, {source}")]
    Conf {
        path: PathBuf,
        source: hocon::ParseError,
    },
    #[error("ClearML is enabled ({why}) but no API server is configured: set CLEARML_API_HOST, clearml.api_host, or api.api_server in {conf}")]
    NoHost { why: String, conf: String },
    #[error("ClearML API server {host} (from {source_name}) is configured, but no credentials: set CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY (or CLEARML_AUTH_TOKEN), or api.credentials in {conf}")]
    NoCredentials {
        host: String,
        source_name: String,
        conf: String,
    },
    #[error("{0}")]
    HalfCredentials(String),
    #[error("ClearML API server `{host}` (from {source_name}) is not an http:// or https:// URL")]
    BadHost { host: String, source_name: String },
}

/// The task types a ClearML server accepts in `tasks.create`.
pub(crate) const TASK_TYPES: [&str; 11] = [
    "training",
    "testing",
    "inference",
    "data_processing",
    "application",
    "monitor",
    "controller",
    "optimizer",
    "service",
    "qc",
    "custom",
];

/// Shortest task or project name the server accepts, after stripping.
pub(crate) const MIN_NAME: usize = 3;

/// A project name as the server stores it: every `/`-separated part
/// stripped of surrounding white space, empty parts dropped
/// (`" team / mem "` → `team/mem`, `a//b` → `a/b`). Looking a project up by
/// anything else misses it.
pub(crate) fn tidy_project(name: &str) -> String {
    name.split('/')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("/")
}

/// `value` made acceptable to the server when it is shorter than
/// [`MIN_NAME`] characters once stripped: the stripped name padded with `_`
/// (`ab` → `ab_`). `None`: the name is fine as it is.
pub(crate) fn fit_name(value: &str) -> Option<String> {
    let kept = value.trim();
    let short = MIN_NAME.saturating_sub(kept.chars().count());
    (short > 0).then(|| format!("{kept}{}", "_".repeat(short)))
}

/// Names the task memtrack would create for the run `run_name` (when it
/// reports into no given task) with a name the server accepts: a run name
/// ClearML would refuse is padded for ClearML only, and the change noted
/// in [`Settings::adapted`]. The run keeps its own name everywhere else.
pub(crate) fn fit_task_name(settings: &mut Settings, run_name: &str) {
    if settings.task.is_some() || settings.job_task_only || !settings.task_name.is_empty() {
        return;
    }
    if let Some(fit) = fit_name(run_name) {
        settings
            .adapted
            .push(format!("the run name `{run_name}` → task `{fit}`"));
        settings.task_name = fit;
    }
}

/// Variable names, newest first (`TRAINS_*` are the older aliases).
fn env_first(
    env: &dyn Fn(&str) -> Option<String>,
    names: &[&'static str],
) -> Option<(&'static str, String)> {
    names.iter().find_map(|n| {
        env(n)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .map(|v| (*n, v))
    })
}

const ENV_HOST: &[&str] = &["CLEARML_API_HOST", "TRAINS_API_HOST"];
const ENV_WEB: &[&str] = &["CLEARML_WEB_HOST", "TRAINS_WEB_HOST"];
const ENV_FILES: &[&str] = &["CLEARML_FILES_HOST", "TRAINS_FILES_HOST"];
const ENV_KEY: &[&str] = &["CLEARML_API_ACCESS_KEY", "TRAINS_API_ACCESS_KEY"];
const ENV_SECRET: &[&str] = &["CLEARML_API_SECRET_KEY", "TRAINS_API_SECRET_KEY"];
const ENV_TOKEN: &[&str] = &["CLEARML_AUTH_TOKEN", "TRAINS_AUTH_TOKEN"];
const ENV_TASK: &[&str] = &["CLEARML_TASK_ID", "TRAINS_TASK_ID"];
const ENV_CONF: &[&str] = &["CLEARML_CONFIG_FILE", "TRAINS_CONFIG_FILE"];
const ENV_WORKER: &[&str] = &["CLEARML_WORKER_NAME", "TRAINS_WORKER_NAME"];
const ENV_VERIFY: &[&str] = &[
    "CLEARML_API_HOST_VERIFY_CERT",
    "TRAINS_API_HOST_VERIFY_CERT",
];

fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Some(true),
        "false" | "no" | "off" | "0" => Some(false),
        _ => None,
    }
}

/// Includes nested deeper than this are refused (a file including itself).
const MAX_INCLUDE_DEPTH: usize = 8;
/// Files one `clearml.conf` may include, all levels together.
const MAX_INCLUDED_FILES: usize = 64;

/// Reads and parses a `clearml.conf` (at most 1 MiB), with the files its
/// `include` lines name (relative to the file's folder; a missing one is
/// skipped unless `required(…)`). `url(…)` and `classpath(…)` includes are
/// not read, and said so.
pub(crate) fn read_conf(path: &Path) -> Result<hocon::ConfTree, ClearmlError> {
    read_conf_at(path, 0, &mut MAX_INCLUDED_FILES.clone())
}

fn read_conf_at(
    path: &Path,
    depth: usize,
    files_left: &mut usize,
) -> Result<hocon::ConfTree, ClearmlError> {
    use std::io::Read;
    let read_err = |source| ClearmlError::ConfRead {
        path: path.to_path_buf(),
        source,
    };
    // Regular files only, opened without blocking: a FIFO or `/dev/zero`
    // is refused, not waited on or read.
    let file = crate::files::open_input(path).map_err(read_err)?;
    let size = file.metadata().map_err(read_err)?.len();
    if size > MAX_CONF_BYTES {
        return Err(ClearmlError::ConfTooLarge {
            path: path.to_path_buf(),
            size,
        });
    }
    let mut text = String::new();
    file.take(MAX_CONF_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_err)?;
    if text.len() as u64 > MAX_CONF_BYTES {
        // Larger than its size said (it grew while read).
        return Err(ClearmlError::ConfTooLarge {
            path: path.to_path_buf(),
            size: text.len() as u64,
        });
    }
    let folder = path.parent().unwrap_or(Path::new("."));
    let mut resolve = |include: hocon::Include, line: usize| {
        let error = |message: String| hocon::ParseError { line, message };
        if include.kind != "file" {
            tracing::warn!(
                "ClearML: {}, line {line}: `include {}(…)` is not supported; the settings it holds are not read",
                path.display(),
                include.kind
            );
            return if include.required {
                Err(error(format!(
                    "a required `include {}(…)`, which memtrack cannot read",
                    include.kind
                )))
            } else {
                Ok(None)
            };
        }
        if depth >= MAX_INCLUDE_DEPTH {
            return Err(error(format!(
                "includes nest deeper than {MAX_INCLUDE_DEPTH} files (does a file include itself?)"
            )));
        }
        if *files_left == 0 {
            return Err(error(format!(
                "more than {MAX_INCLUDED_FILES} included files"
            )));
        }
        *files_left -= 1;
        let target = folder.join(&include.target);
        match read_conf_at(&target, depth + 1, files_left) {
            Ok(tree) => Ok(Some(tree)),
            Err(ClearmlError::ConfRead { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound && !include.required =>
            {
                tracing::debug!(
                    "ClearML: {} includes {}, which does not exist",
                    path.display(),
                    target.display()
                );
                Ok(None)
            }
            Err(e) => Err(error(format!("in the included file: {e}"))),
        }
    };
    hocon::parse_with(&text, &mut resolve).map_err(|source| ClearmlError::Conf {
        path: path.to_path_buf(),
        source,
    })
}

impl From<ClearmlError> for ConfProblem {
    /// A [`read_conf`] failure, kept comparable: its message, and the
    /// kind of the I/O failure behind it.
    fn from(e: ClearmlError) -> Self {
        let kind = match &e {
            ClearmlError::ConfRead { source, .. } => Some(source.kind()),
            _ => None,
        };
        ConfProblem::Unread {
            message: e.to_string(),
            kind,
        }
    }
}

/// Resolves ClearML settings from memtrack's config, the environment
/// (`CLEARML_*`, and the older `TRAINS_*` aliases) and `clearml.conf`
/// (`config.config_file`, else `CLEARML_CONFIG_FILE`, else
/// `home/clearml.conf`).
///
/// `Ok(None)`: off. Precedence: memtrack config (`api_host`, `task`) >
/// environment > `clearml.conf`. `enabled = "auto"` is on when
/// `CLEARML_TASK_ID` or `CLEARML_API_HOST` is set, or `clearml.task` or
/// `clearml.api_host` is given. The file is read only when it is named
/// (`config_file`, `CLEARML_CONFIG_FILE`) or something is missing from the
/// config and the environment; a missing default `~/clearml.conf` is no
/// error.
///
/// Errors name the source: a host without credentials (or the reverse), a
/// key without its secret, a malformed file (file, line, problem), on
/// without a host.
pub fn resolve(
    config: &ClearmlConfig,
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> Result<Option<Settings>, ClearmlError> {
    let env_task = env_first(env, ENV_TASK);
    let env_host = env_first(env, ENV_HOST);
    let Some(why) = switched_on(config, env_task.as_ref(), env_host.as_ref()) else {
        return Ok(None);
    };
    let mut found = Found::from_config_and_env(config, env_host, env)?;
    let conf = ConfFile::locate(config, env, home);
    found.fill_from_conf(&conf, env)?;
    let server = found.require(why, conf.name())?;
    let target = TaskChoice::of(config, env_task)?;
    let mut settings = assemble(config, env, server, target);
    settings.output = output_conf(&conf, env);
    Ok(Some(settings))
}

/// The output settings of `clearml.conf`, when it exists; a problem is
/// kept (and said once) rather than stopping the reporting: it matters
/// only for an `s3://` destination.
fn output_conf(conf: &ConfFile, env: &dyn Fn(&str) -> Option<String>) -> super::output::OutputConf {
    let name = conf.name();
    let Some(path) = conf.path.as_ref().filter(|p| p.exists()) else {
        return super::output::OutputConf {
            file: name,
            ..Default::default()
        };
    };
    // The conf carries the problem to every destination it spoils.
    let read = read_conf(path)
        .map_err(ConfProblem::from)
        .and_then(|doc| super::output::read(&doc, env, &name).map_err(ConfProblem::from));
    read.unwrap_or_else(|problem| {
        // Said once per process: the settings are resolved again at the end.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!("ClearML: the artifact settings of {name} are not used: {problem}");
        }
        super::output::OutputConf {
            file: name,
            problem: Some(problem),
            ..Default::default()
        }
    })
}

/// ClearML as the job's own SDK finds it, for a run [`resolve`] left off
/// (`enabled = "auto"` and no trigger): the server and credentials of
/// `clearml.conf` (`clearml.config_file`, else `CLEARML_CONFIG_FILE`, else
/// `home/clearml.conf`, which `clearml-init` writes), completed by the
/// `CLEARML_*` variables. The settings report only into a task the job
/// announces ([`Settings::job_task_only`]): a job that calls `Task.init`
/// gets memtrack's charts without any setting, and one that does not sees
/// nothing change.
///
/// `Err`: why ClearML stays off, in one line for a job that announces a
/// task anyway (never a secret). A file that does not read is such a
/// reason here, not an error: nobody asked memtrack to use it.
pub(crate) fn zero_config(
    config: &ClearmlConfig,
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> Result<Settings, NoZeroConfig> {
    if config.enabled == Switch::Off {
        return Err(NoZeroConfig::Disabled);
    }
    let conf = ConfFile::locate(config, env, home);
    let exists = conf.path.as_ref().is_some_and(|p| p.exists());
    if !exists {
        return Err(NoZeroConfig::NoSetup { file: conf.name() });
    }
    let mut found = Found::from_config_and_env(config, None, env)?;
    found.fill_from_conf(&conf, env)?;
    let server = found.require(format!("found {}", conf.name()), conf.name())?;
    let target = TaskChoice {
        task: None,
        project: tidy_project(&config.project),
        task_name: config.task_name.trim().to_string(),
        task_type: config.task_type.trim().to_string(),
        adapted: Vec::new(),
    };
    let mut settings = assemble(config, env, server, target);
    settings.job_task_only = true;
    settings.output = output_conf(&conf, env);
    Ok(settings)
}

/// Why the job's own ClearML setup is not used (never a secret).
#[derive(Debug, thiserror::Error)]
pub(crate) enum NoZeroConfig {
    #[error("clearml.enabled = false")]
    Disabled,
    #[error(
        "no ClearML setup found: no CLEARML_API_HOST, no {file} (run `clearml-init`, or set \
         CLEARML_CONFIG_FILE)"
    )]
    NoSetup { file: String },
    /// The setup found is incomplete or does not read.
    #[error(transparent)]
    Setup(#[from] ClearmlError),
}

/// Why ClearML is on (for messages); `None`: off.
fn switched_on(
    config: &ClearmlConfig,
    env_task: Option<&(&'static str, String)>,
    env_host: Option<&(&'static str, String)>,
) -> Option<String> {
    match config.enabled {
        Switch::Off => None,
        Switch::On => Some("clearml.enabled = true".to_string()),
        Switch::Auto => {
            if !config.task.trim().is_empty() {
                Some("clearml.task is set".into())
            } else if !config.api_host.trim().is_empty() {
                Some("clearml.api_host is set".into())
            } else if let Some((name, _)) = env_task {
                Some(format!("{name} is set"))
            } else {
                env_host.map(|(name, _)| format!("{name} is set"))
            }
        }
    }
}

/// The server settings found so far, each with where it came from.
struct Found {
    host: Option<(String, String)>,
    web: Option<String>,
    files: Option<String>,
    verify: Option<bool>,
    credentials: Option<(Credentials, String)>,
}

/// The server and credentials every setting needs.
struct Server {
    host: String,
    host_source: String,
    web: Option<String>,
    files: Option<String>,
    verify: Option<bool>,
    credentials: Credentials,
    credentials_source: String,
}

impl Found {
    /// Config and environment first.
    fn from_config_and_env(
        config: &ClearmlConfig,
        env_host: Option<(&'static str, String)>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Found, ClearmlError> {
        let host = if !config.api_host.trim().is_empty() {
            Some((
                config.api_host.trim().to_string(),
                "clearml.api_host".to_string(),
            ))
        } else {
            env_host.map(|(n, v)| (v, n.to_string()))
        };
        Ok(Found {
            host,
            web: env_first(env, ENV_WEB).map(|(_, v)| v),
            files: env_first(env, ENV_FILES).map(|(_, v)| v),
            verify: env_first(env, ENV_VERIFY).and_then(|(_, v)| parse_bool(&v)),
            credentials: env_credentials(env)?,
        })
    }

    /// Then `clearml.conf`, read when it is named, or when something is
    /// missing and the default file exists.
    fn fill_from_conf(
        &mut self,
        conf: &ConfFile,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ClearmlError> {
        let missing = self.host.is_none() || self.credentials.is_none();
        let Some(path) = conf
            .path
            .as_ref()
            .filter(|p| conf.named || (missing && p.exists()))
        else {
            return Ok(());
        };
        let doc = read_conf(path)?;
        let get = |key: &str| {
            doc.get_str(key, env)
                .map(|v| v.map(|s| s.trim().to_string()).filter(|s| !s.is_empty()))
                .map_err(|source| ClearmlError::Conf {
                    path: path.clone(),
                    source,
                })
        };
        if self.host.is_none() {
            let from_conf = match get("api.api_server")? {
                Some(h) => Some(h),
                None => get("api.host")?,
            };
            self.host = from_conf.map(|h| (h, format!("api.api_server in {}", path.display())));
        }
        if self.web.is_none() {
            self.web = get("api.web_server")?;
        }
        if self.files.is_none() {
            self.files = get("api.files_server")?;
        }
        if self.verify.is_none() {
            self.verify = get("api.verify_certificate")?.and_then(|v| parse_bool(&v));
        }
        if self.credentials.is_none() {
            let key = get("api.credentials.access_key")?;
            let secret = get("api.credentials.secret_key")?;
            self.credentials = match (key, secret) {
                (Some(k), Some(s)) => Some((
                    Credentials::Keys {
                        access_key: k,
                        secret_key: s,
                    },
                    format!("api.credentials in {}", path.display()),
                )),
                (Some(_), None) | (None, Some(_)) => {
                    return Err(ClearmlError::HalfCredentials(format!(
                        "{}: api.credentials needs both access_key and secret_key",
                        path.display()
                    )))
                }
                (None, None) => None,
            };
        }
        Ok(())
    }

    /// A server and its credentials, or the error that says what is
    /// missing and where to set it.
    fn require(self, why: String, conf_name: String) -> Result<Server, ClearmlError> {
        let Some((host, host_source)) = self.host else {
            if let Some((_, source)) = self.credentials {
                return Err(ClearmlError::HalfCredentials(format!(
                    "ClearML credentials are given ({source}) but no API server: set CLEARML_API_HOST, clearml.api_host, or api.api_server in {conf_name}"
                )));
            }
            return Err(ClearmlError::NoHost {
                why,
                conf: conf_name,
            });
        };
        if !(host.starts_with("http://") || host.starts_with("https://")) {
            return Err(ClearmlError::BadHost {
                host,
                source_name: host_source,
            });
        }
        let Some((credentials, credentials_source)) = self.credentials else {
            return Err(ClearmlError::NoCredentials {
                host,
                source_name: host_source,
                conf: conf_name,
            });
        };
        Ok(Server {
            host,
            host_source,
            web: self.web,
            files: self.files,
            verify: self.verify,
            credentials,
            credentials_source,
        })
    }
}

/// Credentials from the environment; as in the SDK, a token wins over
/// keys wherever they come from.
fn env_credentials(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(Credentials, String)>, ClearmlError> {
    let env_key = env_first(env, ENV_KEY);
    let env_secret = env_first(env, ENV_SECRET);
    let env_token = env_first(env, ENV_TOKEN);
    Ok(match (env_key, env_secret) {
        _ if env_token.is_some() => {
            env_token.map(|(n, token)| (Credentials::Token(token), n.to_string()))
        }
        (Some((_, k)), Some((_, s))) => Some((
            Credentials::Keys {
                access_key: k,
                secret_key: s,
            },
            "CLEARML_API_ACCESS_KEY/CLEARML_API_SECRET_KEY".to_string(),
        )),
        (Some((n, _)), None) => {
            return Err(ClearmlError::HalfCredentials(format!(
                "{n} is set but CLEARML_API_SECRET_KEY is not: ClearML needs both the access key and the secret key"
            )))
        }
        (None, Some((n, _))) => {
            return Err(ClearmlError::HalfCredentials(format!(
                "{n} is set but CLEARML_API_ACCESS_KEY is not: ClearML needs both the access key and the secret key"
            )))
        }
        (None, None) => None,
    })
}

/// Where `clearml.conf` is, and whether it was named (then it must exist).
struct ConfFile {
    path: Option<PathBuf>,
    named: bool,
}

impl ConfFile {
    fn locate(
        config: &ClearmlConfig,
        env: &dyn Fn(&str) -> Option<String>,
        home: Option<&Path>,
    ) -> ConfFile {
        let (path, named) = if !config.config_file.as_os_str().is_empty() {
            (Some(config.config_file.clone()), true)
        } else if let Some((_, p)) = env_first(env, ENV_CONF) {
            (Some(PathBuf::from(p)), true)
        } else {
            (home.map(|h| h.join("clearml.conf")), false)
        };
        ConfFile { path, named }
    }

    /// The file as messages name it.
    fn name(&self) -> String {
        self.path
            .as_ref()
            .map_or_else(|| "~/clearml.conf".to_string(), |p| p.display().to_string())
    }
}

/// The task to report into, or the project, name and type of the one
/// memtrack creates (checked against the server's rules).
struct TaskChoice {
    task: Option<String>,
    project: String,
    task_name: String,
    task_type: String,
    /// Names changed to pass the server's rules ([`Settings::adapted`]).
    adapted: Vec<String>,
}

impl TaskChoice {
    fn of(
        config: &ClearmlConfig,
        env_task: Option<(&'static str, String)>,
    ) -> Result<TaskChoice, ClearmlError> {
        let project = if config.project.trim().is_empty() {
            "memtrack".to_string()
        } else {
            tidy_project(&config.project)
        };
        let task = if !config.task.trim().is_empty() {
            Some(config.task.trim().to_string())
        } else {
            env_task.map(|(_, v)| v)
        };
        // What names a task memtrack may create must pass the server's
        // rules: what would not is adapted for ClearML (and said), never a
        // reason to refuse the job.
        let mut adapted = Vec::new();
        let mut project = project;
        let mut task_name = config.task_name.trim().to_string();
        let mut task_type = config.task_type.trim();
        if task.is_none() {
            if let Some(fit) = fit_name(&project) {
                adapted.push(format!("clearml.project `{project}` → `{fit}`"));
                project = fit;
            }
            if !task_name.is_empty() {
                if let Some(fit) = fit_name(&task_name) {
                    adapted.push(format!("clearml.task_name `{task_name}` → `{fit}`"));
                    task_name = fit;
                }
            }
            if !TASK_TYPES.contains(&task_type) {
                adapted.push(format!(
                    "clearml.task_type `{task_type}` (not a ClearML task type; one of: {}) → `training`",
                    TASK_TYPES.join(", ")
                ));
                task_type = "training";
            }
        }
        Ok(TaskChoice {
            task,
            project,
            task_name,
            task_type: task_type.to_string(),
            adapted,
        })
    }
}

/// The settings, with the config's limits kept in range.
fn assemble(
    config: &ClearmlConfig,
    env: &dyn Fn(&str) -> Option<String>,
    server: Server,
    target: TaskChoice,
) -> Settings {
    let worker = env_first(env, ENV_WORKER)
        .map(|(_, v)| v)
        .or_else(|| sysinfo::System::host_name().ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "memtrack".into());
    Settings {
        api_host: server.host.trim_end_matches('/').to_string(),
        web_host: server
            .web
            .unwrap_or_default()
            .trim_end_matches('/')
            .to_string(),
        credentials: server.credentials,
        task: target.task,
        owns_task: false,
        project: target.project,
        task_name: target.task_name,
        task_type: target.task_type,
        adapted: target.adapted,
        job_task_wait: config.job_task_wait,
        artifact_expected: false,
        job_task_only: false,
        files_host: server
            .files
            .unwrap_or_default()
            .trim_end_matches('/')
            .to_string(),
        files_upload: false,
        output: super::output::OutputConf::default(),
        worker,
        verify_certificate: server.verify.unwrap_or(true),
        timer_every: config.timer_every,
        time_axis_after: config.time_axis_after,
        batch_max: config.batch_max.max(1),
        flush_interval: config.flush_interval.max(Duration::from_millis(10)),
        queue_max: config.queue_max.max(1),
        request_timeout: config.request_timeout.max(Duration::from_millis(100)),
        backoff_min: BACKOFF_MIN,
        backoff_max: BACKOFF_MAX,
        host_source: server.host_source,
        credentials_source: server.credentials_source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn conf_dir(text: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("clearml.conf"), text).unwrap();
        dir
    }

    const CONF: &str = "api {\n  api_server: http://conf:8008\n  web_server: http://conf:8080\n  credentials {\"access_key\": \"CONFKEY\", \"secret_key\": \"CONFSECRET\"}\n}\n";

    #[test]
    fn auto_is_off_without_a_trigger() {
        let dir = conf_dir(CONF);
        let got = resolve(&ClearmlConfig::default(), &env_of(&[]), Some(dir.path())).unwrap();
        assert!(got.is_none());
        let off = ClearmlConfig {
            enabled: Switch::Off,
            task: "t".into(),
            ..ClearmlConfig::default()
        };
        assert!(resolve(&off, &env_of(&[("CLEARML_TASK_ID", "x")]), None)
            .unwrap()
            .is_none());
    }

    #[test]
    fn task_id_turns_it_on_and_the_file_fills_the_rest() {
        let dir = conf_dir(CONF);
        let s = resolve(
            &ClearmlConfig::default(),
            &env_of(&[("CLEARML_TASK_ID", "abc")]),
            Some(dir.path()),
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.api_host, "http://conf:8008");
        assert_eq!(s.web_host, "http://conf:8080");
        assert_eq!(s.task.as_deref(), Some("abc"));
        assert_eq!(
            s.credentials,
            Credentials::Keys {
                access_key: "CONFKEY".into(),
                secret_key: "CONFSECRET".into()
            }
        );
        assert!(!format!("{s:?}").contains("CONFSECRET"));
    }

    #[test]
    fn credentials_in_an_included_file_are_read_and_bad_includes_named() {
        // The keys kept apart, in a file beside clearml.conf.
        let dir = conf_dir(
            "include \"keys.conf\"\ninclude \"absent.conf\"\napi { api_server: http://conf:8008 }\n",
        );
        std::fs::write(
            dir.path().join("keys.conf"),
            "api { credentials {\"access_key\": \"INCKEY\", \"secret_key\": \"INCSECRET\"} }\n",
        )
        .unwrap();
        let env = env_of(&[("CLEARML_TASK_ID", "abc")]);
        let s = resolve(&ClearmlConfig::default(), &env, Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(s.api_host, "http://conf:8008");
        assert_eq!(
            s.credentials,
            Credentials::Keys {
                access_key: "INCKEY".into(),
                secret_key: "INCSECRET".into()
            }
        );
        let many = "include \"keys.conf\"\n".repeat(65);
        for (text, keys, why) in [
            ("include required(\"absent.conf\")\n", "", "absent.conf"),
            ("include \"clearml.conf\"\n", "", "nest deeper than 8"),
            (many.as_str(), "a: 1\n", "more than 64 included files"),
            ("include required(url(\"http://h/c\"))\n", "", "cannot read"),
            ("include \"keys.conf\"\n", "api {\n", "line 2"),
        ] {
            std::fs::write(dir.path().join("keys.conf"), keys).unwrap();
            std::fs::write(dir.path().join("clearml.conf"), text).unwrap();
            let e = read_conf(&dir.path().join("clearml.conf")).unwrap_err();
            assert!(e.to_string().contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn wrong_artifact_settings_are_kept_typed_and_comparable() {
        let text = format!(
            "{CONF}sdk {{ aws {{ s3 {{ credentials: [ {{ host: \"http://minio:9000\", key: \"K\", secret: \"S\" }} ] }} }} }}\n"
        );
        let dir = conf_dir(&text);
        let resolved = || {
            resolve(
                &ClearmlConfig::default(),
                &env_of(&[("CLEARML_TASK_ID", "abc")]),
                Some(dir.path()),
            )
            .unwrap()
            .unwrap()
        };
        let s = resolved();
        let problem = s.output.problem.clone().unwrap();
        assert!(
            matches!(
                &problem,
                ConfProblem::Settings(super::super::output::OutputConfError::BadHost { .. })
            ),
            "{problem:?}"
        );
        assert!(problem.to_string().contains("not host[:port]"), "{problem}");
        assert_eq!(
            s.output,
            resolved().output,
            "the same file, the same settings"
        );
        // An unreadable file keeps its I/O kind beside the message.
        let missing = dir.path().join("gone.conf");
        let unread = ConfProblem::from(read_conf(&missing).unwrap_err());
        assert!(
            matches!(
                &unread,
                ConfProblem::Unread {
                    kind: Some(std::io::ErrorKind::NotFound),
                    ..
                }
            ),
            "{unread:?}"
        );
        assert!(unread.to_string().contains("gone.conf"), "{unread}");
    }

    #[test]
    fn config_beats_environment_beats_file() {
        let dir = conf_dir(CONF);
        let config = ClearmlConfig {
            api_host: "https://cfg.example/".into(),
            task: "cfgtask".into(),
            ..ClearmlConfig::default()
        };
        let env = env_of(&[
            ("CLEARML_API_HOST", "http://env:8008"),
            ("CLEARML_TASK_ID", "envtask"),
            ("CLEARML_API_ACCESS_KEY", "ENVKEY"),
            ("CLEARML_API_SECRET_KEY", "ENVSECRET"),
            ("CLEARML_WORKER_NAME", "w1"),
        ]);
        let s = resolve(&config, &env, Some(dir.path())).unwrap().unwrap();
        assert_eq!(s.api_host, "https://cfg.example");
        assert_eq!(s.task.as_deref(), Some("cfgtask"));
        assert_eq!(s.worker, "w1");
        assert!(
            matches!(&s.credentials, Credentials::Keys { access_key, .. } if access_key == "ENVKEY")
        );
        // Without the config's host, the environment's wins over the file.
        let s = resolve(&ClearmlConfig::default(), &env, Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(s.api_host, "http://env:8008");
        assert_eq!(s.host_source, "CLEARML_API_HOST");
    }

    #[test]
    fn trains_aliases_and_token_only() {
        let env = env_of(&[
            ("TRAINS_API_HOST", "http://old:8008"),
            ("CLEARML_AUTH_TOKEN", "tok.en.x"),
        ]);
        let s = resolve(&ClearmlConfig::default(), &env, None)
            .unwrap()
            .unwrap();
        assert_eq!(s.api_host, "http://old:8008");
        assert_eq!(s.credentials, Credentials::Token("tok.en.x".into()));
        assert_eq!(format!("{:?}", s.credentials), "Token(***)");
    }

    #[test]
    fn half_configurations_are_errors_without_secrets() {
        let host_only = resolve(
            &ClearmlConfig::default(),
            &env_of(&[("CLEARML_API_HOST", "http://h:8008")]),
            None,
        )
        .unwrap_err();
        assert!(matches!(host_only, ClearmlError::NoCredentials { .. }));
        assert!(host_only.to_string().contains("CLEARML_API_ACCESS_KEY"));

        let key_only = resolve(
            &ClearmlConfig::default(),
            &env_of(&[
                ("CLEARML_API_HOST", "http://h:8008"),
                ("CLEARML_API_ACCESS_KEY", "SEKRITKEY"),
            ]),
            None,
        )
        .unwrap_err();
        assert!(key_only.to_string().contains("CLEARML_API_SECRET_KEY"));
        assert!(!key_only.to_string().contains("SEKRITKEY"));

        let on = ClearmlConfig {
            enabled: Switch::On,
            ..ClearmlConfig::default()
        };
        let creds_only = resolve(
            &on,
            &env_of(&[
                ("CLEARML_API_ACCESS_KEY", "K"),
                ("CLEARML_API_SECRET_KEY", "S"),
            ]),
            None,
        )
        .unwrap_err();
        assert!(
            creds_only.to_string().contains("no API server"),
            "{creds_only}"
        );

        let nothing = resolve(&on, &env_of(&[]), None).unwrap_err();
        assert!(matches!(nothing, ClearmlError::NoHost { .. }), "{nothing}");

        // A word other than auto, true or false never gets this far.
        let bad = toml::from_str::<ClearmlConfig>("enabled = 'maybe'").unwrap_err();
        assert!(
            bad.to_string().contains("`maybe`: use auto, true or false"),
            "{bad}"
        );
        let not_url = resolve(
            &ClearmlConfig::default(),
            &env_of(&[("CLEARML_API_HOST", "localhost:8008")]),
            None,
        )
        .unwrap_err();
        assert!(matches!(not_url, ClearmlError::BadHost { .. }));
    }

    #[test]
    fn malformed_file_names_file_and_line() {
        let dir =
            conf_dir("api {\n  api_server: http://x:8008\n  credentials {\"access_key\": \"K\"\n");
        let err = resolve(
            &ClearmlConfig::default(),
            &env_of(&[("CLEARML_TASK_ID", "t")]),
            Some(dir.path()),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("clearml.conf"), "{msg}");
        assert!(msg.contains("line 4"), "{msg}");
        // A named file that does not exist is an error; a missing default is not.
        let named = ClearmlConfig {
            config_file: dir.path().join("nope.conf"),
            api_host: "http://h".into(),
            ..ClearmlConfig::default()
        };
        assert!(matches!(
            resolve(&named, &env_of(&[]), None),
            Err(ClearmlError::ConfRead { .. })
        ));
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            resolve(
                &ClearmlConfig::default(),
                &env_of(&[("CLEARML_API_HOST", "http://h")]),
                Some(empty.path())
            ),
            Err(ClearmlError::NoCredentials { .. })
        ));
    }

    #[test]
    fn large_files_are_refused() {
        let dir = conf_dir(&"# padding\n".repeat(120_000));
        let err = resolve(
            &ClearmlConfig::default(),
            &env_of(&[("CLEARML_TASK_ID", "t")]),
            Some(dir.path()),
        )
        .unwrap_err();
        assert!(matches!(err, ClearmlError::ConfTooLarge { .. }), "{err}");
    }

    #[test]
    fn the_auth_token_wins_over_keys_from_anywhere() {
        let dir = conf_dir(CONF);
        let env = env_of(&[
            ("CLEARML_TASK_ID", "t"),
            ("CLEARML_AUTH_TOKEN", "tok.en.x"),
            ("CLEARML_API_ACCESS_KEY", "ENVKEY"),
            ("CLEARML_API_SECRET_KEY", "ENVSECRET"),
        ]);
        let s = resolve(&ClearmlConfig::default(), &env, Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(s.credentials, Credentials::Token("tok.en.x".into()));
        assert_eq!(s.credentials_source, "CLEARML_AUTH_TOKEN");
        // The host still comes from the file.
        assert_eq!(s.api_host, "http://conf:8008");
        let env = env_of(&[("CLEARML_TASK_ID", "t"), ("CLEARML_AUTH_TOKEN", "tok.en.x")]);
        let s = resolve(&ClearmlConfig::default(), &env, Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(s.credentials, Credentials::Token("tok.en.x".into()));
    }

    #[test]
    fn project_names_are_tidied_as_the_server_stores_them() {
        assert_eq!(tidy_project(" team / mem "), "team/mem");
        assert_eq!(tidy_project("a//b"), "a/b");
        assert_eq!(tidy_project("/x/ /y/"), "x/y");
        assert_eq!(tidy_project("memtrack"), "memtrack");
        let env = env_of(&[
            ("CLEARML_API_HOST", "http://h"),
            ("CLEARML_AUTH_TOKEN", "t"),
        ]);
        let config = ClearmlConfig {
            project: "team / mem".into(),
            ..ClearmlConfig::default()
        };
        let s = resolve(&config, &env, None).unwrap().unwrap();
        assert_eq!(s.project, "team/mem");
    }

    #[test]
    fn names_and_types_the_server_refuses_are_adapted_and_noted() {
        let env = env_of(&[
            ("CLEARML_API_HOST", "http://h"),
            ("CLEARML_AUTH_TOKEN", "t"),
        ]);
        let with = |f: &dyn Fn(&mut ClearmlConfig)| {
            let mut c = ClearmlConfig::default();
            f(&mut c);
            resolve(&c, &env, None).unwrap().unwrap()
        };
        let s = with(&|c| c.project = " ab ".into());
        assert_eq!(s.project, "ab_");
        assert_eq!(s.adapted.len(), 1, "{:?}", s.adapted);
        assert!(s.adapted[0].contains("clearml.project"), "{:?}", s.adapted);
        assert_eq!(with(&|c| c.project = "a//".into()).project, "a__");
        let s = with(&|c| c.task_name = " x ".into());
        assert_eq!(s.task_name, "x__");
        assert!(
            s.adapted[0].contains("clearml.task_name"),
            "{:?}",
            s.adapted
        );
        let s = with(&|c| c.task_type = "trainer".into());
        assert_eq!(s.task_type, "training");
        assert!(s.adapted[0].contains("inference"), "{:?}", s.adapted);
        for t in TASK_TYPES {
            let s = with(&|c| c.task_type = t.into());
            assert_eq!(s.task_type, t);
            assert!(s.adapted.is_empty(), "{t}");
        }
        // The run name names a created task; a given task needs no name.
        let s = with(&|_| {});
        let mut short = s.clone();
        fit_task_name(&mut short, "ab");
        assert_eq!(short.task_name, "ab_");
        assert_eq!(short.adapted.len(), 1);
        let mut fine = s.clone();
        fit_task_name(&mut fine, "abc");
        assert_eq!(fine.task_name, "");
        assert!(fine.adapted.is_empty());
        let mut given = Settings {
            task: Some("id".into()),
            ..s.clone()
        };
        fit_task_name(&mut given, "ab");
        assert!(given.adapted.is_empty());
        let mut named = Settings {
            task_name: "my task".into(),
            ..s
        };
        fit_task_name(&mut named, "ab");
        assert_eq!(named.task_name, "my task");
        assert_eq!(fit_name("  "), Some("___".into()));
        assert_eq!(fit_name(" abc "), None);
    }

    #[test]
    fn clearml_conf_alone_reports_only_into_the_jobs_task() {
        let dir = conf_dir(
            "api {\n  api_server: http://conf:8008\n  files_server: http://conf:8081/\n  \
             credentials {\"access_key\": \"CONFKEY\", \"secret_key\": \"CONFSECRET\"}\n}\n",
        );
        let config = ClearmlConfig::default();
        // No trigger: resolve leaves it off, the SDK's own setup is enough.
        assert!(resolve(&config, &env_of(&[]), Some(dir.path()))
            .unwrap()
            .is_none());
        let s = zero_config(&config, &env_of(&[]), Some(dir.path())).unwrap();
        assert!(s.job_task_only);
        assert_eq!(s.task, None);
        assert_eq!(s.api_host, "http://conf:8008");
        assert_eq!(s.files_host, "http://conf:8081");
        assert!(s.host_source.contains("clearml.conf"), "{}", s.host_source);
        // CLEARML_CONFIG_FILE names the file, as for the SDK; the
        // environment's keys and files host win over the file's.
        let elsewhere = tempfile::tempdir().unwrap();
        let named = dir.path().join("clearml.conf");
        let env = env_of(&[
            ("CLEARML_CONFIG_FILE", named.to_str().unwrap()),
            ("CLEARML_FILES_HOST", "http://env:8081"),
            ("CLEARML_API_ACCESS_KEY", "ENVKEY"),
            ("CLEARML_API_SECRET_KEY", "ENVSECRET"),
        ]);
        let s = zero_config(&config, &env, Some(elsewhere.path())).unwrap();
        assert_eq!(s.files_host, "http://env:8081");
        assert!(
            matches!(&s.credentials, Credentials::Keys { access_key, .. } if access_key == "ENVKEY")
        );
        // Why it stays off, in words and without a secret.
        let why = zero_config(&config, &env_of(&[]), Some(elsewhere.path()))
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("clearml.conf") && why.contains("clearml-init"),
            "{why}"
        );
        let off = ClearmlConfig {
            enabled: Switch::Off,
            ..ClearmlConfig::default()
        };
        let why = zero_config(&off, &env_of(&[]), Some(dir.path()))
            .unwrap_err()
            .to_string();
        assert!(why.contains("clearml.enabled = false"), "{why}");
        let half = conf_dir("api { api_server: http://h:8008\n credentials { access_key: K } }\n");
        let why = zero_config(&config, &env_of(&[]), Some(half.path()))
            .unwrap_err()
            .to_string();
        assert!(why.contains("secret_key"), "{why}");
    }

    #[test]
    fn masks_keep_little() {
        assert_eq!(mask("short"), "***");
        assert_eq!(mask("ABCDEFGHIJKL"), "ABCD***");
    }
}
