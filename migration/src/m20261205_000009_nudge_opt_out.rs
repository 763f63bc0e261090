//! Lets a producer's transaction go without the nudge: `SET LOCAL outpost.nudge = off` (or the
//! same setting for a role or a database, `ALTER ROLE … SET outpost.nudge = off`).
//!
//! A transaction that sent a `NOTIFY` cannot be prepared for two-phase commit: `PREPARE
//! TRANSACTION` fails with SQLSTATE 0A000, "cannot PREPARE a transaction that has executed
//! LISTEN, UNLISTEN, or NOTIFY". The insert trigger nudges whenever some node asked for nudges,
//! which an idle node does, so a producer whose transactions are prepared (by an XA transaction
//! manager, for one) failed now and then, depending on the nodes' state. With the setting off
//! its events wait for a poll instead: the next busy poll, or an idle node's scheduled poll.
//! `off`, `false`, `no` and `0` turn it off; unset or anything else leaves the nudge on.
//!
//! The setting is read only where a nudge would be sent, so producers pay for it only while a
//! node is idle. The producer API's statement for many events reads it the same way
//! (`outpost::store::events`).
//!
//! `down` restores the trigger function of `m20261202_000007_lean_insert`.

use sea_orm_migration::prelude::*;

use crate::m20261202_000007_lean_insert::before_insert_function;

sql_migration!();

const UP: &str = before_insert_function!(
    "v_nudge AND coalesce(lower(current_setting('outpost.nudge', true)), '')
           NOT IN ('off', 'false', 'no', '0')"
);

const DOWN: &str = before_insert_function!("v_nudge");
