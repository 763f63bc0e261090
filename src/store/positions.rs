//! How far each partition's entries reached each stream (`outpost_stream_position`), and the
//! recovery of one partition after Redis lost entries of it.
//!
//! The mark that moves published rows to the history also records, in the same statement and
//! under the same lease check, the newest entry id the batch appended per stream: a position is
//! never ahead of what the history holds, and only the partition's owner writes it. The publish
//! script records the same thing in the stream's fence hash at Redis (`<partition>:last`), in
//! the same step as the entries; a Redis that lost the last writes has a fence behind the
//! position here (see `dispatch::redis_loss`).

use sea_orm::{ConnectionTrait, TransactionTrait, Value};

use super::sql::{num_array, text_array};
use super::{Store, StoreError, stmt};

/// Turns on, for the rest of the transaction, the setting under which the outbox's insert
/// trigger leaves rows that carry their transaction's id as they are
/// (`m20261206_000012_owned_columns`); [`FILLED_BY_OUTPOST_OFF`] turns it off again.
const FILLED_BY_OUTPOST_ON: &str = "SELECT set_config('outpost.filled_by_outpost', 'on', true)";
const FILLED_BY_OUTPOST_OFF: &str = "SELECT set_config('outpost.filled_by_outpost', 'off', true)";

/// The newest entry a partition appended to a stream, as recorded with its mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMark {
    /// The partition.
    pub partition: i32,
    /// Full stream key.
    pub stream: String,
    /// The entry id, as `(ms, seq)`.
    pub last: (i64, i64),
}

/// A stream of a partition whose newest entries Redis lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostStream {
    /// Full stream key.
    pub stream: String,
    /// The position recorded when the loss was found (the recovery goes ahead only if it still
    /// is: a mark in between means the check must be made again).
    pub recorded: (i64, i64),
    /// The newest entry of the partition Redis still has in the stream; `None` when Redis has
    /// nothing of it (the fence hash, or the partition's field in it, is gone).
    pub kept: Option<(i64, i64)>,
}

/// What the recovery of one partition did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionRecovery {
    /// The partition's new epoch: batches claimed before the recovery are refused.
    pub epoch: i64,
    /// Published events moved back into the outbox as `pending`.
    pub republished: u64,
    /// Events of the partition after the loss point that had left the window
    /// (`retention.republish_window_secs`) and were not re-published; `None` when Redis kept
    /// nothing of the partition's streams to place the loss point.
    pub outside_window: Option<u64>,
}

/// The statement part that records positions: `INSERT … ON CONFLICT` of the arrays `$parts`,
/// `$streams`, `$ms`, `$seqs` (one element per partition and stream, as
/// [`position_arrays`] builds them), keeping the newest of the recorded and the new position.
/// `filter` restricts the partitions written (the lease check of the statement it is part of).
pub(super) fn record_positions_sql(params: [&str; 4], filter: &str) -> String {
    let [parts, streams, ms, seqs] = params;
    format!(
        "INSERT INTO outpost_stream_position AS s (partition, stream, last_ms, last_seq) \
           SELECT v.p, v.s, v.m, v.q \
           FROM unnest({parts}::int4[], {streams}::text[], {ms}::int8[], {seqs}::int8[]) \
             AS v(p, s, m, q) \
           WHERE true{filter} ORDER BY v.p, v.s \
         ON CONFLICT (partition, stream) DO UPDATE \
           SET last_ms = EXCLUDED.last_ms, last_seq = EXCLUDED.last_seq, updated_at = now() \
           WHERE (s.last_ms, s.last_seq) < (EXCLUDED.last_ms, EXCLUDED.last_seq)"
    )
}

/// The four array parameters of [`record_positions_sql`], one element per partition and stream
/// (the newest position of each, as one statement may not update a row twice).
pub(super) fn position_arrays(positions: &[(i32, &str, i64, i64)]) -> [Value; 4] {
    let mut newest: Vec<(i32, &str, i64, i64)> = Vec::with_capacity(positions.len());
    for &(p, s, m, q) in positions {
        match newest
            .iter_mut()
            .find(|(np, ns, _, _)| *np == p && *ns == s)
        {
            Some(n) => {
                if (n.2, n.3) < (m, q) {
                    (n.2, n.3) = (m, q);
                }
            }
            None => newest.push((p, s, m, q)),
        }
    }
    let parts: Vec<i32> = newest.iter().map(|n| n.0).collect();
    let streams: Vec<&str> = newest.iter().map(|n| n.1).collect();
    let ms: Vec<i64> = newest.iter().map(|n| n.2).collect();
    let seqs: Vec<i64> = newest.iter().map(|n| n.3).collect();
    [
        num_array(&parts).into(),
        text_array(&streams).into(),
        num_array(&ms).into(),
        num_array(&seqs).into(),
    ]
}

