//! The `[mlflow]` settings and what they resolve to with the environment:
//! the tracking server, the run and the experiment.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::api::MlflowError;
use crate::export::s3::aws::{check_endpoint, redact_userinfo};

/// Most metric values per `runs/log-batch` request (MLflow's limit).
pub(crate) const BATCH: usize = 1000;

/// The component and operation of the mark that announces the job's run.
pub(crate) const ANNOUNCE: (&str, &str) = ("mlflow", "active_run");

/// The `[mlflow]` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlflowConfig {
    /// The tracking server (`http://…` or `https://…`). Empty: the
    /// `MLFLOW_TRACKING_URI` memtrack was started with; neither: off.
    pub(crate) tracking_uri: String,
    /// Report into this MLflow run (default: `MLFLOW_RUN_ID`, else the
    /// job's, see the module).
    pub(crate) run_id: String,
    /// Where a run memtrack creates goes. Empty: the experiment
    /// `MLFLOW_EXPERIMENT_NAME` names, else `MLFLOW_EXPERIMENT_ID`, else `0`
    /// (MLflow's default experiment).
    pub(crate) experiment_id: String,
    /// One request's time limit.
    #[serde(with = "crate::units::serde_duration")]
    pub(crate) request_timeout: Duration,
}

impl Default for MlflowConfig {
    fn default() -> Self {
        MlflowConfig {
            tracking_uri: String::new(),
            run_id: String::new(),
            experiment_id: String::new(),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// The settings a run uses, from the configuration and the environment.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Settings {
    /// The tracking server as given: its user information, if any, is
    /// sent as HTTP basic authentication and never printed.
    pub(crate) uri: String,
    pub(crate) run_id: Option<String>,
    /// Where a run memtrack creates goes.
    pub(crate) experiment: Experiment,
    pub(crate) request_timeout: Duration,
}

/// The experiment of a run memtrack creates.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Experiment {
    Id(String),
    /// Looked up by name when the run is created, and created when the
    /// server has none of that name (`MLFLOW_EXPERIMENT_NAME`).
    Name(String),
}

impl Settings {
    /// The tracking server for messages: a password in it shows as `***`.
    pub(crate) fn shown(&self) -> String {
        redact_userinfo(&self.uri)
    }
}

/// What the configuration and the environment ask of MLflow.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Resolved {
    /// No tracking URI: MLflow is not used.
    Off,
    /// `MLFLOW_TRACKING_URI` names something memtrack cannot report to
    /// (MLflow's file store, Databricks, a database, an address without a
    /// host): said once, the job runs, MLflow output is off. The job's own
    /// MLflow client uses the same variable, so it is no reason to refuse
    /// the run.
    Unusable(String),
    On(Settings),
}

