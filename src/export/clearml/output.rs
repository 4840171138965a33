//! Where the job's task keeps its artifacts, as the ClearML SDK decides it:
//! the task's `output.destination` (`Task.init(output_uri=...)`), else
//! `sdk.development.default_output_uri` of `clearml.conf`, else the ClearML
//! fileserver. An `s3://` destination takes its credentials, region and
//! (for MinIO and other S3-compatible stores) endpoint from the
//! `sdk.aws.s3` section of `clearml.conf`, matched as the SDK matches them
//! (`clearml/storage/helper.py`, `S3BucketConfigurations`): an entry of
//! `credentials` with a `host` serves `s3://<host>/<bucket>/…`, one with
//! only a `bucket` serves `s3://<bucket>/…`, and the section's own
//! `key`/`secret`/`region` serve the rest. Pure: reading the file is the
//! caller's, and nothing here ever shows a key or a secret.

use std::fmt;

use super::hocon::{ConfTree, ParseError, Value};

/// Entries of `sdk.aws.s3.credentials` read at most (the file is at most
/// 1 MiB anyway).
const MAX_ENTRIES: usize = 256;

/// What `clearml.conf` says about where artifacts go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct OutputConf {
    /// `sdk.development.default_output_uri` (empty: not set).
    pub(crate) default_uri: String,
    /// `sdk.aws.s3`.
    pub(crate) s3: ConfS3,
    /// The file these came from, for messages.
    pub(crate) file: String,
    /// Why the file's output settings could not be read: an `s3://`
    /// destination then fails with this reason.
    pub(crate) problem: Option<ConfProblem>,
}

/// Why `clearml.conf`'s output settings are not used. Comparable, as the
/// settings that carry it are; every `s3://` destination it spoils says it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ConfProblem {
    /// The file did not read or parse: the reader's message, and the kind
    /// of the I/O failure behind it (`None`: too large or malformed).
    #[error("{message}")]
    Unread {
        message: String,
        kind: Option<std::io::ErrorKind>,
    },
    /// The file read, but its output settings are wrong.
    #[error(transparent)]
    Settings(#[from] OutputConfError),
}

/// The `sdk.aws.s3` section.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ConfS3 {
    pub(crate) keys: Option<Keys>,
    pub(crate) region: String,
    pub(crate) entries: Vec<BucketConf>,
}

/// One entry of `sdk.aws.s3.credentials`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BucketConf {
    pub(crate) bucket: String,
    /// `host[:port]` of an S3-compatible store; empty: AWS.
    pub(crate) host: String,
    pub(crate) keys: Option<Keys>,
    pub(crate) region: String,
    /// `https` (the SDK's default) or `http`.
    pub(crate) secure: bool,
}

/// An access key and its secret; shown masked.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    pub(crate) key: String,
    pub(crate) secret: String,
}

impl fmt::Debug for Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Keys { key: ***, secret: *** }")
    }
}

/// The destination the document goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Destination {
    /// An S3 bucket (AWS or an S3-compatible store).
    S3(S3Destination),
    /// A ClearML fileserver (or any http(s) store that takes its uploads).
    Files(String),
}

/// An `s3://` destination resolved against `sdk.aws.s3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct S3Destination {
    /// `s3://bucket/prefix`, as memtrack's S3 uploader takes it.
    pub(crate) url: String,
    /// `http(s)://host[:port]` of an S3-compatible store (`None`: AWS, or
    /// the AWS settings' own endpoint).
    pub(crate) endpoint: Option<String>,
    /// `host[:port]` when the destination names it: the artifact's URI
    /// is then `s3://host[:port]/bucket/key`, as the SDK writes it.
    pub(crate) host: Option<String>,
    /// Empty: the AWS chain's.
    pub(crate) region: String,
    /// From `sdk.aws.s3`, used when the AWS environment and profile give
    /// none.
    pub(crate) keys: Option<Keys>,
    /// Where `keys` come from, for messages (never the keys).
    pub(crate) keys_source: String,
}

/// Where the destination came from, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chosen {
    pub(crate) uri: String,
    pub(crate) source: String,
}

/// The destination for the job's task: its own `output.destination`, else
/// the file's `default_output_uri`, else the fileserver (`None`: none).
pub(crate) fn choose(task_uri: &str, conf: &OutputConf, files_host: &str) -> Option<Chosen> {
    let task_uri = task_uri.trim();
    if !task_uri.is_empty() {
        return Some(Chosen {
            uri: task_uri.to_string(),
            source: "the task's output_uri".into(),
        });
    }
    if !conf.default_uri.trim().is_empty() {
        return Some(Chosen {
            uri: conf.default_uri.trim().to_string(),
            source: format!("sdk.development.default_output_uri in {}", conf.file),
        });
    }
    (!files_host.trim().is_empty()).then(|| Chosen {
        uri: files_host.trim().to_string(),
        source: "the ClearML fileserver".into(),
    })
}

