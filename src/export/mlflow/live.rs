//! Live MLflow reporting: one tokio task that takes the engine's log
//! entries as they are recorded and logs them into the MLflow run while
//! the job runs, then delivers the rest, the peaks and the artifacts at
//! the end, and keeps what did not arrive in the spool file.
//!
//! The engine hands entries over an unbounded channel that this task
//! drains at once into its own bounded queue ([`Values`]): conversion is
//! cheap and local, so the engine never waits on MLflow. At most one
//! `runs/log-batch` request is out at a time, polled in the same
//! `select!` as the channel, so a slow or absent server delays only the
//! values, never their intake. A request is sent when a full batch
//! ([`BATCH`]) waits or [`LIVE_EVERY`] after the last one, with the values
//! at least [`SETTLE_MS`] old (a younger one may still take the step of a
//! mark the job held back); a failed one
//! (no answer, 5xx, 429) goes back to the front and is tried again after
//! a backoff ([`BACKOFF_MIN`] doubling to [`BACKOFF_MAX`]); one the server
//! refuses (4xx) is counted and dropped, never tried forever.
//!
//! Values wait, bounded, until the run is known: `mlflow.run_id` or
//! `MLFLOW_RUN_ID` from the start, else the moment the job's announcement
//! entry arrives (an `mlflow`/`active_run` mark, see [`ANNOUNCE`]); a later
//! announcement of another run is said and ignored, so memtrack never
//! writes into two runs. With no run by the end, memtrack creates one, as
//! before, and sends what it kept.
//!
//! At the end ([`Live::finish`], within a deadline) what is left goes out,
//! then the peaks and the artifacts, and a run memtrack created is ended;
//! a value already delivered is never sent again. Whatever is still owed
//! (values, artifacts, the run's end) is written to `mlflow-spool.jsonl`
//! for `memtrack mlflow-resend`, which runs the same delivery again.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::api::{now_ms, Api, Metric, MlflowError};
use super::settings::{Experiment, Settings, ANNOUNCE, BATCH};
use super::spool::{self, Header, SpoolError, SPOOL_FILE};
use super::values::{StepTracker, Values, SETTLE_MS};
use crate::logging::RateLimited;
use crate::model::Entry;

/// Most values waiting in memory (40 bytes each); beyond it the oldest go.
pub(crate) const QUEUE_MAX: usize = 100_000;
/// How often a partial batch goes out while the job runs.
pub(crate) const LIVE_EVERY: Duration = Duration::from_secs(1);
/// The first wait after a failed request.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(500);
/// The longest wait between two tries.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// At the end, failed tries in a row of one call before what is left goes
/// to the spool (the server is away; the spool's command sends it later).
const END_TRIES: u32 = 3;

/// How the run ended, for the delivery at the end.
#[derive(Debug, Clone)]
pub(crate) struct End {
    /// `memory_usage.json`, when it was written.
    pub(crate) document: Option<PathBuf>,
    /// The report page beside it, when there is one.
    pub(crate) page: Option<PathBuf>,
    /// The run's peaks: host and GPU, in MiB.
    pub(crate) peaks: (f64, f64),
    /// The job failed: a run memtrack created ends `FAILED`.
    pub(crate) failed: bool,
}

/// What the delivery achieved, for the end-of-run lines.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeliveryReport {
    pub(crate) run_id: Option<String>,
    /// Values the server took (while the job ran and at the end).
    pub(crate) sent: usize,
    /// Of those, the ones taken while the job ran.
    pub(crate) sent_live: usize,
    /// Values dropped from a full queue.
    pub(crate) dropped: u64,
    /// Values the server refused (4xx): not kept.
    pub(crate) refused: usize,
    /// Values written to the spool file.
    pub(crate) unsent: usize,
    /// What else the spool keeps owed: "the artifacts", "the run's end".
    pub(crate) owed: Vec<&'static str>,
    /// The spool file, when one was written.
    pub(crate) spool: Option<PathBuf>,
    /// Why the spool could not be written (what it would hold is lost).
    pub(crate) spool_error: Option<String>,
    /// Why the document is not attached (an artifact store that is not
    /// the server's proxy).
    pub(crate) artifact_skipped: Option<String>,
    /// Why the report page is not attached beside it.
    pub(crate) page_skipped: Option<String>,
    /// Calls that failed, in words.
    pub(crate) errors: Vec<String>,
}

