//! memtrack's own log lines on stderr.
//!
//! The job writes to the same terminal, so every line says it is
//! memtrack's: `memtrack: WARN message key=value`.
//!
//! stderr may be gone (a closed pipe, a `tee` that died, a closed
//! descriptor): a log line that cannot be written is dropped, never a
//! panic and never a change of the job's exit status.

pub mod terminal;

use std::fmt;

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

struct Prefixed;

impl<S, N> FormatEvent<S, N> for Prefixed
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let level = *event.metadata().level();
        if level == tracing::Level::INFO {
            write!(writer, "memtrack: ")?;
        } else {
            write!(writer, "memtrack: {level} ")?;
        }
        // Log lines quote names the job chose: shown, never obeyed.
        let mut line = String::new();
        ctx.field_format()
            .format_fields(Writer::new(&mut line), event)?;
        writeln!(writer, "{}", terminal::escape_text(&unalias(&line)))
    }
}

/// Installs the stderr logger. `filter` is a level (`info`) or a tracing
/// filter (`memtrack=debug`); `RUST_LOG`, when set, wins.
pub fn init(filter: &str) {
    // A bare level applies to memtrack; the libraries it uses (AWS SDK,
    // hyper, rustls) only speak up for errors unless a filter names them.
    let quiet = ",aws_config=error,aws_smithy_runtime=error,aws_smithy_http_client=error,aws_sdk_s3=error,\
                 aws_runtime=error,hyper=error,hyper_util=error,rustls=error,h2=error,reqwest=error";
    let with_quiet = |f: &str| {
        if f.contains('=') {
            f.to_string()
        } else {
            format!("{f}{quiet}")
        }
    };
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(with_quiet(&f)).ok())
        .or_else(|| EnvFilter::try_new(with_quiet(filter)).ok())
        .unwrap_or_else(|| EnvFilter::new(with_quiet("info")));
    let _ = tracing_subscriber::fmt()
        .with_writer(|| Stderr)
        // Its fallback for a failed write is `eprintln!`, which panics.
        .log_internal_errors(false)
        .with_ansi(false)
        .with_env_filter(filter)
        .event_format(Prefixed)
        .try_init();
}

/// stderr, with every write error (EPIPE, EBADF, EIO) swallowed.
struct Stderr;

impl std::io::Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// Paths memtrack uses for I/O and the names messages show instead: a
/// folder held by its descriptor is reached as `/proc/self/fd/N`, which
/// means nothing to a reader.
static ALIASES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// From now on, messages show `shown` for the path `via`. An alias
/// outlives the folder held (an error about it may be printed after it is
/// closed) until a new one for the same `via` replaces it.
pub(crate) fn alias_path(via: &std::path::Path, shown: &std::path::Path) {
    let via = via.to_string_lossy().into_owned();
    if let Ok(mut a) = ALIASES.lock() {
        a.retain(|(v, _)| *v != via);
        a.push((via, shown.to_string_lossy().into_owned()));
    }
}

/// `text` with every aliased path written as its shown name.
pub(crate) fn unalias(text: &str) -> std::borrow::Cow<'_, str> {
    let Ok(aliases) = ALIASES.lock() else {
        return text.into();
    };
    let mut out = std::borrow::Cow::Borrowed(text);
    for (via, shown) in aliases.iter() {
        if !out.contains(via.as_str()) {
            continue;
        }
        let mut next = String::with_capacity(out.len());
        let mut rest: &str = &out;
        while let Some(at) = rest.find(via.as_str()) {
            let after = &rest[at + via.len()..];
            next.push_str(&rest[..at]);
            // `/proc/self/fd/5` is not the start of `/proc/self/fd/57`.
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                next.push_str(via);
            } else {
                next.push_str(shown);
            }
            rest = after;
        }
        next.push_str(rest);
        out = std::borrow::Cow::Owned(next);
    }
    out
}

/// Writes one line to stderr, as `eprintln!` would, but a dead stderr is
/// ignored instead of a panic.
pub fn say(line: &str) {
    use std::io::Write;
    let line = unalias(line);
    let line = terminal::escape_text(&line);
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.write_all(b"\n");
}

/// An error and its causes on one line, joined by ": ", leaving out a
/// cause whose text the line already holds (many errors name their cause
/// in their own message: printed as a chain, it would appear twice).
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let text = e.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = e.source();
    }
    line
}

/// Logs a repeated problem the first time, then at most once per
/// [`LOG_INTERVAL`] with the count so far: a flood of a million costs a
/// few lines, however fast it comes (a ratio, one line per hundred, would
/// still be ten thousand).
#[derive(Debug, Default)]
pub(crate) struct RateLimited {
    count: u64,
    last: Option<std::time::Instant>,
}

/// The least time between two lines of one [`RateLimited`] problem.
pub(crate) const LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

impl RateLimited {
    /// Counts one occurrence; `Some(count so far)` when it is to be logged.
    pub(crate) fn hit(&mut self) -> Option<u64> {
        self.hit_at(std::time::Instant::now())
    }

    /// [`RateLimited::hit`] at `now`.
    pub(crate) fn hit_at(&mut self, now: std::time::Instant) -> Option<u64> {
        self.count += 1;
        let due = self
            .last
            .is_none_or(|t| now.saturating_duration_since(t) >= LOG_INTERVAL);
        if due {
            self.last = Some(now);
        }
        due.then_some(self.count)
    }
}

#[cfg(test)]
mod tests {

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read x.toml: {source}")]
    struct Names {
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_named_is_not_repeated() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let e = anyhow::Error::new(Names { source: io() });
        assert_eq!(chain(e.as_ref()), "cannot read x.toml: gone");
        let e = anyhow::Error::new(io()).context("loading the config");
        assert_eq!(chain(e.as_ref()), "loading the config: gone");
        let e = anyhow::Error::new(Names { source: io() }).context("starting");
        assert_eq!(chain(e.as_ref()), "starting: cannot read x.toml: gone");
    }
    use super::*;

    #[test]
    fn rate_limited_logs_first_then_once_per_interval() {
        let mut r = RateLimited::default();
        let t0 = std::time::Instant::now();
        let second = std::time::Duration::from_secs(1);
        // A million in the first second: one line.
        let hits: Vec<u64> = (0..1_000_000).filter_map(|_| r.hit_at(t0)).collect();
        assert_eq!(hits, [1]);
        assert_eq!(r.hit_at(t0 + LOG_INTERVAL - second), None);
        assert_eq!(r.hit_at(t0 + LOG_INTERVAL), Some(1_000_002));
        assert_eq!(r.hit_at(t0 + LOG_INTERVAL + second), None);
    }

    #[test]
    fn held_paths_are_shown_by_name() {
        alias_path(
            std::path::Path::new("/proc/self/fd/97"),
            std::path::Path::new("/out/run"),
        );
        assert_eq!(
            unalias("cannot write /proc/self/fd/97/memory_usage.json: full; /proc/self/fd/977/x"),
            "cannot write /out/run/memory_usage.json: full; /proc/self/fd/977/x"
        );
        assert_eq!(unalias("nothing here"), "nothing here");
    }
}
