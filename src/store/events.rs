//! Writing event facts (the producer side of the contract).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, Value};
use uuid::Uuid;

use super::{DbErrorKind, StoreError, classify, stmt};

/// One validated event fact, ready to be inserted. Delivery state, sequence, partition and
/// transaction id are not here: the database fills them in.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEventRow {
    /// Stable identity; consumers deduplicate by it.
    pub event_id: Uuid,
    /// Aggregate type, e.g. `order`.
    pub aggregate_type: String,
    /// Aggregate id within its type.
    pub aggregate_id: String,
    /// The producer's own version of the aggregate, carried as data.
    pub aggregate_version: Option<i64>,
    /// Event type, e.g. `order.paid`.
    pub event_type: String,
    /// Schema version of the payload (`MAJOR[.MINOR[.PATCH]]`).
    pub schema_version: String,
    /// When the fact happened, by the producer's clock.
    pub occurred_at: DateTime<Utc>,
    /// The payload, already encoded as JSON text.
    pub payload_json: String,
    /// Headers (a JSON object of strings), already encoded as JSON text.
    pub headers_json: String,
    /// Explicit destination, overriding routing.
    pub destination: Option<String>,
}

/// What the database assigned to an inserted event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsertedEvent {
    /// Outbox row id.
    pub id: i64,
    /// The event id (as given).
    pub event_id: Uuid,
    /// Gap-free sequence within the aggregate, in commit order.
    pub aggregate_seq: i64,
    /// Partition of the aggregate.
    pub partition: i32,
    /// Id of the writing transaction.
    pub txid: i64,
    /// Initial delivery state: `pending`, or `held` when the aggregate is held back.
    pub status: String,
}

const COLUMNS: usize = 10;
/// Rows per statement: Postgres accepts at most 65,535 bind parameters.
const MAX_ROWS_PER_STATEMENT: usize = 6_000;

/// Inserts event facts on the caller's connection or transaction, one statement per 6,000 rows,
/// and returns what the database assigned, in the order given.
pub async fn insert_events<C: ConnectionTrait>(
    conn: &C,
    rows: &[NewEventRow],
) -> Result<Vec<InsertedEvent>, StoreError> {
    let mut out = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(MAX_ROWS_PER_STATEMENT) {
        let sql = match chunk.len() {
            1 => insert_sql("outpost_event", 1),
            n => insert_many_sql(n),
        };
        let result = conn.query_all_raw(stmt(&sql, insert_values(chunk))).await;
        let returned = match result {
            Ok(r) => r,
            Err(e) => return Err(insert_error(e, chunk)),
        };
        out.extend(match_returned(returned, chunk)?);
    }
    Ok(out)
}

/// The multi-row INSERT of event facts into `table` (Outpost's outbox, or the benchmark's plain
/// copy of it).
pub(super) fn insert_sql(table: &str, rows: usize) -> String {
    let mut sql = String::with_capacity(200 + rows * 80);
    sql.push_str("INSERT INTO ");
    sql.push_str(table);
    sql.push_str(
        " (event_id, aggregate_type, aggregate_id, aggregate_version, \
         event_type, schema_version, occurred_at, payload, headers, destination) VALUES ",
    );
    push_rows(&mut sql, rows, false, &PLAIN_CASTS);
    sql.push_str(" RETURNING id, event_id, aggregate_seq, partition, txid, status");
    sql
}

/// The statement that writes several events at once, doing in one pass over the rows what the
/// insert trigger does for one: the aggregates' rows are locked in key order (so two producers
/// never deadlock on each other) and each advanced by its count of events; every event gets the
/// next sequence numbers of its aggregate in the order given and an id drawn after its
/// aggregate's lock; the rules are checked (the same functions the trigger calls, raising the
/// same errors); a node that asked for nudges gets one per partition, unless the transaction set
/// `outpost.nudge` off (read as the trigger reads it: `m20261205_000009_nudge_opt_out`). The
/// trigger leaves such rows alone: they come with their own transaction's id (and their id,
/// sequence and partition), written while `outpost.filled_by_outpost` is on. The statement turns
/// the setting on before its first row (`f`, which every row joins), and the statement trigger
/// of `m20261206_000012_owned_columns` turns it off when the statement ends, so a row written
/// in any other statement that names its own transaction's id is refused.
/// The bind values are those of [`insert_sql`].
fn insert_many_sql(rows: usize) -> String {
    let mut sql = String::with_capacity(2000 + rows * 140);
    sql.push_str(
        "WITH e (ord, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
         schema_version, occurred_at, payload, headers, destination) AS (VALUES ",
    );
    push_rows(&mut sql, rows, true, &TYPED_CASTS);
    sql.push_str(INSERT_MANY_TAIL);
    sql
}

