//! Advice: what a run's figures say to change. A small set of pure rules
//! over a finished (or running) run's document, each with a stable
//! `code`, a one-line finding carrying the figures behind it, and a
//! concrete action. The rules and when each stays silent are written down
//! in docs/advice.md.
//!
//! The log is read once, entry by entry (`Facts::observe`), so the
//! writer can feed entries it keeps on disk; the rest of the document is
//! read whole (`Facts::conclude`). `advise` does both for a document
//! in memory.

mod batch;
mod cleanup;
mod gpu;
pub(crate) mod item;
mod leak;
mod oom;
mod workers;

pub(crate) use item::Advice;

use crate::model::{DocumentOf, Entry};

/// What the rules need from the log, gathered one entry at a time.
#[derive(Debug, Default)]
pub(crate) struct Facts {
    steps: batch::Steps,
    cleanups: cleanup::Cleanups,
    cuda_ooms: Vec<Entry>,
    /// The last entry that named a phase (stage, span or mark), per time.
    phases: oom::Phases,
}

impl Facts {
    /// Folds one log entry in (entries in time order).
    pub fn observe(&mut self, e: &Entry) {
        self.steps.observe(e);
        self.cleanups.observe(e);
        self.phases.observe(e);
        if e.component == "cuda" && e.operation == "out_of_memory" && self.cuda_ooms.len() < 8 {
            self.cuda_ooms.push(e.clone());
        }
    }

    /// Every rule's advice on the document the log belongs to, most
    /// serious first.
    pub(crate) fn conclude<L>(self, doc: &DocumentOf<L>) -> Vec<Advice> {
        let mut out = Vec::new();
        out.extend(oom::oom_killed(doc, &self.phases));
        out.extend(self.cuda_ooms.iter().filter_map(|e| oom::cuda_oom(doc, e)));
        out.extend(gpu::foreign(doc));
        out.extend(workers::advise(doc));
        out.extend(self.steps.advise(doc));
        out.extend(leak::advise(doc));
        out.extend(self.cleanups.advise());
        // Stable: the rules' order within a level.
        out.sort_by_key(|a| std::cmp::Reverse(a.level));
        out
    }
}

/// The advice on a document held in memory.
#[cfg(test)]
pub(crate) fn advise(doc: &crate::model::Document) -> Vec<Advice> {
    let mut facts = Facts::default();
    for e in &doc.detailed_log {
        facts.observe(e);
    }
    facts.conclude(doc)
}

/// The advice as text: one block per item, most serious first, or a
/// line saying there is none.
pub fn render(advice: &[Advice]) -> String {
    if advice.is_empty() {
        return "no advice: nothing in this run's figures calls for a change\n".to_string();
    }
    let mut out = String::new();
    for a in advice {
        out.push_str(&format!(
            "[{}] {}: {}\n",
            a.level.as_str(),
            a.code,
            a.finding
        ));
        if !a.action.is_empty() {
            out.push_str(&format!("    -> {}\n", a.action));
        }
    }
    out
}

/// [`render`], or nothing when there is no advice.
pub(crate) fn render_found(advice: &[Advice]) -> String {
    if advice.is_empty() {
        String::new()
    } else {
        render(advice)
    }
}

#[cfg(test)]
pub(crate) mod testkit {
    use crate::model::{Document, Entry, EntryKind, Figures, Target};

    pub fn entry(t: f64, component: &str, operation: &str, cpu: f64) -> Entry {
        Entry {
            component: component.into(),
            operation: operation.into(),
            timestamp: t,
            figures: Figures {
                cpu_ram_used_mb: cpu,
                ..Figures::default()
            },
            kind: EntryKind::Event,
            ..Entry::default()
        }
    }

    pub fn timer(t: f64, cpu: f64) -> Entry {
        Entry {
            component: "memtrack".into(),
            operation: "sample".into(),
            timestamp: t,
            figures: Figures {
                cpu_ram_used_mb: cpu,
                ..Figures::default()
            },
            kind: EntryKind::Timer,
            ..Entry::default()
        }
    }

    pub fn target(pid: u32, ppid: u32, root: bool, rss: f64) -> Target {
        Target {
            pid,
            ppid,
            name: "python3".into(),
            root,
            last_rss_mb: rss,
            peak_rss_mb: rss,
            hwm_mb: rss,
            ..Target::default()
        }
    }

    pub fn doc() -> Document {
        let mut d = Document::default();
        d.run.start = 1000.0;
        d.run.end = Some(1100.0);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::item::{size, Severity};
    use super::testkit::*;
    use super::*;

    #[test]
    fn an_empty_run_gets_no_advice_and_says_so() {
        let d = doc();
        assert!(advise(&d).is_empty());
        assert!(render(&[]).starts_with("no advice"));
    }

    #[test]
    fn a_steady_run_with_marks_gets_no_advice() {
        let mut d = doc();
        for i in 0..100 {
            d.detailed_log.push(timer(1000.0 + i as f64, 500.0));
            if i % 10 == 0 {
                d.detailed_log
                    .push(entry(1000.5 + i as f64, "train", "step", 500.0));
            }
        }
        d.targets.push(target(10, 1, true, 500.0));
        assert_eq!(advise(&d), Vec::<Advice>::new());
    }

    #[test]
    fn render_puts_the_action_under_the_finding() {
        let a = Advice::new(
            "batch-fit",
            Severity::Info,
            "the finding".into(),
            "the action".into(),
        );
        assert_eq!(
            render(&[a]),
            "[info] batch-fit: the finding\n    -> the action\n"
        );
        assert_eq!(size(3174.4), "3.1 GiB");
        assert_eq!(size(310.2), "310 MiB");
    }
}
