//! Which S3 endpoint, region, addressing style and profile an upload uses,
//! resolved the way the AWS CLI resolves them, with where each came from.
//!
//! MinIO users configure the CLI with a profile holding `endpoint_url` and
//! `region` in `~/.aws/config`; memtrack must call the same endpoint, sign
//! for the same region and use path-style addressing there (a custom host
//! rarely serves `bucket.host`). Knowing the source of each value lets the
//! errors name the endpoint actually called and the profile, and tell a
//! credentials problem from a network one. The files are parsed here (pure
//! functions over `&str`); the AWS SDK then gets the resolved values
//! explicitly, so both always agree.
//!
//! Precedence, as the CLI's, first match wins:
//!
//! - endpoint: `s3.endpoint` (`--s3-endpoint`), `AWS_ENDPOINT_URL_S3`,
//!   `AWS_ENDPOINT_URL`, the profile's `services` section
//!   (`s3 = endpoint_url = …`), the profile's `endpoint_url`; none of the
//!   configured ones when `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS` (or the
//!   profile's `ignore_configured_endpoint_urls`) is true;
//! - region: `s3.region` (`--s3-region`), `AWS_REGION`,
//!   `AWS_DEFAULT_REGION`, the profile's `region`, `us-east-1` with a custom
//!   endpoint (MinIO accepts any), the SDK's chain (instance metadata);
//! - profile: `AWS_PROFILE`, `AWS_DEFAULT_PROFILE`, `default`;
//! - path style: `s3.path_style` when `true` or `false`; with `auto`, the
//!   profile's `s3 = addressing_style`, else on for any custom endpoint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::settings::S3Config;

/// Profile files larger than this are not read.
const MAX_PROFILE_FILE_BYTES: u64 = 1 << 20;

/// Sections of an AWS INI file: `[name]` → key → value. A key's indented
/// sub-properties (`s3 =` followed by `  endpoint_url = …`) are stored as
/// `s3.endpoint_url`.
pub(crate) type Sections = BTreeMap<String, BTreeMap<String, String>>;

/// Parses the AWS config or credentials file format. Comment lines (`#`,
/// `;`) and lines outside a section are skipped; a later duplicate key wins.
pub(crate) fn parse_ini(text: &str) -> Sections {
    let mut sections = Sections::new();
    let mut current: Option<String> = None;
    let mut parent: Option<String> = None;
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') {
            let name = line
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            sections.entry(name.clone()).or_default();
            current = Some(name);
            parent = None;
            continue;
        }
        let Some(section) = current.as_ref() else {
            continue;
        };
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let (key, value) = (key.trim().to_ascii_lowercase(), value.trim().to_string());
        let indented = raw.starts_with([' ', '\t']);
        let entries = sections.entry(section.clone()).or_default();
        match (&parent, indented) {
            (Some(p), true) => {
                entries.insert(format!("{p}.{key}"), value);
            }
            _ if value.is_empty() => {
                parent = Some(key);
            }
            _ => {
                parent = None;
                entries.insert(key, value);
            }
        }
    }
    sections
}

/// Splits `url` around its user information: (before, userinfo, after),
/// `None` without one.
fn split_userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let start = url.find("://")? + 3;
    let rest = &url[start..];
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let at = rest[..end].rfind('@')?;
    Some((&url[..start], &rest[..at], &rest[at + 1..]))
}

/// `url` with its user information (`user:password@`) shown as `***@`:
/// for every message that names an endpoint.
pub(crate) fn redact_userinfo(url: &str) -> String {
    match split_userinfo(url) {
        Some((scheme, _, rest)) => format!("{scheme}***@{rest}"),
        None => url.to_string(),
    }
}

/// `url` without its user information: requests are signed with the AWS
/// keys, a password in an endpoint is never used, and the retry command
/// must not print it.
pub(crate) fn strip_userinfo(url: &str) -> String {
    match split_userinfo(url) {
        Some((scheme, _, rest)) => format!("{scheme}{rest}"),
        None => url.to_string(),
    }
}

