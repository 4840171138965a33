//! Log entries as MLflow metric values on the job's step axis, and the
//! bounded queue they wait in for the server.
//!
//! A value's `step` is the entry's iteration; a timer sample, which has
//! none, takes the last iteration seen before it. Its timestamp is the
//! entry's. The queue holds at most a fixed number of values: while the
//! server is away (or the run is not known yet) the oldest are dropped,
//! counted, and said, so a long outage costs the oldest values, never
//! memtrack's memory.

use std::collections::VecDeque;

use super::api::Metric;
use crate::logging::RateLimited;
use crate::model::Entry;

/// The host figure's metric.
pub(crate) const HOST: &str = "memtrack/host_mb";
/// The metrics of one entry, in the order they are made.
pub(crate) const SAMPLE_KEYS: [&str; 3] = [HOST, "memtrack/gpu_mb", "memtrack/gpu_reserved_mb"];
/// The run's peaks, logged once at the end.
pub(crate) const PEAK_KEYS: [&str; 2] = ["memtrack/peak_host_mb", "memtrack/peak_gpu_mb"];

/// The `&'static` name of a metric memtrack logs, for a name read back
/// from a file; `None` for any other name.
pub(crate) fn known_key(name: &str) -> Option<&'static str> {
    SAMPLE_KEYS
        .iter()
        .chain(PEAK_KEYS.iter())
        .find(|k| **k == name)
        .copied()
}

/// Turns entries into values, following the job's iteration.
#[derive(Debug, Default)]
pub(crate) struct Steps {
    step: i64,
    last_ms: i64,
}

impl Steps {
    /// The entry's three values (host, GPU, GPU reserved).
    pub(crate) fn values(&mut self, e: &Entry) -> [Metric; 3] {
        if let Some(i) = e.iteration {
            self.step = i64::try_from(i).unwrap_or(i64::MAX);
        }
        let timestamp = (e.timestamp * 1000.0) as i64;
        self.last_ms = self.last_ms.max(timestamp);
        let at = |key, value| Metric {
            key,
            value,
            timestamp,
            step: self.step,
        };
        [
            at(SAMPLE_KEYS[0], e.cpu_ram_used_mb),
            at(SAMPLE_KEYS[1], e.gpu_ram_used_mb),
            at(SAMPLE_KEYS[2], e.reserved_gpu_ram_mb),
        ]
    }

    /// The run's peaks (host, GPU), at the last step and time seen.
    pub(crate) fn peaks(&self, host: f64, gpu: f64) -> [Metric; 2] {
        [
            Metric {
                key: PEAK_KEYS[0],
                value: host,
                timestamp: self.last_ms,
                step: self.step,
            },
            Metric {
                key: PEAK_KEYS[1],
                value: gpu,
                timestamp: self.last_ms,
                step: self.step,
            },
        ]
    }
}

/// The values waiting for the server, oldest first, at most `max` (plus
/// the one batch that was out and came back).
#[derive(Debug)]
pub(crate) struct Values {
    queue: VecDeque<Metric>,
    max: usize,
    /// Values dropped because the queue was full.
    pub(crate) dropped: u64,
    dropped_logged: RateLimited,
}

impl Values {
    pub(crate) fn new(max: usize) -> Values {
        Values {
            queue: VecDeque::new(),
            max: max.max(1),
            dropped: 0,
            dropped_logged: RateLimited::default(),
        }
    }

    /// A queue holding `values` whatever their number (a resend's file,
    /// already bounded by its size).
    pub(crate) fn holding(values: Vec<Metric>) -> Values {
        let mut v = Values::new(values.len());
        v.queue.extend(values);
        v
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Appends values; a full queue drops its oldest, says so (at a
    /// limited rate) and counts them.
    pub(crate) fn push(&mut self, values: impl IntoIterator<Item = Metric>) {
        for m in values {
            if self.queue.len() >= self.max {
                self.queue.pop_front();
                self.dropped += 1;
                if let Some(n) = self.dropped_logged.hit() {
                    tracing::warn!(
                        "MLflow: memory values dropped, the oldest first ({n} so far): the \
                         server has not taken them and memtrack keeps at most {} \
                         (memory_usage.json has them all)",
                        self.max
                    );
                }
            }
            self.queue.push_back(m);
        }
    }

    /// Takes up to `n` values from the front, for one request.
    pub(crate) fn take(&mut self, n: usize) -> Vec<Metric> {
        let k = n.min(self.queue.len());
        self.queue.drain(..k).collect()
    }

    /// A batch that did not go out returns to the front, in its order.
    /// Nothing is dropped for it: it was counted while it was out.
    pub(crate) fn put_back(&mut self, batch: Vec<Metric>) {
        for m in batch.into_iter().rev() {
            self.queue.push_front(m);
        }
    }

    /// Everything waiting, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Metric> {
        self.queue.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(iteration: Option<u64>, mb: f64, t: f64) -> Entry {
        Entry {
            component: "train".into(),
            operation: "timer".into(),
            iteration,
            cpu_ram_used_mb: mb,
            timestamp: t,
            ..Default::default()
        }
    }

    #[test]
    fn timer_samples_take_the_last_iteration() {
        let mut steps = Steps::default();
        let host: Vec<(i64, f64, i64)> = [(None, 1.0), (Some(7), 2.0), (None, 3.0)]
            .into_iter()
            .enumerate()
            .map(|(i, (it, mb))| steps.values(&entry(it, mb, 10.0 + i as f64))[0].clone())
            .map(|m| (m.step, m.value, m.timestamp))
            .collect();
        assert_eq!(
            host,
            vec![(0, 1.0, 10_000), (7, 2.0, 11_000), (7, 3.0, 12_000)]
        );
        let peaks = steps.peaks(9.0, 0.0);
        assert_eq!((peaks[0].step, peaks[0].timestamp), (7, 12_000));
    }

    #[test]
    fn a_full_queue_drops_the_oldest_and_counts_them() {
        let mut q = Values::new(4);
        let mut steps = Steps::default();
        for i in 0..3 {
            q.push(steps.values(&entry(Some(i), i as f64, 1.0)));
        }
        assert_eq!((q.len(), q.dropped), (4, 5));
        let steps_left: Vec<i64> = q.iter().map(|m| m.step).collect();
        assert_eq!(steps_left, vec![1, 2, 2, 2]);
        // A batch that failed goes back to the front, in order.
        let b = q.take(3);
        q.put_back(b);
        assert_eq!(q.iter().map(|m| m.step).collect::<Vec<_>>(), steps_left);
    }

    #[test]
    fn only_memtracks_metric_names_are_known() {
        assert_eq!(known_key("memtrack/gpu_mb"), Some("memtrack/gpu_mb"));
        assert_eq!(known_key("memtrack/peak_host_mb"), Some(PEAK_KEYS[0]));
        assert_eq!(known_key("loss"), None);
    }
}
