//! Naming a run: its name (chosen, or made from the script it runs), its
//! labels (host, SLURM / torchrun variables, configured ones), the name of
//! its directory, and the [`RunInfo`] the document starts from.

use std::collections::BTreeMap;
use std::path::Path;

use super::context::Mode;
use crate::config::Config;
use crate::model::{GpuBackend, RunInfo};

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

/// The run's name, and whether the user chose it (a chosen name is used as
/// is; an automatic one gets `-2`, `-3`… when taken).
pub(super) struct RunName {
    pub(crate) name: String,
    pub(crate) explicit: bool,
}

impl RunName {
    /// The configured name, else one made from what the run follows.
    pub(crate) fn choose(mode: &Mode, config: &Config) -> RunName {
        let explicit = !config.name.is_empty();
        let name = if explicit {
            config.name.clone()
        } else {
            default_run_name(mode)
        };
        RunName { name, explicit }
    }
}

/// Where the run happens: its host, its labels, and the name of its
/// directory.
pub(super) struct RunLabels {
    pub(crate) host: String,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) dir_name: String,
}

impl RunLabels {
    /// Reads the host name and the labelling environment. The run's
    /// folder name is checked here: a name or a rank that is not one plain
    /// folder name (`a/b`, `..`, a control character) is an error, never a
    /// path.
    pub(crate) fn read(name: &str, config: &Config) -> anyhow::Result<RunLabels> {
        let host = sysinfo::System::host_name().unwrap_or_else(|_| "unknown".into());
        let labels = run_labels(&host, |v| std::env::var(v).ok(), &config.labels);
        check_folder_name("the run name", name)?;
        // One rank of a multi-node job shares the job's run name; its own
        // directory (and journal) carries the rank.
        let dir_name = match labels.get("rank") {
            Some(rank) => {
                check_rank(rank)?;
                format!("{name}.rank{rank}")
            }
            None => name.to_string(),
        };
        check_folder_name("the run folder's name", &dir_name)?;
        Ok(RunLabels {
            host,
            labels,
            dir_name,
        })
    }
}

/// A rank (`RANK`, `SLURM_PROCID` or a `rank` label) goes into the run
/// folder's name, so it must be what ranks are: a number.
fn check_rank(rank: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !rank.is_empty() && rank.len() <= 9 && rank.bytes().all(|b| b.is_ascii_digit()),
        "the rank {} (from RANK, SLURM_PROCID or a rank label) is not a number; \
         it would be part of the run folder's name",
        crate::logging::terminal::escape(rank)
    );
    Ok(())
}

/// `value` must be one plain folder name: not empty, not `.` or `..`, no
/// `/`, no NUL or other control character, at most 255 bytes.
pub(crate) fn check_folder_name(what: &str, value: &str) -> anyhow::Result<()> {
    let why = if value.is_empty() {
        Some("is empty")
    } else if value == "." || value == ".." {
        Some("is . or ..")
    } else if value.contains('/') {
        Some("contains /")
    } else if value.chars().any(crate::logging::terminal::is_control) {
        Some("contains a control character")
    } else if value.len() > 255 {
        Some("is longer than 255 bytes")
    } else {
        None
    };
    match why {
        Some(why) => anyhow::bail!(
            "{what} {} {why}: it must be one plain folder name",
            crate::logging::terminal::escape(value)
        ),
        None => Ok(()),
    }
}

/// The run's identity as the document records it, from its start.
pub(super) fn run_info(
    mode: &Mode,
    recording: &super::recorder::Recording,
    name: RunName,
    place: RunLabels,
    run_dir: &Path,
    gpu_backend: GpuBackend,
) -> RunInfo {
    let RunLabels { host, labels, .. } = place;
    let name = name.name;
    let is_run = matches!(mode, Mode::Run { .. });
    RunInfo {
        id: crate::files::random_id(),
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
        host,
        mode: if is_run { "run" } else { "attach" }.into(),
        command: match mode {
            Mode::Run { argv } => argv.clone(),
            Mode::Attach { .. } => Vec::new(),
        },
        start: crate::units::unix_now(),
        labels,
        interval_s: recording.interval.as_secs_f64(),
        memtrack_version: env!("CARGO_PKG_VERSION").into(),
        gpu_backend,
        memory_limit_mb: recording.memory_limit.map(crate::units::mib),
        host_memory_mb: std::fs::read_to_string(recording.proc_root.join("meminfo"))
            .ok()
            .and_then(|text| crate::sample::parse_meminfo(&text))
            .map(|m| crate::units::mib(m.total)),
        ..RunInfo::default()
    }
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
    fn folder_names_are_one_plain_name() {
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../x",
            "x\0y",
            "x\ny",
            "x\u{1b}]0;T\u{7}",
        ] {
            assert!(check_folder_name("name", bad).is_err(), "{bad:?}");
        }
        for good in ["train-20261122-144302", "bs128.rank3", "a..b", "ünïcode"] {
            check_folder_name("name", good).unwrap();
        }
        for bad in ["", "0/../../escape", "-1", "1 ", "x", "1234567890"] {
            assert!(check_rank(bad).is_err(), "{bad:?}");
        }
        check_rank("0").unwrap();
        check_rank("127").unwrap();
    }
}
