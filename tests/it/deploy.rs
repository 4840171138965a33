//! Deployment: systemd units, SLURM / torchrun / Kubernetes
//! examples, multi-node labels and `memtrack merge`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::*;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[test]
fn every_systemd_unit_passes_systemd_analyze_verify() {
    let dir = scratch();
    let units: Vec<PathBuf> = std::fs::read_dir(repo("systemd"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(units.len() >= 3, "{units:?}");
    let mut names = Vec::new();
    for unit in &units {
        // verify checks that ExecStart's program exists: point it at the
        // binary under test.
        let text = std::fs::read_to_string(unit)
            .unwrap()
            .replace("/usr/local/bin/memtrack", env!("CARGO_BIN_EXE_memtrack"));
        let name = unit
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace("@.service", "@example.service");
        std::fs::write(dir.path().join(&name), text).unwrap();
        names.push(name);
    }
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&names)
        .current_dir(dir.path())
        .output()
        .expect("systemd-analyze (Debian package systemd)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.trim().is_empty(),
        "systemd-analyze verify: {err}"
    );
}

#[test]
fn the_kubernetes_yaml_validates_and_wires_the_sidecar() {
    let files = [
        repo("examples/kubernetes/training-job.yaml"),
        repo("examples/kubernetes/servicemonitor.yaml"),
    ];
    let out = Command::new("kubernetes-validate")
        .arg("--strict")
        .args(&files)
        .output()
        .unwrap_or_else(|e| {
            panic!("kubernetes-validate ({e}); scripts/test installs it from PyPI")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("training-job.yaml passed"), "{text}");

    // The wiring a schema cannot check.
    let check = r#"
import sys, yaml
job = yaml.safe_load(open(sys.argv[1]))
pod = job["spec"]["template"]
spec = pod["spec"]
assert spec["shareProcessNamespace"] is True
sidecar = [c for c in spec["initContainers"] if c["name"] == "memtrack"][0]
assert sidecar["restartPolicy"] == "Always"
trainer = spec["containers"][0]
socket = [a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--socket=")][0]
env = {e["name"]: e.get("value") for e in trainer["env"]}
assert env["MEMTRACK_SOCKET"] == socket, (env, socket)
mount = lambda c: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
assert mount(sidecar)["memtrack-socket"] == mount(trainer)["memtrack-socket"] == socket.rsplit("/", 1)[0]
port = [p for p in sidecar["ports"] if p["name"] == "metrics"][0]["containerPort"]
assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
# Bound to the pod's address, where the scraper and the probe reach it.
assert any(a == "--listen=$(POD_IP):%d" % port for a in sidecar["args"])
pod_ip = [e for e in sidecar["env"] if e["name"] == "POD_IP"][0]
assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
assert not any("0.0.0.0" in a for c in spec["initContainers"] + spec["containers"] for a in c.get("args", []))
monitor = [d for d in yaml.safe_load_all(open(sys.argv[2])) if d["kind"] == "ServiceMonitor"][0]
service = [d for d in yaml.safe_load_all(open(sys.argv[2])) if d["kind"] == "Service"][0]
assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
assert service["spec"]["selector"] == {"app.kubernetes.io/name": pod["metadata"]["labels"]["app.kubernetes.io/name"]}
print("wired")
"#;
    let out = Command::new("python3")
        .args(["-c", check])
        .args(&files)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "wired",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn no_example_serves_metrics_on_every_interface() {
    // Other users and hosts reach whatever memtrack binds: the examples
    // bind where a scraper needs (loopback, the pod's address), no wider.
    for file in [
        "examples/kubernetes/training-job.yaml",
        "examples/slurm/run_gpu_memtrack.sh",
        "examples/torchrun/launch.sh",
        "examples/docker/run_gpu_memtrack.sh",
        "systemd/memtrack-attach.service",
        "systemd/memtrack-run@.service",
    ] {
        let text = std::fs::read_to_string(repo(file)).unwrap();
        for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            assert!(
                !line.contains("0.0.0.0") && !line.contains("[::]"),
                "{file} binds every interface: {line}"
            );
        }
    }
}

#[test]
fn the_shell_examples_parse() {
    for script in [
        "examples/slurm/run_gpu_memtrack.sh",
        "examples/torchrun/launch.sh",
        "examples/docker/run_gpu_memtrack.sh",
    ] {
        let out = Command::new("bash")
            .arg("-n")
            .arg(repo(script))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn slurm_and_torchrun_variables_reach_run_labels_and_metrics() {
    let dir = scratch();
    let env = [
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_PROCID", "3"),
        ("SLURM_NODEID", "1"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "8"),
    ];
    let d = Daemon::start(
        dir.path(),
        &["--interval", "100ms"],
        &["sleep".into(), "1.5".into()],
        &env,
    );
    wait_for("a sample", Duration::from_secs(10), || {
        d.http("GET", "/healthz").0 == 200
    });
    let (_, metrics) = d.http("GET", "/metrics");
    let info = metrics
        .lines()
        .find(|l| l.starts_with("memtrack_run_info{"))
        .expect("memtrack_run_info");
    for needle in [
        "slurm_job_id=\"4242\"",
        "slurm_procid=\"3\"",
        "slurm_nodeid=\"1\"",
        "local_rank=\"0\"",
        "world_size=\"8\"",
    ] {
        assert!(info.contains(needle), "{needle} in {info}");
    }
    // rank (= SLURM_PROCID) labels every series.
    assert!(
        metrics.contains("memtrack_tree_processes{run=\"d\",host=\""),
        "{metrics}"
    );
    assert!(metrics
        .lines()
        .filter(|l| l.starts_with("memtrack_tree_processes{"))
        .all(|l| l.contains("rank=\"3\"")));
    // SLURM_PROCID makes this run rank 3: its directory says so.
    let out = d.out.clone();
    let mut d = d;
    let status = d.child.wait().unwrap();
    assert!(status.success());
    let doc = read_document(&out.join("d.rank3/memory_usage.json"));
    for (k, v) in [
        ("slurm_job_id", "4242"),
        ("rank", "3"),
        ("local_rank", "0"),
        ("world_size", "8"),
    ] {
        assert_eq!(doc.run.labels.get(k).map(String::as_str), Some(v), "{k}");
    }
}

/// One rank of a simulated job: holds `mib` MiB for a moment.
fn rank_run(out: &Path, rank: u32, mib: u32, s3: Option<&S3Server>) -> std::process::Output {
    let script = format!(
        "import time\nb = bytearray({mib} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(0.6)\n"
    );
    let mut run = MemtrackRun::new("job4", out)
        .interval("100ms")
        .args(["--label", &format!("rank={rank}")]);
    if let Some(s3) = s3 {
        run = run.s3(s3);
    }
    run.run(python(&script), Duration::from_secs(60))
}

#[test]
fn a_four_rank_job_merges_locally_and_from_s3() {
    let s3 = S3Server::start();
    let out = scratch();
    let sizes = [100u32, 150, 400, 200];
    for (rank, mib) in sizes.iter().enumerate() {
        let res = rank_run(out.path(), rank as u32, *mib, Some(&s3));
        assert_eq!(res.status.code(), Some(0), "rank {rank}: {}", stderr(&res));
    }
    // Each rank has its own directory; on S3 they share the job's folder.
    let dirs: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for r in 0..4 {
        assert!(dirs.contains(&format!("job4.rank{r}")), "{dirs:?}");
    }
    let files: Vec<String> = (0..4)
        .map(|r| {
            out.path()
                .join(format!("job4.rank{r}/memory_usage.json"))
                .display()
                .to_string()
        })
        .collect();
    let rank2 = read_document(Path::new(&files[2]));
    assert_eq!(rank2.run.name, "job4", "ranks share the job's run name");

    // As examples/slurm does: into the job's folder, which no rank made.
    let merged_path = out.path().join("job4/memory_usage.json");
    let res = run_to_end(
        memtrack()
            .arg("merge")
            .args(&files)
            .arg("-o")
            .arg(&merged_path),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let merged = read_document(&merged_path);
    assert_eq!(merged.ranks.len(), 4);
    assert_eq!(
        merged.worst_rank["host_ram"], "2",
        "{:?}",
        merged.worst_rank
    );
    assert_eq!(
        merged.peak_usage.figures.cpu_ram_used_mb, rank2.peak_usage.figures.cpu_ram_used_mb,
        "the job's peak is rank 2's"
    );
    assert!(merged.peak_usage.figures.cpu_ram_used_mb >= 400.0);
    // How the ranks measured carries over: the report of the job says the
    // same source as each rank's.
    let source = |d: &memtrack::model::Document| d.host.as_ref().map(|h| h.source);
    assert!(source(&rank2).is_some());
    assert_eq!(source(&merged), source(&rank2));

    // A file given twice is not a job of two ranks: refused, nothing
    // written; --force merges it anyway, the repeat named by position.
    let twice = out.path().join("twice.json");
    let res = run_to_end(
        memtrack()
            .arg("merge")
            .args([&files[0], &files[0]])
            .arg("-o")
            .arg(&twice),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
    assert!(
        stderr(&res).contains("both rank \"0\"") && stderr(&res).contains("--force"),
        "{}",
        stderr(&res)
    );
    assert!(!twice.exists(), "a refused merge writes nothing");
    let res = run_to_end(
        memtrack()
            .args(["merge", "--force"])
            .args([&files[0], &files[0]])
            .arg("-o")
            .arg(&twice),
        Duration::from_secs(30),
    );
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let forced: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&twice).unwrap()).unwrap();
    let ranks: Vec<&str> = forced["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rank"].as_str().unwrap())
        .collect();
    assert_eq!(ranks, ["0", "0#1"]);

    // The same from the object store's prefix.
    let mut cmd = memtrack();
    cmd.args([
        "merge",
        &format!("s3://{}/runs/job4/", s3.bucket),
        "--s3-endpoint",
        &s3.endpoint(),
        "-o",
    ])
    .arg(out.path().join("merged-s3.json"));
    for (k, v) in s3.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(30));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let from_s3 = read_document(&out.path().join("merged-s3.json"));
    assert_eq!(from_s3.ranks.len(), 4);
    assert_eq!(from_s3.worst_rank, merged.worst_rank);
    assert_eq!(from_s3.peak_usage, merged.peak_usage);

    // And report reads it, naming the worst rank.
    let res = run_to_end(
        memtrack().arg("report").arg(&merged_path),
        Duration::from_secs(30),
    );
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(
        text.contains("Ranks") && text.contains("worst host_ram: rank 2"),
        "{text}"
    );
}

/// The SLURM example merges and reports when the job fails too, and exits
/// with the job's status. `srun` and `memtrack` are stand-ins that note
/// their calls (no SLURM here); the script itself runs as written.
#[test]
fn the_slurm_example_merges_and_reports_when_the_job_fails() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let calls = dir.path().join("calls");
    for (name, body) in [
        ("srun", "echo srun >> \"$CALLS\"; exit 3\n"),
        ("memtrack", "echo \"memtrack $1\" >> \"$CALLS\"\n"),
    ] {
        let path = bin.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = Command::new("bash")
        .arg(repo("examples/slurm/run_gpu_memtrack.sh"))
        .current_dir(dir.path())
        .env("PATH", path)
        .env("CALLS", &calls)
        .env("SLURM_JOB_ID", "77")
        .env("SLURM_SUBMIT_DIR", dir.path())
        .output()
        .unwrap();
    let noted = std::fs::read_to_string(&calls).unwrap_or_default();
    assert_eq!(
        noted.lines().collect::<Vec<_>>(),
        ["srun", "memtrack merge", "memtrack report"],
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(3), "the job's status");
}
