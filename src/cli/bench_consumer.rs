//! `outpost bench consumer`: how fast the consumer helpers apply a stream's events with the inbox
//! and positions in PostgreSQL, with one and with two group members, against a bare consumer
//! loop that applies the same statement per event without any of the helper's guarantees.
//!
//! With `--kills`, two members instead run the same stream three times, undisturbed, then
//! killed in turn every 2–4 s (a seeded schedule; a killed member's task is aborted, leaving
//! what it had read pending, and it is started again at once under a new name, as a restarted
//! process would be), then undisturbed again; the ratio of the throughput with kills to the
//! mean of the two undisturbed runs is reported.
//!
//! Works in a scratch database `outpost_bench_consumer` (dropped and created at the start,
//! dropped at the end) and under a Redis key prefix of its own. Consumers run in this process.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use rand::SeedableRng;
use redis::aio::MultiplexedConnection;
use sea_orm::{DatabaseTransaction, TransactionTrait};

use super::bench_relay::{
    clk_tck, info, info_field, postgres_cpu_ticks, print_run_header, self_cpu_ticks,
};
use super::scratch::Scratch;
use crate::config::Config;
use crate::consume::{Consumer, ConsumerSettings, Delivery, Handler, HandlerError};
use crate::publish::{Message, entry_fields};
use crate::store::Store;
use crate::store::bench::apply_to_projection;

const DB_NAME: &str = "outpost_bench_consumer";

/// Options of `outpost bench consumer`.
#[derive(Debug, Args)]
pub struct ConsumerBench {
    /// Events in the stream for each run.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Distinct aggregates.
    #[arg(long, default_value_t = 1_000)]
    aggregates: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 200)]
    payload_bytes: usize,
    /// Group members to run, one run per value.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    members: Vec<usize>,
    /// Aggregates each member processes at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Entries read per round.
    #[arg(long, default_value_t = 200)]
    batch: usize,
    /// Two members, with and without being killed in turn every 2–4 s; reports the ratio.
    #[arg(long)]
    kills: bool,
    /// Seed of the kill schedule (`--kills`).
    #[arg(long, default_value_t = 13)]
    kill_seed: u64,
    /// The members' `member_timeout` in milliseconds (default: the helper's default).
    #[arg(long)]
    member_timeout_ms: Option<u64>,
}

/// The handler under test: one upsert into a projection.
struct Project;

impl Handler for Project {
    async fn handle(
        &self,
        event: &Delivery,
        txn: &DatabaseTransaction,
    ) -> Result<(), HandlerError> {
        apply_to_projection(txn, &event.aggregate_id, event.aggregate_seq, &event.data)
            .await
            .map_err(HandlerError::retry)
    }
}

pub(super) async fn run(config: &Config, args: ConsumerBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(config, DB_NAME).await?;
    let outcome = async {
        let max_members = if args.kills {
            2
        } else {
            args.members.iter().copied().max().unwrap_or(1)
        };
        let store = scratch
            .store(
                u32::try_from(max_members * args.concurrency + 4)?,
                "consumer",
            )
            .await?;
        let mut rconn = scratch.rconn.clone();
        let server_info = info(&mut rconn, "server").await?;
        print_run_header("consumer");
        println!(
            "servers:  PostgreSQL {}, Redis {}",
            store.server_version().await?,
            info_field(&server_info, "redis_version").unwrap_or("?")
        );
        println!(
            "work:     {} events over {} aggregates, {} B payloads; handler = one upsert per \
             event; concurrency {} per member, batch {}",
            args.events, args.aggregates, args.payload_bytes, args.concurrency, args.batch
        );
        println!();
        println!(
            "{:<28} {:>10} {:>10} {:>12} {:>14}",
            "run", "seconds", "events/s", "process CPU", "PostgreSQL CPU"
        );
        let run = Run {
            args: &args,
            store: &store,
            redis_url: &scratch.redis_url,
            prefix: &scratch.prefix,
        };
        if args.kills {
            // Undisturbed before and after, so neither warm-up nor a drift of the machine's
            // speed during the runs favours one side.
            let before = run.helper(&mut rconn, 2, None).await?;
            let killed = run.helper(&mut rconn, 2, Some(args.kill_seed)).await?;
            let after = run.helper(&mut rconn, 2, None).await?;
            println!();
            println!(
                "with kills / without (mean of before and after): {:.2} (2 members killed in \
                 turn every 2-4 s, seed {}; member_timeout {:?})",
                killed / ((before + after) / 2.0),
                args.kill_seed,
                args.member_timeout_ms
                    .map(Duration::from_millis)
                    .unwrap_or(ConsumerSettings::new("", "", "").member_timeout)
            );
        } else {
            run.bare(&mut rconn).await?;
            for &m in &args.members {
                run.helper(&mut rconn, m, None).await?;
            }
        }
        store.connection().clone().close().await.ok();
        anyhow::Ok(())
    }
    .await;
    scratch.finish(outcome).await
}

