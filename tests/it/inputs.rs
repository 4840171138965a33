//! Hostile input files: every file memtrack reads (its config, the AWS and
//! ClearML files, PID files, `memory_usage.json` and its side files, a
//! run's journal) goes through one bounded reader, and bad input is a clear
//! error that loses nothing. Each test runs the real binary and failed
//! before its fix.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo")
        .success();
    assert!(ok, "mkfifo {}", path.display());
}

/// A FIFO with no writer, `/dev/zero`, a folder: what a mistyped path or a
/// hostile one gives. Each must be refused at once, naming what it is.
fn not_files(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    let fifo = dir.join("fifo");
    mkfifo(&fifo);
    vec![
        (fifo, "a FIFO (named pipe), not a regular file"),
        (
            PathBuf::from("/dev/zero"),
            "a character device, not a regular file",
        ),
        (dir.to_path_buf(), "a folder, not a regular file"),
    ]
}

/// What once broke: `--config /dev/zero` read without end, a FIFO hung.
#[test]
fn a_config_that_is_no_regular_file_is_refused() {
    let dir = scratch();
    for (path, what) in not_files(dir.path()) {
        let res = run_to_end(
            memtrack().args(["config", "--config"]).arg(&path),
            Duration::from_secs(30),
        );
        let err = stderr(&res);
        assert_ne!(res.status.code(), Some(0), "{}: {err}", path.display());
        assert!(
            err.contains(&path.display().to_string()) && err.contains(what),
            "{}: {err}",
            path.display()
        );
    }
}

/// A small document to upload or read.
fn small_document(dir: &Path) -> PathBuf {
    let mut doc = memtrack::model::Document {
        schema: memtrack::model::SCHEMA_VERSION,
        ..Default::default()
    };
    doc.run.name = "small".into();
    doc.run.start = 1_795_000_000.0;
    let file = dir.join("memory_usage.json");
    memtrack::model::json::write_document(&file, &doc).unwrap();
    file
}

fn without_aws_env(cmd: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// `memtrack upload` of a small document to `server`, with `env`.
fn upload(file: &Path, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = memtrack();
    cmd.arg("upload").arg(file).args(args);
    without_aws_env(&mut cmd).env("HOME", file.parent().unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_to_end(&mut cmd, Duration::from_secs(60))
}

/// What once broke: `AWS_CONFIG_FILE=/dev/zero` grew memtrack to 2 GiB, a
/// FIFO there hung it before the job started.
#[test]
fn aws_files_that_are_no_regular_files_are_refused() {
    let server = S3Server::start();
    let dir = scratch();
    let file = small_document(dir.path());
    let url = format!("s3://{}/runs", server.bucket);
    let cases = not_files(dir.path());
    for var in ["AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"] {
        for (path, what) in &cases {
            let p = path.display().to_string();
            let res = upload(
                &file,
                &["--s3-url", &url, "--s3-endpoint", &server.endpoint()],
                &[
                    (var, &p),
                    ("AWS_ACCESS_KEY_ID", S3_KEY),
                    ("AWS_SECRET_ACCESS_KEY", S3_SECRET),
                ],
            );
            let err = stderr(&res);
            assert_eq!(res.status.code(), Some(1), "{var}={p}: {err}");
            assert!(err.contains(&p) && err.contains(*what), "{var}={p}: {err}");
        }
    }
    assert!(server
        .object("runs/small/artifacts/memory_usage/memory_usage.json")
        .is_none());
}

/// What once broke: a line without `=` in the credentials file was skipped,
/// so the chosen profile looked keyless ("no S3 credentials found") and the
/// real mistake went unnamed. The file and the line are named now.
#[test]
fn a_malformed_credentials_file_is_named_with_its_line() {
    let server = S3Server::start();
    let dir = scratch();
    let file = small_document(dir.path());
    let credentials = dir.path().join("creds");
    std::fs::write(
        &credentials,
        format!("[minio]\naws_access_key_id {S3_KEY}\naws_secret_access_key = {S3_SECRET}\n"),
    )
    .unwrap();
    let p = credentials.display().to_string();
    let res = upload(
        &file,
        &[
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &server.endpoint(),
        ],
        &[
            ("AWS_SHARED_CREDENTIALS_FILE", &p),
            ("AWS_PROFILE", "minio"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ],
    );
    let err = stderr(&res);
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("error parsing {p} on line 2"))
            && !err.contains("no S3 credentials found")
            && !err.contains(S3_KEY),
        "{err}"
    );
    assert!(server
        .object("runs/small/artifacts/memory_usage/memory_usage.json")
        .is_none());
}

/// What once broke: the SDK read the profile files again itself, without
/// memtrack's bound, after memtrack had read and resolved them (twice
/// each): a file changed in between could make it use another profile than
/// the one named. It is handed the text memtrack read now.
#[test]
fn the_aws_profile_files_are_read_once() {
    let server = S3Server::start();
    let dir = scratch();
    let file = small_document(dir.path());
    let aws = dir.path().join(".aws");
    std::fs::create_dir(&aws).unwrap();
    std::fs::write(aws.join("config"), "[profile minio]\nregion = eu-west-3\n").unwrap();
    std::fs::write(
        aws.join("credentials"),
        format!("[minio]\naws_access_key_id = {S3_KEY}\naws_secret_access_key = {S3_SECRET}\n"),
    )
    .unwrap();
    let trace = dir.path().join("open.trace");
    let mut cmd = Command::new("strace");
    cmd.args(["-f", "-qq", "-e", "trace=open,openat,execve", "-o"])
        .arg(&trace)
        .arg(env!("CARGO_BIN_EXE_memtrack"))
        .arg("upload")
        .arg(&file)
        .args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &server.endpoint(),
        ])
        .stdin(Stdio::null());
    without_aws_env(&mut cmd)
        .env("HOME", dir.path())
        .env("AWS_PROFILE", "minio")
        .env("AWS_EC2_METADATA_DISABLED", "true");
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert!(server
        .object("runs/small/artifacts/memory_usage/memory_usage.json")
        .is_some());
    let calls = std::fs::read_to_string(&trace).expect("strace wrote its trace");
    assert!(calls.contains("execve("), "strace traced nothing: {calls}");
    for name in ["config", "credentials"] {
        let path = format!("\"{}\"", aws.join(name).display());
        let opens = calls.lines().filter(|l| l.contains(&path)).count();
        assert_eq!(opens, 1, "{name} opened {opens} times:\n{calls}");
    }
}

