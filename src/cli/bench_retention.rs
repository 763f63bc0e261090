//! `outpost bench retention`: producer commit throughput while the janitor deletes a large
//! backlog of old rows, against the same load without it (`cleanup`); and a soak of events
//! through a relay node with retention on, sampling the outbox's size (`soak`).
//!
//! Works in a scratch database `outpost_bench_retention` on the server of `database.url`
//! (dropped and created at the start, dropped at the end) and under a Redis key prefix of its own
//! (`bench:<random>:`, deleted at the end).

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};

use super::bench_relay::{noop, stream_entries};
use super::scratch::Scratch;
use crate::app;
use crate::config::{Config, Secret};
use crate::dispatch::housekeeping;
use crate::produce::load::{LoadReport, LoadSpec, WriteTarget, run_load};
use crate::produce::{Limits, Producer};
use crate::store::Store;

const DB_NAME: &str = "outpost_bench_retention";

/// Which part of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// Producer throughput with and without the janitor deleting old rows.
    Cleanup,
    /// Events through a relay node with retention on; the outbox's size over time.
    Soak,
}

/// Options of `outpost bench retention`.
#[derive(Debug, Args)]
pub struct RetentionBench {
    /// Old published rows preloaded for the janitor to delete (cleanup part).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    old_rows: u64,
    /// Events written per round, one per transaction (cleanup part).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    events: u64,
    /// Concurrent producers.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    writers: u32,
    /// Rounds per configuration (cleanup part); the median round is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Events through the relay (soak part).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    soak_events: u64,
    /// Offered rate of the soak, events per second (transactions of 10 events).
    #[arg(long, default_value_t = 4000, value_parser = clap::value_parser!(u32).range(1..))]
    soak_rate: u32,
    /// `retention.published_secs` during the soak (also the trim age of its stream).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    soak_retention_secs: u64,
    /// How long to keep sampling after the outbox emptied (soak part).
    #[arg(long, default_value_t = 60)]
    soak_hold_secs: u64,
    /// Set `retention.vacuum` for the soak (the janitor vacuums the table after deleting).
    #[arg(long)]
    vacuum: bool,
    /// Run one part only (default: both).
    #[arg(long, value_enum)]
    only: Option<Part>,
}

pub(super) async fn run(config: &Config, args: RetentionBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(config, DB_NAME).await?;
    let outcome = async {
        let store = scratch.store(args.writers + 4, "retention").await?;
        let wants = |p: Part| args.only.is_none_or(|o| o == p);
        if wants(Part::Cleanup) {
            cleanup(config, &args, &store).await?;
        }
        if wants(Part::Soak) {
            let mut rconn = scratch.rconn.clone();
            soak(
                config,
                &args,
                &store,
                &scratch.url,
                &scratch.prefix,
                &mut rconn,
            )
            .await?;
        }
        store.connection().clone().close().await.ok();
        Ok::<_, anyhow::Error>(())
    }
    .await;
    scratch.finish(outcome).await
}

fn producer(config: &Config) -> Producer {
    Producer::new(Limits {
        max_payload_bytes: config.producer.max_payload_bytes,
        max_header_bytes: config.producer.max_header_bytes,
    })
}

fn spec(count: u64, rate: Option<NonZeroU32>, tx_size: u32, writers: u32) -> LoadSpec {
    LoadSpec {
        count,
        rate,
        aggregates: 10_000,
        aggregate_type: "bench".to_owned(),
        event_type: "bench.tick".to_owned(),
        payload_bytes: 250,
        tx_size,
        writers,
        target: WriteTarget::Outbox,
    }
}

