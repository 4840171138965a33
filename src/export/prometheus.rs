//! `/metrics`: the snapshot in Prometheus text format, encoded with the
//! `prometheus` crate.
//!
//! Metric families are built from the snapshot at scrape time, so the
//! series of a process that exited disappear with it (bounded cardinality)
//! and a scrape never touches the sampler. [`METRICS`] is the one list of
//! what is exported; the README's reference table is checked against it
//! and against a real scrape by the tests.

use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};

use crate::model::{AttributionMode, Gpu, GpuSource};
use crate::sample::procfs::SelfUsage;
use crate::store::snapshot::Snapshot;
use crate::units::MIB;

/// Metric types, as the reference table names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
    Histogram,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
            Kind::Histogram => "histogram",
        }
    }
}

/// One exported metric family.
#[derive(Debug, Clone, Copy)]
pub struct Def {
    pub name: &'static str,
    pub kind: Kind,
    /// Labels beyond the run labels (`run`, `host`, and `rank` when set).
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

const fn def(
    name: &'static str,
    kind: Kind,
    labels: &'static [&'static str],
    help: &'static str,
) -> Def {
    Def {
        name,
        kind,
        labels,
        help,
    }
}

use Kind::{Counter as C, Gauge as G, Histogram as H};

const PROC: &[&str] = &["pid", "name"];
const DEV: &[&str] = &["gpu", "gpu_uuid", "gpu_name"];

