//! Which S3 endpoint, region, addressing style and profile an upload uses,
//! resolved the way the AWS CLI resolves them, with where each came from.
//!
//! MinIO users configure the CLI with a profile holding `endpoint_url` and
//! `region` in `~/.aws/config`; memtrack must call the same endpoint, sign
//! for the same region and use path-style addressing there (a custom host
//! rarely serves `bucket.host`). Knowing the source of each value lets the
//! errors name the endpoint actually called and the profile, and tell a
//! credentials problem from a network one.
//!
//! The files are read here, with a size cap and regular files only; their
//! text is parsed by `aws-config` (the SDK's own profile parser), and the
//! endpoint's precedence is `aws-config`'s too. The SDK is then handed the
//! same text and the resolved values explicitly, so it never reads the
//! files again and both always agree.
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

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aws_config::profile::ProfileSet;
use aws_runtime::env_config::file::{
    EnvConfigFileKind as ProfileFileKind, EnvConfigFiles as ProfileFiles,
};
use aws_runtime::env_config::EnvConfigValue;
use aws_types::origin::Origin;
use aws_types::os_shim_internal::{Env, Fs};

use super::settings::S3Config;

/// Profile files larger than this are not read.
const MAX_PROFILE_FILE_BYTES: u64 = 1 << 20;

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
#[derive(Debug, Clone)]
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
    pub(crate) credentials: CredentialSource,
    /// Whether the instance-metadata service may be asked (for
    /// credentials): not with a custom endpoint, nor when
    /// `AWS_EC2_METADATA_DISABLED` is true.
    pub(crate) imds: bool,
    /// Why a profile file that exists cannot be used: unreadable,
    /// oversized, or not in the profile format (each names the file).
    pub(crate) unusable: Vec<String>,
    /// The profile files' text as read here, for the SDK (its `Debug`
    /// leaves the contents out: they hold secrets).
    pub(crate) profile_files: ProfileFiles,
}

/// What the configuration says about credentials, before asking the SDK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CredentialSource {
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

/// The two profile files: where they are and what they hold (empty when
/// absent or not usable), and why any that exists cannot be used.
#[derive(Debug, Default)]
pub(crate) struct ProfileTexts {
    pub(crate) config_file: PathBuf,
    pub(crate) config: String,
    pub(crate) credentials_file: PathBuf,
    pub(crate) credentials: String,
    pub(crate) unusable: Vec<String>,
}

/// Reads the profile files and resolves. A missing file is an empty one;
/// an unreadable or oversized one is named in [`Resolved::unusable`].
pub(crate) async fn resolve(
    config: &S3Config,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    home: Option<&Path>,
) -> Resolved {
    let (config_file, credentials_file) = file_paths(env, home);
    let mut unusable = Vec::new();
    let mut read = |path: &Path| -> String {
        // Regular files only, read up to the cap (`/dev/zero` or a FIFO as
        // `AWS_CONFIG_FILE` must neither grow memtrack nor hang it).
        match crate::files::read_text_capped(path, MAX_PROFILE_FILE_BYTES) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => {
                unusable.push(format!("cannot read {} ({e})", path.display()));
                String::new()
            }
        }
    };
    let texts = ProfileTexts {
        config: read(&config_file),
        credentials: read(&credentials_file),
        config_file,
        credentials_file,
        unusable,
    };
    resolve_from(config, env, texts).await
}

