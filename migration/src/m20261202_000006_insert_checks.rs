//! Moves the outbox's row rules from CHECK constraints into the insert trigger.
//!
//! PostgreSQL prepares every CHECK constraint of a table anew for each statement that writes it:
//! it reads the stored expression back from text and plans it, and the headers rule called a SQL
//! function whose body was parsed and analysed again each time. For the one-row `INSERT` of an
//! application's transaction and the relay's marks (an `UPDATE` checks every constraint too)
//! that cost more than the insert itself: 16 writers of one-event transactions reached about
//! 3,300 commits/s with the constraints and about 9,000 with the same rules in the trigger
//! (`pgbench`, 2-vCPU VM, 2026-12-02). PL/pgSQL compiles the trigger once per session.
//!
//! The rules and the names producers see are unchanged: a violation is SQLSTATE 23514
//! (`check_violation`) naming the same constraint, now with a message that says which value was
//! wrong and how to fix it. A missing identity field is 23502 (`not_null_violation`) naming the
//! column, as before. The rules apply when a row is inserted; the relay's own updates never
//! change the fields they cover. The status rule stays a CHECK: it guards every write, and one
//! small constraint costs little.
//!
//! `down` restores the constraints and the earlier trigger, as `m20261201_000001_outbox`
//! created them.

use sea_orm_migration::prelude::*;

sql_migration!();

/// The trigger's part that both versions share: the sequence under the aggregate's row lock and
/// the columns the database fills in (as `m20261201_000001_outbox` wrote it).
macro_rules! assign_sequence {
    () => {
        r#"
    UPDATE outpost_aggregate
       SET last_seq = last_seq + 1
     WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id
    RETURNING last_seq, partition, blocked_seq IS NOT NULL INTO v_seq, v_part, v_blocked;
    IF NOT FOUND THEN
        INSERT INTO outpost_aggregate AS a (aggregate_type, aggregate_id, last_seq, partition)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 1,
                outpost_partition_of(NEW.aggregate_type, NEW.aggregate_id,
                                     (SELECT partition_count FROM outpost_meta)))
        ON CONFLICT (aggregate_type, aggregate_id)
            DO UPDATE SET last_seq = a.last_seq + 1
        RETURNING last_seq, partition, blocked_seq IS NOT NULL INTO v_seq, v_part, v_blocked;
    END IF;
    NEW.id := nextval('outpost_event_id_seq');
    NEW.aggregate_seq := v_seq;
    NEW.partition := v_part;
    NEW.txid := txid_current(); -- pg_current_xact_id() as a bigint
    NEW.recorded_at := clock_timestamp();
    NEW.status := CASE WHEN v_blocked THEN 'held' ELSE 'pending' END;
    NEW.attempts := 0;
    NEW.next_attempt_at := now();
    NEW.last_error := NULL;
    NEW.published_at := NULL;
    NEW.stream_id := NULL;
    RETURN NEW;
END
$$;
"#
    };
}
pub(crate) use assign_sequence;

/// The rules every inserted row must keep, as PL/pgSQL statements on `NEW` that raise the error
/// of the rule a row breaks. They need a `v_column text` variable.
macro_rules! row_rules {
    () => {
        r#"    -- Identity first: the sequence below is keyed by it.
    v_column := CASE WHEN NEW.aggregate_type IS NULL THEN 'aggregate_type'
                     WHEN NEW.aggregate_id IS NULL THEN 'aggregate_id'
                     WHEN NEW.event_type IS NULL THEN 'event_type' END;
    IF v_column IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'not_null_violation',
            MESSAGE = format('null value in column "%s" of relation "outpost_event" violates '
                             'not-null constraint', v_column),
            HINT = 'every event needs aggregate_type, aggregate_id and event_type',
            TABLE = 'outpost_event',
            COLUMN = v_column;
    END IF;
    IF length(NEW.aggregate_type) NOT BETWEEN 1 AND 255 OR btrim(NEW.aggregate_type) = ''
       OR NEW.aggregate_type ~ '[[:cntrl:]]' THEN
        PERFORM outpost_event_refuse('outpost_event_aggregate_type_check', 'aggregate_type',
            format('aggregate_type %s is empty, blank, longer than 255 characters or contains a '
                   'control character', left(to_json(NEW.aggregate_type)::text, 80)),
            'use a short name such as ''order''');
    END IF;
    IF length(NEW.aggregate_id) NOT BETWEEN 1 AND 512 OR btrim(NEW.aggregate_id) = '' THEN
        PERFORM outpost_event_refuse('outpost_event_aggregate_id_check', 'aggregate_id',
            format('aggregate_id %s is empty, blank or longer than 512 characters',
                   left(to_json(NEW.aggregate_id)::text, 80)),
            'use the key of the record the event is about');
    END IF;
    IF length(NEW.event_type) NOT BETWEEN 1 AND 255 OR btrim(NEW.event_type) = ''
       OR NEW.event_type ~ '[[:cntrl:]]' THEN
        PERFORM outpost_event_refuse('outpost_event_event_type_check', 'event_type',
            format('event_type %s is empty, blank, longer than 255 characters or contains a '
                   'control character', left(to_json(NEW.event_type)::text, 80)),
            'use a short name such as ''order.paid''');
    END IF;
    IF NEW.schema_version !~ '^(0|[1-9][0-9]{0,8})(\.(0|[1-9][0-9]{0,8})){0,2}$' THEN
        PERFORM outpost_event_refuse('outpost_event_schema_version_check', 'schema_version',
            format('schema_version %s is not MAJOR[.MINOR[.PATCH]]',
                   left(to_json(NEW.schema_version)::text, 80)),
            'write it like 1, 2.1 or 2.1.3 (numbers without leading zeros)');
    END IF;
    IF pg_column_size(NEW.payload) > 1048576 THEN
        PERFORM outpost_event_refuse('outpost_event_payload_size_check', 'payload',
            format('payload takes %s bytes stored, over the limit of 1048576',
                   pg_column_size(NEW.payload)),
            'store large content elsewhere and put its reference in the event');
    END IF;
    IF NEW.headers <> '{}'::jsonb AND (
           pg_column_size(NEW.headers) > 65536
        OR jsonb_typeof(NEW.headers) <> 'object'
        OR EXISTS (SELECT 1 FROM jsonb_each(NEW.headers) AS h(k, v)
                   WHERE jsonb_typeof(h.v) <> 'string' OR h.k = '' OR length(h.k) > 256)) THEN
        PERFORM outpost_event_refuse('outpost_event_headers_check', 'headers',
            format('headers %s are not a JSON object of strings with names of 1 to 256 '
                   'characters, or take over 65536 bytes', left(NEW.headers::text, 80)),
            'write headers like {"traceparent": "00-...", "tenant": "acme"}');
    END IF;
    IF length(NEW.destination) NOT BETWEEN 1 AND 512 OR NEW.destination ~ '[[:cntrl:]]' THEN
        PERFORM outpost_event_refuse('outpost_event_destination_check', 'destination',
            format('destination %s is empty, longer than 512 characters or contains a control '
                   'character', left(to_json(NEW.destination)::text, 80)),
            'leave destination NULL to use the routing rules');
    END IF;
"#
    };
}
pub(crate) use row_rules;

