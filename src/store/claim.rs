//! The relay's statements: claim ready rows of a partition, and record what became of them.
//!
//! A partition is owned by one node at a time (see `lease`), so claiming is a plain read: no row
//! is locked or marked "in flight". What keeps two nodes apart is the lease epoch, checked when
//! results are recorded ([`Store::record_batch`]) and at Redis when publishing.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};

use sea_orm::{ConnectionTrait, TransactionTrait, Value};

use super::positions::{position_arrays, record_positions, record_positions_sql};
use super::sql::{PUBLISHED_COLUMNS, num_array, text_array};
use super::{Store, StoreError, stmt};

/// The largest payload an event may have, in bytes of its JSON text as PostgreSQL writes it out:
/// the database's limit, `outpost_max_payload_bytes()`, which its insert rule and the relay's
/// claim apply (a test checks that the two agree). `producer.max_payload_bytes` may only lower it
/// for the producer API's own check.
pub const MAX_PAYLOAD_BYTES: usize = 262_144;

/// A row claimed for publishing.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedEvent {
    /// Outbox row id.
    pub id: i64,
    /// The row's partition.
    pub partition: i32,
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
    /// Payload schema version.
    pub schema_version: String,
    /// When the fact happened (producer's clock).
    pub occurred_at: chrono::DateTime<chrono::FixedOffset>,
    /// When the row was inserted (database clock).
    pub recorded_at: chrono::DateTime<chrono::FixedOffset>,
    /// Payload as JSON text.
    pub payload: String,
    /// Headers as JSON text (an object of strings).
    pub headers: String,
    /// Explicit destination, if the producer set one.
    pub destination: Option<String>,
    /// Attempts made so far (non-zero for a retry).
    pub attempts: i32,
    /// Why a column the producer wrote could not be read (the row is then a failed event of its
    /// own aggregate, never a failed claim); the fields it concerns hold placeholders.
    pub undecodable: Option<String>,
    /// The payload's size in bytes when it is over the database's limit
    /// (`outpost_max_payload_bytes()`): the claim left the payload out (`payload` is `null`), and
    /// the row is to be refused as `OVERSIZE`.
    pub oversize: Option<u64>,
}

/// The lease under which results are recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRef {
    /// Partition number.
    pub partition: i32,
    /// The owning node.
    pub node_id: String,
    /// The epoch (fencing token) the node acquired.
    pub epoch: i64,
}

/// A row that failed for its own reasons (wrong key type at its stream, too large, unroutable, an
/// error Outpost does not know): it counts an attempt and holds back the rest of its aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedEvent {
    /// Outbox row id.
    pub id: i64,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Its sequence: later events of the aggregate are held.
    pub aggregate_seq: i64,
    /// The failure's code (`WRONGTYPE`, `OVERSIZE`, `UNROUTABLE`, `ENCODING`, `UNDECODABLE`,
    /// …): the metric label.
    pub code: String,
    /// What went wrong (stored in `last_error`).
    pub error: String,
    /// Delay before the next attempt, in milliseconds.
    pub retry_in_ms: i64,
    /// The row can never be published as it is: quarantined at this attempt, whatever
    /// `max_attempts` allows.
    pub unpublishable: bool,
}

/// What became of a claimed batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchResult {
    /// Published rows with their stream entry ids.
    pub published: Vec<(i64, String)>,
    /// Aggregates released by this batch: a row that had been retried was published, so its
    /// aggregate's held rows become pending again. `(type, id, seq of the published row)`.
    pub unblocked: Vec<(String, String, i64)>,
    /// Rows that routing sends nowhere.
    pub no_destination: Vec<i64>,
    /// Rows that failed permanently.
    pub failed: Vec<FailedEvent>,
    /// The newest entry id appended per stream, as `(stream, ms, seq)`: recorded with the mark
    /// (`outpost_stream_position`), so a Redis that later lost it can tell.
    pub positions: Vec<(String, i64, i64)>,
}

/// How a recorded batch ended for the failed rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Rows moved to `retry_wait`.
    pub retrying: u64,
    /// Rows moved to `quarantined`.
    pub quarantined: u64,
}

