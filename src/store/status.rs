//! Views of the state as it is now: the `status` answer (socket and CLI),
//! every resource's pressure level, and the [`Snapshot`] exporters read.

use std::collections::BTreeMap;

use super::pressure::Level;
use super::snapshot::{ProcessNow, RunMeta, Snapshot};
use super::state::Store;

impl Store {
    /// What the daemon sees now, for `status` (socket and CLI) and live
    /// views: run identity, current figures, peaks, live processes, open
    /// spans and stages, pressure levels, GPUs (and, with NVML, how the
    /// tree's share of them is told apart), counters.
    pub(crate) fn status(&self) -> serde_json::Value {
        let processes: Vec<serde_json::Value> = self
            .targets
            .live
            .values()
            .map(|l| {
                let t = &l.target;
                let mib = |b: Option<u64>| b.map(|b| b as f64 / crate::units::MIB);
                serde_json::json!({
                    "pid": t.pid, "ppid": t.ppid, "name": t.name, "root": t.root,
                    "rss_mb": t.last_rss_mb, "peak_rss_mb": t.peak_rss_mb, "hwm_mb": t.hwm_mb,
                    "gpu_mb": t.last_gpu_mb, "peak_gpu_mb": t.peak_gpu_mb,
                    // Its own cost as last read (null until read): the
                    // pages it alone maps, and its proportional share;
                    // `own_estimated` when no read reached it since it grew.
                    "uss_mb": mib(l.uss), "pss_mb": mib(l.pss),
                    "own_estimated": t.own_estimated,
                })
            })
            .collect();
        let open_stages: Vec<&str> = self
            .stages
            .list
            .iter()
            .filter(|s| s.end.is_none())
            .map(|s| s.name.as_str())
            .collect();
        let mut current = serde_json::json!(self.current);
        if let Some(c) = current.as_object_mut() {
            // Its name before `cpu_ram_used_mb`, kept for older readers.
            c.insert("cpu_rss_mb".into(), self.current.cpu_used_mb.into());
        }
        let mut status = serde_json::json!({
            "run": {
                "id": self.run.id, "name": self.run.name, "mode": self.run.mode, "host": self.run.host,
                "start": self.run.start, "labels": self.run.labels, "gpu_backend": self.run.gpu_backend,
            },
            "current": current,
            "peak_usage": self.peaks.run,
            "peaks_by_component": self.peaks.by_component,
            "processes": processes,
            "open_spans": self.open_spans().collect::<Vec<_>>(),
            "open_stages": open_stages,
            "levels": self.alerts.levels,
            "gpus": self.gpu.devices.values().collect::<Vec<_>>(),
            "counters": self.counters,
        });
        // Time to OOM, only while some resource climbs towards its limit.
        let forecasts = self.forecasts();
        if let (false, Some(m)) = (forecasts.is_empty(), status.as_object_mut()) {
            m.insert("forecasts".into(), serde_json::json!(forecasts));
        }
        if let (Some(a), Some(m)) = (&self.gpu.attribution, status.as_object_mut()) {
            m.insert("gpu_attribution".into(), serde_json::json!(a));
        }
        status
    }

    /// The level of every resource seen (host RAM and each GPU), normal
    /// included, so exporters have a series from the start.
    pub(crate) fn all_levels(&self) -> BTreeMap<String, Level> {
        let mut levels = self.alerts.levels.clone();
        if self.host.memory.total > 0 {
            levels.entry("host".into()).or_default();
        }
        for g in self.gpu.devices.values() {
            levels.entry(format!("gpu{}", g.index)).or_default();
        }
        levels
    }

    /// The picture exporters read (see [`Snapshot`]).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            seq: self.seq,
            run: RunMeta {
                id: self.run.id.clone(),
                name: self.run.name.clone(),
                host: self.run.host.clone(),
                mode: self.run.mode.clone(),
                start: self.run.start,
                interval_s: self.run.interval_s,
                gpu_backend: self.run.gpu_backend.clone(),
                labels: self.run.labels.clone(),
            },
            current: self.current.clone(),
            peaks: self.peaks.run,
            by_component: self.peaks.by_component.clone(),
            processes: self
                .targets
                .live
                .values()
                .map(|l| ProcessNow {
                    pid: l.target.pid,
                    ppid: l.target.ppid,
                    name: l.target.name.clone(),
                    root: l.target.root,
                    rss_bytes: l.rss,
                    hwm_bytes: l.hwm,
                    peak_rss_bytes: (l.target.peak_rss_mb * crate::units::MIB) as u64,
                    gpu_bytes: l.gpu.clone(),
                    pss_bytes: l.pss,
                    uss_bytes: l.uss,
                    own_estimated: l.target.own_estimated,
                })
                .collect(),
            gpus: self.gpu.devices.values().cloned().collect(),
            gpu_attribution: self.gpu.attribution.clone(),
            allocator: self.marks.allocator_now.values().copied().collect(),
            events: self.marks.event_counts.clone(),
            levels: self.all_levels(),
            open_spans: self.open_spans().collect(),
            open_stages: self
                .stages
                .list
                .iter()
                .filter(|s| s.end.is_none())
                .map(|s| s.name.clone())
                .collect(),
            host_memory: self.host.memory,
            counters: self.counters.clone(),
            nvml_up: self.gpu.nvml_up,
            finished: self.is_finished(),
            needs: self.summary(),
            forecasts: self.forecasts(),
            ..Snapshot::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::pressure::Level;
    use super::super::testkit::*;

    #[test]
    fn every_resource_seen_has_a_level_from_the_start() {
        let mut st = store();
        assert!(st.all_levels().is_empty());
        timer(&mut st, sample(101.0, &[(10, 100)], &[(10, 10)]));
        let levels: Vec<(String, Level)> = st.all_levels().into_iter().collect();
        assert_eq!(
            levels,
            [
                ("gpu0".to_string(), Level::Normal),
                ("host".to_string(), Level::Normal)
            ]
        );
        assert!(st.levels().is_empty(), "no level crossed");
        let status = st.status();
        assert_eq!(status["current"]["cpu_ram_used_mb"], 100.0);
        assert_eq!(
            status["current"]["cpu_rss_mb"], 100.0,
            "the old name stays readable"
        );
        assert_eq!(status["open_stages"], serde_json::json!([]));
    }

    #[test]
    fn each_process_in_the_status_has_its_own_cost() {
        let mut st = store();
        let mut s = sample(101.0, &[(10, 100)], &[]);
        join(&mut s, 10);
        for p in &mut s.host.processes {
            p.pss = Some(64 << 20);
            p.uss = Some(48 << 20);
            p.own_read = true;
        }
        timer(&mut st, s);
        let mut s = sample(102.0, &[(10, 100), (11, 50)], &[]);
        join(&mut s, 11);
        timer(&mut st, s);
        let status = st.status();
        let procs = status["processes"].as_array().expect("processes");
        let of = |pid: u32| {
            procs
                .iter()
                .find(|p| p["pid"] == pid)
                .unwrap_or_else(|| panic!("{pid} in {procs:?}"))
        };
        assert_eq!(of(10)["uss_mb"], 48.0, "{procs:?}");
        assert_eq!(of(10)["pss_mb"], 64.0);
        assert!(of(11)["uss_mb"].is_null(), "not read yet");
    }
}
