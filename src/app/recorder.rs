//! What records a run: the GPU backend, the store and its journal, the
//! sampler, and the engine that folds samples and events into the store,
//! publishing to the run's outputs.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use super::job::Followed;
use crate::config::Config;
use crate::engine::{Engine, EngineOptions, Outputs};
use crate::model::{AttributionMode, GpuBackend, RunInfo};
use crate::sample::gpu::GpuConfig;
use crate::sample::gpu::GpuSampler;
use crate::sample::Sampler;
use crate::store::journal::Journal;
use crate::store::pressure::Thresholds;
use crate::store::Limits;
use crate::store::Store;

/// What records the run is told: where `/proc` is, the GPU settings,
/// the store's bounds and the engine's pace.
pub(super) struct Recording {
    pub(super) proc_root: PathBuf,
    gpu: GpuConfig,
    log: Limits,
    pressure: Thresholds,
    pub(super) interval: Duration,
    checkpoint_interval: Duration,
    /// The flight recorder's interval and window, when it is on.
    flight: Option<(Duration, Duration)>,
    /// The job's memory limit, bytes (`run` only).
    pub(super) memory_limit: Option<u64>,
}

impl Recording {
    pub(super) fn of(config: &Config, memory_limit: Option<u64>) -> Recording {
        Recording {
            proc_root: config.host.proc_root.clone(),
            gpu: config.gpu.clone(),
            log: config.log,
            pressure: config.pressure,
            interval: config.interval,
            checkpoint_interval: config.checkpoint_interval,
            flight: config
                .flight
                .enabled
                .then_some((config.flight.interval, config.flight.window)),
            memory_limit,
        }
    }
}

/// Opens the GPU backend and says which figures the run will have.
/// Returns the sampler and the backend's description.
pub(super) fn open_gpu(recording: &Recording) -> (Box<dyn GpuSampler>, GpuBackend) {
    let gpu = crate::sample::open_gpu(
        &recording.gpu,
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
        &recording.proc_root,
    );
    let backend = gpu.backend();
    if let GpuBackend::None { reason } = &backend {
        tracing::info!("host-only mode, GPU figures are 0: {reason}");
    } else {
        let names: Vec<String> = gpu
            .devices()
            .iter()
            .map(|d| format!("{} {}", d.index, d.name))
            .collect();
        tracing::info!("GPU figures from NVML: {}", names.join(", "));
        // One line when NVML's PIDs are not simply the tree's.
        match gpu.attribution() {
            Some(a) if a.mode == AttributionMode::DeviceLevel => {
                tracing::warn!(
                    "GPU figures are device-level, every process on the job's GPUs included: {}",
                    a.reason
                );
            }
            Some(a) if a.pid_namespace.init != Some(true) => {
                tracing::info!("GPU figures are per-process: {}", a.reason);
            }
            _ => {}
        }
    }
    (gpu, backend)
}

/// The run's store, with its configured bounds and the GPUs it samples,
/// and the journal that lets a killed run be recovered.
pub(super) fn open_store(
    recording: &Recording,
    run: RunInfo,
    gpu: &dyn GpuSampler,
    run_dir: &Path,
) -> anyhow::Result<(Store, Journal)> {
    let mut store = Store::new(run, recording.log, recording.pressure);
    store.describe_gpus(gpu.devices(), gpu.attribution());
    let journal = Journal::create(run_dir, &mut store)
        .with_context(|| format!("cannot write to the run directory {}", run_dir.display()))?;
    Ok((store, journal))
}

/// The engine over what the run follows, publishing to `outputs`.
pub(super) fn start_engine(
    recording: &Recording,
    followed: Followed,
    gpu: Box<dyn GpuSampler>,
    store: Store,
    journal: Journal,
    events: Option<crate::engine::EventLink>,
    outputs: Outputs,
) -> Engine {
    let Followed {
        tree,
        end_when,
        footprint,
    } = followed;
    let meminfo = File::open(recording.proc_root.join("meminfo")).ok();
    let sampler = Sampler::new(tree, footprint, gpu, meminfo);
    Engine::new(
        sampler,
        store,
        Some(journal),
        EngineOptions {
            interval: recording.interval,
            checkpoint_interval: recording.checkpoint_interval,
            journal_flush: Duration::from_secs(1),
            end_when,
            flight: recording.flight,
        },
        events,
        outputs,
    )
}
