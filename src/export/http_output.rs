//! `/metrics` and `/memory-info` as one of the run's outputs: the HTTP
//! server (`export::http`) reading the engine's latest snapshot.
//!
//! An address that is taken (by another run on this machine, or by every
//! rank of a job given one `--listen`) gives way to a free port on the
//! same interface, with a warning when it was chosen; the job starts
//! either way, without `/metrics` when no port can be had.

use std::net::SocketAddr;

use crate::engine::Feed;
use crate::export::finish::Deadline;
use crate::export::output::{Finished, Output, RunEnd, Start};

/// HTTP connections served at once; more are closed on accept.
const HTTP_CONNECTIONS: usize = 64;

/// The HTTP output.
pub(crate) struct HttpOutput {
    /// The address asked for.
    addr: SocketAddr,
    /// The address was the default one (a taken default is no warning).
    default: bool,
    /// Where `/metrics` is served, once started.
    local: Option<SocketAddr>,
}

impl HttpOutput {
    /// On unless `listen` is off (`addr` is `None`); `default` says the
    /// address is the default one.
    pub(crate) fn build(addr: Option<SocketAddr>, default: bool) -> anyhow::Result<Option<Self>> {
        Ok(addr.map(|addr| HttpOutput {
            addr,
            default,
            local: None,
        }))
    }

    /// The address asked for, else a free port of the same interface.
    fn bind(&self, runtime: &tokio::runtime::Runtime) -> Option<tokio::net::TcpListener> {
        let addr = self.addr;
        let bind = |a| runtime.block_on(tokio::net::TcpListener::bind(a));
        let e = match bind(addr) {
            Ok(listener) => return Some(listener),
            Err(e) => e,
        };
        let any = SocketAddr::new(addr.ip(), 0);
        match bind(any) {
            Ok(listener) => {
                let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
                if self.default {
                    tracing::info!(
                        "{addr} is taken ({e}; another run?): metrics on port {port} instead"
                    );
                } else {
                    tracing::warn!(
                        "cannot listen on {addr} ({e}): metrics on port {port} of the \
                         same host instead (the file_sd target and `memtrack ls` say so)"
                    );
                }
                Some(listener)
            }
            Err(e2) => {
                tracing::warn!(
                    "cannot listen on {addr} ({e}) nor on a free port ({e2}); \
                     going on without /metrics (set --listen)"
                );
                None
            }
        }
    }
}

impl Output for HttpOutput {
    fn name(&self) -> &'static str {
        "http"
    }

    fn start(&mut self, ctx: &Start<'_>) -> anyhow::Result<Feed> {
        let Some(listener) = self.bind(ctx.runtime) else {
            return Ok(Feed::default());
        };
        let local = listener.local_addr().unwrap_or(self.addr);
        tracing::debug!("metrics on http://{local}/metrics");
        self.local = Some(local);
        let state = crate::export::http::HttpState {
            snapshots: ctx.snapshots.subscribe(),
            notices: ctx.notices.clone(),
        };
        ctx.runtime.spawn(crate::export::http::serve(
            listener,
            state,
            HTTP_CONNECTIONS,
            ctx.shutdown.clone(),
        ));
        Ok(Feed::default())
    }

    fn serves(&self) -> Option<SocketAddr> {
        self.local
    }

    /// The server goes with the runtime, once every output has finished.
    fn finish(self: Box<Self>, _: &RunEnd<'_>, _: &Deadline) -> Finished {
        Finished::default()
    }
}
