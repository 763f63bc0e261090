//! One payload limit for the database and the relay, counted in the bytes the relay loads, and
//! the size of each row's payload and headers kept with the row so a claim can bound its memory
//! without reading them.
//!
//! **The limits did not agree.** The insert rule allowed a payload of up to 1 MiB *as stored*
//! (`pg_column_size`, after compression: a compressible payload of many megabytes passed), while
//! the relay refused any payload over `producer.max_payload_bytes` (256 KiB by default) as
//! `OVERSIZE`: such a row was accepted, then loaded by every claim and refused by the relay on
//! every attempt until it was quarantined. Now one limit, `outpost_max_payload_bytes()`
//! (262,144 bytes), is counted the same way in both places: the length of the payload as
//! PostgreSQL writes it out as text (`payload::text`, which is what the relay reads and publishes).
//! The insert rule refuses a longer payload with `outpost_event_payload_size_check`, as before
//! with a message that gives the size and the limit.
//!
//! **The claim's memory budget counted compressed bytes.** `relay.batch_bytes` was compared with
//! `pg_column_size(payload) + pg_column_size(headers)`, the stored (compressed) sizes, so a batch
//! of compressible payloads loaded up to a hundred times its budget. The sizes the relay loads
//! are now generated columns of the outbox, `payload_bytes` and `headers_bytes`
//! (`octet_length` of each column as text), computed once when a row is written: a claim reads
//! them from the row as it read the stored sizes, and never has to decompress a payload to learn
//! its size — neither for the budget nor to refuse an oversized row without loading it (a row
//! written before this migration, or by a database whose limit was higher).
//!
//! Adding the columns rewrites `outpost_event` once, computing both sizes for the rows it holds
//! (only undelivered events). `outpost_published` is unchanged.
//!
//! `down` drops the columns and the limit's function and restores the rules of
//! `m20261202_000007_lean_insert`.

use std::sync::LazyLock;

use sea_orm_migration::prelude::*;

use crate::m20261202_000007_lean_insert::{check_rules_function, row_ok_function};

#[derive(Debug, DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::execute_postgres(manager, &UP).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::execute_postgres(manager, &DOWN).await
    }
}

/// The payload rule as `m20261202_000007_lean_insert` tests it (in `outpost_event_row_ok`).
const OLD_TEST: &str = "pg_column_size(p_payload) <= 1048576";
/// The payload rule in the bytes the relay loads.
const NEW_TEST: &str = "octet_length(p_payload::text) <= outpost_max_payload_bytes()";

/// The payload rule as `m20261202_000006_insert_checks` raises it (in
/// `outpost_event_check_rules`).
const OLD_RULE: &str = r#"    IF pg_column_size(NEW.payload) > 1048576 THEN
        PERFORM outpost_event_refuse('outpost_event_payload_size_check', 'payload',
            format('payload takes %s bytes stored, over the limit of 1048576',
                   pg_column_size(NEW.payload)),
            'store large content elsewhere and put its reference in the event');
    END IF;
"#;
/// The payload rule in the bytes the relay loads, with the limit in its message.
const NEW_RULE: &str = r#"    IF octet_length(NEW.payload::text) > outpost_max_payload_bytes() THEN
        PERFORM outpost_event_refuse('outpost_event_payload_size_check', 'payload',
            format('payload is %s bytes as JSON text, over the limit of %s bytes '
                   '(outpost_max_payload_bytes())',
                   octet_length(NEW.payload::text), outpost_max_payload_bytes()),
            'store large content elsewhere and put its reference in the event');
    END IF;
"#;

/// The two functions of the rules with `from` replaced by `to` in each, as `CREATE OR REPLACE`.
fn rules(from: [&str; 2], to: [&str; 2]) -> String {
    let replace = |text: &str, from: &str, to: &str| {
        text.replacen("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
            .replace(from, to)
    };
    format!(
        "{}\n{}",
        replace(row_ok_function!(), from[0], to[0]),
        replace(check_rules_function!(), from[1], to[1])
    )
}

static UP: LazyLock<String> = LazyLock::new(|| {
    format!(
        r#"
-- The largest payload, in bytes of its JSON text as PostgreSQL writes it out (payload::text):
-- the insert rule and the relay's claim both compare with it.
CREATE FUNCTION outpost_max_payload_bytes() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 262144 $$;

{}
-- The bytes a claim loads for a row: its payload and headers as text, counted once when the row
-- is written (an update that leaves them alone does not count them again).
ALTER TABLE outpost_event
    ADD COLUMN payload_bytes integer GENERATED ALWAYS AS (octet_length(payload::text)) STORED,
    ADD COLUMN headers_bytes integer GENERATED ALWAYS AS (octet_length(headers::text)) STORED;
"#,
        rules([OLD_TEST, OLD_RULE], [NEW_TEST, NEW_RULE])
    )
});

static DOWN: LazyLock<String> = LazyLock::new(|| {
    format!(
        r#"
ALTER TABLE outpost_event DROP COLUMN payload_bytes, DROP COLUMN headers_bytes;
{}
DROP FUNCTION outpost_max_payload_bytes();
"#,
        // The functions as they were: nothing replaced.
        rules([OLD_TEST, OLD_RULE], [OLD_TEST, OLD_RULE])
    )
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_new_rules_replace_the_old_ones() {
        assert_eq!(row_ok_function!().matches(OLD_TEST).count(), 1);
        assert_eq!(check_rules_function!().matches(OLD_RULE).count(), 1);
        assert!(!UP.contains("1048576"), "{}", *UP);
        assert!(UP.contains(NEW_TEST) && UP.contains(NEW_RULE), "{}", *UP);
        assert!(DOWN.contains(OLD_TEST) && DOWN.contains(OLD_RULE));
    }
}
