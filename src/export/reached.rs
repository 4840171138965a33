//! The iterations a job's marks reached, by time. An output that puts
//! memory on the job's step axis gives an entry without an iteration (a
//! timer sample) the step the job was on when the entry was taken. Entries
//! can reach an output out of time order: a sample is stamped when its read
//! begins and can come after a later mark, and the job holds fast steps
//! back and sends them together, each saying when it came. So the marks are
//! kept by time, and an entry looks its step up among them.
//!
//! Two rules read them: MLflow takes the latest mark before the entry
//! ([`Reached::latest_before`]); ClearML takes the largest iteration
//! reached before it ([`Reached::largest_before`]), because its axis never
//! goes back.

use std::collections::VecDeque;

/// Marks kept for the look-up: a sample that reaches the output after more
/// marks than this (a read that overlapped them) takes the step of the
/// newest mark let go, or the largest one.
pub(crate) const MARKS_KEPT: usize = 256;

/// One mark: when it was taken and the iteration it carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark {
    /// Microseconds since the epoch.
    pub(crate) at_us: i64,
    pub(crate) iteration: u64,
}

/// An entry's time in microseconds (a time that is not finite is no time:
/// the callers handle it before they ask).
pub(crate) fn micros(seconds: f64) -> i64 {
    (seconds * 1e6) as i64
}

/// The latest marks, in time order, and what the older ones left.
#[derive(Debug, Default)]
pub(crate) struct Reached {
    /// Marks of one instant keep the order they came in.
    marks: VecDeque<Mark>,
    /// The newest mark let go.
    let_go: Option<Mark>,
    /// The largest iteration let go, or one known without a time.
    floor: u64,
    /// The largest iteration reached at any time: kept, let go or floor.
    largest: u64,
}

impl Reached {
    /// Keeps a mark, in time order.
    pub(crate) fn keep(&mut self, at_us: i64, iteration: u64) {
        let i = self.marks.partition_point(|m| m.at_us <= at_us);
        self.marks.insert(i, Mark { at_us, iteration });
        self.largest = self.largest.max(iteration);
        if self.marks.len() > MARKS_KEPT {
            if let Some(old) = self.marks.pop_front() {
                self.floor = self.floor.max(old.iteration);
                self.let_go = Some(old);
            }
        }
    }

    /// The job reached `iteration` at a time not known (or before every
    /// mark kept): it counts for [`largest_before`](Self::largest_before)
    /// at any time.
    pub(crate) fn raise_floor(&mut self, iteration: u64) {
        self.floor = self.floor.max(iteration);
        self.largest = self.largest.max(iteration);
    }

    /// The largest iteration reached, at any time.
    pub(crate) fn largest(&self) -> u64 {
        self.largest
    }

    /// The latest mark strictly before `at_us` (an entry of a mark's very
    /// instant comes before it in the run's log), else the newest let go.
    pub(crate) fn latest_before(&self, at_us: i64) -> Option<Mark> {
        self.marks
            .iter()
            .rev()
            .find(|m| m.at_us < at_us)
            .copied()
            .or(self.let_go)
    }

    /// The newest mark in time.
    pub(crate) fn latest(&self) -> Option<Mark> {
        self.marks.back().copied().or(self.let_go)
    }

    /// The largest iteration reached strictly before `at_us`, counting
    /// those let go and the floor.
    pub(crate) fn largest_before(&self, at_us: i64) -> u64 {
        self.marks
            .iter()
            .take_while(|m| m.at_us < at_us)
            .fold(self.floor, |acc, m| acc.max(m.iteration))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_arriving_out_of_order_are_read_in_time_order() {
        let mut r = Reached::default();
        r.keep(30, 3);
        r.keep(10, 1);
        r.keep(20, 5);
        // The latest before 25 is the mark at 20; the largest before 25 is 5.
        assert_eq!(r.latest_before(25).map(|m| m.iteration), Some(5));
        assert_eq!(r.largest_before(35), 5);
        assert_eq!(r.latest_before(35).map(|m| m.iteration), Some(3));
        // A mark's very instant is not before it.
        assert_eq!(r.latest_before(10), None);
        assert_eq!(r.largest_before(10), 0);
        assert_eq!(r.latest().map(|m| m.at_us), Some(30));
        assert_eq!(r.largest(), 5);
    }

    #[test]
    fn marks_let_go_still_answer_for_the_times_before_those_kept() {
        let mut r = Reached::default();
        for i in 0..MARKS_KEPT as u64 + 2 {
            r.keep(100 + i as i64, 1000 - i);
        }
        // The two oldest went: 1000 (the largest) and 999 (the newest of them).
        assert_eq!(r.largest_before(0), 1000);
        assert_eq!(
            r.latest_before(0),
            Some(Mark {
                at_us: 101,
                iteration: 999
            })
        );
        assert_eq!(r.largest(), 1000);
        r.raise_floor(2000);
        assert_eq!(r.largest_before(0), 2000);
        assert_eq!(r.largest(), 2000);
    }
}
