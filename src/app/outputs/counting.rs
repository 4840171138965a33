//! A toy output, for the test that the seam holds: it counts the entries
//! and checkpoints the engine feeds it and, at the end of the run, writes
//! what it heard to `counted.json` in the run directory. Built only in
//! `cargo test`, and only when the output folder holds a file named
//! `count-outputs`; it is this module and one line in the list.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::engine::{Checkpoint, Feed};
use crate::event::inbox::Input;
use crate::export::finish::Deadline;
use crate::export::output::{Finished, Output, RunEnd, Start};

/// What the toy output heard.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Counts {
    entries: u64,
    checkpoints: u64,
    last_checkpoint: Option<(u64, PathBuf)>,
    finished: bool,
    written: bool,
    /// The final document, as the files output handed it on.
    document: PathBuf,
}

pub(super) struct Counting {
    counts: Arc<Mutex<Counts>>,
    run_dir: PathBuf,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Counting {
    /// On only where the test asks for it.
    pub(super) fn build(output: &Path) -> anyhow::Result<Option<Counting>> {
        Ok(output.join("count-outputs").exists().then(|| Counting {
            counts: Arc::default(),
            run_dir: PathBuf::new(),
            task: None,
        }))
    }
}

impl Output for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }

    fn start(&mut self, ctx: &Start<'_>) -> anyhow::Result<Feed> {
        let (entries_tx, mut entries) = tokio::sync::mpsc::unbounded_channel();
        let (checkpoints_tx, mut checkpoints) = tokio::sync::watch::channel(Checkpoint::default());
        let counts = Arc::clone(&self.counts);
        let marker = ctx.run_dir.join("counted-checkpoint");
        self.run_dir = ctx.run_dir.to_path_buf();
        self.task = Some(ctx.runtime.spawn(async move {
            let mut checkpoints_open = true;
            loop {
                tokio::select! {
                    entry = entries.recv() => match entry {
                        Some(_) => counts.lock().unwrap().entries += 1,
                        // The engine is done: nothing more comes.
                        None => return,
                    },
                    changed = checkpoints.changed(), if checkpoints_open => {
                        if changed.is_err() {
                            checkpoints_open = false;
                            continue;
                        }
                        let c = checkpoints.borrow_and_update().clone();
                        let mut counts = counts.lock().unwrap();
                        counts.checkpoints += 1;
                        counts.last_checkpoint = Some((c.seq, c.path));
                        std::fs::write(&marker, b"").unwrap();
                    }
                }
            }
        }));
        // A checkpoint now, not after checkpoint_interval.
        ctx.engine.try_send(Input::Checkpoint)?;
        Ok(Feed {
            entries: Some(entries_tx),
            checkpoints: Some(checkpoints_tx),
        })
    }

    fn finish(self: Box<Self>, end: &RunEnd<'_>, deadline: &Deadline) -> Finished {
        if let Some(task) = self.task {
            end.runtime.block_on(deadline.bound("the count", task));
        }
        let mut counts = self.counts.lock().unwrap();
        counts.finished = true;
        let files = end.files();
        counts.written = files.written;
        // As a message shows it: the run directory's path, not the
        // descriptor memtrack reaches it through.
        counts.document = crate::files::shown(&files.document);
        let json = serde_json::to_vec(&*counts).unwrap();
        std::fs::write(self.run_dir.join("counted.json"), json).unwrap();
        Finished::default()
    }
}

/// The run itself, in the process the test below starts for it (the
/// same test, told so by `MEMTRACK_COUNTING_DIR`): `run_daemon` makes its
/// process a subreaper and installs signal handlers, which other tests in
/// this binary must not inherit.
fn run_with_the_counting_output(dir: PathBuf) {
    let mut config = crate::config::Config {
        output: dir.clone(),
        listen: "off".into(),
        ..Default::default()
    };
    config.socket.path = "off".into();
    // The job ends once the output has heard of a checkpoint (a state,
    // waited for; bounded so that a broken seam fails instead of hanging).
    let script = format!(
        "i=0; until [ -e {}/*/counted-checkpoint ]; do i=$((i+1)); \
         [ $i -gt 1200 ] && exit 3; sleep 0.05; done",
        dir.display()
    );
    let mode = crate::app::Mode::Run {
        argv: vec!["sh".into(), "-c".into(), script],
    };
    let outcome = crate::app::run_daemon(mode, config).unwrap();
    assert_eq!(outcome.exit_code, 0, "the job never saw the checkpoint");
}

#[test]
fn a_registered_output_hears_the_runs_entries_checkpoints_and_end() {
    const DIR: &str = "MEMTRACK_COUNTING_DIR";
    if let Some(dir) = std::env::var_os(DIR) {
        return run_with_the_counting_output(PathBuf::from(dir));
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("count-outputs"), b"").unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "app::outputs::counting::a_registered_output_hears_the_runs_entries_checkpoints_and_end",
            "--test-threads=1",
        ])
        .env(DIR, dir.path())
        .status()
        .unwrap();
    assert!(status.success(), "the run failed: {status}");
    let run_dir = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("counted.json").exists())
        .expect("the counting output wrote counted.json");
    let counts: Counts =
        serde_json::from_slice(&std::fs::read(run_dir.join("counted.json")).unwrap()).unwrap();
    let document: serde_json::Value = serde_json::from_slice(
        &std::fs::read(run_dir.join(crate::model::json::FILE_NAME)).unwrap(),
    )
    .unwrap();
    let logged = document["detailed_log"].as_array().unwrap().len() as u64;
    assert!(logged >= 2, "{document}");
    assert_eq!(counts.entries, logged, "every entry of the run, once");
    assert!(counts.checkpoints >= 1);
    let (seq, path) = counts.last_checkpoint.unwrap();
    assert!(seq > 0);
    // The run directory as memtrack holds it (its descriptor).
    assert!(
        path.ends_with(crate::model::json::FILE_NAME),
        "{}",
        path.display()
    );
    assert!(counts.finished && counts.written);
    // The files output is registered like any other: it finished first
    // and handed the final document's path on through the seam.
    assert_eq!(counts.document, run_dir.join(crate::model::json::FILE_NAME));
}
