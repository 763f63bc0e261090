//! Dispatch: moving committed events from the outbox to their streams.
//!
//! The relay's side that sees both the database (through [`crate::store`]) and Redis (through
//! [`crate::publish`]); [`crate::app`] wires it into a node.

pub mod backoff;
pub mod batch;
pub mod cursor;
pub mod housekeeping;
pub mod partition;
pub mod ratelimit;
pub mod redis_loss;
pub mod route;
pub mod settings;
mod settle;
pub mod streams;
pub mod supervisor;
pub mod wakeup;
