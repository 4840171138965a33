//! Wiring one run together: the run directory, the sampler, the store and
//! its journal, the job (or the attached PIDs), signals, and the engine.
//!
//! [`run_daemon`] is the sequence of a run's phases; each phase lives in
//! the file named after it: `plan` (the settings, read once into each
//! phase's part), `naming` (name and labels), `run_dir` (the run
//! directory), `io` (the event socket), `outputs` (the one list of the
//! run's outputs: HTTP, MLflow, ClearML, S3, the files, …), `job` (what is followed),
//! `recorder` (store, journal, engine) and `finish` (the closing line and
//! the exit code, once the outputs, the run's files among them, are done).

mod context;
mod finish;
mod io;
mod job;
mod naming;
mod outputs;
mod plan;
mod pyhooks;
mod recorder;
pub mod registry;
mod run_dir;

use std::sync::mpsc::sync_channel;

use anyhow::Context;

use crate::config::Config;
use crate::event::inbox::Input;
use crate::export::output::RunEnd;
use crate::shutdown::SignalThread;
use crate::sys;

pub use context::{Mode, RunOutcome};
pub use naming::{default_run_name, run_labels, LABEL_ENV};
pub use pyhooks::remove_leftovers as remove_leftover_hooks;
pub(crate) use run_dir::prepare_run_dir;

use io::Io;
use plan::Plan;
use run_dir::Cleanup;

/// Runs `memtrack run` or `memtrack attach` to the end.
pub fn run_daemon(mode: Mode, config: Config) -> anyhow::Result<RunOutcome> {
    // Dropped last: the private folder made when the usual one was another
    // user's goes once the socket and the hooks in it have.
    let _fallback = crate::files::FallbackCleanup;
    // As a container's PID 1, a signal during the start must still end it.
    let startup_signals = crate::shutdown::StartupSignals::install();
    job::check_attach_pids(&mode)?;
    // The settings, read once: from here on each phase has its own part.
    let plan = Plan::from_config(&mode, &config)?;
    let Plan {
        name,
        labels,
        mut outputs,
        output_root,
        recording,
        socket,
        hooks,
        sd_dir,
        tree,
        finish_timeout,
    } = plan;
    let is_run = matches!(mode, Mode::Run { .. });
    job::adopt_orphans(is_run);
    let run_path = prepare_run_dir(&output_root, &labels.dir_name, name.explicit)?;
    // From here on the run directory is reached through its descriptor.
    let held = crate::files::HeldDir::open(&run_path)
        .with_context(|| format!("cannot use run directory {}", run_path.display()))?;
    let run_dir = held.path().to_path_buf();
    let mut cleanup = Cleanup::new(&held);
    let (gpu, backend) = recorder::open_gpu(&recording);
    let document = run_dir.join(crate::model::json::FILE_NAME);
    let run = naming::run_info(&mode, &recording, name, labels, &run_path, backend);
    let (store, journal) = recorder::open_store(&recording, run, gpu.as_ref(), &run_dir)?;

    sys::raise_nofile_limit();
    let (tx, rx) = sync_channel::<Input>(65_536);
    let self_register = matches!(&mode, Mode::Attach { pids } if pids.is_empty());
    let mut io = Io::start(
        &socket,
        tx.clone(),
        self_register,
        store.snapshot(),
        outputs.job_task_off.as_deref(),
    )?;
    let published = outputs.start(&mut io, &store.run, (&run_dir, &document), &tx)?;
    let mut job_env = io.job_env(is_run);
    // Kept until the run ends, then removed.
    let mut _hooks = None;
    if hooks {
        match pyhooks::job_env() {
            Ok((var, dir)) => {
                job_env.push(var);
                _hooks = Some(dir);
            }
            Err(e) => tracing::warn!("{e:#}; the job runs without memtrack's Python hooks"),
        }
    }
    let registration = registry::Registration::register(
        &store.run,
        &run_dir,
        io.socket_path(),
        outputs.metrics(),
        &sd_dir,
    );
    say_where(&store.run.name, &io, outputs.metrics(), &registration);
    // Signals are handled before the job exists, so none can kill
    // memtrack between the spawn and the handlers.
    let signals =
        SignalThread::start(is_run, tx.clone()).context("cannot install signal handlers")?;
    startup_signals.disarm();
    // Start the job last, once everything that can fail has succeeded.
    let followed = job::follow(
        &mode,
        tree,
        &job::Launch {
            env: &job_env,
            run_id: &store.run.id,
        },
        &signals,
        &tx,
    )?;
    let engine = recorder::start_engine(
        &recording,
        followed,
        gpu,
        store,
        journal,
        io.link.clone(),
        published,
    );
    drop(tx);
    cleanup.disarm();
    let (ended, store) = engine.run(&rx);

    let first_signal = signals.stop();
    let job_failed = finish::exit_code(&ended, first_signal, is_run, false) != 0;
    let links = outputs.links();
    let end = RunEnd {
        runtime: &io.runtime,
        ended: &ended,
        store: &store,
        run_dir: &run_dir,
        links: &links,
        job_failed,
    };
    let export_failed = outputs.finish(&end, finish_timeout);
    let files = end.files();
    io.stop();
    drop(registration);
    finish::log_end(&store, &files, export_failed);
    if !held.is_at(&run_path) {
        let now = std::fs::read_link(held.path()).ok();
        tracing::warn!(
            "{} was moved or replaced while the run went on; memtrack wrote only into the folder it created{}",
            run_path.display(),
            now.map(|p| format!(", now at {}", p.display()))
                .unwrap_or_default()
        );
    }
    Ok(RunOutcome {
        exit_code: finish::exit_code(&ended, first_signal, is_run, export_failed),
        document: crate::files::shown(&files.document),
    })
}

/// The start line: the run's name, where its socket is (for `status`,
/// `mark`, `watch` and `cleanup` from another shell), its discovery file
/// and where its metrics are served.
fn say_where(
    name: &str,
    io: &Io,
    metrics: Option<std::net::SocketAddr>,
    registration: &registry::Registration,
) {
    let mut parts = vec![format!("run {name} (memtrack pid {})", std::process::id())];
    parts.push(match io.socket_path() {
        Some(p) => format!("socket {}", p.display()),
        None => "no event socket".into(),
    });
    if let Some(sd) = registration.sd_file() {
        parts.push(format!("Prometheus file_sd {}", sd.display()));
    }
    parts.push(match metrics {
        Some(addr) => format!("metrics on http://{addr}/metrics"),
        None => "no metrics".into(),
    });
    tracing::info!("{}", parts.join("; "));
}

#[cfg(test)]
mod tests {
    use super::*;

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
