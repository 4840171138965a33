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

/// A checkpointed run that leaves no fold empty: the records before its
/// checkpoint and those after it (journalled only). Before: a cgroup host
/// source, then PSS (an earlier source kept); three processes joined, one
/// described, one gone with its exit; two GPUs described, per-process and
/// device-level samples; marks with allocator figures, labels and
/// iterations; a closed and an open stage, an open span; pressure alerts;
/// a flight window; an event sample; journal errors. After: more marks,
/// a span's end and a timer sample. The run is not finished.
pub(super) fn every_fold_records() -> (Vec<Record>, Vec<Record>) {
    use crate::model::{FlightPoint, FlightWindow};

    let boundary = |m: Mark, status: Option<&str>, message: Option<&str>| Boundary {
        mark: m,
        status: status.map(str::to_string),
        message: message.map(str::to_string),
    };
    let mut before = vec![Record::Sample {
        kind: SampleKind::Timer,
        sample: first_sample(),
    }];

    let mut m = mark(101.2, "data", "load");
    m.iteration = Some(7);
    m.labels.insert("split".into(), "train".into());
    m.allocator = Some(Allocator {
        allocated: 1024 * M,
        reserved: 2048 * M,
        max_allocated: 1536 * M,
        device: Some(0),
    });
    before.push(Record::Mark(m));
    before.push(Record::StageBegin(stage(101.3, "warmup", None)));
    before.push(Record::StageEnd(boundary(
        mark(101.4, "stage", "warmup"),
        Some("SUCCESS"),
        Some("warm"),
    )));
    before.push(Record::StageBegin(stage(101.5, "train", None)));
    let mut m = mark(101.6, "model", "step");
    m.pid = Some(11);
    before.push(Record::SpanBegin(boundary(m, None, None)));

    before.push(Record::Sample {
        kind: SampleKind::Timer,
        sample: sample_in_span(),
    });
    before.push(Record::Exit {
        pid: 12,
        exit: Exit::signal(9),
        max_rss: Some(48 * M),
    });
    before.push(Record::Flight(Box::new(FlightWindow {
        reason: "signal".into(),
        timestamp: 102.1,
        pid: Some(12),
        name: "p12".into(),
        exit: Some(Exit::signal(9)),
        interval_s: 0.05,
        points: vec![FlightPoint {
            t: 102.05,
            cpu_mb: 390.0,
            gpu_mb: 70_900.0,
            processes: vec![[12.0, 30.0, 0.0]],
        }],
        cuda_summary: Some("|  allocated  |".into()),
    })));
    before.push(Record::JournalErrors { total: 2 });
    // NVML's PIDs unmatched: the devices' use, labelled.
    let mut s = sample(102.2, &[(10, 320), (11, 60)], &[(10, 60_000)]);
    s.gpu.processes.clear();
    s.gpu.device_level = true;
    before.push(Record::Sample {
        kind: SampleKind::Timer,
        sample: s,
    });
    before.push(Record::Sample {
        kind: SampleKind::Event,
        sample: sample(102.5, &[(10, 310), (11, 60)], &[(10, 50_100), (11, 800)]),
    });
    for i in 0..12u32 {
        let mut m = mark(102.6 + f64::from(i) * 0.01, &format!("c{}", i % 4), "step");
        m.iteration = Some(u64::from(i));
        m.pid = Some(10 + i % 2);
        if i % 4 < 2 {
            m.allocator = Some(Allocator {
                allocated: (900 + u64::from(i)) * M,
                reserved: 1800 * M,
                max_allocated: 1600 * M,
                device: Some(1),
            });
        }
        before.push(Record::Mark(m));
    }

    let mut after = Vec::new();
    after.push(Record::Mark(mark(103.0, "data", "load")));
    let mut m = mark(103.1, "model", "step");
    m.pid = Some(11);
    after.push(Record::SpanEnd(boundary(m, None, None)));
    after.push(Record::Sample {
        kind: SampleKind::Timer,
        sample: sample(103.5, &[(10, 200), (11, 55)], &[(10, 30_000)]),
    });
    after.push(Record::Mark(mark(103.6, "eval", "score")));
    (before, after)
}

