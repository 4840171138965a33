//! Layered configuration: defaults < TOML file (`--config`) < `MEMTRACK_*`
//! environment < command-line flags.
//!
//! One mechanism serves every layer: each becomes a TOML table, is checked
//! against the defaults (unknown keys and ill-typed values are errors that
//! name the layer and the key), and the tables are merged and deserialized
//! once. Environment variable names are derived from the key paths
//! (`host.hwm_interval` ↔ `MEMTRACK_HOST_HWM_INTERVAL`), so a new key is
//! reachable from every layer without further code. Empty strings mean
//! "choose automatically", so every key has a value and appears in
//! `memtrack.example.toml`, which a test keeps equal to the defaults.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::{Table, Value};

pub use crate::export::clearml::ClearmlConfig;
pub(crate) use crate::export::mlflow::MlflowConfig;
pub(crate) use crate::export::s3::S3Config;
use crate::model::valid_label_name;
use crate::sample::footprint::SourceChoice;
pub(crate) use crate::sample::gpu::GpuConfig;
use crate::store::pressure::Thresholds;
pub(crate) use crate::store::Limits;
use crate::units::serde_duration;

/// Where `/metrics` is served unless told otherwise (loopback only).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9464";

/// How long the end of a run may wait on the network by default: enough
/// for an upload and ClearML's last batch on a working network (seconds),
/// short enough that a dead server costs a CI job or a SLURM allocation
/// one minute, not five.
pub(crate) const DEFAULT_FINISH_TIMEOUT: Duration = Duration::from_secs(60);

/// Config files larger than this are refused before parsing.
pub(crate) const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Every setting with its default and a comment saying what it is, as
/// `memtrack config --defaults` prints it (`memtrack.example.toml`; a test
/// keeps it equal to [`Config::default`]).
pub const EXAMPLE: &str = include_str!("../memtrack.example.toml");

/// Prefix of every environment variable that maps onto a config key.
pub(crate) const ENV_PREFIX: &str = "MEMTRACK_";

/// The smallest `host.memory_limit` accepted, bytes.
pub(crate) const MIN_MEMORY_LIMIT: u64 = 4 << 20;

/// Everything the daemon (`run`, `attach`) can be told.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Timer period between samples (10ms … 1h).
    #[serde(with = "serde_duration")]
    pub interval: Duration,
    /// Run name; `outputs/<name>/memory_usage.json`. Empty: `<command>-<time>`.
    pub name: String,
    /// Directory under which each run gets its own folder.
    pub output: PathBuf,
    /// How often `memory_usage.json` is rewritten during the run.
    #[serde(with = "serde_duration")]
    pub checkpoint_interval: Duration,
    /// `error`, `warn`, `info`, `debug` or `trace` (or a tracing filter).
    pub log_level: String,
    /// HTTP address for `/metrics`, `/memory-info`, `/cleanup-memory`,
    /// `/healthz`; `off` disables. When the default address is taken (by
    /// another run) a free port is used instead, said at the start and in
    /// the discovery file; a chosen address must bind.
    pub listen: String,
    /// How long memtrack may spend after the job has ended on what goes
    /// over the network (the S3 upload, ClearML's last points); then it
    /// gives up, prints how to finish later, and exits.
    #[serde(with = "serde_duration")]
    pub finish_timeout: Duration,
    /// `memtrack run`: give a Python job memtrack's automatic hooks (phases
    /// from Hugging Face and Lightning trainers, the out-of-memory report)
    /// through its `PYTHONPATH`. `MEMTRACK_AUTO_HOOKS=0` also turns them off.
    pub auto_hooks: bool,
    /// Write `memory_report.html` (the interactive report page) beside
    /// `memory_usage.json` at the end of the run.
    pub html_report: bool,
    /// Extra labels recorded in `run.labels` and on every metric.
    pub labels: BTreeMap<String, String>,
    pub host: HostConfig,
    pub gpu: GpuConfig,
    pub log: Limits,
    /// Used-memory ratios at which host RAM and each GPU change level.
    pub pressure: Thresholds,
    pub socket: SocketConfig,
    pub clearml: ClearmlConfig,
    pub mlflow: MlflowConfig,
    pub s3: S3Config,
    pub flight: FlightConfig,
    pub discovery: DiscoveryConfig,
}