/// `chosen` as an upload destination; `Err` says why it cannot be used
/// (an unsupported scheme, a malformed URL), never with a secret.
pub(crate) fn destination(
    chosen: &Chosen,
    conf: &OutputConf,
) -> Result<Destination, DestinationError> {
    let uri = chosen.uri.trim_end_matches('/');
    let lower = uri.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Ok(Destination::Files(uri.to_string()));
    }
    if lower.starts_with("s3://") {
        if let Some(problem) = &conf.problem {
            return Err(DestinationError::Unusable {
                chosen: chosen.source.clone(),
                uri: shown(uri),
                problem: problem.clone(),
            });
        }
        return s3_target(uri, conf).map(Destination::S3);
    }
    Err(DestinationError::Unsupported {
        chosen: chosen.source.clone(),
        uri: shown(uri),
    })
}

/// Why the chosen destination cannot take the document. URLs are shown
/// with [`shown`]: never a secret.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DestinationError {
    /// `clearml.conf`'s S3 settings could not be read (`problem`).
    #[error("{chosen} `{uri}`: {problem}")]
    Unusable {
        chosen: String,
        uri: String,
        problem: ConfProblem,
    },
    #[error(
        "{chosen} `{uri}` is not an s3:// or http(s):// URL; memtrack uploads only to S3 and \
         ClearML fileservers"
    )]
    Unsupported { chosen: String, uri: String },
    #[error("`{uri}` names the S3 host {host} but no bucket (s3://host:port/bucket/prefix)")]
    NoBucket { uri: String, host: String },
}

/// Why `clearml.conf`'s artifact settings cannot be used: the entry at
/// fault is named, never its keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum OutputConfError {
    #[error("malformed ClearML config file {file}, {source}")]
    Malformed { file: String, source: ParseError },
    #[error("{file}: sdk.development.default_output_uri holds control characters")]
    ControlInUri { file: String },
    #[error("{section}: credentials holds {count} entries; at most {MAX_ENTRIES} are read")]
    TooMany { section: String, count: usize },
    #[error("{section}: credentials is not a list")]
    NotAList { section: String },
    #[error("{what} is not an object")]
    NotAnObject { what: String },
    #[error("{what}: `{field}` is not a string")]
    NotAString { what: String, field: String },
    #[error("{what}: `bucket` is not a bucket name")]
    BadBucket { what: String },
    #[error("{what}: `host` is not host[:port] (no scheme, user, path or space)")]
    BadHost { what: String },
    #[error("{what}: `secure` is neither true nor false")]
    BadSecure { what: String },
    #[error("{what}: the key or secret holds control characters")]
    ControlInKeys { what: String },
    #[error("{what}: `key` is set but `secret` is not")]
    KeyWithoutSecret { what: String },
    #[error("{what}: `secret` is set but `key` is not")]
    SecretWithoutKey { what: String },
    #[error("{what}: `region` is not a region name")]
    BadRegion { what: String },
}

/// `s3://…` resolved as the SDK resolves it: the longest matching entry of
/// `sdk.aws.s3.credentials` (a `host` entry matches `s3://host/bucket`, a
/// bucket entry `s3://bucket`), else the section's own keys and region.
pub(crate) fn s3_target(uri: &str, conf: &OutputConf) -> Result<S3Destination, DestinationError> {
    let rest = &uri["s3://".len()..];
    let (netloc, path) = rest.split_once('/').unwrap_or((rest, ""));
    let lower = uri.to_ascii_lowercase();
    let matched = conf
        .s3
        .entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let prefix = if e.host.is_empty() {
                format!("s3://{}", e.bucket.to_ascii_lowercase())
            } else if e.bucket.is_empty() {
                format!("s3://{}", e.host.to_ascii_lowercase())
            } else {
                format!(
                    "s3://{}/{}",
                    e.host.to_ascii_lowercase(),
                    e.bucket.to_ascii_lowercase()
                )
            };
            let at_boundary =
                lower.len() == prefix.len() || lower.as_bytes().get(prefix.len()) == Some(&b'/');
            (!e.bucket.is_empty() || !e.host.is_empty())
                .then_some(())
                .filter(|_| lower.starts_with(&prefix) && at_boundary)
                .map(|_| (i, e, prefix.len()))
        })
        .max_by_key(|(_, _, len)| *len);
    let section = format!("sdk.aws.s3 in {}", conf.file);
    let Some((i, entry, _)) = matched else {
        return Ok(S3Destination {
            url: uri.to_string(),
            endpoint: None,
            host: None,
            region: conf.s3.region.clone(),
            keys: conf.s3.keys.clone(),
            keys_source: format!("key/secret of {section}"),
        });
    };
    let keys_source = format!("credentials entry {} of {section}", i + 1);
    let region = if entry.region.is_empty() {
        conf.s3.region.clone()
    } else {
        entry.region.clone()
    };
    if entry.host.is_empty() {
        return Ok(S3Destination {
            url: uri.to_string(),
            endpoint: None,
            host: None,
            region,
            keys: entry.keys.clone(),
            keys_source,
        });
    }
    // `s3://host:port/bucket/prefix`: the bucket is the path's first part.
    let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
    if bucket.is_empty() {
        return Err(DestinationError::NoBucket {
            uri: shown(uri),
            host: shown(netloc),
        });
    }
    let scheme = if entry.secure { "https" } else { "http" };
    Ok(S3Destination {
        url: if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        },
        endpoint: Some(format!("{scheme}://{netloc}")),
        host: Some(netloc.to_string()),
        region,
        keys: entry.keys.clone(),
        keys_source,
    })
}

