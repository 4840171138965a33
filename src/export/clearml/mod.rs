//! ClearML scalars: memtrack's memory figures as charts of a ClearML task.
//!
//! ClearML is where many ML teams already look at their runs, so memtrack
//! reports each `detailed_log` entry there too, following the server's rules
//! described in docs/clearml.md. The exporter must never cost the job
//! anything: the engine hands entries over an unbounded channel that is
//! drained at once into a bounded queue (spilling to `clearml-spool.jsonl`
//! in the run directory), and all network work — login, task lookup or
//! creation, batched `events.add_batch` with retries — happens on tokio
//! tasks that sampling never waits for.
//!
//! - [`hocon`]: the pure `clearml.conf` reader;
//! - [`points`]: entries → scalar points (timer windows, iteration keys,
//!   collisions), pure;
//! - [`queue`]: the bounded in-memory queue and its spool file;
//! - [`api`]: the HTTP client (auth, envelopes, retry classification);
//! - [`reporter`]: the task that owns the queue and drives the server.
//!
//! Settings come from memtrack's config, then the `CLEARML_*` environment,
//! then `clearml.conf` ([`resolve`]); credentials never appear in logs or
//! errors.

pub mod api;
pub mod hocon;
pub mod points;
pub mod queue;
pub mod reporter;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{ClearmlConfig, MAX_CONFIG_BYTES};

pub use reporter::Reporter;

/// File name of the spool in the run directory.
pub const SPOOL_FILE: &str = "clearml-spool.jsonl";

/// The task a run reported into, kept beside the spool so that `memtrack
/// clearml-resend` sends the points to the same task.
pub const TASK_FILE: &str = "clearml-task.json";

/// What [`TASK_FILE`] holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TaskFile {
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub project: String,
    /// memtrack created the task, so memtrack ends it.
    #[serde(default)]
    pub created: bool,
}

/// Notes `task` in `run_dir`'s [`TASK_FILE`], unless a note is already
/// there (the reporter's, which knows whether memtrack created the task).
/// Best effort: without it a resend or a later upload needs to be told the
/// task.
pub fn note_task(run_dir: &Path, task: &TaskRef, created: bool) {
    let path = run_dir.join(TASK_FILE);
    if path.exists() {
        return;
    }
    write_task_note(&path, task, created);
}

fn write_task_note(path: &Path, task: &TaskRef, created: bool) {
    let note = TaskFile {
        id: task.id.clone(),
        name: task.name.clone(),
        project: task.project.clone(),
        created,
    };
    let written = serde_json::to_vec_pretty(&note)
        .map_err(std::io::Error::other)
        .and_then(|bytes| {
            crate::model::json::write_atomic(path, &bytes).map_err(std::io::Error::other)
        });
    if let Err(e) = written {
        tracing::warn!("ClearML: cannot note the task in {}: {e}", path.display());
    }
}

/// Reads a [`TASK_FILE`]; `Ok(None)` when there is none.
pub fn read_task_note(path: &Path) -> anyhow::Result<Option<TaskFile>> {
    use anyhow::Context;
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let note = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not a task note", path.display()))?;
    Ok(Some(note))
}

/// The API version memtrack pins for every call but `auth.login`.
pub const API_VERSION: &str = "2.23";

/// Longest wait between two attempts of a failing request.
pub const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// First wait after a failed attempt (doubled each time up to the cap).
pub const BACKOFF_MIN: Duration = Duration::from_millis(500);

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
pub fn mask(secret: &str) -> String {
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
    pub api_host: String,
    /// Web UI, for the task link in the log (may be empty).
    pub web_host: String,
    pub credentials: Credentials,
    /// Report into this existing task; `None`: create one.
    pub task: Option<String>,
    /// memtrack created `task` in an earlier run (`clearml-resend`): end it
    /// as that run ended if it is still in progress.
    pub owns_task: bool,
    pub project: String,
    /// Name of a created task; empty: the run name.
    pub task_name: String,
    pub task_type: String,
    /// Without a given task, how long to wait for the job to announce the
    /// task its ClearML SDK made (`Task.init`) before creating one.
    pub job_task_wait: Duration,
    /// `memory_usage.json` will be uploaded (S3 is on), so a job's task
    /// announcement is answered once the artifact is registered.
    pub artifact_expected: bool,
    /// `X-ClearML-Worker`.
    pub worker: String,
    pub verify_certificate: bool,
    pub timer_every: Duration,
    pub batch_max: usize,
    pub flush_interval: Duration,
    pub queue_max: usize,
    pub request_timeout: Duration,
    /// First and longest wait between attempts of a failing request.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Where each setting came from, for messages (`CLEARML_API_HOST`, …).
    pub host_source: String,
    pub credentials_source: String,
}