/// How Prometheus finds a run: a file-based service-discovery file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// The folder of the runs' discovery files (`file_sd_configs`). Empty:
    /// `$XDG_RUNTIME_DIR/memtrack/sd`, `/run/memtrack/sd` for root, else
    /// `/tmp/memtrack-<uid>/sd`. `off`: none.
    pub(crate) sd_dir: PathBuf,
}

/// The OOM flight recorder: the last seconds before a target dies, sampled
/// faster than the timer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlightConfig {
    pub(crate) enabled: bool,
    /// Between timer ticks, the tree's RSS (a `statm` read per process) and
    /// NVML's per-process figures are read this often into a ring.
    #[serde(with = "serde_duration")]
    pub(crate) interval: Duration,
    /// How far back the ring reaches.
    #[serde(with = "serde_duration")]
    pub(crate) window: Duration,
}

impl Default for FlightConfig {
    fn default() -> Self {
        FlightConfig {
            enabled: true,
            interval: Duration::from_millis(100),
            window: Duration::from_secs(10),
        }
    }
}

/// The event socket (docs/protocol.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SocketConfig {
    /// Empty: `$XDG_RUNTIME_DIR/memtrack-<pid>.sock`, else
    /// `/tmp/memtrack-<uid>/memtrack-<pid>.sock`. `off`: no socket.
    pub(crate) path: PathBuf,
    /// A group (name or number) whose members may connect: the socket is
    /// then mode 0660 with that group. Empty: 0600, this user only.
    pub(crate) group: String,
    /// Other users allowed to connect (checked with SO_PEERCRED).
    pub(crate) allow_uids: Vec<u32>,
    /// Connections beyond this are closed at once.
    pub(crate) max_connections: usize,
}

impl Default for SocketConfig {
    fn default() -> Self {
        SocketConfig {
            path: PathBuf::new(),
            group: String::new(),
            allow_uids: Vec::new(),
            max_connections: 1024,
        }
    }
}

impl SocketConfig {
    pub fn is_off(&self) -> bool {
        self.path.as_os_str() == "off"
    }
}

/// Host (procfs) sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    /// Where procfs is mounted (tests point this at a fake tree).
    pub(crate) proc_root: PathBuf,
    /// How often `VmHWM` is read from `/proc/PID/status` (it costs many
    /// times the `statm` read done every tick, `cargo bench --bench tick`;
    /// the value is a running maximum, so reading it less often loses
    /// nothing while the process lives).
    #[serde(with = "serde_duration")]
    pub(crate) hwm_interval: Duration,
    /// Read each process's own cost (USS and PSS) from `smaps_rollup`:
    /// on by default, on a thread of its own within `pss_budget` of one
    /// core (a read's cost grows with the process's RSS).
    pub(crate) smaps: bool,
    /// A process's own cost is read again at most this often.
    #[serde(with = "serde_duration")]
    pub(crate) smaps_interval: Duration,
    /// Processes above this RSS are skipped by the `smaps_rollup` read.
    pub(crate) smaps_max_rss_mb: u64,
    /// Where the tree's host figure comes from: `auto` (the distinct pages
    /// as root, else Σ Pss; a memory cgroup holding only the job is a floor
    /// under either), `pages`, `cgroup` (that cgroup's charge), `pss`, or
    /// `rss` (the plain sum, which counts pages shared between processes
    /// once per process).
    pub(crate) source: SourceChoice,
    /// Share of one core spent reading `smaps_rollup` (0.02 = 2 %): for
    /// Σ Pss when that is the source, else for each process's own cost.
    pub(crate) pss_budget: f64,
    /// `run` only: cap the job's memory at this many bytes (`2G`, `512M`
    /// or a byte count; 0: no limit) in the memory cgroup memtrack creates
    /// for it (docs/advice.md, "Checking a smaller machine").
    #[serde(deserialize_with = "bytes_or_size")]
    pub(crate) memory_limit: u64,
}

impl HostConfig {
    /// The job's memory limit, bytes, if one is set.
    pub(crate) fn memory_limit(&self) -> Option<u64> {
        (self.memory_limit > 0).then_some(self.memory_limit)
    }
}

