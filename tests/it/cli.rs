//! The command line and configuration: every bad input gets one clear
//! message, a non-zero exit, and leaves nothing half-written.

use std::path::Path;
use std::time::Duration;

use crate::common::*;

/// Runs memtrack expecting a failure; returns stderr.
fn fails(args: &[&str], env: &[(&str, &str)], code: i32) -> String {
    let mut cmd = memtrack();
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run_to_end(&mut cmd, Duration::from_secs(20));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    err
}

fn empty(dir: &Path) -> bool {
    !dir.exists() || std::fs::read_dir(dir).unwrap().next().is_none()
}

#[test]
fn bad_flags_are_usage_errors() {
    let err = fails(&["run", "--intervall", "1s", "--", "true"], &[], 2);
    assert!(err.contains("--intervall"), "{err}");
    let err = fails(&["run"], &[], 2);
    assert!(err.contains("COMMAND"), "missing command: {err}");
    let err = fails(&["attach", "--pid", "abc"], &[], 2);
    assert!(err.contains("abc"), "{err}");
    let err = fails(&["frobnicate"], &[], 2);
    assert!(err.contains("frobnicate"), "{err}");
}

#[test]
fn bad_values_name_the_key() {
    let out = scratch();
    let o = out.path().to_str().unwrap();
    let err = fails(
        &["run", "--output", o, "--interval", "5ms", "--", "true"],
        &[],
        2,
    );
    assert!(
        err.contains("command line") && err.contains("`interval`") && err.contains("10ms"),
        "{err}"
    );
    let err = fails(
        &["run", "--output", o, "--interval", "soon", "--", "true"],
        &[],
        2,
    );
    assert!(err.contains("interval") && err.contains("soon"), "{err}");
    let err = fails(
        &["run", "--output", o, "--label", "no-equals", "--", "true"],
        &[],
        2,
    );
    assert!(err.contains("KEY=VALUE"), "{err}");
    let err = fails(
        &["run", "--output", o, "--label", "bad-key=1", "--", "true"],
        &[],
        2,
    );
    assert!(err.contains("bad-key"), "{err}");
    let err = fails(
        &["run", "--output", o, "--", "true"],
        &[("MEMTRACK_INTERVALL", "1s")],
        2,
    );
    assert!(err.contains("MEMTRACK_INTERVALL"), "{err}");
    let err = fails(
        &["run", "--output", o, "--", "true"],
        &[("MEMTRACK_GPU_ENABLED", "maybe")],
        2,
    );
    assert!(
        err.contains("environment") && err.contains("gpu.enabled"),
        "{err}"
    );
    assert!(empty(out.path()), "nothing written on a usage error");
}

#[test]
fn bad_config_files_name_file_and_key() {
    let out = scratch();
    let o = out.path().to_str().unwrap();
    let cfg = out.path().join("memtrack.toml");
    let c = cfg.to_str().unwrap();
    let cases = [
        ("[host]\nsmap = true\n", "host.smap"),
        ("interval = 100\n", "interval"),
        ("interval = '100ms'\n[pressure]\nhigh = 0.95\n", "pressure"),
        ("this is not toml", "TOML parse error"),
        ("name = 'a/b'\n", "name"),
    ];
    for (text, needle) in cases {
        std::fs::write(&cfg, text).unwrap();
        let err = fails(
            &[
                "run",
                "--config",
                c,
                "--output",
                &format!("{o}/runs"),
                "--",
                "true",
            ],
            &[],
            2,
        );
        assert!(
            err.contains(needle) && err.contains("memtrack.toml"),
            "{text:?}: {err}"
        );
    }
    let err = fails(
        &["run", "--config", "/nonexistent.toml", "--", "true"],
        &[],
        2,
    );
    assert!(err.contains("/nonexistent.toml"), "{err}");
    // A huge file of garbage is rejected the same way, quickly.
    std::fs::write(&cfg, "x".repeat(5 << 20)).unwrap();
    fails(
        &[
            "run",
            "--config",
            c,
            "--output",
            &format!("{o}/runs"),
            "--",
            "true",
        ],
        &[],
        2,
    );
    assert!(!out.path().join("runs").exists());
}

