//! `report --html` and `compare --html` in a real browser: Debian's
//! headless Chromium loads the page with scripts on, driven over the
//! DevTools protocol on a pipe (`--remote-debugging-pipe`: commands on
//! its fd 3, answers on its fd 4, NUL-separated JSON). The tests read the
//! page's DOM — the peak it shows against the JSON's, a lane for every
//! component — and move a real (synthetic) mouse over the host timeline
//! for the hover text. There is no skip: without `chromium` they fail
//! (`scripts/test` installs it).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use crate::common::{
    memtrack, only_document, python, python3, read_document, run_to_end, scratch, stderr,
};

/// The browser, its page session, and what its pages threw.
struct Browser {
    child: Child,
    stdin: ChildStdin,
    rx: mpsc::Receiver<Value>,
    next: u64,
    session: Option<String>,
    errors: Vec<String>,
    loaded: bool,
    _profile: tempfile::TempDir,
}

/// How long one protocol call may take before the test gives up (a bound
/// on a hang, not a measurement).
const CALL_LIMIT: Duration = Duration::from_secs(120);

impl Browser {
    fn start() -> Browser {
        let found = Command::new("chromium")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            found,
            "chromium is not installed: the page's browser tests need Debian's chromium \
             package (scripts/test installs it: apt-get install chromium)"
        );
        let profile = scratch();
        // The shell hands chromium the test's pipes as its fds 3 and 4.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(
                "exec chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
                 --no-first-run --no-default-browser-check --remote-debugging-pipe \
                 --window-size=1400,1000 --user-data-dir=\"$1\" about:blank \
                 3<&0 4>&1 0</dev/null 1>&2",
            )
            .arg("sh")
            .arg(profile.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromium");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match r.read_until(0, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                if buf.last() == Some(&0) {
                    buf.pop();
                }
                if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
            }
        });
        let mut b = Browser {
            child,
            stdin,
            rx,
            next: 0,
            session: None,
            errors: Vec::new(),
            loaded: false,
            _profile: profile,
        };
        let targets = b.call("Target.getTargets", json!({}));
        let page = targets["targetInfos"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .unwrap_or_else(|| panic!("no page target: {targets}"))["targetId"]
            .clone();
        let attached = b.call(
            "Target.attachToTarget",
            json!({"targetId": page, "flatten": true}),
        );
        b.session = Some(attached["sessionId"].as_str().unwrap().to_string());
        b.call("Page.enable", json!({}));
        b.call("Runtime.enable", json!({}));
        b
    }

    /// Sends a command (to the page once attached) and waits for its answer.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = &self.session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap();
        bytes.push(0);
        self.stdin.write_all(&bytes).unwrap();
        self.stdin.flush().unwrap();
        let deadline = Instant::now() + CALL_LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .rx
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("chromium gave no answer to {method}: {e}"));
            if v["id"] == json!(id) {
                if let Some(err) = v.get("error") {
                    panic!("{method}: {err}");
                }
                return v["result"].clone();
            }
            self.event(&v);
        }
    }

    fn event(&mut self, v: &Value) {
        match v["method"].as_str() {
            Some("Runtime.exceptionThrown") => self.errors.push(v["params"].to_string()),
            Some("Runtime.consoleAPICalled") if v["params"]["type"] == "error" => {
                self.errors.push(v["params"].to_string())
            }
            Some("Page.loadEventFired") => self.loaded = true,
            _ => {}
        }
    }

    /// Opens `file` and waits for its load event; the milliseconds from
    /// the navigation's start until the page's script had drawn it all.
    fn open(&mut self, file: &Path) -> f64 {
        self.loaded = false;
        let url = format!("file://{}", file.display());
        self.call("Page.navigate", json!({"url": url}));
        let deadline = Instant::now() + CALL_LIMIT;
        while !self.loaded {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .rx
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("{} did not load: {e}", file.display()));
            self.event(&v);
        }
        assert_eq!(self.eval("document.body.dataset.ready"), json!("1"));
        assert!(self.errors.is_empty(), "the page threw: {:?}", self.errors);
        self.eval("window.memtrackReady").as_f64().unwrap()
    }

    /// The value of a JavaScript expression in the page.
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        if let Some(e) = r.get("exceptionDetails") {
            panic!("{expr}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// A mouse move to the page's point `(x, y)` (CSS pixels).
    fn move_mouse(&mut self, x: f64, y: f64) {
        self.call(
            "Input.dispatchMouseEvent",
            json!({"type": "mouseMoved", "x": x, "y": y}),
        );
    }

    /// Moves the mouse over chart `id` of a run's page at time `t`
    /// (seconds since the start) and returns the hover text.
    fn hover_at(&mut self, id: &str, t: f64) -> String {
        let duration = self
            .eval(
                "JSON.parse(document.getElementById('memtrack-data').textContent).runs[0].duration",
            )
            .as_f64()
            .unwrap();
        self.hover_across(id, t / duration)
    }

    /// Moves the mouse over chart `id`, `f` of the way across its axis,
    /// and returns the hover text.
    fn hover_across(&mut self, id: &str, f: f64) -> String {
        let r = self.eval(&format!(
            "(() => {{ const e = document.getElementById({id:?}); e.scrollIntoView({{block: 'nearest'}}); \
             const r = e.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; }})()"
        ));
        let r: Vec<f64> = r
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        // The charts' margins: 70 px left, 16 px right.
        let x = r[0] + 70.0 + (r[2] - 86.0) * f;
        self.move_mouse(x, r[1] + r[3] / 2.0);
        let text = self.eval("document.getElementById('hover').textContent");
        text.as_str().unwrap().to_string()
    }

    /// A 1400 px wide window of `height` px, scrolled to the top.
    fn screenshot_setup(&mut self, height: u32) {
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": 1400, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        );
        self.eval("window.scrollTo(0, 0)");
    }

    fn screenshot(&mut self, out: &Path) {
        let shot = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        std::fs::write(out, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Keeps a copy of a page or picture for a person to look at, when
/// `MEMTRACK_KEEP_PLOTS` names a directory.
fn keep(path: &Path) {
    if let Ok(dir) = std::env::var("MEMTRACK_KEEP_PLOTS") {
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::copy(path, Path::new(&dir).join(path.file_name().unwrap()));
    }
}

/// `memtrack report FILE --html -o OUT`, which must succeed.
fn write_page(file: &Path, out: &Path) {
    let res = run_to_end(
        memtrack()
            .args(["report", "--html", "-o"])
            .arg(out)
            .arg(file),
        Duration::from_secs(600),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert!(stderr(&res).contains("wrote"), "{}", stderr(&res));
}

/// A job with stages, spans with iterations, plain marks, a worker
/// process, memory that grows and is freed.
const STAGED_JOB: &str = r#"
import subprocess, sys, time, memtrack
memtrack.mark("system", "experiment_start", ack=True)
with memtrack.stage("warmup"):
    blocks = []
    with memtrack.span("data", "load"):
        for _ in range(6):
            blocks.append(bytearray(8 * 1024 * 1024))
            time.sleep(0.1)
with memtrack.stage("train"):
    worker = subprocess.Popen([sys.executable, "-c",
        "import time; b = bytearray(48 << 20); time.sleep(1.2)"])
    for step in range(4):
        with memtrack.span("model", "step", iteration=step):
            blocks.append(bytearray(16 * 1024 * 1024))
            time.sleep(0.25)
        memtrack.mark("eval", "score", iteration=step, ack=True)
        time.sleep(0.05)
    worker.wait()
    del blocks[:]
memtrack.mark("system", "experiment_end", ack=True)
"#;

/// Runs `job` (argv) under memtrack; its run directory.
fn run_job(dir: &Path, name: &str, job: &[String]) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    let runs = dir.join(format!("runs-{name}"));
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
                name,
                "--output",
            ])
            .arg(&runs)
            .arg("--")
            .args(job)
            .env("PYTHONPATH", &src),
        Duration::from_secs(120),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    only_document(&runs).0
}

fn attr_f64(b: &mut Browser, id: &str) -> f64 {
    let v = b.eval(&format!(
        "document.getElementById({id:?}).getAttribute('data-mib')"
    ));
    v.as_str()
        .unwrap_or_else(|| panic!("#{id} has no data-mib"))
        .parse()
        .unwrap()
}

fn lanes(b: &mut Browser) -> Vec<String> {
    serde_json::from_value(b.eval(
        "Array.from(document.querySelectorAll('#chart-lanes g.lane[data-component]'))\
         .map(g => g.getAttribute('data-component'))",
    ))
    .unwrap()
}

/// The demo job (examples/demo_job.py), small and quick.
fn demo_run(dir: &Path) -> PathBuf {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/demo_job.py");
    let job: Vec<String> = [python3(), &demo.display().to_string()]
        .iter()
        .map(|s| s.to_string())
        .chain(["--scale", "0.3", "--pause", "0.3"].map(String::from))
        .collect();
    run_job(dir, "demo", &job)
}

#[test]
fn the_demo_runs_page_shows_its_peak_lanes_and_hover_in_a_browser() {
    let dir = scratch();
    let run = demo_run(dir.path());
    let json = run.join("memory_usage.json");
    let doc = read_document(&json);
    let page = dir.path().join("memory_report.html");
    write_page(&run, &page);

    let mut b = Browser::start();
    let ms = b.open(&page);
    println!("demo page drawn in {ms:.0} ms");
    // The peak: the card shows the JSON's, the chart's marker the highest
    // point of the series drawn; both are the JSON's exactly.
    let peak = doc.peak_usage.figures.cpu_ram_used_mb;
    assert!(peak > 100.0, "{peak}");
    assert_eq!(attr_f64(&mut b, "peak-host"), peak);
    assert_eq!(attr_f64(&mut b, "chart-host-peak"), peak);
    // A lane for every component.
    let shown = lanes(&mut b);
    for c in doc.peaks_by_component.keys() {
        assert!(shown.contains(c), "no lane for {c}: {shown:?}");
    }
    for c in ["data", "model", "worker", "generate"] {
        assert!(shown.iter().any(|s| s == c), "no lane for {c}: {shown:?}");
    }
    // The advice comes first, then everything else.
    let order: Vec<String> = serde_json::from_value(
        b.eval("Array.from(document.querySelectorAll('main > section')).map(s => s.id)"),
    )
    .unwrap();
    assert_eq!(
        order.first().map(String::as_str),
        Some("advice"),
        "{order:?}"
    );
    for s in [
        "timeline",
        "peaks",
        "leak",
        "needs",
        "processes",
        "settings",
    ] {
        assert!(order.iter().any(|o| o == s), "no {s} section: {order:?}");
    }
    // Hover inside the second generation step: time, value, span,
    // iteration, the last mark.
    let step = doc
        .detailed_log
        .iter()
        .filter(|e| e.component == "generate" && e.operation == "before_step")
        .nth(1)
        .expect("a second step");
    let t = step.timestamp - doc.run.start + 0.05;
    let text = b.hover_at("chart-host", t);
    for wanted in [
        "t = ",
        "host (tree): ",
        "generate / step",
        "iteration: 1",
        "mark: generate / before_step",
    ] {
        assert!(text.contains(wanted), "hover lacks {wanted:?}: {text}");
    }
    // Processes: own cost by default, RSS on a click.
    assert_eq!(
        b.eval("document.getElementById('proc-uss').checked"),
        json!(true)
    );
    let own = b.eval("document.querySelectorAll('#chart-processes polyline').length");
    b.eval("document.getElementById('proc-rss').click()");
    let title = b.eval("document.querySelector('#chart-processes .title').textContent");
    assert_eq!(title, json!("Processes: RSS"));
    assert_eq!(
        b.eval("document.querySelectorAll('#chart-processes polyline').length"),
        own
    );
    b.eval("document.getElementById('proc-uss').click()");
    // Zoom: the wheel narrows the view; a double click shows everything.
    let ticks = |b: &mut Browser| {
        b.eval("Array.from(document.querySelectorAll('#chart-host text')).map(t => t.textContent).join('|')")
    };
    let before = ticks(&mut b);
    b.eval(
        "(() => { const e = document.getElementById('chart-host'); const r = e.getBoundingClientRect(); \
         e.dispatchEvent(new WheelEvent('wheel', {deltaY: -400, clientX: r.left + r.width / 2, \
         clientY: r.top + 50, bubbles: true, cancelable: true})); })()",
    );
    assert_ne!(ticks(&mut b), before, "the wheel did not zoom");
    b.eval(
        "document.getElementById('chart-host').dispatchEvent(new MouseEvent('dblclick', {bubbles: true}))",
    );
    assert_eq!(ticks(&mut b), before, "a double click shows all again");

    // The picture for docs/ (docs/report-page.png), the whole page with
    // the hover box over the host timeline.
    let height = b
        .eval("document.documentElement.scrollHeight")
        .as_f64()
        .unwrap();
    b.screenshot_setup(height.min(4000.0) as u32);
    let text = b.hover_at("chart-host", t);
    assert!(text.contains("generate / step"), "{text}");
    let shot = dir.path().join("report-page.png");
    b.screenshot(&shot);
    keep(&shot);
    keep(&page);
    assert!(b.errors.is_empty(), "the page threw: {:?}", b.errors);

    // An estimated peak USS is marked `~` in the process table, and a line
    // says what that means; with none estimated, no mark and no line.
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let targets = v["targets"].as_array_mut().unwrap();
    let owned = targets
        .iter()
        .position(|t| t["peak_uss_mb"].is_number())
        .expect("a process with an own cost");
    let pid = targets[owned]["pid"].as_u64().unwrap();
    for (estimated, name) in [(false, "read.html"), (true, "estimated.html")] {
        for (i, t) in v["targets"].as_array_mut().unwrap().iter_mut().enumerate() {
            t["peak_uss_estimated"] = json!(estimated && i == owned);
        }
        let file = dir.path().join(format!("{name}.json"));
        std::fs::write(&file, serde_json::to_vec(&v).unwrap()).unwrap();
        let page = dir.path().join(name);
        write_page(&file, &page);
        b.open(&page);
        let cells = b.eval(&format!(
            "Array.from(document.querySelectorAll('#processes tr')).filter(r => \
             r.cells[0] && r.cells[0].textContent.startsWith('{pid} ')).map(r => r.cells[2].textContent)"
        ));
        let cell = cells[0]
            .as_str()
            .unwrap_or_else(|| panic!("no row for {pid}: {cells}"));
        assert_eq!(cell.starts_with('~'), estimated, "{cell}");
        assert_eq!(
            b.eval("document.getElementById('own-estimated') !== null"),
            json!(estimated)
        );
    }
    assert!(b.errors.is_empty(), "the page threw: {:?}", b.errors);
}

/// A memory_usage.json of `n` marks written directly: spans of one step
/// each (`before_step` / `after_step` with the iteration), PyTorch's
/// figures, two stages, one spike at `spike`.
fn big_document(path: &Path, n: usize, spike: usize, name: &str, mark: &str) -> (f64, f64) {
    let t0 = 1_700_000_000.0;
    let f = std::fs::File::create(path).unwrap();
    let mut w = std::io::BufWriter::new(f);
    let end = t0 + n as f64 * 0.01 + 1.0;
    let run = json!({"name": name, "start": t0, "end": end, "host": "bighost", "interval_s": 1.0});
    write!(w, "{{\"schema\":1,\"run\":{run},\"detailed_log\":[").unwrap();
    let (mut peak, mut gpu_peak) = (0.0f64, 0.0f64);
    let mark = serde_json::to_string(mark).unwrap();
    for i in 0..n {
        let mut v = 1000.0 + (i % 977) as f64 * 0.5 + (i as f64 / n as f64) * 300.0;
        if i == spike {
            v = 9876.54321;
        }
        peak = peak.max(v);
        gpu_peak = gpu_peak.max(v / 1.5);
        let (component, op) = match i % 4 {
            0 => ("\"model\"", "\"before_step\"".to_string()),
            1 => ("\"model\"", "\"after_step\"".to_string()),
            2 => ("\"data\"", "\"before_load\"".to_string()),
            _ => ("\"data\"", "\"after_load\"".to_string()),
        };
        let op = if i == n / 2 { mark.clone() } else { op };
        write!(
            w,
            "{}{{\"component\":{component},\"operation\":{op},\"timestamp\":{},\
             \"cpu_ram_used_mb\":{v},\"gpu_ram_used_mb\":{},\"reserved_gpu_ram_mb\":{},\
             \"gpu_source\":\"allocator\",\"iteration\":{}}}",
            if i == 0 { "" } else { "," },
            t0 + i as f64 * 0.01,
            v / 2.0,
            v / 1.5,
            i / 4
        )
        .unwrap();
    }
    let mid = t0 + n as f64 * 0.005;
    let stages = json!([
        {"name": "train", "status": "SUCCESS", "start": t0, "end": mid},
        {"name": "eval", "status": "FAILED", "start": mid, "end": end}
    ]);
    write!(
        w,
        "],\"peak_usage\":{{\"cpu_ram_used_mb\":{peak},\"gpu_ram_used_mb\":{},\
         \"reserved_gpu_ram_mb\":{gpu_peak}}},\"stages\":{stages},\
         \"peaks_by_component\":{{\"model\":{{\"cpu_ram_used_mb\":{peak}}},\"data\":{{}}}}}}",
        peak / 1.5 * 0.75
    )
    .unwrap();
    w.flush().unwrap();
    (peak, gpu_peak)
}

#[test]
fn a_million_marks_make_a_light_page_with_the_exact_peak() {
    let dir = scratch();
    let json = dir.path().join("memory_usage.json");
    let n = 1_000_000;
    let (peak, gpu_peak) = big_document(&json, n, 654_321, "big", "checkpoint");
    let page = dir.path().join("big.html");
    write_page(&json, &page);
    let size = std::fs::metadata(&page).unwrap().len();
    println!(
        "a {} MiB file of {n} marks makes a {:.2} MiB page",
        std::fs::metadata(&json).unwrap().len() >> 20,
        size as f64 / (1 << 20) as f64
    );
    assert!(size <= 5 << 20, "{size} bytes");

    let mut b = Browser::start();
    let ms = b.open(&page);
    println!("million-mark page: loaded and drawn {ms:.0} ms after its navigation began");
    assert_eq!(attr_f64(&mut b, "peak-host"), peak);
    assert_eq!(attr_f64(&mut b, "chart-host-peak"), peak);
    assert_eq!(attr_f64(&mut b, "chart-gpu-peak"), gpu_peak);
    let shown = lanes(&mut b);
    assert_eq!(shown, ["model", "data"]);
    // Every mark is counted even though one per column is kept.
    let total = b.eval(
        "JSON.parse(document.getElementById('memtrack-data').textContent).runs[0].marks_total",
    );
    assert_eq!(total, json!(n));
    let spike_t = 654_321.0 * 0.01;
    let text = b.hover_at("chart-host", spike_t);
    for wanted in [
        "t = ",
        "host (tree): ",
        "iteration: ",
        "span: ",
        "stage: eval",
    ] {
        assert!(text.contains(wanted), "hover lacks {wanted:?}: {text}");
    }
    let shot = dir.path().join("big-page.png");
    b.screenshot_setup(1400);
    b.screenshot(&shot);
    keep(&shot);
    assert!(b.errors.is_empty(), "the page threw: {:?}", b.errors);
}

#[test]
fn hostile_names_and_marks_stay_text() {
    let dir = scratch();
    let json = dir.path().join("memory_usage.json");
    let evil = "</script><script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\">";
    // 200 marks 10 ms apart: the one at 1 s opens a span named `evil`.
    big_document(&json, 200, 70, evil, &format!("before_{evil}"));
    let page = dir.path().join("evil.html");
    write_page(&json, &page);
    let html = std::fs::read_to_string(&page).unwrap();
    assert_eq!(
        html.matches("</script>").count(),
        2,
        "only the page's own two script elements close"
    );
    assert!(!html.contains("<img"), "markup in the data");
    let mut b = Browser::start();
    b.open(&page);
    assert_eq!(b.eval("typeof window.pwned"), json!("undefined"));
    assert_eq!(b.eval("document.querySelectorAll('img').length"), json!(0));
    assert_eq!(
        b.eval("document.getElementById('run-name').textContent"),
        json!(evil)
    );
    assert!(b
        .eval("document.title")
        .as_str()
        .unwrap()
        .contains("</script>"));
    // The hostile span, hovered, is text.
    let text = b.hover_at("chart-host", 1.004);
    assert!(text.contains(evil), "{text}");
    assert_eq!(b.eval("typeof window.pwned"), json!("undefined"));
    assert!(b.errors.is_empty(), "the page threw: {:?}", b.errors);
}

#[test]
fn compare_html_overlays_runs_aligned_by_time_iteration_or_stage() {
    let dir = scratch();
    let a = run_job(dir.path(), "first", &python(STAGED_JOB));
    let b_run = run_job(dir.path(), "second", &python(STAGED_JOB));
    let page = dir.path().join("compare.html");
    let res = run_to_end(
        memtrack()
            .args(["compare", "--html", "-o"])
            .arg(&page)
            .arg(&a)
            .arg(&b_run),
        Duration::from_secs(120),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let docs: BTreeMap<String, f64> = [&a, &b_run]
        .iter()
        .map(|d| {
            let doc = read_document(&d.join("memory_usage.json"));
            (doc.run.name.clone(), doc.peak_usage.figures.cpu_ram_used_mb)
        })
        .collect();
    let mut b = Browser::start();
    b.open(&page);
    let lines = |b: &mut Browser| {
        b.eval("document.querySelectorAll('#chart-host polyline').length")
            .as_u64()
            .unwrap()
    };
    for align in ["time", "iteration", "stage"] {
        b.eval(&format!(
            "(() => {{ const s = document.getElementById('align'); s.value = {align:?}; \
             s.dispatchEvent(new Event('change')); }})()"
        ));
        assert_eq!(lines(&mut b), 2, "one line per run, aligned by {align}");
        let text = b.hover_across("chart-host", 0.5);
        for name in docs.keys() {
            assert!(text.contains(name.as_str()), "{align}: {text}");
        }
    }
    let runs: Vec<String> = serde_json::from_value(
        b.eval("Array.from(document.querySelectorAll('#runs tbody tr td:first-child')).map(t => t.textContent)"),
    )
    .unwrap();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert!(b.errors.is_empty(), "the page threw: {:?}", b.errors);
}

/// The data a page embeds (JSON, whose `\u003c` escapes JSON reads back).
fn page_data(html: &str) -> Value {
    let start = "<script type=\"application/json\" id=\"memtrack-data\">";
    let from = html.find(start).expect("the data element") + start.len();
    let len = html[from..].find("</script>").expect("its end");
    serde_json::from_str(&html[from..from + len]).expect("JSON")
}

/// `memtrack run` of a short job, with extra arguments and environment.
fn short_run(dir: &Path, name: &str, script: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = memtrack();
    cmd.args(["run", "--interval", "50ms", "--no-gpu", "--listen", "off"])
        .args(args)
        .args(["--name", name, "--output"])
        .arg(dir)
        .arg("--")
        .args(python(script));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run_to_end(&mut cmd, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(dir.join(name).join("memory_usage.json").is_file());
    stderr(&out)
}

#[test]
fn a_run_writes_its_page_beside_the_json_unless_turned_off() {
    let dir = scratch();
    let job = "import time; b = bytearray(32 << 20); time.sleep(0.3)";
    let log = short_run(dir.path(), "on", job, &[], &[]);
    let page = dir.path().join("on/memory_report.html");
    assert!(page.is_file(), "{log}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains("<title>memtrack · on</title>"),
        "the run's own page"
    );
    // Its data: the run's figures, the peak of the series drawn being the
    // JSON's exactly.
    let doc = read_document(&dir.path().join("on/memory_usage.json"));
    let data = page_data(&html);
    let run = &data["runs"][0];
    assert_eq!(run["label"], "on");
    assert_eq!(
        run["series_peak"]["host"].as_f64(),
        Some(doc.peak_usage.figures.cpu_ram_used_mb)
    );
    assert_eq!(
        run["report"]["peak_usage"]["cpu_ram_used_mb"].as_f64(),
        Some(doc.peak_usage.figures.cpu_ram_used_mb)
    );
    assert_eq!(run["report"]["run"]["id"], json!(doc.run.id));
    assert_eq!(run["report"]["run"]["status"], json!("finished"));

    // A thinned event log: the page counts every mark and keeps the peak.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    // Every hundredth mark waits for its ack, so none is dropped by a
    // client whose socket buffer a slow daemon left full.
    let marks = "import memtrack\n\
        for i in range(5000):\n    memtrack.mark('loop', 'tick', iteration=i, ack=i % 100 == 99)\n\
        memtrack.mark('loop', 'done', ack=True)\n";
    let log = short_run(
        dir.path(),
        "thin",
        marks,
        &[],
        &[
            ("MEMTRACK_LOG_MAX_EVENT_ENTRIES", "1024"),
            ("PYTHONPATH", src.to_str().unwrap()),
        ],
    );
    let doc = read_document(&dir.path().join("thin/memory_usage.json"));
    assert!(
        dir.path()
            .join("thin/memory_usage.events.jsonl.gz")
            .is_file(),
        "thinned: {log}"
    );
    let html = std::fs::read_to_string(dir.path().join("thin/memory_report.html")).unwrap();
    let run = &page_data(&html)["runs"][0];
    assert!(
        run["marks_total"].as_u64().unwrap() >= 5001,
        "{}",
        run["marks_total"]
    );
    assert_eq!(
        run["series_peak"]["host"].as_f64(),
        Some(doc.peak_usage.figures.cpu_ram_used_mb)
    );

    short_run(dir.path(), "flag", job, &["--no-html-report"], &[]);
    assert!(!dir.path().join("flag/memory_report.html").exists());
    short_run(
        dir.path(),
        "env",
        job,
        &[],
        &[("MEMTRACK_HTML_REPORT", "false")],
    );
    assert!(!dir.path().join("env/memory_report.html").exists());
    let config = dir.path().join("memtrack.toml");
    std::fs::write(&config, "html_report = false\n").unwrap();
    short_run(
        dir.path(),
        "file",
        job,
        &["--config", config.to_str().unwrap()],
        &[],
    );
    assert!(!dir.path().join("file/memory_report.html").exists());
}

#[test]
fn a_page_that_cannot_be_written_is_a_warning_not_a_failure() {
    let dir = scratch();
    // The job takes the page's name in its own run directory.
    let blocker = dir.path().join("blocked/memory_report.html");
    let job = format!(
        "import os, time; os.makedirs({:?}); open(os.path.join({:?}, 'x'), 'w').close(); time.sleep(0.2)",
        blocker.display().to_string(),
        blocker.display().to_string()
    );
    let log = short_run(dir.path(), "blocked", &job, &[], &[]);
    assert!(blocker.is_dir());
    assert!(
        log.contains("the report page was not written"),
        "a warning says so: {log}"
    );
    assert!(log.contains("memtrack report --html"), "{log}");
}
