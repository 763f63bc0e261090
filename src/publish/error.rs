//! Publishing errors, classified by what the relay must do next.

/// What a publishing error means for the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Redis is unreachable, slow, out of memory, loading, or the cluster is moving: back the
    /// partition off and retry later without counting an attempt.
    Transient,
    /// Redis refused this event for its own reasons (a key of the wrong type at its stream, an
    /// oversized entry): count an attempt, retry with backoff, quarantine eventually.
    Permanent,
}

/// A publishing error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    class: ErrorClass,
    code: String,
    message: String,
}

/// Classifies a Redis error code (the first word of an error reply).
pub fn classify_code(code: &str) -> ErrorClass {
    match code {
        "OOM" | "LOADING" | "BUSY" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "READONLY"
        | "MOVED" | "ASK" | "NOREPLICAS" | "NOSCRIPT" | "UNBLOCKED" | "IO" => ErrorClass::Transient,
        _ => ErrorClass::Permanent,
    }
}

impl PublishError {
    /// An error reply from Redis, e.g. `WRONGTYPE Operation against a key ...`.
    pub fn from_reply(reply: &str) -> Self {
        let code = reply.split_whitespace().next().unwrap_or("ERR").to_owned();
        Self {
            class: classify_code(&code),
            code,
            message: reply.to_owned(),
        }
    }

    /// A client-side error from the redis crate.
    pub fn from_redis(e: redis::RedisError) -> Self {
        if e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
        {
            return Self {
                class: ErrorClass::Transient,
                code: "IO".to_owned(),
                message: format!(
                    "cannot reach Redis (check redis.url and that Redis is running): {e}"
                ),
            };
        }
        let code = e.code().unwrap_or("ERR").to_owned();
        Self {
            class: classify_code(&code),
            code,
            message: e.to_string(),
        }
    }

    /// A permanent error for one event that Outpost detects itself (too large, unroutable).
    pub fn event(code: &str, message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Permanent,
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// A transient error Outpost detects itself (`code` is Outpost's own, e.g. `IO`).
    pub fn transient(code: &str, message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Transient,
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// The publish script ran after its call's deadline (half the node's wait for the call: too
    /// late for its answer to be sure to reach the node) and appended nothing.
    pub fn late() -> Self {
        Self {
            class: ErrorClass::Transient,
            code: "LATE".to_owned(),
            message: "the call reached Redis too late to be answered in time (after half of \
                      redis.response_timeout_ms); nothing was appended (a slow or partitioned \
                      network, a paused or overloaded Redis)"
                .to_owned(),
        }
    }

    /// No answer from Redis within the node's time limit for a call.
    pub fn timed_out(limit: std::time::Duration) -> Self {
        Self {
            class: ErrorClass::Transient,
            code: "IO".to_owned(),
            message: format!(
                "no answer from Redis within {} ms (redis.response_timeout_ms); check that Redis \
                 is running and reachable",
                limit.as_millis()
            ),
        }
    }

    pub(super) fn is_late(&self) -> bool {
        self.code == "LATE"
    }

    /// A configuration error (bad URL): permanent for the node, not for an event.
    pub fn config(message: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::Transient,
            code: "CONFIG".to_owned(),
            message: message.into(),
        }
    }

    /// Transient or permanent.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// The Redis error code (`WRONGTYPE`, `OOM`, …) or Outpost's own (`IO`, `LATE`, `OVERSIZE`,
    /// `UNROUTABLE`, `CONFIG`).
    pub fn code(&self) -> &str {
        &self.code
    }

    pub(super) fn is_noscript(&self) -> bool {
        self.code == "NOSCRIPT"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        let wrong = PublishError::from_reply(
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        );
        assert_eq!(
            (wrong.class(), wrong.code()),
            (ErrorClass::Permanent, "WRONGTYPE")
        );
        for t in [
            "OOM command not allowed",
            "LOADING Redis is loading",
            "MOVED 3999 x:1",
        ] {
            assert_eq!(
                PublishError::from_reply(t).class(),
                ErrorClass::Transient,
                "{t}"
            );
        }
    }
}
