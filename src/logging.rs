//! memtrack's own log lines on stderr.
//!
//! The job writes to the same terminal, so every line says it is
//! memtrack's: `memtrack: WARN message key=value`.

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
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .or_else(|| EnvFilter::try_new(filter).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .event_format(Prefixed)
        .try_init();
}
