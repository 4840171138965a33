//! Annotated events: the job tells memtrack what it is doing over a Unix
//! socket (docs/protocol.md). `protocol` is the pure parser, `server` the
//! socket server feeding the engine, `client` the CLI's side.

pub mod client;
pub(crate) mod inbox;
pub mod protocol;
pub(crate) mod server;
