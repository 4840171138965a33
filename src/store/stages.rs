//! Stages: `stage_begin` opens a stage (bounded by
//! [`Limits::max_stages`](super::limits::Limits::max_stages)), `stage_end`
//! closes the latest open one of that name with its status and duration,
//! and the end of the run abandons those still open. Entries logged while
//! a stage is open carry its name and count for its peak.

use super::record::{Applied, Boundary};
use super::state::Store;
use crate::model::Stage;

impl Store {
    /// Opens a stage (when there is room) and logs its start.
    pub(super) fn begin_stage(&mut self, b: &Boundary) -> Applied {
        let name = b.mark.operation.clone();
        if self.make_room_for_a_stage() {
            self.stages.list.push(Stage {
                name: name.clone(),
                status: "RUNNING".into(),
                start: b.mark.timestamp,
                pid: b.mark.pid,
                labels: b.mark.labels.clone(),
                ..Stage::default()
            });
        }
        let entry = self.record_mark(&b.mark, format!("{name}/begin"), Some(name));
        Applied {
            entry: Some(entry),
            ..Applied::default()
        }
    }

    /// Logs a stage's end and closes the latest open stage of its name.
    pub(super) fn end_stage(&mut self, b: &Boundary) -> Applied {
        let name = b.mark.operation.clone();
        // The end's own sample belongs to the stage it closes.
        let entry = self.record_mark(&b.mark, format!("{name}/end"), Some(name.clone()));
        let open = self
            .stages
            .list
            .iter_mut()
            .rev()
            .find(|s| s.name == name && s.end.is_none());
        let unmatched = open.is_none();
        if let Some(stage) = open {
            stage.end = Some(b.mark.timestamp);
            stage.duration_s = Some((b.mark.timestamp - stage.start).max(0.0));
            stage.status = b.status.clone().unwrap_or_else(|| "SUCCESS".into());
            stage.message.clone_from(&b.message);
        }
        Applied {
            entry: Some(entry),
            unmatched,
            ..Applied::default()
        }
    }

    /// Closes every open stage at the end of the run as `ABANDONED`.
    pub(super) fn abandon_open_stages(&mut self, timestamp: f64) {
        for stage in self.stages.list.iter_mut().filter(|s| s.end.is_none()) {
            stage.end = Some(timestamp);
            stage.duration_s = Some((timestamp - stage.start).max(0.0));
            stage.status = "ABANDONED".into();
        }
    }

    /// Whether `stages[]` has room for one more: at the limit, the closed
    /// stage with the smallest peak goes (counted); with every stage
    /// open, the new one is not kept (counted).
    pub(super) fn make_room_for_a_stage(&mut self) -> bool {
        if self.stages.list.len() < self.limits.max_stages {
            return true;
        }
        self.counters.stages_dropped += 1;
        let smallest = self
            .stages
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
                self.stages.list.remove(i);
                true
            }
            None => false,
        }
    }

    pub(super) fn open_stage(&self) -> Option<String> {
        self.stages
            .list
            .iter()
            .rev()
            .find(|s| s.end.is_none())
            .map(|s| s.name.clone())
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