/// Records positions of one partition inside a transaction that checked its lease.
pub(super) async fn record_positions<C: ConnectionTrait>(
    txn: &C,
    partition: i32,
    positions: &[(String, i64, i64)],
) -> Result<(), StoreError> {
    if positions.is_empty() {
        return Ok(());
    }
    let rows: Vec<(i32, &str, i64, i64)> = positions
        .iter()
        .map(|(s, m, q)| (partition, s.as_str(), *m, *q))
        .collect();
    let sql = {
        static SQL: std::sync::LazyLock<String> =
            std::sync::LazyLock::new(|| record_positions_sql(["$1", "$2", "$3", "$4"], ""));
        &*SQL
    };
    txn.execute_raw(stmt(sql, position_arrays(&rows)))
        .await
        .map_err(StoreError::from_db)?;
    Ok(())
}

impl Store {
    /// The recorded positions, of every partition or of `partitions` only.
    pub async fn stream_marks(
        &self,
        partitions: Option<&[i32]>,
    ) -> Result<Vec<StreamMark>, StoreError> {
        let rows =
            match partitions {
                None => self
                    .connection()
                    .query_all_raw(stmt(
                        "SELECT partition, stream, last_ms, last_seq FROM outpost_stream_position \
                         ORDER BY partition, stream",
                        [],
                    ))
                    .await,
                Some(parts) => self
                    .connection()
                    .query_all_raw(stmt(
                        "SELECT partition, stream, last_ms, last_seq FROM outpost_stream_position \
                         WHERE partition = ANY($1::int4[]) ORDER BY partition, stream",
                        [num_array(parts).into()],
                    ))
                    .await,
            }
            .map_err(StoreError::from_db)?;
        rows.into_iter()
            .map(|r| {
                Ok(StreamMark {
                    partition: r.try_get_by_index(0).map_err(StoreError::from_db)?,
                    stream: r.try_get_by_index(1).map_err(StoreError::from_db)?,
                    last: (
                        r.try_get_by_index(2).map_err(StoreError::from_db)?,
                        r.try_get_by_index(3).map_err(StoreError::from_db)?,
                    ),
                })
            })
            .collect()
    }

