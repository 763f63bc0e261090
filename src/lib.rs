//! Outpost: a transactional-outbox dispatcher.
//!
//! Applications commit a business change and an event fact in one database transaction; Outpost
//! delivers every committed fact to Redis Streams afterwards, at least once and in order per
//! aggregate.
//!
//! # Layout
//! - [`config`]: the typed configuration tree (defaults → file → environment → flags).
//! - [`store`]: every SQL statement; the only module that talks to the database.
//! - [`produce`]: the producer API applications call inside their own transactions.
//! - [`publish`]: fenced, pipelined appends to Redis Streams; the only module that talks to Redis.
//! - [`dispatch`]: the relay's actors, moving events from the outbox to the streams.
//! - [`cli`]: the `outpost` command line.
//!
//! `ARCHITECTURE.md` at the repository root has the bird's-eye view and the invariants.

pub mod admin;
pub mod app;
pub mod cli;
pub mod config;
pub mod consume;
pub mod dispatch;
pub mod health;
pub mod metrics;
pub mod produce;
pub mod publish;
pub mod store;