/// Reads `sdk.development.default_output_uri` and `sdk.aws.s3` from a
/// parsed `clearml.conf` (`file` names it in messages). A value that is no
/// string, an entry that is no object, a key without its secret, a host
/// that is not `host[:port]`, a region that is no region: an error naming
/// the entry, never its keys.
pub(crate) fn read(
    doc: &ConfTree,
    env: &dyn Fn(&str) -> Option<String>,
    file: &str,
) -> Result<OutputConf, OutputConfError> {
    let bad = |source: ParseError| OutputConfError::Malformed {
        file: file.to_string(),
        source,
    };
    let get = |key: &str| -> Result<String, OutputConfError> {
        Ok(doc
            .get_str(key, env)
            .map_err(bad)?
            .map(|s| s.trim().to_string())
            .unwrap_or_default())
    };
    let default_uri = get("sdk.development.default_output_uri")?;
    if default_uri.chars().any(char::is_control) {
        return Err(OutputConfError::ControlInUri {
            file: file.to_string(),
        });
    }
    let section = format!("sdk.aws.s3 in {file}");
    let keys = keys(get("sdk.aws.s3.key")?, get("sdk.aws.s3.secret")?, &section)?;
    let region = region(get("sdk.aws.s3.region")?, &section)?;
    let mut entries = Vec::new();
    match doc.get("sdk.aws.s3.credentials") {
        None => {}
        Some(Value::List(list)) => {
            if list.len() > MAX_ENTRIES {
                return Err(OutputConfError::TooMany {
                    section,
                    count: list.len(),
                });
            }
            for (i, item) in list.iter().enumerate() {
                let what = format!("credentials entry {} of {section}", i + 1);
                entries.push(entry(doc, item, env, &what).map_err(|e| match e {
                    Bad::Parse(p) => bad(p),
                    Bad::Said(e) => e,
                })?);
            }
        }
        Some(_) => return Err(OutputConfError::NotAList { section }),
    }
    Ok(OutputConf {
        default_uri,
        s3: ConfS3 {
            keys,
            region,
            entries,
        },
        file: file.to_string(),
        problem: None,
    })
}

enum Bad {
    Parse(ParseError),
    Said(OutputConfError),
}

fn entry(
    doc: &ConfTree,
    item: &Value,
    env: &dyn Fn(&str) -> Option<String>,
    what: &str,
) -> Result<BucketConf, Bad> {
    let Value::Object(map) = item else {
        return Err(Bad::Said(OutputConfError::NotAnObject {
            what: what.to_string(),
        }));
    };
    let field = |name: &str| -> Result<String, Bad> {
        match map.get(name) {
            None => Ok(String::new()),
            Some(v @ Value::Scalar { .. }) => Ok(doc
                .str_of(v, env)
                .map_err(Bad::Parse)?
                .map(|s| s.trim().to_string())
                .unwrap_or_default()),
            Some(_) => Err(Bad::Said(OutputConfError::NotAString {
                what: what.to_string(),
                field: name.to_string(),
            })),
        }
    };
    let bucket = field("bucket")?;
    if bucket.len() > 255 || bucket.chars().any(|c| c.is_control() || c == '/') {
        return Err(Bad::Said(OutputConfError::BadBucket {
            what: what.to_string(),
        }));
    }
    let host = field("host")?;
    if !host_ok(&host) {
        return Err(Bad::Said(OutputConfError::BadHost {
            what: what.to_string(),
        }));
    }
    let secure = match field("secure")?.to_ascii_lowercase().as_str() {
        "" | "true" | "yes" | "on" | "1" => true,
        "false" | "no" | "off" | "0" => false,
        _ => {
            return Err(Bad::Said(OutputConfError::BadSecure {
                what: what.to_string(),
            }))
        }
    };
    Ok(BucketConf {
        keys: keys(field("key")?, field("secret")?, what).map_err(Bad::Said)?,
        region: region(field("region")?, what).map_err(Bad::Said)?,
        bucket,
        host,
        secure,
    })
}

