//! Noticing that Redis lost data, and re-publishing exactly what it lost.
//!
//! # What is recorded
//!
//! - **At Redis, with the entries.** Each stream has a fence hash, created with its first entry
//!   and never deleted by Outpost: per partition, its lease epoch (`<partition>`) and the newest
//!   entry id it appended (`<partition>:last`), written by the publish script in the same step
//!   as the entries. Whatever Redis keeps or loses, it keeps or loses both together: a snapshot
//!   (RDB), an append-only file cut short, a replica's copy all hold a fence as of the same
//!   moment as the stream.
//! - **In PostgreSQL, with the mark.** The statement that moves published rows to the history
//!   records per partition and stream the newest entry id it marked
//!   (`outpost_stream_position`), under the same lease check.
//! - **In the node's memory.** What each of its partitions appended to each stream
//!   ([`StreamBook`]): noted at every acknowledged append, loaded from the recorded positions
//!   when a partition is taken.
//!
//! `outpost_stream` lists the streams Outpost wrote (recorded once per heartbeat from memory);
//! `outpost_redis` holds the `run_id` last seen, an incarnation bumped by every loss found, when
//! the last loss was found, and how many events were re-published in all.
//!
//! # Detection
//!
//! - **In band, at the first append after the loss.** Each append carries the newest entry id
//!   the node knows its partition appended to the stream, and whether the stream was written
//!   before. The script appends nothing and answers "lost" when the fence hash is gone (Redis
//!   restarted empty, failed over to a replica without the data, evicted it), or when the
//!   partition's newest entry at Redis is older than the one carried (Redis came back from an
//!   older snapshot, an `everysec` AOF lost its last second, a replica that lagged was
//!   promoted). So nothing is appended past a gap, which would hide it. The batch backs off and
//!   the supervisor checks at once.
//! - **By run id, on every node.** At start, and whenever a node sees a `run_id` it has not
//!   checked itself (each node keeps its own; one node recording the new id does not spare the
//!   others their check), every recorded position is compared with the fence: a fence whose
//!   `<partition>:last` is missing or older than the recorded position means Redis lost that
//!   partition's entries after it. This finds the streams no partition has appended to since.
//!   A new `run_id` with everything in place (a restart with persistence) is recorded and
//!   logged.
//!
//! # Recovery
//!
//! Per partition, one transaction each ([`Store::recover_partition`]), so lease renewals and the
//! other partitions' marks go on: the positions must still be what the check read (else the
//! partition published meanwhile and the check is made again at the next heartbeat), the
//! partition's epoch is bumped, and the events of the partition published after the loss point
//! within `retention.republish_window_secs` go back to `pending` with their event ids. The
//! fences of the known streams are raised to the new epochs. A batch claimed before the
//! recovery carries an old epoch: its append is refused by the fence (or by the in-band check),
//! its mark by the lease check, so nothing it held can overtake the re-published rows. The owner
//! notices the new epoch at its next heartbeat and takes the partition again, loading the
//! positions the recovery set back to what Redis kept; the relay then publishes the re-queued
//! rows through its normal path, in id order — sequence order per aggregate. An ERROR is logged
//! and `outpost_redis_data_loss_total` and `outpost_republished_events_total` count it.
//!
//! # What is not recovered
//!
//! - Entries published before the window: gone for consumers that had not read them (counted
//!   and logged when Redis kept enough to place the loss point).
//! - With `relay.delete_published`, published rows are not kept, so nothing can be re-published:
//!   the loss is detected and reported all the same.
//! - A loss no position covers: entries appended and not yet marked are still in the outbox and
//!   are sent again anyway; streams written only by a version before positions were recorded
//!   are checked by their fence hash alone (a missing fence is noticed; a shortened stream is
//!   not).
//! - Events of another stream of the same partition published after the loss point are sent
//!   again too: duplicates, which consumers deduplicate by event id.

use metrics::counter;

use std::collections::{BTreeMap, HashMap};

use super::streams::StreamBook;
use crate::metrics as m;
use crate::publish::{PublishError, Publisher};
use crate::store::{LostStream, Store, StoreError};

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
    /// Everything recorded is in place.
    Fine,
    /// Redis restarted (a run id not seen before) and kept everything.
    Restarted,
    /// Redis lost entries; this node recovered the partitions they belonged to.
    Recovered {
        /// Partitions and streams found behind their recorded positions.
        streams: usize,
        /// Rows set back to pending.
        republished: u64,
        /// Partitions that published meanwhile: checked again at the next heartbeat.
        deferred: usize,
    },
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

