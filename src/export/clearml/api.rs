//! The ClearML REST client: authentication, the reply envelope, and which
//! failures are worth retrying (docs/clearml.md, "The wire" and "Rules of
//! the server memtrack follows").
//!
//! Every call is a `POST {api}/v2.23/{service}.{action}` with a JSON body
//! (or JSON lines for `events.add_batch`), the worker and client headers,
//! and a bearer token obtained from `auth.login` with the access key and
//! secret (or, in agent container mode, with `CLEARML_AUTH_TOKEN` itself).
//! The token is refreshed shortly before the `exp` of its JWT payload; on a
//! 401 the client logs in once more and repeats the request once. Request
//! bodies are never compressed; replies may be gzip-compressed.
//!
//! [`Api::call_retrying`] retries connection errors, timeouts, 429 and
//! 502/503/504 without limit (the caller bounds it by dropping the future)
//! and other 5xx a few times, with exponential backoff; other 4xx are
//! returned at once. [`Api::call_creating`], for calls that create
//! something, retries only what surely did not reach the server, so that
//! the caller can look for what a timed-out try made before trying again.
//! No message ever contains a credential.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use super::settings::{mask, Credentials, Settings};

/// The API version memtrack pins for every call but `auth.login`.
pub(crate) const API_VERSION: &str = "2.23";

/// Attempts for a 500 (or another 5xx that is no gateway or maintenance
/// reply) before the request is given up.
pub(crate) const SERVER_ERROR_ATTEMPTS: u32 = 6;

/// Bodies of `events.add_batch`.
pub(crate) const JSON_LINES: &str = "application/json-lines";

/// What goes in a request.
#[derive(Debug, Clone)]
pub(crate) enum Body {
    Json(Value),
    /// One JSON object per line.
    Lines(String),
}

