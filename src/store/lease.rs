//! Partition leases: acquisition (bumping the epoch, the fencing token), renewal, release, pause.
//!
//! All lease time is the database's clock (`now()`); a node never compares its own wall clock
//! with `lease_until`.

use std::sync::LazyLock;

use sea_orm::{ConnectionTrait, TransactionTrait};

use super::sql::num_array;
use super::{DbErrorKind, Store, StoreError, classify, stmt};

/// A partition lease held by a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Partition number.
    pub partition: i32,
    /// Epoch at acquisition: the fencing token for every publish and mark.
    pub epoch: i64,
    /// Paused by an operator: the owner holds it but publishes nothing.
    pub paused: bool,
}

/// What one maintenance tick learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseTick {
    /// Leases this node still holds, renewed.
    pub held: Vec<Lease>,
    /// Of those, the partitions with rows ready to publish now (the scheduled poll that catches
    /// missed nudges).
    pub ready: Vec<i32>,
    /// The outbox was locked by another session beyond the pool's `lock_timeout` (an ACCESS
    /// EXCLUSIVE lock, or one queued): the leases were renewed without the poll, and `ready` is
    /// empty.
    pub outbox_locked: bool,
    /// Nodes with a heartbeat younger than the node TTL (including this one).
    pub live_nodes: u32,
    /// This node's place among the live nodes ordered by id (0-based): with `partitions` not
    /// divisible by `live_nodes`, the first ones take one partition more.
    pub rank: u32,
    /// Total number of partitions.
    pub partitions: u32,
}

fn leases(rows: Vec<sea_orm::QueryResult>) -> Result<Vec<Lease>, StoreError> {
    rows.into_iter()
        .map(|r| {
            Ok(Lease {
                partition: r.try_get_by_index(0).map_err(StoreError::from_db)?,
                epoch: r.try_get_by_index(1).map_err(StoreError::from_db)?,
                paused: r.try_get_by_index(2).map_err(StoreError::from_db)?,
            })
        })
        .collect()
}

/// The tick's statement, with `ready` as the expression of its fourth column (whether the
/// renewed partition has rows ready to publish).
fn tick_sql(ready: &str) -> String {
    format!(
        "WITH hb AS (UPDATE outpost_node SET heartbeat_at = now(), \
                       nudge_until = now() + $3 * interval '1 millisecond' \
                     WHERE node_id = $1 RETURNING node_id), \
              renewed AS (UPDATE outpost_partition \
                          SET lease_until = now() + $2 * interval '1 millisecond' \
                          WHERE owner = $1 RETURNING partition, epoch, paused) \
         SELECT r.partition, r.epoch, r.paused, {ready}, \
                (SELECT count(*) FROM outpost_node \
                 WHERE heartbeat_at > now() - $3 * interval '1 millisecond' \
                    OR node_id IN (SELECT node_id FROM hb))::int8, \
                (SELECT count(*) FROM outpost_partition)::int8, \
                (SELECT count(*) FROM outpost_node \
                 WHERE heartbeat_at > now() - $3 * interval '1 millisecond' \
                   AND node_id < $1)::int8 \
         FROM (SELECT NULL::int4 AS partition, NULL::int8 AS epoch, NULL::bool AS paused \
               UNION ALL SELECT * FROM renewed) r"
    )
}

