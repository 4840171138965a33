//! The `memtrack` binary: parse, configure, call the library, map the
//! result to an exit code. Errors print their whole chain.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use memtrack::app::{self, Mode};
use memtrack::cli::{
    AdviseArgs, AttachArgs, ClearmlResendArgs, Cli, Command, CompareArgs, ConfigArgs,
    ConfigSources, LsArgs, MergeArgs, MlflowResendArgs, PlotArgs, RecoverArgs, ReportArgs, RunArgs,
    SocketArgs, StatusArgs, UploadArgs, WatchArgs,
};
use memtrack::config::{self, Config, Layer};
use memtrack::event::client;
use memtrack::{logging, store, target};

/// Exit status for usage and configuration errors (as clap uses).
const USAGE: u8 = 2;

fn main() -> ExitCode {
    memtrack::sys::take_socket_activation();
    let cli = Cli::parse();
    match dispatch(cli) {
        Ok(code) => ExitCode::from(code),
        Err(Failure { code, error }) => {
            logging::say(&format!(
                "memtrack: error: {}",
                logging::chain(error.as_ref())
            ));
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
    // A ClearML configuration found wanting at start is a usage error.
    if error
        .downcast_ref::<memtrack::export::clearml::ClearmlError>()
        .is_some()
    {
        return usage(error);
    }
    // A job that cannot start exits as a shell would (127 not found, 126
    // not executable).
    let code = error
        .downcast_ref::<target::TargetError>()
        .map_or(1, |e| e.exit_code().clamp(1, 255) as u8);
    Failure { code, error }
}

/// Every configuration layer, resolved: the defaults, the command's
/// `--config` file, the `MEMTRACK_*` environment, then its flags.
fn load_config(args: &impl ConfigSources) -> Result<Config, Failure> {
    let mut layers = Vec::new();
    if let Some(path) = args.config_file() {
        layers.push(Layer::from_file(path).map_err(usage)?);
    }
    layers.push(Layer::from_env(std::env::vars()).map_err(usage)?);
    layers.push(args.flags().map_err(usage)?);
    config::resolve(&layers).map_err(usage)
}

fn dispatch(cli: Cli) -> Result<u8, Failure> {
    match cli.command {
        Command::Run(args) => run(args),
        Command::Attach(args) => attach(&args),
        Command::Mark(args) => mark(&args),
        Command::Status(args) => status(&args),
        Command::Cleanup(args) => cleanup(&args),
        Command::Upload(args) => upload(&args),
        Command::ClearmlResend(args) => clearml_resend(&args),
        Command::MlflowResend(args) => mlflow_resend(&args),
        Command::Report(args) => report(&args),
        Command::Advise(args) => advise(&args),
        Command::Compare(args) => compare(&args),
        Command::Merge(args) => merge(&args),
        Command::Plot(args) => plot(&args),
        Command::Watch(args) => watch(&args),
        Command::Ls(args) => ls(&args),
        Command::Recover(args) => recover(&args),
        Command::Config(args) => show_config(&args),
    }
}

/// `memtrack run`.
fn run(args: RunArgs) -> Result<u8, Failure> {
    let config = load_config(&args)?;
    logging::init(&config.log_level);
    daemon(Mode::Run { argv: args.command }, config)
}

/// `memtrack attach`: the PIDs given and those in PID files, or processes
/// that register themselves over the event socket.
fn attach(args: &AttachArgs) -> Result<u8, Failure> {
    let config = load_config(&args.daemon)?;
    logging::init(&config.log_level);
    let mut pids = args.pids.clone();
    for f in &args.pid_files {
        pids.extend(target::read_pid_file(f).map_err(|e| runtime(e.into()))?);
    }
    if pids.is_empty() && config.socket.is_off() {
        return Err(usage(anyhow::anyhow!(
            "attach needs --pid PID, --pid-file FILE, or the event socket (processes then register themselves)"
        )));
    }
    daemon(Mode::Attach { pids }, config)
}

/// `memtrack status`: what the daemon sees now, as text or JSON.
fn status(args: &StatusArgs) -> Result<u8, Failure> {
    let path = socket_of(&args.socket).map_err(runtime)?;
    let reply = client::Connection::open(&path, CLIENT_TIMEOUT)
        .and_then(|mut c| c.call(&serde_json::json!({"type": "status"})))
        .map_err(runtime)?;
    let text = if args.json {
        format!(
            "{}\n",
            serde_json::to_string_pretty(&reply).unwrap_or_default()
        )
    } else {
        memtrack::event::client::format_status(&reply)
    };
    stdout(&text).map_err(|e| runtime(e.into()))?;
    Ok(0)
}

/// `memtrack cleanup`: asks the job's subscribed clients to free caches.
fn cleanup(args: &SocketArgs) -> Result<u8, Failure> {
    let path = socket_of(args).map_err(runtime)?;
    let reply = client::Connection::open(&path, CLIENT_TIMEOUT)
        .and_then(|mut c| c.call(&serde_json::json!({"type": "cleanup"})))
        .map_err(runtime)?;
    let n = reply["notified"].as_u64().unwrap_or(0);
    stdout(&format!(
        "asked {n} subscribed client(s) to free their caches\n"
    ))
    .map_err(|e| runtime(e.into()))?;
    Ok(0)
}

/// `memtrack upload`: prints the URI the document went to.
fn upload(args: &UploadArgs) -> Result<u8, Failure> {
    let config = load_config(args)?;
    logging::init(&config.log_level);
    let file = memtrack::report::document_path(&args.file).map_err(runtime)?;
    let uri = memtrack::export::s3::upload_file(&config.s3, &file).map_err(runtime)?;
    stdout(&format!("{uri}\n")).map_err(|e| runtime(e.into()))?;
    Ok(0)
}

/// `memtrack clearml-resend`: exits 1 while something is left unsent.
fn clearml_resend(args: &ClearmlResendArgs) -> Result<u8, Failure> {
    let config = load_config(args)?;
    logging::init(&config.log_level);
    let done =
        memtrack::export::clearml::resend::clearml_resend(&args.dir, &config.clearml, args.timeout)
            .map_err(runtime)?;
    stdout(&format!("{}\n", done.summary)).map_err(|e| runtime(e.into()))?;
    Ok(if done.complete { 0 } else { 1 })
}

/// `memtrack mlflow-resend`: exits 1 while something is left unsent.
fn mlflow_resend(args: &MlflowResendArgs) -> Result<u8, Failure> {
    let config = load_config(args)?;
    logging::init(&config.log_level);
    let done =
        memtrack::export::mlflow::resend::mlflow_resend(&args.dir, &config.mlflow, args.timeout)
            .map_err(runtime)?;
    stdout(&format!("{}\n", done.summary)).map_err(|e| runtime(e.into()))?;
    Ok(if done.complete { 0 } else { 1 })
}

/// `memtrack report`, as text or JSON.
fn report(args: &ReportArgs) -> Result<u8, Failure> {
    let file = memtrack::report::document_path(&args.file).map_err(runtime)?;
    if args.html {
        let out = args
            .output
            .clone()
            .unwrap_or_else(|| memtrack::report::html::beside(&file));
        let page = memtrack::report::html::run_page(&file).map_err(runtime)?;
        memtrack::report::html::write(&out, &page).map_err(runtime)?;
        logging::say(&format!("memtrack: wrote {}", out.display()));
        return Ok(0);
    }
    let doc = memtrack::report::read::for_report(&file).map_err(runtime)?;
    let text = if args.json {
        let report = memtrack::report::text::build(&doc);
        format!(
            "{}\n",
            serde_json::to_string_pretty(&report).map_err(|e| runtime(e.into()))?
        )
    } else {
        memtrack::report::text::render(&doc)
    };
    stdout(&text).map_err(|e| runtime(e.into()))?;
    Ok(0)
}

/// `memtrack advise`: the rules' advice on a run, as text or JSON. The
/// advice is worked out again from the file, so a running run's
/// checkpoint and a file written before advice existed get it too.
fn advise(args: &AdviseArgs) -> Result<u8, Failure> {
    let file = memtrack::report::document_path(&args.file).map_err(runtime)?;
    let doc = memtrack::report::read::for_report(&file).map_err(runtime)?;
    let advice = doc.advice;
    let text = if args.json {
        format!(
            "{}\n",
            serde_json::to_string_pretty(&advice).map_err(|e| runtime(e.into()))?
        )
    } else {
        memtrack::model::advice::render(&advice)
    };
    stdout(&text).map_err(|e| runtime(e.into()))?;
    Ok(0)
}

/// `memtrack compare`: the runs side by side, named after themselves (or
/// their directories), and their overlay plot when asked.
fn compare(args: &CompareArgs) -> Result<u8, Failure> {
    let mut runs = Vec::new();
    for f in &args.files {
        let f = &memtrack::report::document_path(f).map_err(runtime)?;
        // The overlay needs the samples; the tables only the summaries.
        let doc = if args.plot.is_some() {
            memtrack::report::read::for_plot(f)
        } else {
            memtrack::report::read::without_log(f)
        }
        .map_err(runtime)?;
        let name = f
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned());
        runs.push((name.unwrap_or_else(|| f.display().to_string()), doc));
    }
    let format = if args.json {
        memtrack::report::compare::Format::Json
    } else {
        args.format
    };
    stdout(&memtrack::report::compare::render(&runs, format)).map_err(|e| runtime(e.into()))?;
    if let Some(out) = &args.plot {
        let names: Vec<String> = memtrack::report::compare::build(&runs)
            .runs
            .into_iter()
            .map(|r| r.name)
            .collect();
        memtrack::report::plot::overlay(
            &runs,
            &names,
            args.align,
            out,
            &memtrack::report::plot::PlotOptions::default(),
        )
        .map_err(|e| runtime(e.into()))?;
        logging::say(&format!("memtrack: wrote {}", out.display()));
    }
    if args.html {
        let names = memtrack::report::compare::build(&runs).runs;
        let files: Vec<(String, std::path::PathBuf)> = names
            .into_iter()
            .zip(&args.files)
            .map(|(r, f)| Ok((r.name, memtrack::report::document_path(f)?)))
            .collect::<anyhow::Result<_>>()
            .map_err(runtime)?;
        let out = args
            .output
            .clone()
            .unwrap_or_else(|| std::path::PathBuf::from("memory_compare.html"));
        let page = memtrack::report::html::compare_page(&files).map_err(runtime)?;
        memtrack::report::html::write(&out, &page).map_err(runtime)?;
        logging::say(&format!("memtrack: wrote {}", out.display()));
    }
    Ok(0)
}

/// `memtrack merge`: the ranks' files (or an S3 prefix) into one document,
/// written to `--output` or printed.
fn merge(args: &MergeArgs) -> Result<u8, Failure> {
    let config = load_config(args)?;
    logging::init(&config.log_level);
    // A signal leaves no temporary folder or half-written file behind.
    memtrack::report::merge::remove_on_signals();
    let inputs = merge_inputs(args, &config)?;
    let accept = if args.force {
        memtrack::report::merge::Accept::Any
    } else {
        memtrack::report::merge::Accept::OneJob
    };
    let merged = memtrack::report::merge::merge_inputs(inputs, accept).map_err(runtime)?;
    match &args.output {
        Some(path) => write_merged(path, &merged),
        None => print_merged(&merged),
    }
}

/// What `merge` reads: the documents under an S3 prefix, downloaded, and
/// local files, streamed.
fn merge_inputs(
    args: &MergeArgs,
    config: &Config,
) -> Result<Vec<memtrack::report::merge::MergeSource>, Failure> {
    use memtrack::report::merge::MergeSource;
    let mut inputs = Vec::new();
    for input in &args.inputs {
        if input.starts_with("s3://") {
            inputs.extend(
                memtrack::export::s3::download_documents(&config.s3, input)
                    .map_err(runtime)?
                    .into_iter()
                    .map(|(source, doc)| MergeSource::Document(source, Box::new(doc))),
            );
        } else {
            // Read as a stream: a rank's log may be millions long.
            let path =
                memtrack::report::document_path(std::path::Path::new(input)).map_err(runtime)?;
            inputs.push(MergeSource::File(input.clone(), path));
        }
    }
    Ok(inputs)
}

fn write_merged(
    path: &std::path::Path,
    merged: &memtrack::report::merge::Merged,
) -> Result<u8, Failure> {
    // The job's folder (outputs/JOB/) may not exist yet:
    // each rank wrote into its own JOB.rankN/.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create {}", dir.display()))
            .map_err(runtime)?;
    }
    // No larger than `report` reads; past it, nothing is written.
    memtrack::model::json::write_document_within(path, merged, memtrack::report::MAX_MERGED)
        .map_err(|e| runtime(e.into()))?;
    logging::say(&format!(
        "memtrack: merged {} ranks into {}",
        merged.ranks.len(),
        path.display()
    ));
    Ok(0)
}

