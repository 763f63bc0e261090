//! Errors of the consumer helper itself (not of handlers: see [`super::HandlerError`]).

use crate::store::StoreError;

/// Why a consumer could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    /// A setting is out of range; the message names it and says what is allowed.
    #[error("consumer setting {0}")]
    Settings(String),
    /// Redis refused a command or could not be reached.
    #[error("redis: {0} (check the Redis URL and that Redis is running)")]
    Redis(String),
    /// The stream or the consumer group is gone (Redis restarted empty, or someone deleted
    /// them): the helper creates the group again.
    #[error("the stream or its consumer group is gone")]
    NoGroup,
    /// The consumer's database failed outside a handler.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A fault point stopped the consumer as a crash would (tests only).
    #[error("stopped by the fault point {0}")]
    Fault(&'static str),
}

impl ConsumeError {
    pub(crate) fn redis(err: redis::RedisError) -> Self {
        if err.code() == Some("NOGROUP") {
            ConsumeError::NoGroup
        } else {
            ConsumeError::Redis(err.to_string())
        }
    }
}
