//! The HTTP endpoint (hyper): `GET /metrics`, `GET /memory-info`,
//! `POST /cleanup-memory`, `GET /healthz`.
//!
//! Every handler reads the latest published snapshot (an `Arc` clone), so a
//! request never reaches the sampler. Hostile clients are bounded, and
//! cannot lock others out: connections are served concurrently, at most
//! `max_connections` at once and a quarter of that per client (a local
//! user, or a remote address: `super::peer`). A client at its share, or
//! a new client finding every connection taken, makes room by closing the
//! oldest connection that is not in the middle of a request (idle, slow to
//! send its head, or not reading its reply) — the client's own, or that
//! of the client holding the most. So a slow or idle client never makes
//! `/healthz` fail for another user's scraper. Request headers must
//! arrive within 5 s and fit in 16 KiB, bodies are capped at 1 KiB and must
//! arrive within 5 s. `POST /cleanup-memory` runs every subscribed client's
//! cleanup handler, so it is honoured at most once per
//! [`CLEANUP_MIN_INTERVAL`] (429 with `Retry-After` otherwise, counted).
//! Wrong methods get 405 with `Allow`, unknown paths 404.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch, Notify};

use super::peer::{self, Peer};
use super::prometheus;
use crate::event::protocol::Notice;
use crate::store::snapshot::Snapshot;
use crate::units::{unix_now, MIB};

/// Longest time a client may take to send its request headers or body.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head accepted.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// Largest request body accepted (`/cleanup-memory` takes none).
pub(crate) const MAX_BODY: usize = 1024;

/// `POST /cleanup-memory` is honoured at most once per this long: each
/// one runs every subscribed client's cleanup handler (`gc.collect()`,
/// `torch.cuda.empty_cache()`), which the Python client's auto-cleanup
/// also allows at most once per 5 s.
pub const CLEANUP_MIN_INTERVAL: Duration = Duration::from_secs(5);

/// What the handlers read.
#[derive(Debug, Clone)]
pub struct HttpState {
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
    pub notices: Option<broadcast::Sender<Notice>>,
}

/// The server's own state beside [`HttpState`]: the cleanup throttle and what
/// the guards counted.
#[derive(Debug, Default)]
struct Guard {
    last_cleanup: Mutex<Option<Instant>>,
    cleanup_throttled: AtomicU64,
    evicted: AtomicU64,
}

impl Guard {
    /// `Ok` when a cleanup may run now (and it is then recorded), else how
    /// long until one may.
    fn cleanup(&self, now: Instant) -> Result<(), Duration> {
        let mut last = self
            .last_cleanup
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(at) = *last {
            let since = now.saturating_duration_since(at);
            if since < CLEANUP_MIN_INTERVAL {
                self.cleanup_throttled.fetch_add(1, Ordering::Relaxed);
                return Err(CLEANUP_MIN_INTERVAL - since);
            }
        }
        *last = Some(now);
        Ok(())
    }

    fn counters(&self) -> prometheus::ServerCounters {
        prometheus::ServerCounters {
            cleanup_throttled: self.cleanup_throttled.load(Ordering::Relaxed),
            connections_evicted: self.evicted.load(Ordering::Relaxed),
        }
    }
}

type Body = Full<Bytes>;

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// `/healthz`: 200 while the run samples on time and follows at least one
/// process; 503 before its first sample or once it lags (`stale`), while
/// nothing is followed (`idle`: an `attach` whose processes have not
/// registered yet, or have all ended) and once the run has `finished`. The
/// body says which, with the number of processes followed and their roots.
pub(crate) fn health(snap: &Snapshot, now: f64) -> (StatusCode, serde_json::Value) {
    let age = now - snap.current.timestamp;
    let limit = (3.0 * snap.run.interval_s).max(5.0);
    let sampled = snap.current.timestamp > 0.0 && age <= limit;
    let followed = snap.current.processes;
    let state = if snap.finished {
        "finished"
    } else if !sampled {
        "stale"
    } else if followed == 0 {
        "idle"
    } else {
        "ok"
    };
    let status = if state == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let roots: Vec<u32> = snap
        .processes
        .iter()
        .filter(|p| p.root)
        .map(|p| p.pid)
        .take(64)
        .collect();
    (
        status,
        serde_json::json!({
            "status": state,
            "processes": followed,
            "roots": roots,
            "last_sample_age_s": age,
            "run": snap.run.name,
        }),
    )
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    // Read by people too (`curl`): C1 controls and bidirectional marks,
    // which JSON writers leave raw, become `\uXXXX`, the same string to
    // a JSON reader.
    let mut body = crate::logging::terminal::escape_output(&text)
        .into_owned()
        .into_bytes();
    body.push(b'\n');
    respond(status, "application/json", body)
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, &serde_json::json!({ "error": message }))
}

