//! Applying a record: [`Store::apply`] hands each record to the folds it
//! concerns, all in this one file. Each fold owns its state and its
//! methods in a file of its own (`targets`, `gpu`, `host`, `alerts`,
//! `forecast`, `marks`, `spans`, `stages`, `peaks`, `samples`) and is
//! given what it needs of the others as arguments; what no single fold
//! owns (the current figures, the event log, the leak series, the
//! counters, the end of the run) is changed here.

use super::marks::entry_from;
use super::record::{Applied, Boundary, Mark, SampleKind};
use super::snapshot::Current;
use super::state::{Store, SYSTEM};
use super::Record;
use crate::model::{Entry, EntryKind, Exit, FlightWindow, GpuSource, HostSource, RunStatus};
use crate::sample::gpu::Status as GpuStatus;
use crate::sample::Sample;
use crate::units::mib;

impl Store {
    /// Applies one record: the only way state changes.
    pub fn apply(&mut self, record: &Record) -> Applied {
        self.seq += 1;
        match record {
            Record::Sample { kind, sample } => self.apply_sample(*kind, sample),
            Record::Mark(mark) => Applied {
                entry: Some(self.record_mark(mark, mark.operation.clone(), None)),
                ..Applied::default()
            },
            Record::SpanBegin(b) => self.begin_span(b),
            Record::SpanEnd(b) => self.end_span(b),
            Record::StageBegin(b) => self.begin_stage(b),
            Record::StageEnd(b) => self.end_stage(b),
            Record::Exit { pid, exit, max_rss } => {
                self.exit(*pid, *exit, *max_rss);
                Applied::default()
            }
            Record::Flight(w) => {
                self.keep_flight(w);
                Applied::default()
            }
            Record::JournalErrors { total } => {
                let c = &mut self.counters_mut().journal_errors;
                *c = (*c).max(*total);
                Applied::default()
            }
            Record::Finish { timestamp, exit } => Applied {
                entry: Some(self.finish(*timestamp, *exit)),
                ..Applied::default()
            },
        }
    }

    /// Applies one sample.
    fn apply_sample(&mut self, kind: SampleKind, sample: &Sample) -> Applied {
        if let Some(info) = &sample.host_source {
            self.host.set_source(info);
        }
        self.follow_the_tree(sample);
        let live = &self.targets.live;
        let gpu = self.gpu.tree_share(
            sample,
            |pid| live.contains_key(&pid),
            &mut self.counters.nvml_errors,
        );
        self.targets.fold_gpu(&gpu.by_process);
        self.targets.fold_readings(sample, &gpu.by_pid);
        self.gpu.fold_devices(sample, &gpu.by_device);
        self.fold_current(sample, mib(gpu.by_device.values().sum()));
        let alerts = self
            .alerts
            .crossings(sample, &self.thresholds, self.limits.max_alerts);
        let forecasts = self
            .forecasts
            .fold(sample, &self.current, self.run.memory_limit_mb);
        let entry = match kind {
            SampleKind::Timer => Some(self.timer_entry()),
            SampleKind::Event => {
                self.counters.event_samples += 1;
                None
            }
        };
        Applied {
            entry,
            alerts,
            unmatched: false,
            forecasts,
        }
    }

    /// The timer entry of the latest sample, in the innermost open span's
    /// component (or [`SYSTEM`]), kept in the thinned timer log.
    fn timer_entry(&mut self) -> Entry {
        self.counters.ticks += 1;
        let span = self.spans.innermost();
        let entry = Entry {
            component: span.map_or_else(|| SYSTEM.to_string(), |s| s.component.clone()),
            operation: "timer".into(),
            kind: EntryKind::Timer,
            span: span.map(|s| format!("{}/{}", s.component, s.operation)),
            stage: self.stages.open_stage(),
            ..entry_from(&self.current)
        };
        self.observe(&entry, 1);
        self.samples.timer.push(entry.clone());
        entry
    }

