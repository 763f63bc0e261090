//! `outpost bench ...`: the benchmarks whose results are published in docs/benchmarks.md.
//!
//! Every benchmark works in a scratch database of its own on the server named by `database.url`
//! (`outpost_bench_*`, dropped at the end), never in the configured database itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};

use crate::config::Config;
use crate::dispatch::wakeup::{Action, WakePolicy, Wakeup};
use crate::produce::load::{LoadReport, LoadSpec, WriteTarget, run_load};
use crate::produce::{Limits, Producer};
use crate::store::{self, ConnectSettings, NodeInfo, Nudge, NudgeListener, Store, admin};

/// Which benchmark.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Producer commit throughput: Outpost's schema against a plain table without triggers.
    Producer(ProducerBench),
    /// Relay drain throughput against a bare relay loop, commit-to-stream latency under steady
    /// load, and the cost of an idle node.
    Relay(super::bench_relay::RelayBench),
    /// Consumer helper throughput with the inbox in PostgreSQL, one and two members, against a
    /// bare consumer loop.
    Consumer(super::bench_consumer::ConsumerBench),
    /// Producer throughput while the janitor deletes old rows, and a soak through a node with
    /// retention on.
    Retention(super::bench_retention::RetentionBench),
    /// Rate limits over a cluster: the measured rate beside a global limit, and the other
    /// streams' throughput while one stream is limited.
    Rate(super::bench_rate::RateBench),
    /// The operator surface over a large outbox and history: overview, event search (first and
    /// deep page), dead-letter filter, with their plans.
    Admin(super::bench_admin::AdminBench),
}

/// Options of `outpost bench producer`.
#[derive(Debug, Args)]
pub struct ProducerBench {
    /// Concurrent producers.
    #[arg(long, default_value_t = 16)]
    writers: u32,
    /// Events written in each 1-event-per-transaction run.
    #[arg(long, default_value_t = 60_000)]
    events_single: u64,
    /// Events written in each 100-events-per-transaction run.
    #[arg(long, default_value_t = 600_000)]
    events_batch: u64,
    /// Distinct aggregates.
    #[arg(long, default_value_t = 10_000)]
    aggregates: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 250)]
    payload_bytes: usize,
    /// Rounds per configuration; the median round is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

pub(super) async fn run(config: &Config, which: BenchCommand) -> anyhow::Result<()> {
    match which {
        BenchCommand::Producer(args) => producer(config, args).await,
        BenchCommand::Relay(args) => super::bench_relay::run(config, args).await,
        BenchCommand::Consumer(args) => super::bench_consumer::run(config, args).await,
        BenchCommand::Retention(args) => super::bench_retention::run(config, args).await,
        BenchCommand::Rate(args) => super::bench_rate::run(config, args).await,
        BenchCommand::Admin(args) => super::bench_admin::run(config, args).await,
    }
}

/// The nudge mechanism under test, as a relay would drive it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// A node that polls while it finds work and asks for nudges after `idle_after` without.
    /// "Work" is any new row (the outbox's id sequence moved), standing in for a relay whose
    /// claims find rows.
    Adaptive,
    /// A node that always asks for nudges: every producer statement sends a NOTIFY.
    AlwaysNudge,
}