/// A memory limit: `2G`, `512M`, `2Gi` are binary (GiB, MiB), as the
/// kernel's own cgroup files and container runtimes read them; otherwise
/// any size [`crate::units::parse_bytes`] reads (`2GiB`, `2GB` = 2·10⁹).
pub(crate) fn parse_limit(text: &str) -> Result<u64, crate::units::UnitError> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "k" | "ki" => 10,
        "m" | "mi" => 20,
        "g" | "gi" => 30,
        "t" | "ti" => 40,
        _ => return crate::units::parse_bytes(t),
    };
    let value: f64 = num.parse().map_err(|_| crate::units::UnitError::Size {
        text: text.to_string(),
        examples: "`2G`, `512M`",
    })?;
    Ok((value * (1u64 << shift) as f64) as u64)
}

/// A size as a byte count or a string with a unit (`2G`, `512MiB`).
fn bytes_or_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    use serde::de::Error;
    match toml::Value::deserialize(d)? {
        toml::Value::Integer(n) => {
            u64::try_from(n).map_err(|_| D::Error::custom("must not be negative"))
        }
        toml::Value::String(s) => parse_limit(&s).map_err(D::Error::custom),
        other => Err(D::Error::custom(format!(
            "expected a size such as `2G`, not {}",
            other.type_str()
        ))),
    }
}

/// The largest value each `log.max_*` cardinality bound accepts: every
/// bounded name costs memory, a `/metrics` series and `status` bytes.
pub(crate) const MAX_CARDINALITY: usize = 100_000;

impl Default for Config {
    fn default() -> Self {
        Config {
            interval: Duration::from_secs(1),
            name: String::new(),
            output: PathBuf::from("outputs"),
            checkpoint_interval: Duration::from_secs(30),
            log_level: "info".into(),
            listen: DEFAULT_LISTEN.into(),
            finish_timeout: DEFAULT_FINISH_TIMEOUT,
            auto_hooks: true,
            html_report: true,
            labels: BTreeMap::new(),
            host: HostConfig::default(),
            gpu: GpuConfig::default(),
            log: Limits::default(),
            pressure: Thresholds::default(),
            socket: SocketConfig::default(),
            clearml: ClearmlConfig::default(),
            mlflow: MlflowConfig::default(),
            s3: S3Config::default(),
            flight: FlightConfig::default(),
            discovery: DiscoveryConfig::default(),
        }
    }
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            proc_root: PathBuf::from("/proc"),
            hwm_interval: Duration::from_secs(1),
            smaps: true,
            smaps_interval: Duration::from_secs(1),
            smaps_max_rss_mb: 65536,
            source: SourceChoice::Auto,
            pss_budget: 0.02,
            memory_limit: 0,
        }
    }
}

/// A configuration problem, naming where it came from and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{layer}: {message}")]
    Parse { layer: String, message: String },
    #[error("{layer}: unknown setting `{key}`{hint}")]
    Unknown {
        layer: String,
        key: String,
        hint: String,
    },
    #[error("{layer}: bad value for `{key}`: {message}")]
    Invalid {
        layer: String,
        key: String,
        message: String,
    },
}

/// One source of settings, as a table shaped like the config.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Human name used in error messages: "config file x.toml", …
    pub(crate) name: String,
    pub(crate) table: Table,
}

impl Layer {
    pub fn new(name: impl Into<String>) -> Self {
        Layer {
            name: name.into(),
            table: Table::new(),
        }
    }

    /// Sets `dotted.key` to `value`, creating the intermediate tables.
    pub(crate) fn set(&mut self, dotted: &str, value: Value) {
        let mut table = &mut self.table;
        let mut parts = dotted.split('.').peekable();
        while let Some(part) = parts.next() {
            if parts.peek().is_none() {
                table.insert(part.to_string(), value);
                return;
            }
            let entry = table
                .entry(part.to_string())
                .or_insert_with(|| Value::Table(Table::new()));
            if !entry.is_table() {
                *entry = Value::Table(Table::new());
            }
            let Value::Table(next) = entry else {
                unreachable!("just made it a table")
            };
            table = next;
        }
    }

