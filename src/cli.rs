//! The command line, in two layers: clap parses raw arguments here; the
//! daemon flags then become the top [`Layer`] of the configuration, where
//! they are validated like every other source.

use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};
use toml::Value;

use crate::config::Layer;

/// Memory telemetry sidecar for ML jobs: host RSS and GPU memory of a
/// process tree, phase marks, peaks, and memory_usage.json.
#[derive(Debug, Parser)]
#[command(name = "memtrack", version, max_term_width = 100)]
#[command(
    after_help = "Settings: defaults < --config FILE < MEMTRACK_* environment < flags. \
See `memtrack config --defaults` for every key."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a job, follow its process tree, write outputs/RUN/memory_usage.json,
    /// and exit with the job's status
    Run(RunArgs),
    /// Follow processes that are already running until they exit or memtrack is signalled
    Attach(AttachArgs),
    /// Send one annotated event (a mark) to a running memtrack
    Mark(MarkArgs),
    /// Print what a running memtrack sees now
    Status(StatusArgs),
    /// Ask the job's subscribed clients to free their caches
    Cleanup(SocketArgs),
    /// Rebuild memory_usage.json of a run whose memtrack was killed
    Recover(RecoverArgs),
    /// Upload a memory_usage.json to S3 / MinIO (or retry a failed upload)
    Upload(UploadArgs),
    /// Send the ClearML points a run left unsent (its clearml-spool.jsonl), and end a task it created
    ClearmlResend(ClearmlResendArgs),
    /// Send what a run left unsent for MLflow (its mlflow-spool.jsonl): values, artifacts, the run's end
    MlflowResend(MlflowResendArgs),
    /// Peaks, stages, processes, alerts, leaks and what a re-run needs, from a memory_usage.json
    Report(ReportArgs),
    /// What the run's figures say to change: worker cost, copy-on-read, the batch that fits, why it ran out
    Advise(AdviseArgs),
    /// Compare runs side by side: duration, exit, peaks by run, stage and component, differences
    ///
    /// One column (or row) per run, named after the run; differences are against the
    /// first run given. `--format markdown` / `csv` print the configuration table
    /// (model, precision, CPU RAM, GPU RAM, GPU peak, comment, from the run labels
    /// `model`, `precision` and `comment`); `--plot FILE` draws the runs over each other.
    Compare(CompareArgs),
    /// Combine the per-rank files of a multi-node job (or an S3 prefix) into one
    Merge(MergeArgs),
    /// Draw a run's memory timeline as SVG or PNG
    Plot(PlotArgs),
    /// A live view of a running memtrack, refreshed in place
    Watch(WatchArgs),
    /// List this user's live runs on this machine: name, pid, socket, metrics address
    Ls(LsArgs),
    /// Print the default or the effective configuration
    Config(ConfigArgs),
}

/// A flag whose value cannot become a setting.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FlagError {
    #[error("--label `{0}`: expected KEY=VALUE")]
    Label(String),
    #[error("--memory-limit: {0}")]
    MemoryLimit(#[source] crate::units::UnitError),
    #[error("--memory-limit: too large")]
    MemoryLimitTooLarge,
    #[error(
        "--memory-limit `{0}` is no size: 0 would mean no limit at all; leave the flag out \
         for none, or give a size of at least 4M"
    )]
    MemoryLimitZero(String),
}

/// What a command reads its configuration from, above the defaults and
/// the environment: its `--config` file and its flags.
pub trait ConfigSources {
    /// The `--config` file, if given.
    fn config_file(&self) -> Option<&Path>;
    /// The flags as the top configuration layer.
    fn flags(&self) -> Result<Layer, FlagError>;
}

