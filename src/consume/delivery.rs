//! Decoding stream entries written by Outpost (the stream contract in `docs/streams.md`).

use std::collections::HashMap;

use redis::Value;
use serde::de::DeserializeOwned;
use serde_json::Map;
use uuid::Uuid;

use super::HandlerError;
use crate::publish::field;

/// One delivery of an event to this consumer: the entry's CloudEvents attributes, its payload
/// and how often the group has delivered it.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// The stream entry id.
    pub stream_id: String,
    /// The event id (`ce_id`): stable across retries and replays.
    pub event_id: Uuid,
    /// The event type (`ce_type`).
    pub event_type: String,
    /// `ce_source`.
    pub source: String,
    /// The aggregate type (`ce_aggregatetype`).
    pub aggregate_type: String,
    /// The aggregate id (`ce_subject`).
    pub aggregate_id: String,
    /// The event's sequence within its aggregate (`ce_aggregateseq`): 1, 2, 3, …
    pub aggregate_seq: i64,
    /// The payload's schema version (`ce_schemaversion`).
    pub schema_version: String,
    /// When the fact happened (`ce_time`, RFC 3339).
    pub time: String,
    /// W3C trace context of the producer, when it had one.
    pub traceparent: Option<String>,
    /// W3C trace state of the producer, when it had one.
    pub tracestate: Option<String>,
    /// Other producer headers.
    pub headers: Map<String, serde_json::Value>,
    /// The payload, JSON text.
    pub data: String,
    /// How many times the group has delivered this entry (1 on first delivery).
    pub deliveries: u32,
    /// Every field as it was in the entry, for the dead-letter stream.
    pub(crate) raw: Vec<(String, Vec<u8>)>,
}

/// An entry that is not an Outpost event (a field missing or malformed). It cannot be ordered or
/// deduplicated, so the helper sends it to the dead-letter stream at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("entry {stream_id} is not an Outpost event: {reason}")]
pub struct NotAnEvent {
    /// The stream entry id.
    pub stream_id: String,
    /// What is wrong with it.
    pub reason: String,
    /// Every field as it was in the entry.
    pub(crate) raw: Vec<(String, Vec<u8>)>,
}

impl Delivery {
    /// Decodes a stream entry. `deliveries` is the group's delivery count for it.
    pub fn decode(
        stream_id: String,
        map: HashMap<String, Value>,
        deliveries: u32,
    ) -> Result<Self, NotAnEvent> {
        let mut raw: Vec<(String, Vec<u8>)> = map
            .into_iter()
            .map(|(k, v)| {
                let bytes = match v {
                    Value::BulkString(b) => b,
                    Value::SimpleString(s) => s.into_bytes(),
                    Value::Int(i) => i.to_string().into_bytes(),
                    other => format!("{other:?}").into_bytes(),
                };
                (k, bytes)
            })
            .collect();
        raw.sort();
        match Fields(&raw).event(&stream_id, deliveries) {
            Ok(mut d) => {
                d.raw = raw;
                Ok(d)
            }
            Err(reason) => Err(NotAnEvent {
                stream_id,
                reason,
                raw,
            }),
        }
    }

    /// The payload decoded as `T`. A payload that does not decode is a permanent failure: no
    /// retry will change it.
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, HandlerError> {
        serde_json::from_str(&self.data).map_err(|e| {
            HandlerError::permanent(format!(
                "payload of {} (type {}, schema {}) does not decode: {e}",
                self.event_id, self.event_type, self.schema_version
            ))
        })
    }
}

