//! Scrape cost against the encoding floor, in one run.
//!
//! `cargo bench --bench scrape` builds a snapshot of 64 processes on 8 GPUs
//! (every process on every device, 20 components) and times:
//! - the floor: the `prometheus` crate's text encoder on the metric
//!   families already built (what any exporter of these series must pay);
//! - memtrack's render: families built from the snapshot, then encoded;
//! - a full `GET /metrics` over loopback TCP against memtrack's HTTP server.

// A benchmark program: it prints its table and fails loudly.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::print_stdout)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::prometheus::{Encoder, TextEncoder};
use memtrack::export::{http, prometheus};
use memtrack::model::{Figures, Gpu, Peaks};
use memtrack::store::snapshot::{ProcessNow, Snapshot};

fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    s.run.name = "bench".into();
    s.run.host = "node-1".into();
    s.run.labels.insert("rank".into(), "0".into());
    s.gpus = (0..8)
        .map(|i| Gpu {
            index: i,
            uuid: format!("GPU-{i:08x}-0000-4000-8000-000000000000"),
            name: "NVIDIA H100 80GB HBM3".into(),
            total_mb: 81559.0,
            used_mb: 40000.0,
            tree_used_mb: 30000.0,
            utilization_pct: 87.0,
            temperature_c: 61.0,
            ..Gpu::default()
        })
        .collect();
    s.processes = (0..64)
        .map(|p| ProcessNow {
            pid: 10_000 + p,
            ppid: 9_999,
            name: format!("python3-worker-{p}"),
            rss_bytes: 2 << 30,
            hwm_bytes: 3 << 30,
            peak_rss_bytes: 3 << 30,
            gpu_bytes: (0..8).map(|d| (d, 1u64 << 30)).collect(),
            ..ProcessNow::default()
        })
        .collect();
    s.by_component = (0..20)
        .map(|c| {
            (
                format!("component_{c}"),
                Peaks {
                    figures: Figures {
                        cpu_ram_used_mb: 1000.0,
                        ..Figures::default()
                    },
                    ..Peaks::default()
                },
            )
        })
        .collect();
    let mut events = BTreeMap::new();
    for c in 0..20 {
        let ops: BTreeMap<String, u64> = (0..4).map(|o| (format!("op_{o}"), 100)).collect();
        events.insert(format!("component_{c}"), ops);
    }
    s.events = events;
    s
}

fn median(mut f: impl FnMut(), runs: usize) -> Duration {
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

fn main() {
    let runs = if full_run() { 301 } else { 5 };
    if !full_run() {
        println!("(smoke run: figures are meaningless; `cargo bench --bench scrape` measures)");
    }
    let snap = snapshot();
    let families = prometheus::families(&snap, None);
    let series: usize = families.iter().map(|f| f.get_metric().len()).sum();
    let bytes = prometheus::render(&snap, None).len();

    let floor = median(
        || {
            let mut out = Vec::with_capacity(bytes);
            TextEncoder::new().encode(&families, &mut out).unwrap();
            std::hint::black_box(out);
        },
        runs,
    );
    let render = median(
        || {
            std::hint::black_box(prometheus::render(&snap, None));
        },
        runs,
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (_tx, rx) = tokio::sync::watch::channel(Arc::new(snap));
    let (_stop, stop_rx) = tokio::sync::watch::channel(false);
    rt.spawn(http::serve(
        listener,
        http::HttpState {
            snapshots: rx,
            notices: None,
        },
        64,
        stop_rx,
    ));
    let scrape = || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut body = Vec::with_capacity(bytes + 512);
        s.read_to_end(&mut body).unwrap();
        assert!(body.starts_with(b"HTTP/1.1 200"));
    };
    scrape();
    let http = median(scrape, runs);

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("scrape cost: 64 processes x 8 GPUs = {series} series, {} KiB of text (median, this machine)", bytes / 1024);
    println!();
    println!("| | time | ratio to the floor |");
    println!("|---|---|---|");
    println!(
        "| floor: encode prebuilt families (prometheus crate) | {:.3} ms | 1.00× |",
        ms(floor)
    );
    println!(
        "| memtrack render (families from the snapshot + encode) | {:.3} ms | {:.2}× |",
        ms(render),
        ms(render) / ms(floor)
    );
    println!(
        "| full GET /metrics over loopback | {:.3} ms | {:.2}× |",
        ms(http),
        ms(http) / ms(floor)
    );
    drop(rt);
}
