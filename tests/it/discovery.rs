//! Many runs on one machine: each finds a free metrics port when the
//! default is taken, says where its socket and metrics are, is listed by
//! `memtrack ls`, answers `--run NAME`, and is found by a real Prometheus
//! through its file-based service-discovery file, which goes away with it.

use std::io::BufRead;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;
use crate::prometheus::{api, free_port, get, query, stop_child, tool};

/// A job that holds a little memory until `stop` exists.
fn waiting_job(stop: &Path) -> Vec<String> {
    python(&format!(
        "import os, time\nb = bytearray(8 << 20)\nwhile not os.path.exists({:?}): time.sleep(0.05)\n",
        stop.display().to_string()
    ))
}

/// A `memtrack run` with the default metrics address and socket, its
/// runtime folder in `xdg`.
struct Run {
    child: Option<Child>,
    stop: PathBuf,
    stderr: Arc<Mutex<String>>,
    /// The start line.
    line: String,
}

impl Run {
    fn start(xdg: &Path, out: &Path, name: &str) -> Run {
        Run::start_with(xdg, out, name, &[])
    }

    /// [`Run::start`] with more flags.
    fn start_with(xdg: &Path, out: &Path, name: &str, args: &[&str]) -> Run {
        let stop = out.join(format!("{name}.stop"));
        let mut child = memtrack()
            .args(["run", "--interval", "200ms", "--name", name, "--output"])
            .arg(out)
            .args(args)
            .arg("--")
            .args(waiting_job(&stop))
            .env("XDG_RUNTIME_DIR", xdg)
            .env_remove("MEMTRACK_SOCKET")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = Arc::clone(&stderr);
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                if line.contains("metrics on http://") || line.contains("no metrics") {
                    let _ = tx.send(line.clone());
                }
                let mut all = sink.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("no start line:\n{}", stderr.lock().unwrap())
            });
        Run {
            child: Some(child),
            stop,
            stderr,
            line,
        }
    }

    /// The metrics address the start line gives.
    fn metrics(&self) -> SocketAddr {
        let rest = self.line.split("metrics on http://").nth(1).unwrap();
        rest.trim_end_matches("/metrics").parse().unwrap()
    }

    /// The socket the start line gives.
    fn socket(&self) -> PathBuf {
        let rest = self.line.split("socket ").nth(1).unwrap();
        PathBuf::from(rest.split(';').next().unwrap())
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Tells the job to end and waits for memtrack's exit status.
    fn finish(mut self) -> Option<i32> {
        std::fs::write(&self.stop, "").unwrap();
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "memtrack did not end:\n{}",
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.stop, "");
        stop_child(self.child.take(), "memtrack");
    }
}

/// `memtrack ARGS` with the runtime folder `xdg`: (exit status, stdout,
/// stderr).
fn tool_in(xdg: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = run_to_end(
        memtrack()
            .args(args)
            .env("XDG_RUNTIME_DIR", xdg)
            .env_remove("MEMTRACK_SOCKET"),
        Duration::from_secs(20),
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr(&out),
    )
}

