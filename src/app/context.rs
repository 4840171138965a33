//! What the phases of a run share: what the run follows ([`Mode`]) and
//! what it reports to `main` at the end ([`RunOutcome`]).

use std::path::PathBuf;

/// What to follow.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Spawn this command and follow its tree.
    Run { argv: Vec<String> },
    /// Follow existing processes.
    Attach { pids: Vec<u32> },
}

/// What a finished daemon reports to `main`.
#[derive(Debug)]
pub struct RunOutcome {
    /// The process exit status memtrack should use.
    pub exit_code: i32,
    pub document: PathBuf,
}
