//! `outpost config check|print`.

use std::process::ExitCode;

use clap::Subcommand;

use crate::config::{Config, ConfigErrors};

/// What to do with the configuration.
#[derive(Debug, Subcommand)]
pub enum ConfigAction {
    /// Validate; print every problem with its source; exit 2 when there is any.
    Check,
    /// Print the effective configuration as TOML, secrets redacted.
    Print,
}

pub(super) fn run(action: &ConfigAction, loaded: Result<Config, ConfigErrors>) -> ExitCode {
    match (action, loaded) {
        (_, Err(problems)) => {
            eprintln!(
                "outpost: the configuration has {} problem(s):\n{problems}",
                problems.problems.len()
            );
            ExitCode::from(super::EXIT_CONFIG)
        }
        (ConfigAction::Check, Ok(_)) => {
            println!("configuration ok");
            ExitCode::SUCCESS
        }
        (ConfigAction::Print, Ok(config)) => {
            print!("{}", config.to_redacted_toml());
            ExitCode::SUCCESS
        }
    }
}
