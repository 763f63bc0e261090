//! Three defects of the insert trigger, fixed where the row is written:
//!
//! - **An idempotent insert left a hole in the sequence.** `INSERT … ON CONFLICT (event_id) DO
//!   NOTHING` runs the BEFORE trigger before the conflict is found, so the skipped row had
//!   already advanced its aggregate's `last_seq`; the next event got the number after the
//!   skipped one, and a consumer in strict order waited for the missing number forever. Now the
//!   trigger looks for the event id in the outbox after it holds the aggregate's row lock, and a
//!   row whose id is there gives its number back. The look is a new statement, so under READ
//!   COMMITTED it sees a concurrent insert of the same event that committed while this one
//!   waited for the lock (and under REPEATABLE READ the second writer fails to serialise
//!   instead). An id found only in `outpost_published` is not a conflict of the outbox's unique
//!   key: such a row is still inserted as a new event, as before.
//! - **A node killed while idle kept asking for nudges.** `wants_nudge` stayed true after its
//!   node died, and every producer commit then sent a `NOTIFY` (capping producers near 3,000
//!   commits/s here, and failing `PREPARE TRANSACTION` for two-phase-commit producers). The
//!   request now lasts only as long as the node's heartbeat: `nudge_until` is moved forward by
//!   each heartbeat (by `node.ttl`), and the trigger and the producer API's statement for many
//!   events nudge only for a node whose `nudge_until` is ahead. Nodes registered when the
//!   migration runs get an hour after their last heartbeat, so nodes of the version before,
//!   which do not move `nudge_until`, keep being nudged while they are replaced.
//! - **A time no stream entry can carry stopped a group of partitions.** `occurred_at =
//!   'infinity'` (what some drivers send for a "maximum" date) or a year past 9999 passed every
//!   rule and then failed to decode in the relay's claim. The rules now refuse a time outside
//!   the years 1 to 9999 (`outpost_event_occurred_at_check`, SQLSTATE 23514, like the other row
//!   rules).
//!
//! `down` restores the trigger function of `m20261205_000009_nudge_opt_out` and drops the
//! column and the function.

use sea_orm_migration::prelude::*;

use crate::m20261202_000007_lean_insert::before_insert_function;

sql_migration!();

/// The insert trigger's function as this migration writes it (`m20261206_000012_owned_columns`
/// restores it on `down`).
macro_rules! insert_fixes_function {
    () => {
        r#"CREATE OR REPLACE FUNCTION outpost_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_nudge boolean;
BEGIN
    IF outpost_event_row_ok(NEW.aggregate_type, NEW.aggregate_id, NEW.event_type,
                            NEW.schema_version, NEW.payload, NEW.headers, NEW.destination)
       IS NOT TRUE THEN
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
pub(crate) use insert_fixes_function;

const UP: &str = concat!(
    r#"
ALTER TABLE outpost_node ADD COLUMN nudge_until timestamptz NOT NULL DEFAULT '-infinity';
-- Nodes of the version before keep asking without moving nudge_until: their requests are good
-- for an hour after their last heartbeat, time enough to replace them with this version.
UPDATE outpost_node SET nudge_until = heartbeat_at + interval '1 hour';

-- Raises the error of the time rule for a time outside the years 1 to 9999 (true otherwise).
CREATE FUNCTION outpost_event_check_time(p_occurred_at timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_occurred_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00' THEN
        RETURN true;
    END IF;
    PERFORM outpost_event_refuse('outpost_event_occurred_at_check', 'occurred_at',
        format('occurred_at %s is not a time between the years 1 and 9999', p_occurred_at),
        'send when the fact happened (now() when in doubt); infinity and far dates cannot be '
        'written into a stream entry');
    RETURN false;
END
$$;

"#,
    insert_fixes_function!()
);

const DOWN: &str = concat!(
    before_insert_function!(
        "v_nudge AND coalesce(lower(current_setting('outpost.nudge', true)), '')
           NOT IN ('off', 'false', 'no', '0')"
    ),
    r#"
DROP FUNCTION outpost_event_check_time(timestamptz);
ALTER TABLE outpost_node DROP COLUMN nudge_until;
"#
);
