//! `outpost bench relay`: the relay's drain throughput against a bare relay loop, commit-to-stream
//! latency under steady load, and the cost of an idle node.
//!
//! Works in a scratch database `outpost_bench_relay` on the server of `database.url` (dropped and
//! created at the start, dropped at the end) and under a Redis key prefix of its own
//! (`bench:<random>:`, whose keys are deleted after every part). The node runs in this process,
//! so "process CPU" is the node's (plus the benchmark's own polling, and in the steady part the
//! load writers). PostgreSQL CPU is read from the `postgres` processes of this machine, Redis CPU
//! from `INFO cpu`.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use redis::aio::MultiplexedConnection;

use super::bench_latency::{self, Arrivals, Percentiles};
use super::bench_poll::{self, OverviewPoller};
use super::scratch::{Scratch, delete_prefix_keys, redis_conn, scan_keys};
use crate::app::{self, NodeHandle};
use crate::config::{Config, Secret};
use crate::produce::load::{Committed, LoadReport, LoadSpec, WriteTarget, run_load};
use crate::produce::{Limits, Producer};
use crate::store::bench::{BareOrder, BareTable};
use crate::store::{self, Store};

/// The scratch database.
const DB_NAME: &str = "outpost_bench_relay";
/// The node's id in every part.
const NODE_ID: &str = "bench-node";
/// Preload shape: transactions of 1,000 events from 4 writers.
const PRELOAD_TX_SIZE: u32 = 1000;
/// The aggregate type and event type of every event the benchmark writes.
const BENCH_AGGREGATE_TYPE: &str = "bench";
const BENCH_EVENT_TYPE: &str = "bench.tick";
const PRELOAD_WRITERS: u32 = 4;
/// Rows per batch of the bare loop.
const BARE_BATCH: u32 = 500;
/// How often the drain checks for remaining rows.
const DRAIN_POLL: Duration = Duration::from_millis(200);
/// How often the drain reports progress and checks for a stall.
const DRAIN_PROGRESS: Duration = Duration::from_secs(10);
/// A drain whose backlog has not shrunk for this long has stalled.
const DRAIN_STALL: Duration = Duration::from_secs(60);
/// How long the steady part waits for the last events after the load ends.
const STEADY_TAIL: Duration = Duration::from_secs(60);
/// Wait before the idle window. PostgreSQL backends report their transaction counts to
/// `pg_stat_database` at most once a second while busy and 10 s after going idle, so the start-up
/// work of the node (lease acquisition, ...) is reported by then and does not leak into the window.
const IDLE_SETTLE: Duration = Duration::from_secs(11);

/// Which part of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// Drain a preloaded backlog with an Outpost node.
    Drain,
    /// Drain the same backlog with the bare loop.
    Baseline,
    /// Commit-to-stream latency at fixed offered rates.
    Steady,
    /// CPU and queries of a node without load.
    Idle,
}

/// The bare loop's read order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BaselineOrder {
    /// `ORDER BY partition, id`: an index range scan, constant cost per batch.
    PartitionId,
    /// `ORDER BY id`: PostgreSQL walks the primary key past every published row, so each batch
    /// costs more as the backlog drains.
    Id,
}

/// What relays the events of the steady part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SteadyRelay {
    /// An Outpost node; the producers write through the producer API.
    Node,
    /// The bare loops (`--baseline-loops`), claiming again at once while they find rows and
    /// waiting `relay.busy_poll_ms` when they find none, over the outbox that the producers write
    /// through the producer API: Outpost's producers, a relay without Outpost's guarantees.
    Bare,
    /// The same bare loops over the plain copy of the outbox, which the producers write without
    /// Outpost's trigger: a hand-written outbox and relay, no sequence, no rules, no nudge.
    BarePlain,
}

/// Options of `outpost bench relay`.
#[derive(Debug, Args)]
pub struct RelayBench {
    /// Events preloaded for the drain and the baseline.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    events: u64,
    /// Distinct aggregates (`a0`, `a1`, ...; aggregate type `bench`).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    aggregates: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 250)]
    payload_bytes: usize,
    /// Delete published rows instead of marking them (the steady part then reports no
    /// insert-to-mark latency, which is read from the marked rows).
    #[arg(long)]
    delete_published: bool,
    /// Concurrent bare loops; the partitions are dealt out among them.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    baseline_loops: u32,
    /// Read order of the bare loop.
    #[arg(long, value_enum, default_value_t = BaselineOrder::PartitionId)]
    baseline_order: BaselineOrder,
    /// Offered rates of the steady part, in events per second.
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = [2000u32, 10_000],
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    rates: Vec<u32>,
    /// Duration of each steady run: rate × seconds events are written.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    steady_secs: u64,
    /// Concurrent producers in the steady part.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    steady_writers: u32,
    /// Events per producer transaction in the steady part (the offered rate stays in events per
    /// second): 1 measures the most commits; more measures higher event rates than the
    /// producers can commit one by one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    steady_tx_size: u32,
    /// What relays the steady part's events: an Outpost node, or the bare loops over the outbox
    /// or over its plain copy (to tell the relay's share of the latency from the producers').
    #[arg(long, value_enum, default_value_t = SteadyRelay::Node)]
    steady_relay: SteadyRelay,
    /// After each steady run, commit->stream percentiles for each second of commits (a tail
    /// spread over the run, or a few stalls).
    #[arg(long)]
    steady_timeline: bool,
    /// Length of the idle window.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    idle_secs: u64,
    /// Nodes draining the backlog together, one drain per value (e.g. `1,2,3`); the first
    /// value's rate is the one the bare loop is compared with.
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = [1u32],
        value_parser = clap::value_parser!(u32).range(1..=8)
    )]
    nodes: Vec<u32>,
    /// Run one part only (default: all, in order).
    #[arg(long, value_enum)]
    only: Option<Part>,
    /// Read the operator's overview (what the panel's overview page and `GET /api/v1/status`
    /// read) while the drain and steady parts run: never, always, or `alternate`: each drain
    /// and each steady rate runs twice, alone and polled (the order swapped every round), and
    /// the ratios are printed.
    #[arg(long, value_enum, default_value_t = OverviewPoll::Off)]
    overview: OverviewPoll,
    /// How often the overview is read, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
    overview_every_ms: u64,
}

/// Whether an operator polls the overview during the drain and steady parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OverviewPoll {
    /// Nobody reads it.
    Off,
    /// Read every `--overview-every-ms`.
    On,
    /// Each run twice, alone and polled.
    Alternate,
}