/// Why a call failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum CallError {
    /// Worth retrying: connection refused or reset, timeout, 429, 5xx.
    Transient {
        reason: String,
        retry_after: Option<Duration>,
        /// A 500-like application error (retried a few times only).
        server_error: bool,
        /// The request may have reached the server and taken effect (a
        /// timeout, a 504, a 5xx, a lost reply): a call that creates
        /// something must look before it tries again.
        maybe_applied: bool,
    },
    /// The credentials or token were refused, even after a fresh login.
    Auth(String),
    /// The server refused the request; repeating it will not help.
    Rejected {
        status: u16,
        subcode: i64,
        message: String,
        error_data: Value,
    },
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Transient { reason, .. } => write!(f, "{reason}"),
            CallError::Auth(m) => write!(f, "{m}"),
            CallError::Rejected {
                status,
                subcode,
                message,
                error_data,
            } => {
                write!(f, "HTTP {status}/{subcode} {message}")?;
                let empty = error_data.as_object().is_none_or(|o| o.is_empty());
                if !empty {
                    write!(f, " {error_data}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for CallError {}

/// The HTTP client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot build the HTTP client: {}", chain(.0))]
pub(crate) struct ClientError(#[source] reqwest::Error);

/// Why an upload to a fileserver failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PostError {
    /// No bearer token: the login failed.
    #[error(transparent)]
    Login(#[from] CallError),
    #[error("POST {url}: {}", chain(source))]
    Send { url: String, source: reqwest::Error },
    /// The server's answer, its body cut to 200 characters.
    #[error("POST {url}: HTTP {status}: {body}")]
    Refused {
        url: String,
        status: reqwest::StatusCode,
        body: String,
    },
}

#[derive(Debug, Default)]
struct Token {
    value: String,
    /// Refresh at this instant (shortly before `exp`); `None`: only on 401.
    refresh_at: Option<Instant>,
}

/// Tracks an outage to log its start and end once.
#[derive(Debug, Default)]
struct Health {
    failures: u64,
    since: Option<Instant>,
    /// The latest transient failure (cleared when the server answers).
    last: Option<String>,
}

/// A cheap-to-clone client; clones share the token.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    client: reqwest::Client,
    host: String,
    worker: String,
    credentials: Credentials,
    credentials_source: String,
    token: Arc<tokio::sync::Mutex<Token>>,
    health: Arc<std::sync::Mutex<Health>>,
    logins: Arc<AtomicU64>,
    /// Failed requests (memtrack_export_errors_total{exporter="clearml"}).
    pub(crate) errors: Arc<AtomicU64>,
    backoff_min: Duration,
    backoff_max: Duration,
}

/// The `X-ClearML-Client` value.
pub(crate) fn client_header() -> String {
    format!("memtrack-{}", env!("CARGO_PKG_VERSION"))
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An error and its causes on one line ("error sending request: … :
/// connection refused").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = s.source();
    }
    out
}

impl Api {
    pub(crate) fn new(settings: &Settings, errors: Arc<AtomicU64>) -> Result<Api, ClientError> {
        let client = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .connect_timeout(settings.request_timeout.min(Duration::from_secs(10)))
            .danger_accept_invalid_certs(!settings.verify_certificate)
            .pool_max_idle_per_host(2)
            .user_agent(client_header())
            .build()
            .map_err(ClientError)?;
        Ok(Api {
            client,
            host: settings.api_host.clone(),
            worker: settings.worker.clone(),
            credentials: settings.credentials.clone(),
            credentials_source: settings.credentials_source.clone(),
            token: Arc::new(tokio::sync::Mutex::new(Token::default())),
            health: Arc::new(std::sync::Mutex::new(Health::default())),
            logins: Arc::new(AtomicU64::new(0)),
            errors,
            backoff_min: settings.backoff_min,
            backoff_max: settings.backoff_max.max(settings.backoff_min),
        })
    }

    /// The first and the longest wait between tries.
    pub(crate) fn backoff(&self) -> (Duration, Duration) {
        (self.backoff_min, self.backoff_max)
    }

    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// The failure of the outage in progress, if any.
    pub(crate) fn last_error(&self) -> Option<String> {
        lock(&self.health).last.clone()
    }

    fn url(&self, endpoint: &str) -> String {
        if endpoint == "auth.login" {
            format!("{}/auth.login", self.host)
        } else {
            format!("{}/v{API_VERSION}/{endpoint}", self.host)
        }
    }

    /// One HTTP exchange, classified.
    async fn exchange(
        &self,
        endpoint: &str,
        body: &Body,
        authorization: &str,
    ) -> Result<Value, (CallError, bool)> {
        let mut req = self
            .client
            .post(self.url(endpoint))
            .header("X-ClearML-Worker", &self.worker)
            .header("X-ClearML-Client", client_header())
            .header(reqwest::header::AUTHORIZATION, authorization);
        req = match body {
            Body::Json(v) => req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(v.to_string()),
            Body::Lines(s) => req
                .header(reqwest::header::CONTENT_TYPE, JSON_LINES)
                .body(s.clone()),
        };
        let resp = req.send().await.map_err(|e| {
            let what = if e.is_timeout() {
                "timed out"
            } else if e.is_connect() {
                "cannot connect"
            } else {
                "request failed"
            };
            (
                CallError::Transient {
                    reason: format!("{endpoint}: {what}: {}", chain(&e)),
                    retry_after: None,
                    server_error: false,
                    maybe_applied: !e.is_connect(),
                },
                false,
            )
        })?;
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = resp.bytes().await.map_err(|e| {
            (
                CallError::Transient {
                    reason: format!("{endpoint}: reading the reply failed: {}", chain(&e)),
                    retry_after: None,
                    server_error: false,
                    maybe_applied: true,
                },
                false,
            )
        })?;
        let envelope: Option<Value> = serde_json::from_slice(&bytes).ok();
        let meta = envelope.as_ref().and_then(|v| v.get("meta"));
        let subcode = meta
            .and_then(|m| m.get("result_subcode"))
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let message = meta
            .and_then(|m| m.get("result_msg"))
            .and_then(Value::as_str)
            .map_or_else(
                || {
                    format!(
                        "HTTP {status} {}",
                        reqwest::StatusCode::from_u16(status)
                            .ok()
                            .and_then(|s| s.canonical_reason())
                            .unwrap_or("")
                    )
                },
                str::to_string,
            );
        match status {
            200..=299 => match envelope {
                Some(mut v) => Ok(v.get_mut("data").map(Value::take).unwrap_or(Value::Null)),
                None => Err((
                    CallError::Transient {
                        reason: format!("{endpoint}: HTTP {status} without a ClearML reply"),
                        retry_after: None,
                        server_error: true,
                        maybe_applied: true,
                    },
                    false,
                )),
            },
            401 => Err((
                CallError::Auth(format!("{endpoint}: HTTP 401/{subcode} {message}")),
                true,
            )),
            408 | 425 | 429 | 502 | 503 | 504 => Err((
                CallError::Transient {
                    reason: format!("{endpoint}: HTTP {status} {message}"),
                    retry_after,
                    server_error: false,
                    // A gateway that timed out may have passed the request on.
                    maybe_applied: matches!(status, 408 | 504),
                },
                false,
            )),
            500..=599 => Err((
                CallError::Transient {
                    reason: format!("{endpoint}: HTTP {status}/{subcode} {message}"),
                    retry_after,
                    server_error: true,
                    maybe_applied: true,
                },
                false,
            )),
            _ => Err((
                CallError::Rejected {
                    status,
                    subcode,
                    message,
                    error_data: meta
                        .and_then(|m| m.get("error_data"))
                        .cloned()
                        .unwrap_or(Value::Null),
                },
                false,
            )),
        }
    }

    /// Logs in (or refreshes a bearer token) and stores the new token.
    async fn login(&self, token: &mut Token) -> Result<(), CallError> {
        let authorization = match &self.credentials {
            Credentials::Keys {
                access_key,
                secret_key,
            } => format!(
                "Basic {}",
                base64_encode(format!("{access_key}:{secret_key}").as_bytes())
            ),
            Credentials::Token(initial) => {
                let current = if token.value.is_empty() {
                    initial
                } else {
                    &token.value
                };
                format!("Bearer {current}")
            }
        };
        let data = match self
            .exchange(
                "auth.login",
                &Body::Json(serde_json::json!({})),
                &authorization,
            )
            .await
        {
            Ok(d) => d,
            Err((CallError::Auth(m), _)) => {
                let access = match &self.credentials {
                    Credentials::Keys { access_key, .. } => {
                        format!(", access key {}", mask(access_key))
                    }
                    Credentials::Token(_) => String::new(),
                };
                return Err(CallError::Auth(format!(
                    "the ClearML server {} refused the credentials from {}{access} ({m})",
                    self.host, self.credentials_source
                )));
            }
            Err((e, _)) => return Err(e),
        };
        let Some(new) = data.get("token").and_then(Value::as_str) else {
            return Err(CallError::Transient {
                reason: "auth.login: the reply has no token".into(),
                retry_after: None,
                server_error: true,
                maybe_applied: false,
            });
        };
        token.value = new.to_string();
        token.refresh_at = jwt_exp(new).map(|exp| refresh_instant(exp, unix_now()));
        self.logins.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// POSTs `body` to `url` (a ClearML fileserver) with the API server's
    /// bearer token, as the SDK authenticates its uploads there. `Err`: why
    /// it failed, in words.
    pub(crate) async fn post_upload(
        &self,
        url: &str,
        content_type: &str,
        body: Vec<u8>,
    ) -> Result<(), PostError> {
        let token = self.bearer().await?;
        let resp = self
            .client
            .post(url)
            .header(reqwest::header::AUTHORIZATION, format!("Bearer {token}"))
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .header("X-ClearML-Client", client_header())
            .body(body)
            .send()
            .await
            .map_err(|source| PostError::Send {
                url: url.to_string(),
                source,
            })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let text = resp.text().await.unwrap_or_default();
        let text: String = text.chars().take(200).collect();
        Err(PostError::Refused {
            url: url.to_string(),
            status,
            body: text.trim().to_string(),
        })
    }

    /// The current bearer token, logging in first when there is none or it
    /// is about to expire.
    async fn bearer(&self) -> Result<String, CallError> {
        let mut token = self.token.lock().await;
        let stale = token.refresh_at.is_some_and(|t| Instant::now() >= t);
        if token.value.is_empty() {
            match &self.credentials {
                Credentials::Token(t) => {
                    token.value = t.clone();
                    token.refresh_at = jwt_exp(t).map(|exp| refresh_instant(exp, unix_now()));
                    if token.refresh_at.is_some_and(|t| Instant::now() >= t) {
                        self.login(&mut token).await?;
                    }
                }
                Credentials::Keys { .. } => self.login(&mut token).await?,
            }
        } else if stale {
            self.login(&mut token).await?;
        }
        Ok(token.value.clone())
    }

    /// Whether the token should be refreshed now (without waiting for the
    /// lock: a busy token is being used or refreshed already).
    pub(crate) fn refresh_due(&self) -> bool {
        self.token.try_lock().is_ok_and(|t| {
            !t.value.is_empty() && t.refresh_at.is_some_and(|at| Instant::now() >= at)
        })
    }

    /// Refreshes the token ahead of its expiry. A bearer-only token cannot
    /// be renewed once expired, so this must not wait for the next request.
    pub(crate) async fn refresh(&self) -> Result<(), CallError> {
        let mut delay = self.backoff_min;
        loop {
            let result = {
                let mut token = self.token.lock().await;
                if token.refresh_at.is_some_and(|at| Instant::now() < at) {
                    return Ok(());
                }
                self.login(&mut token).await
            };
            match result {
                Ok(()) => {
                    self.recovered();
                    return Ok(());
                }
                Err(CallError::Transient { reason, .. }) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    self.failed(&reason);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(self.backoff_max);
                }
                Err(e) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
    }

    /// One attempt, with the single re-login on a 401.
    pub(crate) async fn call(&self, endpoint: &str, body: &Body) -> Result<Value, CallError> {
        let first = self.bearer().await?;
        match self
            .exchange(endpoint, body, &format!("Bearer {first}"))
            .await
        {
            Ok(v) => Ok(v),
            Err((_, true)) => {
                // A 401: log in again once (unless another call already
                // did) and repeat the request once.
                let fresh = {
                    let mut token = self.token.lock().await;
                    if token.value == first {
                        self.login(&mut token).await?;
                    }
                    token.value.clone()
                };
                match self
                    .exchange(endpoint, body, &format!("Bearer {fresh}"))
                    .await
                {
                    Ok(v) => Ok(v),
                    Err((CallError::Auth(m), _)) => Err(CallError::Auth(format!(
                        "the ClearML server {} refused a fresh token ({m})",
                        self.host
                    ))),
                    Err((e, _)) => Err(e),
                }
            }
            Err((e, false)) => Err(e),
        }
    }

    /// [`Api::call`] with retries: transient failures are retried with
    /// exponential backoff (without limit, except 500-like replies), the
    /// rest returned. Logs the start and the end of an outage once.
    pub(crate) async fn call_retrying(
        &self,
        endpoint: &str,
        body: &Body,
    ) -> Result<Value, CallError> {
        self.retrying(endpoint, body, false).await
    }

    /// [`Api::call_retrying`] for a call that creates something
    /// (`tasks.create`, `projects.create`): only failures that surely did
    /// not reach the server (no connection, 429, 502, 503) are retried
    /// here. A timeout, a 504 or a 5xx is returned at once, so that the
    /// caller looks for what the call may have created before trying again
    /// (as the SDK does; a blind retry makes duplicates).
    pub(crate) async fn call_creating(
        &self,
        endpoint: &str,
        body: &Body,
    ) -> Result<Value, CallError> {
        self.retrying(endpoint, body, true).await
    }

    async fn retrying(
        &self,
        endpoint: &str,
        body: &Body,
        creating: bool,
    ) -> Result<Value, CallError> {
        let mut delay = self.backoff_min;
        let mut server_errors = 0u32;
        loop {
            match self.call(endpoint, body).await {
                Ok(v) => {
                    self.recovered();
                    return Ok(v);
                }
                Err(CallError::Transient {
                    reason,
                    retry_after,
                    server_error,
                    maybe_applied,
                }) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    self.failed(&reason);
                    if creating && maybe_applied {
                        return Err(CallError::Transient {
                            reason,
                            retry_after,
                            server_error,
                            maybe_applied,
                        });
                    }
                    if server_error {
                        server_errors += 1;
                        if server_errors >= SERVER_ERROR_ATTEMPTS {
                            return Err(CallError::Transient {
                                reason: format!(
                                    "{reason} (gave up after {server_errors} attempts)"
                                ),
                                retry_after,
                                server_error,
                                maybe_applied,
                            });
                        }
                    }
                    let wait = retry_after
                        .map_or(delay, |r| r.max(self.backoff_min))
                        .min(self.backoff_max);
                    tokio::time::sleep(wait).await;
                    delay = (delay * 2).min(self.backoff_max);
                }
                Err(e) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    self.recovered();
                    return Err(e);
                }
            }
        }
    }

    fn failed(&self, reason: &str) {
        let mut h = lock(&self.health);
        h.failures += 1;
        h.last = Some(reason.to_string());
        if h.since.is_none() {
            h.since = Some(Instant::now());
            tracing::warn!(
                "ClearML server {} is not answering ({reason}); memtrack keeps the points and \
                 retries with backoff (up to {:?} apart)",
                self.host,
                self.backoff_max
            );
        } else {
            tracing::debug!("ClearML: attempt {} failed: {reason}", h.failures);
        }
    }

    fn recovered(&self) {
        let mut h = lock(&self.health);
        h.last = None;
        if let Some(since) = h.since.take() {
            tracing::info!(
                "ClearML server {} answers again after {:.1} s and {} failed attempts",
                self.host,
                since.elapsed().as_secs_f64(),
                h.failures
            );
            h.failures = 0;
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// When to refresh a token expiring at `exp` (Unix seconds): a tenth of its
/// remaining life early, at most 5 minutes, at least 1 second.
fn refresh_instant(exp: f64, now: f64) -> Instant {
    let left = (exp - now).max(0.0);
    let margin = (left / 10.0).clamp(1.0_f64.min(left), 300.0);
    Instant::now() + Duration::from_secs_f64((left - margin).max(0.0))
}

/// The `exp` claim of a JWT, read without checking the signature.
pub(crate) fn jwt_exp(token: &str) -> Option<f64> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64_decode(payload)?;
    let v: Value = serde_json::from_slice(&bytes).ok()?;
    v.get("exp").and_then(Value::as_f64)
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (for `Authorization: Basic`).
pub(crate) fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(B64[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Base64, standard or URL-safe, padding optional (JWT segments).
pub(crate) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for c in text.trim_end_matches('=').bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(((acc >> bits) & 0xff) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for (plain, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            (
                "memtrack-test-key:memtrack-test-secret",
                "bWVtdHJhY2stdGVzdC1rZXk6bWVtdHJhY2stdGVzdC1zZWNyZXQ=",
            ),
        ] {
            assert_eq!(base64_encode(plain.as_bytes()), enc);
            assert_eq!(base64_decode(enc).unwrap(), plain.as_bytes());
        }
        assert_eq!(base64_decode("-_8").unwrap(), vec![0xfb, 0xff]);
        assert!(base64_decode("a b").is_none());
    }

    #[test]
    fn reads_the_exp_claim() {
        // {"alg":"HS256","typ":"JWT"} . {"exp":1733000000,"iat":1}
        let header = base64_encode(br#"{"alg":"HS256","typ":"JWT"}"#);
        let payload = base64_encode(br#"{"exp":1733000000,"iat":1}"#)
            .trim_end_matches('=')
            .replace('+', "-")
            .replace('/', "_");
        let token = format!("{header}.{payload}.sig");
        assert_eq!(jwt_exp(&token), Some(1_733_000_000.0));
        assert_eq!(jwt_exp("not-a-jwt"), None);
    }

    #[test]
    fn refresh_comes_before_expiry() {
        let now = 1000.0;
        let at = refresh_instant(now + 3600.0, now);
        let d = at.duration_since(Instant::now());
        assert!(
            d > Duration::from_secs(3200) && d < Duration::from_secs(3300),
            "{d:?}"
        );
        let soon = refresh_instant(now + 2.0, now).duration_since(Instant::now());
        assert!(soon <= Duration::from_secs(1), "{soon:?}");
        assert!(refresh_instant(now - 5.0, now) <= Instant::now());
    }

    #[test]
    fn rejected_errors_read_well() {
        let e = CallError::Rejected {
            status: 400,
            subcode: 131,
            message: "Events not added".into(),
            error_data: serde_json::json!({"Invalid task id x": 3}),
        };
        assert_eq!(
            e.to_string(),
            r#"HTTP 400/131 Events not added {"Invalid task id x":3}"#
        );
    }
}