async fn cleanup(config: &Config, args: &RetentionBench, store: &Store) -> anyhow::Result<()> {
    let producer = producer(config);
    let started = Instant::now();
    run_load(
        store,
        &producer,
        &spec(args.old_rows, None, 1000, 4),
        noop(),
    )
    .await?;
    store.age_as_published(None, 2 * 86_400).await?;
    store.vacuum_analyze_outbox().await?;
    let retention = config.retention.clone();
    println!(
        "== cleanup: {} published rows two days old preloaded ({:.0} s); janitor with \
         retention.batch_rows = {}, retention.batch_pause_ms = {}",
        args.old_rows,
        started.elapsed().as_secs_f64(),
        retention.batch_rows,
        retention.batch_pause_ms
    );
    println!(
        "{:<6} {:<22} {:>9} {:>11} {:>14}",
        "round", "janitor", "events", "commits/s", "deleted/s"
    );
    let round_load = spec(args.events, None, 1, args.writers);
    let mut without: Vec<LoadReport> = Vec::new();
    let mut with: Vec<(LoadReport, f64)> = Vec::new();
    for round in 1..=args.rounds {
        // Rounds alternate, so drift of the machine hits both alike.
        let r = run_load(store, &producer, &round_load, noop()).await?;
        println!(
            "{round:<6} {:<22} {:>9} {:>11.0} {:>14}",
            "off",
            r.events,
            r.commits_per_sec(),
            "-"
        );
        without.push(r);

        // Deleted rows are counted from the history table, which only the janitor changes here.
        let before = store.published_rows().await?;
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let janitor = {
            let (store, retention) = (store.clone(), retention.clone());
            tokio::spawn(async move {
                tokio::select! {
                    swept = housekeeping::sweep(&store, &retention) => swept.map(|_| ()),
                    _ = &mut stop_rx => Ok(()),
                }
            })
        };
        let r = run_load(store, &producer, &round_load, noop()).await?;
        let _ = stop_tx.send(());
        janitor.await??;
        let after = store.published_rows().await?;
        let deleted = before - after;
        let rate = deleted as f64 / r.elapsed.as_secs_f64();
        println!(
            "{round:<6} {:<22} {:>9} {:>11.0} {:>14.0}",
            "deleting old rows",
            r.events,
            r.commits_per_sec(),
            rate
        );
        if after == 0 {
            bail!(
                "the janitor ran out of old rows during round {round}: preload more (--old-rows) or write fewer events per round (--events)"
            );
        }
        with.push((r, rate));
    }
    without.sort_by(|a, b| a.commits_per_sec().total_cmp(&b.commits_per_sec()));
    with.sort_by(|a, b| a.0.commits_per_sec().total_cmp(&b.0.commits_per_sec()));
    let base = without[without.len() / 2].commits_per_sec();
    let (cleaning, rate) = &with[with.len() / 2];
    println!(
        "median: {base:.0} commits/s without the janitor, {:.0} with it ({:.0} rows deleted/s): \
         ratio {:.3}",
        cleaning.commits_per_sec(),
        rate,
        cleaning.commits_per_sec() / base.max(1e-9)
    );
    store.truncate_outbox().await?;
    Ok(())
}