/// The merged document on stdout, streamed. Its size is counted first (no
/// copy kept), so a document too large for `report` prints nothing.
fn print_merged(merged: &memtrack::report::merge::Merged) -> Result<u8, Failure> {
    use std::io::Write;
    memtrack::model::json::document_size_within(merged, memtrack::report::MAX_MERGED)
        .map_err(|e| runtime(e.into()))?;
    let out = std::io::stdout().lock();
    let mut out = std::io::BufWriter::with_capacity(
        64 * 1024,
        EscapedOut {
            out,
            carry: Vec::new(),
        },
    );
    let written = serde_json::to_writer_pretty(&mut out, merged)
        .map_err(std::io::Error::from)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        other => other.map(|()| 0).map_err(|e| runtime(e.into())),
    }
}

/// stdout through the escaping every command's output gets, for text
/// written in pieces (a character cut between two pieces waits for the
/// next).
struct EscapedOut<W> {
    out: W,
    carry: Vec<u8>,
}

impl<W: std::io::Write> std::io::Write for EscapedOut<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.carry.extend_from_slice(buf);
        let (whole, rest) = match std::str::from_utf8(&self.carry) {
            Ok(s) => (s.len(), 0),
            // Cut inside a character: the rest waits for the next piece.
            Err(e) if e.error_len().is_none() => (e.valid_up_to(), 0),
            // Not UTF-8 at all (JSON text always is): passed on as it is.
            Err(_) => (0, self.carry.len()),
        };
        let text = std::str::from_utf8(&self.carry[..whole]).unwrap_or_default();
        self.out
            .write_all(memtrack::logging::terminal::escape_output(text).as_bytes())?;
        self.out.write_all(&self.carry[whole..whole + rest])?;
        self.carry.drain(..whole + rest);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.write_all(&self.carry)?;
        self.carry.clear();
        self.out.flush()
    }
}

