//! Makes the insert trigger cheaper, moves the wake-up nudge into it, and lets the producer API
//! write many events in one statement that does the trigger's work itself.
//!
//! PL/pgSQL prepares each expression of a function once per transaction and runs each SQL
//! statement through the executor, so for an application's one-event transaction the trigger's
//! cost was its count of expressions and statements more than the work they do. The trigger of
//! `m20261202_000006_insert_checks` had about twenty expressions (one per rule, one per filled-in
//! column) and the statement-level nudge trigger a query of its own plus a transition table.
//! Now:
//!
//! - the rules are one test, `outpost_event_row_ok` (a SQL function PostgreSQL inlines), true for
//!   every row that keeps them; only a row that fails it calls `outpost_event_check_rules`, which
//!   runs the rules one by one and raises the error of the rule the row breaks (the same
//!   SQLSTATE, constraint name, message and hint as before);
//! - every column the database fills in is assigned by the `RETURNING … INTO` of the aggregate's
//!   sequence update, after the aggregate's row lock is taken (so the id is still drawn under the
//!   lock);
//! - the same `RETURNING` reads whether a node asked for nudges, and the row trigger sends
//!   `NOTIFY outpost_wakeup` with its partition as the payload; the statement trigger is gone.
//!   PostgreSQL folds identical notifications of one transaction into one;
//! - the trigger runs unless a row comes with its own transaction's `txid`. The producer API
//!   writes several events with one statement that locks their aggregates in key order, draws
//!   the sequences and ids, checks the same rules with the two functions above, nudges, and
//!   writes `txid`; row by row, the trigger's statements cost it about a quarter more of
//!   PostgreSQL's time. A producer that leaves `txid` out, or names another transaction's, has
//!   every filled-in column set by the trigger as before; one that names its own transaction's
//!   and leaves `id`, `aggregate_seq` or `partition` out is refused by their NOT NULL
//!   constraints.
//!
//! `pgbench`, 16 clients, CPU time of the whole machine (2-vCPU VM, 2026-12-02, alternating runs):
//! one-row `INSERT` per transaction, the tables and triggers of `000006` 236–257 µs, this
//! trigger 190–234 µs, a plain copy of the table without triggers 137–163 µs per transaction;
//! 100-row statements written by PostgreSQL itself, the trigger 39–40 µs, the statement for many
//! events 30–31 µs, the plain copy 20 µs per event.
//!
//! `down` restores the trigger of `000006` and the nudge trigger of `000001`.

use sea_orm_migration::prelude::*;

use crate::m20261201_000001_outbox::nudge_trigger;
use crate::m20261202_000006_insert_checks::rules_trigger;

sql_migration!();

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
pub(crate) use returning_into;

/// The rules' arguments, as the trigger passes them.
macro_rules! rule_args {
    () => {
        "NEW.aggregate_type, NEW.aggregate_id, NEW.event_type, NEW.schema_version, NEW.payload,
             NEW.headers, NEW.destination"
    };
}
pub(crate) use rule_args;

