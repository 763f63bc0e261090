//! Columns Outpost owns can no longer be written by a producer, and a claim no longer reads the
//! retries that are not due yet.
//!
//! **The insert trigger could be skipped.** It ran only for a row that did not carry its own
//! transaction's `txid`, so that the producer API's statement for many events, which does the
//! trigger's work itself, could write `id`, `aggregate_seq`, `partition` and `status`. A plain
//! `INSERT` naming `txid = txid_current()` skipped it too, and kept whatever it wrote in those
//! columns: a sequence number the aggregate had not handed out (its next writer then failed on
//! the unique key, rolling back another service's business transaction), an id already in
//! `outpost_published` (a shared mark then failed for its whole group), another partition
//! (breaking the aggregate's order), or any delivery state. Now:
//!
//! - the trigger is skipped only for rows written while `outpost.filled_by_outpost` is `on`.
//!   Outpost's own statements turn it on before their first row: the producer API's many-event
//!   insert with `set_config` in a CTE that every row joins, the re-queue after a Redis data loss
//!   just before its statement. A statement trigger (`outpost_event_filled_reset`, run only while
//!   the setting is on) turns it off when the statement ends, so it covers that statement's rows
//!   and nothing written after it (a rolled-back statement takes the setting back with it). The
//!   condition is read only for rows that name their own transaction's `txid`; for every other
//!   row the first comparison decides, as before;
//! - a row that names its own transaction's `txid` and reaches the trigger is refused:
//!   SQLSTATE 23514 (`check_violation`) naming `outpost_event_owned_columns_check`, with the
//!   columns it tried to set and a hint to leave them out. Refused rather than filled in: a
//!   producer linking the producer API of a version before this migration sends exactly such
//!   rows, having already advanced the aggregates' `last_seq` in the same statement, and filling
//!   them in would advance it a second time, leaving holes in the sequence. Such producers fail
//!   visibly until they are upgraded. A row with no `txid`, or another transaction's, has every
//!   owned column filled in as before;
//! - the producer API's statement for many events keeps its form and its cost: one `set_config`
//!   and one statement trigger per statement (a version that went through a function taking the
//!   rows as arrays cost PostgreSQL about a quarter more CPU per 100-event transaction;
//!   docs/benchmarks.md).
//!
//! **Retries that were not due were read by every claim.** The claim's index,
//! `outpost_event_ready (partition, id) WHERE status IN ('pending', 'retry_wait')`, held the
//! rows waiting for a retry among the pending ones, and the claim filtered on `next_attempt_at`
//! after reading them: every claim of a partition read all its waiting retries again. The index
//! is split: `outpost_event_pending (partition, id) WHERE status = 'pending'` for the rows in
//! order, and `outpost_event_retry_due (partition, next_attempt_at) WHERE status = 'retry_wait'`,
//! through which a claim reads only the retries that are due. The indexes are built while the
//! migration holds the outbox (it holds only undelivered events, so this is short).
//!
//! `down` restores the trigger and its function as `m20261206_000010_insert_fixes` left them and
//! the index of `m20261201_000001_outbox`, and drops the functions and the two indexes.

use sea_orm_migration::prelude::*;

use crate::m20261206_000010_insert_fixes::insert_fixes_function;

sql_migration!();

/// The insert trigger's function: that of `m20261206_000010_insert_fixes`, refusing a row that
/// names its own transaction's id.
macro_rules! trigger_function {
    () => {
        r#"CREATE OR REPLACE FUNCTION outpost_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_nudge boolean;
BEGIN
    -- A row that names its own transaction's id and reached this trigger was not written by
    -- Outpost (whose statements run with outpost.filled_by_outpost on, see the trigger's
    -- condition): it is refused, since it claims columns only Outpost may fill in.
    IF outpost_event_row_ok(NEW.aggregate_type, NEW.aggregate_id, NEW.event_type,
                            NEW.schema_version, NEW.payload, NEW.headers, NEW.destination)
       IS NOT TRUE OR NEW.txid = txid_current() THEN
        IF NEW.txid = txid_current() THEN
            PERFORM outpost_event_refuse_owned(NEW);
        END IF;
        PERFORM outpost_event_check_rules(NEW.aggregate_type, NEW.aggregate_id, NEW.event_type,
                                          NEW.schema_version, NEW.payload, NEW.headers,
                                          NEW.destination);
    END IF;
    IF NOT (NEW.occurred_at BETWEEN '0001-01-01 00:00:00+00'
                                AND '9999-12-31 23:59:59.999999+00') THEN
        PERFORM outpost_event_check_time(NEW.occurred_at);
    END IF;

    -- The sequence, under the aggregate's row lock kept until commit: writers of one aggregate
    -- are serialised, writers of different aggregates never wait on each other.
    UPDATE outpost_aggregate
       SET last_seq = last_seq + 1
     WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id
    RETURNING nextval('outpost_event_id_seq'), last_seq, partition,
              CASE WHEN blocked_seq IS NULL THEN 'pending' ELSE 'held' END,
              txid_current(), clock_timestamp(), now(), 0, NULL::text, NULL::timestamptz,
              NULL::text,
              EXISTS (SELECT FROM outpost_node WHERE wants_nudge AND nudge_until > now())
         INTO NEW.id, NEW.aggregate_seq, NEW.partition, NEW.status, NEW.txid, NEW.recorded_at,
              NEW.next_attempt_at, NEW.attempts, NEW.last_error, NEW.published_at, NEW.stream_id,
              v_nudge;
    IF NOT FOUND THEN
        INSERT INTO outpost_aggregate AS a (aggregate_type, aggregate_id, last_seq, partition)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 1,
                outpost_partition_of(NEW.aggregate_type, NEW.aggregate_id,
                                     (SELECT partition_count FROM outpost_meta)))
        ON CONFLICT (aggregate_type, aggregate_id)
            DO UPDATE SET last_seq = a.last_seq + 1
        RETURNING nextval('outpost_event_id_seq'), last_seq, partition,
                  CASE WHEN blocked_seq IS NULL THEN 'pending' ELSE 'held' END,
                  txid_current(), clock_timestamp(), now(), 0, NULL::text, NULL::timestamptz,
                  NULL::text,
                  EXISTS (SELECT FROM outpost_node WHERE wants_nudge AND nudge_until > now())
             INTO NEW.id, NEW.aggregate_seq, NEW.partition, NEW.status, NEW.txid,
                  NEW.recorded_at, NEW.next_attempt_at, NEW.attempts, NEW.last_error,
                  NEW.published_at, NEW.stream_id, v_nudge;
    END IF;
    -- An event already in the outbox: this row is refused by the unique key, or skipped by
    -- ON CONFLICT (event_id) DO NOTHING. It gives its sequence number back. A statement of its
    -- own, after the lock: it sees an insert of the same event that committed meanwhile.
    IF EXISTS (SELECT FROM outpost_event WHERE event_id = NEW.event_id) THEN
        UPDATE outpost_aggregate SET last_seq = last_seq - 1
         WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id;
        RETURN NEW;
    END IF;
    -- The nudge, only while some live node asked for it; sent at commit, once per partition.
    IF v_nudge AND coalesce(lower(current_setting('outpost.nudge', true)), '')
           NOT IN ('off', 'false', 'no', '0') THEN
        PERFORM pg_notify('outpost_wakeup', NEW.partition::text);
    END IF;
    RETURN NEW;
END
$$;
"#
    };
}