/// `memtrack plot`: an SVG or PNG of the run's timeline.
fn plot(args: &PlotArgs) -> Result<u8, Failure> {
    let file = memtrack::report::document_path(&args.file).map_err(runtime)?;
    let doc = memtrack::report::read::for_plot(&file).map_err(runtime)?;
    let opts = memtrack::report::plot::PlotOptions {
        width: args.width,
        height: args.height,
        title: args.title.clone(),
        process_rss: args.process_rss,
    };
    // By default the picture goes beside the document it shows.
    let out = args.output.clone().unwrap_or_else(|| {
        file.parent()
            .unwrap_or(std::path::Path::new("."))
            .join("memory_timeline.svg")
    });
    memtrack::report::plot::plot(&doc, &out, &opts).map_err(|e| runtime(e.into()))?;
    logging::say(&format!("memtrack: wrote {}", out.display()));
    Ok(0)
}

/// `memtrack watch`: a live view, refreshed every `--interval`.
fn watch(args: &WatchArgs) -> Result<u8, Failure> {
    let path = socket_of(&args.socket).map_err(runtime)?;
    let interval = memtrack::units::parse_duration(&args.interval)
        .map_err(|e| usage(anyhow::Error::new(e).context("--interval")))?;
    let mut out = std::io::stdout().lock();
    client::watch(&path, interval, args.once, &mut out).map_err(runtime)?;
    Ok(0)
}

