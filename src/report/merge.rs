//! `memtrack merge`: the ranks of a multi-node job as one job-level
//! `memory_usage.json`.
//!
//! Each rank (one memtrack per node) writes its own file. The merged file
//! keeps every rank's log (entries labelled with `rank` and `host`), GPUs
//! (marked with their host), stages and alerts; its peaks are the maxima
//! over the ranks — the node that needs the most decides the hardware — and
//! `ranks` / `worst_rank` say which rank reached each peak.

use std::collections::BTreeMap;

use crate::model::{Document, Peaks, RankSummary, SCHEMA_VERSION};
use crate::report::leak;

/// The rank name of a file: its `rank` label, else its host, else its
/// position.
fn rank_of(doc: &Document, i: usize) -> String {
    doc.run
        .labels
        .get("rank")
        .cloned()
        .or_else(|| (!doc.run.host.is_empty()).then(|| doc.run.host.clone()))
        .unwrap_or_else(|| i.to_string())
}

/// The figures whose worst rank is named.
fn figures(p: &Peaks) -> [(&'static str, f64); 4] {
    [
        ("host_ram", p.cpu_ram_used_mb.max(p.cpu_ram_hwm_mb)),
        ("gpu_used", p.gpu_ram_used_mb),
        ("gpu_peak", p.gpu_ram_peak_mb),
        ("gpu_process", p.gpu_process_used_mb),
    ]
}

/// Merges per-rank documents (`(source, document)`).
pub fn merge(inputs: Vec<(String, Document)>) -> anyhow::Result<Document> {
    anyhow::ensure!(!inputs.is_empty(), "nothing to merge");
    let mut out = Document {
        schema: SCHEMA_VERSION,
        ..Document::default()
    };
    let first = &inputs[0].1.run;
    out.run.name = first.name.clone();
    out.run.mode = "merged".into();
    out.run.status = "merged".into();
    out.run.memtrack_version = env!("CARGO_PKG_VERSION").into();
    out.run.interval_s = first.interval_s;
    out.run.gpu_backend = first.gpu_backend.clone();
    out.run.command = first.command.clone();
    // Labels every rank shares (the job's, not a node's).
    out.run.labels = first.labels.clone();
    out.run.start = f64::INFINITY;
    let mut hosts: Vec<String> = Vec::new();
    let mut best: BTreeMap<&'static str, (f64, String)> = BTreeMap::new();
    let mut leaks: Vec<(String, serde_json::Value)> = Vec::new();

    for (i, (source, doc)) in inputs.into_iter().enumerate() {
        let rank = rank_of(&doc, i);
        let host = doc.run.host.clone();
        if !hosts.contains(&host) {
            hosts.push(host.clone());
        }
        out.run
            .labels
            .retain(|k, v| doc.run.labels.get(k) == Some(v));
        if doc.run.start > 0.0 {
            out.run.start = out.run.start.min(doc.run.start);
        }
        out.run.end = match (out.run.end, doc.run.end) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        // The job failed if any rank did.
        if let Some(e) = doc.run.exit {
            if out.run.exit.is_none_or(|cur| cur.code == 0 && e.code != 0) {
                out.run.exit = Some(e);
            }
        }
        for (figure, value) in figures(&doc.peak_usage) {
            if value > best.get(figure).map_or(0.0, |b| b.0) {
                best.insert(figure, (value, rank.clone()));
            }
        }
        out.peak_usage.merge(&doc.peak_usage);
        for (c, p) in &doc.peaks_by_component {
            out.peaks_by_component
                .entry(c.clone())
                .or_default()
                .merge(p);
        }
        // Each rank's own verdict: the merged log mixes the ranks' samples,
        // so a trend over it would mean nothing.
        let verdict = doc
            .leak
            .clone()
            .unwrap_or_else(|| leak::analyze(&doc, &leak::LeakConfig::default()));
        leaks.push((rank.clone(), verdict));
        let tag = |labels: &mut BTreeMap<String, String>| {
            labels.insert("rank".into(), rank.clone());
            labels.insert("host".into(), host.clone());
        };
        for mut e in doc.detailed_log {
            tag(&mut e.labels);
            out.detailed_log.push(e);
        }
        for mut s in doc.stages {
            tag(&mut s.labels);
            out.stages.push(s);
        }
        for mut g in doc.gpus {
            g.host = Some(host.clone());
            out.gpus.push(g);
        }
        for mut a in doc.alerts {
            a.resource = format!("{host}:{}", a.resource);
            out.alerts.push(a);
        }
        out.targets.extend(doc.targets);
        out.flight_recorder.extend(doc.flight_recorder);
        out.summary.peak_host_ram_mb = out
            .summary
            .peak_host_ram_mb
            .max(doc.summary.peak_host_ram_mb);
        out.summary.min_host_ram_mb = out.summary.min_host_ram_mb.max(doc.summary.min_host_ram_mb);
        out.summary.min_gpu_mb = out.summary.min_gpu_mb.max(doc.summary.min_gpu_mb);
        out.summary.headroom_ratio = doc.summary.headroom_ratio;
        out.ranks.push(RankSummary {
            rank,
            host,
            source,
            exit: doc.run.exit,
            peak_usage: doc.peak_usage,
            summary: doc.summary,
        });
    }
    if !out.run.start.is_finite() {
        out.run.start = 0.0;
    }
    out.summary.duration_s = out.run.end.unwrap_or(out.run.start) - out.run.start;
    out.run.host = hosts.join(",");
    out.detailed_log
        .sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    out.ranks.sort_by_key(|r| natural(&r.rank));
    out.worst_rank = best
        .into_iter()
        .map(|(k, (_, rank))| (k.to_string(), rank))
        .collect();
    out.leak = Some(merge_leaks(leaks));
    Ok(out)
}

/// The job's leak verdict from its ranks': suspected when any rank is, the
/// suspects named with their rank, `host` and `gpu` the verdicts of the
/// rank that looks worst (suspected first, then the fastest growth), and
/// every rank's whole verdict under `ranks`.
fn merge_leaks(leaks: Vec<(String, serde_json::Value)>) -> serde_json::Value {
    use serde_json::{json, Value};
    let worst = |part: &str| -> Value {
        leaks
            .iter()
            .map(|(_, l)| &l[part])
            .filter(|v| !v.is_null())
            .max_by(|a, b| {
                let key = |v: &Value| {
                    (
                        v["suspected"].as_bool().unwrap_or(false),
                        v["rate_mib_per_hour"].as_f64().unwrap_or(f64::NEG_INFINITY),
                    )
                };
                let (sa, ra) = key(a);
                let (sb, rb) = key(b);
                sa.cmp(&sb).then(ra.total_cmp(&rb))
            })
            .cloned()
            .unwrap_or(Value::Null)
    };
    let mut suspects = Vec::new();
    for (rank, l) in &leaks {
        for s in l["suspects"].as_array().into_iter().flatten() {
            if let Some(s) = s.as_str() {
                suspects.push(Value::String(format!("rank {rank}: {s}")));
            }
        }
    }
    let host = worst("host");
    let gpu = worst("gpu");
    let mut out = json!({
        "suspected": !suspects.is_empty(),
        "suspects": suspects,
        "host": host,
        "ranks": leaks.into_iter().collect::<serde_json::Map<String, Value>>(),
    });
    if !gpu.is_null() {
        out["gpu"] = gpu;
    }
    out
}

/// Orders `rank2` before `rank10`.
fn natural(s: &str) -> (Option<u64>, String) {
    (s.parse().ok(), s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(r: &str, host_mb: f64, gpu_mb: f64) -> (String, Document) {
        let mut d = Document::default();
        d.run.name = "job".into();
        d.run.host = format!("node{r}");
        d.run.labels.insert("rank".into(), r.into());
        d.run.labels.insert("slurm_job_id".into(), "42".into());
        d.run.start = 100.0;
        d.run.end = Some(200.0);
        d.peak_usage.cpu_ram_used_mb = host_mb;
        d.peak_usage.gpu_process_used_mb = gpu_mb;
        d.detailed_log.push(crate::model::Entry {
            timestamp: 150.0,
            cpu_ram_used_mb: host_mb,
            ..Default::default()
        });
        (format!("rank{r}.json"), d)
    }

    #[test]
    fn peaks_are_the_worst_rank_and_it_is_named() {
        let m = merge(vec![
            rank("0", 100.0, 9000.0),
            rank("1", 400.0, 1000.0),
            rank("10", 50.0, 2000.0),
        ])
        .unwrap();
        assert_eq!(m.peak_usage.cpu_ram_used_mb, 400.0);
        assert_eq!(m.peak_usage.gpu_process_used_mb, 9000.0);
        assert_eq!(m.worst_rank["host_ram"], "1");
        assert_eq!(m.worst_rank["gpu_process"], "0");
        let order: Vec<&str> = m.ranks.iter().map(|r| r.rank.as_str()).collect();
        assert_eq!(order, ["0", "1", "10"]);
        assert_eq!(
            m.run.labels.get("slurm_job_id").map(String::as_str),
            Some("42"),
            "shared labels kept"
        );
        assert!(
            !m.run.labels.contains_key("rank"),
            "per-rank labels dropped"
        );
        assert_eq!(m.detailed_log.len(), 3);
        assert!(m.detailed_log.iter().all(|e| e.labels.contains_key("rank")));
    }

    #[test]
    fn a_failed_rank_fails_the_job() {
        let mut bad = rank("1", 1.0, 0.0);
        bad.1.run.exit = Some(crate::model::Exit::signal(9));
        let mut good = rank("0", 1.0, 0.0);
        good.1.run.exit = Some(crate::model::Exit::code(0));
        let m = merge(vec![good, bad]).unwrap();
        assert_eq!(m.run.exit.unwrap().code, 137);
    }

    #[test]
    fn the_leak_verdict_is_each_ranks_own_not_a_trend_over_the_mix() {
        // Rank 1 grows steadily for a minute; rank 0 is flat at a higher
        // level. Interleaved, the mixed log would look like noise.
        let series = |r: &str, f: &dyn Fn(f64) -> f64| {
            let (src, mut d) = rank(r, 0.0, 0.0);
            d.detailed_log.clear();
            for i in 0..120 {
                let t = 100.0 + f64::from(i) * 0.5;
                d.detailed_log.push(crate::model::Entry {
                    component: "system".into(),
                    operation: "timer".into(),
                    kind: crate::model::EntryKind::Timer,
                    timestamp: t,
                    cpu_ram_used_mb: f(t - 100.0),
                    ..Default::default()
                });
            }
            (src, d)
        };
        let m = merge(vec![
            series("0", &|_| 5000.0),
            series("1", &|t| 1000.0 + 10.0 * t),
        ])
        .unwrap();
        let leak = m.leak.unwrap();
        assert_eq!(leak["suspected"], true, "{leak:#}");
        assert!(
            leak["suspects"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s.as_str().unwrap().starts_with("rank 1: host")),
            "{leak:#}"
        );
        let rate = leak["host"]["rate_mib_per_hour"].as_f64().unwrap();
        assert!((rate - 36_000.0).abs() < 3_600.0, "{rate}");
        assert_eq!(leak["ranks"]["0"]["suspected"], false);
    }
}
