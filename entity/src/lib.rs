//! SeaORM entities for Outpost's tables.
//!
//! These mirror the schema created by the `migration` crate and carry no behaviour: queries and
//! state transitions live in `outpost::store`.

pub mod outpost_aggregate;
pub mod outpost_audit;
pub mod outpost_backlog;
pub mod outpost_event;
pub mod outpost_inbox;
pub mod outpost_node;
pub mod outpost_partition;
pub mod outpost_published;
pub mod outpost_redis;
pub mod outpost_stream;