/// Why `endpoint` cannot be an S3 endpoint (a configuration error, never
/// retried as a network one): it must be an `http://` or `https://` URL
/// with a host.
pub(crate) fn check_endpoint(endpoint: &str) -> Result<(), EndpointError> {
    let shown = redact_userinfo(endpoint);
    let not_url = |e: Box<dyn std::error::Error + Send + Sync>| EndpointError::NotUrl {
        shown: shown.clone(),
        source: e,
    };
    let uri: hyper::Uri = strip_userinfo(endpoint)
        .parse()
        .map_err(|e: hyper::http::uri::InvalidUri| not_url(e.into()))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(EndpointError::NotHttp { shown }),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(EndpointError::NoHost { shown });
    }
    // The port's range, which the URI grammar leaves open.
    reqwest::Url::parse(&strip_userinfo(endpoint)).map_err(|e| not_url(e.into()))?;
    Ok(())
}

/// Why a string cannot be an S3 endpoint; `shown` is the endpoint with any
/// password left out.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EndpointError {
    #[error("`{shown}` is not a URL ({source})")]
    NotUrl {
        shown: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("`{shown}` is not an http:// or https:// URL (write e.g. http://minio:9000)")]
    NotHttp { shown: String },
    #[error("`{shown}` names no host")]
    NoHost { shown: String },
}

/// One resolved value and where it came from (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Setting {
    pub(crate) value: String,
    pub(crate) source: String,
}

/// What an upload will use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// The profile name and what chose it (`AWS_PROFILE`, `default`).
    pub(crate) profile: String,
    pub(crate) profile_from: &'static str,
    /// Whether either file defines the profile.
    pub(crate) profile_defined: bool,
    /// A custom endpoint; `None` is AWS itself.
    pub(crate) endpoint: Option<Setting>,
    /// `None`: left to the SDK's chain.
    pub(crate) region: Option<Setting>,
    pub(crate) path_style: bool,
    pub(crate) config_file: PathBuf,
    pub(crate) credentials_file: PathBuf,
    /// Where credentials would come from, or why none are configured.
    pub(crate) credentials: Credentials,
    /// Whether the instance-metadata service may be asked (for
    /// credentials): not with a custom endpoint, nor when
    /// `AWS_EC2_METADATA_DISABLED` is true.
    pub(crate) imds: bool,
    /// Files that exist but could not be read (named in messages).
    pub(crate) unreadable: Vec<String>,
}

/// What the configuration says about credentials, before asking the SDK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Credentials {
    /// `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`.
    Environment,
    /// Only one of the pair is set.
    HalfEnvironment {
        set: &'static str,
        missing: &'static str,
    },
    /// The profile holds keys or a way to get them (role, process, SSO).
    Profile,
    /// Web identity (`AWS_WEB_IDENTITY_TOKEN_FILE`) or container/instance
    /// credentials may apply: only the SDK can tell.
    Elsewhere,
    /// Nothing configured.
    None,
    /// Keys memtrack was handed for this destination (`sdk.aws.s3` of
    /// `clearml.conf`): where they come from, for messages.
    Given(String),
}

