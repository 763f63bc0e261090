//! Retention and Redis bookkeeping: the janitor's deletes, the streams Outpost wrote and how far,
//! the Redis instance last seen, the recovery after Redis lost data, and storage figures.
//!
//! **The janitor** deletes in small batches, each a transaction of its own that first takes a
//! transaction-scoped advisory lock: when several nodes run a janitor, one deletes at a time and
//! the others skip that round (and `SKIP LOCKED` keeps them off each other's rows regardless).
//! Published events are deleted from `outpost_published` through its index on `published_at`;
//! `no_destination` rows from the outbox through `outpost_event_aged` on `(status, recorded_at)`,
//! `discarded` ones through `outpost_event_discarded` on the time they were discarded (kept in
//! their `next_attempt_at`). Quarantined rows are never deleted: they wait for an operator.

use sea_orm::{ConnectionTrait, TransactionTrait};

use super::sql::{num_array, text_array};
use super::{Store, StoreError, stmt};

/// Advisory lock key of the janitor ("outpost janitor").
pub const JANITOR_LOCK: i64 = 0x6f75_7470_6a61_6e69;

/// Which rows the janitor ages out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// Events in `outpost_published`, by `published_at`.
    Published,
    /// `no_destination` rows, by `recorded_at`.
    NoDestination,
    /// `discarded` rows, by when they were discarded (their `next_attempt_at`).
    Discarded,
}

impl Expiry {
    /// The state's name, as stored and as a metric label.
    pub fn state(self) -> &'static str {
        match self {
            Expiry::Published => "published",
            Expiry::NoDestination => "no_destination",
            Expiry::Discarded => "discarded",
        }
    }
}

/// A stream as recorded in `outpost_stream`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRecord {
    /// Full stream key.
    pub stream: String,
    /// The Redis incarnation the position belongs to.
    pub incarnation: i64,
    /// The newest entry id seen acknowledged, as `(ms, seq)`.
    pub last: (i64, i64),
}

/// The Redis instance as recorded in `outpost_redis`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisRecord {
    /// `run_id` last recorded; `None` before the first node ran.
    pub run_id: Option<String>,
    /// Bumped by every recovery from a data loss.
    pub incarnation: i64,
}

/// Storage figures of the outbox table and the database's vacuum horizon.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StorageFigures {
    /// `pg_table_size('outpost_event')`: heap, TOAST and free space map, bytes.
    pub table_bytes: i64,
    /// `pg_indexes_size('outpost_event')`, bytes.
    pub index_bytes: i64,
    /// Dead row versions not yet vacuumed (statistics, approximate).
    pub dead_tuples: i64,
    /// Live rows (statistics, approximate).
    pub live_tuples: i64,
    /// Age in transactions of the oldest snapshot or prepared transaction in this database that
    /// holds back vacuum (0 when none).
    pub xmin_age_xids: i64,
    /// Age in seconds of the oldest transaction holding back vacuum (0 when none).
    pub oldest_xact_secs: f64,
    /// Prepared (two-phase) transactions in this database.
    pub prepared_xacts: i64,
    /// `pg_total_relation_size('outpost_published')`: the history of published events, with
    /// its indexes, bytes.
    pub published_bytes: i64,
}

/// `(partition, epoch)` rows.
fn epochs(rows: Vec<sea_orm::QueryResult>) -> Result<Vec<(i32, i64)>, StoreError> {
    rows.into_iter()
        .map(|r| {
            Ok((
                r.try_get_by_index::<i32>(0).map_err(StoreError::from_db)?,
                r.try_get_by_index::<i64>(1).map_err(StoreError::from_db)?,
            ))
        })
        .collect()
}