/// Everything `/metrics` serves.
pub const METRICS: &[Def] = &[
    def("memtrack_build_info", G, &["version", "gpu_backend"], "Always 1; the labels describe this memtrack."),
    def(
        "memtrack_run_info",
        G,
        &["every run label"],
        "Always 1; carries all of run.labels (slurm_job_id, slurm_procid, local_rank, world_size, …).",
    ),
    def("memtrack_process_resident_memory_bytes", G, PROC, "RSS of a followed process."),
    def("memtrack_process_resident_memory_high_water_bytes", G, PROC, "Kernel high-water mark (VmHWM) of a followed process."),
    def("memtrack_process_gpu_memory_bytes", G, &["pid", "name", "gpu", "gpu_uuid"], "NVML used GPU memory of a followed process on one device."),
    def("memtrack_process_proportional_memory_bytes", G, PROC, "PSS of a followed process: its share of the pages it maps."),
    def("memtrack_process_unique_memory_bytes", G, PROC, "USS of a followed process: the memory it alone holds."),
    def(
        "memtrack_process_own_memory_estimated",
        G,
        PROC,
        "1 when a process's PSS and USS are an estimate (no read reached it since it grew: its last read plus what it wrote since), 0 when read.",
    ),
    def("memtrack_tree_resident_memory_bytes", G, &[], "Host memory of the followed process tree, every page once (see memtrack_tree_memory_source)."),
    def("memtrack_tree_resident_memory_high_water_bytes", G, &[], "The tree's highest host memory since the previous sample, as the kernel saw it."),
    def("memtrack_tree_memory_source", G, &["source"], "1 for the source of the tree's host figure: pages, cgroup, pss or rss (rss counts shared pages once per process)."),
    def("memtrack_tree_gpu_memory_bytes", G, &["gpu", "gpu_uuid", "attribution"], "NVML used GPU memory of the tree on one device: attribution per-process (the tree's processes), or device-level (every process on the device: NVML's PIDs could not be matched to the tree's)."),
    def("memtrack_tree_processes", G, &[], "Processes in the followed tree."),
    def("memtrack_gpu_attribution_info", G, &["mode"], "Always 1; mode: how the run's GPU figures are attributed so far (per-process, device-level or mixed)."),
    def("memtrack_gpu_memory_used_bytes", G, DEV, "Used memory of a GPU (every process on it)."),
    def("memtrack_gpu_memory_total_bytes", G, DEV, "Total memory of a GPU."),
    def("memtrack_gpu_memory_free_bytes", G, DEV, "Free memory of a GPU."),
    def("memtrack_gpu_utilization_ratio", G, DEV, "GPU utilization (0-1) over NVML's last sample period."),
    def("memtrack_gpu_temperature_celsius", G, DEV, "GPU temperature."),
    def("memtrack_allocator_allocated_bytes", G, &["pid", "device"], "torch.cuda.memory_allocated() last sent by a process."),
    def("memtrack_allocator_reserved_bytes", G, &["pid", "device"], "torch.cuda.memory_reserved() last sent by a process."),
    def("memtrack_allocator_max_allocated_bytes", G, &["pid", "device"], "torch.cuda.max_memory_allocated() last sent by a process."),
    def("memtrack_host_memory_total_bytes", G, &[], "Host RAM (MemTotal)."),
    def("memtrack_host_memory_available_bytes", G, &[], "Host RAM available (MemAvailable)."),
    def("memtrack_peak_memory_bytes", G, &["figure"], "Run peak of each memory_usage.json figure (cpu_ram_used, cpu_ram_hwm, gpu_ram_used, gpu_ram_peak, reserved_gpu_ram, gpu_process_used; the gpu ones only when the run has GPU memory)."),
    def("memtrack_component_peak_memory_bytes", G, &["component", "figure"], "Peak of each figure over the samples attributed to a component."),
    def("memtrack_events_total", C, &["component", "operation"], "Events (marks and span boundaries) recorded; a stage's boundaries count in no component (see memtrack_current_stage); before the first, one series at 0 without these labels."),
    def("memtrack_pressure_level", G, &["resource"], "Memory pressure: 0 normal, 1 high, 2 critical, 3 emergency."),
    def(
        "memtrack_seconds_to_limit",
        G,
        &["resource", "limit"],
        "Time to OOM: at the recent growth rate, seconds until the resource reaches its limit (host: the job's memory limit, on the cgroup's charge, else the host's available memory; gpuN: the GPU's total); absent while it does not climb steadily.",
    ),
    def("memtrack_open_spans", G, &[], "Spans open now."),
    def("memtrack_open_stages", G, &[], "Stages open now."),
    def("memtrack_last_sample_timestamp_seconds", G, &[], "Unix time of the latest sample."),
    def("memtrack_run_start_timestamp_seconds", G, &[], "Unix time the run started."),
    def("memtrack_interval_seconds", G, &[], "The timer period."),
    def("memtrack_current_stage", G, &["stage"], "1 for each stage the job began and has not ended yet."),
    def(
        "memtrack_leak_suspected",
        G,
        &["memory"],
        "memtrack's leak verdict on the tree's host or gpu memory: 1 suspected, 0 judged and not; absent until the run is long enough to judge (20 s and 12 samples after warm-up).",
    ),
    def("memtrack_leak_growth_bytes", G, &["memory"], "Growth over the window the leak rule judged, for each judged series of the tree."),
    def(
        "memtrack_process_leak_suspected",
        G,
        &["pid", "name", "memory"],
        "The leak verdict on one followed process long enough to judge (host memory; gpu where it had any): 1 suspected, 0 not.",
    ),
    def("memtrack_rerun_host_memory_bytes", G, &[], "What a re-run needs in host RAM: the tree's peak so far plus 10 % headroom."),
    def("memtrack_rerun_gpu_memory_bytes", G, &[], "What a re-run needs on one GPU: the largest per-device peak so far plus 10 % headroom (absent without GPU memory)."),
    def("memtrack_self_resident_memory_bytes", G, &[], "RSS of memtrack itself."),
    def("memtrack_self_cpu_seconds_total", C, &[], "CPU time memtrack itself has used (user + system)."),
    def("memtrack_tick_duration_seconds", H, &[], "Time one sample took."),
    def("memtrack_ticks_total", C, &[], "Timer samples taken."),
    def("memtrack_missed_ticks_total", C, &[], "Timer slots skipped because a tick overran."),
    def("memtrack_dropped_events_total", C, &[], "Events dropped (the daemon's queue stayed full)."),
    def("memtrack_protocol_errors_total", C, &[], "Socket messages refused as malformed or invalid."),
    def("memtrack_socket_refused_peers_total", C, &[], "Socket peers of another user, refused."),
    def("memtrack_socket_rejected_connections_total", C, &[], "Socket connections beyond the limit, closed."),
    def("memtrack_socket_slow_clients_total", C, &[], "Socket clients that stopped reading their replies (sent no more; their messages still recorded)."),
    def(
        "memtrack_folded_total",
        C,
        &["dimension"],
        "Names a job sent beyond a cardinality bound (log.max_*): component (entries counted under _other), event_kind, span (not opened), stage (dropped).",
    ),
    def("memtrack_http_cleanup_throttled_total", C, &[], "POST /cleanup-memory refused with 429 (at most one cleanup per 5 s)."),
    def("memtrack_http_evicted_connections_total", C, &[], "Idle or slow HTTP connections closed to make room for new ones."),
    def("memtrack_nvml_up", G, &[], "1 when NVML answered at the latest sample."),
    def("memtrack_nvml_errors_total", C, &[], "Samples whose GPU figures failed."),
    def("memtrack_export_errors_total", C, &["exporter"], "Failed exports (checkpoint, journal, clearml, s3)."),
];