/// 429 with `Retry-After` (whole seconds, rounded up).
fn too_many(wait: Duration) -> Response<Body> {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let mut r = json(
        StatusCode::TOO_MANY_REQUESTS,
        &serde_json::json!({
            "error": format!(
                "cleanup runs at most once per {} s; retry in {secs} s",
                CLEANUP_MIN_INTERVAL.as_secs()
            ),
            "retry_after_s": secs,
        }),
    );
    r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
    r
}

const ROUTES: &[(&str, &str)] = &[
    ("/metrics", "GET, HEAD"),
    ("/memory-info", "GET, HEAD"),
    ("/cleanup-memory", "POST"),
    ("/healthz", "GET, HEAD"),
    ("/", "GET, HEAD"),
];

/// Answers one request.
async fn handle(state: &HttpState, guard: &Guard, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let Some((_, allow)) = ROUTES.iter().find(|(p, _)| *p == path) else {
        return error(StatusCode::NOT_FOUND, "no such endpoint; see GET /");
    };
    let method = req.method().clone();
    let is_get = method == Method::GET || method == Method::HEAD;
    let allowed = if *allow == "POST" {
        method == Method::POST
    } else {
        is_get
    };
    if !allowed {
        let mut r = error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("{path} accepts {allow}"),
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static(allow));
        return r;
    }
    // A body must be small and quick, even where none is expected.
    let limited = Limited::new(req.into_body(), MAX_BODY);
    match tokio::time::timeout(REQUEST_TIMEOUT, limited.collect()).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("request bodies are limited to {MAX_BODY} bytes"),
            )
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time",
            )
        }
    }
    let snap = state.snapshots.borrow().clone();
    let mut response = match path.as_str() {
        "/metrics" => respond(
            StatusCode::OK,
            prometheus::content_type(),
            prometheus::render_with(
                &snap,
                crate::sample::procfs::SelfUsage::read(),
                &guard.counters(),
            ),
        ),
        "/memory-info" => json(StatusCode::OK, &memory_info(&snap)),
        "/cleanup-memory" => match guard.cleanup(Instant::now()) {
            Err(wait) => too_many(wait),
            Ok(()) => {
                let notified = state
                    .notices
                    .as_ref()
                    .and_then(|n| {
                        n.send(Notice::Cleanup {
                            reason: "http".into(),
                            timestamp: unix_now(),
                        })
                        .ok()
                    })
                    .unwrap_or(0);
                json(StatusCode::OK, &serde_json::json!({ "notified": notified }))
            }
        },
        "/healthz" => {
            let (status, body) = health(&snap, unix_now());
            json(status, &body)
        }
        _ => json(
            StatusCode::OK,
            &serde_json::json!({
                "service": "memtrack",
                "run": snap.run.name,
                "endpoints": ROUTES.iter().map(|(p, m)| format!("{m} {p}")).collect::<Vec<_>>(),
            }),
        ),
    };
    if method == Method::HEAD {
        *response.body_mut() = Full::new(Bytes::new());
    }
    response
}