impl Store {
    /// Deletes at most `limit` rows of `expiry` older than `older_than_secs`. Returns `None`
    /// when another node's janitor holds the lock (nothing deleted), else the rows deleted.
    pub async fn delete_expired(
        &self,
        expiry: Expiry,
        older_than_secs: u64,
        limit: u32,
    ) -> Result<Option<u64>, StoreError> {
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        let locked = txn
            .query_one_raw(stmt(
                "SELECT pg_try_advisory_xact_lock($1)",
                [JANITOR_LOCK.into()],
            ))
            .await
            .map_err(StoreError::from_db)?
            .map(|r| r.try_get_by_index::<bool>(0))
            .transpose()
            .map_err(StoreError::from_db)?
            .unwrap_or(false);
        if !locked {
            txn.rollback().await.map_err(StoreError::from_db)?;
            return Ok(None);
        }
        let (table, column, status) = match expiry {
            Expiry::Published => ("outpost_published", "published_at", "TRUE"),
            Expiry::NoDestination => ("outpost_event", "recorded_at", "status = 'no_destination'"),
            // A discarded row's next_attempt_at is when it was discarded.
            Expiry::Discarded => ("outpost_event", "next_attempt_at", "status = 'discarded'"),
        };
        let sql = format!(
            "DELETE FROM {table} WHERE id IN ( \
               SELECT id FROM {table} \
               WHERE {status} AND {column} < now() - $1 * interval '1 second' \
               ORDER BY {column} LIMIT $2 FOR UPDATE SKIP LOCKED)"
        );
        let res = txn
            .execute_raw(stmt(
                &sql,
                [
                    i64::try_from(older_than_secs).unwrap_or(i64::MAX).into(),
                    i64::from(limit).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        txn.commit().await.map_err(StoreError::from_db)?;
        Ok(Some(res.rows_affected()))
    }

    /// `VACUUM (ANALYZE)` of the outbox and of `outpost_published`: makes the space of deleted
    /// and updated rows reusable. Takes a lock that does not conflict with inserts, updates or
    /// deletes.
    pub async fn vacuum_outbox(&self) -> Result<(), StoreError> {
        // VACUUM cannot run inside a transaction block: one statement per call.
        for table in ["outpost_event", "outpost_published"] {
            self.connection()
                .execute_unprepared(&format!("VACUUM (ANALYZE) {table}"))
                .await
                .map_err(StoreError::from_db)?;
        }
        Ok(())
    }

    /// Records how far streams were seen acknowledged (`(stream, ms, seq)`), as of
    /// `incarnation`: a position only ever grows, and positions from an older incarnation are
    /// dropped. Returns the current incarnation and every recorded stream. One statement.
    pub async fn record_streams(
        &self,
        incarnation: i64,
        positions: &[(String, i64, i64)],
    ) -> Result<(i64, Vec<String>), StoreError> {
        let names: Vec<&str> = positions.iter().map(|(s, _, _)| s.as_str()).collect();
        let ms: Vec<i64> = positions.iter().map(|(_, m, _)| *m).collect();
        let seq: Vec<i64> = positions.iter().map(|(_, _, q)| *q).collect();
        let rows = self
            .connection()
            .query_all_raw(stmt(
                "WITH cur AS (SELECT incarnation FROM outpost_redis), \
                 up AS (INSERT INTO outpost_stream AS s (stream, incarnation, last_ms, last_seq) \
                   SELECT v.s, $1, v.m, v.q \
                   FROM unnest($2::text[], $3::int8[], $4::int8[]) AS v(s, m, q) \
                   WHERE $1 = (SELECT incarnation FROM cur) \
                   ON CONFLICT (stream) DO UPDATE \
                     SET last_ms = EXCLUDED.last_ms, last_seq = EXCLUDED.last_seq, \
                         updated_at = now() \
                     WHERE s.incarnation = EXCLUDED.incarnation \
                       AND (s.last_ms, s.last_seq) < (EXCLUDED.last_ms, EXCLUDED.last_seq) \
                   RETURNING 1) \
                 SELECT (SELECT incarnation FROM cur), \
                        (SELECT coalesce(array_agg(stream), '{}') FROM outpost_stream)::text[]",
                [
                    incarnation.into(),
                    text_array(&names).into(),
                    num_array(&ms).into(),
                    num_array(&seq).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let row = rows
            .into_iter()
            .next()
            .ok_or_else(|| StoreError::Corrupt("outpost_redis has no row".to_owned()))?;
        let current: Option<i64> = row.try_get_by_index(0).map_err(StoreError::from_db)?;
        let streams: Vec<String> = row.try_get_by_index(1).map_err(StoreError::from_db)?;
        Ok((
            current.ok_or_else(|| StoreError::Corrupt("outpost_redis has no row".to_owned()))?,
            streams,
        ))
    }

    /// The Redis instance and every stream, as recorded.
    pub async fn redis_records(&self) -> Result<(RedisRecord, Vec<StreamRecord>), StoreError> {
        let db = self.connection();
        let row = db
            .query_one_raw(stmt("SELECT run_id, incarnation FROM outpost_redis", []))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("outpost_redis has no row".to_owned()))?;
        let redis = RedisRecord {
            run_id: row.try_get_by_index(0).map_err(StoreError::from_db)?,
            incarnation: row.try_get_by_index(1).map_err(StoreError::from_db)?,
        };
        let streams = db
            .query_all_raw(stmt(
                "SELECT stream, incarnation, last_ms, last_seq FROM outpost_stream ORDER BY stream",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .into_iter()
            .map(|r| {
                Ok(StreamRecord {
                    stream: r.try_get_by_index(0).map_err(StoreError::from_db)?,
                    incarnation: r.try_get_by_index(1).map_err(StoreError::from_db)?,
                    last: (
                        r.try_get_by_index(2).map_err(StoreError::from_db)?,
                        r.try_get_by_index(3).map_err(StoreError::from_db)?,
                    ),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok((redis, streams))
    }

    /// Records `run_id` as the Redis instance seen (a restart that lost nothing).
    pub async fn note_redis_run_id(&self, run_id: &str) -> Result<(), StoreError> {
        self.connection()
            .execute_raw(stmt(
                "UPDATE outpost_redis SET run_id = $1, seen_at = now()",
                [run_id.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// Every partition with its current epoch.
    pub async fn partition_epochs(&self) -> Result<Vec<(i32, i64)>, StoreError> {
        epochs(
            self.connection()
                .query_all_raw(stmt(
                    "SELECT partition, epoch FROM outpost_partition ORDER BY partition",
                    [],
                ))
                .await
                .map_err(StoreError::from_db)?,
        )
    }

    /// Size, dead tuples and vacuum horizon figures; catalog reads only, no table scan.
    pub async fn storage_figures(&self) -> Result<StorageFigures, StoreError> {
        let row = self
            .connection()
            .query_one_raw(stmt(
                "WITH holders AS ( \
                   SELECT age(backend_xmin)::int8 AS xids, \
                          extract(epoch FROM now() - xact_start)::float8 AS secs \
                   FROM pg_stat_activity \
                   WHERE datname = current_database() AND backend_xmin IS NOT NULL \
                     AND pid <> pg_backend_pid() \
                   UNION ALL \
                   SELECT age(transaction)::int8, extract(epoch FROM now() - prepared)::float8 \
                   FROM pg_prepared_xacts WHERE database = current_database()) \
                 SELECT pg_table_size('outpost_event'), pg_indexes_size('outpost_event'), \
                        coalesce((SELECT n_dead_tup FROM pg_stat_user_tables \
                                  WHERE relid = 'outpost_event'::regclass), 0), \
                        coalesce((SELECT n_live_tup FROM pg_stat_user_tables \
                                  WHERE relid = 'outpost_event'::regclass), 0), \
                        coalesce((SELECT max(xids) FROM holders), 0)::int8, \
                        coalesce((SELECT max(secs) FROM holders), 0)::float8, \
                        (SELECT count(*) FROM pg_prepared_xacts \
                         WHERE database = current_database()), \
                        pg_total_relation_size('outpost_published')",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("no storage figures".to_owned()))?;
        let g = StoreError::from_db;
        Ok(StorageFigures {
            table_bytes: row.try_get_by_index(0).map_err(g)?,
            index_bytes: row.try_get_by_index(1).map_err(g)?,
            dead_tuples: row.try_get_by_index(2).map_err(g)?,
            live_tuples: row.try_get_by_index(3).map_err(g)?,
            xmin_age_xids: row.try_get_by_index(4).map_err(g)?,
            oldest_xact_secs: row.try_get_by_index(5).map_err(g)?,
            prepared_xacts: row.try_get_by_index(6).map_err(g)?,
            published_bytes: row.try_get_by_index(7).map_err(g)?,
        })
    }
}
