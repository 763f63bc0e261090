//! `outpost-records bench`: the records scenario's transactions per second with and without the
//! event fact — same schema, same mix, same writers — on fresh scratch databases, in alternating
//! rounds. The difference is what the decision record's guarantee costs the application.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use outpost::config::Config;
use outpost::store::admin;

use crate::load::{self, LoadSettings, LoadStats, Mix};
use crate::service::{Events, Records};

/// Options of `bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Seconds of writing per round.
    #[arg(long, default_value_t = 20)]
    pub duration: u64,
    /// Concurrent writers.
    #[arg(long, default_value_t = 8)]
    pub writers: usize,
    /// Rounds of each variant (alternating, so drift of the machine hits both alike; the
    /// median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// Seed of the mix (the same for every round).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

const SCRATCH: &str = "outpost_records_bench";

pub(super) async fn run(config: &Config, args: BenchArgs) -> anyhow::Result<()> {
    let server = config.database.url()?.expose().to_owned();
    println!(
        "records scenario, {} writers, {} s per round, {} rounds each (no relay running: the \
         producer side alone)",
        args.writers, args.duration, args.rounds
    );
    let mut results: Vec<(Events, f64, u64)> = Vec::new();
    for round in 1..=args.rounds {
        for events in [Events::Emit, Events::Omit] {
            let (rate, with_event) = one_round(config, &server, &args, events).await?;
            println!(
                "round {round} {:<18} {rate:>8.0} transactions/s ({with_event} event facts)",
                label(events)
            );
            results.push((events, rate, with_event));
        }
    }
    admin::drop_database(&server, SCRATCH).await?;
    // The median, not the mean: on a shared machine one round can be slowed by others.
    let median = |e: Events| {
        let mut r: Vec<f64> = results.iter().filter(|x| x.0 == e).map(|x| x.1).collect();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied().unwrap_or(0.0)
    };
    let (with, without) = (median(Events::Emit), median(Events::Omit));
    println!(
        "median: {with:.0} transactions/s with the event fact, {without:.0} without ({:+.1} %)",
        (with / without.max(f64::MIN_POSITIVE) - 1.0) * 100.0
    );
    Ok(())
}

fn label(events: Events) -> &'static str {
    match events {
        Events::Emit => "with event fact",
        Events::Omit => "without event fact",
    }
}

async fn one_round(
    config: &Config,
    server: &str,
    args: &BenchArgs,
    events: Events,
) -> anyhow::Result<(f64, u64)> {
    admin::drop_database(server, SCRATCH).await?;
    admin::create_database(server, SCRATCH, None).await?;
    let url = admin::database_url(server, SCRATCH)?;
    let store = super::open(&url, args.writers as u32 + 2, "bench").await?;
    let records = Records::with_events(store.connection().clone(), super::producer(config), events);
    let stats = Arc::new(LoadStats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let settings = LoadSettings {
        writers: args.writers.max(1),
        rate: 0,
        mix: Mix::default(),
        seed: args.seed,
    };
    let started = Instant::now();
    let load = tokio::spawn(load::run(records, settings, stats.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_secs(args.duration)).await;
    stop.store(true, Ordering::Relaxed);
    load.await?;
    let elapsed = started.elapsed().as_secs_f64();
    store.connection().clone().close().await.ok();
    Ok((
        stats.total() as f64 / elapsed,
        stats.with_event.load(Ordering::Relaxed),
    ))
}