/// Both or neither; an empty pair is none (`clearml-init` writes `key: ""`).
fn keys(key: String, secret: String, what: &str) -> Result<Option<Keys>, OutputConfError> {
    let what = what.to_string();
    match (key.is_empty(), secret.is_empty()) {
        (true, true) => Ok(None),
        (false, false) => {
            if key.chars().chain(secret.chars()).any(char::is_control) {
                return Err(OutputConfError::ControlInKeys { what });
            }
            Ok(Some(Keys { key, secret }))
        }
        (false, true) => Err(OutputConfError::KeyWithoutSecret { what }),
        (true, false) => Err(OutputConfError::SecretWithoutKey { what }),
    }
}

fn region(region: String, what: &str) -> Result<String, OutputConfError> {
    let ok = region.len() <= 64
        && region
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(region)
    } else {
        Err(OutputConfError::BadRegion {
            what: what.to_string(),
        })
    }
}

/// A URL with its user part (which may hold a password) masked.
pub(crate) fn redact_userinfo(text: &str) -> String {
    match text.split_once("://") {
        Some((scheme, rest)) => {
            let host_end = rest.find('/').unwrap_or(rest.len());
            match rest[..host_end].rfind('@') {
                Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
                None => text.to_string(),
            }
        }
        None => text.to_string(),
    }
}

/// `host[:port]`, nothing else (no scheme, user, path or space); empty
/// is fine (no host).
fn host_ok(host: &str) -> bool {
    if host.is_empty() {
        return true;
    }
    let (name, port) = match host.rsplit_once(':') {
        Some((n, p)) if !n.contains(']') || n.ends_with(']') => (n, Some(p)),
        _ => (host, None),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '[' | ']' | ':'));
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
    // The host is not shown in the error: a user part may hold a password.
    name_ok && port_ok
}