    /// Folds a sample's host figures and the tree's GPU memory (`gpu_tree`,
    /// MiB) into the current figures (and the last ones of a live tree).
    fn fold_current(&mut self, sample: &Sample, gpu_tree: f64) {
        let sampled = sample.gpu_status == GpuStatus::Sampled;
        let (used, peak, source) = match &sample.host.footprint {
            Some(f) => (f.used, f.peak.max(f.used), f.source),
            // Journals of older builds: the RSS sum, as it was then.
            None => (
                sample.host.tree_rss(),
                sample.host.tree_hwm(),
                HostSource::Rss,
            ),
        };
        let run_peak = self.peaks.run.figures.cpu_ram_used_mb;
        self.host.observe(sample, mib(used), run_peak);
        let charge = sample
            .host
            .footprint
            .as_ref()
            .and_then(|f| f.cgroup.as_ref());
        self.current = Current {
            timestamp: sample.timestamp,
            cpu_used_mb: mib(used),
            cpu_hwm_mb: mib(peak),
            charge_mb: charge.map(|r| mib(r.working_set())),
            charge_hwm_mb: charge.map(|r| {
                mib(r
                    .interval_peak_working_set()
                    .unwrap_or_else(|| r.working_set()))
            }),
            host_source: source,
            gpu_tree_mb: gpu_tree,
            gpu_tree_peak_mb: self.current.gpu_tree_peak_mb.max(gpu_tree),
            gpu_source: match (sampled, sample.gpu.device_level) {
                (true, false) => GpuSource::Nvml,
                (true, true) => GpuSource::Device,
                (false, _) => GpuSource::None,
            },
            processes: sample.host.processes.len(),
        };
        if !sample.host.processes.is_empty() {
            self.last_alive = Some(self.current.clone());
        }
    }

    /// `stage` is given for a stage's boundary only: its entry counts for
    /// the run's and the stages' peaks but makes no component of its own
    /// (no "stage" row in the peaks, no `component="stage"` in /metrics):
    /// a stage's peaks are in `stages[]`.
    fn record_mark(&mut self, mark: &Mark, operation: String, stage: Option<String>) -> Entry {
        let boundary = stage.is_some();
        let mut entry = Entry {
            component: mark.component.clone(),
            operation,
            timestamp: mark.timestamp,
            kind: mark.kind,
            pid: mark.pid,
            iteration: mark.iteration,
            labels: mark.labels.clone(),
            stage: stage.or_else(|| self.stages.open_stage()),
            ..entry_from(&self.current)
        };
        if let Some(a) = mark.allocator {
            entry.figures.gpu_ram_used_mb = mib(a.allocated);
            entry.figures.reserved_gpu_ram_mb = mib(a.reserved);
            entry.figures.gpu_ram_peak_mb = mib(a.max_allocated);
            entry.gpu_source = GpuSource::Allocator;
        }
        if mark.kind == EntryKind::Event {
            self.counters.events += 1;
            if !boundary {
                self.marks.count(
                    &entry.component,
                    &entry.operation,
                    self.limits.max_event_kinds,
                    &mut self.counters.event_kinds_folded,
                );
            }
        }
        if let (Some(a), Some(pid)) = (mark.allocator, mark.pid) {
            self.marks.note_allocator(pid, mark.timestamp, a);
        }
        if boundary {
            self.observe_outside_components(&entry, 1);
        } else {
            self.observe(&entry, 1);
        }
        self.push_event(&entry);
        entry
    }

    /// Keeps an event entry: in the log (memory or file) and in the leak
    /// rule's bounded series.
    fn push_event(&mut self, entry: &Entry) {
        self.leak.push_untimed(entry);
        if self.events.push(entry).is_err() {
            // Kept in memory and written with the next batch.
            self.counters.journal_errors += 1;
        }
    }

    /// Folds an entry into the overall, component and open-stage peaks.
    fn observe(&mut self, entry: &Entry, n: u64) {
        self.peaks.observe(
            entry,
            n,
            self.limits.max_components,
            &mut self.counters.components_folded,
        );
        self.stages.observe_open(entry, n);
    }

    /// Folds an entry into the overall and open-stage peaks only (a
    /// stage's boundary: no component of its own).
    fn observe_outside_components(&mut self, entry: &Entry, n: u64) {
        self.peaks.run.observe_weighted(entry, n);
        self.stages.observe_open(entry, n);
    }