/// Options shared by `run` and `attach`.
#[derive(Debug, Args, Default)]
pub struct DaemonArgs {
    /// TOML configuration file
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Timer period between samples, e.g. 100ms, 1s (default: 1s)
    #[arg(long, value_name = "DURATION")]
    pub(crate) interval: Option<String>,
    /// Run name: the output folder outputs/NAME/ (default: script name and time)
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Option<String>,
    /// Directory holding one folder per run (default: ./outputs)
    #[arg(long, value_name = "DIR")]
    pub(crate) output: Option<PathBuf>,
    /// Extra label for the run and its metrics (repeatable)
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub(crate) labels: Vec<String>,
    /// Host-only mode: do not load NVML
    #[arg(long)]
    pub(crate) no_gpu: bool,
    /// NVML library to load instead of libnvidia-ml.so.1
    #[arg(long, value_name = "PATH")]
    pub(crate) nvml_lib: Option<PathBuf>,
    /// Read each process's own cost, USS and PSS (the default; kept for
    /// older command lines)
    #[arg(long, hide = true)]
    pub(crate) smaps: bool,
    /// Do not read each process's own cost (USS and PSS per process)
    #[arg(long, conflicts_with = "smaps")]
    pub(crate) no_smaps: bool,
    /// Source of the tree's host figure: auto (as root the distinct pages,
    /// else the Pss sum; a memory cgroup holding only the job is a floor
    /// under either), pages, cgroup (that cgroup's charge), pss, or rss
    /// (counts shared pages once per process) (default: auto)
    #[arg(long, value_name = "SOURCE")]
    pub(crate) host_source: Option<String>,
    /// How often memory_usage.json is rewritten during the run (default: 30s)
    #[arg(long, value_name = "DURATION")]
    pub(crate) checkpoint_interval: Option<String>,
    /// Log level: error, warn, info, debug or trace (default: info)
    #[arg(long, value_name = "LEVEL")]
    pub(crate) log_level: Option<String>,
    /// HTTP address for /metrics and /memory-info; `off`: none (default:
    /// 127.0.0.1:9464, or a free port when another run holds it)
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) listen: Option<String>,
    /// Report into this ClearML task (default: $CLEARML_TASK_ID, else a new task)
    #[arg(long, value_name = "TASK_ID")]
    pub(crate) clearml_task: Option<String>,
    /// ClearML project of the task memtrack creates (turns ClearML on)
    #[arg(long, value_name = "NAME")]
    pub(crate) clearml_project: Option<String>,
    /// Do not report to ClearML even when it is configured
    #[arg(long)]
    pub(crate) no_clearml: bool,
    /// run: do not give a Python job memtrack's automatic hooks (framework
    /// callbacks, out-of-memory report)
    #[arg(long)]
    pub(crate) no_auto_hooks: bool,
    /// Do not write memory_report.html (the interactive report page) beside
    /// the JSON at the end
    #[arg(long)]
    pub(crate) no_html_report: bool,
    /// Upload memory_usage.json to s3://bucket/prefix at the end
    #[arg(long, value_name = "S3_URL")]
    pub(crate) s3_url: Option<String>,
    /// S3 endpoint (MinIO), e.g. http://127.0.0.1:9000
    #[arg(long, value_name = "URL")]
    pub(crate) s3_endpoint: Option<String>,
    /// Region to sign for (default: AWS_REGION, the profile's, us-east-1 with an endpoint)
    #[arg(long, value_name = "REGION")]
    pub(crate) s3_region: Option<String>,
    /// Path-style addressing: auto (on with an endpoint), true or false (default: auto)
    #[arg(long, value_name = "auto|true|false")]
    pub(crate) s3_path_style: Option<String>,
    /// How long the end of the run may wait on the network (the S3 upload,
    /// ClearML's last points) before it gives up and says how to finish
    /// later (default: 1m)
    #[arg(long, value_name = "DURATION")]
    pub(crate) finish_timeout: Option<String>,
    /// Event socket path; `off`: none. The job gets it as MEMTRACK_SOCKET
    /// (default: $XDG_RUNTIME_DIR/memtrack-PID.sock, else /tmp/memtrack-UID/)
    #[arg(long, value_name = "PATH")]
    pub(crate) socket: Option<PathBuf>,
}

