//! After the run: report, compare, the OOM flight recorder, leak
//! detection on a real job, and the live view under a terminal.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::*;

#[test]
fn a_job_killed_while_allocating_leaves_its_last_seconds() {
    let out = scratch();
    let pid_file = out.path().join("job.pid");
    let steps_file = out.path().join("job.steps");
    let script = format!(
        r#"
import os, time
open({pid:?}, 'w').write(str(os.getpid()))
bufs = []
for step in range(60):
    b = bytearray(20 << 20)
    for i in range(0, len(b), 4096): b[i] = 1
    bufs.append(b)
    with open({steps:?}, 'w') as f: f.write(str(step))
    time.sleep(0.05)
time.sleep(30)
"#,
        pid = pid_file.display().to_string(),
        steps = steps_file.display().to_string()
    );
    // A slow timer: the window comes from the flight recorder's own reads.
    let mut child = memtrack()
        .args([
            "run",
            "--listen",
            "off",
            "--interval",
            "1s",
            "--name",
            "oom",
            "--output",
        ])
        .arg(out.path())
        .arg("--")
        .args(python(&script))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the job", Duration::from_secs(10), || pid_file.exists());
    // Kill it well into its climb — counted in the job's own steps, not
    // in seconds, so a loaded machine slows both sides alike.
    wait_for("30 steps of the climb", Duration::from_secs(60), || {
        std::fs::read_to_string(&steps_file)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .is_some_and(|s| s >= 30)
    });
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    signal(pid, "KILL");
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(137));

    let file = out.path().join("oom/memory_usage.json");
    let doc = read_document(&file);
    assert_eq!(doc.flight_recorder.len(), 1, "{:?}", doc.flight_recorder);
    let w = &doc.flight_recorder[0];
    assert_eq!(
        (w.reason.as_str(), w.pid, w.exit.and_then(|e| e.signal)),
        ("signal", Some(pid), Some(9))
    );
    assert!((w.interval_s - 0.1).abs() < 1e-9);
    let live: Vec<f64> = w
        .points
        .iter()
        .filter(|p| !p.processes.is_empty())
        .map(|p| p.cpu_mb)
        .collect();
    assert!(
        live.len() >= 5,
        "high-rate points before the death: {}",
        live.len()
    );
    assert!(
        live.last().unwrap() > live.first().unwrap(),
        "memory was climbing: {live:?}"
    );
    assert!(w.points.iter().all(|p| p.t <= w.timestamp + 0.5));

    let res = run_to_end(memtrack().arg("report").arg(&file), Duration::from_secs(20));
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(
        text.contains("Flight recorder") && text.contains("died by SIGKILL"),
        "{text}"
    );
    assert!(text.contains("killed by SIGKILL (137)"), "{text}");
}

