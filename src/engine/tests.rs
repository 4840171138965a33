//! The engine driven by hand: a fake `/proc` with no processes, a fake
//! GPU, no journal, and inputs handed to its batch handler or its loop.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use tokio::sync::{broadcast, oneshot};

use super::*;
use crate::event::inbox::ClientRequest;
use crate::event::protocol;
use crate::event::server::Stats;
use crate::model::{Exit, GpuBackend, RunInfo, RunStatus};
use crate::sample::footprint::{FootprintOptions, FootprintReader, SourceChoice};
use crate::sample::gpu::{Device, GpuSample, GpuSampler, ProcessReading, Status};
use crate::sample::procfs::{ProcOptions, ProcTree};
use crate::store::pressure::Thresholds;
use crate::store::Limits;
use crate::sys::Reaped;

/// A GPU that reports one process's memory on every read.
struct FakeGpu {
    reads: Arc<AtomicU64>,
}

impl GpuSampler for FakeGpu {
    fn backend(&self) -> GpuBackend {
        GpuBackend::Other("fake".into())
    }

    fn devices(&self) -> &[Device] {
        &[]
    }

    fn sample(&mut self, out: &mut GpuSample) -> Status {
        self.reads.fetch_add(1, Ordering::Relaxed);
        out.processes.push(ProcessReading {
            pid: 4242,
            device: 0,
            used: Some(1 << 20),
        });
        Status::Sampled
    }
}

struct Rig {
    engine: Engine,
    gpu_reads: Arc<AtomicU64>,
    _proc: tempfile::TempDir,
}

fn rig(flight: bool, self_register: bool) -> Rig {
    let proc = tempfile::tempdir().unwrap();
    std::fs::write(proc.path().join("stat"), "cpu 0 0 0 0\nbtime 1700000000\n").unwrap();
    let tree = ProcTree::new(ProcOptions {
        root: proc.path().into(),
        hwm_interval: Duration::from_secs(1),
        reaper: None,
        job: None,
        smaps: None,
        read_share: 0.02,
    })
    .unwrap();
    let footprint = FootprintReader::new(
        FootprintOptions {
            choice: SourceChoice::Rss,
            proc_root: proc.path().into(),
        },
        None,
    );
    let gpu_reads = Arc::new(AtomicU64::new(0));
    let gpu = Box::new(FakeGpu {
        reads: Arc::clone(&gpu_reads),
    });
    let sampler = Sampler::new(tree, footprint, gpu, None);
    let store = Store::new(RunInfo::default(), Limits::default(), Thresholds::default());
    let opts = EngineOptions {
        // Long enough that no timer tick falls due while a test runs.
        interval: Duration::from_secs(3600),
        checkpoint_interval: Duration::from_secs(3600),
        journal_flush: Duration::from_secs(1),
        end_when: EndWhen::Stopped,
        flight: flight.then_some((Duration::from_millis(100), Duration::from_secs(1))),
    };
    let events = EventLink {
        notices: broadcast::channel(16).0,
        stats: Arc::new(Stats::default()),
        self_register,
    };
    let mut engine = Engine::new(sampler, store, None, opts, Some(events), Outputs::default());
    engine.start_flight();
    Rig {
        engine,
        gpu_reads,
        _proc: proc,
    }
}

fn not_ended() -> Ended {
    Ended {
        job_exit: None,
        stopped_by_request: false,
        urgent: false,
        write_error: None,
    }
}

/// A client's line as the socket server hands it over, with the receiver
/// of its reply.
fn client(line: &str, pid: Option<u32>) -> (Input, oneshot::Receiver<Vec<u8>>) {
    let (tx, rx) = oneshot::channel();
    let input = Input::Client(Box::new(ClientRequest {
        pid,
        received: 1000.0,
        request: protocol::parse(line.as_bytes()).unwrap(),
        reply: Some(tx),
    }));
    (input, rx)
}

fn reply(mut rx: oneshot::Receiver<Vec<u8>>) -> Option<serde_json::Value> {
    let line = rx.try_recv().ok()?;
    Some(serde_json::from_slice(&line).unwrap())
}

#[test]
fn an_input_stays_small_because_the_queue_preallocates_its_slots() {
    assert!(
        std::mem::size_of::<Input>() <= 48,
        "{}",
        std::mem::size_of::<Input>()
    );
}