#[test]
fn missing_command_and_pid_leave_nothing_behind() {
    let out = scratch();
    let o = out.path().join("runs");
    let o = o.to_str().unwrap();
    let err = fails(
        &["run", "--output", o, "--", "/nonexistent/train.py"],
        &[],
        127,
    );
    assert!(
        err.contains("/nonexistent/train.py: command not found"),
        "{err}"
    );
    assert!(empty(Path::new(o)), "no half-written run");
    let err = fails(&["attach", "--output", o, "--pid", "4000000"], &[], 1);
    assert!(err.contains("no process with PID 4000000"), "{err}");
    let pid_file = out.path().join("bad.pid");
    std::fs::write(&pid_file, "12x\n").unwrap();
    let err = fails(
        &[
            "attach",
            "--output",
            o,
            "--pid-file",
            pid_file.to_str().unwrap(),
        ],
        &[],
        1,
    );
    // Where, not what: a PID file's content is never echoed.
    assert!(err.contains("bad.pid") && err.contains("word 1"), "{err}");
    assert!(!err.contains("12x"), "{err}");
    let err = fails(&["attach", "--output", o, "--socket", "off"], &[], 2);
    assert!(err.contains("--pid"), "{err}");
    assert!(empty(Path::new(o)));
}

#[test]
fn unwritable_output_is_one_clear_error() {
    let err = fails(
        &["run", "--output", "/proc/memtrack-out", "--", "true"],
        &[],
        1,
    );
    assert!(
        err.contains("cannot create output directory /proc/memtrack-out"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let err = fails(
        &["run", "--output", "/etc/hostname/runs", "--", "true"],
        &[],
        1,
    );
    assert!(err.contains("/etc/hostname/runs"), "{err}");
}

#[test]
fn attach_follows_a_running_process_until_it_exits() {
    let out = scratch();
    let mut job = std::process::Command::new("sleep")
        .arg("1")
        .spawn()
        .unwrap();
    let pid_file = out.path().join("job.pid");
    std::fs::write(&pid_file, format!("{}\n", job.id())).unwrap();
    let res = run_to_end(
        memtrack()
            .args(["attach", "--interval", "100ms", "--pid-file"])
            .arg(&pid_file)
            .arg("--output")
            .arg(out.path().join("runs")),
        Duration::from_secs(20),
    );
    job.wait().unwrap();
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let (_, doc) = only_document(&out.path().join("runs"));
    assert_eq!(doc.run.mode, "attach");
    assert_eq!(doc.targets.len(), 1);
    assert!(doc.targets[0].root && doc.targets[0].exited_at.is_some());
}

#[test]
fn help_matches_the_snapshot() {
    for (args, file) in [
        (vec!["--help"], "help.txt"),
        (vec!["run", "--help"], "help-run.txt"),
    ] {
        let out = run_to_end(
            memtrack().args(&args).env("COLUMNS", "100"),
            Duration::from_secs(10),
        );
        assert_eq!(out.status.code(), Some(0));
        let got = String::from_utf8(out.stdout).unwrap();
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/it/snapshots")
            .join(file);
        if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &got).unwrap();
        }
        let want = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            got, want,
            "{file} changed; rerun with UPDATE_SNAPSHOTS=1 and review the diff"
        );
    }
}

#[test]
fn example_config_equals_the_defaults_and_names_every_key() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("memtrack.example.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let layer = memtrack::config::Layer::from_file(&path).unwrap();
    let parsed = memtrack::config::resolve(&[layer]).unwrap();
    assert_eq!(
        parsed,
        memtrack::config::Config::default(),
        "example values = defaults"
    );
    let table: toml::Table = toml::from_str(&text).unwrap();
    let example_keys: Vec<String> = memtrack::config::leaf_keys(&table)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    for (key, _) in memtrack::config::leaf_keys(&memtrack::config::default_table()) {
        assert!(
            example_keys.contains(&key),
            "memtrack.example.toml lacks `{key}`"
        );
    }
    // And `memtrack config --defaults` prints the same values.
    let out = run_to_end(
        memtrack().args(["config", "--defaults"]),
        Duration::from_secs(10),
    );
    let printed: memtrack::config::Config =
        toml::from_str(&String::from_utf8(out.stdout).unwrap()).unwrap();
    assert_eq!(printed, parsed);
}