struct Families {
    run_labels: Vec<(String, String)>,
    out: Vec<MetricFamily>,
}

impl Families {
    fn family(&mut self, name: &str) -> &mut MetricFamily {
        let def = METRICS
            .iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| unreachable!("{name} is in METRICS"));
        if self.out.last().map(MetricFamily::name) != Some(name) {
            let mut f = MetricFamily::default();
            f.set_name(name.to_string());
            f.set_help(def.help.to_string());
            f.set_field_type(match def.kind {
                Kind::Gauge => MetricType::GAUGE,
                Kind::Counter => MetricType::COUNTER,
                Kind::Histogram => MetricType::HISTOGRAM,
            });
            self.out.push(f);
        }
        let n = self.out.len() - 1;
        &mut self.out[n]
    }

    fn labels(&self, extra: &[(&str, String)]) -> Vec<LabelPair> {
        self.run_labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .chain(extra.iter().map(|(k, v)| (*k, v.clone())))
            .map(|(k, v)| {
                let mut l = LabelPair::default();
                l.set_name(k.to_string());
                // Label values come from the job (names, labels, the
                // command line): a control or bidirectional character is
                // written as a visible `\u{1b}`, as on the terminal.
                l.set_value(crate::logging::terminal::escape(&v).into_owned());
                l
            })
            .collect()
    }

    fn gauge(&mut self, name: &str, extra: &[(&str, String)], value: f64) {
        let mut m = Metric::from_label(self.labels(extra));
        let mut g = Gauge::default();
        g.set_value(value);
        m.set_gauge(g);
        self.family(name).mut_metric().push(m);
    }

    fn counter(&mut self, name: &str, extra: &[(&str, String)], value: f64) {
        let mut m = Metric::from_label(self.labels(extra));
        let mut c = Counter::default();
        c.set_value(value);
        m.set_counter(c);
        self.family(name).mut_metric().push(m);
    }
}

/// The run labels every series carries.
pub(crate) fn run_labels(snap: &Snapshot) -> Vec<(String, String)> {
    let mut l = vec![
        ("run".to_string(), snap.run.name.clone()),
        ("host".to_string(), snap.run.host.clone()),
    ];
    if let Some(rank) = snap.run.labels.get("rank") {
        l.push(("rank".to_string(), rank.clone()));
    }
    l
}

/// What the HTTP server counted itself, read at scrape time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerCounters {
    pub cleanup_throttled: u64,
    pub connections_evicted: u64,
}

/// The snapshot as metric families, in [`METRICS`] order (the server's
/// own counters at 0).
pub fn families(snap: &Snapshot, me: Option<SelfUsage>) -> Vec<MetricFamily> {
    families_with(snap, me, &ServerCounters::default())
}