/// `/memory-info`: current and peak figures per process, component and
/// GPU, with pressure levels, in MiB and percent.
pub(crate) fn memory_info(snap: &Snapshot) -> serde_json::Value {
    let level = |resource: &str| {
        snap.levels
            .get(resource)
            .copied()
            .unwrap_or_default()
            .as_str()
    };
    let host = &snap.host_memory;
    let host_used_pct = if host.total > 0 {
        100.0 * (1.0 - host.available as f64 / host.total as f64)
    } else {
        0.0
    };
    let gpus: Vec<serde_json::Value> = snap
        .gpus
        .iter()
        .map(|g| {
            let free = (g.total_mb - g.used_mb).max(0.0);
            serde_json::json!({
                "index": g.index, "uuid": g.uuid, "name": g.name,
                "total_mb": g.total_mb, "used_mb": g.used_mb, "free_mb": free,
                "memory_usage_percent": if g.total_mb > 0.0 { 100.0 * g.used_mb / g.total_mb } else { 0.0 },
                "free_memory_gb": free / 1024.0,
                "tree_used_mb": g.tree_used_mb, "peak_tree_used_mb": g.peak_tree_used_mb,
                "utilization_pct": g.utilization_pct, "temperature_c": g.temperature_c,
                "level": level(&format!("gpu{}", g.index)),
            })
        })
        .collect();
    let processes: Vec<serde_json::Value> = snap
        .processes
        .iter()
        .map(|p| {
            serde_json::json!({
                "pid": p.pid, "name": p.name, "root": p.root,
                "rss_mb": p.rss_bytes as f64 / MIB, "hwm_mb": p.hwm_bytes as f64 / MIB,
                "peak_rss_mb": p.peak_rss_bytes as f64 / MIB,
                "gpu_mb": p.gpu_bytes.values().sum::<u64>() as f64 / MIB,
                "uss_mb": p.uss_bytes.map(|b| b as f64 / MIB),
                "pss_mb": p.pss_bytes.map(|b| b as f64 / MIB),
                "own_estimated": p.own_estimated,
            })
        })
        .collect();
    serde_json::json!({
        "run": { "name": snap.run.name, "id": snap.run.id, "host": snap.run.host, "labels": snap.run.labels },
        "timestamp": snap.current.timestamp,
        "host": {
            "total_mb": host.total as f64 / MIB, "available_mb": host.available as f64 / MIB,
            "used_percent": host_used_pct, "level": level("host"),
        },
        "tree": {
            "cpu_ram_used_mb": snap.current.cpu_used_mb, "cpu_ram_hwm_mb": snap.current.cpu_hwm_mb,
            "gpu_ram_used_mb": snap.current.gpu_tree_mb, "processes": snap.processes.len(),
        },
        "peak_usage": snap.peaks,
        "peaks_by_component": snap.by_component,
        "gpus": gpus,
        "processes": processes,
        "allocator": snap.allocator,
        "open_spans": snap.open_spans,
        "open_stages": snap.open_stages,
    })
}

/// One open connection, as the accept loop sees it.
struct Slot {
    peer: Peer,
    /// A request is being answered (its handler runs): never evicted.
    busy: Arc<AtomicBool>,
    /// Told when the connection must make room for a newer one.
    evict: Arc<Notify>,
}

/// The open connections, oldest first (ids grow).
#[derive(Default)]
struct Slots {
    next: u64,
    open: BTreeMap<u64, Slot>,
}

impl Slots {
    /// Opens a slot for a connection of `peer`: its id, the flag it sets
    /// while answering a request, and the notice that closes it.
    fn insert(&mut self, peer: Peer) -> (u64, Arc<AtomicBool>, Arc<Notify>) {
        let busy = Arc::new(AtomicBool::new(false));
        let evict = Arc::new(Notify::new());
        let id = self.next;
        self.next += 1;
        self.open.insert(
            id,
            Slot {
                peer,
                busy: Arc::clone(&busy),
                evict: Arc::clone(&evict),
            },
        );
        (id, busy, evict)
    }