struct Fields<'a>(&'a [(String, Vec<u8>)]);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    fn need(&self, name: &str) -> Result<&str, String> {
        match self.get(name) {
            Some(v) if !v.is_empty() => Ok(v),
            Some(_) => Err(format!("field {name} is empty")),
            None => Err(format!("field {name} is missing or not UTF-8")),
        }
    }

    fn event(&self, stream_id: &str, deliveries: u32) -> Result<Delivery, String> {
        let event_id = self.need(field::ID)?;
        let event_id = Uuid::parse_str(event_id)
            .map_err(|e| format!("{} {event_id:?} is not a UUID: {e}", field::ID))?;
        let seq = self.need(field::AGGREGATE_SEQ)?;
        let aggregate_seq: i64 =
            seq.parse().ok().filter(|s| *s >= 1).ok_or_else(|| {
                format!("{} {seq:?} is not a sequence number", field::AGGREGATE_SEQ)
            })?;
        let headers = match self.get(field::HEADERS) {
            None => Map::new(),
            Some(text) => serde_json::from_str(text)
                .map_err(|e| format!("{} is not a JSON object: {e}", field::HEADERS))?,
        };
        Ok(Delivery {
            stream_id: stream_id.to_owned(),
            event_id,
            event_type: self.need(field::TYPE)?.to_owned(),
            source: self.get(field::SOURCE).unwrap_or_default().to_owned(),
            aggregate_type: self.need(field::AGGREGATE_TYPE)?.to_owned(),
            aggregate_id: self.need(field::SUBJECT)?.to_owned(),
            aggregate_seq,
            schema_version: self
                .get(field::SCHEMA_VERSION)
                .unwrap_or_default()
                .to_owned(),
            time: self.get(field::TIME).unwrap_or_default().to_owned(),
            traceparent: self.get(field::TRACEPARENT).map(str::to_owned),
            tracestate: self.get(field::TRACESTATE).map(str::to_owned),
            headers,
            data: self.get(field::DATA).unwrap_or("null").to_owned(),
            deliveries,
            raw: Vec::new(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::publish::{Message, entry_fields};

    fn entry(m: Message) -> HashMap<String, Value> {
        entry_fields(m)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), Value::BulkString(v.into_bytes())))
            .collect()
    }

    fn message() -> Message {
        Message {
            event_id: "0193a4b2-7c1e-7d2f-9a3b-1c2d3e4f5a6b".into(),
            event_type: "order.paid".into(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            aggregate_seq: 7,
            schema_version: "1.2".into(),
            time: "2026-12-01T10:00:00.000000Z".into(),
            payload: r#"{"amount":5}"#.into(),
            headers: r#"{"traceparent":"00-aa-bb-01","tenant":"t1"}"#.into(),
        }
    }

    #[test]
    fn what_the_publisher_writes_decodes_back() {
        let d = Delivery::decode("1-0".into(), entry(message()), 2).unwrap();
        assert_eq!(d.event_type, "order.paid");
        assert_eq!(d.aggregate_type, "order");
        assert_eq!(d.aggregate_id, "o-1");
        assert_eq!(d.aggregate_seq, 7);
        assert_eq!(d.schema_version, "1.2");
        assert_eq!(d.traceparent.as_deref(), Some("00-aa-bb-01"));
        assert_eq!(d.headers.get("tenant"), Some(&serde_json::json!("t1")));
        assert_eq!(d.deliveries, 2);
        #[derive(serde::Deserialize)]
        struct Paid {
            amount: i64,
        }
        assert_eq!(d.payload::<Paid>().unwrap().amount, 5);
        assert!(matches!(
            d.payload::<Vec<String>>(),
            Err(HandlerError::Permanent(_))
        ));
    }

    #[test]
    fn an_entry_without_identity_or_sequence_is_not_an_event() {
        let mut map = entry(message());
        map.remove(field::AGGREGATE_SEQ);
        let err = Delivery::decode("1-0".into(), map, 1).unwrap_err();
        assert!(err.reason.contains("ce_aggregateseq"), "{err}");
        assert_eq!(
            err.raw.len(),
            12,
            "every field kept for the dead-letter stream"
        );

        let mut map = entry(message());
        map.insert(field::ID.into(), Value::BulkString(b"not-a-uuid".to_vec()));
        let err = Delivery::decode("1-0".into(), map, 1).unwrap_err();
        assert!(err.reason.contains("not a UUID"), "{err}");

        let mut map = entry(message());
        map.insert(
            field::AGGREGATE_SEQ.into(),
            Value::BulkString(b"0".to_vec()),
        );
        assert!(Delivery::decode("1-0".into(), map, 1).is_err());
    }
}
