//! `plot`: the timeline picture. A rich run built in code, a bare
//! file and a real job are drawn as SVG and PNG; the SVG is read back for
//! its series, phases, stages, peaks and alerts, the PNG's header for its
//! size.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use memtrack::model::{
    Alert, Document, Entry, EntryKind, Exit, Gpu, GpuSource, Peaks, RunInfo, Stage, Target,
};
use memtrack::report::plot::{plot, ImageFormat, PlotError, PlotOptions};

use crate::common::{memtrack, only_document, python, run_to_end, scratch, stderr};

const T0: f64 = 1_700_000_000.0;

/// The width and height from a PNG's IHDR chunk, after checking the
/// signature and the chunk's CRC.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(
        bytes.len() > 33,
        "too short for a PNG: {} bytes",
        bytes.len()
    );
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[8..12], &13u32.to_be_bytes(), "IHDR length");
    assert_eq!(&bytes[12..16], b"IHDR", "first chunk is IHDR");
    let be = |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    // CRC-32 (ISO-HDLC) over the chunk type and data.
    let mut crc = 0xFFFF_FFFFu32;
    for &b in &bytes[12..29] {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    assert_eq!(!crc, be(29), "IHDR CRC");
    assert_eq!(
        &bytes[bytes.len() - 8..bytes.len() - 4],
        b"IEND",
        "ends with IEND"
    );
    (be(16), be(20))
}

/// The visible text of an SVG: every `<text>` element's content, unescaped.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let body = &t[t.find('>')? + 1..];
            Some(body[..body.find("</text>")?].to_string())
        })
        .map(|t| {
            t.replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&quot;", "\"")
                .replace("&apos;", "'")
                .replace("&amp;", "&")
        })
        .collect()
}

fn assert_has(texts: &[String], wanted: &str) {
    assert!(
        texts.iter().any(|t| t.contains(wanted)),
        "no text containing {wanted:?} in the SVG; texts: {texts:#?}"
    );
}

fn entry(kind: EntryKind, component: &str, operation: &str, t: f64) -> Entry {
    Entry {
        component: component.into(),
        operation: operation.into(),
        timestamp: T0 + t,
        kind,
        ..Entry::default()
    }
}

