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
    fields.push(("ce_specversion", "1.0".to_owned()));
    fields.push(("ce_id", m.event_id));
    fields.push(("ce_type", m.event_type));
    fields.push(("ce_source", format!("/outpost/{}", m.aggregate_type)));
    fields.push(("ce_subject", m.aggregate_id));
    fields.push(("ce_time", m.time));
    fields.push(("ce_aggregatetype", m.aggregate_type));
    fields.push(("ce_aggregateseq", m.aggregate_seq.to_string()));
    fields.push(("ce_schemaversion", m.schema_version));
    fields.push(("content-type", "application/json".to_owned()));
    for name in ["traceparent", "tracestate"] {
        if let Some(Value::String(v)) = headers.remove(name) {
            fields.push((
                if name == "traceparent" {
                    "traceparent"
                } else {
                    "tracestate"
                },
                v,
            ));
        }
    }
    if !headers.is_empty() {
        fields.push(("headers", Value::Object(headers).to_string()));
    }
    fields.push(("data", m.payload));
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