#[test]
fn report_and_compare_read_real_runs_and_a_bare_file() {
    let out = scratch();
    let mut files = Vec::new();
    for (model, precision, mib) in [
        ("SmolLM-135M", "FP32", 60),
        ("SmolLM-1.7B", "FP32", 160),
        ("SmolLM-1.7B", "INT8", 110),
    ] {
        let name = format!("{model}-{precision}");
        let script = format!("import time\nb = bytearray({mib} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(0.4)\n");
        let res = run_to_end(
            memtrack()
                .args([
                    "run",
                    "--listen",
                    "off",
                    "--interval",
                    "100ms",
                    "--name",
                    &name,
                    "--label",
                    &format!("model={model}"),
                ])
                .args(["--label", &format!("precision={precision}"), "--output"])
                .arg(out.path())
                .arg("--")
                .args(python(&script)),
            Duration::from_secs(30),
        );
        assert_eq!(res.status.code(), Some(0));
        files.push(out.path().join(&name).join("memory_usage.json"));
    }
    let res = run_to_end(
        memtrack()
            .args(["compare", "--format", "markdown"])
            .args(&files),
        Duration::from_secs(20),
    );
    let md = String::from_utf8_lossy(&res.stdout);
    let lines: Vec<&str> = md.lines().collect();
    assert_eq!(
        lines[0],
        "| Model | Precision | CPU RAM | GPU RAM | GPU Peak | Comment |"
    );
    assert!(
        lines[2].starts_with("| SmolLM-135M | FP32 | 0.")
            && lines[3].starts_with("| SmolLM-1.7B | FP32 |"),
        "{md}"
    );
    assert!(lines[4].starts_with("| SmolLM-1.7B | INT8 |"), "{md}");
    let res = run_to_end(
        memtrack().args(["compare", "--format", "csv"]).args(&files),
        Duration::from_secs(20),
    );
    assert_eq!(String::from_utf8_lossy(&res.stdout).lines().count(), 4);

    let res = run_to_end(
        memtrack().arg("report").arg(&files[1]),
        Duration::from_secs(20),
    );
    let text = String::from_utf8_lossy(&res.stdout);
    for needle in [
        "Peaks",
        "Processes",
        "Leak check",
        "What a re-run needs",
        "host RAM",
    ] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    let res = run_to_end(
        memtrack().args(["report", "--json"]).arg(&files[1]),
        Duration::from_secs(20),
    );
    let v: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    assert!(v["needs"]["host_needed_mb"].as_f64().unwrap() > 160.0);

    // A bare file: only detailed_log and peak_usage.
    let bare = out.path().join("bare.json");
    std::fs::write(
        &bare,
        r#"{"detailed_log": [{"component": "model", "operation": "before_generate", "timestamp": 1234567890.123,
             "cpu_ram_used_mb": 2048, "gpu_ram_used_mb": 8192, "gpu_ram_peak_mb": 10240, "reserved_gpu_ram_mb": 12288}],
           "peak_usage": {"cpu_ram_used_mb": 2048, "gpu_ram_used_mb": 8192, "gpu_ram_peak_mb": 10240, "reserved_gpu_ram_mb": 12288}}"#,
    )
    .unwrap();
    let res = run_to_end(memtrack().arg("report").arg(&bare), Duration::from_secs(20));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(
        text.contains("bare file") && text.contains("a 16 GB card fits"),
        "{text}"
    );
    // Not a document at all: one clear error.
    let res = run_to_end(
        memtrack().arg("report").arg("/etc/hostname"),
        Duration::from_secs(20),
    );
    assert_eq!(res.status.code(), Some(1));
    assert!(
        stderr(&res).contains("is not a memory_usage.json document"),
        "{}",
        stderr(&res)
    );
}

#[test]
fn a_real_leaking_job_is_flagged_and_a_steady_one_is_not() {
    let out = scratch();
    // 30 s of steady growth, ~600 MiB in all; and a sawtooth of the same size.
    let leak = "import time\nkeep = []\nfor s in range(60):\n    b = bytearray(10 << 20)\n    for i in range(0, len(b), 4096): b[i] = 1\n    keep.append(b)\n    time.sleep(0.5)\n";
    let saw = "import time\nfor s in range(60):\n    b = bytearray(300 << 20)\n    for i in range(0, len(b), 4096): b[i] = 1\n    time.sleep(0.25)\n    del b\n    time.sleep(0.25)\n";
    let mut verdicts = Vec::new();
    for (name, script) in [("leak", leak), ("saw", saw)] {
        let res = run_to_end(
            memtrack()
                .args([
                    "run",
                    "--listen",
                    "off",
                    "--interval",
                    "200ms",
                    "--name",
                    name,
                    "--output",
                ])
                .arg(out.path())
                .arg("--")
                .args(python(script)),
            Duration::from_secs(90),
        );
        assert_eq!(res.status.code(), Some(0));
        let doc = read_document(&out.path().join(name).join("memory_usage.json"));
        verdicts.push(doc.leak.expect("the daemon writes its leak verdict"));
    }
    assert_eq!(verdicts[0]["suspected"], true, "{}", verdicts[0]);
    let rate = verdicts[0]["host"]["rate_mib_per_hour"].as_f64().unwrap();
    // 10 MiB every 0.5 s = 72 000 MiB/h.
    assert!((rate - 72_000.0).abs() / 72_000.0 < 0.15, "rate {rate}");
    assert_eq!(verdicts[1]["suspected"], false, "{}", verdicts[1]);
}

