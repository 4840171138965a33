//! The few MLflow REST calls memtrack makes: `experiments/get-by-name`,
//! `experiments/create`, `runs/create`, `runs/get`, `runs/log-batch`,
//! `runs/update`, and the artifact proxy's `PUT`.

use std::time::Duration;

use serde_json::{json, Value};

/// One metric value as `runs/log-batch` takes it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Metric {
    pub(crate) key: &'static str,
    pub(crate) value: f64,
    /// Unix milliseconds.
    pub(crate) timestamp: i64,
    pub(crate) step: i64,
}

/// Why the MLflow export failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MlflowError {
    #[error("{0}")]
    Config(String),
    #[error("MLflow {call}: {why}")]
    Call {
        call: String,
        why: String,
        /// Worth another try later: no answer, or the server's 5xx / 429.
        transient: bool,
    },
    /// The end of the run's deadline came before an answer.
    #[error("MLflow: no answer before the end's deadline (finish_timeout)")]
    Deadline,
}

impl MlflowError {
    /// Whether trying the same call again later may succeed (an outage),
    /// rather than the server refusing it or answering nonsense.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self,
            MlflowError::Call {
                transient: true,
                ..
            }
        )
    }
}

/// Whether an HTTP status is worth another try: the server's own trouble
/// or a request to slow down.
fn transient_status(status: reqwest::StatusCode) -> bool {
    status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS
}

/// A client for one tracking server.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    pub fn new(base: &str, timeout: Duration) -> Result<Api, MlflowError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .user_agent(format!("memtrack-{}", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| MlflowError::Config(format!("cannot make an HTTP client: {e}")))?;
        Ok(Api {
            client,
            base: base.to_string(),
        })
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, MlflowError> {
        let url = format!("{}/api/2.0/mlflow/{path}", self.base);
        let mut request = self.client.request(method, &url);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let failed = |why: String, transient: bool| MlflowError::Call {
            call: path.to_string(),
            why,
            transient,
        };
        let response = request
            .send()
            .await
            .map_err(|e| failed(describe(&e), true))?;
        let status = response.status();
        if !status.is_success() {
            return Err(failed(
                format!("HTTP {status}: {}", error_text(response).await),
                transient_status(status),
            ));
        }
        let body = read_capped(response, MAX_REPLY)
            .await
            .map_err(|e| failed(e, false))?;
        Ok(serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// The id of the experiment called `name`, created when the server has
    /// none (as MLflow's client does for `MLFLOW_EXPERIMENT_NAME`).
    pub(crate) async fn experiment_named(&self, name: &str) -> Result<String, MlflowError> {
        let url = format!("experiments/get-by-name?experiment_name={}", query(name));
        match self.call(reqwest::Method::GET, &url, None).await {
            Ok(reply) => {
                if let Some(id) = reply["experiment"]["experiment_id"].as_str() {
                    return Ok(id.to_string());
                }
            }
            // The server's answer for a name it does not know.
            Err(MlflowError::Call { why, .. }) if why.contains("RESOURCE_DOES_NOT_EXIST") => {}
            Err(e) => return Err(e),
        }
        let reply = self
            .call(
                reqwest::Method::POST,
                "experiments/create",
                Some(json!({"name": name})),
            )
            .await?;
        reply["experiment_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| MlflowError::Call {
                call: "experiments/create".into(),
                why: "the reply names no experiment".into(),
                transient: false,
            })
    }

    /// Creates a run in `experiment`; returns its id.
    pub(crate) async fn create_run(
        &self,
        experiment: &str,
        name: &str,
        memtrack_id: &str,
    ) -> Result<String, MlflowError> {
        let body = json!({
            "experiment_id": experiment,
            "run_name": name,
            "start_time": now_ms(),
            "tags": [
                {"key": "mlflow.runName", "value": name},
                {"key": "mlflow.source.name", "value": "memtrack"},
                {"key": "memtrack.run_id", "value": memtrack_id},
            ],
        });
        let reply = self
            .call(reqwest::Method::POST, "runs/create", Some(body))
            .await?;
        reply["run"]["info"]["run_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| MlflowError::Call {
                call: "runs/create".into(),
                why: "the reply names no run".into(),
                transient: false,
            })
    }

    pub(crate) async fn log_batch(
        &self,
        run_id: &str,
        metrics: &[Metric],
    ) -> Result<(), MlflowError> {
        let body = json!({"run_id": run_id, "metrics": metrics});
        self.call(reqwest::Method::POST, "runs/log-batch", Some(body))
            .await?;
        Ok(())
    }

    /// Ends a run memtrack created: FINISHED, or FAILED.
    pub(crate) async fn end_run(&self, run_id: &str, failed: bool) -> Result<(), MlflowError> {
        let status = if failed { "FAILED" } else { "FINISHED" };
        let body = json!({"run_id": run_id, "status": status, "end_time": now_ms()});
        self.call(reqwest::Method::POST, "runs/update", Some(body))
            .await?;
        Ok(())
    }

    /// The run's artifact folder as the proxy's path (`Ok`), or why the
    /// run's artifacts are not served by the tracking server (`Err`).
    pub(crate) async fn artifact_path(
        &self,
        run_id: &str,
    ) -> Result<Result<String, NotProxied>, MlflowError> {
        let reply = self
            .call(
                reqwest::Method::GET,
                &format!("runs/get?run_id={}", query(run_id)),
                None,
            )
            .await?;
        let uri = reply["run"]["info"]["artifact_uri"]
            .as_str()
            .unwrap_or_default();
        Ok(proxy_path(uri).ok_or_else(|| NotProxied {
            uri: uri.to_string(),
        }))
    }

    pub(crate) async fn put_artifact(
        &self,
        dir: &str,
        name: &str,
        body: Vec<u8>,
    ) -> Result<(), MlflowError> {
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{dir}/{name}",
            self.base
        );
        let failed = |why: String, transient: bool| MlflowError::Call {
            call: format!("artifact upload of {name}"),
            why,
            transient,
        };
        let response = self
            .client
            .put(&url)
            .header(
                "content-type",
                if name.ends_with(".html") {
                    "text/html; charset=utf-8"
                } else {
                    "application/json"
                },
            )
            .body(body)
            .send()
            .await
            .map_err(|e| failed(describe(&e), true))?;
        let status = response.status();
        if !status.is_success() {
            return Err(failed(
                format!("HTTP {status}: {}", error_text(response).await),
                transient_status(status),
            ));
        }
        Ok(())
    }
}