/// A configuration problem, naming its source. Never contains a secret.
#[derive(Debug, thiserror::Error)]
pub enum ClearmlError {
    #[error("clearml.enabled: expected auto, true or false, got `{0}`")]
    Enabled(String),
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
    #[error("{key} `{value}`: {why}")]
    Name {
        key: &'static str,
        value: String,
        why: String,
    },
    #[error("clearml.task_type `{0}` is not a ClearML task type; use one of: {types}", types = TASK_TYPES.join(", "))]
    TaskType(String),
}

/// The task types a ClearML server accepts in `tasks.create`.
pub const TASK_TYPES: [&str; 11] = [
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
pub const MIN_NAME: usize = 3;

/// A project name as the server stores it: every `/`-separated part
/// stripped of surrounding white space, empty parts dropped
/// (`" team / mem "` → `team/mem`, `a//b` → `a/b`). Looking a project up by
/// anything else misses it.
pub fn tidy_project(name: &str) -> String {
    name.split('/')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("/")
}

/// Refuses a task or project name the server would refuse: shorter than
/// [`MIN_NAME`] characters once stripped.
pub fn check_name(key: &'static str, value: &str) -> Result<(), ClearmlError> {
    if value.trim().chars().count() < MIN_NAME {
        return Err(ClearmlError::Name {
            key,
            value: value.to_string(),
            why: format!(
                "ClearML refuses names shorter than {MIN_NAME} characters (white space at the ends \
                 does not count)"
            ),
        });
    }
    Ok(())
}

/// Checks the name of the task memtrack would create for the run `run_name`
/// (when it reports into no given task), before the run starts.
pub fn check_task_name(settings: &Settings, run_name: &str) -> Result<(), ClearmlError> {
    if settings.task.is_some() {
        return Ok(());
    }
    if settings.task_name.trim().is_empty() {
        check_name(
            "the run name (the ClearML task name; set clearml.task_name)",
            run_name,
        )
    } else {
        check_name("clearml.task_name", &settings.task_name)
    }
}

/// The run as a created task needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunInfoLite {
    pub name: String,
    pub id: String,
    pub host: String,
}

impl From<&crate::store::snapshot::RunMeta> for RunInfoLite {
    fn from(m: &crate::store::snapshot::RunMeta) -> Self {
        RunInfoLite {
            name: m.name.clone(),
            id: m.id.clone(),
            host: m.host.clone(),
        }
    }
}

/// The task memtrack reports into.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskRef {
    pub id: String,
    pub name: String,
    /// The project's name (empty when the task has none).
    pub project: String,
}

/// How the run ended, for the task's final status and its artifact.
#[derive(Debug, Clone, Default)]
pub struct RunEnd {
    pub exit: Option<crate::model::Exit>,
    pub artifact: Option<Artifact>,
}

/// `memory_usage.json` where it was uploaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub uri: String,
    pub size: u64,
    /// Lowercase hex.
    pub sha256: String,
}

/// What the end of the run achieved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FinishReport {
    /// Points the server stored.
    pub sent: u64,
    /// Points left in the spool file ([`FinishReport::spool`]).
    pub unsent: u64,
    /// Points dropped because their (title, series, iteration) was taken.
    pub duplicates_skipped: u64,
    /// Points dropped because a value was NaN or infinite.
    pub non_finite_skipped: u64,
    /// Points refused by the server (partial errors, rejected batches).
    pub refused: u64,
    /// Points lost because the spool file could not be written.
    pub discarded: u64,
    /// Every problem, in words (no secrets).
    pub errors: Vec<String>,
    pub task: Option<TaskRef>,
    /// The spool file, when points stayed unsent.
    pub spool: Option<PathBuf>,
    /// Whether the artifact was registered on the task.
    pub artifact_registered: bool,
    /// The final status memtrack gave the task it created
    /// (`completed`/`failed`), if any.
    pub final_status: Option<String>,
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