impl Store {
    /// Heartbeat, lease renewal and the scheduled poll in one statement: refreshes the node's
    /// heartbeat, extends every lease it owns by `lease_ms`, says which of them have rows ready,
    /// and counts the live nodes (heartbeat within `node_ttl_ms`). An idle node runs only this,
    /// once per heartbeat.
    ///
    /// The renewal must not wait for the outbox: a session holding it in ACCESS EXCLUSIVE mode
    /// (an `ALTER TABLE`, a `VACUUM FULL`, or such a statement queued behind a long query) would
    /// otherwise hold back every node's heartbeat and let their leases expire. So a node runs
    /// its ticks on a pool whose sessions have a `lock_timeout`
    /// ([`super::ConnectSettings::lock_timeout`]); when the statement is refused a lock, the tick
    /// renews again without the poll, reading no outbox ([`LeaseTick::outbox_locked`]).
    ///
    /// Each is one statement outside any explicit transaction: a node frozen between its
    /// statements then holds no lock on the lease rows, and other nodes can take its partitions
    /// once its leases expire.
    pub async fn lease_tick(
        &self,
        node_id: &str,
        lease_ms: u64,
        node_ttl_ms: u64,
    ) -> Result<LeaseTick, StoreError> {
        static WITH_POLL: LazyLock<String> = LazyLock::new(|| {
            tick_sql(
                "r.partition IS NOT NULL AND (EXISTS ( \
                   SELECT 1 FROM outpost_event e WHERE e.partition = r.partition \
                   AND e.status = 'pending' AND e.next_attempt_at <= now()) \
                 OR EXISTS ( \
                   SELECT 1 FROM outpost_event e WHERE e.partition = r.partition \
                   AND e.status = 'retry_wait' AND e.next_attempt_at <= now()))",
            )
        });
        static WITHOUT_POLL: LazyLock<String> = LazyLock::new(|| tick_sql("false"));
        let tick = |sql: &'static str| {
            self.connection().query_all_raw(stmt(
                sql,
                [node_id.into(), ms(lease_ms).into(), ms(node_ttl_ms).into()],
            ))
        };
        let (rows, outbox_locked) = match tick(&WITH_POLL).await {
            Ok(rows) => (rows, false),
            Err(e) if classify(&e) == DbErrorKind::LockNotAvailable => (
                tick(&WITHOUT_POLL).await.map_err(StoreError::from_db)?,
                true,
            ),
            Err(e) => return Err(StoreError::from_db(e)),
        };
        let mut held = Vec::with_capacity(rows.len());
        let mut ready = Vec::new();
        let (mut live_nodes, mut partitions, mut rank) = (1u32, 0u32, 0u32);
        for r in rows {
            let p: Option<i32> = r.try_get_by_index(0).map_err(StoreError::from_db)?;
            live_nodes = count(r.try_get_by_index(4).map_err(StoreError::from_db)?);
            partitions = count(r.try_get_by_index(5).map_err(StoreError::from_db)?);
            rank = count(r.try_get_by_index(6).map_err(StoreError::from_db)?);
            if let Some(partition) = p {
                if r.try_get_by_index::<bool>(3).map_err(StoreError::from_db)? {
                    ready.push(partition);
                }
                held.push(Lease {
                    partition,
                    epoch: r.try_get_by_index(1).map_err(StoreError::from_db)?,
                    paused: r.try_get_by_index(2).map_err(StoreError::from_db)?,
                });
            }
        }
        Ok(LeaseTick {
            held,
            ready,
            outbox_locked,
            live_nodes: live_nodes.max(1),
            rank,
            partitions,
        })
    }

    /// Acquires up to `max` partitions that are free, expired, or left by an earlier run of this
    /// node (those first), bumping each one's epoch. Partitions in `holding` are skipped.
    pub async fn acquire_partitions(
        &self,
        node_id: &str,
        lease_ms: u64,
        holding: &[i32],
        max: u32,
    ) -> Result<Vec<Lease>, StoreError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let rows = self
            .connection()
            .query_all_raw(stmt(
                "UPDATE outpost_partition p SET owner = $1, epoch = p.epoch + 1, \
                   lease_until = now() + $2 * interval '1 millisecond' \
                 WHERE p.partition IN ( \
                   SELECT partition FROM outpost_partition \
                   WHERE (owner IS NULL OR lease_until IS NULL OR lease_until < now() \
                          OR owner = $1) \
                     AND NOT (partition = ANY($3::int4[])) \
                   ORDER BY (owner = $1) DESC NULLS LAST, partition \
                   LIMIT $4 FOR UPDATE SKIP LOCKED) \
                 RETURNING p.partition, p.epoch, p.paused",
                [
                    node_id.into(),
                    ms(lease_ms).into(),
                    num_array(holding).into(),
                    i64::from(max).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        leases(rows)
    }

    /// Moves this node's lease on `partition` from `epoch` past `seen`, an epoch found at Redis
    /// that the database never handed out. Epochs only grow, so a fence ahead of the database
    /// means the database lost history (restored from a backup, or recreated while Redis kept
    /// its fences); while the database still names this node as owner at `epoch`, nobody else
    /// can hold the partition, and jumping ahead is safe. Returns the new epoch, or `None` when
    /// the lease is no longer ours at `epoch` (then the fence is a real takeover).
    pub async fn advance_epoch(
        &self,
        node_id: &str,
        partition: i32,
        epoch: i64,
        seen: i64,
        lease_ms: u64,
    ) -> Result<Option<i64>, StoreError> {
        let row = self
            .connection()
            .query_one_raw(stmt(
                "UPDATE outpost_partition SET epoch = $4 + 1, \
                   lease_until = now() + $5 * interval '1 millisecond' \
                 WHERE partition = $1 AND owner = $2 AND epoch = $3 AND $4 >= epoch \
                 RETURNING epoch",
                [
                    partition.into(),
                    node_id.into(),
                    epoch.into(),
                    seen.into(),
                    ms(lease_ms).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        match row {
            Some(r) => Ok(Some(r.try_get_by_index(0).map_err(StoreError::from_db)?)),
            None => Ok(None),
        }
    }

    /// Gives partitions back at once (graceful handoff): the next owner does not wait for the
    /// lease to expire. Only leases still held at the given epochs are released.
    pub async fn release_partitions(
        &self,
        node_id: &str,
        released: &[Lease],
    ) -> Result<u64, StoreError> {
        if released.is_empty() {
            return Ok(0);
        }
        let parts: Vec<i32> = released.iter().map(|l| l.partition).collect();
        let epochs: Vec<i64> = released.iter().map(|l| l.epoch).collect();
        let res = self
            .connection()
            .execute_raw(stmt(
                "UPDATE outpost_partition p SET owner = NULL, lease_until = NULL \
                 FROM unnest($2::int4[], $3::int8[]) AS v(partition, epoch) \
                 WHERE p.partition = v.partition AND p.epoch = v.epoch AND p.owner = $1",
                [
                    node_id.into(),
                    num_array(&parts).into(),
                    num_array(&epochs).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        Ok(res.rows_affected())
    }

    /// Pauses or resumes partitions, and records the action in the audit log in the same
    /// transaction. Persisted: whichever node owns a partition honours it at its next heartbeat,
    /// also after restarts. Returns the partitions whose state changed.
    pub async fn set_paused(
        &self,
        partitions: &[i32],
        paused: bool,
        actor: &str,
        role: &str,
    ) -> Result<Vec<i32>, StoreError> {
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        let changed = txn
            .query_all_raw(stmt(
                "UPDATE outpost_partition SET paused = $2, \
                   paused_at = CASE WHEN $2 THEN now() END, \
                   paused_by = CASE WHEN $2 THEN $3 END \
                 WHERE partition = ANY($1::int4[]) AND paused <> $2 RETURNING partition",
                [num_array(partitions).into(), paused.into(), actor.into()],
            ))
            .await
            .map_err(StoreError::from_db)?
            .into_iter()
            .map(|r| r.try_get_by_index::<i32>(0).map_err(StoreError::from_db))
            .collect::<Result<Vec<i32>, _>>()?;
        let action = if paused {
            "partition.pause"
        } else {
            "partition.resume"
        };
        txn.execute_raw(stmt(
            "INSERT INTO outpost_audit (actor, role, action, target, detail) \
             VALUES ($1, $2, $3, $4, jsonb_build_object('requested', $5::int4[], \
                                                        'changed', $6::int4[]))",
            [
                actor.into(),
                role.into(),
                action.into(),
                num_array(partitions).into(),
                num_array(partitions).into(),
                num_array(&changed).into(),
            ],
        ))
        .await
        .map_err(StoreError::from_db)?;
        txn.commit().await.map_err(StoreError::from_db)?;
        Ok(changed)
    }
}

fn ms(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn count(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}
