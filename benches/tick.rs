//! The cost of one host sampling tick against the floor, in one run.
//!
//! `cargo bench --bench tick` spawns a real process tree (1 and 16
//! processes) and times, per tick:
//! - the floor: one `pread` of a kept-open `/proc/PID/statm` per process
//!   (the least any sampler of RSS can do);
//! - memtrack's procfs sample (new-process check + statm per process), with
//!   and without the rate-limited `VmHWM` read falling due;
//! - a full engine tick: sample, store fold and journal serialization;
//! - sysinfo refreshing the same processes' memory (known PIDs only, and
//!   all processes, which is what finding new children takes).
//!
//! Each figure is the median of 31 batches; ratios are to the floor.

// A benchmark program: it prints its table and fails loudly.
#![allow(clippy::expect_used, clippy::print_stdout)]
// spawn_tree hands its child to main, which kills and reaps it.
#![allow(clippy::zombie_processes)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use memtrack::model::RunInfo;
use memtrack::sample::footprint::{self, FootprintOptions, FootprintReader, SourceChoice};
use memtrack::sample::gpu::NoGpu;
use memtrack::sample::host::HostSample;
use memtrack::sample::procfs::{ProcOptions, ProcTree};
use memtrack::sample::{Sample, Sampler};
use memtrack::store::pressure::Thresholds;
use memtrack::store::{Limits, Record, SampleKind, Store};

