//! The consumer inbox is keyed by aggregate as well as by event id.
//!
//! Before, `outpost_inbox` was keyed by `(consumer_group, event_id)` only: an event of aggregate
//! B whose id an event of aggregate A had used already (a producer's bug, a database restored
//! next to another, an entry written to the stream by someone else) was acknowledged as a
//! duplicate without being applied — and in strict order, B's later events then waited behind a
//! gap that never filled. The helper now records `(consumer_group, event_id, aggregate_type,
//! aggregate_id)` and looks an event up in its own aggregate.
//!
//! Rows written before this migration do not know their aggregate: they get an empty aggregate
//! type and id (a real event never has either empty) and the helper treats them as they were
//! treated when written — a match for the event id in any aggregate. The primary key is rebuilt,
//! which rewrites the inbox's index once.

use sea_orm_migration::prelude::*;

sql_migration!();

const UP: &str = r#"
ALTER TABLE outpost_inbox
    ADD COLUMN aggregate_type text NOT NULL DEFAULT '',
    ADD COLUMN aggregate_id   text NOT NULL DEFAULT '';
ALTER TABLE outpost_inbox
    ALTER COLUMN aggregate_type DROP DEFAULT,
    ALTER COLUMN aggregate_id DROP DEFAULT,
    DROP CONSTRAINT outpost_inbox_pkey,
    ADD CONSTRAINT outpost_inbox_pkey
        PRIMARY KEY (consumer_group, event_id, aggregate_type, aggregate_id);
"#;

const DOWN: &str = r#"
-- Back to one row per event id and group: of the aggregates that share an id, one row stays.
DELETE FROM outpost_inbox a
USING outpost_inbox b
WHERE a.consumer_group = b.consumer_group
  AND a.event_id = b.event_id
  AND (a.aggregate_type, a.aggregate_id) > (b.aggregate_type, b.aggregate_id);
ALTER TABLE outpost_inbox
    DROP CONSTRAINT outpost_inbox_pkey,
    ADD CONSTRAINT outpost_inbox_pkey PRIMARY KEY (consumer_group, event_id),
    DROP COLUMN aggregate_type,
    DROP COLUMN aggregate_id;
"#;
