//! The stream entry format: CloudEvents 1.0 in binary mode, one entry field per attribute.
//! `docs/streams.md` is the public description; keep the two in step.
//!
//! The field names and the constant values are written once, here: [`Entry::fields`] lists them
//! for anyone writing or reading entries, and the publish script is generated from the same
//! tables ([`FIXED`], [`OPTIONAL`]), so the relay sends Redis only the values that vary.

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

/// The fields every entry has before the optional ones, in order: a constant value, or `None` for
/// a value of the event's own ([`Entry`] holds those, in this order).
pub(super) const FIXED: [(&str, Option<&str>); 10] = [
    (field::SPECVERSION, Some("1.0")),
    (field::ID, None),
    (field::TYPE, None),
    (field::SOURCE, None),
    (field::SUBJECT, None),
    (field::TIME, None),
    (field::AGGREGATE_TYPE, None),
    (field::AGGREGATE_SEQ, None),
    (field::SCHEMA_VERSION, None),
    (field::CONTENT_TYPE, Some("application/json")),
];

/// The fields an entry has only when the event carries them, in order, after [`FIXED`] and before
/// [`field::DATA`], which always comes last.
pub(super) const OPTIONAL: [&str; 3] = [field::TRACEPARENT, field::TRACESTATE, field::HEADERS];

/// Number of values of an event's own among [`FIXED`].
const VARYING: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < FIXED.len() {
        if FIXED[i].1.is_none() {
            n += 1;
        }
        i += 1;
    }
    n
};

/// Where [`Entry::new`] puts the aggregate's type and id among the varying values.
const AGGREGATE_TYPE_AT: usize = 5;
const AGGREGATE_ID_AT: usize = 3;

/// One stream entry: the values of an event that vary, in the order of [`FIXED`], then the
/// optional fields, then the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    varying: [String; VARYING],
    optional: [Option<String>; 3],
    data: String,
}

impl Entry {
    /// The entry for `m`, consuming it (the payload is moved, not copied). Fails when the
    /// headers are not a JSON object.
    pub fn new(m: Message) -> Result<Self, PublishError> {
        Self::try_new(m).map_err(|failed| failed.0)
    }

    /// [`Entry::new`], giving the message back with the error.
    pub fn try_new(m: Message) -> Result<Self, Box<(PublishError, Message)>> {
        let mut headers: Map<String, Value> = if m.headers.is_empty() || m.headers == "{}" {
            Map::new()
        } else {
            match serde_json::from_str(&m.headers) {
                Ok(h) => h,
                Err(e) => {
                    let e = format!("headers are not a JSON object: {e}");
                    return Err(Box::new((PublishError::event("ENCODING", e), m)));
                }
            }
        };
        let mut trace = |name| match headers.remove(name) {
            Some(Value::String(v)) => Some(v),
            _ => None,
        };
        let traceparent = trace(field::TRACEPARENT);
        let tracestate = trace(field::TRACESTATE);
        let rest = (!headers.is_empty()).then(|| Value::Object(headers).to_string());
        Ok(Self {
            varying: [
                m.event_id,
                m.event_type,
                format!("/outpost/{}", m.aggregate_type),
                m.aggregate_id,
                m.time,
                m.aggregate_type,
                m.aggregate_seq.to_string(),
                m.schema_version,
            ],
            optional: [traceparent, tracestate, rest],
            data: m.payload,
        })
    }

    /// Every field of the entry, names and values, in the order Redis stores them.
    pub fn fields(&self) -> Vec<(&'static str, &str)> {
        let mut varying = self.varying.iter();
        let mut out: Vec<(&'static str, &str)> = FIXED
            .iter()
            .filter_map(|(name, constant)| {
                let value = match constant {
                    Some(c) => Some(*c),
                    None => varying.next().map(String::as_str),
                };
                value.map(|v| (*name, v))
            })
            .collect();
        for (name, value) in OPTIONAL.iter().zip(&self.optional) {
            if let Some(v) = value {
                out.push((name, v.as_str()));
            }
        }
        out.push((field::DATA, self.data.as_str()));
        out
    }

    /// The event's aggregate, `(type, id)`.
    pub fn aggregate(&self) -> (&str, &str) {
        (
            &self.varying[AGGREGATE_TYPE_AT],
            &self.varying[AGGREGATE_ID_AT],
        )
    }

    /// Which optional fields are present: bit `i` for `OPTIONAL[i]`.
    pub(super) fn shape(&self) -> u8 {
        self.optional
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_some())
            .fold(0, |bits, (i, _)| bits | (1 << i))
    }

    /// The values the event brings, in field order: what the publish script is sent.
    pub(super) fn values(&self) -> impl Iterator<Item = &str> {
        self.varying
            .iter()
            .map(String::as_str)
            .chain(self.optional.iter().flatten().map(String::as_str))
            .chain(std::iter::once(self.data.as_str()))
    }
}

/// The fields of the stream entry for `m`, owned: for tools and tests that write entries in
/// the relay's format with their own `XADD`.
pub fn entry_fields(m: Message) -> Result<Vec<(&'static str, String)>, PublishError> {
    Ok(Entry::new(m)?
        .fields()
        .into_iter()
        .map(|(k, v)| (k, v.to_owned()))
        .collect())
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
    fn the_script_is_sent_the_varying_values_in_field_order() {
        let e = Entry::new(msg(r#"{"tracestate":"k=v"}"#)).unwrap_or_else(|_| unreachable!());
        assert_eq!(e.shape(), 0b010);
        let varying: Vec<&str> = e
            .fields()
            .into_iter()
            .filter(|(name, _)| !FIXED.iter().any(|(n, c)| n == name && c.is_some()))
            .map(|(_, v)| v)
            .collect();
        assert_eq!(e.values().collect::<Vec<_>>(), varying);
        assert_eq!(Entry::new(msg("{}")).map(|e| e.shape()).ok(), Some(0));
    }

    #[test]
    fn bad_headers_are_an_event_error() {
        assert!(entry_fields(msg("[1]")).is_err());
        assert!(entry_fields(msg("{}")).is_ok());
    }
}