/// A ten-minute training run: a root process, eight workers (so "others"
/// is needed), phases of three components, three stages (one failed),
/// host and GPU alerts, NVML and allocator figures, and a slow host leak.
fn rich_document() -> Document {
    let duration = 600.0;
    let mut doc = Document {
        schema: 1,
        run: RunInfo {
            id: "0123abcd".into(),
            name: "bs128-lr3e-4".into(),
            host: "gpu-node-07".into(),
            mode: "run".into(),
            command: vec![
                "python".into(),
                "train.py".into(),
                "--batch-size".into(),
                "128".into(),
            ],
            start: T0,
            end: Some(T0 + duration),
            exit: Some(Exit::code(1)),
            status: "finished".into(),
            labels: BTreeMap::new(),
            interval_s: 1.0,
            memtrack_version: "0.1.0".into(),
            gpu_backend: "nvml".into(),
            ..RunInfo::default()
        },
        ..Document::default()
    };
    let rss = |t: f64| -> f64 {
        // load the model in 30 s, then a 1.5 MiB/s leak in the root, and
        // an evaluation bump at the end
        let load = 2400.0 * (t / 30.0).min(1.0);
        let leak = if t > 30.0 { 1.5 * (t - 30.0) } else { 0.0 };
        let eval = if t > 480.0 { 900.0 } else { 0.0 };
        300.0 + load + leak + eval + 40.0 * ((t * 0.7).sin())
    };
    let gpu = |t: f64| -> f64 {
        if t < 20.0 {
            0.0
        } else if t < 60.0 {
            9000.0 * (t - 20.0) / 40.0
        } else if t < 470.0 {
            // activations while a train step runs
            let in_step = t >= 66.5 && (t - 60.0) % 30.0 >= 6.5 && (t - 60.0) % 30.0 < 28.0;
            9000.0 + if in_step { 2500.0 } else { 0.0 }
        } else if t < 480.0 {
            9000.0
        } else {
            14_500.0
        }
    };
    let workers = 8usize;
    let tree = |t: f64| rss(t) + (500.0 * workers as f64 + 40.0 * 28.0) * f64::from(t > 40.0);
    let mut log = vec![];
    let mut start = entry(EntryKind::System, "system", "experiment_start", 0.2);
    start.figures.cpu_ram_used_mb = 300.0;
    log.push(start);
    for i in 0..=600 {
        let t = i as f64;
        let mut e = entry(EntryKind::Timer, "system", "timer", t);
        e.figures.cpu_ram_used_mb = tree(t);
        e.figures.cpu_ram_hwm_mb = e
            .figures
            .cpu_ram_used_mb
            .max(rss(t) + 2000.0 * f64::from(t > 90.0));
        e.figures.gpu_process_used_mb = gpu(t);
        e.figures.gpu_ram_used_mb = gpu(t);
        e.figures.reserved_gpu_ram_mb = gpu(t);
        e.gpu_source = GpuSource::Nvml;
        log.push(e);
    }
    // phases: data/load every 30 s, model/forward in between, eval at the end
    let mut mark = |component: &str, op: &str, t: f64, alloc: f64| {
        let mut e = entry(EntryKind::Event, component, op, t);
        e.pid = Some(1000);
        e.figures.cpu_ram_used_mb = tree(t);
        e.gpu_source = GpuSource::Allocator;
        e.figures.gpu_ram_used_mb = alloc;
        e.figures.gpu_ram_peak_mb = alloc * 1.2;
        e.figures.reserved_gpu_ram_mb = alloc * 1.25;
        e.figures.gpu_process_used_mb = gpu(t);
        log.push(e);
    };
    mark("model", "before_load", 2.0, 0.0);
    mark("model", "after_load", 58.0, 7000.0);
    let mut t = 60.0;
    while t < 470.0 {
        mark("data", "before_fetch", t, 7100.0);
        mark("data", "after_fetch", t + 6.0, 7200.0);
        mark("model", "before_train_step", t + 6.5, 7300.0);
        mark("model", "after_train_step", t + 28.0, 9100.0);
        t += 30.0;
    }
    mark("eval", "before_evaluate", 482.0, 9500.0);
    mark("eval", "after_evaluate", 590.0, 11_000.0);
    let mut end = entry(EntryKind::System, "system", "experiment_end", 599.5);
    end.figures.cpu_ram_used_mb = tree(599.0);
    end.figures.gpu_process_used_mb = gpu(599.0);
    log.push(end);
    log.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    for e in &log {
        doc.peak_usage.observe(e);
    }
    doc.detailed_log = log;

    doc.stages = vec![
        stage("prepare", "SUCCESS", 1.0, 59.0),
        stage("train", "SUCCESS", 60.0, 470.0),
        stage("evaluate", "FAILED", 480.0, 595.0),
    ];
    let mut targets = vec![Target {
        pid: 1000,
        ppid: 1,
        name: "python".into(),
        root: true,
        series: (0..=600)
            .step_by(2)
            .map(|i| [T0 + i as f64, rss(i as f64), gpu(i as f64)])
            .collect(),
        ..Target::default()
    }];
    for w in 0..workers {
        let mb = 500.0 + 40.0 * w as f64;
        targets.push(Target {
            pid: 1001 + w as u32,
            ppid: 1000,
            name: "pt_data_worker".into(),
            series: (40..=600)
                .step_by(2)
                .map(|i| {
                    [
                        T0 + i as f64,
                        mb + 10.0 * ((i as f64 / 17.0 + w as f64).sin()),
                        0.0,
                    ]
                })
                .collect(),
            ..Target::default()
        });
    }
    for t in &mut targets {
        t.peak_rss_mb = t.series.iter().map(|p| p[1]).fold(0.0, f64::max);
        t.peak_gpu_mb = t.series.iter().map(|p| p[2]).fold(0.0, f64::max);
    }
    doc.targets = targets;
    doc.gpus = vec![Gpu {
        index: 0,
        uuid: "GPU-fake".into(),
        name: "NVIDIA A10G".into(),
        total_mb: 23_028.0,
        peak_used_mb: 15_000.0,
        peak_tree_used_mb: 14_500.0,
        ..Gpu::default()
    }];
    doc.alerts = vec![
        alert(300.0, "host", "high", "normal", 0.78),
        alert(360.0, "host", "normal", "high", 0.70),
        alert(485.0, "gpu0", "high", "normal", 0.77),
        alert(500.0, "gpu0", "critical", "high", 0.87),
    ];
    doc
}

