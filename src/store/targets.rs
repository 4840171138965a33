//! Targets: the processes of the tree. A process joins (or, seen again
//! with the same start time, comes back to its one row), is described,
//! has its figures folded into its row and bounded series at each sample,
//! and leaves with its exit and `wait4` peak; gone rows beyond
//! [`Limits::max_targets`](super::limits::Limits::max_targets) are pruned,
//! the smallest first.

use std::collections::BTreeMap;

use crate::model::thin::Thinned;
use crate::model::{Exit, Target};
use crate::sample::host::{Described, Joined, Left};
use crate::sample::Sample;
use crate::units::mib;

/// The targets' state: the processes of the tree, live and gone.
#[derive(Debug, Clone, Default)]
pub(super) struct TargetsState {
    pub(super) live: BTreeMap<u32, LiveTarget>,
    pub(super) gone: Vec<Target>,
}

/// A process of the tree while it lives: its row and its bounded series.
#[derive(Debug, Clone)]
pub(super) struct LiveTarget {
    pub(super) target: Target,
    pub(super) series: Thinned<[f64; 3]>,
    /// Latest figures in bytes, for exporters.
    pub(super) rss: u64,
    pub(super) hwm: u64,
    pub(super) gpu: BTreeMap<u32, u64>,
    pub(super) pss: Option<u64>,
    pub(super) uss: Option<u64>,
    /// `[unix seconds, uss MiB, pss MiB]` at each own-cost read.
    pub(super) own_series: Thinned<[f64; 3]>,
}

impl LiveTarget {
    /// A live row around `target`, no figures read yet.
    fn new(target: Target, series: Thinned<[f64; 3]>, own_series: Thinned<[f64; 3]>) -> LiveTarget {
        LiveTarget {
            target,
            series,
            own_series,
            rss: 0,
            hwm: 0,
            gpu: BTreeMap::new(),
            pss: None,
            uss: None,
        }
    }
}

impl TargetsState {
    /// The name of a process of the tree, live or gone.
    pub(super) fn name(&self, pid: u32) -> Option<String> {
        self.live
            .get(&pid)
            .map(|l| l.target.name.clone())
            .or_else(|| {
                self.gone
                    .iter()
                    .rev()
                    .find(|t| t.pid == pid)
                    .map(|t| t.name.clone())
            })
    }

    /// A process joins the tree: a new row (counted in `seen`), or its
    /// old one when it is the same process (PID and start time) seen
    /// again. Its series keep `series_points` points.
    pub(super) fn join(&mut self, j: &Joined, ts: f64, series_points: usize, seen: &mut u64) {
        // The same process (PID and start time) seen again — a zombie
        // found by a later scan — keeps its one row.
        if let Some(i) = self
            .gone
            .iter()
            .position(|t| t.pid == j.id.pid && t.start_time == j.start_time)
        {
            let target = self.gone.remove(i);
            let mut series = Thinned::new(series_points);
            for point in &target.series {
                series.push(*point);
            }
            let mut own_series = Thinned::new(series_points);
            for point in &target.own_series {
                own_series.push(*point);
            }
            let target = Target {
                exited_at: None,
                series: Vec::new(),
                own_series: Vec::new(),
                ..target
            };
            self.live
                .insert(j.id.pid, LiveTarget::new(target, series, own_series));
            return;
        }
        if self
            .live
            .get(&j.id.pid)
            .is_some_and(|l| l.target.start_time == j.start_time)
        {
            return;
        }
        *seen += 1;
        let target = Target {
            pid: j.id.pid,
            ppid: j.ppid,
            start_time: j.start_time,
            name: j.name.clone(),
            cmdline: j.cmdline.clone(),
            root: j.root,
            first_seen: ts,
            last_seen: ts,
            ..Target::default()
        };
        let series = Thinned::new(series_points);
        let own_series = Thinned::new(series_points);
        self.live
            .insert(j.id.pid, LiveTarget::new(target, series, own_series));
    }

    /// A live process's name and command line, read after it joined.
    pub(super) fn describe(&mut self, d: &Described) {
        if let Some(live) = self.live.get_mut(&d.pid) {
            live.target.name.clone_from(&d.name);
            live.target.cmdline.clone_from(&d.cmdline);
        }
    }