/// The casts of the bind values in a plain `VALUES` list (PostgreSQL infers the other types from
/// the target columns) and in the typed one of [`insert_many_sql`], in [`insert_values`] order.
const PLAIN_CASTS: [&str; COLUMNS] = ["", "", "", "", "", "", "", "::jsonb", "::jsonb", ""];
const TYPED_CASTS: [&str; COLUMNS] = [
    "::uuid",
    "::text",
    "::text",
    "::int8",
    "::text",
    "::text",
    "::timestamptz",
    "::jsonb",
    "::jsonb",
    "::text",
];

/// Appends `rows` rows of bind placeholders, `($1,…,$10),($11,…)`, each led by its index when
/// `with_ord`.
fn push_rows(sql: &mut String, rows: usize, with_ord: bool, casts: &[&str; COLUMNS]) {
    for i in 0..rows {
        sql.push_str(if i > 0 { ",(" } else { "(" });
        if with_ord {
            sql.push_str(&i.to_string());
            sql.push(',');
        }
        for (c, cast) in casts.iter().enumerate() {
            if c > 0 {
                sql.push(',');
            }
            sql.push('$');
            sql.push_str(&(i * COLUMNS + c + 1).to_string());
            sql.push_str(cast);
        }
        sql.push(')');
    }
}

const INSERT_MANY_TAIL: &str = "), \
a AS ( \
    INSERT INTO outpost_aggregate AS a (aggregate_type, aggregate_id, last_seq, partition) \
    SELECT aggregate_type, aggregate_id, count(*), \
           outpost_partition_of(aggregate_type, aggregate_id, \
                                (SELECT partition_count FROM outpost_meta)) \
      FROM e GROUP BY aggregate_type, aggregate_id ORDER BY aggregate_type, aggregate_id \
    ON CONFLICT (aggregate_type, aggregate_id) \
        DO UPDATE SET last_seq = a.last_seq + EXCLUDED.last_seq \
    RETURNING aggregate_type, aggregate_id, last_seq, partition, blocked_seq, \
              CASE WHEN EXISTS (SELECT FROM outpost_node \
                                WHERE wants_nudge AND nudge_until > now()) \
                        AND coalesce(lower(current_setting('outpost.nudge', true)), '') \
                            NOT IN ('off', 'false', 'no', '0') \
                   THEN pg_notify('outpost_wakeup', partition::text)::text END AS nudged \
), \
f AS MATERIALIZED (SELECT set_config('outpost.filled_by_outpost', 'on', true) AS filled) \
INSERT INTO outpost_event (id, event_id, aggregate_type, aggregate_id, aggregate_seq, \
    aggregate_version, event_type, schema_version, occurred_at, payload, headers, destination, \
    partition, txid, status) \
SELECT nextval('outpost_event_id_seq'), e.event_id, e.aggregate_type, e.aggregate_id, \
       a.last_seq - count(*) OVER w + row_number() OVER w, e.aggregate_version, e.event_type, \
       e.schema_version, e.occurred_at, e.payload, e.headers, e.destination, a.partition, \
       txid_current(), CASE WHEN a.blocked_seq IS NULL THEN 'pending' ELSE 'held' END \
  FROM e JOIN a USING (aggregate_type, aggregate_id) CROSS JOIN f \
 WHERE f.filled = 'on' \
   AND (outpost_event_row_ok(e.aggregate_type, e.aggregate_id, e.event_type, \
                             e.schema_version, e.payload, e.headers, e.destination) \
        OR outpost_event_check_rules(e.aggregate_type, e.aggregate_id, e.event_type, \
                                     e.schema_version, e.payload, e.headers, e.destination)) \
   AND (e.occurred_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00' \
        OR outpost_event_check_time(e.occurred_at)) \
WINDOW w AS (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.ord \
             ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) \
 ORDER BY e.ord \
RETURNING id, event_id, aggregate_seq, partition, txid, status";