/// The profile set `aws-config` parses from `texts`, with `profile`
/// selected; a parse error names the file and the line.
async fn parse_profiles(texts: &ProfileTexts, profile: &str) -> Result<ProfileSet, String> {
    // The SDK's loader reads files through `Fs`; an in-memory one holding
    // what was read above keeps the paths in its messages without a
    // second, unbounded read.
    let files = [
        (ProfileFileKind::Config, &texts.config_file, &texts.config),
        (
            ProfileFileKind::Credentials,
            &texts.credentials_file,
            &texts.credentials,
        ),
    ];
    let mut fs = HashMap::new();
    let mut set = ProfileFiles::builder();
    for (kind, path, text) in files {
        fs.insert(path.as_os_str().to_owned(), text.as_bytes().to_vec());
        set = set.with_file(kind, path);
    }
    aws_config::profile::load(
        &Fs::from_raw_map(fs),
        &Env::from_slice(&[]),
        &set.build(),
        Some(profile.to_string().into()),
    )
    .await
    .map_err(|e| {
        // "error parsing PATH on line N:\n  WHY" (the parse error is the
        // load error's source).
        let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
        why.replace(":\n  ", ": ")
    })
}

/// Whether the selected profile holds keys or a way to get them.
fn has_profile_keys(p: &ProfileSet) -> bool {
    [
        "aws_access_key_id",
        "credential_process",
        "role_arn",
        "sso_session",
        "sso_start_url",
        "web_identity_token_file",
        "credential_source",
    ]
    .iter()
    .any(|k| p.get(k).is_some())
}

/// The value of `key` inside a profile property holding sub-properties
/// (`s3 =` then `  addressing_style = path`): `aws-config` keeps those as
/// the property's raw text ("not parsed into structured data"), and the
/// S3 client reads none of them, so this one is read here.
fn sub_property<'a>(value: &'a str, key: &str) -> Option<&'a str> {
    value.lines().find_map(|line| {
        let (k, v) = line.split_once('=')?;
        k.trim().eq_ignore_ascii_case(key).then(|| v.trim())
    })
}

/// [`resolve`] over the files' contents.
pub(crate) async fn resolve_from(
    config: &S3Config,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    texts: ProfileTexts,
) -> Resolved {
    let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    // By hand: aws-config reads `AWS_PROFILE` only, the CLI also
    // `AWS_DEFAULT_PROFILE`.
    let (profile, profile_from) = if let Some(p) = var("AWS_PROFILE") {
        (p, "AWS_PROFILE")
    } else if let Some(p) = var("AWS_DEFAULT_PROFILE") {
        (p, "AWS_DEFAULT_PROFILE")
    } else {
        ("default".to_string(), "default")
    };
    let mut unusable = texts.unusable.clone();
    let profiles = parse_profiles(&texts, &profile)
        .await
        .unwrap_or_else(|why| {
            unusable.push(why);
            ProfileSet::default()
        });
    let profile_defined = profiles.get_profile(&profile).is_some();
    let in_profile = |key: &str| profiles.get(key).filter(|v| !v.is_empty());
    let endpoint = resolve_endpoint(config, &var, &profiles, &profile);
    let truthy = |v: &str| v.trim().eq_ignore_ascii_case("true");
    let from_env = |name: &str| {
        var(name).map(|v| Setting {
            value: v,
            source: name.to_string(),
        })
    };

    // By hand: aws-config's region chain says nothing of where its answer
    // came from, and ends at the instance-metadata service.
    let region = if !config.region.is_empty() {
        Some(Setting {
            value: config.region.clone(),
            source: "s3.region".into(),
        })
    } else {
        from_env("AWS_REGION")
            .or_else(|| from_env("AWS_DEFAULT_REGION"))
            .or_else(|| {
                in_profile("region").map(|v| Setting {
                    value: v.to_string(),
                    source: format!("`region` of profile `{profile}`"),
                })
            })
            .or_else(|| {
                endpoint.as_ref().map(|_| Setting {
                    value: "us-east-1".into(),
                    source: "the default for a custom endpoint".into(),
                })
            })
    };

    let path_style = match config.path_style.explicit() {
        Some(explicit) => explicit,
        None => match in_profile("s3").and_then(|s3| sub_property(s3, "addressing_style")) {
            Some(s) if s.eq_ignore_ascii_case("path") => true,
            Some(s) if s.eq_ignore_ascii_case("virtual") => false,
            _ => endpoint.is_some(),
        },
    };

    // A custom endpoint is no EC2 service: its keys never come from the
    // instance-metadata service, which is then not asked (off EC2 the
    // SDK would wait on 169.254.169.254 and report its own failure).
    let imds = endpoint.is_none() && !env("AWS_EC2_METADATA_DISABLED").is_some_and(|v| truthy(&v));
    let credentials = credential_source(&var, &profiles, imds);

    Resolved {
        profile,
        profile_from,
        profile_defined,
        endpoint,
        region,
        path_style,
        credentials,
        imds,
        unusable,
        profile_files: ProfileFiles::builder()
            .with_contents(ProfileFileKind::Config, texts.config)
            .with_contents(ProfileFileKind::Credentials, texts.credentials)
            .build(),
        config_file: texts.config_file,
        credentials_file: texts.credentials_file,
    }
}

