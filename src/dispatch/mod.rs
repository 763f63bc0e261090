//! Dispatch: moving committed events from the outbox to their streams.
//!
//! Only this module sees both the database (through [`crate::store`]) and Redis.

pub mod wakeup;