    /// Folds each live process's reading (and its GPU memory, `gpu_by_pid`)
    /// into its row, its peaks and its series.
    pub(super) fn fold_readings(&mut self, sample: &Sample, gpu_by_pid: &BTreeMap<u32, u64>) {
        let ts = sample.timestamp;
        for r in &sample.host.processes {
            let Some(live) = self.live.get_mut(&r.pid) else {
                continue;
            };
            live.rss = r.rss;
            live.hwm = r.hwm.max(r.rss);
            if r.pss.is_some() {
                live.pss = r.pss;
                live.uss = r.uss;
            }
            let t = &mut live.target;
            let gpu = gpu_by_pid.get(&r.pid).copied().unwrap_or(0);
            t.last_seen = ts;
            t.last_rss_mb = mib(r.rss);
            t.peak_rss_mb = t.peak_rss_mb.max(t.last_rss_mb);
            t.hwm_mb = t.hwm_mb.max(mib(r.hwm.max(r.rss)));
            t.last_gpu_mb = mib(gpu);
            t.peak_gpu_mb = t.peak_gpu_mb.max(t.last_gpu_mb);
            if r.pss.is_some() {
                t.pss_mb = r.pss.map(mib);
                t.uss_mb = r.uss.map(mib);
            }
            if r.own_read {
                if let (Some(uss), Some(pss)) = (r.uss, r.pss) {
                    let (uss, pss) = (mib(uss), mib(pss));
                    t.own_estimated = r.own_estimated;
                    // An estimate above the peak makes it an estimate; a read
                    // near it (within 2 % or 1 MiB) or above confirms it.
                    let peak = t.peak_uss_mb;
                    if r.own_estimated {
                        t.peak_uss_estimated |= peak.is_none_or(|p| uss > p);
                    } else if peak.is_none_or(|p| uss >= p - (0.02 * p).max(1.0)) {
                        t.peak_uss_estimated = false;
                    }
                    t.peak_uss_mb = Some(t.peak_uss_mb.map_or(uss, |p| p.max(uss)));
                    t.peak_pss_mb = Some(t.peak_pss_mb.map_or(pss, |p| p.max(pss)));
                    live.own_series.push([ts, uss, pss]);
                }
            }
            live.series.push([ts, mib(r.rss), mib(gpu)]);
        }
    }

    /// Each live process's GPU memory in this sample, `(pid, device,
    /// bytes)`, and its peak per device.
    pub(super) fn fold_gpu(&mut self, by_process: &[(u32, u32, u64)]) {
        for live in self.live.values_mut() {
            live.gpu.clear();
        }
        for &(pid, device, used) in by_process {
            let Some(live) = self.live.get_mut(&pid) else {
                continue;
            };
            *live.gpu.entry(device).or_default() += used;
            let peak = live.target.peak_gpu_mb_by_device.entry(device).or_default();
            *peak = peak.max(mib(used));
        }
    }

