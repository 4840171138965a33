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
    // The content is never shown: the file may be anything (`/etc/shadow`).
    #[error("PID file {path}: word {word} is not a PID (a decimal number above 0)")]
    PidFileBad { path: String, word: usize },
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

/// The largest PID: `kill()` takes a signed PID, and a value above this
/// one would wrap to a negative number, which signals a process group (or
/// every process, for -1).
pub(crate) const MAX_PID: u32 = i32::MAX as u32;

/// A word that is not a PID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a PID is a decimal number from 1 to {MAX_PID} (0 and larger values name process groups, \
     not a process)"
)]
pub(crate) struct NotAPid;

/// Parses one PID (`--pid`): a decimal number from 1 to [`MAX_PID`],
/// digits only (no sign, no space: `' 1'` and `'+5'` are a mistake or a
/// trick, not a PID).
pub(crate) fn parse_pid(text: &str) -> Result<u32, NotAPid> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NotAPid);
    }
    match text.parse::<u32>() {
        Ok(pid) if (1..=MAX_PID).contains(&pid) => Ok(pid),
        _ => Err(NotAPid),
    }
}

/// Parses a PID file: PIDs separated by whitespace (one per line is usual).
pub(crate) fn parse_pid_file(path: &str, text: &str) -> Result<Vec<u32>, TargetError> {
    let mut pids = Vec::new();
    for (i, token) in text.split_ascii_whitespace().enumerate() {
        match parse_pid(token) {
            Ok(pid) => pids.push(pid),
            _ => {
                return Err(TargetError::PidFileBad {
                    path: path.to_string(),
                    word: i + 1,
                })
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

/// Reads a PID file, refusing anything that cannot be one: through
/// `crate::files::read_capped` (no blocking on a FIFO, regular files
/// only, `MAX_PID_FILE` (4 KiB) at most whatever its size claims).
pub fn read_pid_file(path: &Path) -> Result<Vec<u32>, TargetError> {
    let shown = path.display().to_string();
    let bytes = crate::files::read_capped(path, MAX_PID_FILE).map_err(|source| {
        TargetError::PidFileRead {
            path: shown.clone(),
            source,
        }
    })?;
    parse_pid_file(&shown, &String::from_utf8_lossy(&bytes))
}

/// Starts the job with the extra environment. It stays in memtrack's
/// process group, so a terminal's Ctrl-C reaches it directly and an
/// interactive debugger (pdb) keeps the terminal.
pub(crate) fn spawn(argv: &[String], env: &[(String, String)]) -> Result<Child, TargetError> {
    spawn_in(argv, env, None)
}

/// [`spawn`], the job joining a cgroup (its `cgroup.procs`, open for
/// writing) before it executes.
pub(crate) fn spawn_in(
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
        let err = parse_pid_file("f", "1 12a\n").unwrap_err().to_string();
        assert!(err.contains("word 2"), "{err}");
        assert!(!err.contains("12a"), "the content is never echoed: {err}");
        assert!(parse_pid_file("f", "0").is_err());
        assert!(parse_pid_file("f", "-5").is_err());
        assert!(parse_pid_file("f", "99999999999").is_err());
        assert!(parse_pid_file("f", "4294967295").is_err());
        assert!(parse_pid_file("f", "2147483648").is_err());
        assert_eq!(parse_pid("2147483647"), Ok(MAX_PID));
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
        let err = read_pid_file(&p).unwrap_err().to_string();
        assert!(err.contains("larger than 4096 bytes"), "{err}");
    }

    #[test]
    fn a_fifo_a_device_and_a_directory_are_refused_without_reading() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.pid");
        // No writer: a blocking open would wait forever.
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        for p in [fifo.as_path(), Path::new("/dev/zero"), dir.path()] {
            let err = read_pid_file(p).unwrap_err().to_string();
            assert!(err.contains("not a regular file"), "{}: {err}", p.display());
        }
    }

    #[test]
    fn a_file_longer_than_its_size_says_is_read_up_to_the_limit() {
        // /proc files claim size 0: the limit is on what is read, not on
        // what the size says.
        let p = Path::new("/proc/self/smaps");
        assert_eq!(p.metadata().unwrap().len(), 0);
        assert!(std::fs::read(p).unwrap().len() as u64 > MAX_PID_FILE);
        let err = read_pid_file(p).unwrap_err().to_string();
        assert!(err.contains("larger than 4096 bytes"), "{err}");
    }

    #[test]
    fn a_secret_file_given_as_pid_file_is_not_echoed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("shadow");
        std::fs::write(&p, "root:$6$secret-hash:19000:0:99999:7:::\n").unwrap();
        let err = read_pid_file(&p).unwrap_err().to_string();
        assert!(!err.contains("secret"), "{err}");
        assert!(!err.contains("root"), "{err}");
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
