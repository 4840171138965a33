//! A server that refuses, fails, stalls or is gone: no point is lost or
//! sent twice, what cannot be sent waits in the spool, and sampling never
//! waits on ClearML.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use memtrack::export::clearml::{Reporter, SPOOL_FILE};
use serde_json::{json, Value};

use super::live::*;
use super::{agent_run, Server, SECRET};
use crate::common::*;

#[test]
fn a_twenty_second_outage_loses_and_repeats_nothing() {
    let server = Server::start();
    let live = Live::start(settings(&server.url(), SECRET), "outage");
    let task = live.wait_task();
    let mut exp = Expected::new();
    let start = Instant::now();
    let mut i = 0u64;
    let mut outage = false;
    // 25 marks a second for 24 s; the server refuses connections for 10 s
    // from t = 2 s, then answers 503 for 10 more.
    while start.elapsed() < Duration::from_secs(24) {
        if !outage && start.elapsed() >= Duration::from_secs(2) {
            outage = true;
            server.fault(json!({"status": 503, "for_s": 20}));
            server.fault(json!({"refuse_for_s": 10}));
        }
        let e = entry("train", "step", unix_now(), Some(i), i as f64);
        expect(&mut exp, &e, i, None);
        live.push(e);
        i += 1;
        std::thread::sleep(Duration::from_millis(40));
    }
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(30));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!(
        (report.sent, report.unsent),
        (exp.len() as u64, 0),
        "{report:?}"
    );
    assert!(errors > 0, "failed attempts are counted");
    // That the daemon's sampling never waits on this is shown with the
    // binary: sampling_stays_on_schedule_while_clearml_stalls_then_refuses.
    let calls = server.admin("GET", "/calls", None);
    let faults = calls["calls"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == 503)
        .count();
    assert!(faults > 0, "the 503 phase was seen");
    assert_eq!(server.state()["tasks"][&task]["status"], "completed");
    server.assert_exactly_once();
}

#[test]
fn a_small_queue_spills_to_the_spool_and_drains_in_order() {
    let server = Server::start();
    let mut s = settings(&server.url(), SECRET);
    s.queue_max = 30;
    s.batch_max = 10;
    let live = Live::start(s, "spill");
    let task = live.wait_task();
    server.fault(json!({"refuse_for_s": 3}));
    let mut exp = Expected::new();
    let mut order = Vec::new();
    for i in 0..100u64 {
        let e = entry("model", "step", unix_now(), Some(i), i as f64);
        expect(&mut exp, &e, i, None);
        order.push(i);
        live.push(e);
    }
    let spool = live.spool();
    wait_for("the spool file", Duration::from_secs(3), || {
        std::fs::read_to_string(&spool).is_ok_and(|t| t.lines().count() >= 500)
    });
    let (report, _, _dir) = live.finish(exit(0), Duration::from_secs(20));
    let points = server.points(&task);
    let got = stored(&points);
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!((report.sent, report.unsent), (600, 0), "{report:?}");
    assert!(!spool.exists(), "an emptied spool is removed");
    // In order: the request that stored a point never precedes the one
    // that stored an earlier point.
    let mut request_of: BTreeMap<(u64, String), u64> = BTreeMap::new();
    for p in &points {
        request_of.insert(
            (
                p["iter"].as_u64().unwrap(),
                p["variant"].as_str().unwrap().to_string(),
            ),
            p["request"].as_u64().unwrap(),
        );
    }
    let mut last = 0;
    for i in order {
        for f in FIELDS {
            let r = request_of[&(i, f.to_string())];
            assert!(
                r >= last,
                "point {i}/{f} stored by request {r} after request {last}"
            );
            last = r;
        }
    }
    server.assert_exactly_once();
}

#[test]
fn a_flapping_server_is_retried_and_every_point_arrives_once() {
    // 429 with Retry-After, then 502, 503 and 504 (one raw gateway page),
    // one after another on the batch endpoint: every one is retried.
    let server = Server::start();
    let live = Live::start(settings(&server.url(), SECRET), "flap");
    let task = live.wait_task();
    for (status, extra) in [
        (429, json!({"retry_after": 1})),
        (502, json!({"raw": true})),
        (503, json!({})),
        (504, json!({})),
    ] {
        let mut f = json!({"status": status, "count": 1, "endpoint": "events.add_batch"});
        f.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        server.fault(f);
    }
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..30);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(20));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!(
        (report.sent, report.refused, report.unsent),
        (180, 0, 0),
        "{report:?}"
    );
    // Each failed attempt counts as an export error; none is a problem
    // for the report.
    assert_eq!(errors, 4, "{report:?}");
    assert!(report.errors.is_empty(), "{report:?}");
    assert!(server.calls_to("events.add_batch") >= 5);
    assert_eq!(server.state()["faults"]["status"], json!([]), "all used");
    server.assert_exactly_once();
}

#[test]
fn partial_errors_are_counted_and_the_rest_delivered() {
    let server = Server::start();
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 500;
    s.flush_interval = Duration::from_millis(300);
    let live = Live::start(s, "partial");
    let task = live.wait_task();
    server.fault(json!({"partial_errors": 3}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..20);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert_eq!(got.len(), 117);
    assert!(got.iter().all(|(k, v)| exp.get(k) == Some(v)));
    assert_eq!(
        (report.sent, report.refused, report.unsent),
        (117, 3, 0),
        "{report:?}"
    );
    assert_eq!(errors, 3);
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.contains("Error when indexing events batch")),
        "{report:?}"
    );
    server.assert_exactly_once();
}

