//! Validation of event facts before they reach the database.
//!
//! The schema enforces the same rules at insert (the outbox's insert trigger, or the statement
//! for many events, which report a broken rule as a CHECK violation naming its constraint);
//! checking here first gives the caller a precise error and keeps its transaction usable.

use chrono::Utc;
use serde_json::Value;

use super::trace::TraceContext;
use super::{EventFact, ProduceError};
use crate::store::NewEventRow;

/// Size limits applied by the producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest encoded payload, in bytes (`producer.max_payload_bytes`; the database's limit,
    /// [`crate::store::MAX_PAYLOAD_BYTES`], is the most it may be).
    pub max_payload_bytes: usize,
    /// Largest encoded headers object, in bytes (`producer.max_header_bytes`).
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_bytes: crate::store::MAX_PAYLOAD_BYTES,
            max_header_bytes: 8 * 1024,
        }
    }
}

const MAX_TYPE_LEN: usize = 255;
const MAX_AGGREGATE_ID_LEN: usize = 512;
const MAX_DESTINATION_LEN: usize = 512;
const MAX_HEADER_NAME_LEN: usize = 256;

impl Limits {
    /// Validates `fact` and encodes it as a row, adding the trace context to its headers unless
    /// the caller set `traceparent` already.
    pub(super) fn row(
        &self,
        fact: EventFact,
        trace: Option<&TraceContext>,
    ) -> Result<NewEventRow, ProduceError> {
        check_name("aggregate_type", &fact.aggregate_type, MAX_TYPE_LEN, true)?;
        check_name(
            "aggregate_id",
            &fact.aggregate_id,
            MAX_AGGREGATE_ID_LEN,
            false,
        )?;
        check_name("event_type", &fact.event_type, MAX_TYPE_LEN, true)?;
        check_schema_version(&fact.schema_version)?;
        if let Some(dest) = &fact.destination {
            check_name("destination", dest, MAX_DESTINATION_LEN, true)?;
        }
        let mut headers = match fact.headers {
            Value::Object(map) => map,
            other => {
                return Err(ProduceError::Invalid {
                    field: "headers",
                    problem: format!(
                        "must be a JSON object of string values, got {}",
                        json_kind(&other)
                    ),
                });
            }
        };
        for (name, value) in &headers {
            if name.is_empty() || name.len() > MAX_HEADER_NAME_LEN {
                return Err(ProduceError::Invalid {
                    field: "headers",
                    problem: format!(
                        "header names must be 1 to {MAX_HEADER_NAME_LEN} bytes long, got {}",
                        name.len()
                    ),
                });
            }
            if !value.is_string() {
                return Err(ProduceError::Invalid {
                    field: "headers",
                    problem: format!("header {name:?} must be a string, got {}", json_kind(value)),
                });
            }
        }
        if let Some(trace) = trace
            && !headers.contains_key("traceparent")
        {
            headers.insert(
                "traceparent".to_owned(),
                Value::String(trace.traceparent.clone()),
            );
            if let Some(state) = &trace.tracestate {
                headers.insert("tracestate".to_owned(), Value::String(state.clone()));
            }
        }
        let headers_json = Value::Object(headers).to_string();
        if headers_json.len() > self.max_header_bytes {
            return Err(ProduceError::HeadersTooLarge {
                size: headers_json.len(),
                limit: self.max_header_bytes,
            });
        }
        let payload_json = serde_json::to_string(&fact.payload).map_err(ProduceError::Encode)?;
        if payload_json.len() > self.max_payload_bytes {
            return Err(ProduceError::PayloadTooLarge {
                size: payload_json.len(),
                limit: self.max_payload_bytes,
            });
        }
        Ok(NewEventRow {
            event_id: fact.event_id,
            aggregate_type: fact.aggregate_type,
            aggregate_id: fact.aggregate_id,
            aggregate_version: fact.aggregate_version,
            event_type: fact.event_type,
            schema_version: fact.schema_version,
            occurred_at: fact.occurred_at.unwrap_or_else(Utc::now),
            payload_json,
            headers_json,
            destination: fact.destination,
        })
    }
}

fn check_name(
    field: &'static str,
    value: &str,
    max: usize,
    no_control: bool,
) -> Result<(), ProduceError> {
    if value.trim().is_empty() {
        return Err(ProduceError::Invalid {
            field,
            problem: "is missing or blank; every event needs it".to_owned(),
        });
    }
    let chars = value.chars().count();
    if chars > max {
        return Err(ProduceError::Invalid {
            field,
            problem: format!("is {chars} characters long; at most {max} are allowed"),
        });
    }
    if no_control && value.chars().any(char::is_control) {
        return Err(ProduceError::Invalid {
            field,
            problem: "contains control characters, which are not allowed".to_owned(),
        });
    }
    if value.contains('\0') {
        return Err(ProduceError::Invalid {
            field,
            problem: "contains a NUL character, which PostgreSQL text cannot store".to_owned(),
        });
    }
    Ok(())
}

/// `MAJOR[.MINOR[.PATCH]]`, each part a number without leading zeros, at most 9 digits.
fn check_schema_version(v: &str) -> Result<(), ProduceError> {
    let parts: Vec<&str> = v.split('.').collect();
    let ok = (1..=3).contains(&parts.len())
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.len() <= 9
                && p.bytes().all(|b| b.is_ascii_digit())
                && (p.len() == 1 || !p.starts_with('0'))
        });
    if ok {
        Ok(())
    } else {
        Err(ProduceError::Invalid {
            field: "schema_version",
            problem: format!(
                "{v:?} is not a version; use MAJOR[.MINOR[.PATCH]] with plain numbers, e.g. \"2\" \
                 or \"1.3\""
            ),
        })
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_versions() {
        for ok in ["1", "0", "2.1", "1.0.3", "123456789"] {
            assert!(check_schema_version(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "v1",
            "1.",
            ".1",
            "01",
            "1.2.3.4",
            "1a",
            "1234567890",
            "1 ",
        ] {
            assert!(check_schema_version(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names() {
        assert!(check_name("event_type", "order.paid", 255, true).is_ok());
        assert!(check_name("event_type", "  ", 255, true).is_err());
        assert!(check_name("event_type", "a\nb", 255, true).is_err());
        assert!(check_name("aggregate_id", "a\nb", 512, false).is_ok());
        assert!(check_name("aggregate_id", "a\0b", 512, false).is_err());
        assert!(check_name("event_type", &"x".repeat(256), 255, true).is_err());
    }
}
