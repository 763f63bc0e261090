//! The stream entry format: CloudEvents 1.0 in binary mode, one entry field per attribute.
//! `docs/streams.md` is the public description; keep the two in step.

use serde_json::{Map, Value};

use super::PublishError;

/// One event, as the publisher needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Event identity (`ce_id`).
    pub event_id: String,
    /// Event type (`ce_type`).
    pub event_type: String,
    /// Aggregate type (`ce_source` is `/outpost/<aggregate type>`; also `ce_aggregatetype`).
    pub aggregate_type: String,
    /// Aggregate id (`ce_subject`).
    pub aggregate_id: String,
    /// Sequence within the aggregate (`ce_aggregateseq`).
    pub aggregate_seq: i64,
    /// Payload schema version (`ce_schemaversion`).
    pub schema_version: String,
    /// When the fact happened, RFC 3339 (`ce_time`).
    pub time: String,
    /// The payload, JSON text (`data`).
    pub payload: String,
    /// Headers, a JSON object of strings: `traceparent` and `tracestate` become fields of their
    /// own, the rest go into `headers`.
    pub headers: String,
}

/// Names of the entry fields: the stream contract, shared by the publisher and the consumer
/// helpers.
pub mod field {
    /// `1.0`.
    pub const SPECVERSION: &str = "ce_specversion";
    /// The event id.
    pub const ID: &str = "ce_id";
    /// The event type.
    pub const TYPE: &str = "ce_type";
    /// `/outpost/<aggregate type>`.
    pub const SOURCE: &str = "ce_source";
    /// The aggregate id.
    pub const SUBJECT: &str = "ce_subject";
    /// When the fact happened.
    pub const TIME: &str = "ce_time";
    /// The aggregate type.
    pub const AGGREGATE_TYPE: &str = "ce_aggregatetype";
    /// The sequence within the aggregate.
    pub const AGGREGATE_SEQ: &str = "ce_aggregateseq";
    /// The payload's schema version.
    pub const SCHEMA_VERSION: &str = "ce_schemaversion";
    /// `application/json`.
    pub const CONTENT_TYPE: &str = "content-type";
    /// W3C trace context.
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C trace state.
    pub const TRACESTATE: &str = "tracestate";
    /// Other producer headers, a JSON object.
    pub const HEADERS: &str = "headers";
    /// The payload, JSON text.
    pub const DATA: &str = "data";
}

/// The fields of the stream entry for `m`, consuming it (the payload is moved, not copied).
pub fn entry_fields(m: Message) -> Result<Vec<(&'static str, String)>, PublishError> {
    let mut headers: Map<String, Value> = if m.headers.is_empty() || m.headers == "{}" {
        Map::new()
    } else {
        serde_json::from_str(&m.headers).map_err(|e| {
            PublishError::event("ENCODING", format!("headers are not a JSON object: {e}"))
        })?
    };
    let mut fields = Vec::with_capacity(14);
    fields.push((field::SPECVERSION, "1.0".to_owned()));
    fields.push((field::ID, m.event_id));
    fields.push((field::TYPE, m.event_type));
    fields.push((field::SOURCE, format!("/outpost/{}", m.aggregate_type)));
    fields.push((field::SUBJECT, m.aggregate_id));
    fields.push((field::TIME, m.time));
    fields.push((field::AGGREGATE_TYPE, m.aggregate_type));
    fields.push((field::AGGREGATE_SEQ, m.aggregate_seq.to_string()));
    fields.push((field::SCHEMA_VERSION, m.schema_version));
    fields.push((field::CONTENT_TYPE, "application/json".to_owned()));
    for name in [field::TRACEPARENT, field::TRACESTATE] {
        if let Some(Value::String(v)) = headers.remove(name) {
            fields.push((name, v));
        }
    }
    if !headers.is_empty() {
        fields.push((field::HEADERS, Value::Object(headers).to_string()));
    }
    fields.push((field::DATA, m.payload));
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(headers: &str) -> Message {
        Message {
            event_id: "0190-id".into(),
            event_type: "order.paid".into(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            aggregate_seq: 7,
            schema_version: "2".into(),
            time: "2026-12-01T00:00:00Z".into(),
            payload: "{\"a\":1}".into(),
            headers: headers.into(),
        }
    }

    #[test]
    fn cloudevents_binary_fields() {
        let f = entry_fields(msg(r#"{"traceparent":"00-a-b-01","x-correlation":"c1"}"#))
            .unwrap_or_default();
        let get = |k: &str| f.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("ce_id"), Some("0190-id"));
        assert_eq!(get("ce_subject"), Some("o-1"));
        assert_eq!(get("ce_aggregateseq"), Some("7"));
        assert_eq!(get("traceparent"), Some("00-a-b-01"));
        assert_eq!(get("tracestate"), None);
        assert_eq!(get("headers"), Some(r#"{"x-correlation":"c1"}"#));
        assert_eq!(get("data"), Some("{\"a\":1}"));
    }

    #[test]
    fn bad_headers_are_an_event_error() {
        assert!(entry_fields(msg("[1]")).is_err());
        assert!(entry_fields(msg("{}")).is_ok());
    }
}