/// The bind values of [`insert_sql`] and [`insert_many_sql`], row after row.
pub(super) fn insert_values(rows: &[NewEventRow]) -> Vec<Value> {
    let mut values: Vec<Value> = Vec::with_capacity(rows.len() * COLUMNS);
    for row in rows {
        values.extend([
            row.event_id.into(),
            row.aggregate_type.clone().into(),
            row.aggregate_id.clone().into(),
            row.aggregate_version.into(),
            row.event_type.clone().into(),
            row.schema_version.clone().into(),
            row.occurred_at.into(),
            row.payload_json.clone().into(),
            row.headers_json.clone().into(),
            row.destination.clone().into(),
        ]);
    }
    values
}

/// Pairs the rows RETURNING gave back with the rows sent, in the order sent.
fn match_returned(
    returned: Vec<sea_orm::QueryResult>,
    rows: &[NewEventRow],
) -> Result<Vec<InsertedEvent>, StoreError> {
    let mut by_id: HashMap<Uuid, InsertedEvent> = HashMap::with_capacity(returned.len());
    for r in returned {
        let ev = InsertedEvent {
            id: r.try_get_by_index(0).map_err(StoreError::from_db)?,
            event_id: r.try_get_by_index(1).map_err(StoreError::from_db)?,
            aggregate_seq: r.try_get_by_index(2).map_err(StoreError::from_db)?,
            partition: r.try_get_by_index(3).map_err(StoreError::from_db)?,
            txid: r.try_get_by_index(4).map_err(StoreError::from_db)?,
            status: r.try_get_by_index(5).map_err(StoreError::from_db)?,
        };
        by_id.insert(ev.event_id, ev);
    }
    rows.iter()
        .map(|row| {
            by_id.remove(&row.event_id).ok_or_else(|| {
                StoreError::Corrupt(format!("insert did not return event {}", row.event_id))
            })
        })
        .collect()
}

/// Turns an insert failure into the most useful error: a duplicate event id names the id.
fn insert_error(err: sea_orm::DbErr, rows: &[NewEventRow]) -> StoreError {
    if let DbErrorKind::UniqueViolation(constraint) = classify(&err)
        && constraint == "outpost_event_event_id_key"
    {
        // The database does not say which row collided without parsing its message; with one
        // row it is that row, otherwise report the first of the batch and say so in the detail.
        if let [only] = rows {
            return StoreError::DuplicateEventId(only.event_id);
        }
        return StoreError::Rejected {
            constraint,
            detail: format!(
                "one of the {} event ids in this batch is already in the outbox",
                rows.len()
            ),
        };
    }
    StoreError::from_db(err)
}

#[cfg(test)]
mod tests {
    use super::{PLAIN_CASTS, TYPED_CASTS, push_rows};

    #[test]
    fn placeholders_number_the_bind_values_row_after_row() {
        let mut plain = String::new();
        push_rows(&mut plain, 2, false, &PLAIN_CASTS);
        assert_eq!(
            plain,
            "($1,$2,$3,$4,$5,$6,$7,$8::jsonb,$9::jsonb,$10),\
             ($11,$12,$13,$14,$15,$16,$17,$18::jsonb,$19::jsonb,$20)"
        );
        let mut typed = String::new();
        push_rows(&mut typed, 2, true, &TYPED_CASTS);
        assert!(typed.starts_with("(0,$1::uuid,$2::text,"), "{typed}");
        assert!(
            typed.ends_with(
                ",(1,$11::uuid,$12::text,$13::text,$14::int8,$15::text,$16::text,\
                                $17::timestamptz,$18::jsonb,$19::jsonb,$20::text)"
            ),
            "{typed}"
        );
    }
}