impl DeliveryReport {
    /// Nothing is owed any more.
    pub(crate) fn complete(&self) -> bool {
        self.unsent == 0 && self.owed.is_empty() && self.spool_error.is_none()
    }
}

/// The handle on the live reporter: [`Live::start`], entries through
/// [`Live::entries`] (the engine's sender) or [`Live::entry`], and
/// [`Live::finish`] with a deadline.
#[derive(Debug)]
pub(crate) struct Live {
    entries: mpsc::UnboundedSender<Entry>,
    finish: Option<oneshot::Sender<(End, Instant)>>,
    done: Option<oneshot::Receiver<DeliveryReport>>,
    errors: Arc<AtomicU64>,
}

impl Live {
    /// Starts the reporter on the current tokio runtime and returns at once.
    /// `run_name` and `memtrack_run` name a run memtrack creates; the
    /// spool goes into `run_dir`.
    pub(crate) fn start(
        settings: &Settings,
        run_name: &str,
        memtrack_run: &str,
        run_dir: &Path,
    ) -> Result<Live, MlflowError> {
        let api = Api::new(&settings.uri, settings.request_timeout)?;
        let mut header = Header::new(&settings.uri, run_name, memtrack_run);
        header.set_experiment(&settings.experiment);
        header.run_id.clone_from(&settings.run_id);
        if let Some(id) = &settings.run_id {
            tracing::info!("MLflow: memory values go live into run {id}");
        }
        let errors = Arc::new(AtomicU64::new(0));
        let delivery = Delivery::new(
            api,
            header,
            Values::new(QUEUE_MAX),
            run_dir.join(SPOOL_FILE),
            Arc::clone(&errors),
        );
        let (entries, entries_rx) = mpsc::unbounded_channel();
        let (finish, finish_rx) = oneshot::channel();
        let (done_tx, done) = oneshot::channel();
        tokio::spawn(async move {
            let report = delivery.live(entries_rx, finish_rx).await;
            let _ = done_tx.send(report);
        });
        Ok(Live {
            entries,
            finish: Some(finish),
            done: Some(done),
            errors,
        })
    }

    /// The sender the engine hands each entry to (it never blocks).
    pub(crate) fn entries(&self) -> mpsc::UnboundedSender<Entry> {
        self.entries.clone()
    }

    /// Hands one entry over (the engine holds [`Live::entries`] instead).
    #[cfg(test)]
    pub(crate) fn entry(&self, entry: Entry) {
        let _ = self.entries.send(entry);
    }

    /// Failed calls so far, for `memtrack_export_errors_total`.
    pub(crate) fn errors(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.errors)
    }

    /// Delivers what is left by `deadline` (every entry sent before this
    /// call is included) and writes the spool for the rest. Returns a
    /// little after the deadline at worst: the time to write the spool.
    pub(crate) async fn finish(mut self, end: End, deadline: Instant) -> DeliveryReport {
        let (Some(finish), Some(done)) = (self.finish.take(), self.done.take()) else {
            return DeliveryReport::default();
        };
        if finish.send((end, deadline)).is_err() {
            return DeliveryReport {
                errors: vec!["the MLflow reporter stopped early".into()],
                ..DeliveryReport::default()
            };
        }
        done.await.unwrap_or_else(|_| DeliveryReport {
            errors: vec!["the MLflow reporter stopped early".into()],
            ..DeliveryReport::default()
        })
    }
}

