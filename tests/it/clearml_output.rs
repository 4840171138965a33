//! Where the job's ClearML task keeps its artifacts: `Task.init(output_uri=
//! "s3://…")` with the credentials of `clearml.conf`'s `sdk.aws.s3`, as a
//! ClearML user with MinIO has them. The real SDK runs the job; the strict
//! contract server stands in for ClearML, s3s-fs (which checks every
//! signature) for MinIO, the fileserver stand-in for the fileserver.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::clearml::{
    bare_sdk_env, require_clearml_sdk, run_python_job, write_clearml_conf, FileServer, Server,
};
use crate::common::*;

/// `sdk.aws.s3` as the ClearML docs configure MinIO: one `credentials`
/// entry for the store's `host`, plain http.
fn sdk_s3(s3: &S3Server, secret: &str) -> String {
    format!(
        "sdk {{\n  aws {{\n    s3 {{\n      key: \"\"\n      secret: \"\"\n      region: \"\"\n      \
         credentials: [\n        {{\n          host: \"127.0.0.1:{}\"\n          key: \"{S3_KEY}\"\n          \
         secret: \"{secret}\"\n          multipart: false\n          secure: false\n        }}\n      ]\n    \
         }}\n  }}\n}}\n",
        s3.port
    )
}

/// Appends `text` to the `clearml.conf` in `home`.
fn append_conf(home: &Path, text: &str) {
    let file = home.join("clearml.conf");
    let mut conf = std::fs::read_to_string(&file).unwrap();
    conf.push_str(text);
    std::fs::write(&file, conf).unwrap();
}

/// A job whose `Task.init` names `output_uri` (the SDK checks it can write
/// there with the credentials of its own clearml.conf), with five marked
/// steps.
fn job(output_uri: &str) -> String {
    format!(
        r#"import memtrack
from clearml import Task
task = Task.init(project_name="memtrack-it", task_name="out uri", output_uri={output_uri:?},
                 auto_resource_monitoring=False, auto_connect_arg_parser=False,
                 auto_connect_frameworks={{"detect_repository": False}})
keep = []
for i in range(5):
    with memtrack.span("model", "step", iteration=i):
        keep.append(bytearray(4 << 20))
print("TASK", task.id, flush=True)
task.close()
"#
    )
}

fn task_id(stdout: &str, all: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("TASK "))
        .unwrap_or_else(|| panic!("no task: {all}"))
        .to_string()
}

/// The environment of the job and memtrack: only `~/clearml.conf`, no AWS
/// credentials at all.
fn env(home: &Path, extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut env = bare_sdk_env(home);
    env.extend(extra.iter().cloned());
    env
}

/// What a job with an `s3://` `output_uri` starts from: the contract
/// server, the fileserver and the store, and a home whose `clearml.conf`
/// is what `clearml-init` writes for the first two plus `sdk.aws.s3` with
/// the store's right keys ([`sdk_s3`]); `api`, that file before
/// `sdk.aws.s3` (for a file of memtrack's own).
struct Stores {
    server: Server,
    files: FileServer,
    s3: S3Server,
    out: tempfile::TempDir,
    api: String,
}

impl Stores {
    fn start() -> Stores {
        require_clearml_sdk();
        let server = Server::start();
        let files = FileServer::start();
        let s3 = S3Server::start();
        let out = scratch();
        write_clearml_conf(out.path(), &server, &files.url());
        let api = std::fs::read_to_string(out.path().join("clearml.conf")).unwrap();
        append_conf(out.path(), &sdk_s3(&s3, S3_SECRET));
        Stores {
            server,
            files,
            s3,
            out,
            api,
        }
    }
}

