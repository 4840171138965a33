//! Test helpers shared by the store's unit tests: a store, samples of a
//! tree, marks, boundaries and a busy run with every kind of entry.

pub(super) use std::collections::BTreeMap;

pub(super) use super::limits::Limits;
pub(super) use super::pressure::Thresholds;
pub(super) use super::record::{Applied, Boundary, Mark, SampleKind};
pub(super) use super::state::Store;
pub(super) use super::Record;
pub(super) use crate::model::{Allocator, EntryKind, Exit, RunInfo};
use crate::sample::gpu::{DeviceReading, GpuSample, ProcessReading, Status as GpuStatus};
use crate::sample::host::{HostProcessReading, HostSample, Identity, Joined, Left};
pub(super) use crate::sample::{HostMemory, Sample};

pub(super) const M: u64 = 1024 * 1024;

pub(super) fn store() -> Store {
    Store::new(
        RunInfo {
            start: 100.0,
            ..RunInfo::default()
        },
        Limits::default(),
        Thresholds::default(),
    )
}

pub(super) fn sample(ts: f64, procs: &[(u32, u64)], gpu: &[(u32, u64)]) -> Box<Sample> {
    let mut s = Sample {
        timestamp: ts,
        host: HostSample {
            processes: procs
                .iter()
                .map(|&(pid, rss)| HostProcessReading {
                    pid,
                    rss: rss * M,
                    hwm: rss * M,
                    ..HostProcessReading::default()
                })
                .collect(),
            ..HostSample::default()
        },
        gpu: GpuSample {
            devices: vec![DeviceReading {
                index: 0,
                used: gpu.iter().map(|g| g.1).sum::<u64>() * M,
                total: 80_000 * M,
                free: 0,
                ..DeviceReading::default()
            }],
            processes: gpu
                .iter()
                .map(|&(pid, used)| ProcessReading {
                    pid,
                    device: 0,
                    used: Some(used * M),
                })
                .collect(),
            device_level: false,
        },
        gpu_status: GpuStatus::Sampled,
        memory: HostMemory {
            total: 1000 * M,
            available: 900 * M,
        },
        ..Sample::default()
    };
    s.host.joined = Vec::new();
    Box::new(s)
}

pub(super) fn join(s: &mut Sample, pid: u32) {
    s.host.joined.push(Joined {
        id: Identity {
            pid,
            start_ticks: u64::from(pid),
        },
        ppid: 1,
        start_time: 0.0,
        name: format!("p{pid}"),
        cmdline: vec![],
        root: pid == 10,
    });
}

/// `pid` (started at tick `pid`, as [`join`] has it) is gone from the tree.
pub(super) fn leave(s: &mut Sample, pid: u32) {
    s.host.left.push(Left {
        id: Identity {
            pid,
            start_ticks: u64::from(pid),
        },
        exit: None,
        max_rss: None,
    });
}

pub(super) fn timer(st: &mut Store, s: Box<Sample>) -> Applied {
    st.apply(&Record::Sample {
        kind: SampleKind::Timer,
        sample: s,
    })
}

pub(super) fn stage(ts: f64, name: &str, status: Option<&str>) -> Boundary {
    Boundary {
        mark: mark(ts, "stage", name),
        status: status.map(str::to_string),
        message: None,
    }
}

pub(super) fn mark(ts: f64, component: &str, operation: &str) -> Mark {
    Mark {
        timestamp: ts,
        pid: Some(10),
        component: component.into(),
        operation: operation.into(),
        iteration: None,
        labels: BTreeMap::new(),
        allocator: None,
        kind: EntryKind::Event,
    }
}

/// A run with every kind of entry: samples inside and outside spans,
/// a stage, marks with allocator figures, an exit and the finish.
pub(super) fn busy_run(st: &mut Store, marks: u32) {
    let mut s = sample(101.0, &[(10, 100), (11, 50)], &[(10, 2000)]);
    join(&mut s, 10);
    join(&mut s, 11);
    timer(st, s);
    st.apply(&Record::StageBegin(stage(101.2, "train", None)));
    for i in 0..marks {
        let t = 101.5 + f64::from(i) * 0.013;
        if i % 97 == 0 {
            timer(
                st,
                sample(t, &[(10, 100 + u64::from(i % 50)), (11, 50)], &[(10, 2500)]),
            );
        }
        let mut m = mark(t + 0.001, &format!("c{}", i % 8), "step");
        m.iteration = Some(u64::from(i));
        if i % 3 == 0 {
            m.allocator = Some(Allocator {
                allocated: (1024 + u64::from(i % 100)) * M,
                reserved: 2048 * M,
                max_allocated: 1536 * M,
                device: Some(0),
            });
        }
        if i % 100 == 0 {
            m.labels.insert("split".into(), format!("s{i}"));
            st.apply(&Record::SpanBegin(Boundary {
                mark: m.clone(),
                status: None,
                message: None,
            }));
            st.apply(&Record::SpanEnd(Boundary {
                mark: m,
                status: None,
                message: None,
            }));
        } else {
            st.apply(&Record::Mark(m));
        }
    }
    let end = 102.0 + f64::from(marks) * 0.013;
    st.apply(&Record::StageEnd(stage(end, "train", Some("SUCCESS"))));
    st.apply(&Record::Exit {
        pid: 11,
        exit: Exit::signal(9),
        max_rss: None,
    });
    st.apply(&Record::Finish {
        timestamp: end + 1.0,
        exit: Some(Exit::code(0)),
    });
}
