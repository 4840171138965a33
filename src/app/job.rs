//! What a run follows: the job it spawns (in a memory cgroup of its own
//! when one can be had, reaped by a waiter thread) or the PIDs it attaches
//! to, as a process tree and a host-footprint reader.

use std::sync::mpsc::SyncSender;

use anyhow::{bail, Context};

use super::context::Mode;
use crate::config::Config;
use crate::engine::EndWhen;
use crate::event::inbox::Input;
use crate::sample::footprint::{self, FootprintOptions, FootprintReader, SourceChoice};
use crate::sample::procfs::{ProcOptions, ProcTree, SmapsOptions};
use crate::shutdown::SignalThread;
use crate::{sys, target};

/// What the sampler follows, and when the run ends.
pub(super) struct Followed {
    pub(crate) tree: ProcTree,
    pub(crate) end_when: EndWhen,
    pub(crate) footprint: FootprintReader,
}

/// Refuses to attach to a PID that does not exist, before anything starts.
pub(super) fn check_attach_pids(mode: &Mode) -> anyhow::Result<()> {
    if let Mode::Attach { pids } = mode {
        for pid in pids {
            if !sys::pid_exists(*pid) {
                bail!("no process with PID {pid}");
            }
        }
    }
    Ok(())
}

/// In `run` mode memtrack becomes the tree's child subreaper.
pub(super) fn adopt_orphans(is_run: bool) {
    if is_run {
        // Orphaned workers then stay in the tree and their exits reach us.
        if let Err(e) = sys::become_subreaper() {
            tracing::debug!("cannot become a child subreaper: {e}");
        }
    }
}

/// How the tree and its host figure are read, and the memory limit the
/// job runs under (bytes, `run` only).
pub(super) struct TreePlan {
    procs: ProcOptions,
    footprint: FootprintOptions,
    memory_limit: Option<u64>,
}

impl TreePlan {
    pub(super) fn of(config: &Config, is_run: bool, memory_limit: Option<u64>) -> TreePlan {
        let host = &config.host;
        TreePlan {
            procs: ProcOptions {
                root: host.proc_root.clone(),
                hwm_interval: host.hwm_interval,
                reaper: is_run.then(std::process::id),
                job: None,
                smaps: host.smaps.then_some(SmapsOptions {
                    interval: host.smaps_interval,
                    max_rss: host.smaps_max_rss_mb << 20,
                }),
                read_share: host.pss_budget,
            },
            footprint: FootprintOptions {
                choice: host.source,
                proc_root: host.proc_root.clone(),
            },
            memory_limit,
        }
    }
}

/// How the job is started: its extra environment and the run it belongs
/// to (naming its cgroup).
pub(super) struct Launch<'a> {
    pub(crate) env: &'a [(String, String)],
    pub(crate) run_id: &'a str,
}

/// Starts the job (`run`) or follows the given PIDs (`attach`).
pub(super) fn follow(
    mode: &Mode,
    tree: TreePlan,
    launch: &Launch<'_>,
    signals: &SignalThread,
    tx: &SyncSender<Input>,
) -> anyhow::Result<Followed> {
    match mode {
        Mode::Run { argv } => start_job(argv, tree, launch, signals, tx),
        Mode::Attach { pids } => attach(pids, tree.procs, tree.footprint),
    }
}

/// Spawns the job, tells the signal thread its PID, follows its tree, and
/// starts the thread that reaps it.
fn start_job(
    argv: &[String],
    tree: TreePlan,
    launch: &Launch<'_>,
    signals: &SignalThread,
    tx: &SyncSender<Input>,
) -> anyhow::Result<Followed> {
    let TreePlan {
        procs: mut opts,
        footprint: footprint_opts,
        memory_limit,
    } = tree;
    // The job's wait4 peak starts from memtrack's own (the child
    // is a copy of memtrack until it executes): only a peak above
    // that one is the job's.
    let inherited_hwm = own_vm_hwm();
    let (child, footprint) = match memory_limit {
        Some(limit) => spawn_limited(argv, launch, footprint_opts, limit)?,
        None => spawn_job(argv, launch.env, footprint_opts, launch.run_id)?,
    };
    let pid = child.id();
    signals.set_job(pid);
    opts.job = Some(pid);
    let mut tree = ProcTree::new(opts).context("cannot read procfs")?;
    if let Err(e) = tree.add_root(pid) {
        // A job that ends at once is gone before we look.
        tracing::debug!("cannot follow the job: {e}");
    }
    reap(child, inherited_hwm, signals.job_ended(), tx.clone())?;
    Ok(Followed {
        tree,
        end_when: EndWhen::JobExits,
        footprint,
    })
}

