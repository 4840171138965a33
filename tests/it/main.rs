//! memtrack's integration tests: one binary, real processes, real sockets,
//! real servers on loopback. Shared helpers live in `common`.

// A test crate: its helpers fail loudly like its tests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod bounds;
mod clearml;
mod cli;
mod common;
mod core;
mod deploy;
mod events;
mod golden;
mod host;
mod hostile;
mod http;
mod layers;
mod plot;
mod prometheus;
mod refs;
mod report;
mod s3;
mod safety;