/// The socket `--run NAME` names, else `--socket`, else `$MEMTRACK_SOCKET`.
fn socket_of(args: &SocketArgs) -> anyhow::Result<std::path::PathBuf> {
    let Some(wanted) = &args.run else {
        return client::socket_path(args.socket.as_deref()).map_err(|e| {
            let live = app::registry::live_runs();
            if live.is_empty() {
                anyhow::anyhow!("{e}; or --run NAME for a live run (`memtrack ls`: none now)")
            } else {
                let names: Vec<&str> = live.iter().map(|r| r.name.as_str()).collect();
                anyhow::anyhow!(
                    "{e}; or pass --run NAME for one of the live runs: {}",
                    names.join(", ")
                )
            }
        });
    };
    let run = app::registry::find_run(wanted)?;
    run.socket
        .ok_or_else(|| anyhow::anyhow!("run `{}` serves no event socket", run.name))
}

/// `memtrack ls`: the live runs, as a table or JSON.
fn ls(args: &LsArgs) -> Result<u8, Failure> {
    let runs = app::registry::live_runs();
    let text = if args.json {
        format!(
            "{}\n",
            serde_json::to_string_pretty(&runs).map_err(|e| runtime(e.into()))?
        )
    } else {
        app::registry::format_runs(&runs, memtrack::units::unix_now())
    };
    stdout(&text).map_err(|e| runtime(e.into()))?;
    Ok(0)
}