    /// Logs a span's start and opens it when there is room.
    fn begin_span(&mut self, b: &Boundary) -> Applied {
        let entry = self.record_mark(&b.mark, format!("before_{}", b.mark.operation), None);
        self.spans.open(
            &b.mark,
            self.limits.max_open_spans,
            &mut self.counters.spans_untracked,
        );
        Applied {
            entry: Some(entry),
            ..Applied::default()
        }
    }

    /// Closes the innermost open span of the same component and operation
    /// (of the same process if there is one) and logs its end.
    fn end_span(&mut self, b: &Boundary) -> Applied {
        let matched = self.spans.close(&b.mark);
        let entry = self.record_mark(&b.mark, format!("after_{}", b.mark.operation), None);
        Applied {
            entry: Some(entry),
            unmatched: !matched,
            ..Applied::default()
        }
    }

    /// Opens a stage (when there is room) and logs its start.
    fn begin_stage(&mut self, b: &Boundary) -> Applied {
        let name = b.mark.operation.clone();
        self.stages
            .open(b, self.limits.max_stages, &mut self.counters.stages_dropped);
        let entry = self.record_mark(&b.mark, format!("{name}/begin"), Some(name));
        Applied {
            entry: Some(entry),
            ..Applied::default()
        }
    }

    /// Logs a stage's end and closes the latest open stage of its name.
    fn end_stage(&mut self, b: &Boundary) -> Applied {
        let name = b.mark.operation.clone();
        // The end's own sample belongs to the stage it closes.
        let entry = self.record_mark(&b.mark, format!("{name}/end"), Some(name));
        let unmatched = !self.stages.close(b);
        Applied {
            entry: Some(entry),
            unmatched,
            ..Applied::default()
        }
    }

    /// Follows the tree's changes a sample reports: processes that joined,
    /// were described or left, and the reader's error counts. A process
    /// that left counts its `wait4` peak in the run's, closes the spans it
    /// left open and sends no more allocator figures.
    fn follow_the_tree(&mut self, sample: &Sample) {
        let ts = sample.timestamp;
        let counters = &mut self.counters;
        for j in &sample.host.joined {
            let points = self.limits.target_series_points;
            self.targets.join(j, ts, points, &mut counters.targets_seen);
        }
        for d in &sample.host.described {
            self.targets.describe(d);
        }
        for left in &sample.host.left {
            let max = self.limits.max_targets;
            if !self
                .targets
                .leave(left, ts, max, &mut counters.targets_pruned)
            {
                continue;
            }
            if let Some(b) = left.max_rss {
                self.peaks.exact_peak(b);
            }
            self.spans.close_those_of(left.id.pid);
            self.marks.forget(left.id.pid);
        }
        counters.proc_errors += u64::from(sample.host.errors);
        counters.fd_fallbacks += u64::from(sample.host.fd_fallbacks);
    }

    /// A process we reaped: its exact exit status, and its `wait4` peak
    /// for its row and the run's peak.
    fn exit(&mut self, pid: u32, exit: Exit, max_rss: Option<u64>) {
        self.targets.exit(pid, exit, max_rss);
        if let Some(b) = max_rss {
            self.peaks.exact_peak(b);
        }
    }

    /// Ends the run: open stages are abandoned, open spans dropped, and
    /// `experiment_end` reports the last figures of a live tree.
    fn finish(&mut self, timestamp: f64, exit: Option<Exit>) -> Entry {
        self.stages.abandon_open(timestamp);
        self.spans.open.clear();
        let last = self
            .last_alive
            .clone()
            .unwrap_or_else(|| self.current.clone());
        let entry = Entry {
            component: SYSTEM.into(),
            operation: "experiment_end".into(),
            timestamp,
            kind: EntryKind::System,
            ..entry_from(&last)
        };
        self.observe(&entry, 1);
        self.push_event(&entry);
        self.run.end = Some(timestamp);
        self.run.exit = exit.or(self.run.exit);
        self.run.status = RunStatus::Finished;
        entry
    }

    /// Keeps a flight-recorder window, up to [`MAX_FLIGHTS`](super::limits::MAX_FLIGHTS).
    fn keep_flight(&mut self, w: &FlightWindow) {
        if self.flights.len() < super::limits::MAX_FLIGHTS {
            self.flights.push(w.clone());
        } else {
            self.counters.flights_dropped += 1;
        }
    }
}