    /// Reads a TOML file (a regular file of at most `MAX_CONFIG_BYTES`).
    pub fn from_file(path: &Path) -> Result<Layer, ConfigError> {
        let name = format!("config file {}", path.display());
        let read_err = |source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        };
        // A FIFO, a device or a file growing while read is refused, not
        // waited on or read without end.
        let text = crate::files::read_text_capped(path, MAX_CONFIG_BYTES).map_err(read_err)?;
        Layer::from_toml(name, &text)
    }

    /// Parses TOML text as a layer named `name` (for messages).
    pub fn from_toml(name: impl Into<String>, text: &str) -> Result<Layer, ConfigError> {
        let name = name.into();
        let table: Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
            layer: name.clone(),
            message: e.to_string().trim_end().to_string(),
        })?;
        Ok(Layer { name, table })
    }

    /// Collects `MEMTRACK_*` variables. A variable that names no setting is
    /// an error, so a typo (`MEMTRACK_INTERVALL`) never passes silently.
    pub fn from_env(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Layer, ConfigError> {
        let defaults = default_table();
        let keys = leaf_keys(&defaults);
        let mut layer = Layer::new("environment");
        for (name, raw) in vars {
            let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            if CLIENT_ONLY_ENV.contains(&name.as_str()) {
                continue;
            }
            // `MEMTRACK_LABELS_TEAM=cv` is `labels.team = "cv"`: label names
            // are free-form, so they follow the key path in lower case.
            if let Some(label) = rest
                .get(..LABELS_ENV.len())
                .filter(|p| p.eq_ignore_ascii_case(LABELS_ENV))
                .and_then(|_| rest.get(LABELS_ENV.len()..))
                .filter(|l| !l.is_empty())
            {
                layer.set(
                    &format!("labels.{}", label.to_ascii_lowercase()),
                    Value::String(raw),
                );
                continue;
            }
            let Some((key, default)) = keys
                .iter()
                .find(|(k, _)| k.replace('.', "_").eq_ignore_ascii_case(rest))
            else {
                return Err(ConfigError::Unknown {
                    layer: format!("environment variable {name}"),
                    key: rest.to_ascii_lowercase(),
                    hint: " (no memtrack setting has this name)".into(),
                });
            };
            layer.set(key, env_value(&raw, default));
        }
        Ok(layer)
    }
}

/// Variables read by clients (`memtrack mark`, the Python client) rather
/// than by the daemon's config: the daemon passes them over. `BIN` is the
/// memtrack binary the Python client starts.
pub(crate) const CLIENT_ONLY_ENV: &[&str] = &[
    "MEMTRACK_SOCKET",
    "MEMTRACK_SOCKET_OWNER",
    "MEMTRACK_TIMEOUT",
    "MEMTRACK_DISABLE",
    "MEMTRACK_BIN",
];

/// `MEMTRACK_LABELS_<NAME>` sets one label.
const LABELS_ENV: &str = "LABELS_";

/// A string from the environment, typed like the default it overrides:
/// strings stay strings, anything else is read as a TOML literal
/// (`true`, `42`, `[1, 2]`, `{ rank = "0" }`).
fn env_value(raw: &str, default: &Value) -> Value {
    if default.is_str() {
        return Value::String(raw.to_string());
    }
    // A switch also takes the shell's usual 1/0, yes/no, on/off.
    if default.is_bool() {
        match raw.trim().to_ascii_lowercase().as_str() {
            "1" | "yes" | "on" => return Value::Boolean(true),
            "0" | "no" | "off" => return Value::Boolean(false),
            _ => {}
        }
    }
    toml::from_str::<Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_string()))
}

/// The defaults as a TOML table.
pub fn default_table() -> Table {
    match Value::try_from(Config::default()) {
        Ok(Value::Table(t)) => t,
        _ => unreachable!("Config serializes to a table"),
    }
}

/// Every settable key path with its default value. Tables whose keys are
/// free-form (`labels`) count as one leaf.
pub fn leaf_keys(defaults: &Table) -> Vec<(String, Value)> {
    fn walk(prefix: &str, table: &Table, out: &mut Vec<(String, Value)>) {
        for (k, v) in table {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                Value::Table(t) if !FREE_FORM_TABLES.contains(&path.as_str()) => {
                    walk(&path, t, out)
                }
                _ => out.push((path, v.clone())),
            }
        }
    }
    let mut out = Vec::new();
    walk("", defaults, &mut out);
    out
}

const FREE_FORM_TABLES: &[&str] = &["labels"];

