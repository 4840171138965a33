//! S3 / MinIO uploads (issue 6), against a real S3 server that checks
//! signatures (s3s-fs) on loopback.

use std::process::Command;
use std::time::Duration;

use crate::common::*;

fn run_with_s3(
    server: &S3Server,
    out: &std::path::Path,
    secret: &str,
    extra: &[&str],
    job: &[&str],
) -> std::process::Output {
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out)
        .args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &server.endpoint(),
        ])
        .args(extra)
        .arg("--")
        .args(job);
    for (k, v) in server.env(secret) {
        cmd.env(k, v);
    }
    run_to_end(&mut cmd, Duration::from_secs(120))
}

const KEY: &str = "runs/job/artifacts/memory_usage/memory_usage.json";

#[test]
fn the_uploaded_object_equals_the_local_file() {
    let server = S3Server::start();
    let out = scratch();
    let res = run_with_s3(
        &server,
        out.path(),
        S3_SECRET,
        &[],
        &["sh", "-c", "sleep 0.3; exit 3"],
    );
    assert_eq!(
        res.status.code(),
        Some(3),
        "the job's status: {}",
        stderr(&res)
    );
    let local = std::fs::read(out.path().join("job/memory_usage.json")).unwrap();
    assert_eq!(
        server.object(KEY).as_deref(),
        Some(local.as_slice()),
        "byte for byte at the documented key"
    );
    assert!(
        stderr(&res).contains(&format!("uploaded s3://{}/{KEY}", server.bucket)),
        "{}",
        stderr(&res)
    );
}

#[test]
fn a_wrong_secret_is_a_clear_credentials_error_and_the_file_stays() {
    let server = S3Server::start();
    let out = scratch();
    let res = run_with_s3(&server, out.path(), "not-the-secret", &[], &["true"]);
    assert_eq!(
        res.status.code(),
        Some(0),
        "the job's status wins in run mode"
    );
    let err = stderr(&res);
    assert!(
        err.contains("refused the credentials")
            && err.contains("SignatureDoesNotMatch")
            && err.contains(&server.endpoint())
            && err.contains(&server.bucket),
        "{err}"
    );
    assert!(
        !err.contains("not-the-secret"),
        "the secret never appears in logs"
    );
    let doc = read_document(&out.path().join("job/memory_usage.json"));
    assert_eq!(doc.run.status, "finished");
    assert!(server.object(KEY).is_none());
}

#[test]
fn a_missing_bucket_is_named() {
    let server = S3Server::start();
    let out = scratch();
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out.path())
        .args([
            "--s3-url",
            "s3://no-such-bucket/runs",
            "--s3-endpoint",
            &server.endpoint(),
            "--",
            "true",
        ]);
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    assert_eq!(res.status.code(), Some(0));
    assert!(
        stderr(&res).contains("bucket `no-such-bucket` does not exist"),
        "{}",
        stderr(&res)
    );
    assert!(out.path().join("job/memory_usage.json").is_file());
}

#[test]
fn server_down_at_the_end_then_memtrack_upload_succeeds() {
    let mut server = S3Server::start();
    server.down();
    let out = scratch();
    let res = run_with_s3(&server, out.path(), S3_SECRET, &[], &["true"]);
    assert_eq!(res.status.code(), Some(0));
    let err = stderr(&res);
    assert!(
        err.contains("cannot reach S3")
            && err.contains("after 5 attempts")
            && err.contains("memtrack upload"),
        "{err}"
    );
    let file = out.path().join("job/memory_usage.json");
    let local = std::fs::read(&file).unwrap();
    assert_eq!(
        read_document(&file).run.status,
        "finished",
        "local file intact"
    );

    server.up();
    let mut cmd = memtrack();
    cmd.arg("upload").arg(&file).args([
        "--s3-url",
        &format!("s3://{}/runs", server.bucket),
        "--s3-endpoint",
        &server.endpoint(),
    ]);
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert_eq!(
        String::from_utf8_lossy(&res.stdout).trim(),
        format!("s3://{}/{KEY}", server.bucket)
    );
    assert_eq!(server.object(KEY).as_deref(), Some(local.as_slice()));
}

#[test]
fn a_50_mb_document_goes_up_in_parts_and_round_trips() {
    let server = S3Server::start();
    let dir = scratch();
    // A real document, made large by a long event log.
    let mut doc = memtrack::model::Document {
        schema: memtrack::model::SCHEMA_VERSION,
        ..Default::default()
    };
    doc.run.name = "big".into();
    let entry = memtrack::model::Entry {
        component: "model".into(),
        operation: "step".into(),
        timestamp: 1_795_000_000.25,
        cpu_ram_used_mb: 1024.5,
        ..Default::default()
    };
    doc.detailed_log = vec![entry; 170_000];
    let file = dir.path().join("memory_usage.json");
    memtrack::export::json::write_document(&file, &doc).unwrap();
    let local = std::fs::read(&file).unwrap();
    assert!(local.len() > 50 << 20, "{} bytes", local.len());

    let mut cmd = memtrack();
    cmd.arg("upload").arg(&file).args([
        "--s3-url",
        &format!("s3://{}/archive", server.bucket),
        "--s3-endpoint",
        &server.endpoint(),
    ]);
    cmd.env("MEMTRACK_LOG_LEVEL", "info");
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let key = "archive/big/artifacts/memory_usage/memory_usage.json";
    // 50+ MiB in 8 MiB parts.
    assert!(stderr(&res).contains("7 parts"), "{}", stderr(&res));
    let stored = server.object(key).expect("stored");
    assert!(
        stored == local,
        "multipart object differs from the local file"
    );
}