    /// Makes room for one more connection from `peer`: at its share
    /// (`max / 4`), its own oldest idle connection is closed; with all
    /// `max` taken, the oldest idle connection of the client holding the
    /// most is (or, all of those answering, anyone's oldest idle one).
    /// `false` when no connection can be closed (every candidate is
    /// answering a request): the new one is then refused.
    fn make_room(&mut self, peer: Peer, max: usize, guard: &Guard) -> bool {
        let share = (max / 4).max(1);
        let mut held: BTreeMap<Peer, usize> = BTreeMap::new();
        for s in self.open.values() {
            *held.entry(s.peer).or_default() += 1;
        }
        let at_share = held.get(&peer).copied().unwrap_or(0) >= share;
        if !at_share && self.open.len() < max {
            return true;
        }
        let idle = |s: &Slot| !s.busy.load(Ordering::Acquire);
        let oldest_idle_of = |who: Peer| {
            self.open
                .iter()
                .find(|(_, s)| s.peer == who && idle(s))
                .map(|(id, _)| *id)
        };
        let oldest_idle = if at_share {
            oldest_idle_of(peer)
        } else {
            // All taken: the client holding the most gives way first, then
            // anyone.
            held.iter()
                .max_by_key(|(_, n)| **n)
                .and_then(|(heaviest, _)| oldest_idle_of(*heaviest))
                .or_else(|| self.open.iter().find(|(_, s)| idle(s)).map(|(id, _)| *id))
        };
        match oldest_idle.and_then(|id| self.open.remove(&id)) {
            Some(slot) => {
                slot.evict.notify_one();
                guard.evicted.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }
}

/// Marks a connection busy while a handler runs (also when the handler's
/// future is dropped half-way).
struct Busy(Arc<AtomicBool>);

impl Busy {
    fn new(flag: &Arc<AtomicBool>) -> Busy {
        flag.store(true, Ordering::Release);
        Busy(Arc::clone(flag))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Serves HTTP until `shutdown` turns true.
pub async fn serve(
    listener: TcpListener,
    state: HttpState,
    max_connections: usize,
    mut shutdown: watch::Receiver<bool>,
) {
    let max_connections = max_connections.max(1);
    let slots = Arc::new(Mutex::new(Slots::default()));
    let guard = Arc::new(Guard::default());
    let state = Arc::new(state);
    loop {
        let first = tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        // Whatever else is waiting to be accepted, identified together.
        let mut batch = vec![first];
        while batch.len() < ACCEPT_BATCH {
            match tokio::time::timeout(Duration::ZERO, listener.accept()).await {
                Ok(Ok(accepted)) => batch.push(accepted),
                _ => break,
            }
        }
        let ends: Vec<(SocketAddr, SocketAddr)> = batch
            .iter()
            .map(|(stream, client)| (*client, stream.local_addr().unwrap_or(*client)))
            .collect();
        let peers = peer::identify(Path::new("/proc/net"), &ends);
        for ((stream, _), peer) in batch.into_iter().zip(peers) {
            admit(
                stream,
                peer,
                max_connections,
                &slots,
                &guard,
                &state,
                &shutdown,
            );
        }
    }
}

/// Connections accepted and identified together when they arrive at once.
const ACCEPT_BATCH: usize = 256;

/// Serves one accepted connection from `peer`, if room can be made.
fn admit(
    stream: tokio::net::TcpStream,
    peer: Peer,
    max_connections: usize,
    slots: &Arc<Mutex<Slots>>,
    guard: &Arc<Guard>,
    state: &Arc<HttpState>,
    shutdown: &watch::Receiver<bool>,
) {
    let (id, busy, evict) = {
        let mut slots = slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Nothing can be closed to make room: close the new one at once
        // rather than queue it.
        if !slots.make_room(peer, max_connections, guard) {
            drop(stream);
            return;
        }
        slots.insert(peer)
    };
    let state = Arc::clone(state);
    let guard = Arc::clone(guard);
    let slots = Arc::clone(slots);
    let mut stop = shutdown.clone();
    tokio::spawn(async move {
        let service = hyper::service::service_fn(move |req| {
            let state = Arc::clone(&state);
            let guard = Arc::clone(&guard);
            let busy = Busy::new(&busy);
            async move {
                let response = handle(&state, &guard, req).await;
                drop(busy);
                Ok::<_, Infallible>(response)
            }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(REQUEST_TIMEOUT)
            .max_buf_size(MAX_HEAD)
            .serve_connection(TokioIo::new(stream), service);
        tokio::pin!(conn);
        tokio::select! {
            _ = conn.as_mut() => {}
            // Made room for a newer connection: close now.
            _ = evict.notified() => {}
            _ = stop.changed() => {
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
            }
        }
        slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .open
            .remove(&id);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthz_says_what_is_followed_and_is_503_while_nothing_is() {
        let mut snap = Snapshot::default();
        snap.run.interval_s = 1.0;
        let state = |snap: &Snapshot, now| {
            let (code, body) = health(snap, now);
            (
                code.as_u16(),
                body["status"].as_str().unwrap_or("").to_string(),
            )
        };
        assert_eq!(state(&snap, 100.0), (503, "stale".into()), "no sample yet");
        snap.current.timestamp = 99.0;
        assert_eq!(
            state(&snap, 100.0),
            (503, "idle".into()),
            "nothing followed"
        );
        snap.current.processes = 2;
        snap.processes = vec![
            crate::store::snapshot::ProcessNow {
                pid: 41,
                root: true,
                ..Default::default()
            },
            crate::store::snapshot::ProcessNow {
                pid: 42,
                ppid: 41,
                ..Default::default()
            },
        ];
        assert_eq!(state(&snap, 100.0), (200, "ok".into()));
        let (_, body) = health(&snap, 100.0);
        assert_eq!(body["processes"], 2);
        assert_eq!(body["roots"], serde_json::json!([41]));
        assert_eq!(state(&snap, 200.0), (503, "stale".into()), "lagging");
        snap.finished = true;
        assert_eq!(state(&snap, 100.0), (503, "finished".into()));
    }

    fn slot(slots: &mut Slots, peer: Peer) -> (u64, Arc<AtomicBool>, Arc<Notify>) {
        slots.insert(peer)
    }

    #[test]
    fn room_is_made_by_the_client_holding_the_most_and_never_mid_request() {
        let guard = Guard::default();
        let (a, b) = (Peer::Uid(65534), Peer::Uid(0));
        let mut slots = Slots::default();
        // Up to its share (8 / 4 = 2), a client gets room freely.
        assert!(slots.make_room(a, 8, &guard));
        let (a0, a0_busy, _) = slot(&mut slots, a);
        assert!(slots.make_room(a, 8, &guard));
        let (a1, _, _) = slot(&mut slots, a);
        // At its share, its own oldest connection not answering a request
        // makes room: a0 is answering, so a1 goes.
        a0_busy.store(true, Ordering::Release);
        assert!(slots.make_room(a, 8, &guard));
        assert!(slots.open.contains_key(&a0) && !slots.open.contains_key(&a1));
        let (_, a2_busy, _) = slot(&mut slots, a);
        // Every one of its connections answering: the new one is refused.
        a2_busy.store(true, Ordering::Release);
        assert!(!slots.make_room(a, 8, &guard));
        // Six other clients fill the pool; a new one makes room by closing
        // the oldest idle connection of the client holding the most (`a`,
        // but both of its are answering), so anyone's oldest idle one.
        let mut others = Vec::new();
        for i in 0..6u8 {
            let p = Peer::Ip(std::net::IpAddr::from([10, 0, 0, i]));
            assert!(slots.make_room(p, 8, &guard));
            others.push(slot(&mut slots, p).0);
        }
        assert_eq!(slots.open.len(), 8);
        assert!(slots.make_room(b, 8, &guard));
        assert!(!slots.open.contains_key(&others[0]));
        assert_eq!(slots.open.len(), 7);
        assert_eq!(guard.evicted.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn cleanup_is_throttled_and_says_how_long_to_wait() {
        let guard = Guard::default();
        let t0 = Instant::now();
        assert!(guard.cleanup(t0).is_ok());
        let wait = guard.cleanup(t0 + Duration::from_secs(2)).unwrap_err();
        assert_eq!(wait, CLEANUP_MIN_INTERVAL - Duration::from_secs(2));
        assert!(guard.cleanup(t0 + CLEANUP_MIN_INTERVAL).is_ok());
        assert_eq!(guard.cleanup_throttled.load(Ordering::Relaxed), 1);
        let r = too_many(Duration::from_millis(1500));
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[RETRY_AFTER], "2");
    }

    #[test]
    fn memory_info_gives_gpu_percent_and_free_gb() {
        let mut snap = Snapshot::default();
        snap.gpus.push(crate::model::Gpu {
            index: 0,
            total_mb: 1000.0,
            used_mb: 870.0,
            ..Default::default()
        });
        let v = memory_info(&snap);
        assert_eq!(v["gpus"][0]["memory_usage_percent"], 87.0);
        assert!((v["gpus"][0]["free_memory_gb"].as_f64().unwrap() - 130.0 / 1024.0).abs() < 1e-9);
    }

    #[test]
    fn memory_info_gives_each_process_its_own_cost() {
        let mut snap = Snapshot::default();
        let own = [
            (10, Some((64u64 << 20, 48u64 << 20)), false),
            (11, None, false),
            (12, Some((70 << 20, 60 << 20)), true),
        ];
        for (pid, own, estimated) in own {
            snap.processes.push(crate::store::snapshot::ProcessNow {
                pid,
                rss_bytes: 100 << 20,
                pss_bytes: own.map(|o| o.0),
                uss_bytes: own.map(|o| o.1),
                own_estimated: estimated,
                ..Default::default()
            });
        }
        let v = memory_info(&snap);
        assert_eq!(v["processes"][0]["pss_mb"], 64.0);
        assert_eq!(v["processes"][0]["uss_mb"], 48.0);
        assert_eq!(v["processes"][0]["own_estimated"], false);
        assert!(v["processes"][1]["uss_mb"].is_null(), "not read yet");
        assert_eq!(v["processes"][2]["uss_mb"], 60.0);
        assert_eq!(v["processes"][2]["own_estimated"], true, "said, not hidden");
    }
}
