//! `outpost_stream_position`: for every stream and partition, the newest entry that partition's
//! owner appended to that stream and recorded as published.
//!
//! A Redis that comes back with only its last writes lost (restored from an RDB snapshot, an
//! AOF `everysec` tail lost in a crash, a replica promoted while it lagged) keeps its fences,
//! so a missing fence cannot tell. Each fence hash therefore also records, per partition, the
//! newest entry that partition appended (`<partition>:last`, written by the publish script in
//! the same step as the entries, so a snapshot holds both or neither). A fence behind the
//! position recorded here means the entries after it were lost. The mark that moves rows to the
//! history updates the row in the same statement, so the position never runs ahead of what the
//! history holds, and only the partition's owner at its epoch writes it.
//!
//! `down` drops the table.

use sea_orm_migration::prelude::*;

sql_migration!();

const UP: &str = r#"
CREATE TABLE outpost_stream_position (
    stream     text        NOT NULL,
    partition  integer     NOT NULL,
    last_ms    bigint      NOT NULL,
    last_seq   bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outpost_stream_position_pkey PRIMARY KEY (partition, stream)
);
"#;

const DOWN: &str = r#"
DROP TABLE IF EXISTS outpost_stream_position;
"#;