#[test]
fn a_batch_refused_as_a_whole_is_dropped_and_later_ones_go_on() {
    let server = Server::start();
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 6;
    let live = Live::start(s, "refused");
    let task = live.wait_task();
    server.fault(json!({"status": 400, "count": 1, "endpoint": "events.add_batch"}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..5);
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    assert_eq!((report.sent, report.refused), (24, 6), "{report:?}");
    assert_eq!(server.points(&task).len(), 24);
    assert!(errors >= 6);
    assert_eq!(report.errors.len(), 1, "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn a_batch_failed_with_server_errors_is_set_aside_then_delivered_at_the_end() {
    // Six 500s in a row exhaust one batch's attempts: later batches go on,
    // and the set-aside one is tried again at the end instead of dropped.
    let server = Server::start();
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 6;
    let live = Live::start(s, "aside");
    let task = live.wait_task();
    server.fault(json!({"status": 500, "count": 6, "endpoint": "events.add_batch"}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..5);
    wait_for("the later batches", Duration::from_secs(20), || {
        server.points(&task).len() >= 24
    });
    assert_eq!(server.points(&task).len(), 24, "one batch is held back");
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_secs(10));
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    assert_eq!(
        (report.sent, report.refused, report.unsent),
        (30, 0, 0),
        "{report:?}"
    );
    assert!(errors >= 6);
    assert!(report.errors.is_empty(), "{report:?}");
    server.assert_exactly_once();
}

#[test]
fn batches_a_server_keeps_failing_stay_in_the_spool_for_a_resend() {
    // ClearML answers 500 while its storage is down: nothing can be
    // delivered during the run, and nothing is thrown away.
    let server = Server::start();
    let mut s = settings(&server.url(), SECRET);
    s.batch_max = 6;
    let live = Live::start(s.clone(), "down");
    let task = live.wait_task();
    server.fault(json!({"status": 500, "for_s": 600, "endpoint": "events.add_batch"}));
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..5);
    let (report, _errors, dir) = live.finish(exit(0), Duration::from_secs(4));
    assert_eq!(
        (report.sent, report.refused, report.discarded, report.unsent),
        (0, 0, 0, 30),
        "{report:?}"
    );
    assert!(
        report.spool.as_deref().is_some_and(Path::exists),
        "{report:?}"
    );
    assert!(server.points(&task).is_empty());

    server.fault(json!({"clear": true}));
    s.task = Some(task.clone());
    let rt = runtime();
    let report = rt.block_on(async {
        let (reporter, bad) =
            Reporter::resend(s, run_info("down"), dir.path().join("run")).unwrap();
        assert_eq!(bad, 0);
        reporter.finish(exit(0), Duration::from_secs(20)).await
    });
    assert_eq!((report.sent, report.unsent), (30, 0), "{report:?}");
    let got = stored(&server.points(&task));
    assert!(got == exp, "{}", diff(&exp, &got));
    server.assert_exactly_once();
}

#[test]
fn an_unreachable_host_keeps_the_points_in_the_spool() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let live = Live::start(
        settings(&format!("http://127.0.0.1:{port}"), SECRET),
        "down",
    );
    let mut exp = Expected::new();
    steady_marks(&live, &mut exp, "model", 0..10);
    let spool = live.spool();
    let started = Instant::now();
    let (report, errors, _dir) = live.finish(exit(0), Duration::from_millis(1500));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "bounded by the timeout"
    );
    assert_eq!((report.sent, report.unsent), (0, 60), "{report:?}");
    assert_eq!(report.spool.as_deref(), Some(spool.as_path()));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    assert!(
        report.errors[0].contains("could not be reached")
            && report.errors[0].contains(&port.to_string()),
        "{report:?}"
    );
    assert!(errors > 0);
    let lines: Vec<Value> = std::fs::read_to_string(&spool)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 60);
    assert_eq!(lines[0]["metric"], "memory/model");
    assert_eq!(lines[6]["iter"], 1);
}

#[test]
fn the_server_down_for_the_whole_run_leaves_every_point_in_the_spool() {
    let server = Server::start();
    server.fault(json!({"refuse_for_s": 600}));
    let out = scratch();
    let conf = out.path().join("m.toml");
    std::fs::write(&conf, "[clearml]\nfinal_flush_timeout = \"2s\"\n").unwrap();
    let res = agent_run(&server, out.path())
        .arg("--config")
        .arg(&conf)
        .run(["sh", "-c", "sleep 0.3"], Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "the job's status wins: {log}");
    let spool = std::fs::read_to_string(out.path().join("job").join(SPOOL_FILE)).unwrap();
    assert!(spool.lines().count() > 0, "{log}");
    assert!(log.contains("unsent"), "{log}");
    assert!(out.path().join("job/memory_usage.json").exists());
}

#[test]
fn sampling_stays_on_schedule_while_clearml_stalls_then_refuses() {
    // Every call answers 1.5 s late for 2 s, then connections are refused:
    // the daemon's timer must not notice.
    let server = Server::start();
    server.fault(json!({"delay_ms": 1500, "for_s": 2}));
    let out = scratch();
    let conf = out.path().join("m.toml");
    std::fs::write(
        &conf,
        "[clearml]\nfinal_flush_timeout = \"2s\"\ntimer_every = \"0s\"\n",
    )
    .unwrap();
    let res = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_secs(2));
            server.fault(json!({"refuse_for_s": 600}));
        });
        agent_run(&server, out.path())
            .interval("100ms")
            .arg("--config")
            .arg(&conf)
            .run(["sh", "-c", "sleep 4"], Duration::from_secs(120))
    });
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let doc = read_document(&out.path().join("job/memory_usage.json"));
    // A timer that waited on the stalled server would stop for 1.5 s.
    assert_sampling_went_on(&doc, 1.4);
    // Every timer sample became points, and those not sent are kept.
    assert!(out.path().join("job").join(SPOOL_FILE).exists(), "{log}");
}
