//! The `outpost-records` command line: the application's services (`write`, `consume`), its
//! schema (`setup`), the verdict (`verify`) and all of it at once (`demo`, which `outpost demo`
//! runs). The binary's edge: errors become `anyhow` here.

mod bench;
mod demo;
mod redis_server;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use outpost::config::{Config, LoadOptions};
use outpost::produce::{Limits, Producer};
use outpost::store::{ConnectSettings, Store};
use tokio::signal::unix::{SignalKind, signal};

use crate::load::{self, LoadSettings, LoadStats, Mix};
use crate::projection::{self, ConsumerTarget};
use crate::service::Records;
use crate::{schema, verify};

pub use demo::DemoArgs;

/// The records application over Outpost.
#[derive(Debug, Parser)]
#[command(name = "outpost-records", version, about, long_about = None)]
pub struct Cli {
    /// Outpost's configuration file (default: config/outpost.toml when it exists); the
    /// application reads `database.*`, `redis.*` and `producer.*` from it.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one key, e.g. `--set database.url=postgres://…` (repeatable).
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The whole scenario on a fresh database, verified at the end.
    Demo(DemoArgs),
    /// Apply Outpost's migrations and create the application's tables on `database.url`.
    Setup,
    /// Run the writers (the load generator) until SIGTERM/SIGINT or `--duration`.
    Write(WriteArgs),
    /// Keep the read model from the stream until SIGTERM/SIGINT.
    Consume(ConsumeArgs),
    /// Check the delivered events and the read model against the source rows.
    Verify,
    /// Transactions per second with and without the event fact (results in
    /// docs/benchmarks.md).
    Bench(bench::BenchArgs),
}

/// Options of the writers.
#[derive(Debug, Clone, Args)]
pub struct WriteArgs {
    /// Concurrent writers.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Transactions per second over all writers (0: as fast as they go).
    #[arg(long, default_value_t = 0)]
    pub rate: u32,
    /// Stop after this many seconds (0: until SIGTERM/SIGINT).
    #[arg(long, default_value_t = 0)]
    pub duration: u64,
    /// Seed of the mix.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Options of the consumer.
#[derive(Debug, Clone, Args)]
pub struct ConsumeArgs {
    /// This member's name in the `record-view` group (default: host and process id).
    #[arg(long)]
    pub member: Option<String>,
}

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    // With the `failpoints` feature, fault points are armed from FAILPOINTS; otherwise a no-op.
    let _faults = fail::FailScenario::setup();
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let options = match load_options(&cli) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("outpost-records: {e}");
            return ExitCode::from(2);
        }
    };
    let config = match outpost::config::load(&options) {
        Ok(c) => c,
        Err(problems) => {
            eprintln!("outpost-records: the configuration has problems:\n{problems}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outpost-records: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::run(&config, &options, args).await,
            Command::Setup => setup(&config).await.map(|_| true),
            Command::Write(args) => write(&config, args).await.map(|()| true),
            Command::Consume(args) => consume(&config, args).await.map(|()| true),
            Command::Verify => verify_cmd(&config).await,
            Command::Bench(args) => bench::run(&config, args).await.map(|()| true),
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("outpost-records: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_options(cli: &Cli) -> anyhow::Result<LoadOptions> {
    let mut overrides = Vec::with_capacity(cli.set.len());
    for item in &cli.set {
        let (k, v) = item.split_once('=').with_context(|| {
            format!("--set {item}: expected KEY=VALUE, e.g. --set database.pool_size=20")
        })?;
        overrides.push((k.trim().to_owned(), v.to_owned()));
    }
    Ok(LoadOptions {
        file: cli.config.clone(),
        overrides,
        ..LoadOptions::default()
    })
}

/// Opens `url` with a pool of `pool`, applies Outpost's migrations and creates the
/// application's tables (for the subcommands and the tests).
pub async fn open(url: &str, pool: u32, what: &str) -> anyhow::Result<Store> {
    let store = Store::connect(&ConnectSettings {
        connect_timeout: Duration::from_secs(5),
        ..ConnectSettings::new(url, format!("outpost-records {what}"), pool)
    })
    .await?;
    outpost::store::migrate_up(&store)
        .await
        .context("applying Outpost's migrations")?;
    schema::create_tables(store.connection())
        .await
        .context("creating the application's tables")?;
    Ok(store)
}

async fn connect(config: &Config, what: &str) -> anyhow::Result<Store> {
    let url = config.database.url()?;
    open(url.expose(), config.database.pool_size, what)
        .await
        .with_context(|| format!("opening the database at {url}"))
}

/// The producer with the configured limits.
pub(crate) fn producer(config: &Config) -> Producer {
    Producer::new(Limits {
        max_payload_bytes: config.producer.max_payload_bytes,
        max_header_bytes: config.producer.max_header_bytes,
    })
}

async fn setup(config: &Config) -> anyhow::Result<Store> {
    let store = connect(config, "setup").await?;
    println!("migrated; the application's tables exist");
    Ok(store)
}

async fn write(config: &Config, args: WriteArgs) -> anyhow::Result<()> {
    let store = connect(config, "writer").await?;
    let records = Records::new(store.connection().clone(), producer(config));
    let stats = Arc::new(LoadStats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let settings = LoadSettings {
        writers: args.writers.max(1),
        rate: args.rate,
        mix: Mix::default(),
        seed: args.seed,
    };
    let load = tokio::spawn(load::run(records, settings, stats.clone(), stop.clone()));
    let mut term = signal(SignalKind::terminate())?;
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    let until = async {
        if args.duration == 0 {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(Duration::from_secs(args.duration)).await;
    };
    tokio::pin!(until);
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            () = &mut until => break,
            _ = tick.tick() => println!(
                "committed {} transactions ({} with an event, {} undeclared-only updates), {} rolled back",
                stats.total(),
                stats.with_event.load(Ordering::Relaxed),
                stats.undeclared_only.load(Ordering::Relaxed),
                stats.failed.load(Ordering::Relaxed),
            ),
        }
    }
    stop.store(true, Ordering::Relaxed);
    load.await?;
    println!("stopped after {} committed transactions", stats.total());
    Ok(())
}

async fn consume(config: &Config, args: ConsumeArgs) -> anyhow::Result<()> {
    let store = connect(config, "consumer").await?;
    let target = ConsumerTarget {
        redis_url: config.redis.url()?.expose().to_owned(),
        key_prefix: config.redis.key_prefix.clone(),
        member: args
            .member
            .unwrap_or_else(|| format!("{}-{}", outpost::health::hostname(), std::process::id())),
    };
    let mut term = signal(SignalKind::terminate())?;
    println!(
        "keeping record_view from {}; SIGTERM or Ctrl-C to stop",
        projection::stream()
    );
    let stats = projection::run(&target, store.connection().clone(), async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    })
    .await?;
    println!("stopped: {stats:?}");
    Ok(())
}

async fn verify_cmd(config: &Config) -> anyhow::Result<bool> {
    let store = connect(config, "verify").await?;
    let verdict = verify::verify(store.connection()).await?;
    println!("{verdict}");
    Ok(verdict.passed())
}
