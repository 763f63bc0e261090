//! The records scenario: the decision Outpost exists for, as a small application.
//!
//! Every mutation of a record or a link commits its business row, its audit row, its history
//! row and its event fact in one transaction; delivery to the stream happens later, at least
//! once, through Outpost's relay; a change outside the declared event content emits nothing; a
//! consumer keeps a read model exactly once.
//!
//! # Layout
//! - [`model`]: the SeaORM entities (business rows, audit, history, read model).
//! - [`schema`]: creates the tables.
//! - [`service`]: the mutations, each one transaction through Outpost's producer API.
//! - [`projection`]: the consumer keeping the read model through `outpost::consume`.
//! - [`load`]: the load generator.
//! - [`verify`]: the verdict — delivered once and in order, no event for undeclared changes,
//!   read model equal to the source.
//! - [`cli`]: `outpost-records demo|setup|write|consume|verify|bench` (the binary's edge, the only
//!   place `anyhow` is used).

pub mod cli;
pub mod load;
pub mod model;
pub mod projection;
pub mod schema;
pub mod service;
pub mod verify;
