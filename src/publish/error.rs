//! Publishing errors, classified by what the relay must do next.

/// What a publishing error means for the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Redis is unreachable, slow, out of memory, loading, or the cluster is moving: back the
    /// partition off and retry later without counting an attempt.
    Transient,
    /// Redis or Outpost refused this event for a reason that may pass (an error code Outpost
    /// does not know, an unexpected reply): count an attempt, retry with backoff, quarantine
    /// after `relay.max_attempts`.
    Permanent,
    /// The event can never be published as it is (a key of the wrong type where its stream
    /// goes, too large, not routable or encodable): quarantine it at the first attempt. An
    /// operator fixes the cause and replays it.
    Unpublishable,
}

/// A publishing error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    class: ErrorClass,
    code: String,
    message: String,
}

/// Classifies an error code: a Redis error code (the first word of an error reply) or one of
/// Outpost's own. Whatever can heal without anyone touching the event is transient; whatever
/// the event itself makes fail on every attempt is unpublishable; the rest (codes not known
/// here) is permanent: retried up to `relay.max_attempts`.
pub fn classify_code(code: &str) -> ErrorClass {
    match code {
        "OOM" | "LOADING" | "BUSY" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "READONLY"
        | "MOVED" | "ASK" | "NOREPLICAS" | "NOSCRIPT" | "UNBLOCKED" | "IO" | "LATE" | "CONFIG"
        | "FENCE" => ErrorClass::Transient,
        "WRONGTYPE" | "OVERSIZE" | "UNROUTABLE" | "ENCODING" | "UNDECODABLE" | "KEY" => {
            ErrorClass::Unpublishable
        }
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

    /// An error of one event that Outpost detects itself (too large, unroutable: unpublishable;
    /// an unexpected reply: permanent), classified by its code ([`classify_code`]), never
    /// transient.
    pub fn event(code: &str, message: impl Into<String>) -> Self {
        let class = match classify_code(code) {
            ErrorClass::Transient => ErrorClass::Permanent,
            class => class,
        };
        Self {
            class,
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

    /// The fence hash `fence` does not hold an epoch for `partition`: `value` is what its field
    /// holds (its first bytes), `None` when the key is not a hash at all. Someone other than
    /// Outpost wrote it; nothing is appended for the partition until it is fixed, and no event
    /// is blamed.
    pub fn bad_fence(fence: &str, partition: i32, value: Option<&str>) -> Self {
        let message = match value {
            Some(value) => format!(
                "the fence {fence} holds {value:?} for partition {partition}, which is not an \
                 epoch (decimal digits, below 9223372036854775807); nothing is appended for the \
                 partition until it is fixed: set it to the partition's epoch shown by `outpost \
                 status` (HSET {fence} {partition} <epoch>) or remove the field (HDEL {fence} \
                 {partition}); never delete the whole key"
            ),
            None => format!(
                "the fence {fence} of partition {partition} is not a hash; nothing is appended \
                 to its stream until it is fixed: remove the key (DEL {fence}), and the relay \
                 handles the stream as one whose fence Redis lost (it re-publishes the partitions' \
                 recent events, which consumers deduplicate)"
            ),
        };
        Self {
            class: ErrorClass::Transient,
            code: "FENCE".to_owned(),
            message,
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

    /// Transient, permanent or unpublishable.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// The Redis error code (`WRONGTYPE`, `OOM`, …) or Outpost's own (`IO`, `LATE`, `FENCE`,
    /// `OVERSIZE`, `UNROUTABLE`, `ENCODING`, `UNDECODABLE`, `KEY`, `PROTOCOL`, `CONFIG`).
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
            (ErrorClass::Unpublishable, "WRONGTYPE")
        );
        for code in ["OVERSIZE", "UNROUTABLE", "ENCODING", "UNDECODABLE", "KEY"] {
            assert_eq!(
                PublishError::event(code, "x").class(),
                ErrorClass::Unpublishable,
                "{code}"
            );
        }
        // An unknown code may pass; an unexpected reply too. Neither is retried without counting.
        assert_eq!(
            PublishError::from_reply("NOPERM this user has no permissions").class(),
            ErrorClass::Permanent
        );
        assert_eq!(
            PublishError::event("PROTOCOL", "x").class(),
            ErrorClass::Permanent
        );
        assert_eq!(
            PublishError::event("IO", "x").class(),
            ErrorClass::Permanent
        );
        let fence = PublishError::bad_fence("f", 3, Some("abc"));
        assert_eq!(
            (fence.class(), fence.code()),
            (ErrorClass::Transient, "FENCE")
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