#[test]
fn watch_shows_live_values_in_a_terminal() {
    if Command::new("tmux").arg("-V").output().is_err() {
        panic!("tmux is needed for the terminal test (Debian package tmux)");
    }
    let dir = scratch();
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &python("import time\nb = bytearray(120 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(6)\n"),
        &[],
    );
    let session = format!("memtrack-watch-{}", std::process::id());
    let bin = env!("CARGO_BIN_EXE_memtrack");
    let cmd = format!(
        "{bin} watch --socket {} --interval 200ms",
        d.socket.display()
    );
    let ok = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            &session,
            "-x",
            "160",
            "-y",
            "40",
            &cmd,
        ])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let capture = || -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &session])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut screen = String::new();
    wait_for(
        "a frame with the job's memory",
        Duration::from_secs(10),
        || {
            screen = capture();
            screen.contains("memtrack watch")
                && screen.lines().any(|l| {
                    // The root's RSS column: the job holds 120 MiB.
                    l.contains("python3 (root)")
                        && l.split_whitespace()
                            .nth(1)
                            .and_then(|v| v.parse::<f64>().ok())
                            .is_some_and(|v| v >= 120.0)
                })
        },
    );
    // Refreshing in place: the clock moves, the screen does not scroll.
    let first = capture();
    let mut second = capture();
    wait_for("the view to refresh", Duration::from_secs(30), || {
        second = capture();
        second != first
    });
    assert_eq!(
        second.matches("memtrack watch").count(),
        1,
        "one frame on screen:\n{second}"
    );
    let _ = Command::new("tmux")
        .args(["kill-session", "-t", &session])
        .status();
    let (code, _) = d.finish();
    assert_eq!(code, Some(0));
}

#[test]
fn report_plot_and_compare_take_run_directories() {
    let out = scratch();
    for name in ["small", "large"] {
        let res = run_to_end(
            memtrack()
                .args([
                    "run", "--listen", "off", "--socket", "off", "--name", name, "--output",
                ])
                .arg(out.path())
                .args(["--", "true"]),
            Duration::from_secs(60),
        );
        assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    }
    let dir = out.path().join("small");
    let file = dir.join("memory_usage.json");
    let tool = |args: &[&std::ffi::OsStr]| {
        let res = run_to_end(memtrack().args(args), Duration::from_secs(60));
        assert_eq!(res.status.code(), Some(0), "{args:?}: {}", stderr(&res));
        String::from_utf8(res.stdout).unwrap()
    };
    // The directory reads exactly as its file.
    for json in [false, true] {
        let flag: &[&std::ffi::OsStr] = if json { &["--json".as_ref()] } else { &[] };
        let by_dir = tool(&[&["report".as_ref()], flag, &[dir.as_os_str()]].concat());
        let by_file = tool(&[&["report".as_ref()], flag, &[file.as_os_str()]].concat());
        assert_eq!(by_dir, by_file);
        assert!(by_dir.contains("small"), "{by_dir}");
    }
    let by_dir = tool(&[
        "compare".as_ref(),
        "--format".as_ref(),
        "csv".as_ref(),
        dir.as_os_str(),
        out.path().join("large").as_os_str(),
    ]);
    let by_file = tool(&[
        "compare".as_ref(),
        "--format".as_ref(),
        "csv".as_ref(),
        file.as_os_str(),
        out.path().join("large/memory_usage.json").as_os_str(),
    ]);
    assert_eq!(by_dir, by_file, "rows named after the run directories");
    assert!(
        by_dir.contains("small") && by_dir.contains("large"),
        "{by_dir}"
    );
    let svg = out.path().join("small.svg");
    tool(&[
        "plot".as_ref(),
        dir.as_os_str(),
        "-o".as_ref(),
        svg.as_os_str(),
    ]);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));

    // A directory without the file says what it is and what to do.
    let empty = out.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for cmd in ["report", "plot", "compare"] {
        let mut c = memtrack();
        c.arg(cmd).arg(&empty);
        if cmd == "plot" {
            c.arg("-o").arg(&svg);
        }
        let res = run_to_end(&mut c, Duration::from_secs(60));
        assert_eq!(res.status.code(), Some(1), "{cmd}");
        assert!(
            stderr(&res).contains("without a memory_usage.json")
                && !stderr(&res).contains("Is a directory"),
            "{cmd}: {}",
            stderr(&res)
        );
    }
}

