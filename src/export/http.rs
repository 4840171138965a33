//! The HTTP endpoint (hyper): `GET /metrics`, `GET /memory-info`,
//! `POST /cleanup-memory`, `GET /healthz`.
//!
//! Every handler reads the latest published snapshot (an `Arc` clone), so a
//! request never reaches the sampler. Hostile clients are bounded: at most
//! `max_connections` at once (more are closed on accept), request headers
//! must arrive within 5 s and fit in 16 KiB, bodies are capped at 1 KiB and
//! must arrive within 5 s. Wrong methods get 405 with `Allow`, unknown
//! paths 404.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch, Semaphore};

use super::prometheus;
use crate::event::protocol::Notice;
use crate::store::snapshot::Snapshot;
use crate::units::{unix_now, MIB};

/// Longest time a client may take to send its request headers or body.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head accepted.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest request body accepted (`/cleanup-memory` takes none).
pub const MAX_BODY: usize = 1024;

/// What the handlers read.
#[derive(Debug, Clone)]
pub struct State {
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
    pub notices: Option<broadcast::Sender<Notice>>,
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

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    respond(status, "application/json", body)
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, &serde_json::json!({ "error": message }))
}

const ROUTES: &[(&str, &str)] = &[
    ("/metrics", "GET, HEAD"),
    ("/memory-info", "GET, HEAD"),
    ("/cleanup-memory", "POST"),
    ("/healthz", "GET, HEAD"),
    ("/", "GET, HEAD"),
];

/// Answers one request.
pub async fn handle(state: &State, req: Request<Incoming>) -> Response<Body> {
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
            prometheus::render(&snap, prometheus::SelfUsage::read()),
        ),
        "/memory-info" => json(StatusCode::OK, &memory_info(&snap)),
        "/cleanup-memory" => {
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
        "/healthz" => {
            let age = unix_now() - snap.current.timestamp;
            let limit = (3.0 * snap.run.interval_s).max(5.0);
            let healthy = snap.current.timestamp > 0.0 && age <= limit && !snap.finished;
            let status = if healthy {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            json(
                status,
                &serde_json::json!({
                    "status": if healthy { "ok" } else if snap.finished { "finished" } else { "stale" },
                    "last_sample_age_s": age,
                    "run": snap.run.name,
                }),
            )
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
pub fn memory_info(snap: &Snapshot) -> serde_json::Value {
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

/// Serves HTTP until `shutdown` turns true.
pub async fn serve(
    listener: TcpListener,
    state: State,
    max_connections: usize,
    mut shutdown: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(max_connections));
    let state = Arc::new(state);
    loop {
        let stream = tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        // Over the limit: close at once rather than queue.
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let state = Arc::clone(&state);
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(handle(&state, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(REQUEST_TIMEOUT)
                .max_buf_size(MAX_HEAD)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
                }
            }
            drop(permit);
        });
    }
}

/// Parses `--listen`: `off`, or an address (`127.0.0.1:9464`, `[::1]:9464`).
pub fn parse_listen(text: &str) -> Result<Option<SocketAddr>, String> {
    if text == "off" {
        return Ok(None);
    }
    text.parse::<SocketAddr>()
        .map(Some)
        .map_err(|_| format!("`{text}` is not an address like 127.0.0.1:9464 (or `off`)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_values() {
        assert_eq!(parse_listen("off").unwrap(), None);
        assert_eq!(
            parse_listen("127.0.0.1:9464").unwrap().unwrap().port(),
            9464
        );
        assert!(parse_listen("[::1]:0").unwrap().is_some());
        assert!(parse_listen("localhost:9464").is_err());
        assert!(parse_listen("9464").is_err());
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
}