/// The snapshot and the server's counters as metric families, in
/// [`METRICS`] order. Device-level GPU series are left out while NVML does
/// not answer: no data rather than the last values of a lost GPU.
pub(crate) fn families_with(
    snap: &Snapshot,
    me: Option<SelfUsage>,
    server: &ServerCounters,
) -> Vec<MetricFamily> {
    let mut f = Families {
        run_labels: run_labels(snap),
        out: Vec::new(),
    };
    // Device-level GPU series only while NVML answers.
    let gpus: &[Gpu] = if snap.nvml_up { &snap.gpus } else { &[] };
    info(&mut f, snap);
    processes(&mut f, snap);
    tree(&mut f, snap, gpus);
    devices(&mut f, gpus);
    allocator(&mut f, snap);
    host_memory(&mut f, snap);
    peaks(&mut f, snap);
    events(&mut f, snap);
    run_state(&mut f, snap);
    verdicts(&mut f, snap);
    if let Some(me) = me {
        self_usage(&mut f, me);
    }
    tick_histogram(&mut f, snap);
    collector_counters(&mut f, snap);
    server_counters(&mut f, server);
    nvml(&mut f, snap);
    export_errors(&mut f, snap);
    f.out.retain(|fam| !fam.get_metric().is_empty());
    f.out
}

/// Build and run identity: `memtrack_build_info`, and every run label on one
/// `memtrack_run_info` series.
fn info(f: &mut Families, snap: &Snapshot) {
    let version = env!("CARGO_PKG_VERSION").to_string();
    let backend = snap.run.gpu_backend.kind().to_string();
    f.gauge(
        "memtrack_build_info",
        &[("version", version), ("gpu_backend", backend)],
        1.0,
    );
    // All run labels on one info series, not on every series: SLURM and
    // torchrun variables stay queryable (join on run) at no cardinality cost.
    let info: Vec<(&str, String)> = snap
        .run
        .labels
        .iter()
        .filter(|(k, _)| {
            !matches!(k.as_str(), "run" | "host" | "rank") && crate::model::valid_label_name(k)
        })
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    f.gauge("memtrack_run_info", &info, 1.0);
}

/// Per-process figures of the live tree: resident memory, its high water, GPU
/// memory per device, PSS and USS.
fn processes(f: &mut Families, snap: &Snapshot) {
    let proc_labels = |p: &crate::store::snapshot::ProcessNow| {
        [("pid", p.pid.to_string()), ("name", p.name.clone())]
    };
    for p in &snap.processes {
        f.gauge(
            "memtrack_process_resident_memory_bytes",
            &proc_labels(p),
            p.rss_bytes as f64,
        );
    }
    for p in &snap.processes {
        f.gauge(
            "memtrack_process_resident_memory_high_water_bytes",
            &proc_labels(p),
            p.hwm_bytes as f64,
        );
    }
    let uuid = |index: u32| {
        snap.gpus
            .iter()
            .find(|g| g.index == index)
            .map(|g| g.uuid.clone())
            .unwrap_or_default()
    };
    for p in &snap.processes {
        for (dev, bytes) in &p.gpu_bytes {
            let labels = [
                ("pid", p.pid.to_string()),
                ("name", p.name.clone()),
                ("gpu", dev.to_string()),
                ("gpu_uuid", uuid(*dev)),
            ];
            f.gauge("memtrack_process_gpu_memory_bytes", &labels, *bytes as f64);
        }
    }
    for p in &snap.processes {
        if let Some(pss) = p.pss_bytes {
            f.gauge(
                "memtrack_process_proportional_memory_bytes",
                &proc_labels(p),
                pss as f64,
            );
        }
    }
    for p in &snap.processes {
        if let Some(uss) = p.uss_bytes {
            f.gauge(
                "memtrack_process_unique_memory_bytes",
                &proc_labels(p),
                uss as f64,
            );
        }
    }
    for p in &snap.processes {
        if p.uss_bytes.is_some() {
            f.gauge(
                "memtrack_process_own_memory_estimated",
                &proc_labels(p),
                f64::from(u8::from(p.own_estimated)),
            );
        }
    }
}

