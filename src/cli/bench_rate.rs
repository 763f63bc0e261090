//! `outpost bench rate`: whether rate limits hold for a cluster, and whether a limited stream
//! holds up the partitions of the others.
//!
//! 1. **Global limit**: `--nodes` nodes drain a backlog under `rate_limit.global_per_sec =
//!    --global`; the cluster's rate is measured from the streams' lengths over `--secs` seconds
//!    after a warm-up (which lets the initial burst out), beside the limit.
//! 2. **Isolation**, twice: first the events go to one stream per partition (`routing.stream =
//!    "rate:{partition}"`) and the stream of partition 0 is the limited one; then two streams
//!    share every partition, and the limited stream's backlog is the oldest rows of each (eight
//!    claims' worth), ahead of `--events` rows of the other stream. Each time the nodes drain
//!    the backlog once without limits and once with the limited stream at `--stream-limit`
//!    events/s, and the other streams' throughput (from their first entry to their last) is
//!    compared between the two runs: a limit on one stream should cost the others nothing.
//!
//! Works in a scratch database `outpost_bench_rate` and under a Redis key prefix of its own, as
//! the other benchmarks do. Nodes run in this process.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

use super::bench_relay::{Load, preload, preload_more, print_run_header, stream_entries};
use super::scratch::Scratch;
use super::scratch::delete_prefix_keys;
use crate::app::{self, NodeHandle};
use crate::config::{Config, Secret};
use crate::store::Store;

const DB_NAME: &str = "outpost_bench_rate";
/// How often the streams' lengths are read.
const POLL: Duration = Duration::from_millis(100);
/// How long a drain may go without progress before the run is given up.
const STALL: Duration = Duration::from_secs(60);

/// Options of `outpost bench rate`.
#[derive(Debug, Args)]
pub struct RateBench {
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// `rate_limit.global_per_sec` of the first part (events/s).
    #[arg(long, default_value_t = 3_000)]
    global: u32,
    /// Seconds the first part's rate is measured over, after a warm-up of 5 s.
    #[arg(long, default_value_t = 20)]
    secs: u64,
    /// The limit of partition 0's stream in the second part (events/s).
    #[arg(long, default_value_t = 100)]
    stream_limit: u32,
    /// Events in the second part's backlog.
    #[arg(long, default_value_t = 300_000)]
    events: u64,
    /// Distinct aggregates.
    #[arg(long, default_value_t = 10_000)]
    aggregates: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 200)]
    payload_bytes: usize,
}

/// Warm-up before the first part measures: the bucket's initial burst goes out meanwhile.
const WARM_UP: Duration = Duration::from_secs(5);

struct Bench<'a> {
    config: &'a Config,
    args: &'a RateBench,
    store: Store,
    scratch: &'a Scratch,
    partitions: u32,
}

pub(super) async fn run(config: &Config, args: RateBench) -> anyhow::Result<()> {
    if args.nodes == 0 || args.global == 0 || args.stream_limit == 0 || args.secs == 0 {
        bail!("--nodes, --global, --stream-limit and --secs must be at least 1");
    }
    let scratch = Scratch::create(config, DB_NAME).await?;
    let outcome = async {
        let store = scratch.store(4, "rate").await?;
        let bench = Bench {
            config,
            args: &args,
            partitions: store.partition_count().await?,
            store,
            scratch: &scratch,
        };
        super::scratch::until_interrupted(bench.run_parts(), &bench.store).await
    }
    .await;
    scratch.finish(outcome).await
}