fn stage(name: &str, status: &str, start: f64, end: f64) -> Stage {
    Stage {
        name: name.into(),
        status: status.into(),
        start: T0 + start,
        end: Some(T0 + end),
        duration_s: Some(end - start),
        peak: Peaks::default(),
        ..Stage::default()
    }
}

fn alert(t: f64, resource: &str, level: &str, previous: &str, ratio: f64) -> Alert {
    Alert {
        timestamp: T0 + t,
        resource: resource.into(),
        level: level.into(),
        previous: previous.into(),
        used_ratio: ratio,
        message: String::new(),
    }
}

/// Keeps a copy of a picture for a person to look at, when
/// `MEMTRACK_KEEP_PLOTS` names a directory.
fn keep(path: &Path) {
    if let Ok(dir) = std::env::var("MEMTRACK_KEEP_PLOTS") {
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::copy(path, Path::new(&dir).join(path.file_name().unwrap()));
    }
}

#[test]
fn plot_draws_series_phases_stages_peaks_and_alerts() {
    let dir = scratch();
    let doc = rich_document();
    let svg_path = dir.path().join("rich.svg");
    let summary = plot(&doc, &svg_path, &PlotOptions::default()).unwrap();
    keep(&svg_path);
    assert_eq!(summary.format, ImageFormat::Svg);
    assert!(summary.gpu_panel);
    assert_eq!((summary.stages, summary.alerts), (3, 4));
    // model/load, 14 × (data/fetch + model/train_step), eval/evaluate
    assert_eq!(summary.phases, 30);

    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.contains(r#"width="1400""#) && svg.contains(r#"height="900""#));
    let texts = svg_texts(&svg);
    for wanted in [
        // header
        "memtrack · bs128-lr3e-4",
        "gpu-node-07",
        "python train.py --batch-size 128",
        "exit 1",
        // series and legend, top processes by peak and the rest
        "tree host memory (9 processes)",
        "tree peak between samples",
        "1000 python",
        "1008 pt_data_worker",
        "others (3 processes)",
        "tree GPU (NVML, per process)",
        "allocated (PyTorch, at marks)",
        "reserved (PyTorch, at marks)",
        "GPU0 capacity",
        "Host memory (MiB)",
        "GPU memory (GiB)",
        "time since start (min:s)",
        // phases by component
        "Phases (by component)",
        "model (15 spans)",
        "data (14 spans)",
        "eval (1 span)",
        "load",
        // stages with their status
        "prepare",
        "SUCCESS (2)",
        "train · SUCCESS",
        "evaluate · FAILED",
        "FAILED (1)",
        // peaks, alerts, marks, leak
        "host peak ",
        "GPU peak 14.2 GiB (14,500 MiB)",
        "host high 78 %",
        "host normal 70 %",
        "gpu0 critical 87 %",
        "experiment_start",
        "experiment_end",
        "leak? +",
        "leak suspected: host +",
    ] {
        assert_has(&texts, wanted);
    }
    let host_peak = doc.peak_usage.figures.cpu_ram_used_mb.round() as u64;
    let grouped = format!("{},{:03}", host_peak / 1000, host_peak % 1000);
    assert_has(&texts, &format!("host peak {grouped} MiB"));
    assert!(summary
        .annotations
        .iter()
        .any(|a| a.starts_with("GPU peak")));
    assert!(summary.legend.iter().any(|l| l == "others (3 processes)"));

    let png_path = dir.path().join("rich.png");
    let opts = PlotOptions {
        width: 1600,
        height: 1000,
        title: Some("bs128 on gpu-node-07".into()),
        ..PlotOptions::default()
    };
    let png = plot(&doc, &png_path, &opts).unwrap();
    keep(&png_path);
    assert_eq!(png.format, ImageFormat::Png);
    assert_eq!(png_size(&std::fs::read(&png_path).unwrap()), (1600, 1000));
    // a picture, not a blank page: plenty of distinct bytes after encoding
    assert!(std::fs::metadata(&png_path).unwrap().len() > 40_000);
}

#[test]
fn plot_reads_a_bare_file() {
    let mut log = vec![];
    for i in 0..12 {
        let t = 1_234_567_890.0 + i as f64 * 5.0;
        for (op, extra) in [("before_generate", 0.0), ("after_generate", 1500.0)] {
            log.push(serde_json::json!({
                "component": "model", "operation": op, "timestamp": t + extra / 1000.0,
                "cpu_ram_used_mb": 1024.5 + i as f64 * 3.0, "gpu_ram_used_mb": 8192.3 + extra,
                "gpu_ram_peak_mb": 8500.1 + extra, "reserved_gpu_ram_mb": 10240.0
            }));
        }
    }
    let bare = serde_json::json!({
        "detailed_log": log,
        "peak_usage": {"cpu_ram_used_mb": 1060.0, "gpu_ram_used_mb": 9692.3,
                       "gpu_ram_peak_mb": 10000.1, "reserved_gpu_ram_mb": 10240.0}
    });
    let doc: Document = serde_json::from_value(bare).unwrap();
    let dir = scratch();
    for name in ["bare.svg", "bare.png"] {
        let path = dir.path().join(name);
        let s = plot(&doc, &path, &PlotOptions::default()).unwrap();
        keep(&path);
        assert!(s.gpu_panel, "the base GPU fields make a GPU panel");
        assert_eq!(s.phases, 12);
        assert_eq!(s.stages, 0);
    }
    let texts = svg_texts(&std::fs::read_to_string(dir.path().join("bare.svg")).unwrap());
    for wanted in [
        "memtrack · memory timeline",
        "tree host memory (1 process)",
        "allocated (PyTorch, at marks)",
        "reserved (PyTorch, at marks)",
        "model (12 spans)",
        "GPU peak 10.0 GiB (10,240 MiB)",
        "host peak 1,058 MiB",
    ] {
        assert_has(&texts, wanted);
    }
    let png = std::fs::read(dir.path().join("bare.png")).unwrap();
    assert_eq!(png_size(&png), (1400, 900));
}

#[test]
fn plot_refuses_what_it_cannot_draw() {
    let dir = scratch();
    let doc = rich_document();
    let e = plot(&doc, &dir.path().join("x.pdf"), &PlotOptions::default()).unwrap_err();
    assert!(matches!(e, PlotError::Format { .. }), "{e}");
    assert!(e.to_string().contains(".svg or .png"), "{e}");
    let tiny = PlotOptions {
        width: 100,
        height: 80,
        title: None,
        ..PlotOptions::default()
    };
    assert!(matches!(
        plot(&doc, &dir.path().join("x.png"), &tiny),
        Err(PlotError::Size { .. })
    ));
    let e = plot(
        &Document::default(),
        &dir.path().join("x.svg"),
        &PlotOptions::default(),
    );
    assert!(matches!(e, Err(PlotError::Empty)));
    let missing = dir.path().join("no/such/dir/x.png");
    let e = plot(&doc, &missing, &PlotOptions::default()).unwrap_err();
    assert!(e.to_string().contains("no/such/dir/x.png"), "{e}");
}

#[test]
fn plot_draws_a_real_run_with_marks_spans_and_stages() {
    let dir = scratch();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    let script = r#"
import time, memtrack
memtrack.mark("system", "experiment_start", ack=True)
with memtrack.stage("warmup"):
    blocks = []
    with memtrack.span("data", "load"):
        for _ in range(6):
            blocks.append(bytearray(8 * 1024 * 1024))
            time.sleep(0.1)
with memtrack.stage("train"):
    for step in range(3):
        with memtrack.span("model", "step", iteration=step):
            blocks.append(bytearray(16 * 1024 * 1024))
            time.sleep(0.25)
    del blocks[:]
memtrack.mark("system", "experiment_end", ack=True)
"#;
    let out = run_to_end(
        memtrack()
            .args([
                "run",
                "--interval",
                "50ms",
                "--no-gpu",
                "--listen",
                "off",
                "--name",
                "real",
                "--output",
            ])
            .arg(dir.path().join("runs"))
            .arg("--")
            .args(python(script))
            .env("PYTHONPATH", &src),
        Duration::from_secs(60),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (_, doc) = only_document(&dir.path().join("runs"));
    let svg = dir.path().join("real.svg");
    let s = plot(&doc, &svg, &PlotOptions::default()).unwrap();
    let png = dir.path().join("real.png");
    plot(&doc, &png, &PlotOptions::default()).unwrap();
    keep(&svg);
    keep(&png);
    assert!(!s.gpu_panel, "--no-gpu: host panel only");
    assert_eq!(s.stages, 2);
    assert_eq!(s.phases, 4, "data/load and three model/step spans");
    let texts = svg_texts(&std::fs::read_to_string(&svg).unwrap());
    for wanted in [
        "memtrack · real",
        "no GPU",
        "warmup · SUCCESS",
        "train · SUCCESS",
        "data (1 span)",
        "model (3 spans)",
        "host peak ",
        "experiment_start",
        "experiment_end",
        "time since start",
    ] {
        assert_has(&texts, wanted);
    }
    assert_eq!(png_size(&std::fs::read(&png).unwrap()), (1400, 900));
}

/// A PNG's pixels as RGB rows: the IDAT chunks inflated and unfiltered
/// (8-bit RGB, not interlaced, as plotters writes it).
fn png_pixels(bytes: &[u8]) -> (usize, usize, Vec<u8>) {
    use std::io::Read;
    let (w, h) = png_size(bytes);
    assert_eq!(
        &bytes[24..29],
        &[8, 2, 0, 0, 0],
        "8-bit RGB, not interlaced"
    );
    let (w, h) = (w as usize, h as usize);
    let mut data = Vec::new();
    let mut at = 8;
    while at + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if &bytes[at + 4..at + 8] == b"IDAT" {
            data.extend_from_slice(&bytes[at + 8..at + 8 + len]);
        }
        at += 12 + len;
    }
    let mut raw = Vec::new();
    flate2::read::ZlibDecoder::new(&data[..])
        .read_to_end(&mut raw)
        .unwrap();
    let stride = w * 3;
    assert_eq!(raw.len(), h * (stride + 1), "one filter byte per row");
    let mut out = vec![0u8; h * stride];
    for y in 0..h {
        let filter = raw[y * (stride + 1)];
        let row = &raw[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
        for x in 0..stride {
            let a = if x >= 3 { out[y * stride + x - 3] } else { 0 };
            let b = if y > 0 { out[(y - 1) * stride + x] } else { 0 };
            let c = if x >= 3 && y > 0 {
                out[(y - 1) * stride + x - 3]
            } else {
                0
            };
            let predicted = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => ((u16::from(a) + u16::from(b)) / 2) as u8,
                4 => {
                    let p = i16::from(a) + i16::from(b) - i16::from(c);
                    let (pa, pb, pc) = (
                        (p - i16::from(a)).abs(),
                        (p - i16::from(b)).abs(),
                        (p - i16::from(c)).abs(),
                    );
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                f => panic!("PNG filter {f}"),
            };
            out[y * stride + x] = row[x].wrapping_add(predicted);
        }
    }
    (w, h, out)
}

#[test]
fn png_draws_no_spike_above_the_data() {
    // Regression: a series that turns sharply at every sample (up and back
    // down within a pixel) drew thin spikes far above its maximum in the
    // PNG — through the lanes, off the image — while the SVG was clean.
    let peak = 1194.9;
    let mut doc = Document {
        schema: 1,
        run: RunInfo {
            id: "5p1ke5".into(),
            name: "zigzag".into(),
            start: T0,
            end: Some(T0 + 150.0),
            exit: Some(Exit::code(0)),
            status: "finished".into(),
            interval_s: 0.1,
            gpu_backend: "none".into(),
            ..RunInfo::default()
        },
        ..Document::default()
    };
    for i in 0..1500 {
        let mut e = entry(EntryKind::Timer, "system", "timer", i as f64 * 0.1);
        e.figures.cpu_ram_used_mb = if i % 2 == 1 {
            peak - (i % 7) as f64
        } else {
            600.0 + (i % 5) as f64 * 20.0
        };
        doc.peak_usage.observe(&e);
        doc.detailed_log.push(e);
    }
    let dir = scratch();
    let run = dir.path().join("zigzag");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(
        run.join("memory_usage.json"),
        serde_json::to_vec(&doc).unwrap(),
    )
    .unwrap();
    let draw = |name: &str| {
        let out = dir.path().join(name);
        let done = run_to_end(
            memtrack().args(["plot", run.to_str().unwrap(), "-o", out.to_str().unwrap()]),
            Duration::from_secs(60),
        );
        assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));
        keep(&out);
        out
    };
    let svg = std::fs::read_to_string(draw("zigzag.svg")).unwrap();
    let png = std::fs::read(draw("zigzag.png")).unwrap();

    // Where the SVG draws the series' maximum: the highest point of the
    // host line (#1F4E8C, wider than a pixel) left of the legend.
    let (w, h, pixels) = png_pixels(&png);
    let legend_x = w as i32 - 300;
    let mut top: Option<(i32, i32)> = None;
    for tag in svg.split("<polyline").skip(1) {
        let line = &tag[..tag.find('>').unwrap()];
        if !line.contains(r##"stroke="#1F4E8C""##) || line.contains(r#"stroke-width="1""#) {
            continue;
        }
        let points = line.split("points=\"").nth(1).unwrap();
        for p in points[..points.find('"').unwrap()].split_whitespace() {
            let (x, y) = p.split_once(',').unwrap();
            let (x, y): (i32, i32) = (x.parse().unwrap(), y.parse().unwrap());
            if x < legend_x && top.is_none_or(|t| y < t.1) {
                top = Some((x, y));
            }
        }
    }
    let (_, peak_y) = top.expect("the SVG draws the host line");

    // No pixel of the host line's blue above that in the PNG, but for the
    // peak's own label just above it (45 pixels at this size).
    let mut above = Vec::new();
    for y in 0..(peak_y - 45).max(0) as usize {
        for x in 0..legend_x as usize {
            let p = &pixels[(y * w + x) * 3..(y * w + x) * 3 + 3];
            if i32::from(p[2]) - i32::from(p[0]) >= 30 {
                above.push((x, y));
            }
        }
    }
    assert!(
        above.is_empty(),
        "{} host-line pixels above the data's maximum (y {peak_y} of {h}), e.g. {:?}",
        above.len(),
        &above[..above.len().min(5)]
    );
}

#[test]
fn plot_without_output_writes_beside_the_document_and_says_where() {
    let dir = scratch();
    let run = dir.path().join("train");
    std::fs::create_dir(&run).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/it/fixtures/golden/train/memory_usage.json"),
        run.join("memory_usage.json"),
    )
    .unwrap();
    let done = run_to_end(memtrack().arg("plot").arg(&run), Duration::from_secs(60));
    assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));
    let svg = run.join("memory_timeline.svg");
    assert!(
        std::fs::read_to_string(&svg).unwrap().contains("<svg"),
        "{}",
        svg.display()
    );
    assert!(
        stderr(&done).contains(&svg.display().to_string()),
        "{}",
        stderr(&done)
    );
}
