//! Log entries as MLflow metric values on the job's step axis, and the
//! bounded queue they wait in for the server.
//!
//! A value's `step` is the entry's iteration; a timer sample, which has
//! none, takes the iteration of the last mark before it in time, looked up
//! among the latest marks ([`StepTracker`], over
//! [`Reached`](crate::export::reached::Reached)): a sample whose reading
//! overlapped a mark reaches the output after it. Marks the
//! job held back and sent together (steps less than 10 ms apart) arrive
//! after a timer sample taken meanwhile, though they came before it: a
//! timer value still waiting in the queue takes such a mark's iteration
//! when the mark is the latest before it ([`Values::push_entry`]), so the
//! values agree with the order of the run's log. While the run goes on a
//! value is sent only once it is [`SETTLE_MS`] old
//! ([`Values::take_settled`]): the job sends held steps at most 200 ms
//! after the first of them, and at its next message of any other kind. Its timestamp is the
//! entry's. The queue holds at most a fixed number of values: while the
//! server is away (or the run is not known yet) the oldest are dropped,
//! counted, and said, so a long outage costs the oldest values, never
//! memtrack's memory.

use std::collections::VecDeque;

use super::api::Metric;
use crate::export::reached::{self, Mark, Reached};
use crate::logging::RateLimited;
use crate::model::Entry;

/// How old a value must be before it is sent while the run goes on, in
/// milliseconds: ten times the longest the job holds a step back while
/// steps keep coming.
pub(crate) const SETTLE_MS: i64 = 500;

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

/// Turns entries into values, following the job's iteration: an entry
/// without one takes the iteration of the latest mark before it in time,
/// as the run's log orders them, whatever order they arrive in.
#[derive(Debug, Default)]
pub(crate) struct StepTracker {
    marks: Reached,
    last_ms: i64,
}

impl StepTracker {
    /// The entry's three values (host, GPU, GPU reserved).
    #[cfg(test)]
    pub(crate) fn values(&mut self, e: &Entry) -> [Metric; 3] {
        self.tagged(e).0
    }

    /// An entry's time in microseconds.
    fn micros(e: &Entry) -> i64 {
        reached::micros(e.timestamp)
    }

    /// A mark's step and time (µs); before any mark, step 0 from the
    /// beginning of time.
    fn step_of(mark: Option<Mark>) -> (i64, i64) {
        mark.map_or((0, i64::MIN), |m| {
            (i64::try_from(m.iteration).unwrap_or(i64::MAX), m.at_us)
        })
    }

    /// The latest iteration, and its mark's time (µs).
    fn latest(&self) -> (i64, i64) {
        Self::step_of(self.marks.latest())
    }

    /// The entry's three values (host, GPU, GPU reserved), and for an
    /// entry without an iteration the time (µs) of the mark its step came
    /// from.
    fn tagged(&mut self, e: &Entry) -> ([Metric; 3], Option<i64>) {
        let timestamp = (e.timestamp * 1000.0) as i64;
        let us = Self::micros(e);
        let (step, from) = match e.iteration {
            Some(i) => {
                self.marks.keep(us, i);
                (i64::try_from(i).unwrap_or(i64::MAX), None)
            }
            None => {
                // The latest mark strictly before: an entry of a mark's
                // very instant comes before it in the run's log.
                let (step, from) = Self::step_of(self.marks.latest_before(us));
                (step, Some(from))
            }
        };
        self.last_ms = self.last_ms.max(timestamp);
        let at = |key, value| Metric {
            key,
            value,
            timestamp,
            step,
        };
        let values = [
            at(SAMPLE_KEYS[0], e.figures.cpu_ram_used_mb),
            at(SAMPLE_KEYS[1], e.figures.gpu_ram_used_mb),
            at(SAMPLE_KEYS[2], e.figures.reserved_gpu_ram_mb),
        ];
        (values, from)
    }

    /// The run's peaks (host, GPU), at the last step and time seen.
    pub(crate) fn peaks(&self, host: f64, gpu: f64) -> [Metric; 2] {
        [
            Metric {
                key: PEAK_KEYS[0],
                value: host,
                timestamp: self.last_ms,
                step: self.latest().0,
            },
            Metric {
                key: PEAK_KEYS[1],
                value: gpu,
                timestamp: self.last_ms,
                step: self.latest().0,
            },
        ]
    }
}

/// A value waiting, and for a timer sample's the time of the mark its step
/// came from.
#[derive(Debug, Clone)]
struct Queued {
    metric: Metric,
    from: Option<i64>,
    /// The entry's time (µs).
    at: i64,
}