/// The insert trigger's function, `CREATE OR REPLACE`d; `$nudge` is the condition under which it
/// sends the nudge (`v_nudge`: a node asked for nudges).
macro_rules! before_insert_function {
    ($nudge:literal) => {
        concat!(
            r#"CREATE OR REPLACE FUNCTION outpost_event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_nudge boolean;
BEGIN
    IF outpost_event_row_ok("#,
            $crate::m20261202_000007_lean_insert::rule_args!(),
            r#") IS NOT TRUE THEN
        PERFORM outpost_event_check_rules("#,
            $crate::m20261202_000007_lean_insert::rule_args!(),
            r#");
    END IF;

    -- The sequence, under the aggregate's row lock kept until commit: writers of one aggregate
    -- are serialised, writers of different aggregates never wait on each other.
    UPDATE outpost_aggregate
       SET last_seq = last_seq + 1
     WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id"#,
            $crate::m20261202_000007_lean_insert::returning_into!(),
            r#"
    IF NOT FOUND THEN
        INSERT INTO outpost_aggregate AS a (aggregate_type, aggregate_id, last_seq, partition)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 1,
                outpost_partition_of(NEW.aggregate_type, NEW.aggregate_id,
                                     (SELECT partition_count FROM outpost_meta)))
        ON CONFLICT (aggregate_type, aggregate_id)
            DO UPDATE SET last_seq = a.last_seq + 1"#,
            $crate::m20261202_000007_lean_insert::returning_into!(),
            r#"
    END IF;
    -- The nudge, only while some node asked for it; sent at commit, once per partition.
    IF "#,
            $nudge,
            r#" THEN
        PERFORM pg_notify('outpost_wakeup', NEW.partition::text);
    END IF;
    RETURN NEW;
END
$$;

"#
        )
    };
}
pub(crate) use before_insert_function;

/// The function of the rules' one test, as this migration creates it.
macro_rules! row_ok_function {
    () => {
        r#"CREATE FUNCTION outpost_event_row_ok(p_aggregate_type text, p_aggregate_id text,
                                     p_event_type text, p_schema_version text, p_payload jsonb,
                                     p_headers jsonb, p_destination text) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT length(p_aggregate_type) BETWEEN 1 AND 255 AND btrim(p_aggregate_type) <> ''
       AND length(p_aggregate_id) BETWEEN 1 AND 512 AND btrim(p_aggregate_id) <> ''
       AND length(p_event_type) BETWEEN 1 AND 255 AND btrim(p_event_type) <> ''
       AND (p_aggregate_type || p_event_type) !~ '[[:cntrl:]]'
       AND (p_schema_version = '1'
            OR p_schema_version ~ '^(0|[1-9][0-9]{0,8})(\.(0|[1-9][0-9]{0,8})){0,2}$')
       AND pg_column_size(p_payload) <= 1048576
       AND (p_headers = '{}'::jsonb
            OR (pg_column_size(p_headers) <= 65536 AND jsonb_typeof(p_headers) = 'object'
                -- a member whose value is not a string, or whose name is empty or longer than
                -- 256 characters (a jsonpath repetition count stops at 255)
                AND NOT jsonb_path_exists(p_headers,
                    '$.keyvalue() ? (@.value.type() != "string" || @.key == ""
                                     || @.key like_regex "^.{200}.{57}" flag "s")')))
       AND (p_destination IS NULL
            OR (length(p_destination) BETWEEN 1 AND 512 AND p_destination !~ '[[:cntrl:]]'))
$$;
"#
    };
}
pub(crate) use row_ok_function;

/// The function of the rules one by one, as this migration creates it.
macro_rules! check_rules_function {
    () => {
        concat!(
            r#"CREATE FUNCTION outpost_event_check_rules(p_aggregate_type text, p_aggregate_id text,
                                          p_event_type text, p_schema_version text,
                                          p_payload jsonb, p_headers jsonb, p_destination text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    new      outpost_event;
    v_column text;
BEGIN
    new.aggregate_type := p_aggregate_type;
    new.aggregate_id := p_aggregate_id;
    new.event_type := p_event_type;
    new.schema_version := p_schema_version;
    new.payload := p_payload;
    new.headers := p_headers;
    new.destination := p_destination;
"#,
            $crate::m20261202_000006_insert_checks::row_rules!(),
            r#"    RETURN true;
END
$$;
"#
        )
    };
}
pub(crate) use check_rules_function;

const UP: &str = concat!(
    r#"
-- True exactly when a row keeps every rule of outpost_event_check_rules, in one expression that
-- PostgreSQL inlines where it is called (false or NULL otherwise).
"#,
    row_ok_function!(),
    r#"
-- The row rules one by one: raises the error of the rule a row breaks, and returns true when it
-- breaks none. Called only for a row that outpost_event_row_ok did not pass.
"#,
    check_rules_function!(),
    "\n",
    before_insert_function!("v_nudge"),
    r#"-- A row that comes with its own transaction's id is left as it is: the producer API's statement
-- for many events writes it, having taken the aggregates' locks, drawn the sequences and ids,
-- checked the rules and nudged itself. (PostgreSQL reads this condition back from its stored
-- form for every statement, so it is kept to one comparison.)
DROP TRIGGER outpost_event_before_insert ON outpost_event;
CREATE TRIGGER outpost_event_before_insert BEFORE INSERT ON outpost_event
    FOR EACH ROW WHEN (NEW.txid IS DISTINCT FROM txid_current())
    EXECUTE FUNCTION outpost_event_before_insert();

DROP TRIGGER outpost_event_nudge ON outpost_event;
DROP FUNCTION outpost_event_nudge();
"#
);

const DOWN: &str = concat!(
    r#"
DROP TRIGGER outpost_event_before_insert ON outpost_event;
CREATE TRIGGER outpost_event_before_insert BEFORE INSERT ON outpost_event
    FOR EACH ROW EXECUTE FUNCTION outpost_event_before_insert();
"#,
    rules_trigger!(),
    "\n",
    nudge_trigger!(),
    r#"DROP FUNCTION outpost_event_check_rules(text, text, text, text, jsonb, jsonb, text);
DROP FUNCTION outpost_event_row_ok(text, text, text, text, jsonb, jsonb, text);
"#
);