/// A running member: its stop signal and its task.
type Member = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<crate::consume::ConsumerStats, crate::consume::ConsumeError>>,
);

struct Run<'a> {
    args: &'a ConsumerBench,
    store: &'a Store,
    redis_url: &'a str,
    prefix: &'a str,
}

impl Run<'_> {
    /// Fills a fresh stream with the events, as the relay writes them.
    async fn preload(&self, conn: &mut MultiplexedConnection, stream: &str) -> anyhow::Result<()> {
        self.store.reset_consumer_bench().await?;
        let payload = format!(
            r#"{{"pad":"{}"}}"#,
            "x".repeat(self.args.payload_bytes.saturating_sub(10))
        );
        let mut seqs = vec![0i64; usize::try_from(self.args.aggregates.max(1))?];
        let mut n = 0u64;
        while n < self.args.events {
            let mut pipe = redis::pipe();
            for _ in 0..1000.min(self.args.events - n) {
                let a = usize::try_from(n % self.args.aggregates.max(1))?;
                seqs[a] += 1;
                let fields = entry_fields(Message {
                    event_id: uuid::Uuid::now_v7().to_string(),
                    event_type: "order.changed".into(),
                    aggregate_type: "order".into(),
                    aggregate_id: format!("o{a}"),
                    aggregate_seq: seqs[a],
                    schema_version: "1".into(),
                    time: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    payload: payload.clone(),
                    headers: "{}".into(),
                })?;
                pipe.cmd("XADD").arg(stream).arg("*");
                for (k, v) in fields {
                    pipe.arg(k).arg(v);
                }
                n += 1;
            }
            let _: Vec<String> = pipe.query_async(conn).await.context("preloading")?;
        }
        Ok(())
    }

    /// A bare consumer: XREADGROUP, one transaction per event with the same upsert, XACK per
    /// batch. No inbox, no order check, no reclaim: what the helper's guarantees are measured
    /// against.
    async fn bare(&self, conn: &mut MultiplexedConnection) -> anyhow::Result<()> {
        let stream = format!("{}bare", self.prefix);
        self.preload(conn, &stream).await?;
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg("bare")
            .arg("0")
            .query_async(conn)
            .await?;
        let usage = Usage::start();
        let db = self.store.connection().clone();
        loop {
            let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("bare")
                .arg("c1")
                .arg("COUNT")
                .arg(self.args.batch)
                .arg("STREAMS")
                .arg(&stream)
                .arg(">")
                .query_async(conn)
                .await?;
            let entries = super::tail::flatten(reply);
            if entries.is_empty() {
                break;
            }
            let work = entries.iter().map(|e| {
                let db = db.clone();
                let agg: String = e.get("ce_subject").unwrap_or_default();
                let seq: i64 = e.get("ce_aggregateseq").unwrap_or_default();
                let data: String = e.get("data").unwrap_or_default();
                async move {
                    let txn = db.begin().await?;
                    apply_to_projection(&txn, &agg, seq, &data).await?;
                    txn.commit().await?;
                    anyhow::Ok(())
                }
            });
            futures::StreamExt::collect::<Vec<_>>(futures::StreamExt::buffer_unordered(
                futures::stream::iter(work),
                self.args.concurrency,
            ))
            .await
            .into_iter()
            .collect::<anyhow::Result<Vec<()>>>()?;
            let ids: Vec<&str> = entries.iter().map(|e| e.id.as_str()).collect();
            let _: i64 = redis::cmd("XACK")
                .arg(&stream)
                .arg("bare")
                .arg(&ids)
                .query_async(conn)
                .await?;
        }
        self.report("bare loop, 1 member", usage).await?;
        Ok(())
    }

    /// Starts a member of the benchmark's group.
    async fn member(&self, stream: &str, name: String) -> anyhow::Result<Member> {
        let mut s = ConsumerSettings::new(self.redis_url, stream.to_owned(), "bench");
        s.key_prefix = self.prefix.to_owned();
        s.consumer = name;
        s.concurrency = self.args.concurrency;
        s.batch = self.args.batch;
        s.block = Duration::from_millis(100);
        if let Some(ms) = self.args.member_timeout_ms {
            s.member_timeout = Duration::from_millis(ms);
        }
        let consumer = Consumer::connect(s, self.store.connection().clone(), Project).await?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run_until(async move {
            let _ = rx.await;
        }));
        Ok((tx, task))
    }

    /// `members` helpers in one group until every event is applied; with `kills`, the members
    /// are killed in turn every 2–4 s on a schedule seeded with it. Returns events per second.
    async fn helper(
        &self,
        conn: &mut MultiplexedConnection,
        members: usize,
        kills: Option<u64>,
    ) -> anyhow::Result<f64> {
        let stream = format!(
            "{}helper{members}{}",
            self.prefix,
            match kills {
                Some(_) => "k".to_owned(),
                None => uuid::Uuid::now_v7().simple().to_string(),
            }
        );
        self.preload(conn, &stream).await?;
        let usage = Usage::start();
        let mut running = Vec::new();
        for m in 0..members {
            running.push(self.member(&stream, format!("m{m}")).await?);
        }
        let mut schedule = kills.map(rand::rngs::StdRng::seed_from_u64);
        let pause = |rng: &mut rand::rngs::StdRng| {
            Duration::from_millis(rand::Rng::random_range(rng, 2_000..=4_000))
        };
        let mut next_kill = schedule.as_mut().map(|r| Instant::now() + pause(r));
        let mut killed = 0usize;
        let want = i64::try_from(self.args.events)?;
        let mut last = (Instant::now(), 0i64);
        loop {
            let applied = self.store.consumer_bench_applied().await?;
            if applied >= want {
                break;
            }
            if let (Some(at), Some(rng)) = (next_kill, schedule.as_mut())
                && Instant::now() >= at
            {
                // Killed as a process is: what it read stays pending, its transactions in
                // flight roll back; started again at once under a new name.
                let slot = killed % members;
                running[slot].1.abort();
                let _ = (&mut running[slot].1).await;
                killed += 1;
                running[slot] = self.member(&stream, format!("m{slot}-{killed}")).await?;
                next_kill = Some(Instant::now() + pause(rng));
            }
            if applied > last.1 {
                last = (Instant::now(), applied);
            } else if last.0.elapsed() > Duration::from_secs(60) {
                anyhow::bail!("stalled at {applied} of {want} events");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let label = format!(
            "helper, {members} member{}{}",
            if members == 1 { "" } else { "s" },
            if kills.is_some() {
                format!(", {killed} kills")
            } else {
                String::new()
            }
        );
        let reported = self.report(&label, usage).await;
        for (stop, task) in running {
            let _ = stop.send(());
            task.await??;
        }
        reported
    }

    /// Prints a run's line; returns its events per second.
    async fn report(&self, label: &str, usage: Usage) -> anyhow::Result<f64> {
        let secs = usage.at.elapsed().as_secs_f64();
        let tck = clk_tck();
        let cpu = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => {
                format!("{:.0}%", (b.saturating_sub(a)) as f64 / tck / secs * 100.0)
            }
            _ => "?".to_owned(),
        };
        println!(
            "{:<28} {:>10.2} {:>10.0} {:>12} {:>14}",
            label,
            secs,
            self.args.events as f64 / secs,
            cpu(usage.proc_ticks, self_cpu_ticks()),
            cpu(usage.pg_ticks, postgres_cpu_ticks().map(|(_, t)| t)),
        );
        Ok(self.args.events as f64 / secs)
    }
}

struct Usage {
    at: Instant,
    proc_ticks: Option<u64>,
    pg_ticks: Option<u64>,
}

impl Usage {
    fn start() -> Self {
        Self {
            at: Instant::now(),
            proc_ticks: self_cpu_ticks(),
            pg_ticks: postgres_cpu_ticks().map(|(_, t)| t),
        }
    }
}
