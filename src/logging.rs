//! memtrack's own log lines on stderr.
//!
//! The job writes to the same terminal, so every line says it is
//! memtrack's: `memtrack: WARN message key=value`.
//!
//! stderr may be gone (a closed pipe, a `tee` that died, a closed
//! descriptor): a log line that cannot be written is dropped, never a
//! panic and never a change of the job's exit status.

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
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
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

/// Writes one line to stderr, as `eprintln!` would, but a dead stderr is
/// ignored instead of a panic.
pub fn say(line: &str) {
    use std::io::Write;
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

/// Logs a repeated problem once, then every `every`-th time.
#[derive(Debug, Default)]
pub struct RateLimited {
    count: u64,
}

impl RateLimited {
    /// Counts one occurrence; `Some(count so far)` when it is to be logged.
    pub fn hit(&mut self, every: u64) -> Option<u64> {
        self.count += 1;
        (self.count == 1 || self.count.is_multiple_of(every)).then_some(self.count)
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
    fn rate_limited_logs_first_and_every_nth() {
        let mut r = RateLimited::default();
        let hits: Vec<u64> = (0..250).filter_map(|_| r.hit(100)).collect();
        assert_eq!(hits, [1, 100, 200]);
    }
}
