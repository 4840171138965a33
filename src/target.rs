//! Which processes to follow: a job memtrack spawns (`run`), or existing
//! PIDs given on the command line or in PID files (`attach`).
//!
//! The process tree below these roots is found by the procfs sampler.

use std::path::Path;
use std::process::{Child, Command};

/// Largest PID file memtrack reads (a PID file holds one short line).
const MAX_PID_FILE: u64 = 4096;

/// Why a target could not be followed, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("cannot read PID file {path}: {source}")]
    PidFileRead {
        path: String,
        source: std::io::Error,
    },
    #[error("PID file {path} is {size} bytes; a PID file holds one PID")]
    PidFileTooBig { path: String, size: u64 },
    #[error("PID file {path}: `{token}` is not a PID")]
    PidFileBad { path: String, token: String },
    #[error("PID file {path} is empty")]
    PidFileEmpty { path: String },
    #[error("{program}: command not found")]
    NotFound { program: String },
    #[error("{program}: permission denied (is it executable?)")]
    NotExecutable { program: String },
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
}

impl TargetError {
    /// The exit status a shell would give for this failure to start.
    pub fn exit_code(&self) -> i32 {
        match self {
            TargetError::NotFound { .. } => 127,
            TargetError::NotExecutable { .. } => 126,
            _ => 1,
        }
    }
}

/// Parses a PID file: PIDs separated by whitespace (one per line is usual).
pub fn parse_pid_file(path: &str, text: &str) -> Result<Vec<u32>, TargetError> {
    let mut pids = Vec::new();
    for token in text.split_ascii_whitespace() {
        match token.parse::<u32>() {
            Ok(pid) if pid > 0 => pids.push(pid),
            _ => {
                let mut shown = token.to_string();
                shown.truncate(32);
                return Err(TargetError::PidFileBad {
                    path: path.to_string(),
                    token: shown.escape_debug().to_string(),
                });
            }
        }
    }
    if pids.is_empty() {
        return Err(TargetError::PidFileEmpty {
            path: path.to_string(),
        });
    }
    Ok(pids)
}

/// Reads a PID file, refusing anything that cannot be one.
pub fn read_pid_file(path: &Path) -> Result<Vec<u32>, TargetError> {
    let shown = path.display().to_string();
    let read_err = |source| TargetError::PidFileRead {
        path: shown.clone(),
        source,
    };
    let size = std::fs::metadata(path).map_err(read_err)?.len();
    if size > MAX_PID_FILE {
        return Err(TargetError::PidFileTooBig { path: shown, size });
    }
    let bytes = std::fs::read(path).map_err(read_err)?;
    parse_pid_file(&shown, &String::from_utf8_lossy(&bytes))
}

/// Starts the job with the extra environment. It stays in memtrack's
/// process group, so a terminal's Ctrl-C reaches it directly and an
/// interactive debugger (pdb) keeps the terminal.
pub fn spawn(argv: &[String], env: &[(String, String)]) -> Result<Child, TargetError> {
    spawn_in(argv, env, None)
}

/// [`spawn`], the job joining a cgroup (its `cgroup.procs`, open for
/// writing) before it executes.
pub fn spawn_in(
    argv: &[String],
    env: &[(String, String)],
    cgroup_procs: Option<std::fs::File>,
) -> Result<Child, TargetError> {
    let program = argv.first().cloned().unwrap_or_default();
    let mut cmd = Command::new(&program);
    cmd.args(&argv[1..]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(procs) = cgroup_procs {
        crate::sys::join_cgroup_before_exec(&mut cmd, procs);
    }
    cmd.spawn().map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => TargetError::NotFound { program },
        std::io::ErrorKind::PermissionDenied => TargetError::NotExecutable { program },
        _ if source.raw_os_error() == Some(libc::ENOEXEC) => TargetError::NotExecutable { program },
        _ => TargetError::Spawn { program, source },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pid_files() {
        assert_eq!(parse_pid_file("f", "1234\n").unwrap(), vec![1234]);
        assert_eq!(parse_pid_file("f", " 1 2\n3 ").unwrap(), vec![1, 2, 3]);
        let err = parse_pid_file("f", "12a\n").unwrap_err().to_string();
        assert!(err.contains("`12a`"), "{err}");
        assert!(parse_pid_file("f", "0").is_err());
        assert!(parse_pid_file("f", "-5").is_err());
        assert!(parse_pid_file("f", "99999999999").is_err());
        assert!(matches!(
            parse_pid_file("f", " \n"),
            Err(TargetError::PidFileEmpty { .. })
        ));
        assert!(parse_pid_file("f", "1\u{0}2").is_err());
    }

    #[test]
    fn oversized_pid_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.pid");
        std::fs::write(&p, "1\n".repeat(5000)).unwrap();
        assert!(matches!(
            read_pid_file(&p),
            Err(TargetError::PidFileTooBig { .. })
        ));
    }

    #[test]
    fn spawn_failures_map_to_shell_codes() {
        let e = spawn(&["/nonexistent/prog".into()], &[]).unwrap_err();
        assert_eq!(e.exit_code(), 127);
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o644, 0o755] {
            let p = dir.path().join(format!("data-{mode:o}"));
            std::fs::write(&p, [0u8, 1, 2, 3]).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = spawn(&[p.display().to_string()], &[]).unwrap_err();
            assert_eq!(e.exit_code(), 126, "{e}");
        }
    }
}