async fn producer(config: &Config, args: ProducerBench) -> anyhow::Result<()> {
    let server = config.database.url()?.expose().to_owned();
    let name = "outpost_bench_producer";
    admin::drop_database(&server, name).await?;
    admin::create_database(&server, name, None).await?;
    let url = admin::database_url(&server, name)?;
    let settings = ConnectSettings::new(url.clone(), "outpost bench", args.writers + 4);
    let store = Store::connect(&settings).await?;
    store::migrate_up(&store).await?;
    store.create_plain_table().await?;
    let producer = Producer::new(Limits::default());
    let policy = WakePolicy {
        busy_poll: config.relay.busy_poll(),
        idle_after: config.relay.idle_after(),
    };
    let heartbeat = config.node.heartbeat();

    println!(
        "producer commit throughput, {} writers, {} aggregates, {}-byte payloads",
        args.writers, args.aggregates, args.payload_bytes
    );
    println!(
        "{:<8} {:<30} {:>9} {:>11} {:>11} {:>7} {:>8}",
        "tx size", "table", "events", "commits/s", "events/s", "ratio", "nudges"
    );
    let configs = [
        ("plain table (no triggers)", None),
        ("outpost, adaptive nudge", Some(Listener::Adaptive)),
        ("outpost, nudge every commit", Some(Listener::AlwaysNudge)),
    ];
    for (tx_size, count) in [(1u32, args.events_single), (100, args.events_batch)] {
        let spec = |target| LoadSpec {
            count,
            rate: None,
            aggregates: args.aggregates,
            aggregate_type: "bench".to_owned(),
            event_type: "bench.tick".to_owned(),
            payload_bytes: args.payload_bytes,
            tx_size,
            writers: args.writers,
            target,
        };
        // Rounds alternate between the configurations so that drift of the machine (cache,
        // checkpoints, other load) hits all of them alike.
        let mut results: Vec<Vec<(LoadReport, u64)>> = vec![Vec::new(); configs.len()];
        for _ in 0..args.rounds.max(1) {
            for (i, (_, listener)) in configs.iter().enumerate() {
                store.reset_bench_tables().await?;
                let outcome = match listener {
                    None => {
                        let r = run_load(
                            &store,
                            &producer,
                            &spec(WriteTarget::PlainTable),
                            super::bench_relay::noop(),
                        )
                        .await?;
                        (r, 0)
                    }
                    Some(mode) => {
                        let stop = Arc::new(AtomicBool::new(false));
                        let handle = tokio::spawn(listen(
                            url.clone(),
                            store.clone(),
                            *mode,
                            policy,
                            heartbeat,
                            stop.clone(),
                        ));
                        let r = run_load(
                            &store,
                            &producer,
                            &spec(WriteTarget::Outbox),
                            super::bench_relay::noop(),
                        )
                        .await?;
                        stop.store(true, Ordering::Relaxed);
                        (r, handle.await??)
                    }
                };
                results[i].push(outcome);
            }
        }
        let medians: Vec<(LoadReport, u64)> = results.into_iter().map(median).collect();
        for ((label, _), (report, nudges)) in configs.iter().zip(&medians) {
            print_row(tx_size, label, report, &medians[0].0, *nudges);
        }
    }
    drop(store);
    admin::drop_database(&server, name).await?;
    Ok(())
}

/// The round with the median commit rate.
fn median(mut rounds: Vec<(LoadReport, u64)>) -> (LoadReport, u64) {
    rounds.sort_by(|a, b| a.0.commits_per_sec().total_cmp(&b.0.commits_per_sec()));
    let mid = rounds.len() / 2;
    rounds.swap_remove(mid)
}

fn print_row(tx_size: u32, label: &str, r: &LoadReport, baseline: &LoadReport, nudges: u64) {
    println!(
        "{:<8} {:<30} {:>9} {:>11.0} {:>11.0} {:>7.2} {:>8}",
        tx_size,
        label,
        r.events,
        r.commits_per_sec(),
        r.events_per_sec(),
        r.commits_per_sec() / baseline.commits_per_sec().max(1e-9),
        nudges
    );
}

/// A listening node for the duration of a run: registers, LISTENs, and drives `wants_nudge` as
/// the relay does with `policy` (idle, it looks for new rows every `node.heartbeat_ms`, as the
/// relay's heartbeat does). Returns the number of nudges received.
async fn listen(
    url: String,
    store: Store,
    mode: Listener,
    policy: WakePolicy,
    heartbeat: Duration,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<u64> {
    let node = NodeInfo {
        node_id: "bench-listener".to_owned(),
        hostname: String::new(),
        pid: i32::try_from(std::process::id()).unwrap_or(0),
        version: env!("CARGO_PKG_VERSION").to_owned(),
    };
    store.register_node(&node).await?;
    let mut listener = NudgeListener::connect(&url).await?;
    let mut high_water = store.outbox_high_water().await?;
    let mut wake = Wakeup::new(policy, Instant::now());
    // It sends no heartbeat: its request for nudges lasts the run (an hour at most).
    const ASKING_MS: u64 = 3_600_000;
    if mode == Listener::AlwaysNudge {
        store
            .set_wants_nudge(&node.node_id, true, ASKING_MS)
            .await?;
    }
    let mut nudges = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let wait = wake.next_wait().unwrap_or(heartbeat);
        let action = tokio::select! {
            n = listener.recv() => {
                if matches!(n?, Nudge::Partitions(_)) { nudges += 1; }
                wake.nudged(Instant::now())
            }
            () = tokio::time::sleep(wait) => {
                let now_high = store.outbox_high_water().await?;
                let found = now_high != high_water;
                high_water = now_high;
                wake.polled(found, Instant::now())
            }
        };
        if mode == Listener::Adaptive {
            match action {
                Action::AskForNudges => {
                    store
                        .set_wants_nudge(&node.node_id, true, ASKING_MS)
                        .await?;
                }
                Action::StopNudges => {
                    store
                        .set_wants_nudge(&node.node_id, false, ASKING_MS)
                        .await?;
                }
                Action::None => {}
            }
        }
    }
    store.deregister_node(&node.node_id).await?;
    Ok(nudges)
}