/// A value for a message: at most 80 characters, control characters
/// escaped, a URL's user part (which may hold a password) masked. A task's
/// `output_uri` comes from the server: shown only this way.
pub(crate) fn shown(text: &str) -> String {
    let text = redact_userinfo(text);
    let cut: String = text.chars().take(80).collect();
    let escaped: String = cut.escape_debug().collect();
    if text.chars().count() > 80 {
        format!("{escaped}…")
    } else {
        escaped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(text: &str) -> Result<OutputConf, String> {
        let doc = super::super::hocon::parse(text).unwrap();
        read(
            &doc,
            &|v| (v == "MINIO_SECRET").then(|| "from-env".into()),
            "c.conf",
        )
        .map_err(|e| e.to_string())
    }

    const SDK: &str = r#"
sdk {
  development { default_output_uri: "s3://minio.local:9000/models/out" }
  aws {
    s3 {
      key: "GLOBALKEY"
      secret: "GLOBALSECRET"
      region: "eu-west-1"
      credentials: [
        { bucket: "team-bucket", key: "TEAMKEY", secret: "TEAMSECRET", region: "us-west-2" },
        { host: "minio.local:9000", key: "MINIOKEY", secret: ${MINIO_SECRET}, multipart: false, secure: false },
        { host: "minio.local:9000", bucket: "models", key: "MODELSKEY", secret: "MODELSSECRET", secure: true }
      ]
    }
  }
}
"#;

    #[test]
    fn destinations_follow_the_sdks_precedence() {
        let c = conf(SDK).unwrap();
        assert_eq!(c.default_uri, "s3://minio.local:9000/models/out");
        let task = choose("s3://team-bucket/x", &c, "http://files").unwrap();
        assert_eq!(task.source, "the task's output_uri");
        let dflt = choose("", &c, "http://files").unwrap();
        assert!(
            dflt.source.contains("default_output_uri"),
            "{}",
            dflt.source
        );
        let files = choose("", &OutputConf::default(), "http://files:8081").unwrap();
        assert_eq!(
            destination(&files, &c).unwrap(),
            Destination::Files("http://files:8081".into())
        );
        assert_eq!(choose(" ", &OutputConf::default(), ""), None);
        let gs = Chosen {
            uri: "gs://bucket/x".into(),
            source: "the task's output_uri".into(),
        };
        assert!(destination(&gs, &c)
            .unwrap_err()
            .to_string()
            .contains("gs://bucket/x"));
        let userinfo = Chosen {
            uri: "gs://me:PASSWORD@bucket/x".into(),
            source: "the task's output_uri".into(),
        };
        let e = destination(&userinfo, &c).unwrap_err().to_string();
        assert!(
            e.contains("gs://***@bucket/x") && !e.contains("PASSWORD"),
            "{e}"
        );
    }

    #[test]
    fn s3_credentials_match_as_in_the_sdk() {
        let c = conf(SDK).unwrap();
        // A bucket entry.
        let t = s3_target("s3://team-bucket/runs", &c).unwrap();
        assert_eq!(t.url, "s3://team-bucket/runs");
        assert_eq!(t.endpoint, None);
        assert_eq!(t.region, "us-west-2");
        assert_eq!(t.keys.as_ref().unwrap().key, "TEAMKEY");
        // A host entry: the bucket is the path's first part; the longest
        // match wins; `secure` picks the scheme.
        let t = s3_target("s3://minio.local:9000/models/out", &c).unwrap();
        assert_eq!(t.url, "s3://models/out");
        assert_eq!(t.endpoint.as_deref(), Some("https://minio.local:9000"));
        assert_eq!(t.host.as_deref(), Some("minio.local:9000"));
        assert_eq!(t.keys.as_ref().unwrap().key, "MODELSKEY");
        let t = s3_target("s3://minio.local:9000/other", &c).unwrap();
        assert_eq!(t.endpoint.as_deref(), Some("http://minio.local:9000"));
        assert_eq!(t.keys.as_ref().unwrap().secret, "from-env");
        assert_eq!(t.region, "eu-west-1", "the section's region");
        // `models2` is another bucket, not the `models` entry's.
        let t = s3_target("s3://minio.local:9000/models2", &c).unwrap();
        assert_eq!(t.keys.as_ref().unwrap().key, "MINIOKEY");
        // No entry: the section's own keys.
        let t = s3_target("s3://elsewhere/p", &c).unwrap();
        assert_eq!(t.keys.as_ref().unwrap().key, "GLOBALKEY");
        assert!(t.keys_source.contains("key/secret"), "{}", t.keys_source);
        assert!(s3_target("s3://minio.local:9000", &c).is_err());
        // Keys never show.
        let shown = format!("{c:?}{t:?}");
        for secret in ["GLOBALSECRET", "TEAMSECRET", "from-env", "MODELSSECRET"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }

    #[test]
    fn hostile_sdk_aws_s3_values_are_named_never_shown() {
        for (text, says) in [
            ("sdk.aws.s3.credentials: \"x\"", "not a list"),
            ("sdk.aws.s3.credentials: [ \"x\" ]", "not an object"),
            (
                "sdk.aws.s3.credentials: [ { host: { a: b } } ]",
                "`host` is not a string",
            ),
            (
                "sdk.aws.s3.credentials: [ { host: \"me:TOPSECRET@h/x\", key: K1, secret: S1 } ]",
                "not host[:port]",
            ),
            (
                "sdk.aws.s3.credentials: [ { host: \"h:99999\" } ]",
                "not host[:port]",
            ),
            (
                "sdk.aws.s3.credentials: [ { bucket: b, key: ONLYKEY } ]",
                "`secret` is not",
            ),
            (
                "sdk.aws.s3.credentials: [ { bucket: b, secure: maybe } ]",
                "neither true nor false",
            ),
            (
                "sdk.aws.s3 { key: K, secret: \"S\\nX\" }",
                "control characters",
            ),
            ("sdk.aws.s3.region: \"eu west\"", "not a region"),
            ("sdk.aws.s3.credentials: [ { bucket: ${NOPE} } ]", "line 1"),
        ] {
            let e = conf(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
            assert!(!e.contains("TOPSECRET") && !e.contains("ONLYKEY"), "{e}");
        }
        let many = format!(
            "sdk.aws.s3.credentials: [ {} ]",
            vec!["{ bucket: b }"; MAX_ENTRIES + 1].join(", ")
        );
        assert!(conf(&many).unwrap_err().contains("at most"));
        // Empty pairs, as clearml-init writes them, are no keys.
        let c = conf("sdk.aws.s3 { key: \"\", secret: \"\", region: \"\" }").unwrap();
        assert_eq!(c.s3, ConfS3::default());
    }
}