/// The largest reply memtrack reads from the tracking server. Its replies
/// to memtrack's calls are a few KiB (`runs/get` of a run with thousands of
/// parameters and tags stays well below this); a longer one is refused,
/// never held whole, whatever `Content-Length` says or does not say.
pub(crate) const MAX_REPLY: usize = 8 << 20;

/// What is shown of an error reply's body.
const ERROR_TEXT: usize = 500;

/// A reply's body, read chunk by chunk up to `cap` bytes (after
/// decompression); a longer body is an error, and the connection is
/// dropped without reading the rest.
async fn read_capped(mut response: reqwest::Response, cap: usize) -> Result<Vec<u8>, String> {
    let too_long = || format!("the reply is longer than {cap} bytes; memtrack reads no more");
    if response.content_length().is_some_and(|n| n > cap as u64) {
        return Err(too_long());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| describe(&e))? {
        if body.len() + chunk.len() > cap {
            return Err(too_long());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The start of an error reply's body, for the message: at most
/// [`ERROR_TEXT`] bytes are read.
async fn error_text(mut response: reqwest::Response) -> String {
    let mut body = Vec::new();
    while body.len() < ERROR_TEXT {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    body.truncate(ERROR_TEXT);
    String::from_utf8_lossy(&body).into_owned()
}

/// A request error with its causes, and any URL in it without its user
/// information.
fn describe(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    crate::export::s3::aws::redact_userinfo(&text)
}

/// `mlflow-artifacts:/0/abc/artifacts` (or with `//host:port`) → `0/abc/artifacts`.
fn proxy_path(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("mlflow-artifacts:")?;
    let rest = match rest.strip_prefix("//") {
        Some(authority_and_path) => authority_and_path.split_once('/').map_or("", |(_, p)| p),
        None => rest,
    };
    let path = rest.trim_matches('/');
    (!path.is_empty() && !path.split('/').any(|s| s == "..")).then(|| path.to_string())
}

/// `text` percent-encoded for a URL's query (RFC 3986 unreserved kept).
fn query(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Why a run's artifacts are not uploaded: its artifact store is not the
/// tracking server's proxy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the run's artifact store `{uri}` is not the tracking server's proxy (mlflow-artifacts:)")]
pub(crate) struct NotProxied {
    pub(crate) uri: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_paths() {
        assert_eq!(
            proxy_path("mlflow-artifacts:/0/ab/artifacts").as_deref(),
            Some("0/ab/artifacts")
        );
        assert_eq!(
            proxy_path("mlflow-artifacts://127.0.0.1:5000/1/ab/artifacts").as_deref(),
            Some("1/ab/artifacts")
        );
        assert_eq!(proxy_path("s3://bucket/x"), None);
        assert_eq!(proxy_path("mlflow-artifacts:/../x"), None);
    }

    #[test]
    fn query_text_is_percent_encoded() {
        assert_eq!(query("team a/b&c=d"), "team%20a%2Fb%26c%3Dd");
        assert_eq!(query("é"), "%C3%A9");
    }
}