/// A request out, with the batch it carries (put back if it fails).
type Out = (
    Vec<Metric>,
    Pin<Box<dyn Future<Output = Result<(), MlflowError>> + Send>>,
);

/// What wakes the live loop.
enum Wake {
    Finish(Option<(End, Instant)>),
    Entry(Option<Entry>),
    Sent(Result<(), MlflowError>),
    Due,
}

/// The one owner of the queue and of what is known of the MLflow run.
struct Delivery {
    api: Api,
    /// The run, whether memtrack created it, and what else is owed: the
    /// state the spool keeps.
    header: Header,
    queue: Values,
    steps: StepTracker,
    spool: PathBuf,
    sent: usize,
    refused: usize,
    errors: Vec<String>,
    errors_total: Arc<AtomicU64>,
    backoff: Duration,
    /// The server is not answering (since this many failed tries).
    down: u64,
    down_logged: RateLimited,
    other_run_logged: bool,
}

impl Delivery {
    fn new(
        api: Api,
        header: Header,
        queue: Values,
        spool: PathBuf,
        errors_total: Arc<AtomicU64>,
    ) -> Delivery {
        Delivery {
            api,
            header,
            queue,
            steps: StepTracker::default(),
            spool,
            sent: 0,
            refused: 0,
            errors: Vec::new(),
            errors_total,
            backoff: BACKOFF_MIN,
            down: 0,
            down_logged: RateLimited::default(),
            other_run_logged: false,
        }
    }

    /// The loop while the job runs, then the end.
    async fn live(
        mut self,
        mut entries: mpsc::UnboundedReceiver<Entry>,
        mut finish: oneshot::Receiver<(End, Instant)>,
    ) -> DeliveryReport {
        let mut out: Option<Out> = None;
        let mut open = true;
        let mut last_send = Instant::now();
        let mut retry_at: Option<Instant> = None;
        let ending = loop {
            let now = Instant::now();
            if out.is_none() && !self.queue.is_empty() {
                if let Some(run) = self.header.run_id.clone() {
                    let due = match retry_at {
                        Some(t) => now >= t,
                        None => self.queue.len() >= BATCH || now >= last_send + LIVE_EVERY,
                    };
                    if due {
                        retry_at = None;
                        last_send = now;
                        let batch = self.queue.take_settled(BATCH, now_ms() - SETTLE_MS);
                        if !batch.is_empty() {
                            let api = self.api.clone();
                            let body = batch.clone();
                            out = Some((
                                batch,
                                Box::pin(async move { api.log_batch(&run, &body).await }),
                            ));
                        }
                    }
                }
            }
            let wake = (out.is_none() && !self.queue.is_empty() && self.header.run_id.is_some())
                .then(|| retry_at.unwrap_or(last_send + LIVE_EVERY));
            let event = tokio::select! {
                f = &mut finish => Wake::Finish(f.ok()),
                e = entries.recv(), if open => Wake::Entry(e),
                r = poll_out(&mut out), if out.is_some() => Wake::Sent(r),
                () = sleep_until(wake), if wake.is_some() => Wake::Due,
            };
            match event {
                Wake::Finish(f) => break f,
                Wake::Entry(Some(e)) => self.take(&e),
                Wake::Entry(None) => open = false,
                Wake::Sent(result) => {
                    let Some((batch, _)) = out.take() else {
                        continue;
                    };
                    if let Some(wait) = self.settle(batch, result) {
                        retry_at = Some(Instant::now() + wait);
                    }
                }
                Wake::Due => {}
            }
        };
        let Some((end, deadline)) = ending else {
            return DeliveryReport::default();
        };
        // The batch out finishes (or goes back) first, keeping the order.
        if let Some((batch, fut)) = out.take() {
            match tokio::time::timeout_at(deadline, fut).await {
                Ok(result) => {
                    self.settle(batch, result);
                }
                Err(_) => self.queue.put_back(batch),
            }
        }
        let sent_live = self.sent;
        // Every entry the engine recorded is in the channel by now.
        while let Ok(e) = entries.try_recv() {
            self.take(&e);
        }
        self.queue.push(self.steps.peaks(end.peaks.0, end.peaks.1));
        self.header.artifacts = end.document.is_some();
        let mut report = self.deliver(&end, deadline).await;
        report.sent_live = sent_live;
        report
    }

