//! S3 / MinIO uploads, against a real S3 server that checks
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
    // The report page beside it.
    let page = std::fs::read(out.path().join("job/memory_report.html")).unwrap();
    assert_eq!(
        server
            .object("runs/job/artifacts/memory_usage/memory_report.html")
            .as_deref(),
        Some(page.as_slice()),
        "{}",
        stderr(&res)
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
    let (file, local) = fifty_mb_document(dir.path());

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

/// AWS settings of the machine running the tests must not reach memtrack.
fn without_aws_env(cmd: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// A listener that accepts connections and never answers on them, until
/// dropped.
struct Silent {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Silent {
    fn start(port: u16) -> Silent {
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stopped.load(std::sync::atomic::Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => held.push(conn),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            held.len()
        });
        Silent {
            stop,
            thread: Some(thread),
        }
    }

    /// Closes everything; returns how many connections it held.
    fn stop(mut self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The command memtrack printed after "run: ", as one line.
fn printed_command(log: &str) -> String {
    log.lines()
        .find_map(|l| l.split_once("to upload it later, run: ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("no retry command in:\n{log}"))
        .trim()
        .to_string()
}

/// Runs a printed command line in a shell, `memtrack` being the binary
/// under test (as when it is installed in PATH).
fn run_printed(line: &str, env: &[(&'static str, String)]) -> std::process::Output {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_memtrack"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", line]).env("PATH", path);
    without_aws_env(&mut cmd);
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_to_end(&mut cmd, Duration::from_secs(60))
}

#[test]
fn a_server_that_never_answers_costs_the_deadline_and_the_printed_command_uploads_later() {
    let mut server = S3Server::start();
    server.down();
    // The server's address accepts connections and never answers.
    let silent = Silent::start(server.port);
    let out = scratch();
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out.path())
        .args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &server.endpoint(),
            "--",
            "true",
        ])
        .env("MEMTRACK_FINISH_TIMEOUT", "4s");
    without_aws_env(&mut cmd);
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    // Without a deadline the SDK's retries (5 × 60 s) outlast this bound.
    let res = run_to_end(&mut cmd, Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(0), "the job's status wins");
    assert!(silent.stop() > 0, "memtrack did connect");
    let err = stderr(&res);
    assert!(
        err.contains(&format!("waiting for the upload to {}", server.endpoint()))
            && err.contains("did not answer within 4s (finish_timeout)"),
        "one progress line, then the deadline: {err}"
    );
    let line = printed_command(&err);
    assert!(
        line.contains(&format!("--s3-url s3://{}/runs", server.bucket))
            && line.contains(&format!("--s3-endpoint {}", server.endpoint())),
        "{line}"
    );
    let file = out.path().join("job/memory_usage.json");
    let local = std::fs::read(&file).unwrap();

    // Run as printed, from elsewhere, once the server is back.
    server.up();
    let res = run_printed(&line, &server.env(S3_SECRET));
    assert_eq!(res.status.code(), Some(0), "{line}: {}", stderr(&res));
    assert_eq!(server.object(KEY).as_deref(), Some(local.as_slice()));
}

/// A loopback proxy in front of the S3 server that keeps every byte the
/// client sent, so a test can read the requests' lines and headers.
struct Recorder {
    port: u16,
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Recorder {
    fn start(target: u16) -> Recorder {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (log, stopped) = (std::sync::Arc::clone(&seen), std::sync::Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stopped.load(std::sync::atomic::Ordering::SeqCst) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let server = std::net::TcpStream::connect(("127.0.0.1", target)).unwrap();
                let pump =
                    |mut from: std::net::TcpStream,
                     mut to: std::net::TcpStream,
                     log: Option<std::sync::Arc<std::sync::Mutex<Vec<u8>>>>| {
                        std::thread::spawn(move || {
                            let mut buf = [0u8; 64 * 1024];
                            loop {
                                match from.read(&mut buf) {
                                    Ok(0) | Err(_) => break,
                                    Ok(n) => {
                                        if let Some(log) = &log {
                                            log.lock().unwrap().extend_from_slice(&buf[..n]);
                                        }
                                        if to.write_all(&buf[..n]).is_err() {
                                            break;
                                        }
                                    }
                                }
                            }
                            let _ = to.shutdown(std::net::Shutdown::Write);
                        });
                    };
                pump(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    Some(std::sync::Arc::clone(&log)),
                );
                pump(server, client, None);
            }
        });
        Recorder { port, seen, stop }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A temporary HOME holding AWS CLI files.
fn aws_home(config: &str, credentials: &str) -> tempfile::TempDir {
    let home = scratch();
    std::fs::create_dir(home.path().join(".aws")).unwrap();
    std::fs::write(home.path().join(".aws/config"), config).unwrap();
    std::fs::write(home.path().join(".aws/credentials"), credentials).unwrap();
    home
}

#[test]
fn a_profile_endpoint_and_region_upload_path_style_signed_for_that_region() {
    let server = S3Server::start();
    let proxy = Recorder::start(server.port);
    // As MinIO's docs set up the AWS CLI: a host name, not an address (an
    // address would get path style from the SDK anyway).
    let home = aws_home(
        &format!(
            "[profile minio]\nendpoint_url = http://localhost:{}\nregion = eu-west-3\n",
            proxy.port
        ),
        &format!("[minio]\naws_access_key_id = {S3_KEY}\naws_secret_access_key = {S3_SECRET}\n"),
    );
    let out = scratch();
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out.path())
        .args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--",
            "true",
        ]);
    without_aws_env(&mut cmd)
        .env("HOME", home.path())
        .env("AWS_PROFILE", "minio")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("MEMTRACK_FINISH_TIMEOUT", "30s");
    let res = run_to_end(&mut cmd, Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let local = std::fs::read(out.path().join("job/memory_usage.json")).unwrap();
    assert_eq!(
        server.object(KEY).as_deref(),
        Some(local.as_slice()),
        "uploaded through the profile's endpoint: {}",
        stderr(&res)
    );
    let sent = proxy.text();
    let put = format!("PUT /{}/{KEY}", server.bucket);
    assert!(sent.contains(&put), "path style ({put}):\n{sent}");
    assert!(
        sent.contains(&format!("host: localhost:{}", proxy.port))
            || sent.contains(&format!("Host: localhost:{}", proxy.port)),
        "no bucket in the host name:\n{sent}"
    );
    let scopes: Vec<&str> = sent
        .split("Credential=")
        .skip(1)
        .map(|s| s.split(',').next().unwrap())
        .collect();
    assert!(!scopes.is_empty(), "signed requests:\n{sent}");
    for scope in &scopes {
        let parts: Vec<&str> = scope.split('/').collect();
        assert_eq!(parts[0], S3_KEY, "{scope}");
        assert_eq!(
            parts[2], "eu-west-3",
            "signed for the profile's region: {scope}"
        );
        assert_eq!(parts[3], "s3", "{scope}");
    }
}

/// A small document to upload.
fn small_document(dir: &std::path::Path) -> std::path::PathBuf {
    let mut doc = memtrack::model::Document {
        schema: memtrack::model::SCHEMA_VERSION,
        ..Default::default()
    };
    doc.run.name = "small".into();
    let file = dir.join("memory_usage.json");
    memtrack::model::json::write_document(&file, &doc).unwrap();
    file
}

#[test]
fn missing_credentials_and_an_unknown_profile_are_named_as_such() {
    let server = S3Server::start();
    let dir = scratch();
    let file = small_document(dir.path());
    let home = aws_home("[default]\nregion = us-east-1\n", "");
    let upload = |env: &[(&str, &str)]| {
        let mut cmd = memtrack();
        cmd.arg("upload").arg(&file).args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &server.endpoint(),
        ]);
        without_aws_env(&mut cmd)
            .env("HOME", home.path())
            .env("AWS_EC2_METADATA_DISABLED", "true");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let res = run_to_end(&mut cmd, Duration::from_secs(60));
        assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
        let err = stderr(&res);
        assert!(
            err.contains("no usable AWS credentials")
                && err.contains(&server.endpoint())
                && !err.contains("cannot reach"),
            "credentials, not the network: {err}"
        );
        err
    };
    let err = upload(&[]);
    assert!(
        err.contains("AWS_ACCESS_KEY_ID") && err.contains("profile `default`"),
        "{err}"
    );
    let err = upload(&[("AWS_PROFILE", "nope")]);
    assert!(
        err.contains("AWS_PROFILE names profile `nope`")
            && err.contains(&home.path().join(".aws/config").display().to_string()),
        "{err}"
    );
    let err = upload(&[("AWS_ACCESS_KEY_ID", S3_KEY)]);
    assert!(
        err.contains("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"),
        "{err}"
    );
    assert!(server
        .object("runs/small/artifacts/memory_usage/memory_usage.json")
        .is_none());
}