impl DaemonArgs {
    /// The flags as the top configuration layer.
    pub(crate) fn layer(&self) -> Result<Layer, FlagError> {
        let mut layer = Layer::new("command line");
        let mut set_str = |key: &str, v: &Option<String>| {
            if let Some(v) = v {
                layer.set(key, Value::String(v.clone()));
            }
        };
        set_str("interval", &self.interval);
        set_str("name", &self.name);
        set_str("checkpoint_interval", &self.checkpoint_interval);
        set_str("log_level", &self.log_level);
        set_str("listen", &self.listen);
        set_str("finish_timeout", &self.finish_timeout);
        let mut set = |key: &str, v: &Option<String>| {
            if let Some(v) = v {
                layer.set(key, Value::String(v.clone()));
            }
        };
        set("clearml.task", &self.clearml_task);
        set("clearml.project", &self.clearml_project);
        set("s3.url", &self.s3_url);
        set("s3.endpoint", &self.s3_endpoint);
        set("s3.region", &self.s3_region);
        set("s3.path_style", &self.s3_path_style);
        // Naming a task or project asks for ClearML; --no-clearml wins.
        if self.no_clearml {
            layer.set("clearml.enabled", Value::String("false".into()));
        } else if self.clearml_task.is_some() || self.clearml_project.is_some() {
            layer.set("clearml.enabled", Value::String("true".into()));
        }
        if let Some(o) = &self.output {
            layer.set("output", Value::String(o.display().to_string()));
        }
        if let Some(p) = &self.socket {
            layer.set("socket.path", Value::String(p.display().to_string()));
        }
        if let Some(p) = &self.nvml_lib {
            layer.set("gpu.nvml_library", Value::String(p.display().to_string()));
        }
        if self.no_auto_hooks {
            layer.set("auto_hooks", Value::Boolean(false));
        }
        if self.no_html_report {
            layer.set("html_report", Value::Boolean(false));
        }
        if self.no_gpu {
            layer.set("gpu.enabled", Value::Boolean(false));
        }
        if self.smaps {
            layer.set("host.smaps", Value::Boolean(true));
        }
        if self.no_smaps {
            layer.set("host.smaps", Value::Boolean(false));
        }
        if let Some(source) = &self.host_source {
            layer.set("host.source", Value::String(source.clone()));
        }
        for l in &self.labels {
            let (k, v) = l
                .split_once('=')
                .ok_or_else(|| FlagError::Label(l.clone()))?;
            layer.set(&format!("labels.{k}"), Value::String(v.to_string()));
        }
        Ok(layer)
    }
}