    /// One entry: the run it announces, and its values.
    fn take(&mut self, e: &Entry) {
        if e.component == ANNOUNCE.0 && e.operation == ANNOUNCE.1 {
            if let Some(id) = e.labels.get("run_id").filter(|id| !id.is_empty()) {
                self.adopt(id);
            }
        }
        self.queue.push_entry(&mut self.steps, e);
    }

    /// The job announced its run: the values go there, unless memtrack
    /// already reports into one.
    fn adopt(&mut self, id: &str) {
        match &self.header.run_id {
            None if spool::plain_id(id) => {
                tracing::info!("MLflow: memory values go live into the job's run {id}");
                self.header.run_id = Some(id.to_string());
            }
            None => {
                if !self.other_run_logged {
                    self.other_run_logged = true;
                    tracing::warn!("MLflow: the job announced a run id that is not one; ignored");
                }
            }
            Some(run) if run != id && !self.other_run_logged => {
                self.other_run_logged = true;
                tracing::warn!(
                    "MLflow: the job announced run {id}, but memtrack already reports into run \
                     {run}; its values stay there"
                );
            }
            Some(_) => {}
        }
    }

    /// A request's result: counted, or the batch back in front for
    /// another try after the returned wait.
    fn settle(&mut self, batch: Vec<Metric>, result: Result<(), MlflowError>) -> Option<Duration> {
        match result {
            Ok(()) => {
                self.sent += batch.len();
                self.backoff = BACKOFF_MIN;
                if self.down > 0 {
                    tracing::info!("MLflow: the server answers again; sending the values kept");
                    self.down = 0;
                }
                None
            }
            Err(e) if e.is_transient() => {
                self.errors_total.fetch_add(1, Ordering::Relaxed);
                self.down += 1;
                self.queue.put_back(batch);
                let wait = self.backoff;
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                if let Some(n) = self.down_logged.hit() {
                    tracing::warn!(
                        "MLflow: {e} ({n} failed tries so far); {} values wait, trying again \
                         in {}",
                        self.queue.len(),
                        humantime::format_duration(wait)
                    );
                }
                Some(wait)
            }
            Err(e) => {
                self.errors_total.fetch_add(1, Ordering::Relaxed);
                self.refused += batch.len();
                tracing::error!("MLflow: {} values refused: {e}", batch.len());
                self.errors.push(e.to_string());
                None
            }
        }
    }