    /// Records that Redis (`run_id`) was found to have lost data: a new incarnation (positions
    /// noted in memory before it are dropped, `outpost_stream`) and the time. Returns the new
    /// incarnation.
    pub async fn note_redis_loss(&self, run_id: &str) -> Result<i64, StoreError> {
        let row = self
            .connection()
            .query_one_raw(stmt(
                "WITH r AS (UPDATE outpost_redis SET run_id = $1, incarnation = incarnation + 1, \
                              seen_at = now(), lost_at = now() RETURNING incarnation), \
                      s AS (UPDATE outpost_stream SET incarnation = (SELECT incarnation FROM r), \
                              last_ms = 0, last_seq = 0, updated_at = now() RETURNING 1) \
                 SELECT incarnation FROM r",
                [run_id.into()],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("outpost_redis has no row".to_owned()))?;
        row.try_get_by_index(0).map_err(StoreError::from_db)
    }

    /// Recovers one partition whose entries Redis lost, in one transaction of its own (the
    /// other partitions' marks and lease renewals go on meanwhile):
    ///
    /// 1. the positions of `lost` are locked and must still be what the check read (else
    ///    `None`: the partition published since, and the check is made again);
    /// 2. the partition's epoch is bumped: its batches claimed before this point are refused at
    ///    the mark, and at Redis once the fences are raised to it;
    /// 3. the events of the partition published in the last `window_secs` after the loss point
    ///    (the oldest entry lost of its streams) move back into the outbox as `pending`, with
    ///    their ids, event ids and sequences: the relay publishes them again through its normal
    ///    path, in id order, which is sequence order per aggregate. An event of another stream
    ///    of the partition published after that point is sent again too (a duplicate, which
    ///    consumers deduplicate by event id);
    /// 4. the positions are set back to what Redis kept.
    pub async fn recover_partition(
        &self,
        partition: i32,
        lost: &[LostStream],
        window_secs: u64,
    ) -> Result<Option<PartitionRecovery>, StoreError> {
        if lost.is_empty() {
            return Ok(None);
        }
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        let streams: Vec<&str> = lost.iter().map(|l| l.stream.as_str()).collect();
        let current = txn
            .query_all_raw(stmt(
                "SELECT stream, last_ms, last_seq FROM outpost_stream_position \
                 WHERE partition = $1 AND stream = ANY($2::text[]) \
                 ORDER BY stream FOR UPDATE",
                [partition.into(), text_array(&streams).into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let mut unchanged = current.len() == lost.len();
        for r in &current {
            let stream: String = r.try_get_by_index(0).map_err(StoreError::from_db)?;
            let at: (i64, i64) = (
                r.try_get_by_index(1).map_err(StoreError::from_db)?,
                r.try_get_by_index(2).map_err(StoreError::from_db)?,
            );
            unchanged &= lost.iter().any(|l| l.stream == stream && l.recorded == at);
        }
        if !unchanged {
            txn.rollback().await.map_err(StoreError::from_db)?;
            return Ok(None);
        }
        let epoch: i64 = txn
            .query_one_raw(stmt(
                "UPDATE outpost_partition SET epoch = epoch + 1 WHERE partition = $1 \
                 RETURNING epoch",
                [partition.into()],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt(format!("partition {partition} has no row")))?
            .try_get_by_index(0)
            .map_err(StoreError::from_db)?;
        // The loss point: the oldest entry kept of the lost streams (nothing kept: all of the
        // window). Rows with an entry id that cannot be read are sent again as well.
        let cut = lost
            .iter()
            .map(|l| l.kept)
            .min()
            .flatten()
            .unwrap_or((-1, -1));
        let after = "CASE WHEN p.stream_id ~ '^[0-9]{1,18}-[0-9]{1,18}$' \
                       THEN (split_part(p.stream_id, '-', 1)::int8, \
                             split_part(p.stream_id, '-', 2)::int8) > ($2::int8, $3::int8) \
                       ELSE true END";
        // The parameters of both statements over the history: partition, loss point, window.
        let after_cut = || {
            [
                partition.into(),
                cut.0.into(),
                cut.1.into(),
                i64::try_from(window_secs).unwrap_or(i64::MAX).into(),
            ]
        };
        let republished = if window_secs == 0 {
            0
        } else {
            // The rows carry this transaction's id and are written with
            // `outpost.filled_by_outpost` on (for this statement only), so the insert trigger
            // leaves their sequence, partition and id as they are; `txid` then names the
            // re-queuing transaction. An event whose id a producer wrote again after it was
            // published stays in the history: the outbox holds an event under that id already,
            // which is published anyway, and the move must not fail on it.
            txn.execute_raw(stmt(FILLED_BY_OUTPOST_ON, []))
                .await
                .map_err(StoreError::from_db)?;
            let columns = super::sql::PUBLISHED_COLUMNS
                .split(", ")
                .map(|c| if c == "txid" { "txid_current()" } else { c })
                .collect::<Vec<_>>()
                .join(", ");
            let moved = txn
                .execute_raw(stmt(
                    &format!(
                        "WITH back AS (DELETE FROM outpost_published p \
                       WHERE p.partition = $1 \
                         AND p.published_at >= now() - $4 * interval '1 second' \
                         AND {after} \
                         AND NOT EXISTS (SELECT 1 FROM outpost_event e \
                                         WHERE e.event_id = p.event_id) \
                       RETURNING p.*) \
                     INSERT INTO outpost_event ({}, status, next_attempt_at) \
                     SELECT {columns}, 'pending', now() FROM back",
                        super::sql::PUBLISHED_COLUMNS
                    ),
                    after_cut(),
                ))
                .await
                .map_err(StoreError::from_db)?
                .rows_affected();
            txn.execute_raw(stmt(FILLED_BY_OUTPOST_OFF, []))
                .await
                .map_err(StoreError::from_db)?;
            moved
        };
        // Rows after the loss point that had left the window: counted through the history's
        // index on `published_at`, from a minute before the loss point (the clocks of Redis and
        // PostgreSQL may differ). Not counted when Redis kept nothing to place the point.
        let outside_window = if cut.0 < 0 {
            None
        } else {
            let n: i64 = txn
                .query_one_raw(stmt(
                    &format!(
                        "SELECT count(*) FROM outpost_published p \
                         WHERE p.partition = $1 AND {after} \
                           AND p.published_at < now() - $4 * interval '1 second' \
                           AND p.published_at >= to_timestamp($2::int8 / 1000.0) \
                                                 - interval '1 minute'"
                    ),
                    after_cut(),
                ))
                .await
                .map_err(StoreError::from_db)?
                .map(|r| r.try_get_by_index(0))
                .transpose()
                .map_err(StoreError::from_db)?
                .unwrap_or(0);
            Some(u64::try_from(n).unwrap_or(0))
        };
        // Positions go back to what Redis kept; a stream it kept nothing of loses its row.
        let kept: Vec<(i32, &str, i64, i64)> = lost
            .iter()
            .filter_map(|l| l.kept.map(|(m, q)| (partition, l.stream.as_str(), m, q)))
            .collect();
        let [_, kept_streams, kept_ms, kept_seqs] = position_arrays(&kept);
        txn.execute_raw(stmt(
            "WITH v AS (SELECT * FROM unnest($2::text[], $3::int8[], $4::int8[]) AS v(s, m, q)), \
                  gone AS (DELETE FROM outpost_stream_position \
                           WHERE partition = $1 AND stream = ANY($5::text[]) \
                             AND stream NOT IN (SELECT s FROM v) RETURNING 1) \
             UPDATE outpost_stream_position t SET last_ms = v.m, last_seq = v.q, \
                    updated_at = now() \
             FROM v WHERE t.partition = $1 AND t.stream = v.s",
            [
                partition.into(),
                kept_streams,
                kept_ms,
                kept_seqs,
                text_array(&streams).into(),
            ],
        ))
        .await
        .map_err(StoreError::from_db)?;
        txn.execute_raw(stmt(
            "UPDATE outpost_redis SET republished = republished + $1",
            [i64::try_from(republished).unwrap_or(i64::MAX).into()],
        ))
        .await
        .map_err(StoreError::from_db)?;
        txn.commit().await.map_err(StoreError::from_db)?;
        Ok(Some(PartitionRecovery {
            epoch,
            republished,
            outside_window,
        }))
    }
}