const UP: &str = concat!(
    r#"
-- Refuses a row that names its own transaction's id without being written by Outpost, listing
-- the owned columns it set.
CREATE FUNCTION outpost_event_refuse_owned(p_row outpost_event) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_given text;
BEGIN
    v_given := concat_ws(', ',
        CASE WHEN p_row.id IS NOT NULL THEN 'id' END,
        CASE WHEN p_row.aggregate_seq IS NOT NULL THEN 'aggregate_seq' END,
        CASE WHEN p_row.partition IS NOT NULL THEN 'partition' END,
        'txid',
        CASE WHEN p_row.status IS DISTINCT FROM 'pending' THEN 'status' END,
        CASE WHEN p_row.attempts IS DISTINCT FROM 0 THEN 'attempts' END,
        CASE WHEN p_row.last_error IS NOT NULL THEN 'last_error' END,
        CASE WHEN p_row.published_at IS NOT NULL THEN 'published_at' END,
        CASE WHEN p_row.stream_id IS NOT NULL THEN 'stream_id' END);
    PERFORM outpost_event_refuse('outpost_event_owned_columns_check', 'txid',
        format('txid names the writing transaction, which only Outpost''s own statements may '
               'write; this row sets %s: leave these columns out, the database fills them in',
               v_given),
        'leave id, aggregate_seq, partition, txid, status, attempts, next_attempt_at, '
        'recorded_at, last_error, published_at and stream_id out of the INSERT: the '
        'database fills them in');
END
$$;

"#,
    trigger_function!(),
    r#"
-- The trigger is skipped only for rows that Outpost's own statements write (they set
-- outpost.filled_by_outpost), and that carry their transaction's id. The setting is read only
-- for such rows: for any other the first comparison decides.
DROP TRIGGER outpost_event_before_insert ON outpost_event;
CREATE TRIGGER outpost_event_before_insert BEFORE INSERT ON outpost_event
    FOR EACH ROW WHEN (NEW.txid IS DISTINCT FROM txid_current()
                       OR current_setting('outpost.filled_by_outpost', true)
                          IS DISTINCT FROM 'on')
    EXECUTE FUNCTION outpost_event_before_insert();

-- Outpost's statements that write their own columns turn outpost.filled_by_outpost on before
-- their first row (set_config, local to the transaction); this turns it off again when such a
-- statement ends, so it covers that statement's rows and nothing written after it. The WHEN
-- clause keeps every other INSERT from running the function.
CREATE FUNCTION outpost_event_filled_reset() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('outpost.filled_by_outpost', 'off', true);
    RETURN NULL;
END
$$;
CREATE TRIGGER outpost_event_filled_reset AFTER INSERT ON outpost_event
    FOR EACH STATEMENT WHEN (current_setting('outpost.filled_by_outpost', true) = 'on')
    EXECUTE FUNCTION outpost_event_filled_reset();

-- The claim's indexes: pending rows in id order, and waiting retries by when they are due.
CREATE INDEX outpost_event_pending ON outpost_event (partition, id) WHERE status = 'pending';
CREATE INDEX outpost_event_retry_due ON outpost_event (partition, next_attempt_at)
    WHERE status = 'retry_wait';
DROP INDEX outpost_event_ready;
"#
);

const DOWN: &str = concat!(
    r#"
CREATE INDEX outpost_event_ready ON outpost_event (partition, id)
    WHERE status IN ('pending', 'retry_wait');
DROP INDEX outpost_event_retry_due;
DROP INDEX outpost_event_pending;
DROP TRIGGER outpost_event_filled_reset ON outpost_event;
DROP FUNCTION outpost_event_filled_reset();
DROP TRIGGER outpost_event_before_insert ON outpost_event;
CREATE TRIGGER outpost_event_before_insert BEFORE INSERT ON outpost_event
    FOR EACH ROW WHEN (NEW.txid IS DISTINCT FROM txid_current())
    EXECUTE FUNCTION outpost_event_before_insert();
"#,
    insert_fixes_function!(),
    r#"DROP FUNCTION outpost_event_refuse_owned(outpost_event);
"#
);
