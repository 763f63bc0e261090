//! Dispatch: moving committed events from the outbox to their streams.
//!
//! Only this module sees both the database (through [`crate::store`]) and Redis.

pub mod backoff;
pub mod batch;
pub mod cursor;
pub mod housekeeping;
pub mod node;
pub mod partition;
pub mod ratelimit;
pub mod redis_loss;
pub mod route;
mod settle;
pub mod streams;
pub mod supervisor;
pub mod wakeup;