/// [`every_fold_records`]' first sample: three processes joined, two GPUs,
/// a cgroup host source.
fn first_sample() -> Box<Sample> {
    use crate::model::HostSource;
    use crate::sample::cgroup::{CgroupReading, MemStat};
    use crate::sample::footprint::SourceInfo;
    use crate::sample::host::Footprint;

    let mut s = with_pss(sample(
        101.0,
        &[(10, 100), (11, 50), (12, 30)],
        &[(10, 2000), (11, 500), (99, 700)],
    ));
    for pid in [10, 11, 12] {
        join(&mut s, pid);
    }
    s.gpu.devices[0].utilization_pct = Some(93);
    s.gpu.devices[0].temperature_c = Some(71);
    s.gpu.devices.push(crate::sample::gpu::DeviceReading {
        index: 1,
        used: 1234 * M,
        free: 0,
        total: 40_000 * M,
        utilization_pct: Some(12),
        memory_utilization_pct: Some(4),
        temperature_c: Some(45),
    });
    s.host_source = Some(SourceInfo {
        source: HostSource::Cgroup,
        reason: "a cgroup of the job's own".into(),
        cgroup: Some("/sys/fs/cgroup/memtrack.slice/run-1".into()),
        cgroup_version: Some(2),
        cgroup_created: true,
        since: 100.5,
    });
    s.host.footprint = Some(Footprint {
        source: HostSource::Cgroup,
        used: 170 * M,
        peak: 190 * M,
        cgroup: Some(CgroupReading {
            usage: 200 * M,
            interval_peak: Some(205 * M),
            kernel_peak: Some(210 * M),
            stat: MemStat {
                anon: 150 * M,
                file: 50 * M,
                shmem: 4 * M,
                file_mapped: 9 * M,
                inactive_file: 30 * M,
                active_file: 20 * M,
            },
            oom_kills: Some(1),
        }),
        ..Footprint::default()
    });
    s
}

/// [`every_fold_records`]' second sample, inside the span: the host nearly
/// full, GPU 0 past critical; 11 is described and 12 leaves with its exit
/// and wait4 peak; the source turns to PSS.
fn sample_in_span() -> Box<Sample> {
    use crate::model::HostSource;
    use crate::sample::footprint::SourceInfo;
    use crate::sample::host::{Described, Footprint};

    let mut s = with_pss(sample(
        102.0,
        &[(10, 300), (11, 60)],
        &[(10, 70_000), (11, 900)],
    ));
    s.memory.available = 40 * M;
    s.host.described.push(Described {
        pid: 11,
        name: "python".into(),
        cmdline: vec!["python".into(), "worker.py".into()],
    });
    s.host.left.push(crate::sample::host::Left {
        id: crate::sample::host::Identity {
            pid: 12,
            start_ticks: 12,
        },
        exit: Some(Exit::code(3)),
        max_rss: Some(45 * M),
    });
    s.host_source = Some(SourceInfo {
        source: HostSource::Pss,
        reason: "the cgroup went away".into(),
        since: 101.9,
        ..SourceInfo::default()
    });
    s.host.footprint = Some(Footprint {
        source: HostSource::Pss,
        used: 340 * M,
        peak: 350 * M,
        age_s: Some(0.25),
        pss_reads: 3,
        pss_read_s: 0.125,
        ..Footprint::default()
    });
    s
}

/// Each process's Pss and USS, a little below its RSS.
fn with_pss(mut s: Box<Sample>) -> Box<Sample> {
    for p in &mut s.host.processes {
        p.pss = Some(p.rss - 3 * M);
        p.uss = Some(p.rss - 7 * M);
        p.own_read = true;
    }
    s
}

/// The run whose records [`every_fold_records`] gives.
pub(super) fn every_fold_run_info() -> RunInfo {
    RunInfo {
        id: "fold-run".into(),
        name: "every fold".into(),
        host: "node-1".into(),
        mode: "run".into(),
        command: vec!["python".into(), "train.py".into()],
        start: 100.0,
        interval_s: 0.5,
        memtrack_version: "0.1.0".into(),
        labels: BTreeMap::from([("rank".to_string(), "0".to_string())]),
        ..RunInfo::default()
    }
}

/// The GPUs of that run, described before its first checkpoint.
pub(super) fn every_fold_gpus() -> (
    Vec<crate::sample::gpu::Device>,
    Option<crate::model::GpuAttribution>,
) {
    let device = |index: u32, name: &str| crate::sample::gpu::Device {
        index,
        uuid: format!("GPU-{index}"),
        name: name.into(),
    };
    (
        vec![device(0, "H100"), device(1, "A100")],
        Some(crate::model::GpuAttribution {
            reason: "NVML's PIDs are this namespace's".into(),
            ..crate::model::GpuAttribution::default()
        }),
    )
}