impl Queued {
    /// A value whose step is settled: from a file, or one that went out.
    fn settled(metric: Metric) -> Queued {
        Queued {
            at: metric.timestamp.saturating_mul(1000),
            metric,
            from: None,
        }
    }
}

/// The values waiting for the server, oldest first, at most `max` (plus
/// the one batch that was out and came back).
#[derive(Debug)]
pub(crate) struct Values {
    queue: VecDeque<Queued>,
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
        v.queue.extend(values.into_iter().map(Queued::settled));
        v
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// An entry's values, on the job's step axis. A mark that came before
    /// timer samples still waiting (held back by the job, it arrived after
    /// them) gives them its iteration when it is the latest mark before
    /// them; values already sent keep theirs.
    pub(crate) fn push_entry(&mut self, steps: &mut StepTracker, e: &Entry) {
        let (values, from) = steps.tagged(e);
        let at = StepTracker::micros(e);
        if from.is_none() {
            let step = values[0].step;
            // Entries without an iteration are queued in time order: back
            // from the newest until one from before the mark, or from its
            // very instant (which the run's log puts before it).
            for q in self.queue.iter_mut().rev() {
                let Some(used) = q.from else {
                    continue;
                };
                if q.at <= at {
                    break;
                }
                if at > used {
                    (q.metric.step, q.from) = (step, Some(at));
                }
            }
        }
        self.push_tagged(values, from, at);
    }

    /// Appends values; a full queue drops its oldest, says so (at a
    /// limited rate) and counts them.
    pub(crate) fn push(&mut self, values: impl IntoIterator<Item = Metric>) {
        for metric in values {
            let at = metric.timestamp.saturating_mul(1000);
            self.push_tagged([metric], None, at);
        }
    }

    fn push_tagged(
        &mut self,
        values: impl IntoIterator<Item = Metric>,
        from: Option<i64>,
        at: i64,
    ) {
        for metric in values {
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
            self.queue.push_back(Queued { metric, from, at });
        }
    }

    /// Takes up to `n` values from the front whose time is at most
    /// `settled` (milliseconds since the epoch), for one request while the
    /// run goes on: a value younger than that may still take the step of a
    /// mark the job held back, so it waits for the next request.
    pub(crate) fn take_settled(&mut self, n: usize, settled: i64) -> Vec<Metric> {
        let k = self
            .queue
            .iter()
            .take(n)
            .take_while(|q| q.metric.timestamp <= settled)
            .count();
        self.queue.drain(..k).map(|q| q.metric).collect()
    }

    /// Takes up to `n` values from the front, for one request.
    pub(crate) fn take(&mut self, n: usize) -> Vec<Metric> {
        let k = n.min(self.queue.len());
        self.queue.drain(..k).map(|q| q.metric).collect()
    }

    /// A batch that did not go out returns to the front, in its order.
    /// Nothing is dropped for it: it was counted while it was out.
    pub(crate) fn put_back(&mut self, batch: Vec<Metric>) {
        // Sent or not, their steps stay as they went out.
        for metric in batch.into_iter().rev() {
            self.queue.push_front(Queued::settled(metric));
        }
    }

    /// Everything waiting, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Metric> {
        self.queue.iter().map(|q| &q.metric)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::reached::MARKS_KEPT;
    use crate::model::Figures;

    fn entry(iteration: Option<u64>, mb: f64, t: f64) -> Entry {
        Entry {
            component: "train".into(),
            operation: "timer".into(),
            iteration,
            figures: Figures {
                cpu_ram_used_mb: mb,
                ..Figures::default()
            },
            timestamp: t,
            ..Default::default()
        }
    }

