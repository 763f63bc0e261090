//! Consumer-side tables: where each consumer group stands in each aggregate, and what became of
//! each event it processed.
//!
//! These live in the consumer's own database (the helper writes them in the handler's
//! transaction), which may or may not be the database that holds the outbox.

use sea_orm_migration::prelude::*;

sql_migration!();

const UP: &str = r#"
-- The last sequence a consumer group applied (or dead-lettered) per aggregate. The helper locks
-- this row before running a handler, so two members of a group never apply the same aggregate at
-- once, and it applies only the next sequence.
CREATE TABLE outpost_consumer_position (
    consumer_group text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    last_seq       bigint      NOT NULL DEFAULT 0 CHECK (last_seq >= 0),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, aggregate_type, aggregate_id)
) WITH (fillfactor = 70);

-- What became of a processed event: applied by the handler, or sent to the dead-letter stream.
ALTER TABLE outpost_inbox
    ADD COLUMN outcome text NOT NULL DEFAULT 'applied'
        CHECK (outcome IN ('applied', 'dead_lettered'));
"#;

const DOWN: &str = r#"
ALTER TABLE outpost_inbox DROP COLUMN IF EXISTS outcome;
DROP TABLE IF EXISTS outpost_consumer_position;
"#;
