//! The run's settings, read once and turned into what each phase needs.
//!
//! [`Plan::from_config`] is the one place a run reads its [`Config`]: it chooses
//! the name and labels, checks them, builds the outputs (each checking its
//! own settings) and hands every later phase its own part — the run
//! directory's parent, the tree's options, the socket's settings, the
//! recorder's pace and bounds. Nothing it does is seen outside memtrack:
//! a setting that is wrong fails the run here, before a folder is made or
//! the job starts.

use std::path::PathBuf;
use std::time::Duration;

use super::context::Mode;
use super::job::TreePlan;
use super::naming::{RunLabels, RunName};
use super::outputs::{self, Registered};
use super::recorder::Recording;
use crate::config::{Config, SocketConfig};

/// Each phase's part of the run's settings.
pub(super) struct Plan {
    pub(super) name: RunName,
    pub(super) labels: RunLabels,
    /// Built, their settings checked; started once the socket is up.
    pub(super) outputs: Registered,
    /// The folder under which the run's own folder is made.
    pub(super) output_root: PathBuf,
    /// The GPU backend, the store's bounds and the engine's pace.
    pub(super) recording: Recording,
    pub(super) socket: SocketConfig,
    /// Whether a Python job gets memtrack's automatic hooks.
    pub(super) hooks: bool,
    /// Where the Prometheus discovery file goes (`off`: nowhere).
    pub(super) sd_dir: PathBuf,
    /// How the job's tree and its host figure are read.
    pub(super) tree: TreePlan,
    /// How long the outputs may take once the job has ended.
    pub(super) finish_timeout: Duration,
}

impl Plan {
    pub(super) fn from_config(mode: &Mode, config: &Config) -> anyhow::Result<Plan> {
        let is_run = matches!(mode, Mode::Run { .. });
        let memory_limit = config.host.memory_limit();
        if !is_run && memory_limit.is_some() {
            tracing::warn!(
                "host.memory_limit applies to `run` only: the attached processes keep their limits"
            );
        }
        // The limit the job runs under (bytes): none when attaching.
        let memory_limit = memory_limit.filter(|_| is_run);
        let name = RunName::choose(mode, config);
        let labels = RunLabels::read(&name.name, config)?;
        Ok(Plan {
            hooks: is_run && super::pyhooks::wanted(config.auto_hooks),
            recording: Recording::of(config, memory_limit),
            tree: TreePlan::of(config, is_run, memory_limit),
            outputs: outputs::build(config)?,
            name,
            labels,
            output_root: config.output.clone(),
            socket: config.socket.clone(),
            sd_dir: config.discovery.sd_dir.clone(),
            finish_timeout: config.finish_timeout,
        })
    }
}