/// What once broke: a password in `endpoint_url` was printed twice (the
/// error and the retry command), and an invalid URL was retried 5 times
/// as a network error.
#[test]
fn an_endpoint_password_is_never_printed_and_a_bad_url_is_not_retried() {
    let mut server = S3Server::start();
    server.down();
    let out = scratch();
    let endpoint = format!("http://admin:hunter2-pw@127.0.0.1:{}", server.port);
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out.path())
        .args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &endpoint,
            "--",
            "true",
        ]);
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(120));
    let err = stderr(&res);
    assert!(
        err.contains("cannot reach S3") && err.contains("memtrack upload"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    assert!(err.contains("***@127.0.0.1"), "{err}");

    // An endpoint that is no URL: one configuration error, before the job.
    for bad in [
        "http://127.0.0.1 bad:9000",
        "minio:9000",
        "http://127.0.0.1:99999",
    ] {
        let mut cmd = memtrack();
        cmd.args(["run", "--listen", "off", "--name", "bad", "--output"])
            .arg(out.path())
            .args([
                "--s3-url",
                &format!("s3://{}/runs", server.bucket),
                "--s3-endpoint",
                bad,
                "--",
                "touch",
            ])
            .arg(out.path().join("job-ran"));
        for (k, v) in server.env(S3_SECRET) {
            cmd.env(k, v);
        }
        let res = run_to_end(&mut cmd, Duration::from_secs(60));
        let err = stderr(&res);
        assert_eq!(res.status.code(), Some(1), "{bad}: {err}");
        assert!(
            err.contains("S3 is misconfigured") && !err.contains("attempts"),
            "{bad}: {err}"
        );
        assert!(!out.path().join("job-ran").exists(), "{bad}: {err}");
    }
}

/// What once broke: with a custom endpoint and no credentials the SDK asked
/// the instance-metadata service and its text was shown. The SDK's
/// metadata endpoint is pointed at a closed loopback port, so even a
/// regression sends nothing off the machine, and the trace shows whether
/// memtrack tried it.
#[test]
fn no_credentials_with_an_endpoint_never_asks_instance_metadata() {
    let server = S3Server::start();
    let dir = scratch();
    let file = small_document(dir.path());
    let trace = dir.path().join("connect.trace");
    let mut cmd = Command::new("strace");
    cmd.args(["-f", "-qq", "-e", "trace=connect,execve", "-o"])
        .arg(&trace)
        .arg(env!("CARGO_BIN_EXE_memtrack"))
        .arg("upload")
        .arg(&file)
        .args([
            "--s3-url",
            &format!("s3://{}/runs", server.bucket),
            "--s3-endpoint",
            &server.endpoint(),
        ])
        .stdin(Stdio::null());
    // No AWS_EC2_METADATA_DISABLED: memtrack must know better by itself.
    without_aws_env(&mut cmd)
        .env("HOME", dir.path())
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9");
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRACK_") {
            cmd.env_remove(k);
        }
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    let err = stderr(&res);
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no S3 credentials found (looked in: the environment")
            && err.contains("profile `default`"),
        "{err}"
    );
    let calls = std::fs::read_to_string(&trace).expect("strace wrote its trace");
    // The trace works (memtrack's own execve is in it); a metadata probe
    // would be a connect to the closed port 9.
    assert!(calls.contains("execve("), "strace traced nothing: {calls}");
    assert!(!calls.contains("sin_port=htons(9)"), "{calls}");
    assert!(!err.to_ascii_lowercase().contains("imds"), "{err}");
}

