//! Statements only the benchmarks use: a plain copy of the outbox table without Outpost's
//! triggers, as the baseline producers are compared against; and for `outpost bench relay`, the
//! bare relay loop it compares Outpost with, and the drain, latency and idle figures.

use sea_orm::ConnectionTrait;

use super::events::{insert_sql, insert_values};
use super::sql::num_array;
use super::{NewEventRow, Store, StoreError};

/// Name of the baseline table.
pub const PLAIN_TABLE: &str = "bench_plain_event";

impl Store {
    /// Creates `bench_plain_event`: the outbox's columns, constraints and indexes, with plain
    /// defaults instead of triggers.
    pub async fn create_plain_table(&self) -> Result<(), StoreError> {
        self.connection()
            .execute_unprepared(
                "DROP TABLE IF EXISTS bench_plain_event; \
                 DROP SEQUENCE IF EXISTS bench_plain_id; DROP SEQUENCE IF EXISTS bench_plain_seq; \
                 CREATE SEQUENCE bench_plain_id; CREATE SEQUENCE bench_plain_seq; \
                 CREATE TABLE bench_plain_event (LIKE outpost_event INCLUDING ALL); \
                 ALTER TABLE bench_plain_event \
                   ALTER COLUMN id SET DEFAULT nextval('bench_plain_id'), \
                   ALTER COLUMN aggregate_seq SET DEFAULT nextval('bench_plain_seq'), \
                   ALTER COLUMN partition SET DEFAULT 0, \
                   ALTER COLUMN txid SET DEFAULT 0;",
            )
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }
}

impl Store {
    /// Empties both tables between benchmark rounds, so every round starts from the same size.
    pub async fn reset_bench_tables(&self) -> Result<(), StoreError> {
        self.connection()
            .execute_unprepared(
                "TRUNCATE bench_plain_event; TRUNCATE outpost_event; TRUNCATE outpost_aggregate; \
                 CHECKPOINT;",
            )
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// The last id handed out by the outbox's id sequence: changes whenever rows are inserted.
    pub async fn outbox_high_water(&self) -> Result<i64, StoreError> {
        let row = self
            .connection()
            .query_one_raw(super::stmt(
                "SELECT last_value FROM outpost_event_id_seq",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("outpost_event_id_seq has no value".to_owned()))?;
        row.try_get_by_index(0).map_err(StoreError::from_db)
    }
}

/// Inserts rows into the baseline table with the same statement shape as the outbox insert.
pub async fn insert_plain<C: ConnectionTrait>(
    conn: &C,
    rows: &[NewEventRow],
) -> Result<(), StoreError> {
    let sql = insert_sql(PLAIN_TABLE, rows.len());
    conn.query_all_raw(super::stmt(&sql, insert_values(rows)))
        .await
        .map_err(StoreError::from_db)?;
    Ok(())
}

/// A row read by the benchmark's bare relay loop (`outpost bench relay`, baseline part).
#[derive(Debug, Clone, PartialEq)]
pub struct BareRow {
    /// Outbox row id.
    pub id: i64,
    /// Event identity.
    pub event_id: uuid::Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Sequence within the aggregate.
    pub aggregate_seq: i64,
    /// Event type.
    pub event_type: String,
    /// Payload as JSON text.
    pub payload: String,
}

/// The table a bare loop reads: the outbox (rows written by Outpost's producers, with the
/// sequence, partition and rules of the insert trigger), or its plain copy (rows written without
/// any of them, as by an application's hand-written outbox).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BareTable {
    /// `outpost_event`.
    Outbox,
    /// `bench_plain_event`.
    Plain,
}

impl BareTable {
    /// The table's name.
    pub fn name(self) -> &'static str {
        match self {
            BareTable::Outbox => "outpost_event",
            BareTable::Plain => PLAIN_TABLE,
        }
    }
}

