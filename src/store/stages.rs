//! Stages: `stage_begin` opens a stage (bounded by
//! [`Limits::max_stages`](super::limits::Limits::max_stages)), `stage_end`
//! closes the latest open one of that name with its status and duration,
//! and the end of the run abandons those still open. Entries logged while
//! a stage is open carry its name and count for its peak.

use super::record::Boundary;
use crate::model::{Entry, Stage};

/// The stages' state: every stage kept, open and closed, in start order.
#[derive(Debug, Clone, Default)]
pub(super) struct StagesState {
    pub(super) list: Vec<Stage>,
}

impl StagesState {
    /// Opens the stage `b` begins, when there is room among `max_stages`
    /// (a stage that cannot be kept, or one made room for, is counted in
    /// `dropped`).
    pub(super) fn open(&mut self, b: &Boundary, max_stages: usize, dropped: &mut u64) {
        if self.make_room(max_stages, dropped) {
            self.list.push(Stage {
                name: b.mark.operation.clone(),
                status: "RUNNING".into(),
                start: b.mark.timestamp,
                pid: b.mark.pid,
                labels: b.mark.labels.clone(),
                ..Stage::default()
            });
        }
    }

    /// Closes the latest open stage of `b`'s name with its status and
    /// duration; false when none is open.
    pub(super) fn close(&mut self, b: &Boundary) -> bool {
        let open = self
            .list
            .iter_mut()
            .rev()
            .find(|s| s.name == b.mark.operation && s.end.is_none());
        let Some(stage) = open else {
            return false;
        };
        stage.end = Some(b.mark.timestamp);
        stage.duration_s = Some((b.mark.timestamp - stage.start).max(0.0));
        stage.status = b.status.clone().unwrap_or_else(|| "SUCCESS".into());
        stage.message.clone_from(&b.message);
        true
    }

    /// Closes every open stage at the end of the run as `ABANDONED`.
    pub(super) fn abandon_open(&mut self, timestamp: f64) {
        for stage in self.list.iter_mut().filter(|s| s.end.is_none()) {
            stage.end = Some(timestamp);
            stage.duration_s = Some((timestamp - stage.start).max(0.0));
            stage.status = "ABANDONED".into();
        }
    }

    /// Whether the list has room for one more: at the limit, the closed
    /// stage with the smallest peak goes (counted); with every stage
    /// open, the new one is not kept (counted).
    fn make_room(&mut self, max_stages: usize, dropped: &mut u64) -> bool {
        if self.list.len() < max_stages {
            return true;
        }
        *dropped += 1;
        let smallest = self
            .list
            .iter()
            .enumerate()
            .filter(|(_, s)| s.end.is_some())
            .min_by(|a, b| {
                let peak = |s: &Stage| {
                    s.peak
                        .figures
                        .cpu_ram_used_mb
                        .max(s.peak.figures.gpu_ram_peak_mb)
                };
                peak(a.1).total_cmp(&peak(b.1))
            })
            .map(|(i, _)| i);
        match smallest {
            Some(i) => {
                self.list.remove(i);
                true
            }
            None => false,
        }
    }

    /// The innermost open stage's name.
    pub(super) fn open_stage(&self) -> Option<String> {
        self.list
            .iter()
            .rev()
            .find(|s| s.end.is_none())
            .map(|s| s.name.clone())
    }

    /// Folds an entry into the peaks of the stages open now.
    pub(super) fn observe_open(&mut self, entry: &Entry, n: u64) {
        for stage in self.list.iter_mut().filter(|s| s.end.is_none()) {
            stage.peak.observe_weighted(entry, n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::Record;
    use crate::model::Exit;

    #[test]
    fn stages_record_status_duration_and_peak() {
        let mut st = store();
        timer(&mut st, sample(101.0, &[(10, 100)], &[]));
        st.apply(&Record::StageBegin(stage(101.0, "train", None)));
        timer(&mut st, sample(102.0, &[(10, 900)], &[]));
        st.apply(&Record::StageEnd(stage(105.0, "train", Some("SUCCESS"))));
        st.apply(&Record::StageBegin(stage(105.0, "eval", None)));
        timer(&mut st, sample(106.0, &[(10, 200)], &[]));
        st.apply(&Record::StageEnd(stage(106.5, "eval", Some("FAILED"))));
        st.apply(&Record::StageBegin(stage(107.0, "export", None)));
        st.apply(&Record::Finish {
            timestamp: 108.0,
            exit: Some(Exit::code(1)),
        });
        let doc = st.document();
        let s: Vec<(&str, &str, f64, f64)> = doc
            .stages
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.status.as_str(),
                    s.duration_s.unwrap(),
                    s.peak.figures.cpu_ram_used_mb,
                )
            })
            .collect();
        assert_eq!(
            s,
            [
                ("train", "SUCCESS", 4.0, 900.0),
                ("eval", "FAILED", 1.5, 900.0),
                ("export", "ABANDONED", 1.0, 200.0)
            ]
        );
    }

    #[test]
    fn an_end_without_a_begin_is_unmatched_and_logged_in_its_stage() {
        let mut st = store();
        timer(&mut st, sample(101.0, &[(10, 100)], &[]));
        let out = st.apply(&Record::StageEnd(stage(102.0, "ghost", Some("FAILED"))));
        assert!(out.unmatched);
        let e = out.entry.unwrap();
        assert_eq!(
            (e.operation.as_str(), e.stage.as_deref()),
            ("ghost/end", Some("ghost"))
        );
        assert!(st.stages().is_empty());
    }

    #[test]
    fn entries_while_a_stage_is_open_carry_its_name() {
        let mut st = store();
        st.apply(&Record::StageBegin(stage(101.0, "train", None)));
        let e = st.apply(&Record::Mark(mark(101.5, "data", "batch")));
        assert_eq!(e.entry.unwrap().stage.as_deref(), Some("train"));
        let t = timer(&mut st, sample(102.0, &[(10, 100)], &[]));
        assert_eq!(t.entry.unwrap().stage.as_deref(), Some("train"));
        st.apply(&Record::StageEnd(stage(103.0, "train", None)));
        assert_eq!(st.stages()[0].status, "SUCCESS", "the default status");
        let e = st.apply(&Record::Mark(mark(104.0, "data", "batch")));
        assert_eq!(e.entry.unwrap().stage, None);
    }
}