impl Store {
    /// Ready rows of `partitions` in id order (which, within an aggregate, is sequence order),
    /// in one statement: for each partition at most `max_rows` rows and no more than
    /// `max_bytes` of payload and headers as the relay loads them, uncompressed (always at least
    /// one row, so a large event is still seen and dealt with), and for the whole claim no more
    /// than `max_bytes` times the number of partitions (but for its first row: a partition whose
    /// large first row does not fit then gets nothing this time). A payload over the database's
    /// limit is not loaded at all: see [`ClaimedEvent::oversize`]. Ordered by partition, then id.
    pub async fn claim_many(
        &self,
        partitions: &[i32],
        max_rows: u32,
        max_bytes: u64,
    ) -> Result<Vec<ClaimedEvent>, StoreError> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let rows = self
            .connection()
            .query_all_raw(stmt(
                claim_many_sql(),
                [
                    num_array(partitions).into(),
                    i64::from(max_rows).into(),
                    byte_bound(max_bytes).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        rows.iter().map(claimed_event).collect()
    }

    /// [`Store::claim_many`] where some partitions read from a cursor: `(partition, after_id)`,
    /// `after_id` 0 for a read from the oldest row. A partition with a cursor reads only pending
    /// rows with a larger id (and its due retries), and skips every row whose aggregate still has
    /// a pending row at or before the cursor, so an aggregate's events never overtake one
    /// another.
    ///
    /// For a partition whose oldest rows all wait for a rate-limit permit: the relay moves past
    /// them to the rows of other streams behind them (see `dispatch::cursor`).
    ///
    /// Also returns the partitions whose claim stopped at a bound (`max_rows` or `max_bytes`),
    /// which may have more rows ready.
    pub async fn claim_after(
        &self,
        partitions: &[(i32, i64)],
        max_rows: u32,
        max_bytes: u64,
    ) -> Result<(Vec<ClaimedEvent>, Vec<i32>), StoreError> {
        if partitions.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let (numbers, after): (Vec<i32>, Vec<i64>) = partitions.iter().copied().unzip();
        let rows = self
            .connection()
            .query_all_raw(stmt(
                claim_after_sql(),
                [
                    num_array(&numbers).into(),
                    i64::from(max_rows).into(),
                    byte_bound(max_bytes).into(),
                    num_array(&after).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let mut full = Vec::new();
        let mut events = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let event = claimed_event(row)?;
            let last_of_partition = rows
                .get(i + 1)
                .map(|next| next.try_get_by_index::<i32>(PARTITION_AT))
                .transpose()
                .map_err(StoreError::from_db)?
                != Some(event.partition);
            if last_of_partition {
                // Rows are in partition order: the partition's last row closes its count.
                let read: i64 = row
                    .try_get_by_index(PARTITION_AT + 2)
                    .map_err(StoreError::from_db)?;
                let returned = events
                    .iter()
                    .rev()
                    .take_while(|e: &&ClaimedEvent| e.partition == event.partition)
                    .count()
                    + 1;
                if read >= i64::from(max_rows) || read > i64::try_from(returned).unwrap_or(0) {
                    full.push(event.partition);
                }
            }
            events.push(event);
        }
        Ok((events, full))
    }

    /// What [`Store::claim_many`] returns, for a poll of partitions that mostly have nothing or
    /// a few rows ready: one index scan over all of them (58.8 µs against the per-partition
    /// statement's 96.9 µs over 64 partitions at 100 events/s), the bounds applied in the same
    /// statement before any payload is read out, so a poll never loads more than its bounds.
    /// Only when more than `cap` rows are ready, which a scan in partition order cannot share
    /// out fairly, does it read them again with [`Store::claim_many`].
    pub async fn claim_polled(
        &self,
        partitions: &[i32],
        max_rows: u32,
        max_bytes: u64,
        cap: u32,
    ) -> Result<Vec<ClaimedEvent>, StoreError> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let rows = self
            .connection()
            .query_all_raw(stmt(
                claim_polled_sql(),
                [
                    num_array(partitions).into(),
                    (i64::from(cap) + 1).into(),
                    i64::from(max_rows).into(),
                    byte_bound(max_bytes).into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let scanned: i64 = match rows.first() {
            Some(r) => r
                .try_get_by_index(PARTITION_AT + 2)
                .map_err(StoreError::from_db)?,
            None => 0,
        };
        if scanned > i64::from(cap) {
            return self.claim_many(partitions, max_rows, max_bytes).await;
        }
        rows.iter().map(claimed_event).collect()
    }

    /// The plan of [`Store::claim_many`] (or, when `polled`, of [`Store::claim_polled`]'s scan
    /// with `cap` = `max_rows`) as PostgreSQL runs it for the relay's workers (a prepared
    /// statement with a generic plan), from `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`: for the
    /// tests and benchmarks that check which rows and pages a claim reads.
    pub async fn explain_claim(
        &self,
        partitions: &[i32],
        max_rows: u32,
        max_bytes: u64,
        polled: bool,
    ) -> Result<serde_json::Value, StoreError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "outpost_explain_claim_{}",
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let bytes = byte_bound(max_bytes);
        // The arguments are numbers formatted here, never text from outside.
        let (sql, args) = if polled {
            (
                claim_polled_sql(),
                format!(
                    "'{}', {}, {}, {bytes}",
                    num_array(partitions),
                    i64::from(max_rows) + 1,
                    max_rows
                ),
            )
        } else {
            (
                claim_many_sql(),
                format!("'{}', {max_rows}, {bytes}", num_array(partitions)),
            )
        };
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        txn.execute_unprepared(&format!(
            "SET LOCAL plan_cache_mode = force_generic_plan; PREPARE {name} AS {sql}"
        ))
        .await
        .map_err(StoreError::from_db)?;
        let plan = txn
            .query_one_raw(stmt(
                &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {name}({args})"),
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("EXPLAIN returned no row".to_owned()))?
            .try_get_by_index(0)
            .map_err(StoreError::from_db)?;
        // A prepared statement outlives the transaction (after an error above, its name is
        // never used again).
        txn.execute_unprepared(&format!("DEALLOCATE {name}"))
            .await
            .map_err(StoreError::from_db)?;
        txn.commit().await.map_err(StoreError::from_db)?;
        Ok(plan)
    }

    /// Marks (or deletes) published rows of several partitions in one statement. Each lease is
    /// checked as in [`Store::record_batch`]: rows of a partition whose lease is no longer ours at
    /// its epoch stay untouched. Returns the partitions whose lease held.
    pub async fn mark_published_many(
        &self,
        node_id: &str,
        leases: &[(i32, i64)],
        published: &[(i64, String)],
        positions: &[(i32, &str, i64, i64)],
        delete_published: bool,
    ) -> Result<Vec<i32>, StoreError> {
        let parts: Vec<i32> = leases.iter().map(|(p, _)| *p).collect();
        let epochs: Vec<i64> = leases.iter().map(|(_, e)| *e).collect();
        let ids: Vec<i64> = published.iter().map(|(id, _)| *id).collect();
        let sids: Vec<&str> = published.iter().map(|(_, s)| s.as_str()).collect();
        let [pos_parts, pos_streams, pos_ms, pos_seqs] = position_arrays(positions);
        let rows = self
            .connection()
            .query_all_raw(stmt(
                mark_many_sql(delete_published),
                [
                    node_id.into(),
                    num_array(&parts).into(),
                    num_array(&epochs).into(),
                    num_array(&ids).into(),
                    text_array(&sids).into(),
                    pos_parts,
                    pos_streams,
                    pos_ms,
                    pos_seqs,
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        rows.into_iter()
            .map(|r| r.try_get_by_index::<i32>(0).map_err(StoreError::from_db))
            .collect()
    }

    /// Records a batch's results in one transaction, guarded by the lease: if `lease` is no
    /// longer the partition's owner and epoch, nothing is recorded and
    /// [`StoreError::LeaseLost`] is returned.
    ///
    /// Published rows become `published` (or are deleted when `delete_published`); rows with no
    /// destination become `no_destination`; failed rows count an attempt and become `retry_wait`,
    /// or `quarantined` once `max_attempts` is reached (at once when
    /// [`FailedEvent::unpublishable`]), and their aggregates' later rows become `held`.
    /// Aggregates in `unblocked` have their held rows made `pending` again.
    pub async fn record_batch(
        &self,
        lease: &LeaseRef,
        result: &BatchResult,
        delete_published: bool,
        max_attempts: u32,
    ) -> Result<Recorded, StoreError> {
        if result.no_destination.is_empty()
            && result.unblocked.is_empty()
            && result.failed.is_empty()
        {
            let positions: Vec<(i32, &str, i64, i64)> = result
                .positions
                .iter()
                .map(|(s, m, q)| (lease.partition, s.as_str(), *m, *q))
                .collect();
            let held = self
                .mark_published_many(
                    &lease.node_id,
                    &[(lease.partition, lease.epoch)],
                    &result.published,
                    &positions,
                    delete_published,
                )
                .await?;
            if held.is_empty() {
                return Err(StoreError::LeaseLost {
                    partition: lease.partition,
                    epoch: lease.epoch,
                });
            }
            return Ok(Recorded::default());
        }
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        let held = txn
            .query_one_raw(stmt(
                "SELECT 1 FROM outpost_partition \
                 WHERE partition = $1 AND owner = $2 AND epoch = $3 FOR KEY SHARE",
                [
                    lease.partition.into(),
                    lease.node_id.clone().into(),
                    lease.epoch.into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        if held.is_none() {
            txn.rollback().await.map_err(StoreError::from_db)?;
            return Err(StoreError::LeaseLost {
                partition: lease.partition,
                epoch: lease.epoch,
            });
        }
        if !result.published.is_empty() {
            let ids: Vec<i64> = result.published.iter().map(|(id, _)| *id).collect();
            if delete_published {
                txn.execute_raw(stmt(
                    "DELETE FROM outpost_event WHERE id = ANY($1::int8[])",
                    [num_array(&ids).into()],
                ))
                .await
                .map_err(StoreError::from_db)?;
            } else {
                let sids: Vec<&str> = result.published.iter().map(|(_, s)| s.as_str()).collect();
                static MOVE: LazyLock<String> =
                    LazyLock::new(|| format!("WITH {} SELECT 1", move_published("$1", "$2", "")));
                txn.execute_raw(stmt(
                    &MOVE,
                    [num_array(&ids).into(), text_array(&sids).into()],
                ))
                .await
                .map_err(StoreError::from_db)?;
            }
        }
        record_positions(&txn, lease.partition, &result.positions).await?;
        if !result.no_destination.is_empty() {
            txn.execute_raw(stmt(
                "UPDATE outpost_event SET status = 'no_destination' WHERE id = ANY($1::int8[])",
                [num_array(&result.no_destination).into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        }
        if !result.unblocked.is_empty() {
            release_holds(&txn, &result.unblocked).await?;
        }
        let mut recorded = Recorded::default();
        if !result.failed.is_empty() {
            recorded = record_failures(&txn, &result.failed, max_attempts).await?;
        }
        txn.commit().await.map_err(StoreError::from_db)?;
        Ok(recorded)
    }
}

/// The columns of a claimed row, in the order [`claimed_event`] reads them (the row is `w`).
/// A time outside the years 1 to 9999 (a row written before the rule refused it) comes as
/// NULL: it cannot be decoded, nor written into a stream entry. A payload over the database's
/// limit comes as NULL too, never read out: the relay refuses the row by its size (the last
/// column) alone.
const CLAIM_COLUMNS: &str = "w.id, w.event_id, w.aggregate_type, w.aggregate_id, \
     w.aggregate_seq, w.event_type, w.schema_version, \
     CASE WHEN w.occurred_at BETWEEN '0001-01-01 00:00:00+00' \
                                 AND '9999-12-31 23:59:59.999999+00' THEN w.occurred_at END, \
     w.recorded_at, \
     CASE WHEN w.payload_bytes <= outpost_max_payload_bytes() THEN w.payload::text END, \
     w.headers::text, w.destination, w.attempts, w.partition, w.payload_bytes";

/// Where the partition is among [`CLAIM_COLUMNS`]; the payload's size follows it, and a
/// statement's own figures (`read`, `scanned`) come after them.
const PARTITION_AT: usize = 13;

/// The bytes row `row` loads, for the claims' budget (`relay.batch_bytes`): its payload and
/// headers as text, uncompressed, as the outbox's generated columns counted them when the row
/// was written. Never the stored size: a compressible payload takes a hundredth of its size on
/// disk.
fn row_bytes(row: &str) -> String {
    format!("{row}.payload_bytes + {row}.headers_bytes")
}

/// `max_bytes` as a claim's parameter: at most what times any number of partitions up to
/// 65,536 still fits in a `bigint` (the whole claim's bound multiplies it), which no budget
/// comes near.
fn byte_bound(max_bytes: u64) -> i64 {
    i64::try_from(max_bytes)
        .unwrap_or(i64::MAX)
        .min(i64::MAX >> 16)
}

/// A claim's statement around `rows`, the rows of each partition within its own bounds (`w.*`
/// and the statement's figures): the claimed columns (then `extra`) of those rows in partition
/// and id order, within the bytes of the whole claim, `per_partition` bytes (a parameter) times
/// the number of partitions (`$1`), but for the first row, which is always claimed. Each
/// partition's first row escapes its own byte bound (a large row must be seen to be dealt
/// with); without this bound, a claim over many partitions whose first rows are all large would
/// load all of them.
fn within_claim(rows: &str, per_partition: &str, extra: &str) -> String {
    format!(
        "SELECT {CLAIM_COLUMNS}{extra} \
         FROM (SELECT c.*, sum({}) OVER (ORDER BY c.partition, c.id) AS claimed \
               FROM ({rows}) c) w \
         WHERE w.claimed <= {per_partition} * cardinality($1::int4[]) OR w.claimed = {} \
         ORDER BY w.partition, w.id",
        row_bytes("c"),
        row_bytes("w")
    )
}

/// Decodes one claimed row. The columns the database fills in must decode (a failure is a
/// broken database); a column the producer wrote that does not is noted in
/// [`ClaimedEvent::undecodable`], so one bad row never fails the claim of its neighbours.
fn claimed_event(r: &sea_orm::QueryResult) -> Result<ClaimedEvent, StoreError> {
    let g = StoreError::from_db;
    let mut problems: Vec<String> = Vec::new();
    // A payload over the limit comes as NULL (the claim left it out): only its size is read.
    let (payload, oversize) = match r.try_get_by_index::<Option<String>>(9) {
        Ok(Some(p)) => (p, None),
        Ok(None) => {
            let size: i32 = r.try_get_by_index(PARTITION_AT + 1).map_err(g)?;
            ("null".to_owned(), Some(u64::try_from(size).unwrap_or(0)))
        }
        Err(e) => {
            problems.push(format!("payload: {e}"));
            ("null".to_owned(), None)
        }
    };
    let mut lenient = |at: usize, column: &str| -> Option<String> {
        match r.try_get_by_index::<String>(at) {
            Ok(v) => Some(v),
            Err(e) => {
                problems.push(format!("{column}: {e}"));
                None
            }
        }
    };
    let event_type = lenient(5, "event_type").unwrap_or_default();
    let schema_version = lenient(6, "schema_version").unwrap_or_default();
    let headers = lenient(10, "headers").unwrap_or_else(|| "{}".to_owned());
    let occurred_at: Option<chrono::DateTime<chrono::FixedOffset>> =
        r.try_get_by_index(7).map_err(g)?;
    if occurred_at.is_none() {
        problems.push(
            "occurred_at is not a time between the years 1 and 9999 (infinity, or a far date)"
                .to_owned(),
        );
    }
    let event_id = match r.try_get_by_index::<uuid::Uuid>(1) {
        Ok(id) => id,
        Err(e) => {
            problems.push(format!("event_id: {e}"));
            uuid::Uuid::nil()
        }
    };
    let destination = match r.try_get_by_index::<Option<String>>(11) {
        Ok(d) => d,
        Err(e) => {
            problems.push(format!("destination: {e}"));
            None
        }
    };
    let recorded_at: chrono::DateTime<chrono::FixedOffset> = r.try_get_by_index(8).map_err(g)?;
    Ok(ClaimedEvent {
        id: r.try_get_by_index(0).map_err(g)?,
        event_id,
        aggregate_type: r.try_get_by_index(2).map_err(g)?,
        aggregate_id: r.try_get_by_index(3).map_err(g)?,
        aggregate_seq: r.try_get_by_index(4).map_err(g)?,
        event_type,
        schema_version,
        occurred_at: occurred_at.unwrap_or(recorded_at),
        recorded_at,
        payload,
        headers,
        destination,
        attempts: r.try_get_by_index(12).map_err(g)?,
        partition: r.try_get_by_index(PARTITION_AT).map_err(g)?,
        undecodable: (!problems.is_empty()).then(|| problems.join("; ")),
        oversize,
    })
}

/// The statement of [`Store::mark_published_many`], built once per mode.
fn mark_many_sql(delete_published: bool) -> &'static str {
    fn build(delete_published: bool) -> String {
        let marked = if delete_published {
            "marked AS (DELETE FROM outpost_event e USING unnest($4::int8[]) AS v(id) \
             WHERE e.id = v.id AND e.partition IN (SELECT partition FROM lease) RETURNING 1)"
                .to_owned()
        } else {
            move_published(
                "$4",
                "$5",
                " AND e.partition IN (SELECT partition FROM lease)",
            )
        };
        let positions = record_positions_sql(
            ["$6", "$7", "$8", "$9"],
            " AND v.p IN (SELECT partition FROM lease)",
        );
        format!(
            "WITH lease AS (SELECT p.partition FROM outpost_partition p \
                            JOIN unnest($2::int4[], $3::int8[]) AS l(partition, epoch) \
                              ON p.partition = l.partition AND p.epoch = l.epoch \
                            WHERE p.owner = $1 ORDER BY p.partition FOR KEY SHARE OF p), \
                  {marked}, \
                  positions AS ({positions}) \
             SELECT partition FROM lease"
        )
    }
    static DELETE: LazyLock<String> = LazyLock::new(|| build(true));
    static MOVE: LazyLock<String> = LazyLock::new(|| build(false));
    if delete_published { &DELETE } else { &MOVE }
}

/// Two common table expressions that move published rows from the outbox to
/// `outpost_published`: `moved` deletes the outbox rows whose ids are in the array parameter
/// `ids` (and that meet `and`), `marked` inserts them with their stream entry ids (the array
/// parameter `sids`, in the order of `ids`) and the time of publishing. One statement, so the
/// row is in exactly one of the two tables at any time.
fn move_published(ids: &str, sids: &str, and: &str) -> String {
    let e_columns = PUBLISHED_COLUMNS
        .split(", ")
        .map(|c| format!("e.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "moved AS (DELETE FROM outpost_event e USING unnest({ids}::int8[], {sids}::text[]) \
           AS v(id, sid) WHERE e.id = v.id{and} RETURNING {e_columns}, v.sid), \
         marked AS (INSERT INTO outpost_published ({PUBLISHED_COLUMNS}, published_at, stream_id) \
           SELECT {PUBLISHED_COLUMNS}, now(), sid FROM moved RETURNING 1)"
    )
}

/// Ends the holds of aggregates whose failing event (`(type, id, seq)`) was published or routed
/// nowhere: an aggregate held at that very sequence is released, and only its held rows become
/// pending again. An aggregate held at another sequence (an earlier event still failing, after
/// a Redis-loss recovery sent published rows back) keeps its hold and its held rows.
async fn release_holds<C: ConnectionTrait>(
    txn: &C,
    unblocked: &[(String, String, i64)],
) -> Result<(), StoreError> {
    let (types, ids, seqs) = split3(unblocked);
    lock_aggregates(txn, &types, &ids).await?;
    txn.execute_raw(stmt(
        "WITH released AS ( \
           UPDATE outpost_aggregate a SET blocked_seq = NULL \
           FROM unnest($1::text[], $2::text[], $3::int8[]) AS v(t, i, s) \
           WHERE a.aggregate_type = v.t AND a.aggregate_id = v.i AND a.blocked_seq = v.s \
           RETURNING a.aggregate_type, a.aggregate_id) \
         UPDATE outpost_event e SET status = 'pending', next_attempt_at = now() \
         FROM released r \
         WHERE e.aggregate_type = r.aggregate_type AND e.aggregate_id = r.aggregate_id \
           AND e.status = 'held'",
        [types, ids, seqs],
    ))
    .await
    .map_err(StoreError::from_db)?;
    Ok(())
}

async fn record_failures<C: ConnectionTrait>(
    txn: &C,
    failed: &[FailedEvent],
    max_attempts: u32,
) -> Result<Recorded, StoreError> {
    let triples: Vec<(String, String, i64)> = failed
        .iter()
        .map(|f| {
            (
                f.aggregate_type.clone(),
                f.aggregate_id.clone(),
                f.aggregate_seq,
            )
        })
        .collect();
    let (types, ids, seqs) = split3(&triples);
    lock_aggregates(txn, &types, &ids).await?;
    // Lock the aggregates first: producers writing to them wait, and see the hold when they go on.
    // An aggregate already held at an earlier sequence stays held there: the earliest failing
    // event is the one its successors wait for.
    txn.execute_raw(stmt(
        "UPDATE outpost_aggregate a \
         SET blocked_seq = LEAST(coalesce(a.blocked_seq, v.s), v.s) \
         FROM unnest($1::text[], $2::text[], $3::int8[]) AS v(t, i, s) \
         WHERE a.aggregate_type = v.t AND a.aggregate_id = v.i",
        [types.clone(), ids.clone(), seqs.clone()],
    ))
    .await
    .map_err(StoreError::from_db)?;
    let row_ids: Vec<i64> = failed.iter().map(|f| f.id).collect();
    let errors: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
    let delays: Vec<i64> = failed.iter().map(|f| f.retry_in_ms).collect();
    let at_once: Vec<bool> = failed.iter().map(|f| f.unpublishable).collect();
    let outcome = txn
        .query_all_raw(stmt(
            "UPDATE outpost_event e SET attempts = e.attempts + 1, last_error = v.err, \
               status = CASE WHEN v.at_once OR e.attempts + 1 >= $4 \
                 THEN 'quarantined' ELSE 'retry_wait' END, \
               next_attempt_at = now() + v.delay * interval '1 millisecond' \
             FROM unnest($1::int8[], $2::text[], $3::int8[], $5::bool[]) AS v(id, err, delay, at_once) \
             WHERE e.id = v.id RETURNING e.status",
            [
                num_array(&row_ids).into(),
                text_array(&errors).into(),
                num_array(&delays).into(),
                i32::try_from(max_attempts).unwrap_or(i32::MAX).into(),
                num_array(&at_once).into(),
            ],
        ))
        .await
        .map_err(StoreError::from_db)?;
    let mut recorded = Recorded::default();
    for r in outcome {
        let status: String = r.try_get_by_index(0).map_err(StoreError::from_db)?;
        if status == "quarantined" {
            recorded.quarantined += 1;
        } else {
            recorded.retrying += 1;
        }
    }
    // A new statement: its snapshot includes rows committed while we waited for the locks.
    txn.execute_raw(stmt(
        "UPDATE outpost_event e SET status = 'held' \
         FROM unnest($1::text[], $2::text[], $3::int8[]) AS v(t, i, s) \
         JOIN outpost_aggregate a ON a.aggregate_type = v.t AND a.aggregate_id = v.i \
         WHERE e.aggregate_type = v.t AND e.aggregate_id = v.i \
           AND e.aggregate_seq > a.blocked_seq AND e.status = 'pending'",
        [types, ids, seqs],
    ))
    .await
    .map_err(StoreError::from_db)?;
    Ok(recorded)
}

/// Locks the rows of the aggregates `(types[k], ids[k])` in key order, the order in which the
/// producer API's statement for many events takes them: a transaction of the relay's and a
/// producer's that both hold one of the aggregates and want another then wait for each other
/// in one direction, never in a cycle (the relay's own updates below would take them in the
/// order of a join).
async fn lock_aggregates<C: ConnectionTrait>(
    txn: &C,
    types: &Value,
    ids: &Value,
) -> Result<(), StoreError> {
    txn.execute_raw(stmt(
        "SELECT 1 FROM outpost_aggregate a \
         JOIN unnest($1::text[], $2::text[]) AS v(t, i) \
           ON a.aggregate_type = v.t AND a.aggregate_id = v.i \
         ORDER BY a.aggregate_type, a.aggregate_id FOR UPDATE OF a",
        [types.clone(), ids.clone()],
    ))
    .await
    .map_err(StoreError::from_db)?;
    Ok(())
}

fn split3(items: &[(String, String, i64)]) -> (Value, Value, Value) {
    let types: Vec<&str> = items.iter().map(|(t, _, _)| t.as_str()).collect();
    let ids: Vec<&str> = items.iter().map(|(_, i, _)| i.as_str()).collect();
    let seqs: Vec<i64> = items.iter().map(|(_, _, s)| *s).collect();
    (
        text_array(&types).into(),
        text_array(&ids).into(),
        num_array(&seqs).into(),
    )
}

/// The statement of [`Store::claim_many`]: `$1` partitions, `$2` rows, `$3` bytes per partition.
///
/// Pending rows are read in id order from `outpost_event_pending`; retries from
/// `outpost_event_retry_due`, only those due (`next_attempt_at <= now()`), then put in id order.
/// The retries' scan is a subquery of its own (`OFFSET 0`): asked for rows in id order directly,
/// the planner may walk the primary key in id order instead and read every retry that is not due
/// yet on its way.
fn claim_many_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| claim_sql(false));
    &SQL
}

/// The statement of [`Store::claim_after`]: [`claim_many_sql`] with `$4` each partition's cursor.
fn claim_after_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| claim_sql(true));
    &SQL
}

/// The per-partition claim; `after`: each partition reads only pending rows past its cursor
/// (`$4`), and no row of an aggregate that still has a pending row at or before it (due retries
/// wherever they are: an aggregate's rows after a retry are held, never pending), and each row
/// says how many rows its partition's scan read before the byte bound (`read`).
fn claim_sql(after: bool) -> String {
    let (read, count, from, pending_after) = if after {
        (
            ", w.read",
            ", count(*) OVER () AS read",
            "unnest($1::int4[], $4::int8[]) AS p(partition, after_id)",
            // Within an aggregate id order is sequence order, so its oldest pending row says
            // whether it still has one at or before the cursor.
            " AND e.id > p.after_id \
              AND (p.after_id = 0 OR ( \
                SELECT b.id FROM outpost_event b \
                WHERE b.aggregate_type = e.aggregate_type AND b.aggregate_id = e.aggregate_id \
                  AND b.status = 'pending' \
                ORDER BY b.aggregate_seq LIMIT 1) > p.after_id)",
        )
    } else {
        ("", "", "unnest($1::int4[]) AS p(partition)", "")
    };
    let rows = format!(
        "SELECT w.* \
         FROM {from}, LATERAL ( \
           SELECT t.*, \
                  sum({}) OVER (ORDER BY t.id) AS running, \
                  row_number() OVER (ORDER BY t.id) AS n{count} \
           FROM (SELECT u.* FROM ( \
                   (SELECT e.* FROM outpost_event e \
                     WHERE e.partition = p.partition AND e.status = 'pending' \
                       AND e.next_attempt_at <= now(){pending_after} \
                     ORDER BY e.id LIMIT $2) \
                   UNION ALL \
                   (SELECT r.* FROM (SELECT e.* FROM outpost_event e \
                      WHERE e.partition = p.partition AND e.status = 'retry_wait' \
                        AND e.next_attempt_at <= now() OFFSET 0) r \
                     ORDER BY r.id LIMIT $2)) u \
                 ORDER BY u.id LIMIT $2) t) w \
         WHERE w.n = 1 OR w.running <= $3",
        row_bytes("t")
    );
    within_claim(&rows, "$3", read)
}

/// The statement of [`Store::claim_polled`]: `$1` partitions, `$2` rows scanned at most, `$3`
/// rows and `$4` bytes per partition. Its two scans are those of [`claim_many_sql`].
fn claim_polled_sql() -> &'static str {
    // The inner scan carries each row's payload as stored (a TOAST pointer for a large
    // one); only the rows within the bounds are read out as text.
    static SQL: LazyLock<String> = LazyLock::new(|| {
        let rows = format!(
            "SELECT w.* \
             FROM (SELECT t.*, \
                          row_number() OVER (PARTITION BY t.partition ORDER BY t.id) AS n, \
                          sum({}) \
                            OVER (PARTITION BY t.partition ORDER BY t.id) AS running, \
                          count(*) OVER () AS scanned \
                   FROM (SELECT u.* FROM ( \
                           (SELECT e.* FROM outpost_event e \
                             WHERE e.partition = ANY($1::int4[]) \
                               AND e.status = 'pending' AND e.next_attempt_at <= now() \
                             ORDER BY e.partition, e.id LIMIT $2) \
                           UNION ALL \
                           (SELECT r.* FROM (SELECT e.* FROM outpost_event e \
                              WHERE e.partition = ANY($1::int4[]) \
                                AND e.status = 'retry_wait' \
                                AND e.next_attempt_at <= now() OFFSET 0) r \
                             ORDER BY r.partition, r.id LIMIT $2)) u \
                         ORDER BY u.partition, u.id LIMIT $2) t) w \
             WHERE w.n <= $3 AND (w.n = 1 OR w.running <= $4)",
            row_bytes("t")
        );
        within_claim(&rows, "$4", ", w.scanned")
    });
    &SQL
}