#[test]
fn credentials_never_reach_logs_json_or_memory_info() {
    let server = S3Server::start();
    let out = scratch();
    let info = out.path().join("memory-info.json");
    let script = format!(
        "import json, os, re, time, urllib.request\n\
         time.sleep(0.5)\n\
         port = open({port:?}).read().strip()\n\
         base = 'http://127.0.0.1:%s' % port\n\
         open({info:?}, 'wb').write(urllib.request.urlopen(base + '/memory-info').read() + urllib.request.urlopen(base + '/metrics').read())\n",
        port = out.path().join("port").display().to_string(),
        info = info.display().to_string()
    );
    let d = {
        let mut env: Vec<(&str, &str)> = Vec::new();
        let s3_env = server.env(S3_SECRET);
        for (k, v) in &s3_env {
            env.push((k, v.as_str()));
        }
        // ClearML on, at a host that refuses: its errors are logged too.
        env.push(("CLEARML_API_HOST", "http://127.0.0.1:9"));
        env.push(("CLEARML_API_ACCESS_KEY", "clearml-key-0123456789"));
        env.push(("CLEARML_API_SECRET_KEY", "clearml-secret-do-not-log"));
        env.push(("MEMTRACK_CLEARML_FINAL_FLUSH_TIMEOUT", "1s"));
        // The run is `d`, too short a ClearML task name: name the task.
        env.push(("MEMTRACK_CLEARML_TASK_NAME", "memtrack test"));
        env.push(("MEMTRACK_LOG_LEVEL", "debug"));
        let url = format!("s3://{}/runs", server.bucket);
        let endpoint = server.endpoint();
        Daemon::start(
            out.path(),
            &[
                "--interval",
                "100ms",
                "--s3-url",
                &url,
                "--s3-endpoint",
                &endpoint,
            ],
            &python(&script),
            &env,
        )
    };
    std::fs::write(out.path().join("port"), d.http.port().to_string()).unwrap();
    let (code, _, log) = d.finish_logged();
    assert_eq!(code, Some(0));
    let mut everything = log.clone();
    everything.push_str(&std::fs::read_to_string(out.path().join("d/memory_usage.json")).unwrap());
    let served = std::fs::read_to_string(&info).unwrap();
    assert!(
        served.contains("memtrack_build_info"),
        "the job read /memory-info and /metrics"
    );
    everything.push_str(&served);
    for secret in [S3_SECRET, "clearml-secret-do-not-log"] {
        assert!(!everything.contains(secret), "{secret} leaked");
    }
    assert!(log.contains("uploaded s3://"), "the upload happened: {log}");
    assert!(log.contains("ClearML"), "ClearML was on: {log}");
    assert!(log.contains("DEBUG"), "at the most verbose level: {log}");
}

#[test]
fn attach_reports_a_failed_upload_in_its_status() {
    let mut server = S3Server::start();
    server.down();
    let out = scratch();
    let mut job = Command::new("sleep").arg("0.5").spawn().unwrap();
    let mut cmd = memtrack();
    cmd.args([
        "attach",
        "--listen",
        "off",
        "--socket",
        "off",
        "--interval",
        "100ms",
        "--name",
        "a",
        "--output",
    ])
    .arg(out.path())
    .args(["--pid", &job.id().to_string()])
    .args([
        "--s3-url",
        &format!("s3://{}/runs", server.bucket),
        "--s3-endpoint",
        &server.endpoint(),
    ]);
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    job.wait().unwrap();
    assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
    assert!(out.path().join("a/memory_usage.json").is_file());
}

#[test]
fn checkpoints_are_uploaded_during_the_run_and_the_final_file_wins() {
    let server = S3Server::start();
    let out = scratch();
    let conf = out.path().join("m.toml");
    std::fs::write(&conf, "[s3]\nupload_checkpoints = true\n").unwrap();
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out.path())
        .args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &server.endpoint(),
            "--checkpoint-interval",
            "1s",
            "--interval",
            "100ms",
            "--config",
        ])
        .arg(&conf)
        .args(["--", "sh", "-c", "sleep 4"])
        .stderr(std::process::Stdio::null());
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    // A checkpoint arrives while the job still runs.
    let mut mid = None;
    wait_for("a checkpoint upload", Duration::from_secs(15), || {
        mid = server
            .object(KEY)
            .and_then(|b| serde_json::from_slice::<memtrack::model::Document>(&b).ok());
        mid.is_some()
    });
    assert_eq!(mid.unwrap().run.status, "running");
    assert!(child.try_wait().unwrap().is_none(), "still running");
    assert_eq!(child.wait().unwrap().code(), Some(0));
    // The last word is the final document, not a late checkpoint.
    let local = std::fs::read(out.path().join("job/memory_usage.json")).unwrap();
    assert_eq!(server.object(KEY).as_deref(), Some(local.as_slice()));
    assert_eq!(
        read_document(&out.path().join("job/memory_usage.json"))
            .run
            .status,
        "finished"
    );
}
