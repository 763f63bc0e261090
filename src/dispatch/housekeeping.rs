//! Storage hygiene, run by every node next to its supervisor:
//!
//! - **The janitor** ([`janitor`]) deletes published rows past `retention.published_secs`,
//!   `no_destination` rows past `retention.no_destination_secs` and `discarded` rows past
//!   `retention.discarded_secs`, `retention.batch_rows` at a time with `retention.batch_pause_ms`
//!   between statements, every `retention.interval_ms`. Quarantined rows stay until an operator
//!   acts. Each statement takes a transaction-scoped advisory lock first: with several nodes, one
//!   deletes at a time and the others skip. With `retention.vacuum` it then runs `VACUUM` on the
//!   outbox table (for databases where autovacuum is off).
//! - **The trimmer** ([`trimmer`]) trims every stream Outpost wrote (`outpost_stream`) below what
//!   every consumer group has acknowledged (see [`crate::publish::TrimRule`]).
//! - **Storage metrics** ([`storage_metrics`]): table and index size, dead tuples, the vacuum
//!   horizon, prepared transactions.
//!
//! They are tasks of the node's actix system and end with it; a delete interrupted by shutdown
//! is rolled back.

use std::time::Duration;

use metrics::{counter, gauge};

use crate::config::RetentionConfig;
use crate::metrics as m;
use crate::publish::{Publisher, TrimRule};
use crate::store::{Expiry, Store, StoreError};

/// How often storage figures are read.
pub const STORAGE_METRICS_EVERY: Duration = Duration::from_secs(15);

/// What one janitor round deleted, per state; `None` when another node's janitor held the lock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// Published rows deleted.
    pub published: u64,
    /// `no_destination` rows deleted.
    pub no_destination: u64,
    /// `discarded` rows deleted.
    pub discarded: u64,
    /// Statements that found the janitor lock taken.
    pub skipped: u64,
}

/// One janitor round: every state, in batches, until nothing past its window is left.
pub async fn sweep(store: &Store, r: &RetentionConfig) -> Result<Swept, StoreError> {
    let mut swept = Swept::default();
    for (expiry, secs) in [
        (Expiry::Published, r.published_secs),
        (Expiry::NoDestination, r.no_destination_secs),
        (Expiry::Discarded, r.discarded_secs),
    ] {
        loop {
            let Some(n) = store.delete_expired(expiry, secs, r.batch_rows).await? else {
                swept.skipped += 1;
                break;
            };
            counter!(m::RETENTION_DELETED, "state" => expiry.state()).increment(n);
            match expiry {
                Expiry::Published => swept.published += n,
                Expiry::NoDestination => swept.no_destination += n,
                Expiry::Discarded => swept.discarded += n,
            }
            if n < u64::from(r.batch_rows) {
                break;
            }
            tokio::time::sleep(r.batch_pause()).await;
        }
    }
    Ok(swept)
}

/// The janitor loop.
pub async fn janitor(store: Store, r: RetentionConfig) {
    loop {
        match sweep(&store, &r).await {
            Ok(s) if s.published + s.no_destination + s.discarded > 0 => {
                tracing::info!(
                    published = s.published,
                    no_destination = s.no_destination,
                    discarded = s.discarded,
                    "retention: rows past their window deleted"
                );
                if r.vacuum
                    && let Err(e) = store.vacuum_outbox().await
                {
                    tracing::warn!(error = %e, "retention: VACUUM of the outbox failed (retention.vacuum)");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "retention: deleting old rows failed; retrying later")
            }
        }
        tokio::time::sleep(r.interval()).await;
    }
}

/// One trimming round over every recorded stream; returns (trimmed, capped) entries.
pub async fn trim_all(
    store: &Store,
    publisher: &Publisher,
    rule: TrimRule,
) -> Result<(u64, u64), crate::dispatch::redis_loss::WatchError> {
    let (_, streams) = store.redis_records().await?;
    let (mut trimmed, mut capped) = (0, 0);
    for s in streams {
        let report = publisher.trim(&s.stream, rule).await?;
        let reason = if report.groups == Some(0) {
            "age"
        } else {
            "acknowledged"
        };
        counter!(m::STREAM_TRIMMED, "reason" => reason).increment(report.trimmed);
        counter!(m::STREAM_TRIMMED, "reason" => "cap").increment(report.capped);
        if report.capped > 0 {
            tracing::warn!(
                stream = %s.stream,
                dropped = report.capped,
                trimmed_safely = report.trimmed,
                groups = report.groups.unwrap_or(0),
                max_len = rule.max_len,
                "retention.stream_max_len dropped entries that consumers had not acknowledged \
                 (or read): they are gone from the stream; raise the cap or speed up the \
                 consumers"
            );
        }
        trimmed += report.trimmed;
        capped += report.capped;
    }
    Ok((trimmed, capped))
}

/// The trimmer loop.
pub async fn trimmer(store: Store, publisher: Publisher, r: RetentionConfig) {
    let rule = TrimRule {
        ungrouped_after_ms: r.trim_ungrouped_after_secs.saturating_mul(1000),
        max_len: r.stream_max_len,
    };
    loop {
        if let Err(e) = trim_all(&store, &publisher, rule).await {
            tracing::warn!(error = %e, "retention: trimming streams failed; retrying later");
        }
        tokio::time::sleep(r.trim_interval()).await;
    }
}

/// Reads the storage figures into their gauges once.
pub async fn refresh_storage_metrics(store: &Store) -> Result<(), StoreError> {
    let f = store.storage_figures().await?;
    gauge!(m::TABLE_BYTES).set(f.table_bytes as f64);
    gauge!(m::INDEX_BYTES).set(f.index_bytes as f64);
    gauge!(m::DEAD_TUPLES).set(f.dead_tuples as f64);
    gauge!(m::LIVE_TUPLES).set(f.live_tuples as f64);
    gauge!(m::XMIN_AGE).set(f.xmin_age_xids as f64);
    gauge!(m::OLDEST_XACT).set(f.oldest_xact_secs);
    gauge!(m::PREPARED_XACTS).set(f.prepared_xacts as f64);
    gauge!(m::PUBLISHED_BYTES).set(f.published_bytes as f64);
    Ok(())
}

/// The storage metrics loop.
pub async fn storage_metrics(store: Store) {
    loop {
        if let Err(e) = refresh_storage_metrics(&store).await {
            tracing::debug!(error = %e, "reading storage figures failed");
        }
        tokio::time::sleep(STORAGE_METRICS_EVERY).await;
    }
}
