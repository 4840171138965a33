//! A setting spelled `auto`, `true` or `false` (`clearml.enabled`,
//! `s3.path_style`): one type, one parser, one message for a bad value.
//!
//! A TOML boolean reads as the word, so `path_style = false` means what it
//! says; the environment and the command line give words.

use std::fmt;

use serde::{Deserialize, Serialize};

/// `auto`: memtrack decides from the rest of the configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Switch {
    #[default]
    Auto,
    On,
    Off,
}

/// A word that is not `auto`, `true` or `false`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}`: use auto, true or false")]
pub(crate) struct NotASwitch(pub String);

impl Switch {
    /// The words a setting accepts: `auto`, `true`, `false`.
    pub(crate) fn parse(word: &str) -> Result<Switch, NotASwitch> {
        match word {
            "auto" => Ok(Switch::Auto),
            "true" => Ok(Switch::On),
            "false" => Ok(Switch::Off),
            other => Err(NotASwitch(other.to_string())),
        }
    }

    /// What an explicit value says; `None` for `auto`.
    pub(crate) fn explicit(self) -> Option<bool> {
        match self {
            Switch::Auto => None,
            Switch::On => Some(true),
            Switch::Off => Some(false),
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Switch::Auto => "auto",
            Switch::On => "true",
            Switch::Off => "false",
        }
    }
}

impl fmt::Display for Switch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Switch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Switch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Bool(bool),
            Word(String),
        }
        match Either::deserialize(d) {
            Ok(Either::Bool(true)) => Ok(Switch::On),
            Ok(Either::Bool(false)) => Ok(Switch::Off),
            Ok(Either::Word(w)) => Switch::parse(&w).map_err(serde::de::Error::custom),
            Err(_) => Err(serde::de::Error::custom(
                "expected auto, true or false (a word or a TOML boolean)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, Serialize)]
    struct T {
        s: Switch,
    }

    fn read(text: &str) -> Result<Switch, String> {
        toml::from_str::<T>(text)
            .map(|t| t.s)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn words_and_toml_booleans_read_alike() {
        assert_eq!(read("s = 'auto'"), Ok(Switch::Auto));
        assert_eq!(read("s = 'true'"), Ok(Switch::On));
        assert_eq!(read("s = true"), Ok(Switch::On));
        assert_eq!(read("s = 'false'"), Ok(Switch::Off));
        assert_eq!(read("s = false"), Ok(Switch::Off));
        assert_eq!(Switch::On.explicit(), Some(true));
        assert_eq!(Switch::Auto.explicit(), None);
    }

    #[test]
    fn anything_else_is_refused_with_the_accepted_words() {
        let e = read("s = 'yes'").unwrap_err();
        assert!(e.contains("`yes`: use auto, true or false"), "{e}");
        let e = read("s = 1").unwrap_err();
        assert!(
            e.contains("expected auto, true or false (a word or a TOML boolean)"),
            "{e}"
        );
    }

    #[test]
    fn writes_the_word_back() {
        for s in [Switch::Auto, Switch::On, Switch::Off] {
            let text = toml::to_string(&T { s }).unwrap();
            assert_eq!(read(&text), Ok(s));
            assert_eq!(text.trim(), format!("s = \"{s}\""));
        }
    }
}
