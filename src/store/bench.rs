//! Statements only the benchmarks use: a plain copy of the outbox table without Outpost's
//! triggers, as the baseline producers are compared against.

use sea_orm::ConnectionTrait;

use super::events::{insert_sql, insert_values};
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