/// The tree as a whole: its footprint, peak, source, GPU memory per device and
/// process count.
fn tree(f: &mut Families, snap: &Snapshot, gpus: &[Gpu]) {
    f.gauge(
        "memtrack_tree_resident_memory_bytes",
        &[],
        snap.current.cpu_used_mb * MIB,
    );
    f.gauge(
        "memtrack_tree_resident_memory_high_water_bytes",
        &[],
        snap.current.cpu_hwm_mb * MIB,
    );
    f.gauge(
        "memtrack_tree_memory_source",
        &[("source", snap.current.host_source.as_str().to_string())],
        1.0,
    );
    let attribution = if snap.current.gpu_source == GpuSource::Device {
        AttributionMode::DeviceLevel
    } else {
        AttributionMode::PerProcess
    };
    for g in gpus {
        f.gauge(
            "memtrack_tree_gpu_memory_bytes",
            &[
                ("gpu", g.index.to_string()),
                ("gpu_uuid", g.uuid.clone()),
                ("attribution", attribution.as_str().to_string()),
            ],
            g.tree_used_mb * MIB,
        );
    }
    f.gauge("memtrack_tree_processes", &[], snap.processes.len() as f64);
    if let Some(a) = &snap.gpu_attribution {
        f.gauge(
            "memtrack_gpu_attribution_info",
            &[("mode", a.mode.as_str().to_string())],
            1.0,
        );
    }
}

/// Device-level GPU figures: memory used, total and free, utilization,
/// temperature.
fn devices(f: &mut Families, gpus: &[Gpu]) {
    let dev = |g: &Gpu| {
        [
            ("gpu", g.index.to_string()),
            ("gpu_uuid", g.uuid.clone()),
            ("gpu_name", g.name.clone()),
        ]
    };
    for g in gpus {
        f.gauge("memtrack_gpu_memory_used_bytes", &dev(g), g.used_mb * MIB);
    }
    for g in gpus {
        f.gauge("memtrack_gpu_memory_total_bytes", &dev(g), g.total_mb * MIB);
    }
    for g in gpus {
        f.gauge(
            "memtrack_gpu_memory_free_bytes",
            &dev(g),
            (g.total_mb - g.used_mb).max(0.0) * MIB,
        );
    }
    for g in gpus {
        f.gauge(
            "memtrack_gpu_utilization_ratio",
            &dev(g),
            g.utilization_pct / 100.0,
        );
    }
    for g in gpus {
        f.gauge("memtrack_gpu_temperature_celsius", &dev(g), g.temperature_c);
    }
}

/// The allocator figures each process sent last.
fn allocator(f: &mut Families, snap: &Snapshot) {
    let alloc = |a: &crate::store::snapshot::AllocatorNow| {
        [
            ("pid", a.pid.to_string()),
            (
                "device",
                a.figures.device.map(|d| d.to_string()).unwrap_or_default(),
            ),
        ]
    };
    for a in &snap.allocator {
        f.gauge(
            "memtrack_allocator_allocated_bytes",
            &alloc(a),
            a.figures.allocated as f64,
        );
    }
    for a in &snap.allocator {
        f.gauge(
            "memtrack_allocator_reserved_bytes",
            &alloc(a),
            a.figures.reserved as f64,
        );
    }
    for a in &snap.allocator {
        f.gauge(
            "memtrack_allocator_max_allocated_bytes",
            &alloc(a),
            a.figures.max_allocated as f64,
        );
    }
}

/// The host's memory, once read.
fn host_memory(f: &mut Families, snap: &Snapshot) {
    if snap.host_memory.total > 0 {
        f.gauge(
            "memtrack_host_memory_total_bytes",
            &[],
            snap.host_memory.total as f64,
        );
        f.gauge(
            "memtrack_host_memory_available_bytes",
            &[],
            snap.host_memory.available as f64,
        );
    }
}

/// Whether the run has GPU memory to speak of: a GPU seen, or a GPU
/// figure above 0 (PyTorch's allocator figures come without NVML too).
fn has_gpu(snap: &Snapshot) -> bool {
    !snap.gpus.is_empty() || snap.peaks.any_gpu()
}