/// The S3 endpoint and where it came from: `s3.endpoint`, else (unless
/// `ignore_configured_endpoint_urls`) `aws-config`'s order of the
/// environment and the profile.
fn resolve_endpoint(
    config: &S3Config,
    var: &dyn Fn(&str) -> Option<String>,
    profiles: &ProfileSet,
    profile: &str,
) -> Option<Setting> {
    // The environment `aws-config` looks at, less blank values (unset, as
    // for the CLI).
    let aws_env = Env::from(
        [
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL",
            "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
        ]
        .into_iter()
        .filter_map(|k| Some((k.to_string(), var(k)?)))
        .collect::<HashMap<_, _>>(),
    );

    let truthy = |v: &str| v.trim().eq_ignore_ascii_case("true");
    let ignore_configured = EnvConfigValue::new()
        .env("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
        .profile("ignore_configured_endpoint_urls")
        .load(&aws_env, Some(profiles))
        .is_some_and(|(v, _)| truthy(&v));
    if !config.endpoint.is_empty() {
        Some(Setting {
            value: config.endpoint.clone(),
            source: "s3.endpoint".into(),
        })
    } else if ignore_configured {
        None
    } else {
        // `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, the services section,
        // `endpoint_url`: aws-config's order; the origin names the source.
        let found = EnvConfigValue::new()
            .env("AWS_ENDPOINT_URL")
            .profile("endpoint_url")
            .service_id("s3")
            .load(&aws_env, Some(profiles));
        found
            .filter(|(value, _)| !value.is_empty())
            .map(|(value, from)| {
                let origin: Origin = (&from).into();
                let source = match origin {
                    o if o == Origin::service_environment_variable() => {
                        "AWS_ENDPOINT_URL_S3".into()
                    }
                    o if o == Origin::shared_environment_variable() => "AWS_ENDPOINT_URL".into(),
                    o if o == Origin::service_profile_file() => format!(
                        "`s3.endpoint_url` of services `{}` (profile `{profile}`)",
                        profiles.get("services").unwrap_or_default()
                    ),
                    _ => format!("`endpoint_url` of profile `{profile}`"),
                };
                Setting {
                    value: value.into_owned(),
                    source,
                }
            })
    }
}

/// Where credentials would come from, or why none are configured.
fn credential_source(
    var: &dyn Fn(&str) -> Option<String>,
    profiles: &ProfileSet,
    imds: bool,
) -> CredentialSource {
    let has = |name: &str| var(name).is_some();
    match (has("AWS_ACCESS_KEY_ID"), has("AWS_SECRET_ACCESS_KEY")) {
        (true, true) => CredentialSource::Environment,
        (true, false) => CredentialSource::HalfEnvironment {
            set: "AWS_ACCESS_KEY_ID",
            missing: "AWS_SECRET_ACCESS_KEY",
        },
        (false, true) => CredentialSource::HalfEnvironment {
            set: "AWS_SECRET_ACCESS_KEY",
            missing: "AWS_ACCESS_KEY_ID",
        },
        _ if has_profile_keys(profiles) => CredentialSource::Profile,
        _ if has("AWS_WEB_IDENTITY_TOKEN_FILE")
            || has("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
            || has("AWS_CONTAINER_CREDENTIALS_FULL_URI")
            || imds =>
        {
            CredentialSource::Elsewhere
        }
        _ => CredentialSource::None,
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
    /// (Only a claim when both files could be read.)
    pub(crate) fn unknown_profile(&self) -> Option<String> {
        let known_unknown =
            self.profile_from != "default" && !self.profile_defined && self.unusable.is_empty();
        known_unknown.then(|| {
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
                CredentialSource::Environment
                | CredentialSource::Profile
                | CredentialSource::Elsewhere
                | CredentialSource::Given(_) => return None,
                CredentialSource::HalfEnvironment { set, missing } => {
                    format!("{set} is set but {missing} is not")
                }
                CredentialSource::None => format!("no S3 credentials found ({})", self.looked_in()),
            }
        };
        for u in &self.unusable {
            why.push_str(&format!("; {u}"));
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

/// [`resolve_from`] over inline texts, as files under `/home/u/.aws/`.
#[cfg(test)]
pub(crate) fn resolve_texts(
    config: &S3Config,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
    config_text: &str,
    credentials_text: &str,
) -> Resolved {
    let texts = ProfileTexts {
        config_file: "/home/u/.aws/config".into(),
        config: config_text.into(),
        credentials_file: "/home/u/.aws/credentials".into(),
        credentials: credentials_text.into(),
        unusable: Vec::new(),
    };
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime")
        .block_on(resolve_from(config, env, texts))
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
    fn a_malformed_profile_file_is_named_with_its_line_not_skipped() {
        // A key without `=` in the chosen profile: once skipped silently,
        // so the profile looked defined but keyless.
        let vars = [("AWS_PROFILE", "minio")];
        let r = resolve_texts(
            &S3Config::default(),
            &env(&vars),
            CONFIG,
            "[minio]\naws_access_key_id\naws_secret_access_key = SK\n",
        );
        assert_eq!(
            r.unusable,
            ["error parsing /home/u/.aws/credentials on line 2: \
              Expected an '=' sign defining a property"],
        );
        let why = r.missing_credentials().unwrap_or_default();
        assert!(
            !why.contains("neither"),
            "the profile is not unknown: {why}"
        );
        // Hostile input: no panic, and an error rather than a guess.
        let junk = "[\n]]]\n[a\nb=c\n\u{0}=\u{0}\n".repeat(1000);
        for (config, credentials) in [(junk.as_str(), ""), ("", junk.as_str())] {
            let r = resolve_texts(&S3Config::default(), &env(&vars), config, credentials);
            assert_eq!(r.unusable.len(), 1, "{:?}", r.unusable);
            assert!(r.unusable[0].contains("on line 1"), "{:?}", r.unusable);
        }
    }

    #[test]
    fn a_profile_endpoint_turns_on_path_style_and_its_region_is_used() {
        let r = resolve_texts(
            &S3Config::default(),
            &env(&[("AWS_PROFILE", "minio")]),
            CONFIG,
            CREDENTIALS,
        );
        assert_eq!(r.endpoint.as_ref().unwrap().value, "http://minio-host:9000");
        assert_eq!(r.region.as_ref().unwrap().value, "eu-central-2");
        assert!(r.path_style);
        assert_eq!(r.credentials, CredentialSource::Profile);
        assert!(r
            .describe_endpoint()
            .contains("`endpoint_url` of profile `minio`"));
        assert!(r.missing_credentials().is_none());
        // The files' text travels with it, for the SDK, but never prints.
        assert!(!format!("{r:?}").contains("SK2"));
    }

    #[test]
    fn precedence_follows_the_cli() {
        let vars = [
            ("AWS_PROFILE", "minio"),
            ("AWS_ENDPOINT_URL", "http://env:1"),
            ("AWS_REGION", "us-west-2"),
        ];
        let r = resolve_texts(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        assert_eq!(r.endpoint.as_ref().unwrap().source, "AWS_ENDPOINT_URL");
        assert_eq!(r.region.as_ref().unwrap().value, "us-west-2");
        let vars = [
            ("AWS_PROFILE", "minio"),
            ("AWS_ENDPOINT_URL_S3", "http://s3env:1"),
            ("AWS_ENDPOINT_URL", "http://env:1"),
        ];
        let r = resolve_texts(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        assert_eq!(r.endpoint.unwrap().value, "http://s3env:1");
        let config = S3Config {
            endpoint: "http://flag:2".into(),
            region: "r-1".into(),
            path_style: crate::switch::Switch::Off,
            ..S3Config::default()
        };
        let r = resolve_texts(&config, &env(&vars), CONFIG, CREDENTIALS);
        assert_eq!(r.endpoint.as_ref().unwrap().value, "http://flag:2");
        assert_eq!(r.region.as_ref().unwrap().value, "r-1");
        assert!(!r.path_style, "an explicit false wins");
        let vars = [
            ("AWS_PROFILE", "minio"),
            ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true"),
        ];
        let r = resolve_texts(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        assert!(r.endpoint.is_none() && !r.path_style);
        // The services section, and its addressing style.
        let r = resolve_texts(
            &S3Config::default(),
            &env(&[("AWS_PROFILE", "svc")]),
            CONFIG,
            "",
        );
        assert_eq!(r.endpoint.unwrap().value, "http://svc-host:9000");
        assert!(!r.path_style, "addressing_style = virtual");
        // AWS itself: the default profile's region, no path style.
        let r = resolve_texts(&S3Config::default(), &env(&[]), CONFIG, CREDENTIALS);
        assert!(r.endpoint.is_none() && !r.path_style);
        assert_eq!(r.region.unwrap().value, "eu-west-1");
        assert_eq!(r.credentials, CredentialSource::Profile);
    }

    #[test]
    fn the_less_common_forms_resolve_as_the_cli_does() {
        let s3 = S3Config::default();
        // AWS_DEFAULT_PROFILE chooses, AWS_PROFILE wins over it.
        let r = resolve_texts(
            &s3,
            &env(&[("AWS_DEFAULT_PROFILE", "minio")]),
            CONFIG,
            CREDENTIALS,
        );
        assert_eq!(
            (r.profile.as_str(), r.profile_from),
            ("minio", "AWS_DEFAULT_PROFILE")
        );
        assert_eq!(r.endpoint.unwrap().value, "http://minio-host:9000");
        let vars = [("AWS_DEFAULT_PROFILE", "minio"), ("AWS_PROFILE", "svc")];
        assert_eq!(resolve_texts(&s3, &env(&vars), CONFIG, "").profile, "svc");
        // AWS_DEFAULT_REGION over the profile's, AWS_REGION over both.
        let vars = [("AWS_DEFAULT_REGION", "ca-central-1")];
        let r = resolve_texts(&s3, &env(&vars), CONFIG, "");
        assert_eq!(r.region.unwrap().source, "AWS_DEFAULT_REGION");
        let vars = [
            ("AWS_DEFAULT_REGION", "ca-central-1"),
            ("AWS_REGION", "me-south-1"),
        ];
        let r = resolve_texts(&s3, &env(&vars), CONFIG, "");
        assert_eq!(r.region.unwrap().value, "me-south-1");
        // `[profile default]` is the default profile; the region's source
        // names it.
        let r = resolve_texts(
            &s3,
            &env(&[]),
            "[profile default]\nregion = af-south-1\n",
            "",
        );
        let region = r.region.unwrap();
        assert_eq!(region.value, "af-south-1");
        assert_eq!(region.source, "`region` of profile `default`");
        assert!(r.profile_defined);
        // The profile's own ignore_configured_endpoint_urls.
        let config =
            "[default]\nendpoint_url = http://x:1\nignore_configured_endpoint_urls = true\n";
        assert!(resolve_texts(&s3, &env(&[]), config, "").endpoint.is_none());
        // A blank variable is unset: AWS_ENDPOINT_URL_S3 of spaces gives way.
        let vars = [
            ("AWS_ENDPOINT_URL_S3", "  "),
            ("AWS_ENDPOINT_URL", "http://env:1"),
        ];
        let r = resolve_texts(&s3, &env(&vars), "", "");
        assert_eq!(r.endpoint.unwrap().source, "AWS_ENDPOINT_URL");
        // Keys for a profile in the credentials file, its settings in the
        // config file: one profile.
        let vars = [("AWS_PROFILE", "minio")];
        let r = resolve_texts(
            &s3,
            &env(&vars),
            "[profile minio]\nregion = x-1\n",
            CREDENTIALS,
        );
        assert_eq!(r.credentials, CredentialSource::Profile);
        assert_eq!(r.region.unwrap().value, "x-1");
    }

    #[tokio::test]
    async fn oversized_or_unreadable_files_are_named_not_read() {
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
        let r = resolve(&S3Config::default(), &env(&vars), Some(home.path())).await;
        assert!(r.region.is_none(), "the oversized file was not read");
        assert_eq!(r.unusable.len(), 2, "{:?}", r.unusable);
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
        let r = resolve(&S3Config::default(), &env(&vars), Some(home.path())).await;
        assert_eq!(r.region.unwrap().value, "sa-east-1");
        assert!(r.profile_defined);
    }

    #[test]
    fn credential_problems_are_named() {
        let no_imds = [("AWS_EC2_METADATA_DISABLED", "true")];
        let r = resolve_texts(&S3Config::default(), &env(&no_imds), "", "");
        let why = r.missing_credentials().unwrap();
        assert!(
            why.contains("AWS_ACCESS_KEY_ID") && why.contains("profile `default`"),
            "{why}"
        );
        let vars = [
            ("AWS_PROFILE", "nope"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ];
        let r = resolve_texts(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
        let why = r.missing_credentials().unwrap();
        assert!(why.contains("AWS_PROFILE names profile `nope`"), "{why}");
        // An unknown profile is named even where the instance might help.
        let r = resolve_texts(
            &S3Config::default(),
            &env(&[("AWS_PROFILE", "nope")]),
            CONFIG,
            "",
        );
        assert!(r.missing_credentials().unwrap().contains("`nope`"));
        let r = resolve_texts(
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
        let r = resolve_texts(&S3Config::default(), &env(&[]), CONFIG, "");
        assert!(r.missing_credentials().is_none());
    }

    #[test]
    fn a_custom_endpoint_never_asks_instance_metadata_and_a_typo_is_an_error() {
        let config = S3Config {
            endpoint: "http://minio:9000".into(),
            ..S3Config::default()
        };
        let r = resolve_texts(&config, &env(&[]), "", "");
        assert!(!r.imds);
        assert_eq!(r.credentials, CredentialSource::None);
        let why = r.missing_credentials().unwrap();
        assert!(
            why.starts_with("no S3 credentials found (looked in: the environment")
                && why.contains("custom endpoint"),
            "{why}"
        );
        assert!(resolve_texts(&S3Config::default(), &env(&[]), "", "").imds);
        // Keys in the environment do not hide a profile name with a typo.
        let vars = [
            ("AWS_PROFILE", "mnio"),
            ("AWS_ACCESS_KEY_ID", "AK"),
            ("AWS_SECRET_ACCESS_KEY", "SK"),
        ];
        let r = resolve_texts(&S3Config::default(), &env(&vars), CONFIG, CREDENTIALS);
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
        let r = resolve_texts(
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