/// Reads and parses a `clearml.conf` (at most 1 MiB).
pub fn read_conf(path: &Path) -> Result<hocon::Document, ClearmlError> {
    use std::io::Read;
    let read_err = |source| ClearmlError::ConfRead {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_err)?;
    let size = file.metadata().map_err(read_err)?.len();
    if size > MAX_CONFIG_BYTES {
        return Err(ClearmlError::ConfTooLarge {
            path: path.to_path_buf(),
            size,
        });
    }
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_err)?;
    hocon::parse(&text).map_err(|source| ClearmlError::Conf {
        path: path.to_path_buf(),
        source,
    })
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
    let enabled = config.enabled.trim().to_ascii_lowercase();
    let env_task = env_first(env, ENV_TASK);
    let env_host = env_first(env, ENV_HOST);
    let why = match enabled.as_str() {
        "false" | "off" | "no" | "0" => return Ok(None),
        "true" | "on" | "yes" | "1" => "clearml.enabled = true".to_string(),
        "auto" | "" => {
            if !config.task.trim().is_empty() {
                "clearml.task is set".into()
            } else if !config.api_host.trim().is_empty() {
                "clearml.api_host is set".into()
            } else if let Some((name, _)) = &env_task {
                format!("{name} is set")
            } else if let Some((name, _)) = &env_host {
                format!("{name} is set")
            } else {
                return Ok(None);
            }
        }
        other => return Err(ClearmlError::Enabled(other.to_string())),
    };

    // Config and environment first.
    let mut host = if !config.api_host.trim().is_empty() {
        Some((
            config.api_host.trim().to_string(),
            "clearml.api_host".to_string(),
        ))
    } else {
        env_host.map(|(n, v)| (v, n.to_string()))
    };
    let env_key = env_first(env, ENV_KEY);
    let env_secret = env_first(env, ENV_SECRET);
    // As in the SDK, a token wins over keys wherever they come from.
    let env_token = env_first(env, ENV_TOKEN);
    let mut credentials = match (env_key, env_secret) {
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
    };
    let mut web = env_first(env, ENV_WEB).map(|(_, v)| v);
    let mut verify = env_first(env, ENV_VERIFY).and_then(|(_, v)| parse_bool(&v));

    // Then clearml.conf.
    let (conf_path, named) = if !config.config_file.as_os_str().is_empty() {
        (Some(config.config_file.clone()), true)
    } else if let Some((_, p)) = env_first(env, ENV_CONF) {
        (Some(PathBuf::from(p)), true)
    } else {
        (home.map(|h| h.join("clearml.conf")), false)
    };
    let conf_name = conf_path
        .as_ref()
        .map_or_else(|| "~/clearml.conf".to_string(), |p| p.display().to_string());
    let missing = host.is_none() || credentials.is_none();
    if let Some(path) = conf_path.filter(|p| named || (missing && p.exists())) {
        let doc = read_conf(&path)?;
        let get = |key: &str| {
            doc.get_str(key, env)
                .map(|v| v.map(|s| s.trim().to_string()).filter(|s| !s.is_empty()))
                .map_err(|source| ClearmlError::Conf {
                    path: path.clone(),
                    source,
                })
        };
        if host.is_none() {
            let from_conf = match get("api.api_server")? {
                Some(h) => Some(h),
                None => get("api.host")?,
            };
            host = from_conf.map(|h| (h, format!("api.api_server in {}", path.display())));
        }
        if web.is_none() {
            web = get("api.web_server")?;
        }
        if verify.is_none() {
            verify = get("api.verify_certificate")?.and_then(|v| parse_bool(&v));
        }
        if credentials.is_none() {
            let key = get("api.credentials.access_key")?;
            let secret = get("api.credentials.secret_key")?;
            credentials = match (key, secret) {
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
    }

    let Some((host, host_source)) = host else {
        if let Some((_, source)) = credentials {
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
    let Some((credentials, credentials_source)) = credentials else {
        return Err(ClearmlError::NoCredentials {
            host,
            source_name: host_source,
            conf: conf_name,
        });
    };

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
    // What names a task memtrack may create must pass the server's rules.
    let task_type = config.task_type.trim();
    if task.is_none() {
        check_name("clearml.project", &project)?;
        if !config.task_name.trim().is_empty() {
            check_name("clearml.task_name", &config.task_name)?;
        }
        if !TASK_TYPES.contains(&task_type) {
            return Err(ClearmlError::TaskType(config.task_type.clone()));
        }
    }
    let worker = env_first(env, ENV_WORKER)
        .map(|(_, v)| v)
        .or_else(|| sysinfo::System::host_name().ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "memtrack".into());
    Ok(Some(Settings {
        api_host: host.trim_end_matches('/').to_string(),
        web_host: web.unwrap_or_default().trim_end_matches('/').to_string(),
        credentials,
        task,
        owns_task: false,
        project,
        task_name: config.task_name.trim().to_string(),
        task_type: task_type.to_string(),
        job_task_wait: config.job_task_wait,
        artifact_expected: false,
        worker,
        verify_certificate: verify.unwrap_or(true),
        timer_every: config.timer_every,
        batch_max: config.batch_max.max(1),
        flush_interval: config.flush_interval.max(Duration::from_millis(10)),
        queue_max: config.queue_max.max(1),
        request_timeout: config.request_timeout.max(Duration::from_millis(100)),
        backoff_min: BACKOFF_MIN,
        backoff_max: BACKOFF_MAX,
        host_source,
        credentials_source,
    }))
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
            enabled: "false".into(),
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
            enabled: "true".into(),
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

        let bad = ClearmlConfig {
            enabled: "maybe".into(),
            ..ClearmlConfig::default()
        };
        assert!(matches!(
            resolve(&bad, &env_of(&[]), None),
            Err(ClearmlError::Enabled(_))
        ));
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
    fn names_and_types_the_server_refuses_are_refused_first() {
        let env = env_of(&[
            ("CLEARML_API_HOST", "http://h"),
            ("CLEARML_AUTH_TOKEN", "t"),
        ]);
        let with = |f: &dyn Fn(&mut ClearmlConfig)| {
            let mut c = ClearmlConfig::default();
            f(&mut c);
            resolve(&c, &env, None)
        };
        for (bad, key) in [
            (with(&|c| c.project = " ab ".into()), "clearml.project"),
            (with(&|c| c.project = "a//".into()), "clearml.project"),
            (with(&|c| c.task_name = " x ".into()), "clearml.task_name"),
        ] {
            let e = bad.unwrap_err();
            assert!(matches!(e, ClearmlError::Name { .. }), "{e}");
            assert!(e.to_string().contains(key), "{e}");
            assert!(e.to_string().contains("3 characters"), "{e}");
        }
        let e = with(&|c| c.task_type = "trainer".into()).unwrap_err();
        assert!(matches!(e, ClearmlError::TaskType(_)), "{e}");
        assert!(e.to_string().contains("inference"), "{e}");
        for t in TASK_TYPES {
            assert!(with(&|c| c.task_type = t.into()).is_ok(), "{t}");
        }
        // The run name names a created task; a given task needs no name.
        let s = with(&|_| {}).unwrap().unwrap();
        assert!(check_task_name(&s, "ab").is_err());
        assert!(check_task_name(&s, "abc").is_ok());
        let given = Settings {
            task: Some("id".into()),
            ..s.clone()
        };
        assert!(check_task_name(&given, "ab").is_ok());
        let named = Settings {
            task_name: "my task".into(),
            ..s
        };
        assert!(check_task_name(&named, "ab").is_ok());
    }

    #[test]
    fn masks_keep_little() {
        assert_eq!(mask("short"), "***");
        assert_eq!(mask("ABCDEFGHIJKL"), "ABCD***");
    }
}
