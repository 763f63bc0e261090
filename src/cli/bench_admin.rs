//! `outpost bench admin`: how fast the operator surface answers over a large outbox and history:
//! the overview, an event search (first page, and a deep page by keyset) and a dead-letter
//! filter, each as the panel and the API run it (a page and its capped count), with the plans
//! PostgreSQL chose.

use std::time::{Duration, Instant};

use clap::Args;

use crate::config::Config;
use crate::store::{COUNT_CAP, EventFilter, EventState, Store};

/// Options of `outpost bench admin`.
#[derive(Debug, Args)]
pub struct AdminBench {
    /// Rows in the outbox (a thousandth of them quarantined).
    #[arg(long, default_value_t = 5_000_000)]
    outbox: u64,
    /// Rows in the published history.
    #[arg(long, default_value_t = 5_000_000)]
    history: u64,
    /// Times each request is made.
    #[arg(long, default_value_t = 200)]
    rounds: u32,
}

pub(super) async fn run(config: &Config, args: AdminBench) -> anyhow::Result<()> {
    let scratch = super::scratch::Scratch::create(config, "outpost_bench_admin").await?;
    let outcome = async {
        let store = scratch.store(4, "admin").await?;
        let parts = measure(&store, &args);
        super::scratch::until_interrupted(parts, &store).await
    }
    .await;
    scratch.finish(outcome).await
}

async fn measure(store: &Store, args: &AdminBench) -> anyhow::Result<()> {
    let started = Instant::now();
    store.fill_admin_bench(args.outbox, args.history).await?;
    println!(
        "filled {} outbox rows and {} published rows in {:.0} s",
        args.outbox,
        args.history,
        started.elapsed().as_secs_f64()
    );
    let any = EventFilter::default();
    let dead = EventFilter {
        state: Some(EventState::Quarantined),
        error_code: Some("WRONGTYPE".to_owned()),
        ..EventFilter::default()
    };
    let deep = i64::try_from(args.outbox * 4 / 5).unwrap_or(i64::MAX);
    for (name, filter, after) in [
        ("search, first page", &any, None),
        ("search, deep page (keyset)", &any, Some(deep)),
        ("dead letters by code", &dead, None),
    ] {
        println!("plan of {name}:");
        for line in store.explain_search(filter, after).await? {
            println!("    {line}");
        }
    }
    println!(
        "{:<28} {:>9} {:>9} {:>9}",
        "request", "p50 ms", "p99 ms", "max ms"
    );
    let overview = time(args.rounds, || async {
        Ok(store.overview().await.map(drop)?)
    })
    .await?;
    report("overview (all of the below)", &overview);
    let t = time(args.rounds, || async {
        Ok(store.stored_backlog().await.map(drop)?)
    })
    .await?;
    report("  backlog figures (stored)", &t);
    let t = time(args.rounds, || async {
        Ok(store.nodes_status().await.map(drop)?)
    })
    .await?;
    report("  nodes", &t);
    let t = time(args.rounds, || async {
        Ok(store.quarantined_by_code().await.map(drop)?)
    })
    .await?;
    report("  quarantined by code", &t);
    let t = time(args.rounds, || async {
        Ok(store.publish_rate().await.map(drop)?)
    })
    .await?;
    report("  publish rate", &t);
    for (name, filter, after) in [
        ("search, first page", &any, None),
        ("search, deep page (keyset)", &any, Some(deep)),
        ("dead letters by code", &dead, None),
    ] {
        let t = time(args.rounds, || async {
            store.search_events(filter, after, 50).await?;
            store.count_events(filter, COUNT_CAP).await?;
            Ok(())
        })
        .await?;
        report(name, &t);
    }
    Ok(())
}

async fn time<F, Fut>(rounds: u32, mut f: F) -> anyhow::Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut out = Vec::with_capacity(rounds as usize);
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        f().await?;
        out.push(t.elapsed());
    }
    out.sort();
    Ok(out)
}

fn report(name: &str, sorted: &[Duration]) {
    let at = |q: f64| {
        let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
        sorted[i].as_secs_f64() * 1000.0
    };
    println!(
        "{name:<28} {:>9.2} {:>9.2} {:>9.2}",
        at(0.5),
        at(0.99),
        at(1.0)
    );
}