/// Peaks of the run and of each component, per figure; the GPU figures
/// only when the run has GPU memory (no series that can only read 0).
fn peaks(f: &mut Families, snap: &Snapshot) {
    let gpu = has_gpu(snap);
    let figures = |p: &crate::model::Peaks| {
        [
            ("cpu_ram_used", p.figures.cpu_ram_used_mb),
            ("cpu_ram_hwm", p.figures.cpu_ram_hwm_mb),
            ("gpu_ram_used", p.figures.gpu_ram_used_mb),
            ("gpu_ram_peak", p.figures.gpu_ram_peak_mb),
            ("reserved_gpu_ram", p.figures.reserved_gpu_ram_mb),
            ("gpu_process_used", p.figures.gpu_process_used_mb),
        ]
        .into_iter()
        .filter(move |(figure, _)| gpu || figure.starts_with("cpu_"))
    };
    for (figure, mb) in figures(&snap.peaks) {
        f.gauge(
            "memtrack_peak_memory_bytes",
            &[("figure", figure.to_string())],
            mb * MIB,
        );
    }
    for (component, peaks) in &snap.by_component {
        for (figure, mb) in figures(peaks) {
            f.gauge(
                "memtrack_component_peak_memory_bytes",
                &[
                    ("component", component.clone()),
                    ("figure", figure.to_string()),
                ],
                mb * MIB,
            );
        }
    }
}

/// Events per component and operation (0 before the first).
fn events(f: &mut Families, snap: &Snapshot) {
    if snap.events.is_empty() {
        // Served from the start, so that a dashboard reads 0, not "No data",
        // before the first event.
        f.counter("memtrack_events_total", &[], 0.0);
    }
    for (component, ops) in &snap.events {
        for (operation, n) in ops {
            f.counter(
                "memtrack_events_total",
                &[
                    ("component", component.clone()),
                    ("operation", operation.clone()),
                ],
                *n as f64,
            );
        }
    }
}

/// Pressure levels, open spans and stages, and the run's clock.
fn run_state(f: &mut Families, snap: &Snapshot) {
    for (resource, level) in &snap.levels {
        f.gauge(
            "memtrack_pressure_level",
            &[("resource", resource.clone())],
            f64::from(level.as_number()),
        );
    }
    for fc in &snap.forecasts {
        f.gauge(
            "memtrack_seconds_to_limit",
            &[
                ("resource", fc.resource.clone()),
                ("limit", fc.limit.clone()),
            ],
            fc.seconds,
        );
    }
    f.gauge("memtrack_open_spans", &[], snap.open_spans.len() as f64);
    f.gauge("memtrack_open_stages", &[], snap.open_stages.len() as f64);
    f.gauge(
        "memtrack_last_sample_timestamp_seconds",
        &[],
        snap.current.timestamp,
    );
    f.gauge("memtrack_run_start_timestamp_seconds", &[], snap.run.start);
    f.gauge("memtrack_interval_seconds", &[], snap.run.interval_s);
}

/// What memtrack concluded so far: the stages open now, the leak verdicts
/// of the tree and of each process, and what a re-run needs.
fn verdicts(f: &mut Families, snap: &Snapshot) {
    for stage in &snap.open_stages {
        f.gauge("memtrack_current_stage", &[("stage", stage.clone())], 1.0);
    }
    let flag = |suspected: bool| if suspected { 1.0 } else { 0.0 };
    let tree: Vec<(&str, &crate::model::leak::Verdict)> = snap
        .leak
        .iter()
        .flat_map(|l| {
            l.host
                .iter()
                .map(|v| ("host", v))
                .chain(l.gpu.iter().map(|v| ("gpu", v)))
        })
        .filter(|(_, v)| v.judged)
        .collect();
    for (memory, v) in &tree {
        f.gauge(
            "memtrack_leak_suspected",
            &[("memory", (*memory).to_string())],
            flag(v.suspected),
        );
    }
    for (memory, v) in &tree {
        f.gauge(
            "memtrack_leak_growth_bytes",
            &[("memory", (*memory).to_string())],
            v.growth_mib * MIB,
        );
    }
    let targets = snap.leak.iter().flat_map(|l| l.targets.iter().flatten());
    for t in targets {
        let verdicts = std::iter::once(("host", &t.host)).chain(t.gpu.iter().map(|g| ("gpu", g)));
        for (memory, v) in verdicts.filter(|(_, v)| v.judged) {
            f.gauge(
                "memtrack_process_leak_suspected",
                &[
                    ("pid", t.pid.to_string()),
                    ("name", t.name.clone()),
                    ("memory", memory.to_string()),
                ],
                flag(v.suspected),
            );
        }
    }
    if snap.needs.min_host_ram_mb > 0.0 {
        f.gauge(
            "memtrack_rerun_host_memory_bytes",
            &[],
            snap.needs.min_host_ram_mb * MIB,
        );
    }
    if snap.needs.min_gpu_mb > 0.0 {
        f.gauge(
            "memtrack_rerun_gpu_memory_bytes",
            &[],
            snap.needs.min_gpu_mb * MIB,
        );
    }
}

