//! Keys, tokens and `clearml.conf`, read as the SDK reads them: a token
//! refreshed in time, wrong or missing credentials said clearly (never the
//! secret), a broken `clearml.conf` named with its line.

use std::path::Path;
use std::time::Duration;

use memtrack::config::ClearmlConfig;
use memtrack::export::clearml::{resolve, Credentials};
use serde_json::json;

use super::live::*;
use super::{clearml_env, Server, SECRET};
use crate::common::*;

#[test]
fn an_expired_token_costs_one_login_and_no_point() {
    let server = Server::start();
    let live = Live::start(settings(&server.url(), SECRET), "token");
    let task = live.wait_task();
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..50);
    wait_for("the first points", Duration::from_secs(10), || {
        server.points(&task).len() == 300
    });
    server.fault(json!({"expire_tokens": true}));
    steady_marks(&live, &mut exp, "model", 50..100);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    let state = server.state();
    assert_eq!(state["logins"], 2, "one login, one re-login");
    assert_eq!(state["login_kinds"]["basic"], 2);
    assert!(state["auth_failures"].as_u64().unwrap() >= 1);
    assert_eq!((report.sent, errors), (600, 0), "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn a_bearer_token_alone_is_used_and_refreshed_with_itself() {
    let server = Server::start();
    let token = server.admin("POST", "/token", Some(json!({"expiration_sec": 3})))["token"]
        .as_str()
        .unwrap()
        .to_string();
    let mut s = settings(&server.url(), SECRET);
    s.credentials = Credentials::Token(token);
    let live = Live::start(s, "token-only");
    let task = live.wait_task();
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..10);
    // Past the token's refresh point (a tenth of its life before expiry),
    // memtrack refreshes it with itself: the server counts a bearer login.
    wait_for("the token refreshed", Duration::from_secs(15), || {
        server.state()["login_kinds"]["bearer"].as_u64() >= Some(1)
    });
    steady_marks(&live, &mut exp, "model", 10..20);
    let (report, _, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    let state = server.state();
    assert_eq!(state["login_kinds"]["basic"], 0);
    assert!(state["login_kinds"]["bearer"].as_u64().unwrap() >= 1);
    assert!(report.errors.is_empty(), "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn wrong_credentials_are_one_clear_error_without_the_secret() {
    let server = Server::start();
    let live = Live::start(settings(&server.url(), "not-the-secret"), "badcreds");
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..10);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    let msg = &report.errors[0];
    assert!(msg.contains("refused the credentials"), "{msg}");
    assert!(
        msg.contains("CLEARML_API_ACCESS_KEY"),
        "names the source: {msg}"
    );
    assert!(msg.contains(&server.url()), "{msg}");
    assert!(!format!("{report:?}").contains("not-the-secret"));
    // Kept in the spool for `memtrack clearml-resend` with the right ones.
    assert_eq!((report.sent, report.unsent, report.discarded), (0, 60, 0));
    assert!(report.spool.as_deref().is_some_and(Path::exists));
    assert!(errors >= 1);
    assert_eq!(server.calls_to("auth.login"), 1, "not retried");
    assert_eq!(server.state()["tasks"], json!({}));
    server.assert_exactly_once();
}

#[test]
fn clearml_auth_token_wins_over_keys_as_in_the_sdk() {
    let server = Server::start();
    let token = server.admin("POST", "/token", Some(json!({})))["token"]
        .as_str()
        .unwrap()
        .to_string();
    let out = scratch();
    // Keys in clearml.conf and in the environment, both wrong: the token wins.
    std::fs::write(
        out.path().join("clearml.conf"),
        format!(
            "api {{\n  api_server: {}\n  credentials {{\"access_key\": \"CONFKEY\", \"secret_key\": \"CONFSECRET\"}}\n}}\n",
            server.url()
        ),
    )
    .unwrap();
    let res = MemtrackRun::new("job", out.path())
        .args(["--clearml-project", "memtrack-it"])
        .clearml(out.path(), None)
        .env("CLEARML_AUTH_TOKEN", &token)
        .env("CLEARML_API_ACCESS_KEY", "WRONGKEY")
        .env("CLEARML_API_SECRET_KEY", "WRONGSECRET")
        .run(["sh", "-c", "sleep 0.2"], Duration::from_secs(60));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let state = server.state();
    assert_eq!(state["auth_failures"], 0, "{log}");
    assert_eq!(state["login_kinds"]["basic"], 0, "{log}");
    assert_eq!(state["tasks"].as_object().unwrap().len(), 1, "{log}");
    server.assert_exactly_once();
}

#[test]
fn a_clearml_host_without_credentials_stops_memtrack_before_the_job() {
    let out = scratch();
    let marker = out.path().join("job-ran");
    let res = run_to_end(
        clearml_env(
            memtrack()
                .args(["run", "--listen", "off", "--output"])
                .arg(out.path())
                .args(["--", "touch"])
                .arg(&marker),
            out.path(),
            None,
        )
        .env("CLEARML_API_HOST", "http://127.0.0.1:9"),
        Duration::from_secs(30),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(2), "{log}");
    assert!(
        log.contains("CLEARML_API_HOST") && log.contains("credentials"),
        "{log}"
    );
    assert!(!marker.exists(), "the job must not start");
}

#[test]
fn a_malformed_clearml_conf_is_named_with_its_line() {
    let dir = scratch();
    let conf = dir.path().join("clearml.conf");
    std::fs::write(
        &conf,
        "api {\n    api_server: http://localhost:8008\n    credentials {\"access_key\": \"K\", \"secret_key\": \"S3CR3T}\n}\n",
    )
    .unwrap();
    let config = ClearmlConfig {
        enabled: memtrack::switch::Switch::On,
        config_file: conf.clone(),
        ..ClearmlConfig::default()
    };
    let err = resolve(&config, &|_| None, None).unwrap_err().to_string();
    assert!(err.contains(&conf.display().to_string()), "{err}");
    assert!(
        err.contains("line 3") && err.contains("unterminated quoted string"),
        "{err}"
    );
    assert!(!err.contains("S3CR3T"), "{err}");
}

#[test]
fn a_malformed_clearml_conf_costs_only_the_reporting_not_the_run() {
    let out = scratch();
    let conf = out.path().join("clearml.conf");
    std::fs::write(
        &conf,
        "api {\n  api_server: http://127.0.0.1:9\n  credentials {\"access_key\": \n",
    )
    .unwrap();
    let res = run_to_end(
        clearml_env(
            memtrack()
                .args(["run", "--listen", "off", "--name", "job", "--output"])
                .arg(out.path())
                .args(["--", "sh", "-c", "sleep 0.2; exit 4"]),
            out.path(),
            None,
        )
        .env("CLEARML_API_HOST", "http://127.0.0.1:9")
        .env("CLEARML_CONFIG_FILE", &conf),
        Duration::from_secs(60),
    );
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(4), "the job ran: {log}");
    assert!(log.contains("ClearML reporting is off"), "{log}");
    assert!(
        log.contains(&conf.display().to_string()),
        "names the file: {log}"
    );
    assert!(out.path().join("job/memory_usage.json").exists());
}
