//! [`Problem`] and [`ConfigErrors`]: everything wrong with a configuration, at once.

use std::fmt;

/// One thing wrong with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The dotted key concerned (`relay.batch_rows`), or `""` for a problem with a
    /// whole file (unreadable, not valid TOML).
    pub key: String,
    /// Where the offending value came from: `config/outpost.toml:12`,
    /// `environment variable OUTPOST_RELAY__BATCH_ROWS`,
    /// `flag --set relay.batch_rows`, or `default`.
    pub source: String,
    /// What is wrong (naming the key) and how to fix it. Never contains the value
    /// of a secret.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The message names the key; one line per problem, whatever it contains.
        let message = self.message.replace(['\n', '\r'], " ");
        write!(f, "{}: {}", self.source, message)
    }
}

/// Every problem found while loading or validating the configuration.
///
/// `Display` prints one line per problem, `source: message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(.problems))]
pub struct ConfigErrors {
    /// The problems, in the order they were found (file, environment, flags,
    /// then type errors section by section, then range checks).
    pub problems: Vec<Problem>,
}

impl ConfigErrors {
    /// A single problem.
    pub fn one(
        key: impl Into<String>,
        source: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            problems: vec![Problem {
                key: key.into(),
                source: source.into(),
                message: message.into(),
            }],
        }
    }

    /// The problems concerning `key`.
    pub fn for_key<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a Problem> + 'a {
        self.problems.iter().filter(move |p| p.key == key)
    }
}

fn render(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(Problem::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}
