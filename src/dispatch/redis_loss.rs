//! Noticing that Redis lost data, and re-publishing what it lost.
//!
//! # What is recorded
//!
//! Every heartbeat the supervisor reads Redis's `run_id` (with the readiness check, one
//! `INFO`). While a node publishes, it records once per heartbeat, from memory
//! ([`StreamBook`]), the newest entry id Redis acknowledged per stream (`outpost_stream`).
//! `outpost_redis` holds the `run_id` last seen and an incarnation number.
//!
//! # Detection
//!
//! - **In band.** Each stream has a fence hash, created with its first entry and never deleted
//!   by Outpost. An append to a stream this node knows was written before carries a flag, and the
//!   publish script refuses it (appending nothing) when the fence hash is gone: Redis restarted
//!   empty, failed over to a replica without the data, or evicted it. The batch backs off, and
//!   the supervisor checks at once.
//! - **By run id.** When the `run_id` differs from the one recorded (and at start), every
//!   recorded stream is checked: a missing fence, a missing stream, or a `last-generated-id`
//!   behind the recorded position (a replica that lagged) means data was lost. A new `run_id`
//!   with everything in place (a restart with persistence) is only recorded.
//!
//! # Recovery
//!
//! One transaction ([`Store::recover_redis_loss`]), done by the first node to get there for that
//! `run_id`: a new incarnation, every partition's epoch bumped, the rows published within
//! `retention.republish_window_secs` set back to `pending` (same event ids), positions reset.
//! Then the fences of every known stream are raised to the new epochs. A batch claimed before
//! the recovery carries an old epoch: its append is refused by the fence (or, before the fences
//! are raised, by the in-band check), its mark by the lease check, so nothing it held can
//! overtake the re-published rows. The owners notice the new epochs at their next heartbeat and
//! take their partitions again; the relay then publishes the reset rows through its normal path,
//! in id order per partition — sequence order per aggregate. An ERROR is logged and
//! `outpost_redis_data_loss_total` counts it.
//!
//! What cannot be recovered: rows published before the window (gone for consumers that had not
//! read them), and entries appended after the loss and before it was noticed to a stream this
//! node did not know about (a stream first written by another node less than a heartbeat
//! earlier).

use metrics::counter;

use super::streams::StreamBook;
use crate::metrics as m;
use crate::publish::{PublishError, Publisher};
use crate::store::{Store, StoreError};

/// Why a check could not finish (it is retried at the next heartbeat).
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Redis failed.
    #[error(transparent)]
    Redis(#[from] PublishError),
}

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watch {
    /// Nothing to check, or everything in place.
    Fine,
    /// Redis restarted (new run id) and kept everything.
    Restarted,
    /// Redis lost data; this node recovered (`republished` rows set back to pending).
    Recovered {
        /// Streams found lost.
        streams: usize,
        /// Rows set back to pending.
        republished: u64,
    },
    /// Redis lost data and another node had already recovered; this node raised the fences.
    RecoveredElsewhere,
}

/// Writes the positions noted since the last heartbeat (one statement, only when there are).
pub async fn record_positions(store: &Store, book: &StreamBook) -> Result<(), StoreError> {
    let (incarnation, dirty) = book.take_dirty();
    if dirty.is_empty() {
        return Ok(());
    }
    let (current, recorded) = store.record_streams(incarnation, &dirty).await?;
    book.absorb(current, recorded);
    Ok(())
}

/// Loads the recorded streams into the book (at start).
pub async fn load_known(store: &Store, book: &StreamBook) -> Result<(), StoreError> {
    let (current, recorded) = store.record_streams(-1, &[]).await?;
    book.absorb(current, recorded);
    Ok(())
}

/// Checks every recorded stream against Redis (`run_id` is the instance answering now) and
/// recovers when Redis lost data. `force`: check even when the recorded run id matches (a
/// batch found a fence missing).
pub async fn check(
    store: &Store,
    publisher: &Publisher,
    book: &StreamBook,
    run_id: &str,
    force: bool,
    window_secs: u64,
) -> Result<Watch, WatchError> {
    record_positions(store, book).await?;
    let (redis, records) = store.redis_records().await?;
    let same_instance = redis.run_id.as_deref() == Some(run_id);
    if same_instance && !force {
        return Ok(Watch::Fine);
    }
    let mut names: Vec<String> = records.iter().map(|r| r.stream.clone()).collect();
    for s in book.known() {
        if !names.contains(&s) {
            names.push(s);
        }
    }
    let positions = publisher.stream_positions(&names).await?;
    let lost: Vec<&str> = names
        .iter()
        .zip(&positions)
        .filter(|(name, pos)| {
            let behind = records.iter().any(|r| {
                &r.stream == *name
                    && r.incarnation == redis.incarnation
                    && pos.last.is_none_or(|last| last < r.last)
            });
            !pos.fence || behind
        })
        .map(|(name, _)| name.as_str())
        .collect();
    if lost.is_empty() {
        if same_instance {
            return Ok(Watch::Fine);
        }
        store.note_redis_run_id(run_id).await?;
        tracing::info!(
            run_id,
            streams = names.len(),
            "Redis has a new run id and still holds every stream Outpost wrote (restarted with \
             persistence, or first start)"
        );
        return Ok(Watch::Restarted);
    }
    if same_instance {
        // Another node recovered for this instance already (or keys were evicted or deleted
        // without a restart): make the fences whole again so publishing resumes.
        let epochs = store.partition_epochs().await?;
        publisher.raise_fences(&names, &epochs).await?;
        tracing::warn!(
            streams = lost.len(),
            "streams without their fence on a Redis whose loss was already handled; fences \
             raised again (were keys evicted or deleted? see redis.maxmemory_policy_check)"
        );
        return Ok(Watch::RecoveredElsewhere);
    }
    tracing::error!(
        run_id,
        lost_streams = lost.len(),
        first = lost.first().copied().unwrap_or_default(),
        window_secs,
        "Redis lost stream data (restarted without persistence, failed over to a replica that \
         lagged, or evicted keys); re-publishing the events published in the last \
         retention.republish_window_secs with their event ids. Events published before the \
         window are not re-published: consumers that had not read them have lost them. Make \
         Redis persistent (appendonly yes) to avoid this"
    );
    counter!(m::REDIS_DATA_LOSS).increment(1);
    match store.recover_redis_loss(run_id, window_secs).await? {
        Some(recovery) => {
            publisher.raise_fences(&names, &recovery.epochs).await?;
            book.absorb(recovery.incarnation, Vec::new());
            counter!(m::REPUBLISHED).increment(recovery.republished);
            tracing::error!(
                republished = recovery.republished,
                incarnation = recovery.incarnation,
                "events set back to pending for re-publishing; partitions are taken again at new \
                 epochs"
            );
            Ok(Watch::Recovered {
                streams: lost.len(),
                republished: recovery.republished,
            })
        }
        None => {
            let epochs = store.partition_epochs().await?;
            publisher.raise_fences(&names, &epochs).await?;
            Ok(Watch::RecoveredElsewhere)
        }
    }
}
