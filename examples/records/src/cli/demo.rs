//! `outpost-records demo` (and `outpost demo`, which runs it): the records scenario end to end.
//!
//! 1. A fresh database (`--database`, on the server of `database.url`), Outpost's migrations and
//!    the application's tables; the Redis of `redis.url`, or a private one (see
//!    `redis_server`), under a key prefix of the demo's own.
//! 2. `--nodes` relay nodes in this process, each as `outpost run` starts one.
//! 3. The consumer keeping the read model, and the writers.
//! 4. A progress line each second: transactions committed, event facts committed, published and
//!    applied, and the backlog.
//! 5. After `--duration` or Ctrl-C: the writers stop, the relay and the consumer drain, and the
//!    verdict is printed (exit status 1 when it fails).
//!
//! The database is picked in one place ([`DemoDatabase`]), so the embedded default can take
//! over there when it exists.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use outpost::app;
use outpost::config::{Config, LoadOptions};
use outpost::store::{Actor, Role, Store, admin};
use sea_orm::{
    AccessMode, ColumnTrait, DatabaseConnection, EntityTrait, IsolationLevel, PaginatorTrait,
    QueryFilter, TransactionTrait,
};

use super::redis_server::{self, DemoRedis};
use crate::load::{self, LoadSettings, LoadStats, Mix};
use crate::model::applied;
use crate::projection::{self, ConsumerTarget};
use crate::service::{AGGREGATE, Records};
use crate::verify;

/// Options of `demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Seconds of writing before the verdict (Ctrl-C ends it sooner).
    #[arg(long, default_value_t = 30)]
    pub duration: u64,
    /// Relay nodes (they share the partitions through leases).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=4))]
    pub nodes: u8,
    /// Concurrent writers.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Transactions per second over all writers (0: as fast as they go).
    #[arg(long, default_value_t = 0)]
    pub rate: u32,
    /// Seed of the writers' mix.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The demo's database on the server of `database.url` (dropped and created at the start).
    #[arg(long, default_value = "outpost_demo")]
    pub database: String,
    /// The demo's Redis key prefix (its keys are deleted at the start).
    #[arg(long, default_value = "outpost-demo:")]
    pub key_prefix: String,
    /// Drop the database and delete the keys at the end (they are kept for a look otherwise).
    #[arg(long)]
    pub drop: bool,
    /// Seconds to wait for the relay and the consumer to catch up after the writers stopped.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout: u64,
}

/// Where the demo keeps its data.
enum DemoDatabase {
    /// A database of its own on the PostgreSQL server of `database.url`.
    Postgres { server: String, name: String },
}

impl DemoDatabase {
    fn pick(config: &Config, args: &DemoArgs) -> anyhow::Result<Self> {
        let server = config.database.url().context(
            "the demo creates its database on the server of database.url: set it (e.g. \
             OUTPOST_DATABASE__URL=postgres://postgres@127.0.0.1:5432/postgres)",
        )?;
        Ok(DemoDatabase::Postgres {
            server: server.expose().to_owned(),
            name: args.database.clone(),
        })
    }

    /// Creates it afresh and returns its URL.
    async fn create(&self, shown: &str) -> anyhow::Result<String> {
        match self {
            DemoDatabase::Postgres { server, name } => {
                admin::drop_database(server, name).await.with_context(|| {
                    format!(
                        "preparing database {name} on the PostgreSQL server of database.url \
                         ({shown})"
                    )
                })?;
                admin::create_database(server, name, None).await?;
                Ok(admin::database_url(server, name)?)
            }
        }
    }

    async fn drop(&self) -> anyhow::Result<()> {
        match self {
            DemoDatabase::Postgres { server, name } => {
                Ok(admin::drop_database(server, name).await?)
            }
        }
    }

    fn describe(&self, shown: &str) -> String {
        match self {
            DemoDatabase::Postgres { name, .. } => {
                format!("PostgreSQL database {name} (on the server of {shown})")
            }
        }
    }
}

