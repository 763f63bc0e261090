//! What operators need to find, put right and account for events: the failure code as data,
//! indexes behind the dead-letter searches, when a row was discarded, and API tokens.
//!
//! - `outpost_error_code(last_error)`: the failure's code, the first word of `last_error` (the
//!   relay always writes the code first: `WRONGTYPE …`, `UNROUTABLE …`). The one place the code
//!   is read out of the message; searches, counts and the index below all call it.
//! - `outpost_event_dead_code (outpost_error_code(last_error), id) WHERE status = 'quarantined'`:
//!   quarantined rows by code, in id order (the keyset of the searches).
//! - `outpost_event_parked_type (event_type, id)` over rows that are not on their way
//!   (`held`, `quarantined`, `discarded`, `no_destination`, `retry_wait`): searches by event
//!   type. Pending rows, almost every insert, are outside the predicate and add no entry.
//! - `outpost_event_discarded (next_attempt_at) WHERE status = 'discarded'`: a discarded row's
//!   `next_attempt_at` is the time it was discarded (it has no next attempt), and the janitor
//!   ages it out from then, not from when it was recorded (which may be long before).
//! - `outpost_token`: API tokens. Only the SHA-256 of the secret part is kept; the token is
//!   shown once, when created. A revoked token keeps its row (and its name) for the audit log.

use sea_orm_migration::prelude::*;

sql_migration!();

const UP: &str = r#"
CREATE FUNCTION outpost_error_code(p_error text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT split_part(p_error, ' ', 1)
$$;

CREATE INDEX outpost_event_dead_code ON outpost_event (outpost_error_code(last_error), id)
    WHERE status = 'quarantined';
CREATE INDEX outpost_event_parked_type ON outpost_event (event_type, id)
    WHERE status IN ('held', 'quarantined', 'discarded', 'no_destination', 'retry_wait');
CREATE INDEX outpost_event_discarded ON outpost_event (next_attempt_at)
    WHERE status = 'discarded';

CREATE TABLE outpost_token (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text        NOT NULL CHECK (length(name) BETWEEN 1 AND 128
                                            AND name !~ '[[:cntrl:]]'),
    role        text        NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    secret_hash bytea       NOT NULL CHECK (length(secret_hash) = 32),
    created_at  timestamptz NOT NULL DEFAULT now(),
    created_by  text        NOT NULL,
    revoked_at  timestamptz,
    last_used_at timestamptz
);
CREATE UNIQUE INDEX outpost_token_live_name ON outpost_token (name) WHERE revoked_at IS NULL;
"#;

const DOWN: &str = r#"
DROP TABLE IF EXISTS outpost_token;
DROP INDEX IF EXISTS outpost_event_discarded;
DROP INDEX IF EXISTS outpost_event_parked_type;
DROP INDEX IF EXISTS outpost_event_dead_code;
DROP FUNCTION IF EXISTS outpost_error_code(text);
"#;