#[test]
fn the_readme_demo_marks_its_phases_through_the_client() {
    // The README's first command, as written there, made short: the demo
    // must show per-phase peaks (and so the plot's phase lanes), with the
    // forked worker marking its own phase, using the client from the
    // checkout (no pip install).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.contains("examples/demo_job.py") && l.starts_with("cargo run --release -- "))
        .expect("the README's demo command");
    let args: Vec<&str> = line["cargo run --release -- ".len()..]
        .split_whitespace()
        .collect();
    let dash = args.iter().position(|a| *a == "--").unwrap();
    assert_eq!(args[dash + 1], "python3", "{line}");
    let out = scratch();
    let mut cmd = memtrack();
    cmd.current_dir(root)
        .args(&args[..dash])
        .args(["--listen", "off", "--name", "demo", "--output"])
        .arg(out.path())
        .arg("--")
        .arg(python3())
        .args(&args[dash + 2..])
        .args(["--scale", "0.1", "--steps", "2", "--pause", "0.1"])
        .env_remove("PYTHONPATH");
    let done = run_to_end(&mut cmd, Duration::from_secs(120));
    assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));
    let doc = read_document(&out.path().join("demo/memory_usage.json"));
    for phase in ["data", "model", "generate", "worker"] {
        let peak = doc.peaks_by_component.get(phase);
        assert!(
            peak.is_some_and(|p| p.figures.cpu_ram_used_mb > 0.0),
            "no peak for `{phase}`: {:?}",
            doc.peaks_by_component.keys().collect::<Vec<_>>()
        );
    }
    let root_pid = doc.targets.iter().find(|t| t.root).map(|t| t.pid);
    assert!(
        doc.detailed_log
            .iter()
            .any(|e| e.component == "worker" && e.pid.is_some() && e.pid != root_pid),
        "the worker's marks come from the forked process"
    );
}