/// `memtrack recover`.
fn recover(args: &RecoverArgs) -> Result<u8, Failure> {
    logging::init("info");
    // A killed run's cgroup is left behind: remove it (and any other
    // stale one) once it is empty.
    let removed = memtrack::sample::footprint::remove_stale_cgroups(std::path::Path::new("/proc"));
    if removed > 0 {
        logging::say(&format!(
            "memtrack: removed {removed} memory cgroup{} a killed run left",
            if removed == 1 { "" } else { "s" }
        ));
    }
    // So are the Python hooks' folders of killed runs.
    let hooks = app::remove_leftover_hooks();
    if hooks > 0 {
        logging::say(&format!(
            "memtrack: removed {hooks} Python hooks folder{} killed runs left",
            if hooks == 1 { "" } else { "s" }
        ));
    }
    recover_dir(&args.dir).map_err(runtime)
}

/// `memtrack config`: the defaults, or the configuration every layer makes.
fn show_config(args: &ConfigArgs) -> Result<u8, Failure> {
    // The defaults with a comment on each setting: the example file, which
    // a test keeps equal to the built-in defaults.
    let text = if args.defaults {
        config::EXAMPLE.to_string()
    } else {
        toml::to_string(&load_config(&args.daemon)?).map_err(|e| runtime(e.into()))?
    };
    stdout(&text).map_err(|e| runtime(e.into()))?;
    Ok(0)
}

/// How long the socket commands wait for the daemon.
const CLIENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// `memtrack mark`: without `--wait`, an absent daemon is a warning, not a
/// failure, so a mark in a job's shell script never fails the job.
fn mark(args: &memtrack::cli::MarkArgs) -> Result<u8, Failure> {
    let mut labels = serde_json::Map::new();
    for l in &args.labels {
        let (k, v) = l
            .split_once('=')
            .ok_or_else(|| usage(anyhow::anyhow!("--label `{l}`: expected KEY=VALUE")))?;
        labels.insert(k.to_string(), v.into());
    }
    let mut message = serde_json::json!({
        "type": "mark",
        "component": args.component,
        "operation": args.operation,
        "labels": labels,
        "ack": args.wait,
    });
    if let Some(i) = args.iteration {
        message["iteration"] = i.into();
    }
    let sent = socket_of(&args.socket).and_then(|path| {
        let mut c = client::Connection::open(&path, CLIENT_TIMEOUT)?;
        if args.wait {
            c.call(&message).map(Some)
        } else {
            c.send(&message).map(|()| None)
        }
    });
    match sent {
        Ok(Some(reply)) => {
            let e = &reply["entry"];
            let line = format!(
                "recorded {}/{}: host {:.1} MiB, GPU {:.1} MiB ({})\n",
                args.component,
                args.operation,
                e["cpu_ram_used_mb"].as_f64().unwrap_or(0.0),
                e["gpu_ram_used_mb"].as_f64().unwrap_or(0.0),
                e["gpu_source"].as_str().unwrap_or("none"),
            );
            stdout(&line).map_err(|e| runtime(e.into()))?;
            Ok(0)
        }
        Ok(None) => Ok(0),
        Err(e) if !args.wait => {
            logging::say(&format!("memtrack: warning: mark not sent: {e:#}"));
            Ok(0)
        }
        Err(e) => Err(runtime(e)),
    }
}

