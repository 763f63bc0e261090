//! The consumer side: a consumer group's position per aggregate and its inbox of processed event
//! ids. Every function here runs on the caller's own transaction (the one the handler writes
//! its effects in), so the effect, the inbox row and the new position commit together.

use sea_orm::ConnectionTrait;
use uuid::Uuid;

use super::sql::text_array;
use super::{DbErrorKind, StoreError, classify, stmt};

/// Where a consumer group stands in one aggregate, read under the position's row lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboxPosition {
    /// The last sequence the group applied or dead-lettered (0 before the first).
    pub last_seq: i64,
    /// The event id is already in the group's inbox.
    pub seen: bool,
}

/// What became of a processed event, kept in the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxOutcome {
    /// The handler applied it.
    Applied,
    /// It went to the dead-letter stream; the aggregate moves past it.
    DeadLettered,
}

impl InboxOutcome {
    fn as_str(self) -> &'static str {
        match self {
            InboxOutcome::Applied => "applied",
            InboxOutcome::DeadLettered => "dead_lettered",
        }
    }
}

/// Locks the group's position in the aggregate (creating it at 0 on first sight) for the rest of
/// the transaction, and says where it stands and whether `event_id` was processed already in
/// this aggregate. The inbox is keyed by aggregate as well as by event id: an event of another
/// aggregate that reuses the id (a producer's bug, a restored database, a forged entry) is not
/// taken for a duplicate. Rows recorded before the inbox knew aggregates (empty aggregate type
/// and id) match an event id in any aggregate, as they did when written.
///
/// The lock is what keeps two members of a group from applying one aggregate at once: the second
/// waits, then reads the position the first committed.
pub async fn lock_position<C: ConnectionTrait>(
    txn: &C,
    group: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    event_id: Uuid,
) -> Result<InboxPosition, StoreError> {
    // The common case is an aggregate the group has seen: lock its row (a waiting member reads
    // the row as the one before it committed it). Only the first event of an aggregate creates
    // the row, then locks it the same way.
    let select = || {
        stmt(
            "SELECT p.last_seq, EXISTS (SELECT 1 FROM outpost_inbox \
                                        WHERE consumer_group = $1 AND event_id = $4 \
                                          AND (aggregate_type, aggregate_id) \
                                              IN (($2, $3), ('', ''))) \
             FROM outpost_consumer_position p \
             WHERE p.consumer_group = $1 AND p.aggregate_type = $2 AND p.aggregate_id = $3 \
             FOR UPDATE OF p",
            [
                group.into(),
                aggregate_type.into(),
                aggregate_id.into(),
                event_id.into(),
            ],
        )
    };
    let mut row = txn
        .query_one_raw(select())
        .await
        .map_err(StoreError::from_db)?;
    if row.is_none() {
        txn.execute_raw(stmt(
            "INSERT INTO outpost_consumer_position (consumer_group, aggregate_type, aggregate_id) \
             VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            [group.into(), aggregate_type.into(), aggregate_id.into()],
        ))
        .await
        .map_err(StoreError::from_db)?;
        row = txn
            .query_one_raw(select())
            .await
            .map_err(StoreError::from_db)?;
    }
    let row = row.ok_or_else(|| {
        StoreError::Corrupt("a consumer position vanished while being created".into())
    })?;
    Ok(InboxPosition {
        last_seq: row.try_get_by_index(0).map_err(StoreError::from_db)?,
        seen: row.try_get_by_index(1).map_err(StoreError::from_db)?,
    })
}

/// Records `event_id` in the group's inbox and moves the group's position in the aggregate to
/// `seq`, in the caller's transaction (after [`lock_position`]): forward, or back when a new
/// event reuses a sequence the group has passed (the producer's history was rewound). Returns
/// `false` when the event id was in the inbox already (a duplicate raced in): the caller must
/// roll back.
#[allow(clippy::too_many_arguments)]
pub async fn record_processed<C: ConnectionTrait>(
    txn: &C,
    group: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    seq: i64,
    event_id: Uuid,
    outcome: InboxOutcome,
) -> Result<bool, StoreError> {
    let res = txn
        .execute_raw(stmt(
            "WITH inbox AS (INSERT INTO outpost_inbox \
                                (consumer_group, aggregate_type, aggregate_id, event_id, outcome) \
                            VALUES ($1, $2, $3, $5, $6)) \
             UPDATE outpost_consumer_position SET last_seq = $4, \
                    updated_at = now() \
             WHERE consumer_group = $1 AND aggregate_type = $2 AND aggregate_id = $3",
            [
                group.into(),
                aggregate_type.into(),
                aggregate_id.into(),
                seq.into(),
                event_id.into(),
                outcome.as_str().into(),
            ],
        ))
        .await;
    match res {
        Ok(_) => Ok(true),
        Err(e) => match classify(&e) {
            DbErrorKind::UniqueViolation(_) => Ok(false),
            _ => Err(StoreError::from_db(e)),
        },
    }
}

/// `(aggregate type, aggregate id, last sequence)` of a position row.
fn position_row(r: &sea_orm::QueryResult) -> Result<(String, String, i64), StoreError> {
    Ok((
        r.try_get_by_index(0).map_err(StoreError::from_db)?,
        r.try_get_by_index(1).map_err(StoreError::from_db)?,
        r.try_get_by_index(2).map_err(StoreError::from_db)?,
    ))
}

/// The group's position in every aggregate it has seen, for checks and tools: `(aggregate type,
/// aggregate id, last sequence)`.
pub async fn positions<C: ConnectionTrait>(
    conn: &C,
    group: &str,
) -> Result<Vec<(String, String, i64)>, StoreError> {
    conn.query_all_raw(stmt(
        "SELECT aggregate_type, aggregate_id, last_seq FROM outpost_consumer_position \
         WHERE consumer_group = $1 ORDER BY aggregate_type, aggregate_id",
        [group.into()],
    ))
    .await
    .map_err(StoreError::from_db)?
    .iter()
    .map(position_row)
    .collect()
}

/// The group's position in each of `aggregates` (`(aggregate type, aggregate id)`) it has
/// seen, in one statement without a lock: what a member holding events ahead of a gap reads to
/// learn which gaps have filled. Aggregates the group has not seen are left out.
pub async fn positions_of<C: ConnectionTrait>(
    conn: &C,
    group: &str,
    aggregates: &[(&str, &str)],
) -> Result<Vec<(String, String, i64)>, StoreError> {
    if aggregates.is_empty() {
        return Ok(Vec::new());
    }
    let types: Vec<&str> = aggregates.iter().map(|(t, _)| *t).collect();
    let ids: Vec<&str> = aggregates.iter().map(|(_, i)| *i).collect();
    conn.query_all_raw(stmt(
        "SELECT p.aggregate_type, p.aggregate_id, p.last_seq \
         FROM unnest($2::text[], $3::text[]) AS v(t, i) \
         JOIN outpost_consumer_position p \
           ON p.consumer_group = $1 AND p.aggregate_type = v.t AND p.aggregate_id = v.i",
        [
            group.into(),
            text_array(&types).into(),
            text_array(&ids).into(),
        ],
    ))
    .await
    .map_err(StoreError::from_db)?
    .iter()
    .map(position_row)
    .collect()
}
