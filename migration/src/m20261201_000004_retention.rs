//! Retention and Redis bookkeeping.
//!
//! - `outpost_event_aged`: the janitor ages `no_destination` and `discarded` rows out by
//!   `recorded_at` (the published ones use `outpost_event_published`, created with the outbox).
//! - `outpost_stream`: every stream Outpost has appended to, with the newest entry id a node saw
//!   acknowledged and the incarnation of Redis it belongs to. Written from memory once per
//!   heartbeat while a node publishes (never per batch); read to detect a Redis that lost data.
//! - `outpost_redis`: the Redis Outpost publishes to: the `run_id` last recorded, and the
//!   incarnation, bumped each time a data loss is recovered (its re-published window counted).

use sea_orm_migration::prelude::*;

sql_migration!();

const UP: &str = r#"
CREATE INDEX outpost_event_aged ON outpost_event (status, recorded_at)
    WHERE status IN ('no_destination', 'discarded');

CREATE TABLE outpost_redis (
    singleton    boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    run_id       text,
    incarnation  bigint      NOT NULL DEFAULT 0,
    seen_at      timestamptz NOT NULL DEFAULT now(),
    lost_at      timestamptz,
    republished  bigint      NOT NULL DEFAULT 0
);
INSERT INTO outpost_redis DEFAULT VALUES;

CREATE TABLE outpost_stream (
    stream        text        PRIMARY KEY,
    incarnation   bigint      NOT NULL DEFAULT 0,
    last_ms       bigint      NOT NULL DEFAULT 0,
    last_seq      bigint      NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
"#;

const DOWN: &str = r#"
DROP TABLE IF EXISTS outpost_stream;
DROP TABLE IF EXISTS outpost_redis;
DROP INDEX IF EXISTS outpost_event_aged;
"#;