/// Writes to stdout; a closed pipe (`memtrack … | head`) is not an error.
/// Strings a job or a file supplied are in most outputs, so terminal
/// controls are escaped here, for every command.
fn stdout(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let text = memtrack::logging::terminal::escape_output(text);
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

fn daemon(mode: Mode, config: Config) -> Result<u8, Failure> {
    let outcome = app::run_daemon(mode, config).map_err(runtime)?;
    Ok(outcome.exit_code.clamp(0, 255) as u8)
}

/// Says what the recovery could not put back, and where the files it
/// came from were kept; the rest was recovered.
fn warn_lost(r: &store::journal::Recovered) {
    let lost = &r.lost;
    if !lost.is_nothing() {
        let mut lines: Vec<String> = lost.bad_lines.iter().map(u64::to_string).collect();
        if lines.len() == store::entries::MAX_BAD_LINES {
            lines.push("…".into());
        }
        let lines = if lines.is_empty() {
            String::new()
        } else {
            format!("; damaged lines {}", lines.join(", "))
        };
        logging::say(&format!(
            "memtrack: warning: the entries file was damaged: {} log entries lost \
             ({} bytes missing, {} bytes unreadable{lines}); everything else is recovered \
             and the JSON counts them (counters.entries_lost)",
            lost.lost_entries, lost.missing_bytes, lost.dropped_bytes
        ));
    }
    if r.records_lost > 0 || r.entries_missing > 0 {
        logging::say(&format!(
            "memtrack: warning: the run's files stop short of what it recorded: {} journal \
             records and {} log entries are in no file (a full disk, or a damaged journal); \
             the JSON counts them (counters.records_lost, counters.entries_lost)",
            r.records_lost, r.entries_missing
        ));
    }
    if r.from_entries_only > 0 {
        logging::say(&format!(
            "memtrack: warning: {} log entries whose journal records were lost were put back \
             from the entries file",
            r.from_entries_only
        ));
    }
    if let Some(kept) = &r.kept {
        logging::say(&format!(
            "memtrack: the run's crash-safety files are kept in {} (what could not be \
             recovered was lost from them; nothing there is deleted)",
            kept.display()
        ));
    }
}

fn recover_dir(dir: &std::path::Path) -> anyhow::Result<u8> {
    use store::journal;
    if journal::has_journal(dir) {
        let r = journal::recover(dir)?;
        logging::say(&format!(
            "memtrack: recovered {} ({} records replayed, {} unreadable lines skipped)",
            dir.join("memory_usage.json").display(),
            r.replayed,
            r.skipped_lines
        ));
        warn_lost(&r);
        recovered_page(dir);
        return Ok(0);
    }
    let mut found = false;
    for entry in std::fs::read_dir(dir)?.flatten() {
        if journal::has_journal(&entry.path()) {
            found = true;
            let r = journal::recover(&entry.path())?;
            logging::say(&format!(
                "memtrack: recovered {} ({} records replayed)",
                entry.path().display(),
                r.replayed
            ));
            warn_lost(&r);
            recovered_page(&entry.path());
        }
    }
    anyhow::ensure!(found, "{} holds no run to recover", dir.display());
    Ok(0)
}

/// The report page of a recovered run, beside its document, as the end of
/// a run writes it; a failure is a warning (the document is what counts).
fn recovered_page(run_dir: &std::path::Path) {
    let document = run_dir.join("memory_usage.json");
    let out = memtrack::report::html::beside(&document);
    match memtrack::report::html::run_page(&document)
        .and_then(|page| memtrack::report::html::write(&out, &page))
    {
        Ok(()) => logging::say(&format!("memtrack: wrote {}", out.display())),
        Err(e) => logging::say(&format!(
            "memtrack: warning: the report page was not written: {e:#}; \
             `memtrack report --html {}` writes it later",
            document.display()
        )),
    }
}