impl Bench<'_> {
    async fn run_parts(&self) -> anyhow::Result<()> {
        print_run_header("rate");
        println!(
            "cluster:  {} nodes in this process; relay.workers {} each, batch_rows {}",
            self.args.nodes, self.config.relay.workers, self.config.relay.batch_rows
        );
        self.global().await?;
        self.isolation().await
    }

    /// Starts the cluster's nodes, `tweak` applied to each one's configuration (they share the
    /// partitions as they come up: the measurements leave time for it).
    async fn start(&self, tweak: impl Fn(&mut Config)) -> anyhow::Result<Vec<NodeHandle>> {
        let mut nodes = Vec::new();
        for i in 0..self.args.nodes {
            let mut cfg = self.config.clone();
            cfg.database.url = Some(Secret::new(self.scratch.url.clone()));
            cfg.redis.key_prefix = self.scratch.prefix.clone();
            cfg.node.id = format!("bench-rate-{i}");
            cfg.admin.listen = "127.0.0.1:0".to_owned();
            tweak(&mut cfg);
            let started = tokio::task::spawn_blocking(move || app::start(&cfg))
                .await
                .context("the node's start-up thread failed")?
                .context("starting a node");
            match started {
                Ok(n) => nodes.push(n),
                Err(e) => {
                    stop(nodes).await;
                    return Err(e);
                }
            }
        }
        Ok(nodes)
    }

    // -----------------------------------------------------------------------------------
    // Part 1: the global limit

    async fn global(&self) -> anyhow::Result<()> {
        let args = self.args;
        println!();
        println!(
            "== global limit: {} nodes, rate_limit.global_per_sec = {} (burst = the rate)",
            args.nodes, args.global
        );
        let window = WARM_UP + Duration::from_secs(args.secs);
        // Enough for the burst, the warm-up and the window, with a margin: the backlog must
        // outlast the measurement.
        let events = u64::from(args.global) * (window.as_secs() + 5) * 3 / 2;
        preload(
            self.config,
            &self.scratch.url,
            &self.store,
            events,
            args.aggregates,
            args.payload_bytes,
        )
        .await?;
        let global = args.global;
        let nodes = self
            .start(|c| {
                // Only the limit under test, and the streams the measurement reads.
                c.routing.stream = "events:{aggregate_type}".to_owned();
                c.routing.overrides.clear();
                c.rate_limit = Default::default();
                c.rate_limit.global_per_sec = global;
            })
            .await?;
        let pattern = format!("{}events:*", self.scratch.prefix);
        let measured = async {
            tokio::time::sleep(WARM_UP).await;
            let mut conn = self.scratch.rconn.clone();
            let mut samples = vec![(Instant::now(), stream_entries(&mut conn, &pattern).await?)];
            for _ in 0..args.secs {
                tokio::time::sleep(Duration::from_secs(1)).await;
                samples.push((Instant::now(), stream_entries(&mut conn, &pattern).await?));
            }
            Ok::<_, anyhow::Error>(samples)
        }
        .await;
        stop(nodes).await;
        let samples = measured?;
        let (first, last) = (samples[0], samples[samples.len() - 1]);
        if last.1 >= events {
            bail!("the backlog ran out during the measurement; use a longer --secs margin");
        }
        let rate = (last.1 - first.1) as f64 / last.0.duration_since(first.0).as_secs_f64();
        let per_second: Vec<f64> = samples
            .windows(2)
            .map(|w| (w[1].1 - w[0].1) as f64 / w[1].0.duration_since(w[0].0).as_secs_f64())
            .collect();
        let min = per_second.iter().copied().fold(f64::INFINITY, f64::min);
        let max = per_second.iter().copied().fold(0.0, f64::max);
        println!(
            "cluster rate    {rate:.0} events/s over {} s after a {} s warm-up: {:+.1} % of the \
             limit (each second: {min:.0}..{max:.0})",
            args.secs,
            WARM_UP.as_secs(),
            (rate / f64::from(args.global) - 1.0) * 100.0
        );
        delete_prefix_keys(&mut self.scratch.rconn.clone(), &self.scratch.prefix).await
    }

    // -----------------------------------------------------------------------------------
    // Part 2: one limited stream beside unlimited ones

    async fn isolation(&self) -> anyhow::Result<()> {
        let args = self.args;
        for mode in [Mode::PerPartition, Mode::Shared] {
            println!();
            match mode {
                Mode::PerPartition => println!(
                    "== isolation, streams of their own partitions: {} events, one stream per \
                     partition (rate:{{partition}}), {} nodes; without limits, then with stream \
                     rate:0 limited to {}/s",
                    args.events, args.nodes, args.stream_limit
                ),
                Mode::Shared => println!(
                    "== isolation, streams sharing every partition: {} events of stream \
                     rate:limited (the oldest rows, {} aggregates of their own), then {} of \
                     stream rate:other, {} nodes; without limits, then with rate:limited \
                     limited to {}/s (its backlog fills the head of every partition)",
                    self.limited_events(),
                    (args.aggregates / 10).max(1),
                    args.events,
                    args.nodes,
                    args.stream_limit
                ),
            }
            let free = self.drain(mode, None).await?;
            let limited = self.drain(mode, Some(args.stream_limit)).await?;
            println!(
                "other streams   without the limit {:.0} events/s, with it {:.0} events/s: \
                 ratio {:.2}",
                free.others_rate,
                limited.others_rate,
                limited.others_rate / free.others_rate.max(1e-9)
            );
            println!(
                "limited stream  {} events out: without the limit {:.0} events/s, with it \
                 {:.1} events/s after its burst (limit {})",
                limited.first_events, free.first_rate, limited.first_rate, args.stream_limit
            );
        }
        Ok(())
    }

    /// Events of the limited stream in the shared part: eight claims' worth per partition.
    fn limited_events(&self) -> u64 {
        u64::from(self.config.relay.batch_rows) * 8 * u64::from(self.partitions)
    }

    /// Drains a fresh backlog, the limited stream limited to `limit` when given, until the
    /// other streams' events are all out (and, without a limit, every event).
    async fn drain(&self, mode: Mode, limit: Option<u32>) -> anyhow::Result<Drained> {
        let args = self.args;
        let (first, limited_events) = match mode {
            Mode::PerPartition => {
                preload(
                    self.config,
                    &self.scratch.url,
                    &self.store,
                    args.events,
                    args.aggregates,
                    args.payload_bytes,
                )
                .await?;
                ("rate:0".to_owned(), None)
            }
            Mode::Shared => {
                self.store.truncate_outbox().await?;
                // The limited stream's rows first (the oldest), then the others'.
                let n = self.limited_events();
                for load in [
                    Load {
                        events: n,
                        aggregates: (args.aggregates / 10).max(1),
                        payload_bytes: args.payload_bytes,
                        aggregate_type: "limited",
                        event_type: "limited",
                    },
                    Load {
                        events: args.events,
                        aggregates: args.aggregates,
                        payload_bytes: args.payload_bytes,
                        aggregate_type: "other",
                        event_type: "other",
                    },
                ] {
                    preload_more(self.config, &self.scratch.url, &self.store, &load).await?;
                }
                ("rate:limited".to_owned(), Some(n))
            }
        };
        let total_events = args.events + limited_events.unwrap_or(0);
        let nodes = self
            .start(|c| {
                c.routing.overrides.clear();
                match mode {
                    Mode::PerPartition => c.routing.stream = "rate:{partition}".to_owned(),
                    Mode::Shared => {
                        c.routing.stream = "rate:other".to_owned();
                        c.routing
                            .overrides
                            .insert("limited".to_owned(), first.clone());
                    }
                }
                c.rate_limit = Default::default();
                if let Some(l) = limit {
                    c.rate_limit.streams.insert(first.clone(), l);
                }
            })
            .await?;
        let started = Instant::now();
        let keys: Vec<String> = match mode {
            Mode::PerPartition => (0..self.partitions)
                .map(|p| format!("{}rate:{p}", self.scratch.prefix))
                .collect(),
            Mode::Shared => ["rate:limited", "rate:other"]
                .iter()
                .map(|k| format!("{}{k}", self.scratch.prefix))
                .collect(),
        };
        let mut conn = self.scratch.rconn.clone();
        // (time, entries of the limited stream, entries of the others)
        let mut samples: Vec<(Duration, u64, u64)> = Vec::new();
        let polled = async {
            let mut progress = (Instant::now(), 0);
            loop {
                tokio::time::sleep(POLL).await;
                let mut pipe = redis::pipe();
                for k in &keys {
                    pipe.cmd("XLEN").arg(k);
                }
                let lens: Vec<u64> = pipe.query_async(&mut conn).await?;
                let first = lens.first().copied().unwrap_or(0);
                let total: u64 = lens.iter().sum();
                samples.push((started.elapsed(), first, total - first));
                let others_done = limited_events.is_some_and(|n| total - first >= total_events - n);
                if total >= total_events || (limit.is_some() && others_done) {
                    return Ok::<_, anyhow::Error>(());
                }
                if total > progress.1 {
                    progress = (Instant::now(), total);
                } else if progress.0.elapsed() >= STALL {
                    bail!(
                        "the drain stalled: {total} of {total_events} events out, no progress \
                         for {} s",
                        STALL.as_secs()
                    );
                }
            }
        }
        .await;
        stop(nodes).await;
        polled?;
        delete_prefix_keys(&mut self.scratch.rconn.clone(), &self.scratch.prefix).await?;
        let Some(&(end, first_events, others)) = samples.last() else {
            bail!("no sample was taken");
        };
        // The burst went out at once (rate_limit.burst = 0: the rate).
        let burst = limit.map_or(0, u64::from);
        // When the other streams started and were complete, and when the limited stream
        // started and ended (or the measurement did).
        let others_start = samples
            .iter()
            .find(|s| s.2 > 0)
            .map_or(Duration::ZERO, |s| s.0);
        let others_done = samples.iter().find(|s| s.2 >= others).map_or(end, |s| s.0);
        let first_start = samples
            .iter()
            .find(|s| s.1 > 0)
            .map_or(Duration::ZERO, |s| s.0);
        let first_done = samples
            .iter()
            .find(|s| s.1 >= first_events)
            .map_or(end, |s| s.0);
        Ok(Drained {
            others_rate: others as f64
                / others_done
                    .saturating_sub(others_start)
                    .as_secs_f64()
                    .max(1e-9),
            first_events,
            first_rate: first_events.saturating_sub(burst) as f64
                / first_done
                    .saturating_sub(first_start)
                    .as_secs_f64()
                    .max(1e-9),
        })
    }
}

/// Where the limited stream's rows are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One stream per partition; partition 0's is limited.
    PerPartition,
    /// Two streams over every partition; the limited one's rows are the oldest.
    Shared,
}

/// One drain of the isolation part.
struct Drained {
    /// The other partitions' events per second, from their first entry to their last.
    others_rate: f64,
    /// Events of partition 0.
    first_events: u64,
    /// Partition 0's stream: events per second from its first entry to its last, not counting
    /// the burst a limit lets out at once.
    first_rate: f64,
}

async fn stop(nodes: Vec<NodeHandle>) {
    for n in nodes {
        n.shutdown().await;
    }
}