/// memtrack's own memory and CPU time.
fn self_usage(f: &mut Families, me: SelfUsage) {
    f.gauge(
        "memtrack_self_resident_memory_bytes",
        &[],
        me.rss_bytes as f64,
    );
    f.counter("memtrack_self_cpu_seconds_total", &[], me.cpu_seconds);
}

/// How long ticks took.
fn tick_histogram(f: &mut Families, snap: &Snapshot) {
    let h = &snap.tick_seconds;
    let mut hist = Histogram::default();
    hist.set_sample_count(h.count);
    hist.set_sample_sum(h.sum);
    hist.set_bucket(
        h.bounds
            .iter()
            .zip(&h.cumulative)
            .map(|(bound, n)| {
                let mut b = Bucket::default();
                b.set_upper_bound(*bound);
                b.set_cumulative_count(*n);
                b
            })
            .collect(),
    );
    let mut m = Metric::from_label(f.labels(&[]));
    m.set_histogram(hist);
    f.family("memtrack_tick_duration_seconds")
        .mut_metric()
        .push(m);
}

/// What the daemon counted: ticks, dropped and refused messages, folded
/// dimensions.
fn collector_counters(f: &mut Families, snap: &Snapshot) {
    let c = &snap.counters;
    f.counter("memtrack_ticks_total", &[], c.ticks as f64);
    f.counter("memtrack_missed_ticks_total", &[], c.missed_ticks as f64);
    f.counter(
        "memtrack_dropped_events_total",
        &[],
        c.dropped_events as f64,
    );
    f.counter(
        "memtrack_protocol_errors_total",
        &[],
        c.protocol_errors as f64,
    );
    f.counter(
        "memtrack_socket_refused_peers_total",
        &[],
        c.refused_peers as f64,
    );
    f.counter(
        "memtrack_socket_rejected_connections_total",
        &[],
        c.rejected_connections as f64,
    );
    f.counter(
        "memtrack_socket_slow_clients_total",
        &[],
        c.slow_clients as f64,
    );
    for (dimension, n) in [
        ("component", c.components_folded),
        ("event_kind", c.event_kinds_folded),
        ("span", c.spans_untracked),
        ("stage", c.stages_dropped),
    ] {
        f.counter(
            "memtrack_folded_total",
            &[("dimension", dimension.to_string())],
            n as f64,
        );
    }
}

/// The HTTP server's own counters.
fn server_counters(f: &mut Families, server: &ServerCounters) {
    f.counter(
        "memtrack_http_cleanup_throttled_total",
        &[],
        server.cleanup_throttled as f64,
    );
    f.counter(
        "memtrack_http_evicted_connections_total",
        &[],
        server.connections_evicted as f64,
    );
}

/// Whether NVML answers, and its errors.
fn nvml(f: &mut Families, snap: &Snapshot) {
    f.gauge(
        "memtrack_nvml_up",
        &[],
        if snap.nvml_up { 1.0 } else { 0.0 },
    );
    f.counter(
        "memtrack_nvml_errors_total",
        &[],
        snap.counters.nvml_errors as f64,
    );
}

/// Errors per exporter, checkpoint and journal included.
fn export_errors(f: &mut Families, snap: &Snapshot) {
    let c = &snap.counters;
    let mut errors = snap.export_errors.clone();
    errors
        .entry("checkpoint".into())
        .or_insert(c.checkpoint_errors);
    errors.entry("journal".into()).or_insert(c.journal_errors);
    for (exporter, n) in errors {
        f.counter(
            "memtrack_export_errors_total",
            &[("exporter", exporter)],
            n as f64,
        );
    }
}

