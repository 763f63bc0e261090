//! The `outpost` command line. This is the binary's edge: errors become `anyhow` here, are
//! printed once, and decide the exit code.

mod admin_token;
mod audit;
mod bench;
mod bench_admin;
mod bench_consumer;
mod bench_latency;
mod bench_poll;
mod bench_rate;
mod bench_relay;
mod bench_retention;
mod config_cmd;
mod dead_letter;
mod demo;
mod migrate;
mod pause;
mod produce;
mod run;
mod scratch;
mod status;
mod tail;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::config::{self, Config, LoadOptions};
use crate::store::{ConnectSettings, Store};

/// Exit code for configuration problems (`outpost config check` and any command whose
/// configuration does not load).
pub const EXIT_CONFIG: u8 = 2;

/// Outpost: delivers committed outbox events from PostgreSQL to Redis Streams.
#[derive(Debug, Parser)]
#[command(name = "outpost", version, about, long_about = None)]
pub struct Cli {
    /// Configuration file (default: config/outpost.toml when it exists).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one key, e.g. `--set relay.batch_rows=1000` (repeatable; wins over the
    /// environment and the file).
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a relay node until SIGTERM or SIGINT.
    Run(run::RunArgs),
    /// Apply, revert or list schema migrations.
    Migrate {
        #[command(subcommand)]
        action: migrate::MigrateAction,
    },
    /// Check or print the effective configuration.
    Config {
        #[command(subcommand)]
        action: config_cmd::ConfigAction,
    },
    /// Pause partitions: their owner publishes nothing more after its batch in flight.
    Pause(pause::PartitionArgs),
    /// Resume paused partitions.
    Resume(pause::PartitionArgs),
    /// Backlog by state and partition, oldest pending age, nodes and leases.
    Status(status::StatusArgs),
    /// Find quarantined events, look at one, replay or discard them (audited).
    DeadLetter {
        #[command(subcommand)]
        action: dead_letter::DeadLetterAction,
    },
    /// The log of operator actions, newest first.
    Audit(audit::AuditArgs),
    /// Administration: API tokens.
    Admin {
        #[command(subcommand)]
        action: admin_token::AdminAction,
    },
    /// Write load through the real producer API.
    Produce(produce::ProduceArgs),
    /// Print a stream's entries as they arrive, decoded.
    Tail(tail::TailArgs),
    /// The records scenario end to end on a fresh database, verified at the end (runs the
    /// `outpost-records` binary built beside this one).
    #[command(disable_help_flag = true)]
    Demo(demo::DemoArgs),
    /// Benchmarks (results belong in docs/benchmarks.md).
    Bench {
        #[command(subcommand)]
        which: bench::BenchCommand,
    },
}

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    // With the `failpoints` feature, fault points are armed from the FAILPOINTS variable
    // (docs/testing.md); without it this is a no-op.
    let _faults = fail::FailScenario::setup();
    let cli = Cli::parse();
    if let Command::Demo(args) = &cli.command {
        return demo::run(&cli, args);
    }
    let loaded = load_config(&cli);
    init_tracing(loaded.as_ref().ok().map(|c| &c.log));
    if let Command::Config { action } = &cli.command {
        return config_cmd::run(action, loaded);
    }
    let config = match loaded {
        Ok(c) => c,
        Err(problems) => {
            eprintln!("outpost: the configuration has problems:\n{problems}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outpost: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run::run(&config, args).await,
            Command::Migrate { action } => migrate::run(&config, action).await,
            Command::Status(args) => status::run(&config, args).await,
            Command::Pause(args) => pause::run(&config, args, true).await,
            Command::Resume(args) => pause::run(&config, args, false).await,
            Command::DeadLetter { action } => dead_letter::run(&config, action).await,
            Command::Audit(args) => audit::run(&config, args).await,
            Command::Admin { action } => admin_token::run(&config, action).await,
            Command::Produce(args) => produce::run(&config, args).await,
            Command::Tail(args) => tail::run(&config, args).await,
            Command::Bench { which } => bench::run(&config, which).await,
            Command::Config { .. } | Command::Demo(_) => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outpost: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(cli: &Cli) -> Result<Config, config::ConfigErrors> {
    let mut overrides = Vec::with_capacity(cli.set.len());
    for item in &cli.set {
        match item.split_once('=') {
            Some((k, v)) => overrides.push((k.trim().to_owned(), v.to_owned())),
            None => {
                return Err(config::ConfigErrors {
                    problems: vec![config::Problem {
                        key: item.clone(),
                        source: format!("flag --set {item}"),
                        message: "expected KEY=VALUE, e.g. --set relay.batch_rows=1000".to_owned(),
                    }],
                });
            }
        }
    }
    config::load(&LoadOptions {
        file: cli.config.clone(),
        overrides,
        ..LoadOptions::default()
    })
}

/// Logs go to stderr: `RUST_LOG` when set, otherwise `log.level`; `log.format` picks text or
/// JSON lines.
fn init_tracing(log: Option<&config::LogConfig>) {
    use tracing_subscriber::EnvFilter;
    let level = log.map_or("info", |l| l.level.as_str());
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second initialisation (tests calling `main` twice) is harmless to ignore.
    let _ = if log.is_some_and(config::LogConfig::is_json) {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// Opens the database named by `database.url`.
pub(crate) async fn connect(config: &Config, purpose: &str) -> anyhow::Result<Store> {
    let url = config.database.url()?;
    Store::connect(&ConnectSettings {
        connect_timeout: Duration::from_millis(config.database.connect_timeout_ms),
        ..ConnectSettings::new(
            url.expose(),
            format!("outpost {purpose}"),
            config.database.pool_size,
        )
    })
    .await
    .with_context(|| format!("connecting to the database at {url}"))
}

/// The identity of an operator at the command line: `cli:<user>@<host>`. Whoever can run the
/// CLI against the database holds its credentials, so the CLI acts as an admin.
pub(crate) fn cli_actor() -> crate::store::Actor {
    crate::store::Actor::new(
        format!(
            "cli:{}@{}",
            std::env::var("USER").unwrap_or_else(|_| "unknown".to_owned()),
            crate::health::hostname()
        ),
        crate::store::Role::Admin,
    )
}

/// Writes to stdout, ignoring a closed pipe (`outpost status | head`).
pub(crate) fn emit(text: &str) {
    use std::io::Write as _;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}