    /// A process leaves the tree with its exit and `wait4` peak; returns
    /// whether it was live. Gone rows beyond `max_targets` are pruned, the
    /// smallest first (counted in `pruned`).
    pub(super) fn leave(
        &mut self,
        left: &Left,
        ts: f64,
        max_targets: usize,
        pruned: &mut u64,
    ) -> bool {
        let Some(live) = self.live.remove(&left.id.pid) else {
            return false;
        };
        let mut t = live.target;
        t.series = live.series.iter().copied().collect();
        t.own_series = live.own_series.iter().copied().collect();
        t.exited_at = Some(ts);
        if t.exit.is_none() {
            t.exit = Some(left.exit.unwrap_or_else(Exit::unknown));
        }
        if let Some(b) = left.max_rss {
            t.hwm_mb = t.hwm_mb.max(mib(b));
        }
        self.gone.push(t);
        if self.gone.len() + self.live.len() > max_targets {
            if let Some(i) = self
                .gone
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.root)
                .min_by(|a, b| a.1.peak_rss_mb.total_cmp(&b.1.peak_rss_mb))
                .map(|(i, _)| i)
            {
                self.gone.remove(i);
                *pruned += 1;
            }
        }
        true
    }

    /// A process we reaped: its exact exit status, and its `wait4` peak.
    pub(super) fn exit(&mut self, pid: u32, exit: Exit, max_rss: Option<u64>) {
        let target = match self.live.get_mut(&pid) {
            Some(l) => Some(&mut l.target),
            None => self.gone.iter_mut().rev().find(|t| t.pid == pid),
        };
        if let Some(t) = target {
            t.exit = Some(exit);
            if let Some(b) = max_rss {
                t.hwm_mb = t.hwm_mb.max(mib(b));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::limits::Limits;
    use super::super::pressure::Thresholds;
    use super::super::state::Store;
    use super::super::testkit::*;
    use super::super::{Boundary, Record};
    use crate::model::Exit;
    use crate::model::RunInfo;
    use crate::sample::host::{Identity, Left};

    #[test]
    fn exits_are_recorded_and_dead_processes_close_their_spans() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 100)], &[]);
        join(&mut s, 10);
        join(&mut s, 11);
        timer(&mut st, s);
        let mut m = mark(101.5, "data", "load");
        m.pid = Some(11);
        st.apply(&Record::SpanBegin(Boundary {
            mark: m,
            status: None,
            message: None,
        }));
        let mut s = sample(102.0, &[(10, 100)], &[]);
        s.host.left.push(Left {
            id: Identity {
                pid: 11,
                start_ticks: 11,
            },
            exit: None,
            max_rss: Some(400 * M),
        });
        timer(&mut st, s);
        st.apply(&Record::Exit {
            pid: 10,
            exit: Exit::signal(9),
            max_rss: None,
        });
        let doc = st.document();
        let t11 = doc.targets.iter().find(|t| t.pid == 11).unwrap();
        assert_eq!(t11.exit, Some(Exit::unknown()));
        assert_eq!(t11.hwm_mb, 400.0, "wait4's peak");
        assert_eq!(
            doc.peak_usage.figures.cpu_ram_hwm_mb, 400.0,
            "the tree held at least what one process did"
        );
        assert_eq!(doc.summary.peak_host_ram_mb, 400.0);
        assert_eq!(t11.series.len(), 1);
        let t10 = doc.targets.iter().find(|t| t.pid == 10).unwrap();
        assert_eq!(t10.exit.unwrap().code, 137);
        assert_eq!(
            doc.detailed_log.last().unwrap().component,
            "system",
            "span closed"
        );
    }

    #[test]
    fn a_process_seen_again_comes_back_to_its_one_row() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 300)], &[]);
        join(&mut s, 10);
        join(&mut s, 11);
        timer(&mut st, s);
        let mut s = sample(102.0, &[(10, 100)], &[]);
        leave(&mut s, 11);
        timer(&mut st, s);
        assert_eq!(st.live_targets().count(), 1);
        // A later scan finds the same process (PID and start time).
        let mut s = sample(103.0, &[(10, 100), (11, 200)], &[]);
        join(&mut s, 11);
        timer(&mut st, s);
        let doc = st.document();
        let rows: Vec<&crate::model::Target> = doc.targets.iter().filter(|t| t.pid == 11).collect();
        assert_eq!(rows.len(), 1, "one row");
        assert_eq!(rows[0].exited_at, None);
        assert_eq!(rows[0].peak_rss_mb, 300.0, "its peak kept");
        assert_eq!(rows[0].series.len(), 2, "its series kept and extended");
        assert_eq!(st.counters().targets_seen, 2);
    }

    #[test]
    fn a_description_renames_a_live_process() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100)], &[]);
        join(&mut s, 10);
        timer(&mut st, s);
        let mut s = sample(102.0, &[(10, 100)], &[]);
        s.host.described.push(crate::sample::host::Described {
            pid: 10,
            name: "python".into(),
            cmdline: vec!["python".into(), "train.py".into()],
        });
        timer(&mut st, s);
        assert_eq!(st.target_name(10).as_deref(), Some("python"));
        assert_eq!(st.document().targets[0].cmdline, ["python", "train.py"]);
    }

    #[test]
    fn gone_rows_beyond_the_bound_are_pruned_smallest_first_never_the_root() {
        let mut st = Store::new(
            RunInfo::default(),
            Limits {
                max_targets: 3,
                ..Limits::default()
            },
            Thresholds::default(),
        );
        let mut s = sample(1.0, &[(10, 5), (11, 300), (12, 100)], &[]);
        for pid in [10, 11, 12] {
            join(&mut s, pid);
        }
        timer(&mut st, s);
        let mut s = sample(2.0, &[(10, 5)], &[]);
        leave(&mut s, 11);
        leave(&mut s, 12);
        timer(&mut st, s);
        assert_eq!(st.counters().targets_pruned, 0, "three rows fit");
        let mut s = sample(3.0, &[(10, 5), (13, 200)], &[]);
        join(&mut s, 13);
        timer(&mut st, s);
        let mut s = sample(4.0, &[(10, 5)], &[]);
        leave(&mut s, 13);
        timer(&mut st, s);
        let pids: Vec<u32> = st.document().targets.iter().map(|t| t.pid).collect();
        assert_eq!(pids, [10, 11, 13], "12, the smallest gone row, made room");
        assert_eq!(st.counters().targets_pruned, 1);
        assert_eq!(st.target_name(12), None);
    }

    #[test]
    fn an_exit_of_a_gone_process_sets_its_status_and_the_runs_exact_peak() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100), (11, 100)], &[]);
        join(&mut s, 10);
        join(&mut s, 11);
        timer(&mut st, s);
        let mut s = sample(102.0, &[(10, 100)], &[]);
        leave(&mut s, 11);
        timer(&mut st, s);
        st.apply(&Record::Exit {
            pid: 11,
            exit: Exit::code(3),
            max_rss: Some(700 * M),
        });
        let doc = st.document();
        let t11 = doc.targets.iter().find(|t| t.pid == 11).unwrap();
        assert_eq!(t11.exit, Some(Exit::code(3)));
        assert_eq!(t11.hwm_mb, 700.0);
        assert_eq!(doc.peak_usage.figures.cpu_ram_hwm_mb, 700.0);
    }
}
