//! memtrack's integration tests: one binary, real processes, real sockets,
//! real servers on loopback. Shared helpers live in `common`.

// A test crate: its helpers fail loudly like its tests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod advice;
mod bounds;
mod busy;
mod clearml;
mod clearml_output;
mod cli;
mod common;
mod core;
mod deploy;
mod discovery;
mod events;
mod evidence;
mod figures;
mod golden;
mod host;
mod hostile;
mod html;
mod http;
mod inputs;
mod layers;
mod mlflow;
mod own;
mod pidns;
mod plot;
mod prometheus;
mod refs;
mod report;
mod s3;
mod s3_moto;
mod safety;
mod trust;
mod truth;
mod truth_pss;