fn check_unknown(
    layer: &str,
    defaults: &Table,
    table: &Table,
    prefix: &str,
) -> Result<(), ConfigError> {
    for (k, v) in table {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match defaults.get(k) {
            None => {
                let known: Vec<&str> = defaults.keys().map(String::as_str).collect();
                return Err(ConfigError::Unknown {
                    layer: layer.to_string(),
                    key: path,
                    hint: format!(" (known here: {})", known.join(", ")),
                });
            }
            Some(Value::Table(d)) if !FREE_FORM_TABLES.contains(&path.as_str()) => {
                if let Value::Table(t) = v {
                    check_unknown(layer, d, t, &path)?;
                }
            }
            Some(_) => {}
        }
    }
    Ok(())
}

fn merge_into(base: &mut Table, over: &Table) {
    for (k, v) in over {
        match (base.get_mut(k), v) {
            (Some(Value::Table(b)), Value::Table(o)) if k != "labels" => merge_into(b, o),
            (Some(Value::Table(b)), Value::Table(o)) => {
                for (lk, lv) in o {
                    b.insert(lk.clone(), lv.clone());
                }
            }
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

fn deserialize(layer: &str, table: Table) -> Result<Config, ConfigError> {
    Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| {
            // toml reports "…\nin `host.smaps`"; lift the key into our message.
            let text = e.to_string();
            let (mut message, key) = match text.trim_end().rsplit_once("\nin `") {
                Some((m, k)) => (m.to_string(), k.trim_end_matches('`').to_string()),
                None => (text.trim_end().to_string(), String::from("?")),
            };
            if let Some(hint) = what_to_write(&key).filter(|_| !message.contains("write ")) {
                message = format!("{message}; {hint}");
            }
            ConfigError::Invalid {
                layer: layer.to_string(),
                key,
                message,
            }
        })
}

/// What a value of `key` looks like, judged from its default: said after
/// a type error, so the user learns what to write instead.
fn what_to_write(key: &str) -> Option<&'static str> {
    let defaults = Value::Table(default_table());
    let default = key.split('.').try_fold(&defaults, |v, k| v.get(k))?;
    match default {
        Value::String(s) if !s.is_empty() && crate::units::parse_duration(s).is_ok() => {
            Some("write a duration such as \"5s\", \"500ms\" or \"2m\"")
        }
        Value::Float(_) => Some("write a number such as 0.8, or a percentage such as \"80%\""),
        Value::Integer(_) => Some("write a whole number such as 64"),
        Value::Boolean(_) => Some("write true or false"),
        _ => None,
    }
}

/// A percentage (`"80%"`) where the default is a number becomes the
/// ratio (0.8), in every layer alike.
fn read_percentages(defaults: &Table, table: &mut Table) {
    for (k, v) in table.iter_mut() {
        match defaults.get(k) {
            Some(Value::Table(d)) => {
                if let Value::Table(t) = v {
                    read_percentages(d, t);
                }
            }
            Some(Value::Float(_)) => {
                let ratio = v
                    .as_str()
                    .and_then(|text| text.trim().strip_suffix('%'))
                    .and_then(|n| n.trim().parse::<f64>().ok())
                    .filter(|n| n.is_finite());
                if let Some(n) = ratio {
                    *v = Value::Float(n / 100.0);
                }
            }
            _ => {}
        }
    }
}

/// Merges the layers over the defaults and validates the result.
pub fn resolve(layers: &[Layer]) -> Result<Config, ConfigError> {
    let defaults = default_table();
    let layers: Vec<Layer> = layers
        .iter()
        .cloned()
        .map(|mut l| {
            read_percentages(&defaults, &mut l.table);
            l
        })
        .collect();
    for layer in &layers {
        check_unknown(&layer.name, &defaults, &layer.table, "")?;
        // Deserialize each layer alone first so a type error names its source.
        let mut alone = defaults.clone();
        merge_into(&mut alone, &layer.table);
        deserialize(&layer.name, alone)?.validate(&layer.name)?;
    }
    let mut all = defaults;
    for layer in &layers {
        merge_into(&mut all, &layer.table);
    }
    let config = deserialize("configuration", all)?;
    config.validate("configuration")?;
    Ok(config)
}

impl Config {
    /// Checks what types cannot express.
    pub fn validate(&self, layer: &str) -> Result<(), ConfigError> {
        let bad = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                layer: layer.to_string(),
                key: key.to_string(),
                message,
            })
        };
        if self.interval < Duration::from_millis(10) || self.interval > Duration::from_secs(3600) {
            return bad("interval", "must be between 10ms and 1h".into());
        }
        if self.finish_timeout > Duration::from_secs(24 * 3600) {
            return bad("finish_timeout", "must be at most 24h".into());
        }
        if self.checkpoint_interval < Duration::from_secs(1) {
            return bad("checkpoint_interval", "must be at least 1s".into());
        }
        if self.name.contains('/')
            || self.name == "."
            || self.name == ".."
            || self.name.contains('\0')
        {
            return bad(
                "name",
                format!("`{}` cannot be a directory name", self.name),
            );
        }
        if self.log.max_timer_entries < 16 {
            return bad("log.max_timer_entries", "must be at least 16".into());
        }
        if self.log.max_event_entries != 0 && self.log.max_event_entries < 1024 {
            return bad(
                "log.max_event_entries",
                "must be 0 (no bound) or at least 1024".into(),
            );
        }
        if self.log.target_series_points < 16 {
            return bad("log.target_series_points", "must be at least 16".into());
        }
        if self.log.max_targets < 1 {
            return bad("log.max_targets", "must be at least 1".into());
        }
        for (key, value) in [
            ("log.max_components", self.log.max_components),
            ("log.max_event_kinds", self.log.max_event_kinds),
            ("log.max_open_spans", self.log.max_open_spans),
            ("log.max_stages", self.log.max_stages),
        ] {
            if !(1..=MAX_CARDINALITY).contains(&value) {
                return bad(key, format!("must be between 1 and {MAX_CARDINALITY}"));
            }
        }
        if self.host.hwm_interval.is_zero() {
            return bad("host.hwm_interval", "must be positive".into());
        }
        if self
            .host
            .memory_limit()
            .is_some_and(|b| b < MIN_MEMORY_LIMIT)
        {
            return bad(
                "host.memory_limit",
                "must be at least 4M (below it not even an interpreter starts)".into(),
            );
        }
        if !(0.001..=1.0).contains(&self.host.pss_budget) {
            return bad(
                "host.pss_budget",
                "must be between 0.001 and 1 (a share of one core)".into(),
            );
        }
        for (k, v) in &self.labels {
            if !valid_label_name(k) {
                return bad(
                    "labels",
                    format!("`{k}` is not a valid label name ([a-zA-Z_][a-zA-Z0-9_]*)"),
                );
            }
            if v.len() > 256 {
                return bad("labels", format!("value of `{k}` is longer than 256 bytes"));
            }
        }
        if let Err(e) = parse_listen(&self.listen) {
            return bad("listen", e);
        }
        if self.socket.max_connections == 0 || self.socket.max_connections > 65_536 {
            return bad(
                "socket.max_connections",
                "must be between 1 and 65536".into(),
            );
        }
        if !self.socket.group.is_empty() && crate::sys::group_id(&self.socket.group).is_none() {
            return bad(
                "socket.group",
                format!("no group `{}` on this host", self.socket.group),
            );
        }
        if self.clearml.batch_max == 0 || self.clearml.batch_max > 10_000 {
            return bad("clearml.batch_max", "must be between 1 and 10000".into());
        }
        if self.clearml.queue_max < self.clearml.batch_max {
            return bad(
                "clearml.queue_max",
                "must be at least clearml.batch_max".into(),
            );
        }
        if !self.s3.url.is_empty() && !self.s3.url.starts_with("s3://") {
            return bad(
                "s3.url",
                format!("`{}` must look like s3://bucket/prefix", self.s3.url),
            );
        }
        if self.s3.max_attempts == 0 || self.s3.max_attempts > 20 {
            return bad("s3.max_attempts", "must be between 1 and 20".into());
        }
        if self.s3.part_size_mb < 5 || self.s3.part_size_mb > 5120 {
            return bad("s3.part_size_mb", "S3 parts are 5 MiB to 5 GiB".into());
        }
        if self.flight.interval < Duration::from_millis(10) {
            return bad("flight.interval", "must be at least 10ms".into());
        }
        if self.flight.window < self.flight.interval
            || self.flight.window.as_secs_f64() / self.flight.interval.as_secs_f64() > 10_000.0
        {
            return bad(
                "flight.window",
                "must hold between 1 and 10000 intervals".into(),
            );
        }
        if let Err(e) = self.pressure.validate() {
            return bad("pressure", e.to_string());
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log_level).is_err() {
            return bad(
                "log_level",
                format!("`{}` is not a log level or filter", self.log_level),
            );
        }
        Ok(())
    }
}