/// The order in which the bare loop reads the pending rows of its partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BareOrder {
    /// `ORDER BY partition, id`: an index range scan on the outbox's ready index, whose cost does
    /// not grow with the rows already published.
    PartitionId,
    /// `ORDER BY id`: PostgreSQL walks the primary key past every row already published in
    /// the table, so each batch costs more as a backlog drains (quadratic in the backlog).
    Id,
}

/// Latency from insert to publication over the published rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PublishLatency {
    /// Events in `outpost_published`.
    pub rows: i64,
    /// Median of `published_at - recorded_at`, in seconds (`None` without rows).
    pub p50: Option<f64>,
    /// 90th percentile, in seconds.
    pub p90: Option<f64>,
    /// 99th percentile, in seconds.
    pub p99: Option<f64>,
    /// Largest, in seconds.
    pub max: Option<f64>,
}

impl Store {
    /// Empties the outbox, the aggregate sequences and the recorded stream positions (a fresh
    /// start for the next benchmark part, whose streams are deleted with it), then checkpoints
    /// so the part does not pay for the previous part's dirty pages.
    pub async fn truncate_outbox(&self) -> Result<(), StoreError> {
        self.connection()
            .execute_unprepared(
                "TRUNCATE outpost_event, outpost_published, outpost_aggregate, outpost_stream, \
                 outpost_stream_position",
            )
            .await
            .map_err(StoreError::from_db)?;
        self.checkpoint().await
    }