    /// Runs `call` until it succeeds, is refused, fails [`END_TRIES`]
    /// times in a row, or `deadline` passes ([`MlflowError::Deadline`]).
    /// An error that [`MlflowError::is_transient`] is worth a later try.
    async fn attempt<T, Fut>(
        deadline: Instant,
        backoff: &mut Duration,
        errors_total: &AtomicU64,
        mut call: impl FnMut() -> Fut,
    ) -> Result<T, MlflowError>
    where
        Fut: Future<Output = Result<T, MlflowError>>,
    {
        let mut tries = 0;
        loop {
            let result = tokio::time::timeout_at(deadline, call())
                .await
                .map_err(|_| MlflowError::Deadline)?;
            match result {
                Ok(v) => {
                    *backoff = BACKOFF_MIN;
                    return Ok(v);
                }
                Err(e) => {
                    errors_total.fetch_add(1, Ordering::Relaxed);
                    tries += 1;
                    let wait = *backoff;
                    if !e.is_transient() || tries >= END_TRIES || Instant::now() + wait >= deadline
                    {
                        return Err(e);
                    }
                    *backoff = (*backoff * 2).min(BACKOFF_MAX);
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Finds or creates the run when none is known yet.
    async fn ensure_run(&mut self, failed: bool, deadline: Instant) -> Result<String, MlflowError> {
        if let Some(id) = &self.header.run_id {
            return Ok(id.clone());
        }
        let api = &self.api;
        let experiment = match self.header.experiment() {
            Some(Experiment::Name(name)) => {
                Self::attempt(deadline, &mut self.backoff, &self.errors_total, || {
                    api.experiment_named(&name)
                })
                .await?
            }
            Some(Experiment::Id(id)) => id,
            None => "0".to_string(),
        };
        let (name, memtrack_run) = (&self.header.run_name, &self.header.memtrack_run);
        let id = Self::attempt(deadline, &mut self.backoff, &self.errors_total, || {
            api.create_run(&experiment, name, memtrack_run)
        })
        .await?;
        tracing::info!("MLflow: created run {id} in experiment {experiment}");
        self.header.run_id = Some(id.clone());
        self.header.created = true;
        self.header.end = Some(if failed { "FAILED" } else { "FINISHED" }.into());
        Ok(id)
    }

    /// Delivers everything owed by `deadline`, then keeps the rest in
    /// the spool file (or removes it when nothing is owed).
    async fn deliver(mut self, end: &End, deadline: Instant) -> DeliveryReport {
        let mut report = DeliveryReport::default();
        // The end tries afresh, whatever the outage before it backed off to.
        self.backoff = BACKOFF_MIN;
        let reached = match self.ensure_run(end.failed, deadline).await {
            Ok(run) => self.send_all(&run, deadline).await,
            Err(e) => {
                self.errors.push(e.to_string());
                false
            }
        };
        if reached && self.header.artifacts {
            self.attach(end, deadline, &mut report).await;
        }
        if reached && self.header.created {
            if let (Some(status), Some(run)) = (self.header.end.clone(), self.header.run_id.clone())
            {
                let api = &self.api;
                let failed = status == "FAILED";
                match Self::attempt(deadline, &mut self.backoff, &self.errors_total, || {
                    api.end_run(&run, failed)
                })
                .await
                {
                    Ok(()) => self.header.end = None,
                    Err(e) => self.errors.push(e.to_string()),
                }
            }
        }
        report.run_id.clone_from(&self.header.run_id);
        report.sent = self.sent;
        report.refused = self.refused;
        report.dropped = self.queue.dropped;
        report.unsent = self.queue.len();
        if self.header.artifacts {
            report.owed.push("the artifacts");
        }
        if self.header.end.is_some() {
            report.owed.push("the run's end");
        }
        if self.header.run_id.is_none() {
            report.owed.push("the run");
        }
        if report.unsent > 0 || !report.owed.is_empty() {
            match spool::write(&self.spool, &self.header, self.queue.iter()) {
                Ok(()) => report.spool = Some(self.spool.clone()),
                Err(e) => report.spool_error = Some(format!("{}: {e}", self.spool.display())),
            }
        } else {
            match std::fs::remove_file(&self.spool) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => report.spool_error = Some(format!("{}: {e}", self.spool.display())),
            }
        }
        report.errors = self.errors;
        report
    }

    /// Sends every value waiting into `run`, one batch at a time. False
    /// when the server stopped answering (the rest waits in the queue).
    async fn send_all(&mut self, run: &str, deadline: Instant) -> bool {
        while !self.queue.is_empty() {
            let batch = self.queue.take(BATCH);
            let api = &self.api;
            let result = Self::attempt(deadline, &mut self.backoff, &self.errors_total, || {
                api.log_batch(run, &batch)
            })
            .await;
            match result {
                Ok(()) => self.sent += batch.len(),
                Err(e) if !e.is_transient() => {
                    self.refused += batch.len();
                    self.errors.push(e.to_string());
                }
                Err(e) => {
                    self.queue.put_back(batch);
                    self.errors.push(e.to_string());
                    return false;
                }
            }
        }
        true
    }

    /// `memory_usage.json` and the report page into the run's artifacts.
    async fn attach(&mut self, end: &End, deadline: Instant, report: &mut DeliveryReport) {
        let (Some(document), Some(run)) = (&end.document, self.header.run_id.clone()) else {
            self.header.artifacts = false;
            self.errors
                .push("memory_usage.json is not there to attach".into());
            return;
        };
        let api = &self.api;
        let place = Self::attempt(deadline, &mut self.backoff, &self.errors_total, || {
            api.artifact_path(&run)
        })
        .await;
        let dir = match place {
            Ok(Ok(dir)) => dir,
            Ok(Err(not_proxied)) => {
                report.artifact_skipped = Some(not_proxied.to_string());
                self.header.artifacts = false;
                return;
            }
            Err(e) => {
                self.header.artifacts = e.is_transient();
                self.errors.push(e.to_string());
                return;
            }
        };
        let body = match std::fs::read(document) {
            Ok(b) => b,
            Err(e) => {
                self.header.artifacts = false;
                self.errors
                    .push(format!("cannot read {}: {e}", document.display()));
                return;
            }
        };
        let name = crate::model::json::FILE_NAME;
        if let Err(e) = Self::attempt(deadline, &mut self.backoff, &self.errors_total, || {
            api.put_artifact(&dir, name, body.clone())
        })
        .await
        {
            self.header.artifacts = e.is_transient();
            self.errors.push(e.to_string());
            return;
        }
        self.header.artifacts = false;
        if let Some(page) = &end.page {
            let name = page
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("memory_report.html");
            let put = match std::fs::read(page) {
                Ok(body) => Self::attempt(deadline, &mut self.backoff, &self.errors_total, || {
                    api.put_artifact(&dir, name, body.clone())
                })
                .await
                .map_err(|e| e.to_string()),
                Err(e) => Err(format!("{}: {e}", page.display())),
            };
            report.page_skipped = put.err();
        }
    }
}

async fn poll_out(out: &mut Option<Out>) -> Result<(), MlflowError> {
    match out {
        Some((_, fut)) => fut.as_mut().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Why `memtrack mlflow-resend` could not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResendError {
    #[error(transparent)]
    Spool(#[from] SpoolError),
    #[error(transparent)]
    Mlflow(#[from] MlflowError),
    #[error(
        "no tracking server: set MLFLOW_TRACKING_URI or mlflow.tracking_uri (the spool names none)"
    )]
    NoServer,
}

/// Sends what an ended run left in `run_dir`'s spool file: the values, the
/// artifacts and the end of a run memtrack created, whichever are owed,
/// into the run the spool names. `settings` (memtrack's configuration and
/// environment) give the tracking server, else the spool's own. `None`
/// when the run directory holds no spool.
pub(crate) async fn resend(
    settings: Option<&Settings>,
    run_dir: &Path,
    deadline: Instant,
) -> Result<Option<DeliveryReport>, ResendError> {
    let path = run_dir.join(SPOOL_FILE);
    let Some(spooled) = spool::read(&path)? else {
        return Ok(None);
    };
    let (uri, timeout) = match settings {
        Some(s) => (s.uri.clone(), s.request_timeout),
        None if !spooled.header.tracking_uri.is_empty() => (
            spooled.header.tracking_uri.clone(),
            super::settings::MlflowConfig::default().request_timeout,
        ),
        None => return Err(ResendError::NoServer),
    };
    let api = Api::new(&uri, timeout)?;
    let mut header = spooled.header;
    if header.run_id.is_none() {
        header.run_id = settings.and_then(|s| s.run_id.clone());
    }
    let failed = header.end.as_deref() == Some("FAILED");
    let document = run_dir.join(crate::model::json::FILE_NAME);
    let page = run_dir.join("memory_report.html");
    let end = End {
        document: document.is_file().then_some(document),
        page: page.is_file().then_some(page),
        peaks: (0.0, 0.0),
        failed,
    };
    let delivery = Delivery::new(
        api,
        header,
        Values::holding(spooled.values),
        path,
        Arc::new(AtomicU64::new(0)),
    );
    Ok(Some(delivery.deliver(&end, deadline).await))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Figures;

    fn closed_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn settings(uri: String, run_id: Option<&str>) -> Settings {
        Settings {
            uri,
            run_id: run_id.map(str::to_string),
            experiment: Experiment::Name("team".into()),
            request_timeout: Duration::from_secs(5),
        }
    }

    fn entry(iteration: Option<u64>, mb: f64) -> Entry {
        Entry {
            component: "train".into(),
            operation: "step".into(),
            iteration,
            figures: Figures {
                cpu_ram_used_mb: mb,
                ..Figures::default()
            },
            timestamp: 1_700_000_000.0 + mb,
            ..Default::default()
        }
    }

    /// A server that is not there: the job's values, the peaks, the
    /// artifacts and the run's creation all wait in the spool, in order,
    /// and the engine's side never waited.
    #[tokio::test]
    async fn an_absent_server_leaves_everything_in_the_spool() {
        let dir = tempfile::tempdir().unwrap();
        let uri = format!("http://u:secret@127.0.0.1:{}", closed_port());
        let live = Live::start(&settings(uri, None), "r", "m1", dir.path()).unwrap();
        for i in 0..5 {
            live.entry(entry(Some(i), i as f64));
        }
        let document = dir.path().join("memory_usage.json");
        std::fs::write(&document, "{}").unwrap();
        let end = End {
            document: Some(document),
            page: None,
            peaks: (4.0, 0.0),
            failed: true,
        };
        let report = live
            .finish(end, Instant::now() + Duration::from_secs(30))
            .await;
        assert_eq!((report.sent, report.unsent), (0, 5 * 3 + 2), "{report:?}");
        assert_eq!(report.owed, vec!["the artifacts", "the run"]);
        let back = spool::read(&dir.path().join(SPOOL_FILE)).unwrap().unwrap();
        assert_eq!(back.header.run_id, None);
        assert_eq!(back.header.experiment_name.as_deref(), Some("team"));
        assert!(back.header.artifacts);
        assert!(!back.header.tracking_uri.contains("secret"));
        let steps: Vec<i64> = back
            .values
            .iter()
            .filter(|m| m.key == super::super::values::HOST)
            .map(|m| m.step)
            .collect();
        assert_eq!(steps, vec![0, 1, 2, 3, 4]);
        assert_eq!(back.values.last().unwrap().key, "memtrack/peak_gpu_mb");
    }

    /// The job's announcement names the run; a later one of another run
    /// does not move the values, and a run id that is no id is ignored.
    #[tokio::test]
    async fn the_first_announced_run_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let uri = format!("http://127.0.0.1:{}", closed_port());
        let live = Live::start(&settings(uri, None), "r", "m1", dir.path()).unwrap();
        let announce = |id: &str| {
            let mut e = entry(None, 1.0);
            e.component = ANNOUNCE.0.into();
            e.operation = ANNOUNCE.1.into();
            e.labels.insert("run_id".into(), id.into());
            e
        };
        live.entry(announce("../x?y"));
        live.entry(announce("abc123"));
        live.entry(announce("def456"));
        let end = End {
            document: None,
            page: None,
            peaks: (1.0, 0.0),
            failed: false,
        };
        // No time at all: nothing waits on the network.
        let report = live.finish(end, Instant::now()).await;
        assert_eq!(report.run_id.as_deref(), Some("abc123"));
        let back = spool::read(&dir.path().join(SPOOL_FILE)).unwrap().unwrap();
        assert_eq!(back.header.run_id.as_deref(), Some("abc123"));
        assert!(!back.header.created && back.header.end.is_none());
        assert_eq!(back.values.len(), 3 * 3 + 2);
    }
}