#[test]
fn an_s3_output_uri_gets_the_artifact_in_its_bucket_with_clearml_confs_credentials() {
    let Stores {
        server,
        files,
        s3,
        out,
        api: _,
    } = Stores::start();
    let host = format!("127.0.0.1:{}", s3.port);
    let uri = format!("s3://{host}/{}/runs", s3.bucket);
    let (code, stdout, log) =
        run_python_job("outuri", out.path(), &env(out.path(), &[]), &job(&uri));
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "{all}");
    let id = task_id(&stdout, &all);
    let state = server.state();
    let task = &state["tasks"][&id];
    assert_eq!(task["output"]["destination"], uri.as_str(), "{task:#}");
    // The object is in the task's bucket, in the SDK's layout under the
    // task's prefix, and is the final document.
    let key = format!("runs/memtrack-it/out uri.{id}/artifacts/memory_usage/memory_usage.json");
    let local = std::fs::read(out.path().join("outuri/memory_usage.json")).unwrap();
    assert!(
        s3.object(&key).as_deref() == Some(local.as_slice()),
        "the object is the final document: {all}"
    );
    // The task's artifact points at it, as the SDK writes a MinIO URI, and
    // was registered while the task was open.
    let artifacts = task["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 1, "{task:#}\n{all}");
    assert_eq!(artifacts[0]["key"], "memory_usage");
    assert_eq!(
        artifacts[0]["uri"],
        format!("s3://{host}/{}/{key}", s3.bucket)
    );
    for a in state["artifact_log"].as_array().unwrap() {
        assert_eq!(a["task_status"], "in_progress", "{a}");
    }
    // Nothing went to the fileserver, and no secret to the log.
    assert_eq!(files.state()["uploads"], json!([]), "{:#}", files.state());
    assert!(!all.contains(S3_SECRET), "{all}");
    server.assert_exactly_once();
}

#[test]
fn wrong_sdk_aws_s3_credentials_are_one_clear_error_and_the_printed_command_uploads_later() {
    // The job's SDK has the right secret (it checks the destination at
    // `Task.init`); memtrack is given a file with a wrong one.
    let Stores {
        server,
        files: _files,
        s3,
        out,
        api: good,
    } = Stores::start();
    let wrong_secret = "wrong-secret-never-logged";
    let wrong = out.path().join("memtrack-clearml.conf");
    std::fs::write(&wrong, format!("{good}{}", sdk_s3(&s3, wrong_secret))).unwrap();
    let uri = format!("s3://127.0.0.1:{}/{}/runs", s3.port, s3.bucket);
    let (code, stdout, log) = run_python_job(
        "badkeys",
        out.path(),
        &env(
            out.path(),
            &[("MEMTRACK_CLEARML_CONFIG_FILE", wrong.display().to_string())],
        ),
        &job(&uri),
    );
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "the job's status, not the upload's: {all}");
    let id = task_id(&stdout, &all);
    // One clear error: the store refused the keys, which came from the
    // file's sdk.aws.s3; the secret never shows.
    let line = log
        .lines()
        .find(|l| l.contains("the artifact upload failed"))
        .unwrap_or_else(|| panic!("no error line: {all}"));
    assert!(line.contains("refused the credentials"), "{line}");
    assert!(
        line.contains("credentials entry 1 of sdk.aws.s3")
            && line.contains("memtrack-clearml.conf"),
        "{line}"
    );
    assert!(
        !all.contains(wrong_secret) && !all.contains(S3_SECRET),
        "{all}"
    );
    // Nothing is lost: the document is intact, no artifact points at a
    // missing object, and the printed command uploads it.
    let document = out.path().join("badkeys/memory_usage.json");
    assert!(document.exists());
    assert_eq!(server.state()["tasks"][&id]["artifacts"], json!([]));
    let command = line
        .split("to upload it later, run: ")
        .nth(1)
        .and_then(|c| c.split(" (with AWS_ACCESS_KEY_ID").next())
        .unwrap_or_else(|| panic!("no command: {line}"));
    let bin = Path::new(env!("CARGO_BIN_EXE_memtrack"));
    let res = run_to_end(
        std::process::Command::new("sh")
            .args(["-c", command])
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    bin.parent().unwrap().display(),
                    std::env::var("PATH").unwrap()
                ),
            )
            .env("HOME", out.path())
            .env("AWS_ACCESS_KEY_ID", S3_KEY)
            .env("AWS_SECRET_ACCESS_KEY", S3_SECRET)
            .env("AWS_EC2_METADATA_DISABLED", "true"),
        Duration::from_secs(60),
    );
    assert_eq!(res.status.code(), Some(0), "{command}: {}", stderr(&res));
    // Under the task's key, as the artifact would have been.
    let key = format!("runs/memtrack-it/out uri.{id}/artifacts/memory_usage/memory_usage.json");
    assert_eq!(
        String::from_utf8_lossy(&res.stdout).trim(),
        format!("s3://{}/{key}", s3.bucket),
        "{command}"
    );
    assert!(
        s3.object(&key) == Some(std::fs::read(&document).unwrap()),
        "the object is the document"
    );
    server.assert_exactly_once();
}