impl ConfigSources for DaemonArgs {
    fn config_file(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    fn flags(&self) -> Result<Layer, FlagError> {
        self.layer()
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Run the job under this memory limit (e.g. 2G = 2 GiB) in a memory
    /// cgroup of its own: does it fit a smaller machine? Needs root and
    /// cgroup v1; see docs/advice.md
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// The job and its arguments, after `--`
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

impl ConfigSources for RunArgs {
    fn config_file(&self) -> Option<&Path> {
        self.daemon.config.as_deref()
    }

    fn flags(&self) -> Result<Layer, FlagError> {
        let mut layer = self.daemon.layer()?;
        if let Some(limit) = &self.memory_limit {
            let bytes = crate::config::parse_limit(limit).map_err(FlagError::MemoryLimit)?;
            if bytes == 0 {
                return Err(FlagError::MemoryLimitZero(limit.clone()));
            }
            let bytes = i64::try_from(bytes).map_err(|_| FlagError::MemoryLimitTooLarge)?;
            layer.set("host.memory_limit", Value::Integer(bytes));
        }
        Ok(layer)
    }
}

#[derive(Debug, Args)]
pub struct AttachArgs {
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// A process to follow with its descendants (repeatable)
    #[arg(long = "pid", value_name = "PID", value_parser = crate::target::parse_pid)]
    pub pids: Vec<u32>,
    /// A file holding PIDs to follow (repeatable)
    #[arg(long = "pid-file", value_name = "FILE")]
    pub pid_files: Vec<PathBuf>,
}

/// Which running memtrack to talk to.
#[derive(Debug, Args)]
pub struct SocketArgs {
    /// The daemon's socket (default: $MEMTRACK_SOCKET)
    #[arg(long, value_name = "PATH", conflicts_with = "run")]
    pub socket: Option<PathBuf>,
    /// The live run of this name or memtrack pid, as `memtrack ls` lists it
    #[arg(long, value_name = "NAME")]
    pub run: Option<String>,
}

#[derive(Debug, Args)]
pub struct MarkArgs {
    /// Component, e.g. model, retriever, data
    pub component: String,
    /// Operation, e.g. before_generate
    pub operation: String,
    #[command(flatten)]
    pub socket: SocketArgs,
    /// Wait until recorded and print the sample (exit 1 if no daemon answers)
    #[arg(long)]
    pub wait: bool,
    /// The job's iteration (ClearML's x axis)
    #[arg(long, value_name = "N")]
    pub iteration: Option<u64>,
    /// A label (repeatable)
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// Print the raw JSON reply
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct UploadArgs {
    /// The memory_usage.json to upload, or its run directory
    #[arg(value_name = "FILE|RUN_DIR")]
    pub file: PathBuf,
    /// TOML configuration file (its s3 section)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Destination s3://bucket/prefix
    #[arg(long, value_name = "S3_URL")]
    pub s3_url: Option<String>,
    /// S3 endpoint (MinIO), e.g. http://127.0.0.1:9000
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// Region to sign for (default: AWS_REGION, the profile's, us-east-1 with an endpoint)
    #[arg(long, value_name = "REGION")]
    pub s3_region: Option<String>,
    /// Path-style addressing: auto (on with an endpoint), true or false
    #[arg(long, value_name = "auto|true|false")]
    pub s3_path_style: Option<String>,
}

impl UploadArgs {
    /// The flags as the top configuration layer.
    pub(crate) fn layer(&self) -> Layer {
        let mut layer = Layer::new("command line");
        if let Some(v) = &self.s3_url {
            layer.set("s3.url", Value::String(v.clone()));
        }
        if let Some(v) = &self.s3_endpoint {
            layer.set("s3.endpoint", Value::String(v.clone()));
        }
        if let Some(v) = &self.s3_region {
            layer.set("s3.region", Value::String(v.clone()));
        }
        if let Some(v) = &self.s3_path_style {
            layer.set("s3.path_style", Value::String(v.clone()));
        }
        layer
    }
}

impl ConfigSources for UploadArgs {
    fn config_file(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    fn flags(&self) -> Result<Layer, FlagError> {
        Ok(self.layer())
    }
}

#[derive(Debug, Args)]
pub struct ClearmlResendArgs {
    /// The run directory (outputs/RUN) holding clearml-spool.jsonl
    pub dir: PathBuf,
    /// TOML configuration file (its clearml section)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Send into this task (default: the one the run reported into)
    #[arg(long, value_name = "ID")]
    pub clearml_task: Option<String>,
    /// Project of the task to create when the run never got one
    #[arg(long, value_name = "NAME")]
    pub clearml_project: Option<String>,
    /// Give up after this long; what is left stays in the spool (default: 2m)
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = humantime::parse_duration, hide_default_value = true)]
    pub timeout: std::time::Duration,
}

impl ClearmlResendArgs {
    /// The flags as the top configuration layer.
    pub(crate) fn layer(&self) -> Layer {
        let mut layer = Layer::new("command line");
        if let Some(v) = &self.clearml_task {
            layer.set("clearml.task", Value::String(v.clone()));
        }
        if let Some(v) = &self.clearml_project {
            layer.set("clearml.project", Value::String(v.clone()));
        }
        layer
    }
}

impl ConfigSources for ClearmlResendArgs {
    fn config_file(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    fn flags(&self) -> Result<Layer, FlagError> {
        Ok(self.layer())
    }
}

#[derive(Debug, Args)]
pub struct MlflowResendArgs {
    /// The run directory (outputs/RUN) holding mlflow-spool.jsonl
    pub dir: PathBuf,
    /// TOML configuration file (its mlflow section; default tracking server: MLFLOW_TRACKING_URI)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Give up after this long; what is left stays in the spool (default: 2m)
    #[arg(long, value_name = "DURATION", default_value = "2m", value_parser = humantime::parse_duration, hide_default_value = true)]
    pub timeout: std::time::Duration,
}

impl ConfigSources for MlflowResendArgs {
    fn config_file(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    fn flags(&self) -> Result<Layer, FlagError> {
        Ok(Layer::new("command line"))
    }
}

#[derive(Debug, Args)]
pub struct AdviseArgs {
    /// A memory_usage.json, or a run directory (a finished or a running run)
    #[arg(value_name = "FILE|RUN_DIR")]
    pub file: PathBuf,
    /// Print the advice as JSON (an array of {code, level, finding, action, figures})
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A memory_usage.json (any schema version, or only detailed_log and peak_usage), or a run directory
    #[arg(value_name = "FILE|RUN_DIR")]
    pub file: PathBuf,
    /// Print JSON instead of the terminal report
    #[arg(long, conflicts_with = "html")]
    pub json: bool,
    /// Write the report as one interactive HTML page (it opens offline) instead
    /// of printing it: memory_report.html beside the memory_usage.json, or -o FILE
    #[arg(long)]
    pub html: bool,
    /// Where --html writes the page
    #[arg(short, long, value_name = "FILE", requires = "html")]
    pub output: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// memory_usage.json files or run directories, the first being the reference
    #[arg(required = true, value_name = "FILE|RUN_DIR")]
    pub files: Vec<PathBuf>,
    /// What to print (default: table)
    #[arg(long, value_enum, default_value = "table", hide_default_value = true)]
    pub format: crate::report::compare::Format,
    /// Print JSON (as --format json)
    #[arg(long, conflicts_with = "format")]
    pub json: bool,
    /// Also draw the runs' memory over each other into FILE (.svg or .png)
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// The plot's x axis: time since each start, iteration, or stage (default: time)
    #[arg(long, value_enum, default_value = "time", hide_default_value = true)]
    pub align: crate::report::plot::Align,
    /// Also write the runs overlaid as one interactive HTML page (aligned by time,
    /// iteration or stage on the page): memory_compare.html, or -o FILE
    #[arg(long)]
    pub html: bool,
    /// Where --html writes the page
    #[arg(short, long, value_name = "FILE", requires = "html")]
    pub output: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct MergeArgs {
    /// Per-rank memory_usage*.json files, or one s3://bucket/prefix/ holding them
    #[arg(required = true, value_name = "FILE|S3_PREFIX")]
    pub inputs: Vec<String>,
    /// Where to write the merged file (default: print it to stdout)
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// TOML configuration file (its s3 section, for an S3 prefix)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// S3 endpoint (MinIO), e.g. http://127.0.0.1:9000
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
    /// Merge files that are not the ranks of one job (run names that differ, a rank
    /// given twice); a repeated rank is named with its position, e.g. `1#3`
    #[arg(long)]
    pub force: bool,
}

impl MergeArgs {
    /// The flags as the top configuration layer.
    pub(crate) fn layer(&self) -> Layer {
        let mut layer = Layer::new("command line");
        if let Some(e) = &self.s3_endpoint {
            layer.set("s3.endpoint", Value::String(e.clone()));
        }
        layer
    }
}

impl ConfigSources for MergeArgs {
    fn config_file(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    fn flags(&self) -> Result<Layer, FlagError> {
        Ok(self.layer())
    }
}

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// A memory_usage.json, or a run directory
    #[arg(value_name = "FILE|RUN_DIR")]
    pub file: PathBuf,
    /// Output image: .svg or .png (default: memory_timeline.svg beside the
    /// memory_usage.json)
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Width in pixels, 480 to 4096 (default: 1400)
    #[arg(long, default_value_t = 1400, hide_default_value = true)]
    pub width: u32,
    /// Height in pixels, 320 to 4096 (default: 900)
    #[arg(long, default_value_t = 900, hide_default_value = true)]
    pub height: u32,
    /// Title (default: the run name)
    #[arg(long)]
    pub title: Option<String>,
    /// Draw each process's RSS instead of what it alone costs (its USS)
    #[arg(long)]
    pub process_rss: bool,
}

#[derive(Debug, Args)]
pub struct WatchArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// Refresh period (default: 1s)
    #[arg(
        long,
        default_value = "1s",
        value_name = "DURATION",
        hide_default_value = true
    )]
    pub interval: String,
    /// Print one frame and exit (no screen control)
    #[arg(long)]
    pub once: bool,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RecoverArgs {
    /// The run directory (outputs/RUN), or the output root to recover every run in it
    pub dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Print the built-in defaults as TOML
    #[arg(long, conflicts_with = "show")]
    pub defaults: bool,
    /// Print the configuration after every layer (file, environment, flags)
    #[arg(long)]
    pub show: bool,
    #[command(flatten)]
    pub daemon: DaemonArgs,
}
