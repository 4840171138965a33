//! `leak`: the leak rule's verdicts (crate::model::leak) as advice, one
//! per suspect — the tree's host or GPU memory, a process, a component.

use super::item::{size, Advice, Severity};
use crate::model::leak::{LeakReport, Verdict};
use crate::model::DocumentOf;
use crate::units::duration_one_unit;

fn one(subject: String, v: &Verdict) -> Advice {
    Advice::new(
        "leak",
        Severity::Warning,
        format!(
            "{subject} grew by {} over the last {} and is still growing ({} per hour, \
             99 % interval {} to {}), from {}",
            size(v.growth_mib),
            duration_one_unit(v.window_s),
            size(v.rate_mib_per_hour),
            size(v.ci_mib_per_hour.0),
            size(v.ci_mib_per_hour.1),
            size(v.level_mib)
        ),
        "find what keeps references from one iteration to the next (losses kept with their \
         graph, growing lists or caches, tensors stored for logging): tracemalloc for host \
         memory, torch.cuda.memory._record_memory_history() for the GPU"
            .to_string(),
    )
    .figure("growth_mb", v.growth_mib)
    .figure("rate_mib_per_hour", v.rate_mib_per_hour)
    .figure("window_s", v.window_s)
    .figure("level_mb", v.level_mib)
}

pub(super) fn advise<L>(doc: &DocumentOf<L>) -> Vec<Advice> {
    let Some(value) = &doc.leak else {
        return Vec::new();
    };
    let report = LeakReport::from_value(value);
    let mut out = Vec::new();
    let mut add = |subject: String, v: &Verdict| {
        if v.suspected {
            out.push(one(subject, v));
        }
    };
    if let Some(v) = &report.host {
        add("the job's host memory".into(), v);
    }
    if let Some(v) = &report.gpu {
        add("the job's GPU memory".into(), v);
    }
    for t in report.targets.iter().flatten() {
        let what = if t.figure == "uss" {
            "own memory (USS)"
        } else {
            "host memory"
        };
        add(format!("PID {} ({}) {what}", t.pid, t.name), &t.host);
        if let Some(g) = &t.gpu {
            add(format!("PID {} ({}) GPU memory", t.pid, t.name), g);
        }
    }
    for (name, v) in report.components.iter().flatten() {
        add(format!("component {name}"), v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use crate::model::leak::TargetVerdict;

    fn growing() -> Verdict {
        Verdict {
            suspected: true,
            judged: true,
            rate_mib_per_hour: 3600.0,
            ci_mib_per_hour: (3000.0, 4000.0),
            window_s: 60.0,
            growth_mib: 60.0,
            level_mib: 400.0,
            ..Verdict::default()
        }
    }

    #[test]
    fn each_suspect_gets_its_own_line() {
        let mut d = doc();
        let report = LeakReport {
            suspected: true,
            host: Some(growing()),
            targets: Some(vec![
                TargetVerdict {
                    pid: 7,
                    name: "python3".into(),
                    figure: "uss".into(),
                    host: growing(),
                    gpu: None,
                },
                TargetVerdict {
                    pid: 8,
                    name: "python3".into(),
                    host: Verdict::default(),
                    gpu: None,
                    ..TargetVerdict::default()
                },
            ]),
            ..LeakReport::default()
        };
        d.leak = Some(report.to_value());
        let a = super::super::advise(&d);
        assert_eq!(a.len(), 2, "{a:#?}");
        assert_eq!(
            a[0].finding,
            "the job's host memory grew by 60 MiB over the last 60 s and is still growing \
             (3.5 GiB per hour, 99 % interval 2.9 GiB to 3.9 GiB), from 400 MiB"
        );
        assert!(a[1]
            .finding
            .starts_with("PID 7 (python3) own memory (USS) grew"));
    }

    #[test]
    fn no_suspect_no_advice() {
        let mut d = doc();
        d.leak = Some(
            LeakReport {
                host: Some(Verdict::default()),
                ..LeakReport::default()
            }
            .to_value(),
        );
        assert!(super::super::advise(&d).is_empty());
    }
}