/// The AWS CLI's files: `AWS_CONFIG_FILE` / `AWS_SHARED_CREDENTIALS_FILE`,
/// else under `~/.aws/`.
pub(crate) fn file_paths(
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> (PathBuf, PathBuf) {
    let under_home = |name: &str| {
        home.map(|h| h.join(".aws").join(name))
            .unwrap_or_else(|| PathBuf::from("~/.aws").join(name))
    };
    let pick = |var: &str, name: &str| {
        env(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| under_home(name))
    };
    (
        pick("AWS_CONFIG_FILE", "config"),
        pick("AWS_SHARED_CREDENTIALS_FILE", "credentials"),
    )
}

/// Reads the profile files and resolves. A missing file is an empty one;
/// an unreadable or oversized one is named in [`Resolved::unreadable`].
pub(crate) fn resolve(
    config: &S3Config,
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> Resolved {
    let (config_file, credentials_file) = file_paths(env, home);
    let mut unreadable = Vec::new();
    let mut read = |path: &Path| -> String {
        // Regular files only, read up to the cap (`/dev/zero` or a FIFO as
        // `AWS_CONFIG_FILE` must neither grow memtrack nor hang it).
        match crate::files::read_text_capped(path, MAX_PROFILE_FILE_BYTES) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => {
                unreadable.push(format!("{} ({e})", path.display()));
                String::new()
            }
        }
    };
    let config_text = read(&config_file);
    let credentials_text = read(&credentials_file);
    let mut r = resolve_from(config, env, &config_text, &credentials_text);
    r.config_file = config_file;
    r.credentials_file = credentials_file;
    r.unreadable = unreadable;
    r
}

/// Whether a profile section holds keys or a way to get them.
fn has_profile_keys(s: &BTreeMap<String, String>) -> bool {
    s.contains_key("aws_access_key_id")
        || [
            "credential_process",
            "role_arn",
            "sso_session",
            "sso_start_url",
            "web_identity_token_file",
            "credential_source",
        ]
        .iter()
        .any(|k| s.contains_key(*k))
}

/// [`resolve`] over the files' contents.
pub(crate) fn resolve_from(
    config: &S3Config,
    env: &dyn Fn(&str) -> Option<String>,
    config_text: &str,
    credentials_text: &str,
) -> Resolved {
    let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    let (profile, profile_from) = if let Some(p) = var("AWS_PROFILE") {
        (p, "AWS_PROFILE")
    } else if let Some(p) = var("AWS_DEFAULT_PROFILE") {
        (p, "AWS_DEFAULT_PROFILE")
    } else {
        ("default".to_string(), "default")
    };
    let conf = parse_ini(config_text);
    let creds = parse_ini(credentials_text);
    let section_name = if profile == "default" {
        "default".to_string()
    } else {
        format!("profile {profile}")
    };
    // The CLI also accepts `[profile default]`.
    let empty = BTreeMap::new();
    let in_config = conf
        .get(&section_name)
        .or_else(|| conf.get(&format!("profile {profile}")));
    let in_credentials = creds.get(&profile);
    let profile_defined = in_config.is_some() || in_credentials.is_some();
    let p = in_config.unwrap_or(&empty);
    let from_profile = |key: &str| {
        p.get(key).filter(|v| !v.is_empty()).map(|v| Setting {
            value: v.clone(),
            source: format!("`{key}` of profile `{profile}`"),
        })
    };

    let truthy = |v: &str| v.trim().eq_ignore_ascii_case("true");
    let ignore_configured = var("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
        .map(|v| truthy(&v))
        .or_else(|| p.get("ignore_configured_endpoint_urls").map(|v| truthy(v)))
        .unwrap_or(false);
    let from_env = |name: &str| {
        var(name).map(|v| Setting {
            value: v,
            source: name.to_string(),
        })
    };
    let endpoint = if !config.endpoint.is_empty() {
        Some(Setting {
            value: config.endpoint.clone(),
            source: "s3.endpoint".into(),
        })
    } else if ignore_configured {
        None
    } else {
        from_env("AWS_ENDPOINT_URL_S3")
            .or_else(|| from_env("AWS_ENDPOINT_URL"))
            .or_else(|| {
                let services = p.get("services")?;
                let value = conf
                    .get(&format!("services {services}"))?
                    .get("s3.endpoint_url")?
                    .clone();
                Some(Setting {
                    value,
                    source: format!(
                        "`s3.endpoint_url` of services `{services}` (profile `{profile}`)"
                    ),
                })
            })
            .or_else(|| from_profile("endpoint_url"))
    };

    let region = if !config.region.is_empty() {
        Some(Setting {
            value: config.region.clone(),
            source: "s3.region".into(),
        })
    } else {
        from_env("AWS_REGION")
            .or_else(|| from_env("AWS_DEFAULT_REGION"))
            .or_else(|| from_profile("region"))
            .or_else(|| {
                endpoint.as_ref().map(|_| Setting {
                    value: "us-east-1".into(),
                    source: "the default for a custom endpoint".into(),
                })
            })
    };

    let path_style = match config.path_style.explicit() {
        Some(explicit) => explicit,
        None => match p.get("s3.addressing_style").map(|s| s.to_ascii_lowercase()) {
            Some(s) if s == "path" => true,
            Some(s) if s == "virtual" => false,
            _ => endpoint.is_some(),
        },
    };

    let has = |name: &str| var(name).is_some();
    // A custom endpoint is no EC2 service: its keys never come from the
    // instance-metadata service, which is then not asked (off EC2 the
    // SDK would wait on 169.254.169.254 and report its own failure).
    let imds = endpoint.is_none() && !env("AWS_EC2_METADATA_DISABLED").is_some_and(|v| truthy(&v));
    let in_profile =
        in_credentials.is_some_and(has_profile_keys) || in_config.is_some_and(has_profile_keys);
    let credentials = match (has("AWS_ACCESS_KEY_ID"), has("AWS_SECRET_ACCESS_KEY")) {
        (true, true) => Credentials::Environment,
        (true, false) => Credentials::HalfEnvironment {
            set: "AWS_ACCESS_KEY_ID",
            missing: "AWS_SECRET_ACCESS_KEY",
        },
        (false, true) => Credentials::HalfEnvironment {
            set: "AWS_SECRET_ACCESS_KEY",
            missing: "AWS_ACCESS_KEY_ID",
        },
        _ if in_profile => Credentials::Profile,
        _ if has("AWS_WEB_IDENTITY_TOKEN_FILE")
            || has("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
            || has("AWS_CONTAINER_CREDENTIALS_FULL_URI")
            || imds =>
        {
            Credentials::Elsewhere
        }
        _ => Credentials::None,
    };

    Resolved {
        profile,
        profile_from,
        profile_defined,
        endpoint,
        region,
        path_style,
        config_file: PathBuf::new(),
        credentials_file: PathBuf::new(),
        credentials,
        imds,
        unreadable: Vec::new(),
    }
}

impl Resolved {
    /// The endpoint for messages: the URL and its source, or AWS itself.
    pub(crate) fn describe_endpoint(&self) -> String {
        match &self.endpoint {
            Some(e) if e.source == "s3.endpoint" => redact_userinfo(&e.value),
            Some(e) => format!("{} (from {})", redact_userinfo(&e.value), e.source),
            None => format!(
                "AWS S3 (https://s3.{}.amazonaws.com)",
                self.region
                    .as_ref()
                    .map_or("us-east-1", |r| r.value.as_str())
            ),
        }
    }

    /// The profile for messages: `profile `x` (AWS_PROFILE)`.
    pub(crate) fn describe_profile(&self) -> String {
        match self.profile_from {
            "default" => format!("profile `{}`", self.profile),
            from => format!("profile `{}` from {from}", self.profile),
        }
    }

    /// A profile chosen by name that neither file defines.
    pub(crate) fn unknown_profile(&self) -> Option<String> {
        (self.profile_from != "default" && !self.profile_defined).then(|| {
            format!(
                "{} names profile `{}`, which neither {} nor {} defines",
                self.profile_from,
                self.profile,
                self.config_file.display(),
                self.credentials_file.display()
            )
        })
    }

    /// Why no credentials can be found, when the configuration alone tells
    /// (`None`: they may come from somewhere only the SDK can probe). A
    /// profile chosen by name that neither file defines is always an error,
    /// as for the AWS CLI: with keys in the environment a typo would
    /// otherwise send the upload to AWS instead of the profile's endpoint.
    pub(crate) fn missing_credentials(&self) -> Option<String> {
        let mut why = if let Some(unknown) = self.unknown_profile() {
            unknown
        } else {
            match &self.credentials {
                Credentials::Environment
                | Credentials::Profile
                | Credentials::Elsewhere
                | Credentials::Given(_) => return None,
                Credentials::HalfEnvironment { set, missing } => {
                    format!("{set} is set but {missing} is not")
                }
                Credentials::None => format!("no S3 credentials found ({})", self.looked_in()),
            }
        };
        for u in &self.unreadable {
            why.push_str(&format!("; cannot read {u}"));
        }
        Some(why)
    }

    /// Where credentials were looked for, for messages.
    pub(crate) fn looked_in(&self) -> String {
        let profile = if self.profile_defined {
            format!(
                "{}, defined but with no aws_access_key_id, role or credential_process",
                self.describe_profile()
            )
        } else {
            self.describe_profile()
        };
        let imds = if self.imds {
            "the instance-metadata service"
        } else if self.endpoint.is_some() {
            "not the instance-metadata service (a custom endpoint takes no EC2 credentials)"
        } else {
            "not the instance-metadata service (AWS_EC2_METADATA_DISABLED)"
        };
        format!(
            "looked in: the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), {profile} \
             in {} and {}, {imds}",
            self.credentials_file.display(),
            self.config_file.display()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    const CONFIG: &str = "\
# MinIO, as its docs configure the CLI
[default]
region = eu-west-1

[profile minio]
endpoint_url = http://minio-host:9000
region   = eu-central-2
; a comment
[profile svc]
services = local
region = ap-south-1
s3 =
  addressing_style = virtual

[services local]
s3 =
  endpoint_url = http://svc-host:9000
";

    const CREDENTIALS: &str = "[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n\
                               [minio]\naws_access_key_id=AK2\naws_secret_access_key=SK2\n";

    #[test]
    fn the_ini_format() {
        let s = parse_ini(CONFIG);
        assert_eq!(s["profile minio"]["endpoint_url"], "http://minio-host:9000");
        assert_eq!(s["profile minio"]["region"], "eu-central-2");
        assert_eq!(s["profile svc"]["s3.addressing_style"], "virtual");
        assert_eq!(s["profile svc"]["services"], "local");
        assert_eq!(
            s["services local"]["s3.endpoint_url"],
            "http://svc-host:9000"
        );
        assert!(parse_ini("key = outside\n[ x ]\n=\nnovalue\n")["x"].is_empty());
        // Hostile input: no panic, nothing invented.
        let junk = "[\n]]]\n[a\nb=c\n\u{0}=\u{0}\n".repeat(1000);
        let _ = parse_ini(&junk);
    }

    #[test]
    fn a_profile_endpoint_turns_on_path_style_and_its_region_is_used() {
        let r = resolve_from(
            &S3Config::default(),
            &env(&[("AWS_PROFILE", "minio")]),
            CONFIG,
            CREDENTIALS,
        );
        assert_eq!(r.endpoint.as_ref().unwrap().value, "http://minio-host:9000");
        assert_eq!(r.region.as_ref().unwrap().value, "eu-central-2");
        assert!(r.path_style);
        assert_eq!(r.credentials, Credentials::Profile);
        assert!(r
            .describe_endpoint()
            .contains("`endpoint_url` of profile `minio`"));
        assert!(r.missing_credentials().is_none());
    }

    #[test]
    fn precedence_follows_the_cli() {
        let vars = [
            ("AWS_PROFILE", "minio"),
            ("AWS_ENDPOINT_URL", "http://env:1"),
            ("AWS_REGION", "us-west-2"),
        ];
        let r = resolve_from(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        assert_eq!(r.endpoint.as_ref().unwrap().source, "AWS_ENDPOINT_URL");
        assert_eq!(r.region.as_ref().unwrap().value, "us-west-2");
        let vars = [
            ("AWS_PROFILE", "minio"),
            ("AWS_ENDPOINT_URL_S3", "http://s3env:1"),
            ("AWS_ENDPOINT_URL", "http://env:1"),
        ];
        let r = resolve_from(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        assert_eq!(r.endpoint.unwrap().value, "http://s3env:1");
        let config = S3Config {
            endpoint: "http://flag:2".into(),
            region: "r-1".into(),
            path_style: crate::switch::Switch::Off,
            ..S3Config::default()
        };
        let r = resolve_from(&config, &env(&vars), CONFIG, CREDENTIALS);
        assert_eq!(r.endpoint.as_ref().unwrap().value, "http://flag:2");
        assert_eq!(r.region.as_ref().unwrap().value, "r-1");
        assert!(!r.path_style, "an explicit false wins");
        let vars = [
            ("AWS_PROFILE", "minio"),
            ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true"),
        ];
        let r = resolve_from(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        assert!(r.endpoint.is_none() && !r.path_style);
        // The services section, and its addressing style.
        let r = resolve_from(
            &S3Config::default(),
            &env(&[("AWS_PROFILE", "svc")]),
            CONFIG,
            "",
        );
        assert_eq!(r.endpoint.unwrap().value, "http://svc-host:9000");
        assert!(!r.path_style, "addressing_style = virtual");
        // AWS itself: the default profile's region, no path style.
        let r = resolve_from(&S3Config::default(), &env(&[]), CONFIG, CREDENTIALS);
        assert!(r.endpoint.is_none() && !r.path_style);
        assert_eq!(r.region.unwrap().value, "eu-west-1");
        assert_eq!(r.credentials, Credentials::Profile);
    }

    #[test]
    fn oversized_or_unreadable_files_are_named_not_read() {
        let home = tempfile::tempdir().unwrap();
        let aws = home.path().join(".aws");
        std::fs::create_dir(&aws).unwrap();
        let big = format!(
            "[default]\nregion = eu-west-1\n{}",
            "# pad\n".repeat(200_000)
        );
        std::fs::write(aws.join("config"), big).unwrap();
        // A directory where the credentials file should be.
        std::fs::create_dir(aws.join("credentials")).unwrap();
        let vars = [("AWS_EC2_METADATA_DISABLED", "true")];
        let r = resolve(&S3Config::default(), &env(&vars), Some(home.path()));
        assert!(r.region.is_none(), "the oversized file was not read");
        assert_eq!(r.unreadable.len(), 2, "{:?}", r.unreadable);
        let why = r.missing_credentials().unwrap();
        assert!(
            why.contains("cannot read") && why.contains("config ("),
            "{why}"
        );
        // AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE point elsewhere.
        let other = home.path().join("other");
        std::fs::write(&other, "[profile x]\nregion = sa-east-1\n").unwrap();
        let other = other.display().to_string();
        let vars = [("AWS_CONFIG_FILE", other.as_str()), ("AWS_PROFILE", "x")];
        let r = resolve(&S3Config::default(), &env(&vars), Some(home.path()));
        assert_eq!(r.region.unwrap().value, "sa-east-1");
        assert!(r.profile_defined);
    }

    #[test]
    fn credential_problems_are_named() {
        let no_imds = [("AWS_EC2_METADATA_DISABLED", "true")];
        let r = resolve_from(&S3Config::default(), &env(&no_imds), "", "");
        let why = r.missing_credentials().unwrap();
        assert!(
            why.contains("AWS_ACCESS_KEY_ID") && why.contains("profile `default`"),
            "{why}"
        );
        let vars = [
            ("AWS_PROFILE", "nope"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ];
        let r = resolve_from(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        let why = r.missing_credentials().unwrap();
        assert!(why.contains("AWS_PROFILE names profile `nope`"), "{why}");
        // An unknown profile is named even where the instance might help.
        let r = resolve_from(
            &S3Config::default(),
            &env(&[("AWS_PROFILE", "nope")]),
            CONFIG,
            "",
        );
        assert!(r.missing_credentials().unwrap().contains("`nope`"));
        let r = resolve_from(
            &S3Config::default(),
            &env(&[("AWS_ACCESS_KEY_ID", "AK")]),
            "",
            "",
        );
        assert!(r
            .missing_credentials()
            .unwrap()
            .contains("AWS_SECRET_ACCESS_KEY is not"));
        // A defined profile without keys, instance metadata possible: unknown.
        let r = resolve_from(&S3Config::default(), &env(&[]), CONFIG, "");
        assert!(r.missing_credentials().is_none());
    }

    #[test]
    fn a_custom_endpoint_never_asks_instance_metadata_and_a_typo_is_an_error() {
        let config = S3Config {
            endpoint: "http://minio:9000".into(),
            ..S3Config::default()
        };
        let r = resolve_from(&config, &env(&[]), "", "");
        assert!(!r.imds);
        assert_eq!(r.credentials, Credentials::None);
        let why = r.missing_credentials().unwrap();
        assert!(
            why.starts_with("no S3 credentials found (looked in: the environment")
                && why.contains("custom endpoint"),
            "{why}"
        );
        assert!(resolve_from(&S3Config::default(), &env(&[]), "", "").imds);
        // Keys in the environment do not hide a profile name with a typo.
        let vars = [
            ("AWS_PROFILE", "mnio"),
            ("AWS_ACCESS_KEY_ID", "AK"),
            ("AWS_SECRET_ACCESS_KEY", "SK"),
        ];
        let r = resolve_from(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        let why = r.missing_credentials().unwrap();
        assert!(why.contains("profile `mnio`"), "{why}");
    }

    #[test]
    fn passwords_in_endpoints_are_never_shown() {
        let url = "https://admin:hunter2@minio.lab:9000/path?x=@y";
        assert_eq!(redact_userinfo(url), "https://***@minio.lab:9000/path?x=@y");
        assert_eq!(strip_userinfo(url), "https://minio.lab:9000/path?x=@y");
        assert_eq!(redact_userinfo("http://h:1/a@b"), "http://h:1/a@b");
        check_endpoint(url).unwrap();
        for bad in [
            "minio:9000",
            "ftp://h",
            "http://",
            "http://bad host:1",
            "http://u:hunter2@",
            "http://h:99999",
        ] {
            let err = check_endpoint(bad).unwrap_err().to_string();
            assert!(!err.contains("hunter2"), "{err}");
        }
        let r = resolve_from(
            &S3Config {
                endpoint: url.into(),
                ..S3Config::default()
            },
            &env(&[]),
            "",
            "",
        );
        assert!(!r.describe_endpoint().contains("hunter2"));
    }
}
