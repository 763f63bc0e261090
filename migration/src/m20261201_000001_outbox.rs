//! The outbox: event facts, per-aggregate sequences, partition leases, nodes, audit log, inbox.
//!
//! Producers in any language only `INSERT INTO outpost_event`; the triggers below fill in the
//! aggregate sequence (under a per-aggregate row lock, so it is gap-free and in commit order), the
//! partition, the writing transaction id, the delivery state and the wake-up nudge.

use sea_orm_migration::prelude::*;

use crate::execute_postgres;

/// Number of partitions created by this migration. Fixed for the life of a database: the
/// partition of an aggregate is computed once, when its first event is written.
const PARTITIONS: i32 = 64;

#[derive(Debug, DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        execute_postgres(
            manager,
            &UP.replace("{PARTITIONS}", &PARTITIONS.to_string()),
        )
        .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        execute_postgres(manager, DOWN).await
    }
}

/// The wake-up nudge as this migration created it (`m20261202_000007_lean_insert` replaces it
/// and restores it on `down`).
macro_rules! nudge_trigger {
    () => {
        r#"-- The nudge: one NOTIFY per inserting statement, only while some node asked for it. The payload
-- lists the partitions the statement wrote to, so a node wakes only those.
CREATE FUNCTION outpost_event_nudge() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outpost_node WHERE wants_nudge) THEN
        PERFORM pg_notify('outpost_wakeup',
                          (SELECT string_agg(DISTINCT partition::text, ',') FROM outpost_new_rows));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER outpost_event_nudge AFTER INSERT ON outpost_event
    REFERENCING NEW TABLE AS outpost_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outpost_event_nudge();

"#
    };
}
pub(crate) use nudge_trigger;