/// Runs the demo; `Ok(false)` when the verdict fails.
pub(super) async fn run(
    config: &Config,
    options: &LoadOptions,
    args: DemoArgs,
) -> anyhow::Result<bool> {
    let shown_db = config.database.url()?.to_string();
    let database = DemoDatabase::pick(config, &args)?;
    let redis_cfg = config
        .redis
        .url()
        .context("set redis.url (e.g. OUTPOST_REDIS__URL=redis://127.0.0.1:6379)")?;
    let redis = redis_server::pick(redis_cfg.expose(), &redis_cfg.to_string()).await?;
    println!("outpost demo: the records scenario, {} s", args.duration);
    println!("  database  {}", database.describe(&shown_db));
    println!(
        "  redis     {}, keys under {:?}",
        redis.label, args.key_prefix
    );
    if !redis.is_private() {
        redis_server::delete_prefix(&redis.url, &args.key_prefix).await?;
    }
    let url = database.create(&shown_db).await?;
    let store = super::open(&url, (args.writers as u32 + 8).min(64), "demo").await?;

    let outcome = scenario(config, options, &args, &redis, &url, &store).await;
    store.connection().clone().close().await.ok();
    if args.drop {
        database.drop().await?;
        if !redis.is_private() {
            redis_server::delete_prefix(&redis.url, &args.key_prefix).await?;
        }
    } else if outcome.is_ok() {
        println!(
            "kept for a look: database {} and the keys under {:?} (`--drop` removes them)",
            args.database, args.key_prefix
        );
    }
    drop(redis);
    outcome
}