#[test]
fn hostile_sdk_aws_s3_values_cost_only_the_artifact_and_show_no_secret() {
    let Stores {
        server,
        files: _files,
        s3,
        out,
        api,
    } = Stores::start();
    // A password in a host: refused, never echoed; reporting into the task
    // goes on.
    let hostile = out.path().join("hostile.conf");
    std::fs::write(
        &hostile,
        format!(
            "{api}sdk.aws.s3 {{\n  credentials: [\n    {{ host: \"me:HOSTPASSWORD@127.0.0.1:{}/x\", \
             key: \"K\", secret: \"LISTSECRET\" }}\n  ]\n  key: \"TOPKEY\"\n  secret: \
             \"TOPSECRET\"\n}}\n",
            s3.port
        ),
    )
    .unwrap();
    let uri = format!("s3://127.0.0.1:{}/{}/runs", s3.port, s3.bucket);
    let (code, stdout, log) = run_python_job(
        "hostile",
        out.path(),
        &env(
            out.path(),
            &[(
                "MEMTRACK_CLEARML_CONFIG_FILE",
                hostile.display().to_string(),
            )],
        ),
        &job(&uri),
    );
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "{all}");
    let id = task_id(&stdout, &all);
    for secret in ["HOSTPASSWORD", "LISTSECRET", "TOPSECRET", S3_SECRET] {
        assert!(!all.contains(secret), "{secret} shown: {all}");
    }
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("artifact settings of"))
        .collect();
    assert_eq!(warnings.len(), 1, "said once: {all}");
    let warning = warnings[0];
    assert!(
        warning.contains("credentials entry 1") && warning.contains("not host[:port]"),
        "{warning}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("the artifact upload failed") && l.contains("output_uri")),
        "{all}"
    );
    // The charts arrived all the same; the document is intact.
    let memory: Vec<Value> = server
        .points(&id)
        .into_iter()
        .filter(|p| p["metric"].as_str().unwrap().starts_with("memory/"))
        .collect();
    assert!(!memory.is_empty(), "{all}");
    assert!(out.path().join("hostile/memory_usage.json").exists());
    assert_eq!(server.state()["tasks"][&id]["artifacts"], json!([]));
    server.assert_exactly_once();
}

/// A task memtrack creates (no `Task.init`, no S3) gets the document where
/// ClearML keeps a task's artifacts too: the fileserver, registered before
/// memtrack completes the task.
#[test]
fn a_task_memtrack_creates_gets_the_artifact_on_the_fileserver() {
    let server = Server::start();
    let files = FileServer::start();
    let out = scratch();
    let res = MemtrackRun::new("own-task", out.path())
        .clearml(out.path(), Some((&server.url(), crate::clearml::SECRET)))
        .env("CLEARML_FILES_HOST", files.url())
        .env("MEMTRACK_CLEARML_JOB_TASK_WAIT", "0s")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .run(["sleep", "0.3"], Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let state = server.state();
    let tasks = state["tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), 1, "{state:#}");
    let (id, task) = tasks.iter().next().unwrap();
    assert_eq!(state["task_creators"][id], "memtrack");
    assert_eq!(task["status"], "completed", "{task:#}\n{log}");
    let path = format!("memtrack/own-task.{id}/artifacts/memory_usage/memory_usage.json");
    let artifacts = task["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 1, "{task:#}\n{log}");
    assert_eq!(artifacts[0]["uri"], format!("{}/{path}", files.url()));
    let local = std::fs::read_to_string(out.path().join("own-task/memory_usage.json")).unwrap();
    let (code, object) = files.get(&format!("/{path}"));
    assert_eq!(code, 200, "{:#}", files.state());
    assert!(object == local, "the object is the final document");
    assert_eq!(files.state()["violations"], json!([]));
    server.assert_exactly_once();
}

/// `Task.init(output_uri="s3://…")` is enough: no fileserver and no
/// `default_output_uri` configured, the artifact still lands in the bucket.
#[test]
fn an_s3_output_uri_needs_no_fileserver() {
    require_clearml_sdk();
    let server = Server::start();
    let s3 = S3Server::start();
    let out = scratch();
    std::fs::write(
        out.path().join("clearml.conf"),
        format!(
            "api {{\n  web_server: http://127.0.0.1:9\n  api_server: {}\n  credentials {{\n    \
             \"access_key\" = \"{}\"\n    \"secret_key\" = \"{}\"\n  }}\n}}\n{}",
            server.url(),
            crate::clearml::KEY,
            crate::clearml::SECRET,
            sdk_s3(&s3, S3_SECRET)
        ),
    )
    .unwrap();
    let host = format!("127.0.0.1:{}", s3.port);
    let uri = format!("s3://{host}/{}/runs", s3.bucket);
    let (code, stdout, log) =
        run_python_job("nofiles", out.path(), &env(out.path(), &[]), &job(&uri));
    let all = format!("{stdout}\n{log}");
    assert_eq!(code, 0, "{all}");
    let id = task_id(&stdout, &all);
    let key = format!("runs/memtrack-it/out uri.{id}/artifacts/memory_usage/memory_usage.json");
    let local = std::fs::read(out.path().join("nofiles/memory_usage.json")).unwrap();
    assert!(
        s3.object(&key).as_deref() == Some(local.as_slice()),
        "the object is the final document: {all}"
    );
    let task = &server.state()["tasks"][&id];
    assert_eq!(
        task["artifacts"][0]["uri"],
        format!("s3://{host}/{}/{key}", s3.bucket),
        "{task:#}"
    );
    server.assert_exactly_once();
}