#[test]
fn a_second_run_in_a_live_run_directory_is_refused_and_harms_nothing() {
    // Regression: the refused run's cleanup removed the live run's
    // `.memtrack/`, so the live run lost its journal and checkpoints.
    let out = scratch();
    let mut first = memtrack()
        .args([
            "run",
            "--listen",
            "off",
            "--interval",
            "100ms",
            "--name",
            "x",
            "--output",
        ])
        .arg(out.path())
        .args(["--", "sleep", "2"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let journal = out.path().join("x/.memtrack/state.json");
    wait_for("the first run's journal", Duration::from_secs(10), || {
        journal.exists()
    });
    let err = fails(
        &[
            "run",
            "--listen",
            "off",
            "--name",
            "x",
            "--output",
            &out.path().display().to_string(),
            "--",
            "true",
        ],
        &[],
        1,
    );
    assert!(err.contains("in use by a live memtrack"), "{err}");
    assert!(journal.exists(), "the live run's journal was removed");
    let status = first.wait().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(&mut first.stderr.take().unwrap(), &mut log).unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("instead"), "the JSON went elsewhere: {log}");
    let doc = read_document(&out.path().join("x/memory_usage.json"));
    assert_eq!(doc.run.status, "finished");
    assert_eq!(doc.run.exit.map(|e| e.code), Some(0));
}

#[test]
fn clearml_resend_without_the_json_says_to_recover_first() {
    let out = scratch();
    let run_dir = out.path().join("r");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::write(run_dir.join(memtrack::export::clearml::SPOOL_FILE), "").unwrap();
    let dir = run_dir.display().to_string();
    let err = fails(&["clearml-resend", &dir], &[], 1);
    let advice = format!(
        "the run's JSON is needed for its name and exit (after a killed memtrack, \
         run `memtrack recover {dir}` first)"
    );
    assert!(err.contains(&advice), "{err}");
    assert!(!err.contains("  "), "a run of spaces: {err}");
}

/// `memtrack config --show` under `env`, expecting success; returns stdout.
fn shown_config(env: &[(&str, &str)], extra: &[&str]) -> String {
    let mut cmd = memtrack();
    cmd.args(["config", "--show"]).args(extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run_to_end(&mut cmd, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(0), "{env:?}: {}", stderr(&out));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn settings_read_as_the_readme_writes_them() {
    // The Python client's own variable is not a daemon setting.
    let out = scratch();
    let o = out.path().to_str().unwrap();
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--output", o, "--", "true"])
        .env("MEMTRACK_BIN", "/x");
    let done = run_to_end(&mut cmd, Duration::from_secs(30));
    assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));

    // A label through its key path, and a percentage for a ratio.
    let shown = shown_config(
        &[
            ("MEMTRACK_LABELS_TEAM", "cv"),
            ("MEMTRACK_PRESSURE_HIGH", "80%"),
        ],
        &[],
    );
    let config: memtrack::config::Config = toml::from_str(&shown).unwrap();
    assert_eq!(config.labels.get("team").map(String::as_str), Some("cv"));
    assert!((config.pressure.high - 0.8).abs() < 1e-9, "{shown}");

    // A value of the wrong type says what to write.
    let err = fails(
        &["config", "--show"],
        &[("MEMTRACK_PRESSURE_HIGH", "high")],
        2,
    );
    assert!(
        err.contains("pressure.high") && err.contains("80%"),
        "{err}"
    );
    let dir = scratch();
    let file = dir.path().join("m.toml");
    std::fs::write(&file, "interval = 5\n").unwrap();
    let err = fails(
        &["config", "--show", "--config", file.to_str().unwrap()],
        &[],
        2,
    );
    assert!(
        err.contains("`interval`") && err.contains("\"5s\""),
        "{err}"
    );
}

#[test]
fn config_defaults_say_what_each_setting_is() {
    let out = run_to_end(
        memtrack().args(["config", "--defaults"]),
        Duration::from_secs(10),
    );
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    // Every `key = value` line sits in a block of lines opened by a
    // comment: a key never stands without a word about it.
    let mut commented = false;
    let mut keys = 0;
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('[') {
            commented = false;
        } else if t.starts_with('#') {
            commented = true;
        } else {
            keys += 1;
            assert!(commented, "`{t}` has no comment above it:\n{text}");
        }
    }
    let all = memtrack::config::leaf_keys(&memtrack::config::default_table()).len();
    assert!(
        keys + 1 >= all,
        "{keys} keys printed, {all} settings (labels has none)"
    );
}