#[test]
fn compare_names_every_run_and_gives_durations_exits_parts_and_differences() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/fixtures/golden");
    let runs = ["train", "train-rank1", "leaky", "bare"];
    let compare = |extra: &[&str]| {
        let out = run_to_end(
            memtrack()
                .current_dir(&fixtures)
                .arg("compare")
                .args(runs)
                .args(extra),
            Duration::from_secs(60),
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let json: serde_json::Value = serde_json::from_str(&compare(&["--json"])).unwrap();
    let columns = json["runs"].as_array().unwrap();
    // Two ranks of one model named "train" are two runs, by directory.
    let names: Vec<&str> = columns
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, runs);
    assert_eq!(columns[0]["exit"], "1");
    assert!(columns[0]["duration_s"].as_f64().unwrap() > 0.0);
    let host = |i: usize| columns[i]["peak"]["host_mib"].as_f64().unwrap();
    let diff = columns[1]["diff"]["host_mib"].as_f64().unwrap();
    assert!((diff - (host(1) - host(0))).abs() < 1e-6, "{json}");
    let stages: Vec<&str> = json["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(stages, ["load", "train", "eval"]);
    let train_stage = &json["stages"][1];
    assert!(train_stage["peaks"][0]["host_mib"].as_f64().unwrap() > 0.0);
    assert!(train_stage["peaks"][2].is_null(), "leaky has no stages");
    let components: Vec<&str> = json["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert!(
        components.contains(&"model") && components.contains(&"server"),
        "{components:?}"
    );

    // The table: the same, sizes in MiB / GiB, never "0 GB".
    let table = compare(&[]);
    for needle in [
        "train-rank1",
        "Host peak by stage",
        "Host peak by component",
        "MiB",
    ] {
        assert!(table.contains(needle), "{needle}:\n{table}");
    }
    assert!(!table.contains(" GB"), "{table}");
    // `--format json` is `--json`.
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&compare(&["--format", "json"])).unwrap(),
        json
    );

    // The overlay plot, in both formats and every alignment.
    let dir = scratch();
    for (file, align) in [
        ("t.svg", "time"),
        ("i.png", "iteration"),
        ("s.svg", "stage"),
    ] {
        let path = dir.path().join(file);
        compare(&["--plot", path.to_str().unwrap(), "--align", align]);
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() > 1000, "{file}");
        if file.ends_with(".svg") {
            let svg = String::from_utf8(bytes).unwrap();
            for run in ["train-rank1", "leaky"] {
                assert!(svg.contains(run), "{file} names {run}");
            }
        }
    }
}

/// A run on a host without GPU memory, with a stage and a span: `report`
/// shows no GPU column (all zeros would say nothing), no "stage"
/// component (the stage has its own table) and the time outside the spans
/// under that name; `compare` shows no GPU column either.
#[test]
fn a_host_only_run_reports_no_gpu_columns_and_no_invented_components() {
    let out = scratch();
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/src");
    let script = format!(
        "import sys\nsys.path.insert(0, {:?})\nimport memtrack\n\
         with memtrack.stage('build_model'):\n    with memtrack.span('model', 'load'):\n        \
         b = bytearray(16 << 20)\n        for i in range(0, len(b), 4096): b[i] = 1\n",
        client.display().to_string()
    );
    let mut files = Vec::new();
    for name in ["host-a", "host-b"] {
        let res = run_to_end(
            memtrack()
                .args(["run", "--no-gpu", "--listen", "off", "--interval", "50ms"])
                .args(["--name", name, "--output"])
                .arg(out.path())
                .arg("--")
                .args(python(&script)),
            Duration::from_secs(60),
        );
        assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
        files.push(out.path().join(name).join("memory_usage.json"));
    }
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&files[0]).unwrap()).unwrap();
    let components: Vec<&String> = doc["peaks_by_component"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(components, ["model", "system"], "{doc:#}");
    assert_eq!(doc["stages"][0]["name"], "build_model");

    let res = run_to_end(
        memtrack().arg("report").arg(&files[0]),
        Duration::from_secs(20),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let report = String::from_utf8_lossy(&res.stdout).into_owned();
    assert!(
        !report.contains("GPU used") && !report.contains("peak GPU"),
        "{report}"
    );
    let peaks: Vec<&str> = report
        .lines()
        .skip_while(|l| *l != "Peaks")
        .skip(2)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(peaks, ["run", "model", "outside"], "{report}");
    let stages = report
        .lines()
        .skip_while(|l| *l != "Stages")
        .nth(1)
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(
        stages.split_whitespace().collect::<Vec<_>>(),
        ["stage", "status", "duration", "peak", "host"]
    );

    let res = run_to_end(
        memtrack().arg("compare").args(&files),
        Duration::from_secs(20),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let compared = String::from_utf8_lossy(&res.stdout);
    assert!(!compared.contains("GPU"), "{compared}");
    let components: Vec<&str> = compared
        .lines()
        .skip_while(|l| !l.starts_with("Host peak by component"))
        .skip(2)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(components, ["model", "outside"], "{compared}");
}
