//! The same uploads against a second S3 implementation, moto's server
//! (`moto[server]`, the one AWS's own SDK tests lean on), so that what
//! memtrack sends is not tuned to one server's leniencies: the single PUT,
//! the multipart upload of a large file, and a missing bucket named as such.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

/// A moto S3 server on a free loopback port, stopped on drop.
struct Moto {
    child: Child,
    port: u16,
}

const BUCKET: &str = "memtrack-moto";

impl Moto {
    fn start() -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(python3())
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start moto's server ({e}); scripts/test installs moto[server]")
            });
        let moto = Moto { child, port };
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        wait_for("moto to listen", Duration::from_secs(30), || {
            std::net::TcpStream::connect(addr).is_ok()
        });
        let (status, body) = http_request(addr, "PUT", &format!("/{BUCKET}"));
        assert_eq!(status, 200, "create bucket: {body}");
        moto
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// An object's bytes, read back with boto3 (moto's own dependency),
    /// a signed GET like any client's.
    fn object(&self, key: &str) -> Vec<u8> {
        let out = Command::new(python3())
            .args([
                "-c",
                "import sys, boto3; \
                 s3 = boto3.client('s3', endpoint_url=sys.argv[1], region_name='us-east-1', \
                 aws_access_key_id='moto-key', aws_secret_access_key='moto-secret'); \
                 sys.stdout.buffer.write(s3.get_object(Bucket=sys.argv[2], Key=sys.argv[3])['Body'].read())",
                &self.endpoint(),
                BUCKET,
                key,
            ])
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("NO_PROXY", "127.0.0.1")
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "GET {key}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    fn env(cmd: &mut Command) -> &mut Command {
        cmd.env("AWS_ACCESS_KEY_ID", "moto-key")
            .env("AWS_SECRET_ACCESS_KEY", "moto-secret")
            .env("AWS_EC2_METADATA_DISABLED", "true")
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn moto_receives_the_run_file_as_written() {
    let moto = Moto::start();
    let out = scratch();
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out.path())
        .args([
            "--s3-url",
            &format!("s3://{BUCKET}/runs"),
            "--s3-endpoint",
            &moto.endpoint(),
            "--",
            "true",
        ]);
    Moto::env(&mut cmd);
    let res = run_to_end(&mut cmd, Duration::from_secs(120));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    let local = std::fs::read(out.path().join("job/memory_usage.json")).unwrap();
    let stored = moto.object("runs/job/artifacts/memory_usage/memory_usage.json");
    assert!(stored == local, "stored object differs from the local file");
}

#[test]
fn moto_receives_a_50_mb_document_in_parts() {
    let moto = Moto::start();
    let dir = scratch();
    let (file, local) = fifty_mb_document(dir.path());

    let mut cmd = memtrack();
    cmd.arg("upload").arg(&file).args([
        "--s3-url",
        &format!("s3://{BUCKET}/archive"),
        "--s3-endpoint",
        &moto.endpoint(),
    ]);
    cmd.env("MEMTRACK_LOG_LEVEL", "info");
    Moto::env(&mut cmd);
    let res = run_to_end(&mut cmd, Duration::from_secs(180));
    assert_eq!(res.status.code(), Some(0), "{}", stderr(&res));
    assert!(stderr(&res).contains("7 parts"), "{}", stderr(&res));
    let stored = moto.object("archive/big/artifacts/memory_usage/memory_usage.json");
    assert!(
        stored == local,
        "multipart object differs from the local file"
    );
}

#[test]
fn moto_missing_bucket_is_named() {
    let moto = Moto::start();
    let out = scratch();
    let mut cmd = memtrack();
    cmd.args(["run", "--listen", "off", "--name", "job", "--output"])
        .arg(out.path())
        .args([
            "--s3-url",
            "s3://no-such-bucket/runs",
            "--s3-endpoint",
            &moto.endpoint(),
            "--",
            "true",
        ]);
    Moto::env(&mut cmd);
    let res = run_to_end(&mut cmd, Duration::from_secs(60));
    assert_eq!(res.status.code(), Some(0));
    assert!(
        stderr(&res).contains("bucket `no-such-bucket` does not exist"),
        "{}",
        stderr(&res)
    );
    assert!(out.path().join("job/memory_usage.json").is_file());
}