    #[test]
    fn timer_samples_take_the_last_iteration() {
        let mut steps = StepTracker::default();
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

    /// The host values waiting, as (timestamp ms, step).
    fn host(q: &Values) -> Vec<(i64, i64)> {
        q.iter()
            .filter(|m| m.key == HOST)
            .map(|m| (m.timestamp, m.step))
            .collect()
    }

    /// Steps 3 and 4 held back by the job arrive after a timer sample
    /// taken at 12 s: the waiting sample takes step 4 (the latest mark
    /// before it), as the run's log orders them; a mark from before an
    /// earlier one leaves it alone, and a sample already taken out keeps
    /// the step it went with.
    #[test]
    fn a_held_mark_gives_a_waiting_timer_sample_its_step() {
        let mut q = Values::new(100);
        let mut steps = StepTracker::default();
        q.push_entry(&mut steps, &entry(Some(2), 1.0, 10.0));
        q.push_entry(&mut steps, &entry(None, 2.0, 12.0));
        q.push_entry(&mut steps, &entry(Some(3), 3.0, 11.0));
        q.push_entry(&mut steps, &entry(Some(4), 4.0, 11.5));
        q.push_entry(&mut steps, &entry(Some(1), 5.0, 10.5));
        assert_eq!(
            host(&q),
            vec![
                (10_000, 2),
                (12_000, 4),
                (11_000, 3),
                (11_500, 4),
                (10_500, 1)
            ]
        );
        // A later timer sample follows the latest mark in time (4).
        q.push_entry(&mut steps, &entry(None, 6.0, 13.0));
        assert_eq!(host(&q).last(), Some(&(13_000, 4)));
        // Sent, then a mark held from before it: the sent value keeps its step.
        let sent = q.take(100);
        q.put_back(sent);
        q.push_entry(&mut steps, &entry(Some(9), 7.0, 12.5));
        assert_eq!(host(&q)[5], (13_000, 4));
    }

    /// A stage mark and the next step's begin in the same millisecond:
    /// the stage mark came first, so it keeps the step before.
    #[test]
    fn an_entry_just_before_a_mark_of_the_same_millisecond_keeps_its_step() {
        let mut q = Values::new(100);
        let mut steps = StepTracker::default();
        q.push_entry(&mut steps, &entry(Some(10), 1.0, 10.0));
        q.push_entry(&mut steps, &entry(None, 2.0, 11.0552));
        q.push_entry(&mut steps, &entry(Some(11), 2.0, 11.0558));
        assert_eq!(host(&q), vec![(10_000, 10), (11_055, 10), (11_055, 11)]);
    }

    /// What once went wrong under load: a timer sample whose reading
    /// overlapped the next step's mark reached the output after the mark,
    /// and went out with the mark's step though the run's log puts it
    /// before the mark.
    #[test]
    fn a_sample_that_arrives_after_a_later_mark_keeps_the_step_before_it() {
        let mut steps = StepTracker::default();
        let step = |steps: &mut StepTracker, it, t| steps.values(&entry(it, 1.0, t))[0].step;
        assert_eq!(step(&mut steps, Some(3), 10.0), 3);
        assert_eq!(step(&mut steps, Some(4), 11.0), 4);
        assert_eq!(step(&mut steps, None, 10.9), 3);
        assert_eq!(step(&mut steps, None, 11.0), 3, "the mark's own instant");
        assert_eq!(step(&mut steps, None, 11.1), 4);
        assert_eq!(step(&mut steps, None, 9.0), 0, "before any mark");
        // Far more marks than are kept: an entry older than all of them
        // takes the step before the oldest kept.
        for i in 0..(MARKS_KEPT as u64 + 10) {
            step(&mut steps, Some(100 + i), 20.0 + i as f64);
        }
        assert_eq!(step(&mut steps, None, 29.5), 109);
        assert_eq!(step(&mut steps, None, 12.0), 109);
        assert_eq!(steps.peaks(1.0, 0.0)[0].step, 100 + MARKS_KEPT as i64 + 9);
    }

    #[test]
    fn only_settled_values_go_while_the_run_goes_on() {
        let mut steps = StepTracker::default();
        let mut q = Values::new(100);
        q.push_entry(&mut steps, &entry(None, 100.0, 10.0));
        q.push_entry(&mut steps, &entry(None, 110.0, 10.4));
        // At 10.55 s, with 500 ms to settle: only the first is old enough.
        let batch = q.take_settled(1000, 10_550 - SETTLE_MS);
        assert_eq!(
            batch.iter().map(|m| m.timestamp).collect::<Vec<_>>(),
            [10_000; 3]
        );
        // A step the job held back, from before the second sample, still
        // gives it its iteration.
        q.push_entry(&mut steps, &entry(Some(4), 105.0, 10.2));
        let rest = q.take_settled(1000, 11_000 - SETTLE_MS);
        let second: Vec<_> = rest.iter().filter(|m| m.timestamp == 10_400).collect();
        assert!(
            !second.is_empty() && second.iter().all(|m| m.step == 4),
            "{rest:?}"
        );
    }

    #[test]
    fn a_full_queue_drops_the_oldest_and_counts_them() {
        let mut q = Values::new(4);
        let mut steps = StepTracker::default();
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