const UP: &str = concat!(
    r#"
CREATE TABLE outpost_meta (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    partition_count integer NOT NULL CHECK (partition_count BETWEEN 1 AND 4096)
);
INSERT INTO outpost_meta (partition_count) VALUES ({PARTITIONS});

-- Stable partition of an aggregate key: the first 32 bits of md5(len(type) ':' type aggregate_id)
-- as an unsigned number, modulo the partition count. Documented in docs/contract.md so that any
-- backend or language computes the same value.
CREATE FUNCTION outpost_partition_of(p_type text, p_id text, p_count integer) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT (('x' || substr(md5(length(p_type)::text || ':' || p_type || p_id), 1, 8))::bit(32)::bigint
            % p_count)::integer
$$;

CREATE FUNCTION outpost_headers_valid(p_headers jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT jsonb_typeof(p_headers) = 'object'
       AND NOT EXISTS (SELECT 1 FROM jsonb_each(p_headers) AS h(k, v)
                       WHERE jsonb_typeof(h.v) <> 'string' OR h.k = '' OR length(h.k) > 256)
$$;

-- One row per aggregate: the last sequence handed out, its partition, and the sequence of the
-- event that currently holds the aggregate back (waiting for a retry, or quarantined).
CREATE TABLE outpost_aggregate (
    aggregate_type text    NOT NULL,
    aggregate_id   text    NOT NULL,
    last_seq       bigint  NOT NULL,
    partition      integer NOT NULL,
    blocked_seq    bigint,
    PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor = 70); -- room for HOT updates of last_seq
CREATE INDEX outpost_aggregate_blocked ON outpost_aggregate (partition) WHERE blocked_seq IS NOT NULL;

CREATE SEQUENCE outpost_event_id_seq AS bigint;

CREATE TABLE outpost_event (
    id                bigint      NOT NULL,
    event_id          uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_seq     bigint      NOT NULL,
    aggregate_version bigint,
    event_type        text        NOT NULL,
    schema_version    text        NOT NULL DEFAULT '1',
    occurred_at       timestamptz NOT NULL DEFAULT now(),
    recorded_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    payload           jsonb       NOT NULL,
    headers           jsonb       NOT NULL DEFAULT '{}'::jsonb,
    destination       text,
    partition         integer     NOT NULL,
    txid              bigint      NOT NULL,
    status            text        NOT NULL DEFAULT 'pending',
    attempts          integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_error        text,
    published_at      timestamptz,
    stream_id         text,
    CONSTRAINT outpost_event_pkey PRIMARY KEY (id),
    CONSTRAINT outpost_event_event_id_key UNIQUE (event_id),
    CONSTRAINT outpost_event_aggregate_seq_key UNIQUE (aggregate_type, aggregate_id, aggregate_seq),
    CONSTRAINT outpost_event_aggregate_type_check
        CHECK (length(aggregate_type) BETWEEN 1 AND 255 AND btrim(aggregate_type) <> ''
               AND aggregate_type !~ '[[:cntrl:]]'),
    CONSTRAINT outpost_event_aggregate_id_check
        CHECK (length(aggregate_id) BETWEEN 1 AND 512 AND btrim(aggregate_id) <> ''),
    CONSTRAINT outpost_event_event_type_check
        CHECK (length(event_type) BETWEEN 1 AND 255 AND btrim(event_type) <> ''
               AND event_type !~ '[[:cntrl:]]'),
    CONSTRAINT outpost_event_schema_version_check
        CHECK (schema_version ~ '^(0|[1-9][0-9]{0,8})(\.(0|[1-9][0-9]{0,8})){0,2}$'),
    CONSTRAINT outpost_event_payload_size_check CHECK (pg_column_size(payload) <= 1048576),
    CONSTRAINT outpost_event_headers_check
        CHECK (pg_column_size(headers) <= 65536 AND outpost_headers_valid(headers)),
    CONSTRAINT outpost_event_destination_check
        CHECK (destination IS NULL OR (length(destination) BETWEEN 1 AND 512
               AND destination !~ '[[:cntrl:]]')),
    CONSTRAINT outpost_event_status_check
        CHECK (status IN ('pending', 'retry_wait', 'held', 'published', 'quarantined',
                          'discarded', 'no_destination'))
);
ALTER SEQUENCE outpost_event_id_seq OWNED BY outpost_event.id;

-- The claim path: ready rows of one partition in id order (within an aggregate, id order is
-- sequence order because the id is drawn after the aggregate's lock is taken).
CREATE INDEX outpost_event_ready ON outpost_event (partition, id)
    WHERE status IN ('pending', 'retry_wait');
-- Retention deletes and "published in the last N minutes" figures.
CREATE INDEX outpost_event_published ON outpost_event (published_at) WHERE status = 'published';
-- Operators' lists: quarantined, held and no-destination rows.
CREATE INDEX outpost_event_parked ON outpost_event (status, id)
    WHERE status IN ('held', 'quarantined', 'discarded', 'no_destination');

-- Fills in everything a producer does not: sequence, partition, id, transaction id and the
-- initial delivery state. Runs under the aggregate's row lock, which it keeps until commit, so
-- writers of one aggregate are serialised and writers of different aggregates never wait on each
-- other.
CREATE FUNCTION outpost_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_seq     bigint;
    v_part    integer;
    v_blocked boolean;
BEGIN
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

CREATE TRIGGER outpost_event_before_insert BEFORE INSERT ON outpost_event
    FOR EACH ROW EXECUTE FUNCTION outpost_event_before_insert();

-- Nodes of the relay cluster. `wants_nudge` is set by a node that has found no work for a while:
-- only then do producers pay for a NOTIFY. A busy node polls instead.
CREATE TABLE outpost_node (
    node_id      text        PRIMARY KEY,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    wants_nudge  boolean     NOT NULL DEFAULT false,
    version      text        NOT NULL DEFAULT '',
    hostname     text        NOT NULL DEFAULT '',
    pid          integer     NOT NULL DEFAULT 0
);

"#,
    nudge_trigger!(),
    r#"-- Partition leases. `epoch` is the fencing token: every acquisition bumps it, and every mark and
-- publish is checked against it.
CREATE TABLE outpost_partition (
    partition   integer     PRIMARY KEY,
    owner       text,
    epoch       bigint      NOT NULL DEFAULT 0,
    lease_until timestamptz,
    paused      boolean     NOT NULL DEFAULT false,
    paused_at   timestamptz,
    paused_by   text
);
INSERT INTO outpost_partition (partition) SELECT g FROM generate_series(0, {PARTITIONS} - 1) AS g;

-- Every mutating admin action, written in the same transaction as the action.
CREATE TABLE outpost_audit (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL,
    role    text        NOT NULL,
    action  text        NOT NULL,
    target  text        NOT NULL DEFAULT '',
    detail  jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX outpost_audit_at ON outpost_audit (at);

-- Consumer inbox: event ids processed per consumer group, written in the consumer's own
-- transaction so an event's effect is applied once.
CREATE TABLE outpost_inbox (
    consumer_group text        NOT NULL,
    event_id       uuid        NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id)
);
CREATE INDEX outpost_inbox_processed_at ON outpost_inbox (processed_at);
"#
);

const DOWN: &str = r#"
DROP TABLE IF EXISTS outpost_inbox;
DROP TABLE IF EXISTS outpost_audit;
DROP TABLE IF EXISTS outpost_partition;
DROP TABLE IF EXISTS outpost_event;
DROP TABLE IF EXISTS outpost_node;
DROP TABLE IF EXISTS outpost_aggregate;
DROP TABLE IF EXISTS outpost_meta;
DROP FUNCTION IF EXISTS outpost_event_nudge();
DROP FUNCTION IF EXISTS outpost_event_before_insert();
DROP FUNCTION IF EXISTS outpost_headers_valid(jsonb);
DROP FUNCTION IF EXISTS outpost_partition_of(text, text, integer);
"#;