/// The live runs `ls` lists whose run folder is under `out` (`ls` lists
/// every run of this user, other tests' too).
fn listed(xdg: &Path, out: &Path) -> Vec<Value> {
    let (code, text, err) = tool_in(xdg, &["ls", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let all = serde_json::from_str::<Vec<Value>>(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    all.into_iter()
        .filter(|r| {
            r["dir"]
                .as_str()
                .is_some_and(|d| Path::new(d).starts_with(out))
        })
        .collect()
}

#[test]
fn two_runs_share_a_machine_listed_found_by_name_and_port() {
    let xdg = scratch();
    let out = scratch();
    // The default port held by something else: both runs must move on.
    let _held = TcpListener::bind(memtrack::config::DEFAULT_LISTEN).ok();
    let a = Run::start(xdg.path(), out.path(), "alpha");
    let b = Run::start(xdg.path(), out.path(), "beta");
    for run in [&a, &b] {
        assert_ne!(
            run.metrics().to_string(),
            memtrack::config::DEFAULT_LISTEN,
            "{}",
            run.line
        );
        assert!(run.socket().exists(), "{}", run.line);
        let (status, body) = http_request(run.metrics(), "GET", "/metrics");
        assert_eq!(status, 200);
        assert!(body.contains("run=\""), "metrics carry the run label");
    }
    assert_ne!(a.metrics(), b.metrics());

    // `ls` lists both, with what the start lines said.
    let runs = listed(xdg.path(), out.path());
    let names: Vec<&str> = runs.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ["alpha", "beta"], "{runs:?}");
    assert_eq!(runs[1]["pid"], b.pid());
    assert_eq!(runs[1]["metrics"], b.metrics().to_string());
    assert_eq!(runs[1]["socket"], b.socket().display().to_string());
    let (code, table, _) = tool_in(xdg.path(), &["ls"]);
    assert_eq!(code, Some(0));
    assert!(
        table.contains("alpha") && table.contains(&b.socket().display().to_string()),
        "{table}"
    );

    // Another shell reaches each run by name.
    let (code, text, err) = tool_in(xdg.path(), &["status", "--run", "beta", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let status: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status["run"]["name"], "beta", "{text}");
    let (code, text, err) = tool_in(
        xdg.path(),
        &["mark", "--run", "alpha", "probe", "from_shell", "--wait"],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(text.contains("recorded probe/from_shell"), "{text}");
    let (code, _, err) = tool_in(xdg.path(), &["status", "--run", "gamma"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("gamma") && err.contains("alpha") && err.contains("beta"),
        "{err}"
    );
    let (code, _, err) = tool_in(xdg.path(), &["status"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--run"), "{err}");

    assert_eq!(a.finish(), Some(0));
    let runs = listed(xdg.path(), out.path());
    assert_eq!(runs.len(), 1, "the ended run is no longer listed: {runs:?}");
    assert_eq!(b.finish(), Some(0));
    assert!(listed(xdg.path(), out.path()).is_empty());
    let doc = read_document(&out.path().join("alpha/memory_usage.json"));
    assert!(doc
        .detailed_log
        .iter()
        .any(|e| e.component == "probe" && e.operation == "from_shell"));
}

/// A run started by the `memtrack-run@` unit keeps its runtime folder in
/// `/run/memtrack-<instance>` (its `XDG_RUNTIME_DIR`); a shell of the same
/// user, whatever its own `XDG_RUNTIME_DIR`, lists it and reaches it by
/// name.
#[test]
fn a_run_of_a_service_is_listed_from_a_login_shell() {
    use std::os::unix::fs::DirBuilderExt;
    let service = PathBuf::from(format!("/run/memtrack-it-{}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&service)
        .unwrap();
    struct Gone(PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _gone = Gone(service.clone());
    let shell = scratch();
    let out = scratch();
    let run = Run::start(&service, out.path(), "svc-run");
    let runs = listed(shell.path(), out.path());
    let names: Vec<&str> = runs.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ["svc-run"], "{runs:?}");
    assert_eq!(runs[0]["pid"], run.pid());
    let (code, text, err) = tool_in(shell.path(), &["status", "--run", "svc-run", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(text.contains("svc-run"), "{text}");
    assert_eq!(run.finish(), Some(0));
    assert!(listed(shell.path(), out.path()).is_empty());
}

/// One `--listen` for every rank of a job (the SLURM example's
/// `MEMTRACK_LISTEN`) meets a taken port: the job still starts, on a free
/// port of the same host, said in a warning, and what discovery records
/// (`ls`, the file_sd file) is the port actually served.
#[test]
fn a_taken_listen_address_gives_a_free_port_and_the_job_starts() {
    let xdg = scratch();
    let out = scratch();
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = held.local_addr().unwrap();
    let run = Run::start_with(
        xdg.path(),
        out.path(),
        "taken",
        &["--listen", &taken.to_string()],
    );
    let got = run.metrics();
    assert_eq!(got.ip(), taken.ip(), "{}", run.line);
    assert_ne!(got.port(), taken.port(), "{}", run.line);
    let log = run.stderr.lock().unwrap().clone();
    assert!(
        log.contains(&format!("cannot listen on {taken}")) && log.contains("WARN"),
        "{log}"
    );
    let (status, body) = http_request(got, "GET", "/metrics");
    assert_eq!(status, 200);
    assert!(body.contains("run=\"taken\""), "{body}");
    let runs = listed(xdg.path(), out.path());
    assert_eq!(runs[0]["metrics"], got.to_string(), "{runs:?}");
    let sd = run
        .line
        .split("Prometheus file_sd ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap_or_else(|| panic!("no file_sd in {}", run.line));
    let targets = std::fs::read_to_string(sd).unwrap();
    assert!(targets.contains(&got.to_string()), "{targets}");
    assert!(!targets.contains(&taken.to_string()), "{targets}");
    assert_eq!(run.finish(), Some(0));
    drop(held);
}

/// The `file_sd` targets Prometheus has: (run label, health).
fn sd_targets(prom: SocketAddr) -> Vec<(String, String)> {
    api(prom, "targets")["activeTargets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["labels"]["run"].as_str().unwrap_or("").to_string(),
                t["health"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

#[test]
fn prometheus_finds_each_run_through_its_discovery_file() {
    let prometheus = tool("prometheus");
    let xdg = scratch();
    let out = scratch();
    let sd = xdg.path().join("memtrack/sd");
    let a = Run::start(xdg.path(), out.path(), "alpha");
    let b = Run::start(xdg.path(), out.path(), "beta");
    let files: Vec<PathBuf> = std::fs::read_dir(&sd)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(a.line.contains(&sd.display().to_string()), "{}", a.line);

    let prom: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dir = scratch();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: memtrack\n    honor_labels: true\n    \
             file_sd_configs:\n      - files: ['{}/*.json']\n        refresh_interval: 1s\n",
            sd.display()
        ),
    )
    .unwrap();
    let log = dir.path().join("prometheus.log");
    let mut server = Some(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={prom}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let prom_log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for("prometheus ready", Duration::from_secs(30), || {
        get(prom, "/-/ready").0 == 200
    });

    // Both runs scraped, each under its own run label.
    wait_for(
        "both runs up in prometheus",
        Duration::from_secs(30),
        || {
            let mut t = sd_targets(prom);
            t.sort();
            t == [("alpha".into(), "up".into()), ("beta".into(), "up".into())]
        },
    );
    wait_for("series of both runs", Duration::from_secs(30), || {
        let r = query(prom, "count by (run) (memtrack_build_info)");
        r.len() == 2
    });
    let up = query(prom, "up{job=\"memtrack\"}");
    let mut runs: Vec<&str> = up
        .iter()
        .filter_map(|r| r["metric"]["run"].as_str())
        .collect();
    runs.sort();
    assert_eq!(runs, ["alpha", "beta"], "{up:?}\n{}", prom_log());

    // The first run ends: its file goes, and Prometheus drops its target
    // rather than scraping whatever takes its port next.
    assert_eq!(a.finish(), Some(0));
    assert_eq!(std::fs::read_dir(&sd).unwrap().count(), 1);
    wait_for(
        "the ended run's target dropped",
        Duration::from_secs(30),
        || sd_targets(prom) == [("beta".into(), "up".into())],
    );
    assert_eq!(b.finish(), Some(0));
    assert_eq!(std::fs::read_dir(&sd).unwrap().count(), 0);
    stop_child(server.take(), "prometheus");
}
