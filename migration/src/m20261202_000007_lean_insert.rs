//! Makes the insert trigger cheaper, and moves the wake-up nudge into it.
//!
//! PL/pgSQL prepares each expression of a function once per transaction and runs each SQL
//! statement through the executor, so for an application's one-event transaction the trigger's
//! cost was its count of expressions and statements more than the work they do. The trigger of
//! `m20261202_000006_insert_checks` had about twenty expressions (one per rule, one per filled-in
//! column) and the statement-level nudge trigger a query of its own plus a transition table.
//! Now:
//!
//! - the rules are one test, true for every row that keeps them; only a row that fails it calls
//!   `outpost_event_check_rules`, which runs the rules one by one and raises the error of the
//!   rule the row breaks (the same SQLSTATE, constraint name, message and hint as before);
//! - every column the database fills in is assigned by the `RETURNING … INTO` of the aggregate's
//!   sequence update, after the aggregate's row lock is taken (so the id is still drawn under the
//!   lock);
//! - the same `RETURNING` reads whether a node asked for nudges, and the row trigger sends
//!   `NOTIFY outpost_wakeup` with its partition as the payload; the statement trigger is gone.
//!   PostgreSQL folds identical notifications of one transaction into one.
//!
//! `pgbench`, 16 clients, one-row `INSERT` per transaction, CPU time of the whole machine per
//! transaction (2-vCPU VM, 2026-12-02, alternating runs): the tables and triggers of `000006`
//! 236–257 µs, these 211–234 µs, a plain copy of the table without triggers 155–163 µs.
//!
//! `down` restores the trigger of `000006` and the nudge trigger of `000001`.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::ConnectionTrait;

use crate::m20261201_000001_outbox::nudge_trigger;
use crate::m20261202_000006_insert_checks::{row_rules, rules_trigger};
use crate::require_postgres;

#[derive(Debug, DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        require_postgres(manager)?;
        manager.get_connection().execute_unprepared(UP).await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        require_postgres(manager)?;
        manager.get_connection().execute_unprepared(DOWN).await?;
        Ok(())
    }
}

/// What the sequence update (or the first event's insert) of the aggregate row returns, and where
/// the trigger puts it.
macro_rules! returning_into {
    () => {
        r#"
    RETURNING nextval('outpost_event_id_seq'), last_seq, partition,
              CASE WHEN blocked_seq IS NULL THEN 'pending' ELSE 'held' END,
              txid_current(), -- pg_current_xact_id() as a bigint
              clock_timestamp(), now(), 0, NULL::text, NULL::timestamptz, NULL::text,
              EXISTS (SELECT FROM outpost_node WHERE wants_nudge)
         INTO NEW.id, NEW.aggregate_seq, NEW.partition, NEW.status, NEW.txid, NEW.recorded_at,
              NEW.next_attempt_at, NEW.attempts, NEW.last_error, NEW.published_at, NEW.stream_id,
              v_nudge;"#
    };
}

const UP: &str = concat!(
    r#"
-- The row rules one by one, raising the error of the rule a row breaks. The insert trigger calls
-- it only for a row that fails its single test of all the rules.
CREATE FUNCTION outpost_event_check_rules(new outpost_event) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_column text;
BEGIN
"#,
    row_rules!(),
    r#"END
$$;

CREATE OR REPLACE FUNCTION outpost_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_nudge boolean;
BEGIN
    -- True exactly when the row keeps every rule of outpost_event_check_rules.
    IF (length(NEW.aggregate_type) BETWEEN 1 AND 255 AND btrim(NEW.aggregate_type) <> ''
        AND length(NEW.aggregate_id) BETWEEN 1 AND 512 AND btrim(NEW.aggregate_id) <> ''
        AND length(NEW.event_type) BETWEEN 1 AND 255 AND btrim(NEW.event_type) <> ''
        AND (NEW.aggregate_type || NEW.event_type) !~ '[[:cntrl:]]'
        AND (NEW.schema_version = '1'
             OR NEW.schema_version ~ '^(0|[1-9][0-9]{0,8})(\.(0|[1-9][0-9]{0,8})){0,2}$')
        AND pg_column_size(NEW.payload) <= 1048576
        AND (NEW.headers = '{}'::jsonb
             OR (pg_column_size(NEW.headers) <= 65536 AND jsonb_typeof(NEW.headers) = 'object'
                 -- a member whose value is not a string, or whose name is empty or longer
                 -- than 256 characters (a jsonpath repetition count stops at 255)
                 AND NOT jsonb_path_exists(NEW.headers,
                     '$.keyvalue() ? (@.value.type() != "string" || @.key == ""
                                      || @.key like_regex "^.{200}.{57}" flag "s")')))
        AND (NEW.destination IS NULL
             OR (length(NEW.destination) BETWEEN 1 AND 512
                 AND NEW.destination !~ '[[:cntrl:]]'))
       ) IS NOT TRUE THEN
        PERFORM outpost_event_check_rules(NEW);
    END IF;

    -- The sequence, under the aggregate's row lock kept until commit: writers of one aggregate
    -- are serialised, writers of different aggregates never wait on each other.
    UPDATE outpost_aggregate
       SET last_seq = last_seq + 1
     WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id"#,
    returning_into!(),
    r#"
    IF NOT FOUND THEN
        INSERT INTO outpost_aggregate AS a (aggregate_type, aggregate_id, last_seq, partition)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 1,
                outpost_partition_of(NEW.aggregate_type, NEW.aggregate_id,
                                     (SELECT partition_count FROM outpost_meta)))
        ON CONFLICT (aggregate_type, aggregate_id)
            DO UPDATE SET last_seq = a.last_seq + 1"#,
    returning_into!(),
    r#"
    END IF;
    -- The nudge, only while some node asked for it; sent at commit, once per partition.
    IF v_nudge THEN
        PERFORM pg_notify('outpost_wakeup', NEW.partition::text);
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER outpost_event_nudge ON outpost_event;
DROP FUNCTION outpost_event_nudge();
"#
);

const DOWN: &str = concat!(
    rules_trigger!(),
    "\n",
    nudge_trigger!(),
    "DROP FUNCTION outpost_event_check_rules(outpost_event);\n"
);