/// What once broke: with keys in the environment, a typo in `AWS_PROFILE`
/// silently sent the upload to AWS instead of the profile's endpoint.
#[test]
fn an_unknown_profile_is_an_error_even_with_keys_in_the_environment() {
    let server = S3Server::start();
    let dir = scratch();
    let file = small_document(dir.path());
    std::fs::create_dir(dir.path().join(".aws")).unwrap();
    std::fs::write(
        dir.path().join(".aws/config"),
        format!("[profile minio]\nendpoint_url = {}\n", server.endpoint()),
    )
    .unwrap();
    let res = upload(
        &file,
        &["--s3-url", &format!("s3://{}/runs", server.bucket)],
        &[
            ("AWS_PROFILE", "mnio"),
            ("AWS_ACCESS_KEY_ID", S3_KEY),
            ("AWS_SECRET_ACCESS_KEY", S3_SECRET),
        ],
    );
    let err = stderr(&res);
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(
        err.contains("AWS_PROFILE names profile `mnio`")
            && err.contains(&dir.path().join(".aws/config").display().to_string()),
        "{err}"
    );
    assert!(!err.contains("amazonaws.com/"), "never sent to AWS: {err}");
}

/// What once broke: `memtrack upload outputs/RUN` without `--s3-url` failed
/// with "no destination" though the run knew where it was going.
#[test]
fn upload_without_a_url_uses_the_destination_the_run_recorded() {
    let server = S3Server::start();
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
        ]);
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let key = "runs/job/artifacts/memory_usage/memory_usage.json";
    let object = server.root.path().join(&server.bucket).join(key);
    std::fs::remove_file(&object).unwrap();
    let mut cmd = memtrack();
    cmd.arg("upload").arg(out.path().join("job"));
    for (k, v) in server.env(S3_SECRET) {
        cmd.env(k, v);
    }
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let local = std::fs::read(out.path().join("job/memory_usage.json")).unwrap();
    assert_eq!(server.object(key).as_deref(), Some(local.as_slice()));
    // A run without S3 records nothing: the message says so.
    let dir = scratch();
    let file = small_document(dir.path());
    let res = run_to_end(memtrack().arg("upload").arg(&file), Duration::from_secs(30));
    let err = stderr(&res);
    assert_eq!(res.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no destination") && err.contains("s3-destination.json"),
        "{err}"
    );
}

/// A clearml.conf that makes `run` say why ClearML is off; the job runs.
fn run_with_clearml_conf(conf: &Path, out: &Path) -> (i32, String) {
    let res = run_to_end(
        memtrack()
            .args(["run", "--listen", "off", "--name", "job", "--output"])
            .arg(out)
            .args([
                "--clearml-project",
                "memtrack-test",
                "--",
                "sh",
                "-c",
                "exit 4",
            ])
            .env("HOME", out)
            .env("CLEARML_CONFIG_FILE", conf)
            .env_remove("CLEARML_API_HOST")
            .env_remove("CLEARML_API_ACCESS_KEY")
            .env_remove("CLEARML_API_SECRET_KEY")
            .env_remove("CLEARML_AUTH_TOKEN"),
        Duration::from_secs(60),
    );
    (res.status.code().unwrap_or(-1), stderr(&res))
}