async fn soak(
    config: &Config,
    args: &RetentionBench,
    store: &Store,
    url: &str,
    prefix: &str,
    rconn: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<()> {
    store.truncate_outbox().await?;
    store.vacuum_analyze_outbox().await?;
    let keep = args.soak_retention_secs;
    let mut cfg = config.clone();
    cfg.database.url = Some(Secret::new(url.to_owned()));
    cfg.redis.key_prefix = prefix.to_owned();
    cfg.node.id = "bench-soak".to_owned();
    cfg.admin.listen = "127.0.0.1:0".to_owned();
    cfg.relay.delete_published = false;
    cfg.retention.enabled = true;
    cfg.retention.published_secs = keep;
    cfg.retention.republish_window_secs = keep.min(cfg.retention.republish_window_secs);
    cfg.retention.interval_ms = 5000;
    cfg.retention.vacuum = args.vacuum;
    cfg.retention.trim_streams = true;
    cfg.retention.trim_interval_ms = 5000;
    cfg.retention.trim_ungrouped_after_secs = keep;
    let node = tokio::task::spawn_blocking(move || app::start(&cfg))
        .await
        .context("the node's start-up thread failed")?
        .context("starting the node")?;
    let base = store.storage_figures().await?;
    println!(
        "== soak: {} events at {}/s offered (10 per transaction, {} writers) through a node with \
         retention.published_secs = {keep}, janitor every 5 s, retention.vacuum = {}; the stream \
         is trimmed by age ({keep} s)",
        args.soak_events, args.soak_rate, args.writers, args.vacuum
    );
    println!(
        "{:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10}",
        "t (s)",
        "rows",
        "dead",
        "table MiB",
        "index MiB",
        "published",
        "publ. MiB",
        "total MiB",
        "stream"
    );
    let mib = |b: i64| b as f64 / 1_048_576.0;
    let t0 = Instant::now();
    let sample =
        async |rconn: &mut redis::aio::MultiplexedConnection| -> anyhow::Result<(i64, i64)> {
            let f = store.storage_figures().await?;
            let rows = store.outbox_rows().await?;
            let published = store.published_rows().await?;
            let entries = stream_entries(rconn, &format!("{prefix}*")).await?;
            let total = f.table_bytes + f.index_bytes + f.published_bytes;
            println!(
                "{:>7.0} {:>10} {:>10} {:>10.1} {:>10.1} {:>10} {:>12.1} {:>10.1} {:>10}",
                t0.elapsed().as_secs_f64(),
                rows,
                f.dead_tuples,
                mib(f.table_bytes),
                mib(f.index_bytes),
                published,
                mib(f.published_bytes),
                mib(total),
                entries
            );
            Ok((rows + published, total))
        };
    sample(rconn).await?;
    let load = {
        let (store, producer, spec) = (
            store.clone(),
            producer(config),
            spec(
                args.soak_events,
                NonZeroU32::new(args.soak_rate),
                10,
                args.writers,
            ),
        );
        tokio::spawn(async move { run_load(&store, &producer, &spec, noop()).await })
    };
    let every = Duration::from_secs(10);
    let mut sizes: Vec<(f64, i64)> = Vec::new();
    while !load.is_finished() {
        tokio::time::sleep(every).await;
        let (_, size) = sample(rconn).await?;
        sizes.push((t0.elapsed().as_secs_f64(), size));
    }
    let report = load.await??;
    let load_secs = t0.elapsed().as_secs_f64();
    println!(
        "load done: {} events in {:.0} s ({:.0}/s)",
        report.events,
        report.elapsed.as_secs_f64(),
        report.events_per_sec()
    );
    let deadline = Instant::now() + Duration::from_secs(keep + 600);
    loop {
        tokio::time::sleep(every).await;
        let (rows, size) = sample(rconn).await?;
        sizes.push((t0.elapsed().as_secs_f64(), size));
        if rows == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the outbox and the published history did not empty within {} s after the load",
                keep + 600
            );
        }
    }
    let emptied = t0.elapsed().as_secs_f64();
    let hold_until = Instant::now() + Duration::from_secs(args.soak_hold_secs);
    while Instant::now() < hold_until {
        tokio::time::sleep(every).await;
        let (_, size) = sample(rconn).await?;
        sizes.push((t0.elapsed().as_secs_f64(), size));
    }
    node.shutdown().await;
    let steady: Vec<i64> = sizes
        .iter()
        .filter(|(t, _)| *t > (keep as f64) * 3.0 && *t <= load_secs)
        .map(|(_, s)| *s)
        .collect();
    let peak = sizes.iter().map(|(_, s)| *s).max().unwrap_or(0);
    let end = sizes.last().map_or(0, |(_, s)| *s);
    println!(
        "baseline (empty) {:.1} MiB; during the load after 3 × retention: {:.1}–{:.1} MiB; peak \
         {:.1} MiB; outbox and history empty after {:.0} s; at the end {:.1} MiB",
        mib(base.table_bytes + base.index_bytes + base.published_bytes),
        mib(steady.iter().copied().min().unwrap_or(0)),
        mib(steady.iter().copied().max().unwrap_or(0)),
        mib(peak),
        emptied,
        mib(end)
    );
    Ok(())
}
