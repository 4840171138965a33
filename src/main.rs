//! The `memtrack` binary: parse, configure, call the library, map the
//! result to an exit code. Errors print their whole chain.

use std::process::ExitCode;

use clap::Parser;
use memtrack::app::{self, Mode};
use memtrack::cli::{Cli, Command, DaemonArgs};
use memtrack::config::{self, Config, Layer};
use memtrack::{logging, store, target};

/// Exit status for usage and configuration errors (as clap uses).
const USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli) {
        Ok(code) => ExitCode::from(code),
        Err(Failure { code, error }) => {
            eprintln!("memtrack: error: {error:#}");
            ExitCode::from(code)
        }
    }
}

struct Failure {
    code: u8,
    error: anyhow::Error,
}

fn usage(error: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: USAGE,
        error: error.into(),
    }
}

fn runtime(error: anyhow::Error) -> Failure {
    // A job that cannot start exits as a shell would (127 not found, 126
    // not executable).
    let code = error
        .downcast_ref::<target::TargetError>()
        .map_or(1, |e| e.exit_code().clamp(1, 255) as u8);
    Failure { code, error }
}

/// Every configuration layer, resolved.
fn load_config(args: &DaemonArgs) -> Result<Config, Failure> {
    let mut layers = Vec::new();
    if let Some(path) = &args.config {
        layers.push(Layer::from_file(path).map_err(usage)?);
    }
    layers.push(Layer::from_env(std::env::vars()).map_err(usage)?);
    layers.push(args.layer().map_err(|e| usage(anyhow::anyhow!(e)))?);
    config::resolve(&layers).map_err(usage)
}

fn dispatch(cli: Cli) -> Result<u8, Failure> {
    match cli.command {
        Command::Run(args) => {
            let config = load_config(&args.daemon)?;
            logging::init(&config.log_level);
            daemon(Mode::Run { argv: args.command }, config)
        }
        Command::Attach(args) => {
            let config = load_config(&args.daemon)?;
            logging::init(&config.log_level);
            let mut pids = args.pids.clone();
            for f in &args.pid_files {
                pids.extend(target::read_pid_file(f).map_err(|e| runtime(e.into()))?);
            }
            if pids.is_empty() {
                return Err(usage(anyhow::anyhow!(
                    "attach needs --pid PID or --pid-file FILE (self-registration arrives with the event socket)"
                )));
            }
            daemon(Mode::Attach { pids }, config)
        }
        Command::Recover(args) => {
            logging::init("info");
            recover(&args.dir).map_err(runtime)
        }
        Command::Config(args) => {
            let text = if args.defaults {
                toml::to_string(&Config::default())
            } else {
                toml::to_string(&load_config(&args.daemon)?)
            };
            let text = text.map_err(|e| runtime(e.into()))?;
            stdout(&text).map_err(|e| runtime(e.into()))?;
            Ok(0)
        }
    }
}

/// Writes to stdout; a closed pipe (`memtrack … | head`) is not an error.
fn stdout(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

fn daemon(mode: Mode, config: Config) -> Result<u8, Failure> {
    let outcome = app::run_daemon(mode, config).map_err(runtime)?;
    Ok(outcome.exit_code.clamp(0, 255) as u8)
}

fn recover(dir: &std::path::Path) -> anyhow::Result<u8> {
    use store::journal;
    if journal::has_journal(dir) {
        let r = journal::recover(dir)?;
        eprintln!(
            "memtrack: recovered {} ({} records replayed, {} unreadable lines skipped)",
            dir.join("memory_usage.json").display(),
            r.replayed,
            r.skipped_lines
        );
        return Ok(0);
    }
    let mut found = false;
    for entry in std::fs::read_dir(dir)?.flatten() {
        if journal::has_journal(&entry.path()) {
            found = true;
            let r = journal::recover(&entry.path())?;
            eprintln!(
                "memtrack: recovered {} ({} records replayed)",
                entry.path().display(),
                r.replayed
            );
        }
    }
    anyhow::ensure!(found, "{} holds no run to recover", dir.display());
    Ok(0)
}