/// Parses `--listen`: `off`, or an address (`127.0.0.1:9464`, `[::1]:9464`).
pub(crate) fn parse_listen(text: &str) -> Result<Option<std::net::SocketAddr>, String> {
    if text == "off" {
        return Ok(None);
    }
    text.parse::<std::net::SocketAddr>()
        .map(Some)
        .map_err(|_| format!("`{text}` is not an address like 127.0.0.1:9464 (or `off`)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::switch::Switch;

    #[test]
    fn listen_values() {
        assert_eq!(parse_listen("off").unwrap(), None);
        assert_eq!(
            parse_listen("127.0.0.1:9464").unwrap().unwrap().port(),
            9464
        );
        assert!(parse_listen("[::1]:0").unwrap().is_some());
        assert!(parse_listen("localhost:9464").is_err());
        assert!(parse_listen("9464").is_err());
    }

    fn layer(name: &str, toml_text: &str) -> Layer {
        Layer {
            name: name.into(),
            table: toml::from_str(toml_text).unwrap(),
        }
    }

    #[test]
    fn memory_limits_read_as_the_kernel_reads_them() {
        assert_eq!(parse_limit("2G").unwrap(), 2 << 30);
        assert_eq!(parse_limit("512M").unwrap(), 512 << 20);
        assert_eq!(parse_limit("2Gi").unwrap(), 2 << 30);
        assert_eq!(parse_limit("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_limit("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_limit("2GB").unwrap(), 2_000_000_000);
        assert!(parse_limit("lots").is_err());
        let c = resolve(&[layer("file", "[host]\nmemory_limit = '1G'")]).unwrap();
        assert_eq!(c.host.memory_limit(), Some(1 << 30));
        let env = Layer::from_env([("MEMTRACK_HOST_MEMORY_LIMIT".into(), "256M".into())]).unwrap();
        assert_eq!(
            resolve(&[env]).unwrap().host.memory_limit(),
            Some(256 << 20)
        );
        assert_eq!(Config::default().host.memory_limit(), None);
        let tiny = resolve(&[layer("file", "[host]\nmemory_limit = 4096")]).unwrap_err();
        assert!(tiny.to_string().contains("host.memory_limit"), "{tiny}");
        let bad = resolve(&[layer("file", "[host]\nmemory_limit = 'much'")]).unwrap_err();
        assert!(bad.to_string().contains("memory_limit"), "{bad}");
    }

    #[test]
    fn defaults_resolve() {
        assert_eq!(resolve(&[]).unwrap(), Config::default());
    }

    #[test]
    fn later_layers_win() {
        let file = layer(
            "file",
            "interval = '2s'\nname = 'a'\n[gpu]\nenabled = false",
        );
        let env = Layer::from_env([("MEMTRACK_INTERVAL".into(), "500ms".into())]).unwrap();
        let mut flags = Layer::new("flags");
        flags.set("name", Value::String("b".into()));
        let c = resolve(&[file, env, flags]).unwrap();
        assert_eq!(c.interval, Duration::from_millis(500));
        assert_eq!(c.name, "b");
        assert!(!c.gpu.enabled);
    }

    #[test]
    fn env_values_are_typed_like_their_defaults() {
        let env = Layer::from_env([
            ("MEMTRACK_GPU_ENABLED".into(), "false".into()),
            ("MEMTRACK_AUTO_HOOKS".into(), "0".into()),
            ("MEMTRACK_LOG_MAX_TARGETS".into(), "50".into()),
            ("MEMTRACK_NAME".into(), "123".into()),
            ("MEMTRACK_LABELS".into(), "{ rank = '3' }".into()),
            ("MEMTRACK_SOCKET".into(), "/tmp/x".into()),
            ("PATH".into(), "/bin".into()),
        ])
        .unwrap();
        let c = resolve(&[env]).unwrap();
        assert!(!c.gpu.enabled);
        assert!(!c.auto_hooks);
        assert_eq!(c.log.max_targets, 50);
        assert_eq!(c.name, "123");
        assert_eq!(c.labels["rank"], "3");
    }

    #[test]
    fn unknown_keys_name_layer_and_key() {
        let err = resolve(&[layer("config file x.toml", "[host]\nsmap = true")]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("config file x.toml") && text.contains("host.smap"),
            "{text}"
        );
        let err = Layer::from_env([("MEMTRACK_INTERVALL".into(), "1s".into())]).unwrap_err();
        assert!(err.to_string().contains("MEMTRACK_INTERVALL"), "{err}");
    }

    #[test]
    fn bad_values_name_layer_and_key() {
        let err = resolve(&[layer("config file x.toml", "[gpu]\nenabled = 'yes'")]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("gpu.enabled") && text.contains("x.toml"),
            "{text}"
        );
        let err = resolve(&[layer("flags", "interval = '1ms'")]).unwrap_err();
        assert!(err.to_string().contains("`interval`"), "{err}");
        let err = resolve(&[layer("flags", "interval = 'soon'")]).unwrap_err();
        assert!(err.to_string().contains("interval"), "{err}");
        let err = resolve(&[layer("flags", "labels = { 'bad-name' = 'x' }")]).unwrap_err();
        assert!(err.to_string().contains("bad-name"), "{err}");
    }

    #[test]
    fn boolean_settings_take_toml_booleans() {
        let c = resolve(&[layer(
            "config file x.toml",
            "[s3]\npath_style = false\n[clearml]\nenabled = true",
        )])
        .unwrap();
        assert_eq!(c.s3.path_style, Switch::Off);
        assert_eq!(c.clearml.enabled, Switch::On);
        let c = resolve(&[layer("f", "[s3]\npath_style = 'true'")]).unwrap();
        assert_eq!(c.s3.path_style, Switch::On);
        let env = Layer::from_env([("MEMTRACK_S3_PATH_STYLE".into(), "false".into())]).unwrap();
        assert_eq!(resolve(&[env]).unwrap().s3.path_style, Switch::Off);
        for bad in [
            "[s3]\npath_style = 1",
            "[s3]\npath_style = 'yes'",
            "[s3]\npath_style = [true]",
        ] {
            let err = resolve(&[layer("config file x.toml", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("s3.path_style") && err.contains("x.toml"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn finish_timeout_is_a_bounded_duration() {
        assert_eq!(resolve(&[]).unwrap().finish_timeout, DEFAULT_FINISH_TIMEOUT);
        let c = resolve(&[layer("f", "finish_timeout = '0s'")]).unwrap();
        assert!(c.finish_timeout.is_zero(), "0s: no network wait at all");
        for bad in [
            "finish_timeout = '2d'",
            "finish_timeout = 'soon'",
            "finish_timeout = 60",
        ] {
            let err = resolve(&[layer("config file x.toml", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("finish_timeout") && err.contains("x.toml"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn env_labels_percentages_and_client_variables() {
        let env = Layer::from_env([
            ("MEMTRACK_LABELS_TEAM".into(), "cv".into()),
            ("MEMTRACK_PRESSURE_HIGH".into(), "80%".into()),
            ("MEMTRACK_BIN".into(), "/x".into()),
        ])
        .unwrap();
        let c = resolve(&[env]).unwrap();
        assert_eq!(c.labels["team"], "cv");
        assert!((c.pressure.high - 0.8).abs() < 1e-9);
        let c = resolve(&[layer("f", "[pressure]\ncritical = '88 %'")]).unwrap();
        assert!((c.pressure.critical - 0.88).abs() < 1e-9);
    }

    #[test]
    fn type_errors_say_what_to_write() {
        let err = resolve(&[layer("f", "interval = 5")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("write a duration such as \"5s\""), "{err}");
        let err = resolve(&[layer("f", "[pressure]\nhigh = 'lots'")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("0.8") && err.contains("80%"), "{err}");
        let err = resolve(&[layer("f", "[host]\nsmaps = 'on'")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("true or false"), "{err}");
    }

    #[test]
    fn env_names_are_unambiguous() {
        let keys = leaf_keys(&default_table());
        let mut names: Vec<String> = keys.iter().map(|(k, _)| k.replace('.', "_")).collect();
        names.sort();
        let before = names.len();
        names.dedup();
        assert_eq!(
            before,
            names.len(),
            "two keys map to one MEMTRACK_ variable"
        );
    }
}