#[test]
fn an_acked_mark_is_sampled_recorded_and_answered_with_its_entry() {
    let mut r = rig(false, false);
    let (input, rx) = client(
        r#"{"component":"model","operation":"step","iteration":3,"ack":true,"id":"m1"}"#,
        Some(77),
    );
    let stop = r.engine.handle_batch(vec![input], &mut not_ended());
    assert_eq!(stop, None);
    assert_eq!(r.gpu_reads.load(Ordering::Relaxed), 1, "one event sample");
    let answer = reply(rx).expect("an ack");
    assert_eq!(answer["type"], "recorded");
    assert_eq!(answer["id"], "m1");
    assert_eq!(answer["entry"]["operation"], "step");
    let log = r.engine.store.document().detailed_log;
    let last = log.last().expect("the mark's entry");
    assert_eq!(
        (last.component.as_str(), last.operation.as_str()),
        ("model", "step")
    );
    assert_eq!(last.pid, Some(77));
}

#[test]
fn marks_in_one_batch_share_one_sample() {
    let mut r = rig(false, false);
    let batch: Vec<Input> = (0..5)
        .map(|i| client(&format!(r#"{{"component":"a","operation":"op{i}"}}"#), None).0)
        .collect();
    r.engine.handle_batch(batch, &mut not_ended());
    assert_eq!(r.gpu_reads.load(Ordering::Relaxed), 1);
    assert_eq!(r.engine.store.counters().events, 5);
}

#[test]
fn a_stage_opens_and_closes_in_the_store() {
    let mut r = rig(false, false);
    let (open, _) = client(r#"{"type":"stage_begin","name":"train"}"#, None);
    r.engine.handle_batch(vec![open], &mut not_ended());
    assert_eq!(r.engine.store.status()["open_stages"][0], "train");
    let (close, _) = client(
        r#"{"type":"stage_end","name":"train","status":"FAILED"}"#,
        None,
    );
    r.engine.handle_batch(vec![close], &mut not_ended());
    let doc = r.engine.store.document();
    assert_eq!(doc.stages.len(), 1);
    assert_eq!(
        (doc.stages[0].name.as_str(), doc.stages[0].status.as_str()),
        ("train", "FAILED")
    );
    assert_eq!(
        r.engine.store.status()["open_stages"],
        serde_json::json!([])
    );
}

#[test]
fn requests_the_server_answers_change_nothing_and_get_no_reply_here() {
    let mut r = rig(false, false);
    let seq = r.engine.store.seq;
    for line in [
        r#"{"type":"subscribe","id":1}"#,
        r#"{"type":"cleanup","id":2}"#,
        r#"{"type":"clearml_task","task":"abc","ack":true,"id":3}"#,
    ] {
        let (input, mut rx) = client(line, Some(1));
        assert_eq!(r.engine.handle_batch(vec![input], &mut not_ended()), None);
        assert!(
            matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Closed)),
            "{line}: the engine must not answer"
        );
    }
    assert_eq!(r.engine.store.seq, seq, "nothing recorded");
    assert_eq!(r.gpu_reads.load(Ordering::Relaxed), 0, "nothing sampled");
}

#[test]
fn status_and_register_are_answered_without_recording() {
    let mut r = rig(false, false);
    let seq = r.engine.store.seq;
    let (status, status_rx) = client(r#"{"type":"status","id":"s"}"#, None);
    let (register, register_rx) = client(r#"{"type":"register","id":"r"}"#, Some(31337));
    r.engine
        .handle_batch(vec![status, register], &mut not_ended());
    let s = reply(status_rx).expect("status reply");
    assert_eq!(
        (s["type"].as_str(), s["id"].as_str()),
        (Some("status"), Some("s"))
    );
    assert!(s.get("counters").is_some(), "{s}");
    let g = reply(register_rx).expect("register reply");
    assert_eq!(g["type"], "registered");
    assert_eq!(g["following"], false, "self-registration is off");
    assert_eq!(r.engine.store.seq, seq);
}

#[test]
fn a_process_that_cannot_be_followed_is_not_followed() {
    // Self-registration on, but PID 31337 is not in this /proc.
    let mut r = rig(false, true);
    let (register, rx) = client(r#"{"type":"register"}"#, Some(31337));
    r.engine.handle_batch(vec![register], &mut not_ended());
    assert_eq!(reply(rx).expect("reply")["following"], false);
    assert!(r.engine.sampler.all_gone());
}

#[test]
fn the_job_exit_is_recorded_and_ends_a_run_that_waits_for_it() {
    let mut r = rig(false, false);
    r.engine.opts.end_when = EndWhen::JobExits;
    let mut ended = not_ended();
    assert!(!r.engine.run_over(&ended));
    let exited = Input::JobExited {
        pid: 5,
        reaped: Reaped {
            status: 2 << 8,
            max_rss_kib: 4,
        },
    };
    assert_eq!(r.engine.handle_batch(vec![exited], &mut ended), None);
    assert_eq!(ended.job_exit, Some(Exit::code(2)));
    assert!(r.engine.run_over(&ended));
}

#[test]
fn stop_and_checkpoint_requests_are_noted() {
    let mut r = rig(false, false);
    let mut ended = not_ended();
    let batch = vec![
        Input::Checkpoint,
        Input::Stop { urgent: false },
        Input::Stop { urgent: true },
        Input::Stop { urgent: false },
    ];
    assert_eq!(r.engine.handle_batch(batch, &mut ended), Some(true));
    assert!(ended.stopped_by_request);
    assert!(r.engine.checkpoint_soon);
    let mut r = rig(false, false);
    let stop = vec![Input::Stop { urgent: false }];
    assert_eq!(r.engine.handle_batch(stop, &mut not_ended()), Some(false));
}

#[test]
fn a_death_by_signal_keeps_the_flight_window_once() {
    let mut r = rig(true, false);
    for _ in 0..3 {
        r.engine.sample(SampleKind::Timer);
    }
    let killed = || Input::JobExited {
        pid: 9,
        reaped: Reaped {
            status: libc::SIGKILL,
            max_rss_kib: 0,
        },
    };
    r.engine.handle_batch(vec![killed()], &mut not_ended());
    r.engine.handle_batch(vec![killed()], &mut not_ended());
    let flights = r.engine.store.document().flight_recorder;
    assert_eq!(flights.len(), 1, "one window per PID");
    assert_eq!(flights[0].reason, "signal");
    assert_eq!(flights[0].pid, Some(9));
    assert_eq!(flights[0].points.len(), 3, "the three samples before");
}

#[test]
fn a_cuda_oom_is_marked_and_its_window_kept_at_the_end() {
    let mut r = rig(true, false);
    r.engine.flight_tick(Instant::now());
    let (oom, rx) = client(
        r#"{"type":"oom","summary":"the allocator's table","message":"CUDA out of memory","ack":true}"#,
        Some(4242),
    );
    r.engine.handle_batch(vec![oom], &mut not_ended());
    assert_eq!(
        reply(rx).expect("ack")["entry"]["operation"],
        "out_of_memory"
    );
    assert!(
        r.engine.store.document().flight_recorder.is_empty(),
        "the window waits for its tail"
    );
    r.engine.settle_flight(true);
    let flights = r.engine.store.document().flight_recorder;
    assert_eq!(flights.len(), 1);
    assert_eq!(flights[0].reason, "cuda_oom");
    assert_eq!(
        flights[0].cuda_summary.as_deref(),
        Some("the allocator's table")
    );
}

#[test]
fn without_a_flight_recorder_a_death_keeps_nothing() {
    let mut r = rig(false, false);
    r.engine.flight_tick(Instant::now());
    let killed = Input::JobExited {
        pid: 9,
        reaped: Reaped {
            status: libc::SIGKILL,
            max_rss_kib: 0,
        },
    };
    r.engine.handle_batch(vec![killed], &mut not_ended());
    r.engine.settle_flight(true);
    assert!(r.engine.store.document().flight_recorder.is_empty());
    assert_eq!(r.gpu_reads.load(Ordering::Relaxed), 0, "no fast reads");
}

#[test]
fn a_stopped_run_ends_with_a_final_sample_and_a_finished_document() {
    let r = rig(false, false);
    let (tx, rx) = mpsc::sync_channel(8);
    let (mark, _) = client(r#"{"component":"a","operation":"last"}"#, None);
    tx.send(mark).unwrap();
    tx.send(Input::Stop { urgent: false }).unwrap();
    let (ended, store) = r.engine.run(&rx);
    assert!(ended.stopped_by_request);
    assert!(!ended.urgent);
    assert_eq!(ended.write_error, None);
    let doc = store.document();
    assert_eq!(doc.run.status, RunStatus::Finished);
    let ops: Vec<&str> = doc
        .detailed_log
        .iter()
        .map(|e| e.operation.as_str())
        .collect();
    assert!(ops.contains(&"experiment_start"), "{ops:?}");
    assert!(ops.contains(&"last"), "{ops:?}");
}

#[test]
fn an_urgent_stop_skips_the_final_sample() {
    let r = rig(false, false);
    let reads = Arc::clone(&r.gpu_reads);
    let (tx, rx) = mpsc::sync_channel(8);
    tx.send(Input::Stop { urgent: true }).unwrap();
    let (ended, _) = r.engine.run(&rx);
    assert!(ended.urgent);
    assert_eq!(reads.load(Ordering::Relaxed), 1, "only the first sample");
}