/// Compares every recorded position with the fences at Redis (`run_id` is the instance
/// answering now) and recovers the partitions whose entries Redis lost.
pub async fn check(
    store: &Store,
    publisher: &Publisher,
    book: &StreamBook,
    run_id: &str,
    window_secs: u64,
) -> Result<Watch, WatchError> {
    record_positions(store, book).await?;
    let (redis, _) = store.redis_records().await?;
    let marks = store.stream_marks(None).await?;
    let mut names: Vec<String> = book.known();
    for m in &marks {
        if !names.contains(&m.stream) {
            names.push(m.stream.clone());
        }
    }
    let fences = publisher.fence_marks(&names).await?;
    let by_stream: HashMap<&str, &HashMap<i32, (i64, i64)>> = names
        .iter()
        .zip(&fences)
        .filter_map(|(n, f)| f.as_ref().map(|f| (n.as_str(), f)))
        .collect();
    let mut lost: BTreeMap<i32, Vec<LostStream>> = BTreeMap::new();
    for m in marks {
        let kept = by_stream
            .get(m.stream.as_str())
            .and_then(|f| f.get(&m.partition))
            .copied();
        if kept.is_none_or(|k| k < m.last) {
            lost.entry(m.partition).or_default().push(LostStream {
                stream: m.stream,
                recorded: m.last,
                kept,
            });
        }
    }
    let fenceless: Vec<&String> = names
        .iter()
        .zip(&fences)
        .filter(|(_, f)| f.is_none())
        .map(|(n, _)| n)
        .collect();
    let restarted = redis.run_id.as_deref() != Some(run_id);
    if lost.is_empty() {
        if !fenceless.is_empty() {
            // Streams without a fence and without a recorded position: written only by a
            // version before positions were recorded, or evicted or deleted. Their fences are
            // made whole again so that publishing resumes.
            let epochs = store.partition_epochs().await?;
            publisher.raise_fences(&names, &epochs).await?;
            tracing::warn!(
                streams = fenceless.len(),
                first = fenceless.first().map(|s| s.as_str()).unwrap_or_default(),
                "streams Outpost wrote have no fence at Redis, and no position of theirs is \
                 recorded; fences raised again (were keys evicted or deleted? see \
                 redis.maxmemory_policy_check)"
            );
        }
        if !restarted {
            return Ok(Watch::Fine);
        }
        store.note_redis_run_id(run_id).await?;
        if redis.run_id.is_none() {
            // The first node of a new database meets its Redis: nothing to compare with.
            tracing::info!(run_id, "Redis instance recorded");
            return Ok(Watch::Fine);
        }
        tracing::warn!(
            run_id,
            streams = names.len(),
            "Redis has a new run id (restarted, or failed over) and still holds every entry \
             Outpost recorded as published"
        );
        return Ok(Watch::Restarted);
    }
    let streams: usize = lost.values().map(Vec::len).sum();
    let first = lost
        .iter()
        .next()
        .and_then(|(p, l)| l.first().map(|l| (*p, l.clone())));
    tracing::error!(
        run_id,
        partitions = lost.len(),
        streams,
        first = ?first,
        window_secs,
        "Redis lost stream entries Outpost had published (restarted without persistence or \
         from an older snapshot, lost the last writes of its append-only file, failed over to \
         a replica that lagged, or evicted keys); re-publishing the events published after the \
         loss within retention.republish_window_secs, with their event ids. Make Redis \
         persistent with appendfsync always, and fail over only to replicas in sync, to avoid \
         this"
    );
    counter!(m::REDIS_DATA_LOSS).increment(1);
    let incarnation = store.note_redis_loss(run_id).await?;
    book.absorb(incarnation, Vec::new());
    let mut republished = 0;
    let mut outside = 0;
    let mut deferred = 0;
    for (partition, streams_lost) in lost {
        match store
            .recover_partition(partition, &streams_lost, window_secs)
            .await?
        {
            Some(r) => {
                // Raised at once: until then a batch of the partition's old epoch could append
                // to a stream that lost nothing, ahead of the re-queued events.
                publisher
                    .raise_fences(&names, &[(partition, r.epoch)])
                    .await?;
                republished += r.republished;
                outside += r.outside_window.unwrap_or(0);
            }
            None => deferred += 1,
        }
    }
    if !fenceless.is_empty() {
        let epochs = store.partition_epochs().await?;
        publisher.raise_fences(&names, &epochs).await?;
    }
    if deferred > 0 {
        // Checked again at the next heartbeat.
        book.flag_lost();
    }
    counter!(m::REPUBLISHED).increment(republished);
    tracing::error!(
        republished,
        outside_window = outside,
        deferred,
        incarnation,
        "events set back to pending for re-publishing; their partitions are taken again at new \
         epochs. Events lost outside the window are not re-published"
    );
    Ok(Watch::Recovered {
        streams,
        republished,
        deferred,
    })
}