    /// Moves the `oldest` rows of the outbox by id (every row when `None`) to
    /// `outpost_published`, as published `secs` seconds ago with entry id `0-0` (`outpost bench
    /// retention`: old rows for the janitor to delete; tests: the state they start from).
    pub async fn age_as_published(
        &self,
        oldest: Option<u64>,
        secs: u64,
    ) -> Result<u64, StoreError> {
        let columns = super::sql::PUBLISHED_COLUMNS;
        let limit = oldest.map_or_else(|| "ALL".to_owned(), |n| n.to_string());
        let res = self
            .connection()
            .execute_raw(super::stmt(
                &format!(
                    "WITH moved AS (DELETE FROM outpost_event WHERE id IN ( \
                       SELECT id FROM outpost_event ORDER BY id LIMIT {limit}) \
                       RETURNING {columns}) \
                     INSERT INTO outpost_published ({columns}, published_at, stream_id) \
                     SELECT {columns}, now() - $1 * interval '1 second', '0-0' FROM moved"
                ),
                [i64::try_from(secs).unwrap_or(i64::MAX).into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        Ok(res.rows_affected())
    }

    /// Events in `outpost_published` (a scan: for benchmarks on small tables).
    pub async fn published_rows(&self) -> Result<i64, StoreError> {
        self.count_rows("outpost_published").await
    }

    /// Rows in the outbox (a scan: for benchmarks on small tables).
    pub async fn outbox_rows(&self) -> Result<i64, StoreError> {
        self.count_rows("outpost_event").await
    }

    async fn count_rows(&self, table: &str) -> Result<i64, StoreError> {
        let row = self
            .connection()
            .query_one_raw(super::stmt(&format!("SELECT count(*) FROM {table}"), []))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("count returned no row".to_owned()))?;
        row.try_get_by_index(0).map_err(StoreError::from_db)
    }

    /// `VACUUM ANALYZE outpost_event` (hint bits and visibility map set, fresh statistics) and a
    /// checkpoint, so that a preloaded backlog is in the same state for every drain.
    pub async fn vacuum_analyze_outbox(&self) -> Result<(), StoreError> {
        // VACUUM cannot run inside a transaction block: one statement per call.
        self.connection()
            .execute_unprepared("VACUUM ANALYZE outpost_event")
            .await
            .map_err(StoreError::from_db)?;
        self.checkpoint().await
    }

    async fn checkpoint(&self) -> Result<(), StoreError> {
        self.connection()
            .execute_unprepared("CHECKPOINT")
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// True while some row of `table` is waiting to be published (`pending` or `retry_wait`).
    /// Cheap at any backlog size, so it can be polled during a drain without loading the
    /// database the way `count(*)` over the backlog would: each state has a partial index, so
    /// the planner reads its first live entry instead of scanning a heap full of published rows.
    pub async fn has_unpublished(&self, table: BareTable) -> Result<bool, StoreError> {
        let row = self
            .connection()
            .query_one_raw(super::stmt(
                &format!(
                    "SELECT 1 WHERE EXISTS (SELECT 1 FROM {t} WHERE status = 'pending') \
                     OR EXISTS (SELECT 1 FROM {t} WHERE status = 'retry_wait')",
                    t = table.name()
                ),
                [],
            ))
            .await
            .map_err(StoreError::from_db)?;
        Ok(row.is_some())
    }

    /// Rows of `table` waiting to be published (`pending` or `retry_wait`).
    pub async fn unpublished_count(&self, table: BareTable) -> Result<i64, StoreError> {
        let row = self
            .connection()
            .query_one_raw(super::stmt(
                &format!(
                    "SELECT count(*) FROM {} WHERE status IN ('pending', 'retry_wait')",
                    table.name()
                ),
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("count(*) returned no row".to_owned()))?;
        row.try_get_by_index(0).map_err(StoreError::from_db)
    }

    /// Up to `limit` pending rows of `partitions` in `table` whose id is `slice.1` modulo
    /// `slice.0`, for the benchmark's bare relay loop (no ordering guarantee, no lease, no retry
    /// state). The slice deals one partition's rows out among several loops (the plain copy
    /// puts every row in partition 0); `(1, 0)` takes them all.
    pub async fn bare_claim(
        &self,
        table: BareTable,
        partitions: &[i32],
        slice: (u32, u32),
        limit: u32,
        order: BareOrder,
    ) -> Result<Vec<BareRow>, StoreError> {
        let order_by = match order {
            BareOrder::PartitionId => "partition, id",
            BareOrder::Id => "id",
        };
        // Without a slice the statement is the plain claim: a filter on `id % n`, of unknown
        // selectivity to the planner, could move it off the ready index's range scan.
        let slice_filter = match slice {
            (0 | 1, _) => String::new(),
            (n, k) => format!(" AND id % {n} = {k}"),
        };
        let sql = format!(
            "SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, event_type, \
                    payload::text \
             FROM {} \
             WHERE partition = ANY($1::int4[]) AND status = 'pending'{slice_filter} \
             ORDER BY {order_by} LIMIT $2",
            table.name()
        );
        let rows = self
            .connection()
            .query_all_raw(super::stmt(
                &sql,
                [num_array(partitions).into(), i64::from(limit).into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        rows.into_iter()
            .map(|r| {
                let g = StoreError::from_db;
                Ok(BareRow {
                    id: r.try_get_by_index(0).map_err(g)?,
                    event_id: r.try_get_by_index(1).map_err(g)?,
                    aggregate_type: r.try_get_by_index(2).map_err(g)?,
                    aggregate_id: r.try_get_by_index(3).map_err(g)?,
                    aggregate_seq: r.try_get_by_index(4).map_err(g)?,
                    event_type: r.try_get_by_index(5).map_err(g)?,
                    payload: r.try_get_by_index(6).map_err(g)?,
                })
            })
            .collect()
    }

    /// Marks rows of the bare loop published (or deletes them), in one statement.
    pub async fn bare_mark(
        &self,
        table: BareTable,
        ids: &[i64],
        delete: bool,
    ) -> Result<(), StoreError> {
        let sql = if delete {
            format!("DELETE FROM {} WHERE id = ANY($1::int8[])", table.name())
        } else {
            format!(
                "UPDATE {} SET status = 'published', published_at = now() \
                 WHERE id = ANY($1::int8[])",
                table.name()
            )
        };
        self.connection()
            .execute_raw(super::stmt(&sql, [num_array(ids).into()]))
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// Percentiles of `published_at - recorded_at` over the published events: from the insert
    /// (database clock, inside the producer's transaction) to the start of the relay's mark
    /// transaction, which begins after Redis acknowledged the entry.
    /// `marked_in`: a bare loop's table, whose rows it marks `published` where they are (a
    /// node moves them to `outpost_published`).
    pub async fn publish_latency(
        &self,
        marked_in: Option<BareTable>,
    ) -> Result<PublishLatency, StoreError> {
        let published = match marked_in {
            None => "outpost_published".to_owned(),
            Some(t) => format!("{} WHERE status = 'published'", t.name()),
        };
        let row = self
            .connection()
            .query_one_raw(super::stmt(
                &format!(
                    "SELECT count(*), \
                            percentile_cont(0.5) WITHIN GROUP (ORDER BY l), \
                            percentile_cont(0.9) WITHIN GROUP (ORDER BY l), \
                            percentile_cont(0.99) WITHIN GROUP (ORDER BY l), \
                            max(l) \
                     FROM (SELECT extract(epoch FROM published_at - recorded_at)::float8 AS l \
                           FROM {published}) t"
                ),
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("an aggregate returned no row".to_owned()))?;
        let g = StoreError::from_db;
        Ok(PublishLatency {
            rows: row.try_get_by_index(0).map_err(g)?,
            p50: row.try_get_by_index(1).map_err(g)?,
            p90: row.try_get_by_index(2).map_err(g)?,
            p99: row.try_get_by_index(3).map_err(g)?,
            max: row.try_get_by_index(4).map_err(g)?,
        })
    }

    /// Transactions committed and rolled back in the current database so far
    /// (`pg_stat_database`; each backend reports its counts at most once a second, and an idle
    /// one after 10 s).
    pub async fn database_transactions(&self) -> Result<i64, StoreError> {
        let row = self
            .connection()
            .query_one_raw(super::stmt(
                "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database \
                 WHERE datname = current_database()",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("pg_stat_database has no row".to_owned()))?;
        row.try_get_by_index(0).map_err(StoreError::from_db)
    }

    /// The server's version string (`server_version`).
    pub async fn server_version(&self) -> Result<String, StoreError> {
        let row = self
            .connection()
            .query_one_raw(super::stmt("SELECT current_setting('server_version')", []))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("current_setting returned no row".to_owned()))?;
        row.try_get_by_index(0).map_err(StoreError::from_db)
    }
}

/// `outpost bench consumer`: a projection the benchmark's handler keeps, as a typical consumer
/// would (one upsert per event).
impl Store {
    /// Creates (or empties) the projection and the consumer helper's tables.
    pub async fn reset_consumer_bench(&self) -> Result<(), StoreError> {
        self.connection()
            .execute_unprepared(
                "CREATE TABLE IF NOT EXISTS bench_projection ( \
                   aggregate_id text PRIMARY KEY, last_seq bigint NOT NULL, \
                   events bigint NOT NULL, last_payload text NOT NULL); \
                 TRUNCATE bench_projection, outpost_inbox, outpost_consumer_position;",
            )
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// Events applied to the projection so far.
    pub async fn consumer_bench_applied(&self) -> Result<i64, StoreError> {
        let row = self
            .connection()
            .query_one_raw(super::stmt(
                "SELECT coalesce(sum(events), 0)::int8 FROM bench_projection",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("sum returned no row".into()))?;
        row.try_get_by_index(0).map_err(StoreError::from_db)
    }
}

/// The benchmark handler's one statement, on the caller's transaction.
pub async fn apply_to_projection<C: ConnectionTrait>(
    txn: &C,
    aggregate_id: &str,
    seq: i64,
    payload: &str,
) -> Result<(), StoreError> {
    txn.execute_raw(super::stmt(
        "INSERT INTO bench_projection AS p (aggregate_id, last_seq, events, last_payload) \
         VALUES ($1, $2, 1, $3) \
         ON CONFLICT (aggregate_id) DO UPDATE SET last_seq = $2, events = p.events + 1, \
           last_payload = $3",
        [aggregate_id.into(), seq.into(), payload.into()],
    ))
    .await
    .map_err(StoreError::from_db)?;
    Ok(())
}

impl Store {
    /// Fills a scratch database for `outpost bench admin`: `outbox` rows in the outbox (aggregates
    /// of 10 events; every 1,000th row quarantined, alternately `WRONGTYPE` and `OVERSIZE`, with
    /// the next 9 of its aggregate held; the rest pending) and `history` rows in
    /// `outpost_published` spread over the last 7 days; then `VACUUM ANALYZE`. The outbox's user
    /// triggers are off while it is written (the rows carry their own sequence and partition).
    pub async fn fill_admin_bench(&self, outbox: u64, history: u64) -> Result<(), StoreError> {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let db = self.connection();
        db.execute_unprepared("ALTER TABLE outpost_event DISABLE TRIGGER USER")
            .await
            .map_err(StoreError::from_db)?;
        let filled = db
            .execute_raw(super::stmt(
                "INSERT INTO outpost_event (id, event_id, aggregate_type, aggregate_id, \
                   aggregate_seq, event_type, payload, partition, txid, status, attempts, \
                   last_error, recorded_at, next_attempt_at) \
                 SELECT g, gen_random_uuid(), 'order', 'o' || (g / 10), g % 10 + 1, \
                   (ARRAY['order.placed', 'order.paid', 'order.shipped'])[g % 3 + 1], \
                   jsonb_build_object('n', g, 'note', 'an order of the benchmark'), \
                   ((g / 10) % 64)::int4, 1, \
                   CASE WHEN g % 1000 = 0 THEN 'quarantined' \
                        WHEN g % 1000 < 10 THEN 'held' ELSE 'pending' END, \
                   CASE WHEN g % 1000 = 0 THEN 5 ELSE 0 END, \
                   CASE WHEN g % 2000 = 0 THEN 'WRONGTYPE Operation against a key' \
                        WHEN g % 1000 = 0 THEN 'OVERSIZE entry too large' END, \
                   now() - ($1 - g) * interval '1 millisecond', now() \
                 FROM generate_series(1, $1) AS g",
                [n(outbox).into()],
            ))
            .await;
        db.execute_unprepared("ALTER TABLE outpost_event ENABLE TRIGGER USER")
            .await
            .map_err(StoreError::from_db)?;
        filled.map_err(StoreError::from_db)?;
        db.execute_raw(super::stmt(
            "INSERT INTO outpost_published (id, event_id, aggregate_type, aggregate_id, \
               aggregate_seq, event_type, schema_version, occurred_at, recorded_at, payload, \
               headers, partition, txid, attempts, published_at, stream_id) \
             SELECT g, gen_random_uuid(), 'invoice', 'i' || (g / 10), g % 10 + 1, 'invoice.sent', \
               '1', now(), now(), jsonb_build_object('n', g), '{}'::jsonb, \
               ((g / 10) % 64)::int4, 1, 1, \
               now() - (7 * 86400 * (1 - g::float8 / $2)) * interval '1 second', '0-0' \
             FROM generate_series($1 + 1, $1 + $2) AS g",
            [n(outbox).into(), n(history.max(1)).into()],
        ))
        .await
        .map_err(StoreError::from_db)?;
        db.execute_raw(super::stmt(
            "SELECT setval('outpost_event_id_seq', $1)",
            [n(outbox + history + 1).into()],
        ))
        .await
        .map_err(StoreError::from_db)?;
        for table in ["outpost_event", "outpost_published"] {
            db.execute_unprepared(&format!("VACUUM (ANALYZE) {table}"))
                .await
                .map_err(StoreError::from_db)?;
        }
        Ok(())
    }
}
