//! The run's outputs: the one list that names them, and the three moments
//! the run has with all of them (build, start, finish). Adding an output
//! is its folder under `export/` implementing [`Output`] and one line in
//! [`build`]; nothing else in `app/` knows it.
//!
//! The order of the list is the order outputs start in; they finish in
//! the reverse order, so an output that tells another something at the end
//! (S3's final upload, registered by ClearML) finishes before it. The
//! run's files come last: they finish first, so every other output's end
//! finds the final document and the report page written (`RunEnd::files`).

use std::path::Path;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::io::Io;

use crate::config::Config;
use crate::engine::Outputs;
use crate::event::inbox::Input;
use crate::export::clearml::run_output::ClearmlOutput;
use crate::export::files::FilesOutput;
use crate::export::finish::Deadline;
use crate::export::http_output::HttpOutput;
use crate::export::mlflow::run_output::MlflowOutput;
use crate::export::output::{Links, Output, RunEnd, Start};
use crate::export::s3::run_output::S3Output;
use crate::model::RunInfo;

/// Every output the configuration turns on, built (and their settings
/// checked) before anything starts. An output is one line here.
pub(super) fn build(config: &Config) -> anyhow::Result<Registered> {
    let listen = crate::config::parse_listen(&config.listen).map_err(anyhow::Error::msg)?;
    let default_listen = config.listen == crate::config::DEFAULT_LISTEN;
    // ClearML's output follows the job's own task; when it is off the
    // socket says why to a job that announces one.
    let (clearml, job_task_off) = match ClearmlOutput::build(&config.clearml, &config.s3)? {
        Ok(output) => (Some(output), None),
        Err(why) => (None, Some(why.to_string())),
    };
    let mut list = vec![
        HttpOutput::build(listen, default_listen)?.map(boxed),
        MlflowOutput::build(&config.mlflow)?.map(boxed),
        clearml.map(boxed),
        S3Output::build(&config.s3)?.map(boxed),
    ];
    #[cfg(test)]
    list.push(counting::Counting::build(&config.output)?.map(boxed));
    // Last, so it finishes first: the others' ends find the final files.
    list.push(Some(boxed(FilesOutput::build(config.html_report))));
    Ok(Registered {
        outputs: list.into_iter().flatten().collect(),
        job_task_off,
        links: Arc::default(),
    })
}

fn boxed(output: impl Output + 'static) -> Box<dyn Output> {
    Box::new(output)
}

/// The outputs built, in the order they start.
pub(super) struct Registered {
    outputs: Vec<Box<dyn Output>>,
    /// Why the output that takes the job's announcements of its task
    /// (ClearML's `Task.init`) is off: the socket's answer to them.
    pub(super) job_task_off: Option<String>,
    /// The run's messages between outputs.
    links: Arc<Links>,
}

impl Registered {
    /// Starts every output in order on the I/O runtime; returns what the
    /// engine publishes to (snapshots, one feed per output, their error
    /// counters).
    pub(super) fn start(
        &mut self,
        io: &mut Io,
        run: &RunInfo,
        (run_dir, document): (&Path, &Path),
        engine: &SyncSender<Input>,
    ) -> anyhow::Result<Outputs> {
        let ctx = Start {
            runtime: &io.runtime,
            run,
            run_dir,
            document,
            engine: engine.clone(),
            shutdown: io.shutdown.subscribe(),
            snapshots: &io.snapshots,
            notices: io.link.as_ref().map(|l| l.notices.clone()),
            document_uploaded: self.outputs.iter().any(|o| o.uploads_document()),
            job_tasks: Mutex::new(io.job_tasks.take()),
            links: Arc::clone(&self.links),
        };
        let mut out = Outputs {
            snapshots: Some(io.snapshots.clone()),
            ..Outputs::default()
        };
        for output in &mut self.outputs {
            out.feeds.push(output.start(&ctx)?);
            if let Some(errors) = output.errors() {
                out.export_errors.push((output.name().to_string(), errors));
            }
        }
        Ok(out)
    }

    /// The run's messages between outputs, for its end ([`RunEnd::links`]).
    pub(super) fn links(&self) -> Arc<Links> {
        Arc::clone(&self.links)
    }

    /// Where `/metrics` is served, when an output serves it.
    pub(super) fn metrics(&self) -> Option<std::net::SocketAddr> {
        self.outputs.iter().find_map(|o| o.serves())
    }

    /// The end of the run for every output, in the reverse order, sharing
    /// one deadline. True when an output failed (it said so).
    pub(super) fn finish(self, end: &RunEnd<'_>, finish_timeout: Duration) -> bool {
        let deadline = Deadline::start(finish_timeout);
        let mut failed = false;
        for output in self.outputs.into_iter().rev() {
            failed |= output.finish(end, &deadline).failed;
        }
        failed
    }
}

#[cfg(test)]
mod counting;

#[cfg(test)]
mod tests {
    use super::*;

    /// The run's files are an output like the others, and always one:
    /// listed last, they finish first, so the outputs that upload the
    /// final document find it written; turning the report page off
    /// leaves the document's output in the list.
    #[test]
    fn the_files_output_is_always_registered_and_finishes_first() {
        for html_report in [true, false] {
            let config = Config {
                listen: "off".into(),
                html_report,
                ..Default::default()
            };
            let list = build(&config).unwrap();
            let names: Vec<&str> = list.outputs.iter().map(|o| o.name()).collect();
            assert_eq!(names.last(), Some(&"files"), "{names:?}");
            assert_eq!(names.iter().filter(|n| **n == "files").count(), 1);
        }
    }
}
