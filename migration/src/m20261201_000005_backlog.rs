//! `outpost_backlog`: the cluster's backlog figures, counted by one node at a time.
//!
//! Counting rows by state scans the outbox. Every node reports the figures as metrics; instead of
//! each node scanning every 15 s, the first node to find the figures stale claims the refresh
//! (by moving `counted_at` forward) and writes them here, and the others read this one row.
//! `oldest_at` is the `recorded_at` of the oldest undelivered row, so its age is computed when
//! read.

use sea_orm_migration::prelude::*;

sql_migration!();

const UP: &str = r#"
CREATE TABLE outpost_backlog (
    singleton   boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    counted_at  timestamptz NOT NULL DEFAULT '-infinity',
    by_status   jsonb       NOT NULL DEFAULT '{}',
    oldest_at   timestamptz
);
INSERT INTO outpost_backlog DEFAULT VALUES;
"#;

const DOWN: &str = r#"
DROP TABLE IF EXISTS outpost_backlog;
"#;