/// What once broke: a 981-byte clearml.conf (8 substitutions per level, 16
/// levels) allocated 2.85 GB and aborted; `/dev/zero` printed a 1 MiB
/// error line of NUL bytes; a secret alone on a line was echoed.
#[test]
fn hostile_clearml_conf_files_are_bounded_and_never_echoed() {
    let out = scratch();
    let bomb = out.path().join("bomb.conf");
    let mut text = String::from("l0: aaaaaaaa\n");
    for i in 1..16 {
        text.push_str(&format!("l{i}: {}\n", format!("${{l{}}}", i - 1).repeat(8)));
    }
    text.push_str("api {\n  api_server: ${l15}\n}\n");
    assert!(text.len() < 1024, "{}", text.len());
    std::fs::write(&bomb, &text).unwrap();
    let (code, log) = run_with_clearml_conf(&bomb, out.path());
    assert_eq!(code, 4, "the job ran: {log}");
    assert!(log.contains("expand too far"), "{log}");

    let secret = out.path().join("secret.conf");
    std::fs::write(
        &secret,
        "api {\n  api_server: http://127.0.0.1:9\n  secret_key: x\n  Zk9TOPSECRETqW2x\n}\n",
    )
    .unwrap();
    let (code, log) = run_with_clearml_conf(&secret, out.path());
    assert_eq!(code, 4, "{log}");
    assert!(
        log.contains("line 4") && !log.contains("TOPSECRET"),
        "{log}"
    );

    let sub = out.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    for (path, what) in not_files(&sub) {
        let (code, log) = run_with_clearml_conf(&path, out.path());
        assert_eq!(code, 4, "{}: {log}", path.display());
        assert!(log.contains(what), "{}: {log}", path.display());
        assert!(log.len() < 20_000 && !log.contains('\0'), "{}", log.len());
    }
}

/// A document whose event entries were thinned, with `side` as its
/// complete event log beside it.
fn thinned_with_side(dir: &Path, side: &[u8]) -> PathBuf {
    let mut doc = memtrack::model::Document {
        schema: memtrack::model::SCHEMA_VERSION,
        ..Default::default()
    };
    doc.run.name = "thinned".into();
    doc.run.start = 1_795_000_000.0;
    doc.detailed_log = vec![memtrack::model::Entry {
        component: "c".into(),
        operation: "op".into(),
        timestamp: 1_795_000_001.0,
        samples: Some(2),
        ..Default::default()
    }];
    let file = dir.join("memory_usage.json");
    memtrack::model::json::write_document(&file, &doc).unwrap();
    std::fs::write(dir.join("memory_usage.events.jsonl.gz"), side).unwrap();
    file
}

/// What once broke: a small gzip holding one endless line grew plot, merge
/// and report until they aborted.
#[test]
fn a_gzip_bomb_beside_a_document_is_an_error_not_an_abort() {
    let dir = scratch();
    // 256 MiB of one line, a few hundred KB compressed.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let block = vec![b'a'; 1 << 20];
    for _ in 0..256 {
        gz.write_all(&block).unwrap();
    }
    let side = gz.finish().unwrap();
    let file = thinned_with_side(dir.path(), &side);
    for args in [
        vec![
            "plot".to_string(),
            file.display().to_string(),
            "-o".into(),
            dir.path().join("p.svg").display().to_string(),
        ],
        vec![
            "merge".to_string(),
            file.display().to_string(),
            "-o".into(),
            dir.path().join("m.json").display().to_string(),
        ],
    ] {
        let res = run_to_end(memtrack().args(&args), Duration::from_secs(120));
        let err = stderr(&res);
        assert_eq!(res.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("line 1 of") && err.contains("longer than 1048576 bytes"),
            "{args:?}: {err}"
        );
    }
}

/// What once broke: `--pid 4294967295` reached `kill(-1, 0)`.
#[test]
fn pids_that_name_process_groups_are_refused_at_parse_time() {
    let out = scratch();
    for pid in ["4294967295", "2147483648", "0"] {
        let res = run_to_end(
            memtrack()
                .args(["attach", "--listen", "off", "--pid", pid, "--output"])
                .arg(out.path()),
            Duration::from_secs(20),
        );
        let err = stderr(&res);
        assert_eq!(res.status.code(), Some(2), "{pid}: {err}");
        assert!(err.contains("from 1 to 2147483647"), "{pid}: {err}");
    }
    let file = out.path().join("pids");
    std::fs::write(&file, "4294967295\n").unwrap();
    let res = run_to_end(
        memtrack()
            .args(["attach", "--listen", "off", "--pid-file"])
            .arg(&file)
            .arg("--output")
            .arg(out.path()),
        Duration::from_secs(20),
    );
    assert_eq!(res.status.code(), Some(1), "{}", stderr(&res));
    assert!(stderr(&res).contains("word 1 is not a PID"));
}