/// The thread that waits for the job and hands the engine its exit and
/// its peak RSS (none when the peak is memtrack's own, `inherited_hwm`).
fn reap(
    child: std::process::Child,
    inherited_hwm: u64,
    ended: crate::shutdown::JobEnded,
    waiter_tx: SyncSender<Input>,
) -> anyhow::Result<()> {
    let pid = child.id();
    std::thread::Builder::new()
        .name("memtrack-wait".into())
        .spawn(move || {
            // The Child handle is not used to wait: wait4 also gives
            // the exact peak RSS.
            let _child = child;
            let waited = sys::wait_child(pid, true);
            ended.mark();
            match waited {
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
    Ok(())
}

/// Follows existing processes, with their descendants; with none, the
/// processes that register over the socket until memtrack is stopped.
fn attach(
    pids: &[u32],
    opts: ProcOptions,
    footprint_opts: FootprintOptions,
) -> anyhow::Result<Followed> {
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
    Ok(Followed {
        tree,
        end_when: end,
        footprint: FootprintReader::new(footprint_opts, None),
    })
}

/// memtrack's own high-water mark (bytes).
pub(super) fn own_vm_hwm() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|text| crate::sample::parse::parse_status(&text).ok())
        .map_or(0, |s| s.vm_hwm)
}

/// Starts the job under a memory limit: in a memory cgroup memtrack
/// creates for it, capped at `limit` bytes. No cgroup, no job: a run
/// meant to check "does it fit in 2 GiB" must not run unlimited.
fn spawn_limited(
    argv: &[String],
    launch: &Launch<'_>,
    opts: FootprintOptions,
    limit: u64,
) -> anyhow::Result<(std::process::Child, FootprintReader)> {
    let size = crate::units::format_mib(crate::units::mib(limit));
    let cgroup = footprint::job_cgroup(&opts.proc_root, launch.run_id).map_err(|why| {
        anyhow::anyhow!(
            "--memory-limit {size}: memtrack cannot make a memory cgroup for the job ({why});              it needs root and cgroup v1's memory controller (see docs/advice.md)"
        )
    })?;
    let started = cgroup
        .set_limit(limit)
        .map_err(|e| anyhow::anyhow!("--memory-limit {size}: {e}"))
        .and_then(|()| {
            let procs = std::fs::OpenOptions::new()
                .write(true)
                .open(cgroup.procs_path())
                .with_context(|| format!("cannot open {}", cgroup.procs_path().display()))?;
            Ok(target::spawn_in(argv, launch.env, Some(procs))?)
        });
    match started {
        Ok(child) => {
            tracing::info!(
                "the job runs under a {size} memory limit in memory cgroup {}",
                cgroup.dir().display()
            );
            Ok((child, FootprintReader::with_created(opts, cgroup)))
        }
        Err(e) => {
            if let Err(e) = cgroup.remove() {
                tracing::warn!("{e}");
            }
            Err(e)
        }
    }
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
    if opts.choice == SourceChoice::Rss {
        return Ok((target::spawn(argv, env)?, FootprintReader::new(opts, None)));
    }
    let why = match footprint::job_cgroup(&opts.proc_root, run_id) {
        Ok(cgroup) => {
            let joined = std::fs::OpenOptions::new()
                .write(true)
                .open(cgroup.procs_path())
                .map_err(anyhow::Error::from)
                .and_then(|procs| {
                    target::spawn_in(argv, env, Some(procs)).map_err(anyhow::Error::from)
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
        Err(why) => why.to_string(),
    };
    tracing::debug!("no memory cgroup of its own for the job: {why}");
    let child = target::spawn(argv, env)?;
    Ok((child, FootprintReader::new(opts, Some(why))))
}
