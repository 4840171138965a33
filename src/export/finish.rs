//! One deadline for everything a run does after its job has ended.
//!
//! The upload and ClearML's last points go over the network; a server that
//! accepts connections and never answers would otherwise hold the end of
//! the run for the SDKs' retries (minutes), silently, while a CI job or a
//! SLURM allocation pays for it. Every step of the end runs under one
//! [`Deadline`] (`finish_timeout`): a step still waited on after
//! [`PROGRESS_AFTER`] says so in one line, and a step the deadline cuts
//! short is given up — its caller prints the command that finishes later.

use std::future::Future;
use std::time::{Duration, Instant};

/// How long a step runs before the wait is announced.
pub(crate) const PROGRESS_AFTER: Duration = Duration::from_secs(2);

/// The time left for the end of a run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    start: Instant,
    limit: Duration,
}

impl Deadline {
    /// Starts the clock now.
    pub(crate) fn start(limit: Duration) -> Deadline {
        Deadline {
            start: Instant::now(),
            limit,
        }
    }

    /// The whole allowance (`finish_timeout`).
    pub(crate) fn limit(&self) -> Duration {
        self.limit
    }

    pub(crate) fn remaining(&self) -> Duration {
        self.limit.saturating_sub(self.start.elapsed())
    }

    #[cfg(test)]
    pub(crate) fn expired(&self) -> bool {
        self.remaining().is_zero()
    }

    /// Runs `work` until it ends (`Some`) or the deadline passes (`None`,
    /// `work` dropped). A wait longer than [`PROGRESS_AFTER`] is announced
    /// once, naming `what` and the time left.
    pub(crate) async fn bound<F: Future>(&self, what: &str, work: F) -> Option<F::Output> {
        let work = self.announce(what, work);
        tokio::time::timeout(self.remaining(), work).await.ok()
    }

    /// Runs `work` to its end (it bounds itself, e.g. by a timeout taken
    /// from [`Deadline::remaining`]), announcing a long wait as
    /// [`Deadline::bound`] does.
    pub(crate) async fn announce<F: Future>(&self, what: &str, work: F) -> F::Output {
        tokio::pin!(work);
        tokio::select! {
            out = &mut work => return out,
            _ = tokio::time::sleep(PROGRESS_AFTER) => {}
        }
        let left = self.remaining();
        if !left.is_zero() {
            tracing::info!(
                "waiting for {what}: giving up in {} (finish_timeout)",
                crate::units::format_duration(Duration::from_secs(left.as_secs().max(1)))
            );
        }
        work.await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    #[test]
    fn work_that_never_ends_is_cut_at_the_deadline() {
        runtime().block_on(async {
            let d = Deadline::start(Duration::from_millis(200));
            let never = std::future::pending::<()>();
            assert_eq!(d.bound("a server that never answers", never).await, None);
            assert!(d.expired());
            // Nothing left: the next step ends at once too.
            let out = d.bound("the next step", std::future::pending::<()>()).await;
            assert_eq!(out, None);
        });
    }

    #[test]
    fn work_that_ends_keeps_its_result() {
        runtime().block_on(async {
            let d = Deadline::start(Duration::from_secs(60));
            let out = d
                .bound("a slow upload", async {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    7
                })
                .await;
            assert_eq!(out, Some(7));
            assert!(!d.expired());
            assert_eq!(d.announce("quick", async { 8 }).await, 8);
        });
    }
}