/// What once broke: a run's end years before its start printed as
/// `-251606681963.9 s`.
#[test]
fn absurd_durations_print_as_unknown() {
    let dir = scratch();
    let mut doc = memtrack::model::Document {
        schema: memtrack::model::SCHEMA_VERSION,
        ..Default::default()
    };
    doc.run.name = "clock".into();
    doc.run.start = 1_795_000_000.0;
    doc.run.end = Some(1_795_000_000.0 - 251_606_681_963.9);
    let file = dir.path().join("memory_usage.json");
    memtrack::model::json::write_document(&file, &doc).unwrap();
    let res = run_to_end(memtrack().arg("report").arg(&file), Duration::from_secs(30));
    let text = String::from_utf8_lossy(&res.stdout);
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert!(!text.contains("-251"), "{text}");
    assert!(text.contains("unknown"), "{text}");
}

/// A job that sends `n` acknowledged marks, then writes `<dir>/done` and
/// waits to be killed.
const MARKS_JOB: &str = r#"
import json, os, socket, sys, time
d, n = sys.argv[1], int(sys.argv[2])
open(d + "/job.pid", "w").write(str(os.getpid()))
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["MEMTRACK_SOCKET"])
f = s.makefile("rwb")
for i in range(1, n + 1):
    f.write((json.dumps({"type": "mark", "component": "c", "operation": "op",
                         "iteration": i, "ack": True}) + "\n").encode())
    f.flush()
    f.readline()
open(d + "/done", "w").close()
time.sleep(120)
"#;

/// Entries a checkpoint's `state.json` counts in the entries file.
fn checkpointed_entries(state: &Path) -> u64 {
    let text = std::fs::read_to_string(state).unwrap_or_default();
    let Some(at) = text.find("\"file\":\"entries.jsonl\",\"entries\":") else {
        return 0;
    };
    let rest = &text[at + "\"file\":\"entries.jsonl\",\"entries\":".len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// What once broke: a truncated or corrupt `entries.jsonl` made `recover`
/// refuse the whole run (exit 1); the file was also created 0644.
#[test]
fn recover_keeps_what_a_damaged_entries_file_still_holds() {
    let out = scratch();
    let d = out.path();
    let socket = d.join("m.sock");
    let marks = 200u64;
    let child = memtrack()
        .args([
            "run",
            "--listen",
            "off",
            "--checkpoint-interval",
            "1s",
            "--name",
            "r",
            "--output",
        ])
        .arg(d)
        .arg("--socket")
        .arg(&socket)
        .args(["--", python3(), "-c", MARKS_JOB])
        .arg(d)
        .arg(marks.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("memtrack");
    let mut child = scopeguard(child);
    let dot = d.join("r/.memtrack");
    let entries = dot.join("entries.jsonl");
    wait_for("the job's marks", Duration::from_secs(60), || {
        d.join("done").exists()
    });
    // A checkpoint that counts every mark.
    wait_for("a checkpoint of the marks", Duration::from_secs(60), || {
        checkpointed_entries(&dot.join("state.json")) >= marks
    });
    let mode = std::fs::metadata(&entries).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "entries.jsonl is private");
    signal(child.0.id(), "KILL");
    child.0.wait().unwrap();
    let job: u32 = std::fs::read_to_string(d.join("job.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    signal(job, "KILL");

    // Line 5 overwritten, the file cut in the middle of a line.
    let mut bytes = std::fs::read(&entries).unwrap();
    let starts: Vec<usize> = std::iter::once(0)
        .chain(
            bytes
                .iter()
                .enumerate()
                .filter(|(_, &b)| b == b'\n')
                .map(|(i, _)| i + 1),
        )
        .collect();
    bytes[starts[4]] = b'#';
    bytes.truncate(starts[150] + 7);
    std::fs::write(&entries, &bytes).unwrap();

    let res = run_to_end(
        memtrack().arg("recover").arg(d.join("r")),
        Duration::from_secs(60),
    );
    let err = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{err}");
    assert!(
        err.contains("the entries file was damaged") && err.contains("damaged lines 5, 151"),
        "{err}"
    );
    let doc = read_document(&d.join("r/memory_usage.json"));
    assert_eq!(doc.run.status, "recovered");
    let lost = doc.counters.entries_lost;
    assert!(lost >= 2, "{:?}", doc.counters);
    let got = doc
        .detailed_log
        .iter()
        .filter(|e| e.component == "c")
        .count() as u64;
    assert!(got >= 140, "the readable marks are kept: {got}");
    assert!(err.contains(&format!("{lost} log entries lost")), "{err}");
}

/// The child killed if the test fails first.
struct Guard(std::process::Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn scopeguard(child: std::process::Child) -> Guard {
    Guard(child)
}