impl RelayBench {
    /// The runs of round `round` (0-based): `false` alone, `true` polled.
    fn poll_runs(&self, round: usize) -> Vec<bool> {
        match self.overview {
            OverviewPoll::Off => vec![false],
            OverviewPoll::On => vec![true],
            OverviewPoll::Alternate if round.is_multiple_of(2) => vec![false, true],
            OverviewPoll::Alternate => vec![true, false],
        }
    }
}

/// What every part needs.
struct Bench<'a> {
    config: &'a Config,
    args: &'a RelayBench,
    store: Store,
    url: String,
    prefix: String,
    redis: redis::Client,
    rconn: MultiplexedConnection,
    partitions: u32,
    clk_tck: f64,
}

pub(super) async fn run(config: &Config, args: RelayBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(config, DB_NAME).await?;
    let outcome = async {
        let store = scratch
            .store(args.steady_writers.max(args.baseline_loops) + 4, "relay")
            .await?;
        let bench = Bench {
            config,
            args: &args,
            partitions: store.partition_count().await?,
            store,
            url: scratch.url.clone(),
            prefix: scratch.prefix.clone(),
            redis: scratch.redis.clone(),
            rconn: scratch.rconn.clone(),
            clk_tck: clk_tck(),
        };
        super::scratch::until_interrupted(bench.run_parts(), &bench.store).await
    }
    .await;
    scratch.finish(outcome).await
}

