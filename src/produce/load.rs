//! Synthetic load through the real producer API (`outpost produce`, benchmarks, tests).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use governor::{Quota, RateLimiter};
use sea_orm::TransactionTrait;
use serde_json::json;

use super::{EventFact, ProduceError, Producer};
use crate::store::{Store, StoreError};

/// The shape of the load.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Events to write in total.
    pub count: u64,
    /// Events per second across all writers; `None` for as fast as possible.
    pub rate: Option<NonZeroU32>,
    /// Distinct aggregates the events are spread over.
    pub aggregates: u64,
    /// Aggregate type of every event.
    pub aggregate_type: String,
    /// Event type of every event.
    pub event_type: String,
    /// Approximate encoded payload size in bytes.
    pub payload_bytes: usize,
    /// Events per transaction.
    pub tx_size: u32,
    /// Concurrent writers (each with its own connection).
    pub writers: u32,
    /// Where the events go.
    pub target: WriteTarget,
}

/// The table a load writes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteTarget {
    /// Outpost's outbox, through [`Producer::enqueue_facts`].
    Outbox,
    /// The benchmark's plain copy of the table, without triggers (the baseline).
    PlainTable,
}

/// What a load run achieved.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    /// Events committed.
    pub events: u64,
    /// Transactions committed.
    pub commits: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl LoadReport {
    /// Committed events per second.
    pub fn events_per_sec(&self) -> f64 {
        self.events as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    /// Committed transactions per second.
    pub fn commits_per_sec(&self) -> f64 {
        self.commits as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// One committed transaction of a load, as its progress callback sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    /// Events committed so far, by every writer.
    pub total: u64,
    /// Load index of the transaction's first event (the payload's `n`).
    pub first: u64,
    /// Events in the transaction (load indexes `first..first + count`).
    pub count: u64,
}

/// Writes `spec.count` events with `spec.writers` concurrent writers. `progress` is called after
/// every commit, as soon as the commit returned.
pub async fn run_load(
    store: &Store,
    producer: &Producer,
    spec: &LoadSpec,
    progress: Arc<dyn Fn(Committed) + Send + Sync>,
) -> Result<LoadReport, ProduceError> {
    let tx_size = spec.tx_size.max(1);
    let limiter = spec.rate.map(|r| {
        let burst = NonZeroU32::new(tx_size.max(r.get() / 100).max(1)).unwrap_or(r);
        Arc::new(RateLimiter::direct(Quota::per_second(r).allow_burst(burst)))
    });
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let commits = Arc::new(AtomicU64::new(0));
    let pad = "x".repeat(spec.payload_bytes.saturating_sub(40));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..spec.writers.max(1) {
        let (store, producer, spec) = (store.clone(), producer.clone(), spec.clone());
        let (next, done, commits) = (next.clone(), done.clone(), commits.clone());
        let (limiter, progress, pad) = (limiter.clone(), progress.clone(), pad.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let first = next.fetch_add(u64::from(tx_size), Ordering::Relaxed);
                if first >= spec.count {
                    return Ok::<(), ProduceError>(());
                }
                let n = (spec.count - first).min(u64::from(tx_size));
                if let Some(l) = &limiter {
                    let cells = NonZeroU32::new(n as u32).unwrap_or(NonZeroU32::MIN);
                    // `cells` never exceeds the burst, which is at least `tx_size`.
                    let _ = l.until_n_ready(cells).await;
                }
                let facts = (first..first + n)
                    .map(|i| {
                        EventFact::new(
                            spec.aggregate_type.clone(),
                            format!("a{}", i % spec.aggregates.max(1)),
                            spec.event_type.clone(),
                            json!({ "n": i, "pad": pad }),
                        )
                    })
                    .collect();
                let txn = store
                    .connection()
                    .begin()
                    .await
                    .map_err(StoreError::from_db)?;
                match spec.target {
                    WriteTarget::Outbox => {
                        producer.enqueue_facts(&txn, facts).await?;
                    }
                    WriteTarget::PlainTable => {
                        let rows = facts
                            .into_iter()
                            .map(|f| producer.prepare(f))
                            .collect::<Result<Vec<_>, _>>()?;
                        crate::store::bench::insert_plain(&txn, &rows).await?;
                    }
                }
                txn.commit().await.map_err(StoreError::from_db)?;
                commits.fetch_add(1, Ordering::Relaxed);
                let total = done.fetch_add(n, Ordering::Relaxed) + n;
                progress(Committed {
                    total,
                    first,
                    count: n,
                });
            }
        }));
    }
    for t in tasks {
        match t.await {
            Ok(r) => r?,
            Err(e) => {
                return Err(StoreError::Corrupt(format!("a writer task failed: {e}")).into());
            }
        }
    }
    Ok(LoadReport {
        events: done.load(Ordering::Relaxed),
        commits: commits.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    })
}