async fn scenario(
    config: &Config,
    options: &LoadOptions,
    args: &DemoArgs,
    redis: &DemoRedis,
    url: &str,
    store: &Store,
) -> anyhow::Result<bool> {
    let db = store.connection().clone();
    let mut nodes = Vec::with_capacity(usize::from(args.nodes));
    for i in 1..=args.nodes {
        let node_config = node_config(options, url, redis, &args.key_prefix, i)?;
        let handle = tokio::task::spawn_blocking(move || app::start(&node_config))
            .await?
            .context("starting a relay node")?;
        println!(
            "  relay     node {} (metrics, /livez, /readyz on http://{})",
            handle.node_id(),
            handle.admin_addr()
        );
        nodes.push(handle);
    }
    if let Some(first) = nodes.first() {
        // An operator token for this run, so the panel can be opened at once (the demo's
        // database is its own; the token goes with it).
        let admin = Actor::new("outpost demo", Role::Admin);
        let name = format!("demo-{}", chrono::Utc::now().format("%Y%m%d-%H%M%S"));
        let token = store
            .create_token(&admin, &name, Role::Operator)
            .await
            .context("creating the demo's operator token")?;
        println!(
            "  panel     http://{}/panel (log in with the operator token {})",
            first.admin_addr(),
            token.token
        );
    }

    let (stop_consumer, consumer_stopped) = tokio::sync::watch::channel(false);
    let target = ConsumerTarget {
        redis_url: redis.url.clone(),
        key_prefix: args.key_prefix.clone(),
        member: "demo-consumer".to_owned(),
    };
    let consumer = tokio::spawn({
        let db = db.clone();
        let mut rx = consumer_stopped;
        async move {
            projection::run(&target, db, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
        }
    });

    let stats = Arc::new(LoadStats::default());
    let stop_writers = Arc::new(AtomicBool::new(false));
    let records = Records::new(db.clone(), super::producer(config));
    let settings = LoadSettings {
        writers: args.writers.max(1),
        rate: args.rate,
        mix: Mix::default(),
        seed: args.seed,
    };
    println!(
        "  writers   {} ({}), consumer group {} on {}{}",
        settings.writers,
        if args.rate == 0 {
            "as fast as they go".to_owned()
        } else {
            format!("{} transactions/s", args.rate)
        },
        projection::GROUP,
        args.key_prefix,
        projection::stream()
    );
    let writers = tokio::spawn(load::run(
        records,
        settings,
        stats.clone(),
        stop_writers.clone(),
    ));

    let mut progress = Progress::new(&db, &stats);
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let end = tokio::time::sleep(Duration::from_secs(args.duration));
    tokio::pin!(end);
    let mut interrupted = false;
    loop {
        tokio::select! {
            () = &mut end => break,
            _ = tokio::signal::ctrl_c() => { interrupted = true; break; }
            _ = tick.tick() => { progress.show("writing").await; }
        }
        if consumer.is_finished() {
            break;
        }
    }
    stop_writers.store(true, Ordering::Relaxed);
    writers.await?;
    let wrote_for = started.elapsed();
    progress.show("writers stopped").await;

    // Drain: the relay publishes the backlog, the consumer applies it.
    let deadline = Instant::now() + Duration::from_secs(args.drain_timeout);
    let drained = loop {
        let counts = progress.show("draining").await;
        if counts.is_some_and(|c| c.backlog == 0 && c.applied >= c.committed) {
            break true;
        }
        if Instant::now() > deadline || consumer.is_finished() {
            break false;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = tokio::signal::ctrl_c() => break false,
        }
    };
    progress.finish();
    let _ = stop_consumer.send(true);
    let consumer_result = consumer.await?;
    for n in nodes {
        n.shutdown().await;
    }
    let consumer_stats = consumer_result.context("the consumer failed")?;

    let total = stats.total();
    println!(
        "wrote {} transactions in {:.1} s ({:.0}/s){}, {} rolled back",
        total,
        wrote_for.as_secs_f64(),
        total as f64 / wrote_for.as_secs_f64().max(0.001),
        if interrupted { ", interrupted" } else { "" },
        stats.failed.load(Ordering::Relaxed),
    );
    println!(
        "consumer: {} applied, {} duplicates skipped, {} dead-lettered",
        consumer_stats.processed, consumer_stats.duplicates, consumer_stats.dead_lettered
    );
    if !drained {
        println!(
            "the relay and the consumer did not catch up within {} s (--drain-timeout): what \
             is missing is counted as lost below",
            args.drain_timeout
        );
    }
    let verdict = verify::verify(&db).await?;
    println!("{verdict}");
    Ok(verdict.passed())
}

/// The node's configuration: the user's (file, environment, `--set`), pointed at the demo's
/// database, Redis and prefix, with a node id of its own and the admin endpoint on a free port.
fn node_config(
    options: &LoadOptions,
    url: &str,
    redis: &DemoRedis,
    prefix: &str,
    index: u8,
) -> anyhow::Result<Config> {
    let mut opts = options.clone();
    opts.overrides.extend(
        [
            ("database.url", url.to_owned()),
            ("redis.url", redis.url.clone()),
            ("redis.key_prefix", prefix.to_owned()),
            ("node.id", format!("demo-{index}")),
            ("admin.listen", "127.0.0.1:0".to_owned()),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    outpost::config::load(&opts).map_err(|e| anyhow::anyhow!("the node's configuration: {e}"))
}

#[derive(Debug, Clone, Copy)]
struct Counts {
    committed: u64,
    published: u64,
    applied: u64,
    backlog: u64,
}

/// The live line.
struct Progress<'a> {
    db: &'a DatabaseConnection,
    stats: &'a LoadStats,
    tty: bool,
    last_print: Option<Instant>,
}

impl<'a> Progress<'a> {
    fn new(db: &'a DatabaseConnection, stats: &'a LoadStats) -> Self {
        Self {
            db,
            stats,
            tty: std::io::stdout().is_terminal(),
            last_print: None,
        }
    }

    /// The three counts from one snapshot, so an event moving from the outbox to the published
    /// history between two counts is counted once.
    async fn counts(&self) -> Result<Counts, sea_orm::DbErr> {
        use entity::{outpost_event as outbox, outpost_published as published};
        let txn = self
            .db
            .begin_with_config(
                Some(IsolationLevel::RepeatableRead),
                Some(AccessMode::ReadOnly),
            )
            .await?;
        let backlog = outbox::Entity::find()
            .filter(outbox::Column::AggregateType.eq(AGGREGATE))
            .count(&txn)
            .await?;
        let published = published::Entity::find()
            .filter(published::Column::AggregateType.eq(AGGREGATE))
            .count(&txn)
            .await?;
        let applied = applied::Entity::find().count(&txn).await?;
        txn.commit().await?;
        Ok(Counts {
            committed: backlog + published,
            published,
            applied,
            backlog,
        })
    }

    /// Prints the line (in place on a terminal; every five seconds otherwise).
    async fn show(&mut self, phase: &str) -> Option<Counts> {
        let counts = match self.counts().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "could not count the progress");
                return None;
            }
        };
        let due = self
            .last_print
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(5));
        if self.tty || due {
            let line = format!(
                "{phase:>15}: {} transactions; events committed {}, published {}, applied {}, \
                 backlog {}",
                self.stats.total(),
                counts.committed,
                counts.published,
                counts.applied,
                counts.backlog
            );
            let mut out = std::io::stdout().lock();
            if self.tty {
                let _ = write!(out, "\r\x1b[2K{line}");
            } else {
                let _ = writeln!(out, "{line}");
            }
            let _ = out.flush();
            self.last_print = Some(Instant::now());
        }
        Some(counts)
    }

    fn finish(&self) {
        if self.tty {
            println!();
        }
    }
}
