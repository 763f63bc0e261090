//! The settings every batch of a node uses, from `[relay]`.

use std::time::Duration;

/// Relay settings every batch uses.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Rows per claim.
    pub batch_rows: u32,
    /// Payload and header bytes per claim.
    pub batch_bytes: u64,
    /// Attempts before quarantine.
    pub max_attempts: u32,
    /// First retry delay of a failing event.
    pub backoff_base: Duration,
    /// Longest retry delay of a failing event.
    pub backoff_max: Duration,
    /// Delete published rows instead of marking them.
    pub delete_published: bool,
}