/// The insert trigger's function as this migration creates it (`m20261202_000007_lean_insert`
/// restores it on `down`).
macro_rules! rules_trigger {
    () => {
        concat!(
            r#"CREATE OR REPLACE FUNCTION outpost_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_seq     bigint;
    v_part    integer;
    v_blocked boolean;
    v_column  text;
BEGIN
"#,
            $crate::m20261202_000006_insert_checks::row_rules!(),
            "\n",
            $crate::m20261202_000006_insert_checks::assign_sequence!()
        )
    };
}
pub(crate) use rules_trigger;

const UP: &str = concat!(
    r#"
-- Refuses a row that breaks one of the outbox's rules, the way a CHECK constraint would.
CREATE FUNCTION outpost_event_refuse(p_constraint text, p_column text, p_message text,
                                     p_hint text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'check_violation',
        MESSAGE = format('new row for relation "outpost_event" violates check constraint "%s": %s',
                         p_constraint, p_message),
        HINT = p_hint,
        CONSTRAINT = p_constraint,
        TABLE = 'outpost_event',
        COLUMN = p_column;
END
$$;

"#,
    rules_trigger!(),
    r#"
ALTER TABLE outpost_event
    DROP CONSTRAINT outpost_event_aggregate_type_check,
    DROP CONSTRAINT outpost_event_aggregate_id_check,
    DROP CONSTRAINT outpost_event_event_type_check,
    DROP CONSTRAINT outpost_event_schema_version_check,
    DROP CONSTRAINT outpost_event_payload_size_check,
    DROP CONSTRAINT outpost_event_headers_check,
    DROP CONSTRAINT outpost_event_destination_check;
DROP FUNCTION outpost_headers_valid(jsonb);
"#
);

const DOWN: &str = concat!(
    r#"
CREATE FUNCTION outpost_headers_valid(p_headers jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT jsonb_typeof(p_headers) = 'object'
       AND NOT EXISTS (SELECT 1 FROM jsonb_each(p_headers) AS h(k, v)
                       WHERE jsonb_typeof(h.v) <> 'string' OR h.k = '' OR length(h.k) > 256)
$$;

ALTER TABLE outpost_event
    ADD CONSTRAINT outpost_event_aggregate_type_check
        CHECK (length(aggregate_type) BETWEEN 1 AND 255 AND btrim(aggregate_type) <> ''
               AND aggregate_type !~ '[[:cntrl:]]'),
    ADD CONSTRAINT outpost_event_aggregate_id_check
        CHECK (length(aggregate_id) BETWEEN 1 AND 512 AND btrim(aggregate_id) <> ''),
    ADD CONSTRAINT outpost_event_event_type_check
        CHECK (length(event_type) BETWEEN 1 AND 255 AND btrim(event_type) <> ''
               AND event_type !~ '[[:cntrl:]]'),
    ADD CONSTRAINT outpost_event_schema_version_check
        CHECK (schema_version ~ '^(0|[1-9][0-9]{0,8})(\.(0|[1-9][0-9]{0,8})){0,2}$'),
    ADD CONSTRAINT outpost_event_payload_size_check CHECK (pg_column_size(payload) <= 1048576),
    ADD CONSTRAINT outpost_event_headers_check
        CHECK (pg_column_size(headers) <= 65536 AND outpost_headers_valid(headers)),
    ADD CONSTRAINT outpost_event_destination_check
        CHECK (destination IS NULL OR (length(destination) BETWEEN 1 AND 512
               AND destination !~ '[[:cntrl:]]'));

CREATE OR REPLACE FUNCTION outpost_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_seq     bigint;
    v_part    integer;
    v_blocked boolean;
BEGIN
"#,
    assign_sequence!(),
    r#"
DROP FUNCTION IF EXISTS outpost_event_refuse(text, text, text, text);
"#
);