/// The run's MLflow settings. memtrack reports through a tracking
/// server's REST API, so the URI must be an `http(s)://` URL with a host.
/// One that is not is an error when it is memtrack's own setting
/// (`mlflow.tracking_uri`), and [`Resolved::Unusable`] when it comes from
/// `MLFLOW_TRACKING_URI`. Messages never show a password the URI holds.
pub(crate) fn resolve(
    config: &MlflowConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Resolved, MlflowError> {
    let pick = |set: &str, var: &str| {
        Some(set.trim().to_string())
            .filter(|s| !s.is_empty())
            .or_else(|| {
                env(var)
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
            })
    };
    let from_config = !config.tracking_uri.trim().is_empty();
    let Some(uri) = pick(&config.tracking_uri, "MLFLOW_TRACKING_URI") else {
        return Ok(Resolved::Off);
    };
    if let Err(why) = check_uri(&uri) {
        return if from_config {
            Err(MlflowError::Config(format!(
                "mlflow.tracking_uri {why}; memtrack reports to MLflow through a tracking \
                 server's REST API (e.g. http://127.0.0.1:5000)"
            )))
        } else {
            Ok(Resolved::Unusable(format!(
                "MLFLOW_TRACKING_URI {why}: memtrack reports to MLflow only through a tracking \
                 server (http:// or https://), so this run's memory figures do not go to \
                 MLflow (the job runs, and its own MLflow client is not affected)"
            )))
        };
    }
    Ok(Resolved::On(Settings {
        uri: uri.trim_end_matches('/').to_string(),
        run_id: pick(&config.run_id, "MLFLOW_RUN_ID"),
        experiment: experiment(config, env),
        request_timeout: config.request_timeout,
    }))
}

/// Where a run memtrack creates goes: `mlflow.experiment_id`, else the
/// name in `MLFLOW_EXPERIMENT_NAME` (which wins over `MLFLOW_EXPERIMENT_ID`
/// in MLflow's client too), else `MLFLOW_EXPERIMENT_ID`, else `0`.
fn experiment(config: &MlflowConfig, env: &dyn Fn(&str) -> Option<String>) -> Experiment {
    let var = |name: &str| {
        env(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let set = config.experiment_id.trim();
    if !set.is_empty() {
        return Experiment::Id(set.to_string());
    }
    var("MLFLOW_EXPERIMENT_NAME")
        .map(Experiment::Name)
        .or_else(|| var("MLFLOW_EXPERIMENT_ID").map(Experiment::Id))
        .unwrap_or_else(|| Experiment::Id("0".into()))
}

/// Why `uri` is no tracking server memtrack can reach, in words that
/// follow the setting's name (the URI shown without its password).
fn check_uri(uri: &str) -> Result<(), String> {
    let shown = redact_userinfo(uri);
    let scheme = uri.split_once(':').map_or("", |(s, _)| s);
    if !matches!(scheme, "http" | "https") {
        let what = match scheme {
            "" => "a local path (MLflow's file store)".to_string(),
            "file" => "MLflow's file store".to_string(),
            "databricks" | "databricks-uc" => "Databricks".to_string(),
            s if s.contains("sql") || s == "mssql" => "a database store".to_string(),
            s => format!("a `{s}:` address"),
        };
        return Err(format!(
            "`{shown}` is {what}, not an http(s) tracking server"
        ));
    }
    let host = uri.split_once("://").map_or("", |(_, rest)| {
        rest.split(['/', '?', '#']).next().unwrap_or("")
    });
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    if host.is_empty() || host.starts_with(':') {
        return Err(format!("`{shown}` names no host"));
    }
    check_endpoint(uri).map_err(|e| e.to_string())
}
#[cfg(test)]
mod tests {
    use super::*;

    fn env_uri(uri: &'static str) -> impl Fn(&str) -> Option<String> {
        move |v: &str| (v == "MLFLOW_TRACKING_URI").then(|| uri.to_string())
    }

    #[test]
    fn off_without_a_uri_and_on_for_a_server() {
        let none = |_: &str| None;
        assert_eq!(
            resolve(&MlflowConfig::default(), &none).unwrap(),
            Resolved::Off
        );
        let env = |v: &str| match v {
            "MLFLOW_TRACKING_URI" => Some("http://127.0.0.1:5000/".to_string()),
            "MLFLOW_RUN_ID" => Some("abc".to_string()),
            _ => None,
        };
        let Resolved::On(s) = resolve(&MlflowConfig::default(), &env).unwrap() else {
            panic!("on");
        };
        assert_eq!(s.uri, "http://127.0.0.1:5000");
        assert_eq!(s.run_id.as_deref(), Some("abc"));
        assert_eq!(s.experiment, Experiment::Id("0".into()));
    }

    #[test]
    fn the_experiment_is_the_setting_else_the_name_else_the_id_variable() {
        let env = |v: &str| match v {
            "MLFLOW_TRACKING_URI" => Some("http://127.0.0.1:5000".to_string()),
            "MLFLOW_EXPERIMENT_NAME" => Some(" team ".to_string()),
            "MLFLOW_EXPERIMENT_ID" => Some("7".to_string()),
            _ => None,
        };
        let experiment = |config: &MlflowConfig, env: &dyn Fn(&str) -> Option<String>| {
            let Resolved::On(s) = resolve(config, env).unwrap() else {
                panic!("on");
            };
            s.experiment
        };
        assert_eq!(
            experiment(&MlflowConfig::default(), &env),
            Experiment::Name("team".into())
        );
        let only_id = |v: &str| (v != "MLFLOW_EXPERIMENT_NAME").then(|| env(v)).flatten();
        assert_eq!(
            experiment(&MlflowConfig::default(), &only_id),
            Experiment::Id("7".into())
        );
        let config = MlflowConfig {
            experiment_id: "3".into(),
            ..MlflowConfig::default()
        };
        assert_eq!(experiment(&config, &env), Experiment::Id("3".into()));
    }

    #[test]
    fn an_unusable_uri_from_the_environment_turns_mlflow_off_and_says_why() {
        for (uri, why) in [
            ("file:///tmp/mlruns", "MLflow's file store"),
            ("databricks://profile", "Databricks"),
            ("postgresql://u:secret@db/mlflow", "a database store"),
            ("./mlruns", "a local path"),
            ("http://", "names no host"),
            ("https://alice:secret@:5000", "names no host"),
            ("http://127.0.0.1:99999", "not a URL"),
        ] {
            let got = resolve(&MlflowConfig::default(), &env_uri(uri)).unwrap();
            let Resolved::Unusable(message) = got else {
                panic!("{uri}: {got:?}");
            };
            assert!(message.contains(why), "{uri}: {message}");
            assert!(!message.contains("secret"), "{message}");
        }
    }

    #[test]
    fn an_unusable_uri_in_memtracks_own_setting_is_an_error() {
        let config = MlflowConfig {
            tracking_uri: "file:///tmp/mlruns".into(),
            ..MlflowConfig::default()
        };
        let err = resolve(&config, &|_: &str| None).unwrap_err().to_string();
        assert!(err.contains("mlflow.tracking_uri"), "{err}");
    }

    #[test]
    fn a_password_in_the_uri_is_never_shown() {
        let Resolved::On(s) = resolve(
            &MlflowConfig::default(),
            &env_uri("http://alice:hunter2@h:5000"),
        )
        .unwrap() else {
            panic!("on");
        };
        assert_eq!(s.shown(), "http://***@h:5000");
        assert_eq!(s.uri, "http://alice:hunter2@h:5000", "still used to log in");
    }
}