/// The text exposition of a snapshot.
pub fn render(snap: &Snapshot, me: Option<SelfUsage>) -> Vec<u8> {
    render_with(snap, me, &ServerCounters::default())
}

/// [`render`] with the HTTP server's own counters.
pub fn render_with(snap: &Snapshot, me: Option<SelfUsage>, server: &ServerCounters) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 * 1024);
    // Encoding our own well-formed families cannot fail; an empty body
    // would still be a valid scrape.
    let _ = TextEncoder::new().encode(&families_with(snap, me, server), &mut out);
    out
}

/// The `Content-Type` of [`render`]'s output.
pub(crate) fn content_type() -> &'static str {
    prometheus::TEXT_FORMAT
}

/// The README's reference table rows, generated from [`METRICS`].
pub fn reference_table() -> String {
    let mut s = String::from("| metric | type | labels | meaning |\n|---|---|---|---|\n");
    for d in METRICS {
        let labels = if d.labels.is_empty() {
            "—".to_string()
        } else {
            d.labels.join(", ")
        };
        s.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            d.name,
            d.kind.as_str(),
            labels,
            d.help
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::snapshot::ProcessNow;

    #[test]
    fn every_family_is_declared_once_with_the_conventions() {
        let mut names: Vec<&str> = METRICS.iter().map(|d| d.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), METRICS.len());
        for d in METRICS {
            assert!(d.name.starts_with("memtrack_"), "{}", d.name);
            match d.kind {
                Kind::Counter => assert!(d.name.ends_with("_total"), "{}", d.name),
                _ => assert!(!d.name.ends_with("_total"), "{}", d.name),
            }
            assert!(!d.help.is_empty());
        }
    }

    #[test]
    fn a_lost_gpu_leaves_no_stale_series() {
        let mut snap = Snapshot::default();
        snap.gpus.push(crate::model::Gpu {
            index: 0,
            used_mb: 1500.0,
            total_mb: 80_000.0,
            tree_used_mb: 1500.0,
            ..Default::default()
        });
        snap.nvml_up = true;
        let text = String::from_utf8(render(&snap, None)).unwrap();
        assert!(text.contains("memtrack_gpu_memory_used_bytes{"), "{text}");
        snap.nvml_up = false;
        let text = String::from_utf8(render(&snap, None)).unwrap();
        assert!(!text.contains("memtrack_gpu_memory_used_bytes{"), "{text}");
        assert!(!text.contains("memtrack_tree_gpu_memory_bytes{"), "{text}");
        assert!(
            text.contains("memtrack_nvml_up{run=\"\",host=\"\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn dead_processes_have_no_series() {
        let mut snap = Snapshot::default();
        snap.run.name = "r".into();
        snap.processes.push(ProcessNow {
            pid: 7,
            name: "python3".into(),
            rss_bytes: 1024,
            ..ProcessNow::default()
        });
        snap.processes.push(ProcessNow {
            pid: 8,
            name: "python3".into(),
            rss_bytes: 1024,
            uss_bytes: Some(512),
            pss_bytes: Some(768),
            own_estimated: true,
            ..ProcessNow::default()
        });
        let text = String::from_utf8(render(&snap, None)).unwrap();
        assert!(text.contains("memtrack_process_resident_memory_bytes{run=\"r\",host=\"\",pid=\"7\",name=\"python3\"} 1024"), "{text}");
        // An own cost is marked read or estimated; none, no mark.
        assert!(text.contains("memtrack_process_own_memory_estimated{run=\"r\",host=\"\",pid=\"8\",name=\"python3\"} 1"), "{text}");
        assert!(
            !text.contains("memtrack_process_own_memory_estimated{run=\"r\",host=\"\",pid=\"7\""),
            "{text}"
        );
        snap.processes.clear();
        let text = String::from_utf8(render(&snap, None)).unwrap();
        assert!(!text.contains("pid=\"7\""), "{text}");
    }
}