/// `cargo bench` passes `--bench`; `cargo test` runs this binary without
/// it, as a quick smoke run that keeps the benchmark from rotting.
fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Median time per call of `f`, from batches of about 20 ms each.
fn per_call(mut f: impl FnMut()) -> Duration {
    let (batch_ms, batches) = if full_run() { (20, 31) } else { (2, 3) };
    // Warm up and size the batch.
    let t = Instant::now();
    let mut n = 0u32;
    while t.elapsed() < Duration::from_millis(batch_ms) {
        f();
        n += 1;
    }
    let batch = n.max(1);
    let mut samples: Vec<Duration> = (0..batches)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..batch {
                f();
            }
            t.elapsed() / batch
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

fn spawn_tree(n: usize) -> (Child, Vec<u32>) {
    let script = if n == 1 {
        "exec sleep 600".to_string()
    } else {
        format!("for i in $(seq {}); do sleep 600 & done; wait", n - 1)
    };
    // Never the bench's stdout: a reader of it (bench/run) would wait for
    // every sleeper.
    let child = Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let root = child.id();
    // Wait until the whole tree exists.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut tree = tree(Duration::from_secs(3600));
        tree.add_root(root).expect("root");
        tree.sample(Instant::now(), &mut HostSample::default());
        if tree.len() == n {
            return (child, tree.pids().collect());
        }
        if Instant::now() > deadline {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
            panic!("tree of {n} did not form");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Ends a tree [`spawn_tree`] made: the children first (once the shell
/// is gone they belong to init), then the shell.
fn stop_tree(mut child: Child) {
    let _ = Command::new("pkill")
        .args(["-P", &child.id().to_string()])
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

fn tree(hwm_interval: Duration) -> ProcTree {
    ProcTree::new(ProcOptions {
        root: "/proc".into(),
        hwm_interval,
        reaper: None,
        job: None,
        smaps: None,
        read_share: 0.02,
    })
    .expect("procfs")
}

fn footprint_reader(choice: SourceChoice) -> FootprintReader {
    FootprintReader::new(
        FootprintOptions {
            choice,
            proc_root: "/proc".into(),
        },
        None,
    )
}

/// The tree's footprint at default settings (1 s interval, so the VmHWM
/// read falls due every tick): memtrack's sampler tick against the floor of
/// the same files read by hand — `statm` and `status` per process, plus
/// the cgroup's four files (cgroup) — and the Pss budget's
/// cost on its own.
fn footprint_rows(n: usize, root: u32, pids: &[u32]) {
    let statm: Vec<File> = pids
        .iter()
        .map(|p| File::open(format!("/proc/{p}/statm")).expect("statm"))
        .collect();
    // memtrack reads status (VmHWM) at the hwm cadence, from a file it
    // keeps open; so does the floor. (Its command line, read every 10 s to
    // notice an exec, is memtrack's own extra.)
    let status: Vec<File> = pids
        .iter()
        .map(|p| File::open(format!("/proc/{p}/status")).expect("status"))
        .collect();
    let mut buf = vec![0u8; 8192];
    let read_status = |buf: &mut Vec<u8>| {
        for (f, status) in statm.iter().zip(&status) {
            for file in [f, status] {
                let n = file.read_at(buf, 0).expect("pread");
                std::hint::black_box(&buf[..n]);
            }
        }
    };
    let tick = |choice: Option<memtrack::sample::cgroup::Cgroup>| {
        let mut t = tree(Duration::from_nanos(1));
        t.add_root(root).expect("root");
        let reader = match choice {
            Some(cg) => FootprintReader::with_created(
                FootprintOptions {
                    choice: SourceChoice::Auto,
                    proc_root: "/proc".into(),
                },
                cg,
            ),
            None => footprint_reader(SourceChoice::Pss),
        };
        let mut sampler = Sampler::new(
            t,
            reader,
            Box::new(NoGpu {
                reason: "bench".into(),
            }),
            None,
        );
        let mut s = Sample::default();
        sampler.sample(&mut s);
        let d = per_call(|| {
            s.host.clear();
            sampler.sample(&mut s);
            std::hint::black_box(&s);
        });
        (d, sampler)
    };

    // cgroup: needs cgroup v1's memory controller, writable (root).
    match footprint::job_cgroup(std::path::Path::new("/proc"), "bench") {
        Ok(cg) => {
            let dir = cg.dir().to_path_buf();
            let files: Vec<File> = [
                "memory.usage_in_bytes",
                "memory.stat",
                "memory.max_usage_in_bytes",
                "memory.oom_control",
            ]
            .iter()
            .map(|f| File::open(dir.join(f)).expect("cgroup file"))
            .collect();
            let floor = per_call(|| {
                read_status(&mut buf);
                for f in &files {
                    let n = f.read_at(&mut buf, 0).expect("pread");
                    std::hint::black_box(&buf[..n]);
                }
            });
            let (d, sampler) = tick(Some(cg));
            drop(sampler);
            println!(
                "| {n} | cgroup | {:.2} µs | {:.2} µs | {:.2}× |",
                us(floor),
                us(d),
                us(d) / us(floor)
            );
        }
        Err(why) => println!("| {n} | cgroup | - | - | not measured: {why} |"),
    }
    let floor = per_call(|| read_status(&mut buf));
    let (d, sampler) = tick(None);
    let (reads, took) = sampler.pss_cost();
    println!(
        "| {n} | pss (2 % budget) | {:.2} µs | {:.2} µs | {:.2}× |",
        us(floor),
        us(d),
        us(d) / us(floor)
    );
    let smaps: Vec<std::path::PathBuf> = pids
        .iter()
        .map(|p| format!("/proc/{p}/smaps_rollup").into())
        .collect();
    let one_pass = per_call(|| {
        for p in &smaps {
            let t = std::fs::read(p).expect("smaps_rollup");
            std::hint::black_box(&t);
        }
    });
    PSS_NOTES.with(|notes| {
        notes.borrow_mut().push(format!(
            "{n} processes: one smaps_rollup pass over the tree {:.1} µs; in the pss row the budget spent {reads} reads, {:.1} µs each on average",
            us(one_pass),
            if reads > 0 { us(took) / reads as f64 } else { 0.0 }
        ))
    });
}

thread_local! {
    static PSS_NOTES: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// NVML: memtrack's GPU sample against the floor of one process-list query
/// per GPU, both through nvml-wrapper, when NVML loads.
fn gpu_rows() {
    use memtrack::sample::gpu::{GpuSample, GpuSampler};
    let Ok(mut sampler) = memtrack::sample::nvml::NvmlSampler::open(None, &None) else {
        println!();
        println!("GPU: NVML not available on this machine; run this bench on a GPU machine for the NVML rows.");
        return;
    };
    let nvml = nvml_wrapper::Nvml::init().expect("nvml");
    let n = nvml.device_count().expect("count");
    let floor = per_call(|| {
        for i in 0..n {
            let d = nvml.device_by_index(i).expect("device");
            std::hint::black_box(d.running_compute_processes().expect("processes"));
        }
    });
    let mut out = GpuSample::default();
    let sample = per_call(|| {
        out.clear();
        std::hint::black_box(sampler.sample(&mut out));
    });
    let name = nvml
        .device_by_index(0)
        .and_then(|d| d.name())
        .unwrap_or_default();
    println!();
    println!("GPU ({n} x {name}): memtrack's NVML sample vs one process-list query per GPU");
    println!();
    println!("| floor: running_compute_processes per GPU | memtrack NVML sample (memory, utilization, temperature, compute + graphics lists) | ratio |");
    println!("|---|---|---|");
    println!(
        "| {:.1} µs | {:.1} µs | {:.2}× |",
        us(floor),
        us(sample),
        us(sample) / us(floor)
    );
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    if !full_run() {
        println!("(smoke run: figures are meaningless; `cargo bench --bench tick` measures)");
    }
    println!("memtrack tick cost vs the floor (median per tick, this machine)");
    println!();
    println!("| processes | floor: statm pread | memtrack sample | ratio | sample + VmHWM read | ratio | full tick (sample+store+journal) | ratio | sysinfo, known PIDs | ratio | sysinfo, all processes | ratio |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for n in [1usize, 16] {
        let (child, pids) = spawn_tree(n);
        let root = child.id();

        let files: Vec<File> = pids
            .iter()
            .map(|p| File::open(format!("/proc/{p}/statm")).expect("statm"))
            .collect();
        let mut buf = [0u8; 256];
        let floor = per_call(|| {
            for f in &files {
                let n = f.read_at(&mut buf, 0).expect("pread");
                std::hint::black_box(&buf[..n]);
            }
        });

        let mut t = tree(Duration::from_secs(3600));
        t.add_root(root).expect("root");
        let mut out = HostSample::default();
        t.sample(Instant::now(), &mut out);
        assert_eq!(t.len(), n, "the whole tree is followed");
        let sample = per_call(|| {
            out.clear();
            t.sample(Instant::now(), &mut out);
            std::hint::black_box(&out);
        });

        let mut t = tree(Duration::from_nanos(1));
        t.add_root(root).expect("root");
        let with_hwm = per_call(|| {
            out.clear();
            t.sample(Instant::now(), &mut out);
            std::hint::black_box(&out);
        });

        let mut t = tree(Duration::from_secs(3600));
        t.add_root(root).expect("root");
        let mut sampler = Sampler::new(
            t,
            footprint_reader(SourceChoice::Rss),
            Box::new(NoGpu {
                reason: "bench".into(),
            }),
            File::open("/proc/meminfo").ok(),
        );
        let mut store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
        let mut journal = Vec::with_capacity(1 << 20);
        let full = per_call(|| {
            let mut s = Sample::default();
            sampler.sample(&mut s);
            let record = Record::Sample {
                kind: SampleKind::Timer,
                sample: Box::new(s),
            };
            store.apply(&record);
            journal.clear();
            serde_json::to_writer(&mut journal, &record).expect("json");
        });

        let sys_pids: Vec<sysinfo::Pid> = pids.iter().map(|p| sysinfo::Pid::from_u32(*p)).collect();
        let mut sys = sysinfo::System::new().expect("sysinfo");
        let kind = sysinfo::ProcessRefreshKind::nothing().with_memory();
        let sysinfo_some = per_call(|| {
            sys.refresh_processes_specifics(
                sysinfo::ProcessesToUpdate::Some(&sys_pids),
                true,
                kind,
            );
        });
        let sysinfo_all = per_call(|| {
            sys.refresh_processes_specifics(sysinfo::ProcessesToUpdate::All, true, kind);
        });

        let r = |d: Duration| us(d) / us(floor);
        println!(
            "| {n} | {:.2} µs | {:.2} µs | {:.2}× | {:.2} µs | {:.2}× | {:.2} µs | {:.2}× | {:.2} µs | {:.2}× | {:.1} µs | {:.1}× |",
            us(floor),
            us(sample),
            r(sample),
            us(with_hwm),
            r(with_hwm),
            us(full),
            r(full),
            us(sysinfo_some),
            r(sysinfo_some),
            us(sysinfo_all),
            r(sysinfo_all),
        );
        stop_tree(child);
    }
    println!();
    println!(
        "The tree's footprint at default settings (VmHWM read every tick, as at a 1 s interval):"
    );
    println!(
        "memtrack's sampler tick vs the floor reading the same files by hand (median per tick)"
    );
    println!();
    println!("| processes | host source | floor: same files | memtrack sampler tick | ratio |");
    println!("|---|---|---|---|---|");
    for n in [1usize, 16] {
        let (child, pids) = spawn_tree(n);
        footprint_rows(n, child.id(), &pids);
        stop_tree(child);
    }
    println!();
    println!(
        "Pss budget, on its own (host.pss_budget = 0.02: at most 20 ms of reading per second):"
    );
    PSS_NOTES.with(|notes| {
        for line in notes.borrow().iter() {
            println!("- {line}");
        }
    });
    gpu_rows();
    println!();
    println!("goals: memtrack sample <= 2x the floor. The VmHWM read falls due once per");
    println!("host.hwm_interval (1 s): every tick at a 1 s interval, one tick in 100 at 10 ms.");
}