impl Bench<'_> {
    async fn run_parts(&self) -> anyhow::Result<()> {
        self.print_header().await?;
        let wants = |p: Part| self.args.only.is_none_or(|o| o == p);
        let mut drained = None;
        if wants(Part::Drain) {
            let mut pairs = Vec::new();
            for (round, &n) in self.args.nodes.iter().enumerate() {
                let mut pair = [None, None];
                for polled in self.args.poll_runs(round) {
                    let rate = self.drain(n, polled).await?;
                    if !polled {
                        drained = drained.or(Some(rate));
                    }
                    pair[usize::from(polled)] = Some(rate);
                }
                pairs.push((n, pair));
            }
            if self.args.overview == OverviewPoll::Alternate {
                print_poll_ratios("drain", "events/s", &pairs);
            }
        }
        if wants(Part::Baseline) {
            self.baseline(drained).await?;
        }
        if wants(Part::Steady) {
            self.steady().await?;
        }
        if wants(Part::Idle) {
            self.idle().await?;
        }
        Ok(())
    }

    async fn print_header(&self) -> anyhow::Result<()> {
        let cfg = self.config;
        let pg_version = self.store.server_version().await?;
        let server_info = info(&mut self.rconn.clone(), "server").await?;
        let redis_version = info_field(&server_info, "redis_version").unwrap_or("?");
        let (pg_procs, _) = postgres_cpu_ticks().unwrap_or((0, 0));
        print_run_header("relay");
        println!(
            "servers:  PostgreSQL {pg_version} ({pg_procs} local postgres processes), Redis \
             {redis_version}"
        );
        println!(
            "scratch:  database {}, Redis prefix {}",
            Secret::new(self.url.clone()),
            self.prefix
        );
        println!(
            "node:     in this process; relay.workers {} (effective {}), batch_rows {}, \
             busy_poll_ms {}, idle_after_ms {}, database.pool_size {}",
            cfg.relay.workers,
            cfg.relay.effective_workers(),
            cfg.relay.batch_rows,
            cfg.relay.busy_poll_ms,
            cfg.relay.idle_after_ms,
            cfg.database.pool_size
        );
        println!(
            "CPU:      seconds of CPU time and % of one core; PostgreSQL = every local `postgres` \
             process (including exited backends, via the postmaster's child times), Redis = \
             INFO cpu used_cpu_user + used_cpu_sys"
        );
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Part 1: drain

    async fn drain(&self, nodes: u32, polled: bool) -> anyhow::Result<f64> {
        let args = self.args;
        println!();
        println!(
            "== drain: {nodes} node{} publish{} a preloaded backlog (relay.delete_published = \
             {}){}",
            if nodes == 1 { "" } else { "s" },
            if nodes == 1 { "es" } else { "" },
            args.delete_published,
            self.polled_label(polled)
        );
        self.preload().await?;
        let hwm_before = proc_status_kib("VmHWM");
        let rss_before = proc_status_kib("VmRSS");
        let hwm_reset = reset_peak_rss();
        let before = self.snapshot().await;
        let started = Instant::now();
        let mut running = Vec::new();
        for i in 0..nodes {
            let id = if nodes == 1 {
                NODE_ID.to_owned()
            } else {
                format!("{NODE_ID}-{i}")
            };
            match self.start_node_as(&id, args.delete_published).await {
                Ok(n) => running.push(n),
                Err(e) => {
                    for n in running {
                        n.shutdown().await;
                    }
                    return Err(e);
                }
            }
        }
        let poller = polled.then(|| self.poller());
        let measured = async {
            let mut owned_after = None;
            let pattern = format!("{}*", self.prefix);
            let mut last_check = Instant::now();
            let mut progress = (Instant::now(), 0u64);
            loop {
                tokio::time::sleep(DRAIN_POLL).await;
                if owned_after.is_none() {
                    let mut owned = 0;
                    for n in &running {
                        owned += n.owned_partitions().await.len();
                    }
                    if owned >= self.partitions as usize {
                        owned_after = Some(started.elapsed());
                    }
                }
                if !self.store.has_unpublished(BareTable::Outbox).await? {
                    break;
                }
                if last_check.elapsed() >= DRAIN_PROGRESS {
                    last_check = Instant::now();
                    // Progress from Redis (XLEN is O(1)): a count over the backlog would load
                    // the database under measurement.
                    let entries = stream_entries(&mut self.rconn.clone(), &pattern).await?;
                    eprintln!(
                        "drain: {entries} of {} events in the streams after {:.0} s",
                        args.events,
                        started.elapsed().as_secs_f64()
                    );
                    if entries > progress.1 {
                        progress = (Instant::now(), entries);
                    } else if progress.0.elapsed() >= DRAIN_STALL {
                        bail!(
                            "the drain stalled: {entries} of {} events in the streams, no \
                             progress for {} s",
                            args.events,
                            DRAIN_STALL.as_secs()
                        );
                    }
                }
            }
            let elapsed = started.elapsed();
            let after = self.snapshot().await;
            Ok::<_, anyhow::Error>((elapsed, owned_after, after))
        }
        .await;
        let polls = match poller {
            Some(p) => Some(p.finish().await),
            None => None,
        };
        for n in running {
            n.shutdown().await;
        }
        let (elapsed, owned_after, after) = measured?;
        if let Some(polls) = polls {
            println!("overview        {}", bench_poll::describe(&polls?));
        }
        let hwm_after = proc_status_kib("VmHWM");
        let rss_after = proc_status_kib("VmRSS");

        let rate = args.events as f64 / elapsed.as_secs_f64().max(1e-9);
        println!(
            "time to drain   {:.2} s, from node start (all {} partitions owned after {})",
            elapsed.as_secs_f64(),
            self.partitions,
            owned_after.map_or("-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()))
        );
        println!("throughput      {rate:.0} events/s");
        print_usage(&before.diff(&after, self.clk_tck), args.events);
        println!(
            "memory          peak RSS before node start {} (the benchmark alone; the preload \
             ran in another process), RSS {}",
            mib(hwm_before),
            mib(rss_before)
        );
        println!(
            "                peak RSS after the drain {} ({}), RSS {}",
            mib(hwm_after),
            if hwm_reset {
                "the peak was reset to the RSS when the node started: this is the drain's peak"
            } else {
                "the peak could not be reset: it includes what ran before the node"
            },
            mib(rss_after)
        );
        self.print_end_state(&format!("{}*", self.prefix)).await?;
        delete_prefix_keys(&mut self.rconn.clone(), &self.prefix).await?;
        Ok(rate)
    }

    /// Truncates the outbox and writes `--events` events through the producer API, then
    /// `VACUUM ANALYZE`s it.
    async fn preload(&self) -> anyhow::Result<()> {
        let args = self.args;
        preload(
            self.config,
            &self.url,
            &self.store,
            args.events,
            args.aggregates,
            args.payload_bytes,
        )
        .await
    }

    /// Rows by state, and the entries of the streams matching `pattern`.
    async fn print_end_state(&self, pattern: &str) -> anyhow::Result<()> {
        let backlog = store::backlog(&self.store).await?;
        let states = if backlog.by_status.is_empty() {
            "no rows".to_owned()
        } else {
            backlog
                .by_status
                .iter()
                .map(|s| format!("{} {}", s.status, s.rows))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let entries = stream_entries(&mut self.rconn.clone(), pattern).await?;
        println!("end state       rows: {states}; stream entries: {entries}");
        if entries != self.args.events {
            println!(
                "WARNING         {} events were loaded but the streams hold {entries} entries",
                self.args.events
            );
        }
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Part 2: the bare loop

    async fn baseline(&self, outpost_rate: Option<f64>) -> anyhow::Result<()> {
        let args = self.args;
        let loops = self.bare_loops(BareTable::Outbox);
        let order = match args.baseline_order {
            BaselineOrder::PartitionId => BareOrder::PartitionId,
            BaselineOrder::Id => BareOrder::Id,
        };
        println!();
        println!(
            "== baseline: {loops} bare loops (no ordering guarantee, no fencing, no \
             quarantine); per batch: SELECT ≤ {BARE_BATCH} pending rows of the loop's \
             partitions ORDER BY {}, one pipeline of XADDs, one {}",
            match order {
                BareOrder::PartitionId => "partition, id",
                BareOrder::Id => "id",
            },
            if args.delete_published {
                "DELETE"
            } else {
                "UPDATE ... SET status = 'published'"
            }
        );
        self.preload().await?;
        let stream = format!("{}baseline", self.prefix);
        let before = self.snapshot().await;
        let started = Instant::now();
        let tasks = self
            .spawn_bare_loops(&BareLoop {
                store: self.store.clone(),
                stream: stream.clone(),
                table: BareTable::Outbox,
                partitions: Vec::new(),
                slice: (1, 0),
                order,
                delete: args.delete_published,
                until: BareUntil::Drained,
                phases: Arc::default(),
            })
            .await?;
        let mut published = 0u64;
        for t in tasks {
            published += t.await.context("a bare loop panicked")??;
        }
        let elapsed = started.elapsed();
        let after = self.snapshot().await;
        let rate = published as f64 / elapsed.as_secs_f64().max(1e-9);
        println!(
            "time to drain   {:.2} s ({published} events)",
            elapsed.as_secs_f64()
        );
        println!("throughput      {rate:.0} events/s");
        print_usage(&before.diff(&after, self.clk_tck), published);
        self.print_end_state(&stream).await?;
        delete_prefix_keys(&mut self.rconn.clone(), &self.prefix).await?;
        println!();
        println!("{:<28} {:>12}", "drain", "events/s");
        match outpost_rate {
            Some(o) => {
                println!("{:<28} {:>12.0}", "outpost node", o);
                println!("{:<28} {:>12.0}", "bare loop", rate);
                println!(
                    "{:<28} {:>12.2}",
                    "ratio outpost / bare",
                    o / rate.max(1e-9)
                );
            }
            None => {
                println!("{:<28} {:>12.0}", "bare loop", rate);
                println!("(run the drain part too for the ratio outpost / bare)");
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Part 3: steady state

    async fn steady(&self) -> anyhow::Result<()> {
        let args = self.args;
        println!();
        println!(
            "== steady state: {} producers, {} event(s) per transaction, {} s per rate",
            args.steady_writers, args.steady_tx_size, args.steady_secs
        );
        let table = match args.steady_relay {
            SteadyRelay::BarePlain => BareTable::Plain,
            SteadyRelay::Node | SteadyRelay::Bare => BareTable::Outbox,
        };
        let loops = |over: &str| {
            format!(
                "{} bare loops over {over} (no ordering guarantee, no fencing, no quarantine; \
                 claim again at once while rows are found, else wait {} ms)",
                self.bare_loops(table),
                self.config.relay.busy_poll_ms
            )
        };
        println!(
            "   relay: {}",
            match args.steady_relay {
                SteadyRelay::Node =>
                    "an Outpost node; producers write through the producer API".to_owned(),
                SteadyRelay::Bare =>
                    loops("outpost_event, which producers write through the producer API"),
                SteadyRelay::BarePlain => loops(
                    "the outbox's plain copy, which producers write without Outpost's trigger"
                ),
            }
        );
        println!(
            "   commit->stream: from the producer's commit returning to a reader blocked on the \
             stream (XREAD) seeing the entry"
        );
        println!(
            "   insert->mark: published_at - recorded_at of every row (the insert, inside the \
             producer's transaction, to the relay's mark after Redis acknowledged)"
        );
        println!(
            "{:>9} {:>9} {:>10} | {:>28} | {:>15} | {:>5} {:>5} {:>6}",
            "", "", "", "commit->stream ms", "insert->mark ms", "", "", ""
        );
        println!(
            "{:>9} {:>9} {:>10} | {:>6} {:>6} {:>6} {:>7} | {:>7} {:>7} | {:>5} {:>5} {:>6}",
            "offered/s",
            "events",
            "achieved/s",
            "p50",
            "p90",
            "p99",
            "max",
            "p50",
            "p99",
            "proc%",
            "pg%",
            "redis%"
        );
        let mut achieved = Vec::new();
        let mut p99s = Vec::new();
        for (round, &rate) in args.rates.iter().enumerate() {
            let Some(nz) = NonZeroU32::new(rate) else {
                continue;
            };
            let (mut a, mut p) = ([None, None], [None, None]);
            for polled in args.poll_runs(round) {
                let (events_per_sec, p99) = self.steady_run(table, nz, polled).await?;
                a[usize::from(polled)] = Some(events_per_sec);
                p[usize::from(polled)] = p99;
            }
            achieved.push((rate, a));
            p99s.push((rate, p));
        }
        println!(
            "(proc% = this process: the node and the producers; CPU over the load and until the \
             last event was published)"
        );
        if args.overview == OverviewPoll::Alternate {
            print_poll_ratios("steady, achieved", "events/s", &achieved);
            print_poll_ratios("steady, commit->stream p99", "ms", &p99s);
        }
        Ok(())
    }

    /// One steady run at `nz` events/s offered; returns the achieved events/s and the
    /// commit->stream p99 in ms.
    async fn steady_run(
        &self,
        table: BareTable,
        nz: NonZeroU32,
        polled: bool,
    ) -> anyhow::Result<(f64, Option<f64>)> {
        let args = self.args;
        let rate = nz.get();
        self.store.truncate_outbox().await?;
        if table == BareTable::Plain {
            self.store.create_plain_table().await?;
        }
        let spec = LoadSpec {
            count: u64::from(rate).saturating_mul(args.steady_secs),
            rate: Some(nz),
            aggregates: args.aggregates,
            aggregate_type: BENCH_AGGREGATE_TYPE.to_owned(),
            event_type: BENCH_EVENT_TYPE.to_owned(),
            payload_bytes: args.payload_bytes,
            tx_size: args.steady_tx_size,
            writers: args.steady_writers,
            target: match table {
                BareTable::Outbox => WriteTarget::Outbox,
                BareTable::Plain => WriteTarget::PlainTable,
            },
        };
        let stream = self.stream_key(&spec)?;
        let relay = match args.steady_relay {
            SteadyRelay::Node => SteadyRunner::Node(self.start_node(args.delete_published).await?),
            SteadyRelay::Bare | SteadyRelay::BarePlain => {
                let stop = Arc::new(AtomicBool::new(false));
                let phases = Arc::new(BarePhases::default());
                let tasks = self
                    .spawn_bare_loops(&BareLoop {
                        store: self.store.clone(),
                        stream: stream.clone(),
                        table,
                        partitions: Vec::new(),
                        slice: (1, 0),
                        order: BareOrder::PartitionId,
                        delete: args.delete_published,
                        until: BareUntil::Stopped {
                            stop: stop.clone(),
                            poll: self.config.relay.busy_poll(),
                        },
                        phases: phases.clone(),
                    })
                    .await?;
                SteadyRunner::Bare {
                    stop,
                    tasks,
                    phases,
                }
            }
        };
        let measured = async {
            if let SteadyRunner::Node(node) = &relay {
                self.wait_owned(node).await?;
                // Let the node reach its idle state (asking for nudges) before the load
                // starts.
                tokio::time::sleep(self.config.relay.idle_after() + Duration::from_millis(500))
                    .await;
            }
            let poller = polled.then(|| self.poller());
            let before = self.snapshot().await;
            let phases_before = Phases::read();
            let arrivals = Arrivals::new(spec.count);
            let stop = Arc::new(AtomicBool::new(false));
            let watcher = tokio::spawn(bench_latency::watch(
                self.redis.clone(),
                stream.clone(),
                arrivals.clone(),
                stop.clone(),
            ));
            let report =
                run_load(&self.store, &self.producer(), &spec, arrivals.on_commit()).await?;
            let tail = Instant::now();
            while self.store.has_unpublished(table).await? && tail.elapsed() < STEADY_TAIL {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let after = self.snapshot().await;
            let phases = match (&relay, phases_before, Phases::read()) {
                (SteadyRunner::Node(_), Some(b), Some(a)) => Some(("node", a.minus(&b))),
                (SteadyRunner::Bare { phases, .. }, ..) => Some(("bare loops", phases.phases())),
                _ => None,
            };
            stop.store(true, Ordering::Relaxed);
            watcher.await.context("the stream reader failed")??;
            if let Some(p) = poller {
                println!("   overview: {}", bench_poll::describe(&p.finish().await?));
            }
            Ok::<_, anyhow::Error>((
                report,
                before.diff(&after, self.clk_tck),
                arrivals.percentiles(),
                phases,
                args.steady_timeline.then(|| arrivals.per_second()),
            ))
        }
        .await;
        relay.stop().await?;
        let (report, usage, seen, phases, timeline) = measured?;
        // Deleted rows leave no times to read.
        let lat = if args.delete_published {
            None
        } else {
            Some(
                self.store
                    .publish_latency(match args.steady_relay {
                        SteadyRelay::Node => None,
                        SteadyRelay::Bare | SteadyRelay::BarePlain => Some(table),
                    })
                    .await?,
            )
        };
        let left = self.store.unpublished_count(table).await?;
        print_steady_row(rate, &report, &seen, lat.as_ref(), &usage);
        if let Some((who, p)) = phases {
            p.print(who);
        }
        if let Some(seconds) = timeline {
            print_timeline(&seconds);
        }
        if left > 0 {
            println!(
                "WARNING: {left} events were still unpublished {} s after the load ended; \
                 the percentiles cover the published ones only",
                STEADY_TAIL.as_secs()
            );
        }
        delete_prefix_keys(&mut self.rconn.clone(), &self.prefix).await?;
        Ok((report.events_per_sec(), seen.p99.map(|s| s * 1000.0)))
    }

    // ---------------------------------------------------------------------------------------
    // Part 4: idle

    async fn idle(&self) -> anyhow::Result<()> {
        let args = self.args;
        println!();
        println!(
            "== idle: a node with nothing to do, {} s window after {} s settling",
            args.idle_secs,
            IDLE_SETTLE.as_secs()
        );
        self.store.truncate_outbox().await?;
        let node = self.start_node(false).await?;
        let measured = async {
            self.wait_owned(&node).await?;
            tokio::time::sleep(IDLE_SETTLE).await;
            let tx_before = self.store.database_transactions().await?;
            let before = self.snapshot().await;
            tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
            let after = self.snapshot().await;
            let tx_after = self.store.database_transactions().await?;
            Ok::<_, anyhow::Error>((before.diff(&after, self.clk_tck), tx_after - tx_before))
        }
        .await;
        node.shutdown().await;
        let (usage, tx_delta) = measured?;
        // The benchmark's own first read is a transaction that may be counted in the window; the
        // second read cannot be (a transaction's count is reported after it ends).
        let node_tx = (tx_delta - 1).max(0);
        let secs = usage.wall.as_secs_f64().max(1e-9);
        println!(
            "node CPU        {} over {secs:.1} s (this process; /proc times count in steps of \
             {:.3} s)",
            usage.proc_cpu.map_or("n/a".to_owned(), |c| format!(
                "{c:.3} s = {:.2} % of one core",
                c / secs * 100.0
            )),
            1.0 / self.clk_tck
        );
        println!(
            "postgres CPU    {}",
            usage.pg_cpu.map_or("n/a".to_owned(), |c| format!(
                "{c:.3} s = {:.2} % of one core",
                c / secs * 100.0
            ))
        );
        println!(
            "redis CPU       {}",
            usage.redis_cpu.map_or("n/a".to_owned(), |c| format!(
                "{c:.3} s = {:.2} % of one core",
                c / secs * 100.0
            ))
        );
        println!(
            "node queries    {node_tx} transactions = {:.1} /s (xact_commit + xact_rollback of \
             {DB_NAME} in pg_stat_database, minus the benchmark's own read; backends report \
             at most once a second, so the count is accurate to about a second's worth)",
            node_tx as f64 / secs
        );
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Helpers

    /// How many bare loops run over `table`: `--baseline-loops`, over the outbox at most one per
    /// partition.
    fn bare_loops(&self, table: BareTable) -> u32 {
        match table {
            BareTable::Outbox => self.args.baseline_loops.min(self.partitions).max(1),
            BareTable::Plain => self.args.baseline_loops.max(1),
        }
    }

    /// Starts `--baseline-loops` bare loops like `template`, each on a Redis connection of its
    /// own: over the outbox, the partitions are dealt out among them; over the plain copy, whose
    /// rows are all in partition 0, its rows by id.
    async fn spawn_bare_loops(
        &self,
        template: &BareLoop,
    ) -> anyhow::Result<Vec<tokio::task::JoinHandle<anyhow::Result<u64>>>> {
        let mut tasks = Vec::new();
        match template.table {
            BareTable::Outbox => {
                let loops = self.bare_loops(BareTable::Outbox);
                for k in 0..loops {
                    let partitions = (0..self.partitions)
                        .filter(|p| p % loops == k)
                        .filter_map(|p| i32::try_from(p).ok())
                        .collect();
                    let each = BareLoop {
                        partitions,
                        slice: (1, 0),
                        ..template.clone()
                    };
                    tasks.push(tokio::spawn(each.run(redis_conn(&self.redis).await?)));
                }
            }
            BareTable::Plain => {
                let loops = self.bare_loops(BareTable::Plain);
                for k in 0..loops {
                    let each = BareLoop {
                        partitions: vec![0],
                        slice: (loops, k),
                        ..template.clone()
                    };
                    tasks.push(tokio::spawn(each.run(redis_conn(&self.redis).await?)));
                }
            }
        }
        Ok(tasks)
    }

    fn producer(&self) -> Producer {
        Producer::new(Limits {
            max_payload_bytes: self.config.producer.max_payload_bytes,
            max_header_bytes: self.config.producer.max_header_bytes,
        })
    }

    /// An operator reading the overview every `--overview-every-ms`.
    fn poller(&self) -> OverviewPoller {
        OverviewPoller::start(
            self.store.clone(),
            Duration::from_millis(self.args.overview_every_ms),
        )
    }

    /// What a run's heading says about the overview poll.
    fn polled_label(&self, polled: bool) -> String {
        if polled {
            format!(
                ", the overview read every {} ms",
                self.args.overview_every_ms
            )
        } else {
            String::new()
        }
    }

    /// Starts a node on the scratch database, under the benchmark's Redis prefix.
    async fn start_node(&self, delete_published: bool) -> anyhow::Result<NodeHandle> {
        self.start_node_as(NODE_ID, delete_published).await
    }

    /// Starts a node named `id`.
    async fn start_node_as(&self, id: &str, delete_published: bool) -> anyhow::Result<NodeHandle> {
        let mut cfg = self.config.clone();
        cfg.database.url = Some(Secret::new(self.url.clone()));
        cfg.redis.key_prefix = self.prefix.clone();
        cfg.node.id = id.to_owned();
        cfg.admin.listen = "127.0.0.1:0".to_owned();
        cfg.relay.delete_published = delete_published;
        if delete_published {
            // Nothing published is kept, so nothing could be re-published.
            cfg.retention.republish_window_secs = 0;
        }
        let handle = tokio::task::spawn_blocking(move || app::start(&cfg))
            .await
            .context("the node's start-up thread failed")?
            .context("starting the node")?;
        Ok(handle)
    }

    /// The one stream the steady load's events go to.
    fn stream_key(&self, spec: &LoadSpec) -> anyhow::Result<String> {
        let template = self
            .config
            .routing
            .template_for(&spec.event_type)
            .context("the steady load's event type has no destination in [routing]")?;
        if template.contains("{partition}") {
            bail!(
                "routing.stream {template:?} spreads the load over partitions; the steady part \
                 reads one stream (use a template without {{partition}})"
            );
        }
        Ok(format!(
            "{}{}",
            self.prefix,
            template
                .replace("{aggregate_type}", &spec.aggregate_type)
                .replace("{event_type}", &spec.event_type)
        ))
    }

    /// Waits until the node owns every partition.
    async fn wait_owned(&self, node: &NodeHandle) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while node.owned_partitions().await.len() < self.partitions as usize {
            if Instant::now() > deadline {
                bail!("the node did not acquire all partitions within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    async fn snapshot(&self) -> Snapshot {
        let redis_cpu = info(&mut self.rconn.clone(), "cpu")
            .await
            .ok()
            .and_then(|i| {
                let user = info_field(&i, "used_cpu_user")?.parse::<f64>().ok()?;
                let sys = info_field(&i, "used_cpu_sys")?.parse::<f64>().ok()?;
                Some(user + sys)
            });
        Snapshot {
            at: Instant::now(),
            proc_ticks: self_cpu_ticks(),
            pg_ticks: postgres_cpu_ticks().filter(|(n, _)| *n > 0).map(|(_, t)| t),
            redis_cpu,
        }
    }
}

/// The node's batches as its metrics count them (this process's recorder): claims, events
/// published, and the seconds spent claiming, publishing and marking.
#[derive(Debug, Clone, Copy, Default)]
struct Phases {
    claims: f64,
    published: f64,
    claim_secs: f64,
    publish: (f64, f64),
    mark: (f64, f64),
}

impl Phases {
    fn read() -> Option<Phases> {
        let text = crate::metrics::install()?.render();
        // Sums over every label set of `name` (histograms: `name_sum` and `name_count`).
        let total = |name: &str| -> f64 {
            text.lines()
                .filter(|l| {
                    l.strip_prefix(name)
                        .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let hist = |name: &str| {
            (
                total(&format!("{name}_count")),
                total(&format!("{name}_sum")),
            )
        };
        let claim = hist(crate::metrics::CLAIM_SECONDS);
        Some(Phases {
            claims: claim.0,
            claim_secs: claim.1,
            published: total(crate::metrics::PUBLISHED),
            publish: hist(crate::metrics::PUBLISH_SECONDS),
            mark: hist(crate::metrics::MARK_SECONDS),
        })
    }

    fn minus(&self, before: &Phases) -> Phases {
        Phases {
            claims: self.claims - before.claims,
            published: self.published - before.published,
            claim_secs: self.claim_secs - before.claim_secs,
            publish: (
                self.publish.0 - before.publish.0,
                self.publish.1 - before.publish.1,
            ),
            mark: (self.mark.0 - before.mark.0, self.mark.1 - before.mark.1),
        }
    }

    fn print(&self, who: &str) {
        let mean_ms = |(n, secs): (f64, f64)| if n > 0.0 { secs / n * 1000.0 } else { 0.0 };
        println!(
            "          {who}: {:.0} claims ({:.1} events per claim), {:.0} publishes, {:.0} \
             marks; mean ms: claim {:.2}, publish {:.2}, mark {:.2}",
            self.claims,
            self.published / self.claims.max(1.0),
            self.publish.0,
            self.mark.0,
            mean_ms((self.claims, self.claim_secs)),
            mean_ms(self.publish),
            mean_ms(self.mark)
        );
    }
}

/// What relays a steady run's events.
enum SteadyRunner {
    Node(NodeHandle),
    Bare {
        stop: Arc<AtomicBool>,
        tasks: Vec<tokio::task::JoinHandle<anyhow::Result<u64>>>,
        phases: Arc<BarePhases>,
    },
}

impl SteadyRunner {
    /// Stops the node, or the bare loops once they find nothing more; a bare loop's failure is
    /// the run's.
    async fn stop(self) -> anyhow::Result<()> {
        match self {
            SteadyRunner::Node(node) => node.shutdown().await,
            SteadyRunner::Bare { stop, tasks, .. } => {
                stop.store(true, Ordering::Relaxed);
                for t in tasks {
                    t.await.context("a bare loop panicked")??;
                }
            }
        }
        Ok(())
    }
}

/// When a bare loop ends.
#[derive(Debug, Clone)]
enum BareUntil {
    /// At the first claim that finds nothing (a drain).
    Drained,
    /// At the first claim that finds nothing once `stop` is set; until then a claim that finds
    /// nothing is followed by a pause of `poll`.
    Stopped {
        stop: Arc<AtomicBool>,
        poll: Duration,
    },
}

/// One bare relay loop: read a batch, XADD it in one pipeline, mark it.
#[derive(Debug, Clone)]
struct BareLoop {
    store: Store,
    stream: String,
    table: BareTable,
    /// The loop's partitions (dealt out by [`Bench::spawn_bare_loops`]).
    partitions: Vec<i32>,
    /// `(loops, this loop)`: the share of the partitions' rows by id (see `bare_claim`).
    slice: (u32, u32),
    order: BareOrder,
    delete: bool,
    until: BareUntil,
    /// What every loop of this start did, added up.
    phases: Arc<BarePhases>,
}

/// The bare loops' claims, batches (claims that found rows), events, and microseconds spent
/// claiming, publishing and marking: the same figures as the node's [`Phases`].
#[derive(Debug, Default)]
struct BarePhases {
    claims: AtomicU64,
    batches: AtomicU64,
    events: AtomicU64,
    claim_us: AtomicU64,
    publish_us: AtomicU64,
    mark_us: AtomicU64,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl BarePhases {
    fn add_claim(&self, took: Duration) {
        self.claims.fetch_add(1, Ordering::Relaxed);
        self.claim_us.fetch_add(micros(took), Ordering::Relaxed);
    }

    fn add_batch(&self, events: usize, publish: Duration, mark: Duration) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.events.fetch_add(events as u64, Ordering::Relaxed);
        self.publish_us
            .fetch_add(micros(publish), Ordering::Relaxed);
        self.mark_us.fetch_add(micros(mark), Ordering::Relaxed);
    }

    fn phases(&self) -> Phases {
        let count = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let secs = |a: &AtomicU64| count(a) / 1e6;
        let batches = count(&self.batches);
        Phases {
            claims: count(&self.claims),
            published: count(&self.events),
            claim_secs: secs(&self.claim_us),
            publish: (batches, secs(&self.publish_us)),
            mark: (batches, secs(&self.mark_us)),
        }
    }
}

impl BareLoop {
    /// Runs until `until`; returns the events published.
    async fn run(self, mut conn: MultiplexedConnection) -> anyhow::Result<u64> {
        let mut published = 0u64;
        loop {
            let started = Instant::now();
            let rows = self
                .store
                .bare_claim(
                    self.table,
                    &self.partitions,
                    self.slice,
                    BARE_BATCH,
                    self.order,
                )
                .await?;
            let claimed = Instant::now();
            self.phases.add_claim(claimed - started);
            if rows.is_empty() {
                match &self.until {
                    BareUntil::Stopped { stop, poll } if !stop.load(Ordering::Relaxed) => {
                        tokio::time::sleep(*poll).await;
                        continue;
                    }
                    _ => return Ok(published),
                }
            }
            let mut pipe = redis::pipe();
            for r in &rows {
                pipe.cmd("XADD")
                    .arg(&self.stream)
                    .arg("*")
                    .arg("id")
                    .arg(r.event_id.to_string())
                    .arg("type")
                    .arg(&r.event_type)
                    .arg("data")
                    .arg(&r.payload);
            }
            let ids: Vec<String> = pipe.query_async(&mut conn).await.context("XADD pipeline")?;
            if ids.len() != rows.len() {
                bail!("{} XADDs sent, {} acknowledged", rows.len(), ids.len());
            }
            let sent = Instant::now();
            let row_ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
            self.store
                .bare_mark(self.table, &row_ids, self.delete)
                .await?;
            self.phases
                .add_batch(rows.len(), sent - claimed, sent.elapsed());
            published += rows.len() as u64;
        }
    }
}

pub(super) fn noop() -> Arc<dyn Fn(Committed) + Send + Sync> {
    Arc::new(|_| {})
}

/// Seconds as milliseconds with one decimal, `-` for none.
fn ms(v: Option<f64>) -> String {
    v.map_or("-".to_owned(), |s| format!("{:.1}", s * 1000.0))
}

/// One line per second of commits: events, commit->stream p50, p99 and max in milliseconds.
fn print_timeline(seconds: &[Percentiles]) {
    println!(
        "   {:>6} {:>7} {:>6} {:>6} {:>7}",
        "second", "events", "p50", "p99", "max"
    );
    for (i, p) in seconds.iter().enumerate() {
        println!(
            "   {:>6} {:>7} {:>6} {:>6} {:>7}",
            i,
            p.events,
            ms(p.p50),
            ms(p.p99),
            ms(p.max)
        );
    }
}

/// Each round's figure alone and with the overview polled, their ratio, and the medians.
fn print_poll_ratios(what: &str, unit: &str, rounds: &[(u32, [Option<f64>; 2])]) {
    println!();
    println!("== {what} ({unit}), alone and with the overview polled");
    println!(
        "{:>6} {:>8} {:>12} {:>12} {:>7}",
        "round", "run", "alone", "polled", "ratio"
    );
    let (mut alone, mut polled, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (run, [a, p])) in rounds.iter().enumerate() {
        let ratio = a.zip(*p).map(|(a, p)| p / a.max(1e-9));
        alone.extend(*a);
        polled.extend(*p);
        ratios.extend(ratio);
        let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
        println!(
            "{:>6} {:>8} {:>12} {:>12} {:>7}",
            i + 1,
            run,
            f(*a),
            f(*p),
            ratio.map_or("-".to_owned(), |r| format!("{r:.3}"))
        );
    }
    let f = |v: Option<f64>, digits: usize| v.map_or("-".to_owned(), |v| format!("{v:.digits$}"));
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if v.is_empty() {
            "-".to_owned()
        } else {
            format!("{lo:.3}-{hi:.3}")
        }
    };
    println!(
        "{:>6} {:>8} {:>12} {:>12} {:>7}   (ratios {})",
        "median",
        "",
        f(bench_poll::median(&alone), 1),
        f(bench_poll::median(&polled), 1),
        f(bench_poll::median(&ratios), 3),
        spread(&ratios)
    );
}

fn print_steady_row(
    rate: u32,
    report: &LoadReport,
    seen: &Percentiles,
    lat: Option<&store::bench::PublishLatency>,
    usage: &Usage,
) {
    let pct = |v: Option<f64>| {
        v.map_or("n/a".to_owned(), |c| {
            format!("{:.0}", c / usage.wall.as_secs_f64().max(1e-9) * 100.0)
        })
    };
    println!(
        "{:>9} {:>9} {:>10.0} | {:>6} {:>6} {:>6} {:>7} | {:>7} {:>7} | {:>5} {:>5} {:>6}",
        rate,
        report.events,
        report.events_per_sec(),
        ms(seen.p50),
        ms(seen.p90),
        ms(seen.p99),
        ms(seen.max),
        ms(lat.and_then(|l| l.p50)),
        ms(lat.and_then(|l| l.p99)),
        pct(usage.proc_cpu),
        pct(usage.pg_cpu),
        pct(usage.redis_cpu)
    );
    let marked = lat.map(|l| l.rows);
    if seen.events as u64 != report.events || marked.is_some_and(|m| m != report.events as i64) {
        println!(
            "          ({} of {} events seen in the stream, {} rows marked published)",
            seen.events,
            report.events,
            marked.unwrap_or(0)
        );
    }
}

// -------------------------------------------------------------------------------------------
// Resource usage

/// CPU counters at one instant.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    at: Instant,
    /// This process: utime + stime, in clock ticks.
    proc_ticks: Option<u64>,
    /// Every local `postgres` process: utime + stime + cutime + cstime, in clock ticks.
    pg_ticks: Option<u64>,
    /// Redis: used_cpu_user + used_cpu_sys, in seconds.
    redis_cpu: Option<f64>,
}

/// CPU seconds spent between two snapshots.
#[derive(Debug, Clone, Copy)]
struct Usage {
    wall: Duration,
    proc_cpu: Option<f64>,
    pg_cpu: Option<f64>,
    redis_cpu: Option<f64>,
}

impl Snapshot {
    fn diff(&self, later: &Snapshot, clk_tck: f64) -> Usage {
        let ticks = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / clk_tck),
            _ => None,
        };
        Usage {
            wall: later.at.duration_since(self.at),
            proc_cpu: ticks(self.proc_ticks, later.proc_ticks),
            pg_cpu: ticks(self.pg_ticks, later.pg_ticks),
            redis_cpu: match (self.redis_cpu, later.redis_cpu) {
                (Some(a), Some(b)) => Some((b - a).max(0.0)),
                _ => None,
            },
        }
    }
}

fn print_usage(u: &Usage, events: u64) {
    let secs = u.wall.as_secs_f64().max(1e-9);
    println!(
        "{:<16}{:>10} {:>13} {:>10}",
        "CPU", "seconds", "% of a core", "µs/event"
    );
    for (label, v) in [
        ("  this process", u.proc_cpu),
        ("  postgres", u.pg_cpu),
        ("  redis", u.redis_cpu),
    ] {
        match v {
            Some(c) => println!(
                "{label:<16}{c:>10.2} {:>13.0} {:>10.1}",
                c / secs * 100.0,
                c * 1e6 / events.max(1) as f64
            ),
            None => println!("{label:<16}{:>10}", "n/a"),
        }
    }
}

/// Clock ticks per second of `/proc/*/stat` times (`getconf CLK_TCK`; 100 on every common
/// Linux platform when it cannot be asked).
pub(super) fn clk_tck() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// The fields of `/proc/<pid>/stat` after the command name (which may contain spaces), and the
/// command name. Field 3 of proc(5) (`state`) is index 0.
fn proc_stat(path: &str) -> Option<(String, Vec<u64>)> {
    let text = std::fs::read_to_string(path).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_owned();
    let fields = text
        .get(close + 1..)?
        .split_whitespace()
        .map(|f| f.parse::<u64>().unwrap_or(0))
        .collect();
    Some((comm, fields))
}

/// utime (field 14) + stime (15) of this process, all threads included.
pub(super) fn self_cpu_ticks() -> Option<u64> {
    let (_, f) = proc_stat("/proc/self/stat")?;
    Some(f.get(11)? + f.get(12)?)
}

/// (processes, ticks): utime + stime + cutime + cstime (fields 14-17) of every process named
/// `postgres`. The postmaster's child times hold the backends that exited, so a backend ending
/// between two readings does not take its CPU time with it.
pub(super) fn postgres_cpu_ticks() -> Option<(usize, u64)> {
    let mut n = 0;
    let mut ticks = 0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Some((comm, f)) = proc_stat(&format!("/proc/{pid}/stat")) else {
            continue;
        };
        if comm != "postgres" {
            continue;
        }
        n += 1;
        ticks += f.iter().skip(11).take(4).sum::<u64>();
    }
    Some((n, ticks))
}

/// A `Vm*` line of `/proc/self/status`, in KiB.
fn proc_status_kib(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Resets this process's peak RSS to its current RSS (proc(5), `/proc/pid/clear_refs`, value 5).
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn mib(kib: Option<u64>) -> String {
    kib.map_or("n/a".to_owned(), |k| {
        format!("{:.1} MiB", k as f64 / 1024.0)
    })
}

/// The first lines of every benchmark's report: which one, when, on what, run how.
pub(super) fn print_run_header(bench: &str) {
    println!("outpost bench {bench}");
    println!(
        "date:     {}",
        chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
    );
    println!(
        "machine:  {} CPUs (nproc), {}",
        std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get),
        cpu_model()
    );
    println!("command:  {}", command_line());
}

pub(super) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU model".to_owned())
}

/// The command line as typed, quoted where a shell would need it.
pub(super) fn command_line() -> String {
    std::env::args()
        .map(|a| {
            let plain = !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=,:@+%".contains(&b));
            if plain {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

// -------------------------------------------------------------------------------------------
// Redis

/// The text of `INFO <section>`.
pub(super) async fn info(
    conn: &mut MultiplexedConnection,
    section: &str,
) -> anyhow::Result<String> {
    Ok(redis::cmd("INFO").arg(section).query_async(conn).await?)
}

/// One `field:value` line of an `INFO` text.
pub(super) fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// Truncates the outbox and writes `events` events through the producer API, then
/// `VACUUM ANALYZE`s it.
pub(super) async fn preload(
    config: &Config,
    url: &str,
    store: &Store,
    events: u64,
    aggregates: u64,
    payload_bytes: usize,
) -> anyhow::Result<()> {
    store.truncate_outbox().await?;
    let load = Load {
        events,
        aggregates,
        payload_bytes,
        aggregate_type: BENCH_AGGREGATE_TYPE,
        event_type: BENCH_EVENT_TYPE,
    };
    preload_more(config, url, store, &load).await
}

/// Events `outpost produce` adds to the outbox: how many, over how many aggregates of which
/// type, of which event type and payload size.
#[derive(Debug, Clone, Copy)]
pub(super) struct Load<'a> {
    pub events: u64,
    pub aggregates: u64,
    pub payload_bytes: usize,
    pub aggregate_type: &'a str,
    pub event_type: &'a str,
}

/// Adds `load` to the outbox with `outpost produce`, as [`preload`] does (which empties it
/// first).
pub(super) async fn preload_more(
    config: &Config,
    url: &str,
    store: &Store,
    load: &Load<'_>,
) -> anyhow::Result<()> {
    let Load {
        events,
        aggregates,
        payload_bytes,
        aggregate_type,
        event_type,
    } = *load;
    // The producers are another process, as they are in production: this process's memory
    // is then the node's (and the benchmark's), not what the writers left behind.
    let started = Instant::now();
    let exe = std::env::current_exe().context("locating the outpost binary")?;
    let out = tokio::process::Command::new(exe)
        .arg("produce")
        .args(["--count", &events.to_string()])
        .args(["--aggregates", &aggregates.to_string()])
        .args(["--payload-bytes", &payload_bytes.to_string()])
        .args(["--tx-size", &PRELOAD_TX_SIZE.to_string()])
        .args(["--writers", &PRELOAD_WRITERS.to_string()])
        .args(["--aggregate-type", aggregate_type])
        .args(["--event-type", event_type])
        .args([
            "--set",
            &format!(
                "producer.max_payload_bytes={}",
                config.producer.max_payload_bytes
            ),
        ])
        // In the environment, not on the command line, where `ps` would show a password.
        .env("OUTPOST_DATABASE__URL", url)
        .kill_on_drop(true)
        .output()
        .await
        .context("running `outpost produce` for the preload")?;
    if !out.status.success() {
        bail!(
            "the preload (`outpost produce`) failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let elapsed = started.elapsed().as_secs_f64();
    let vacuum = Instant::now();
    store.vacuum_analyze_outbox().await?;
    println!(
        "preload         {} events over {} aggregates, {}-byte payloads, {} writers × {} \
         per transaction, by `outpost produce` in a process of its own: {:.1} s ({:.0} \
         events/s); VACUUM ANALYZE + CHECKPOINT {:.1} s",
        events,
        aggregates.min(events),
        payload_bytes,
        PRELOAD_WRITERS,
        PRELOAD_TX_SIZE,
        elapsed,
        events as f64 / elapsed.max(1e-9),
        vacuum.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Entries of every stream whose key matches `pattern`.
pub(super) async fn stream_entries(
    conn: &mut MultiplexedConnection,
    pattern: &str,
) -> anyhow::Result<u64> {
    let mut total = 0;
    for key in scan_keys(conn, pattern).await? {
        let kind: String = redis::cmd("TYPE").arg(&key).query_async(conn).await?;
        if kind == "stream" {
            let n: u64 = redis::cmd("XLEN").arg(&key).query_async(conn).await?;
            total += n;
        }
    }
    Ok(total)
}
