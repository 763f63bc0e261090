//! Decoding stream entries written by Outpost (the stream contract in `docs/streams.md`).
//!
//! Anyone who can `XADD` to a stream can write any bytes into it, so decoding never assumes
//! anything and never fails as a whole:
//! - an entry whose **identity** does not decode (event id, aggregate type and id, sequence,
//!   event type: missing, empty, not UTF-8, malformed, out of the contract's bounds, given twice)
//!   is [`NotAnEvent`]: it cannot be ordered or deduplicated, and goes to the dead-letter stream
//!   at once;
//! - an entry with a valid identity but a **defect** elsewhere (a field name that is not UTF-8,
//!   a value that is not UTF-8, `data` or `headers` that is not JSON, another contract field
//!   given twice) is a [`Delivery`] the handler never sees: it is dead-lettered in its
//!   aggregate's order, as a permanent failure would be, so the aggregate moves past it.

use serde::de::{DeserializeOwned, IgnoredAny};
use serde_json::Map;
use uuid::Uuid;

use super::HandlerError;
use super::stream::RawField;
use crate::publish::field;

/// Longest aggregate type the contract allows (characters), as the outbox's check.
pub(crate) const MAX_AGGREGATE_TYPE_CHARS: usize = 255;
/// Longest aggregate id the contract allows (characters), as the outbox's check.
pub(crate) const MAX_AGGREGATE_ID_CHARS: usize = 512;

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
    pub(crate) raw: Vec<RawField>,
    /// What is wrong with the entry beyond its identity: it is dead-lettered in its aggregate's
    /// order instead of being handed to the handler.
    pub(crate) defect: Option<String>,
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
    pub(crate) raw: Vec<RawField>,
}

impl Delivery {
    /// Decodes a stream entry from its fields as read (names and values as bytes, in the
    /// entry's order). `deliveries` is the group's delivery count for it.
    pub fn decode(
        stream_id: String,
        raw: Vec<(Vec<u8>, Vec<u8>)>,
        deliveries: u32,
    ) -> Result<Self, NotAnEvent> {
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

    /// What is wrong with the entry beyond its identity, if anything: such an entry is
    /// dead-lettered in its aggregate's order and never reaches the handler.
    pub fn defect(&self) -> Option<&str> {
        self.defect.as_deref()
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

/// `bytes` for a reason: the text when it is UTF-8, else a lossy rendering, quoted and escaped
/// (`{:?}`), cut to a readable length.
fn shown(bytes: &[u8]) -> String {
    const MAX: usize = 64;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX)]);
    let more = if bytes.len() > MAX { "…" } else { "" };
    format!("{text:?}{more}")
}

struct Fields<'a>(&'a [RawField]);

impl Fields<'_> {
    /// The value of the contract field `name`: `None` when absent; an error when given twice or
    /// not UTF-8.
    fn get(&self, name: &str) -> Result<Option<&str>, String> {
        let mut found = self
            .0
            .iter()
            .filter(|(k, _)| k.as_slice() == name.as_bytes());
        let Some((_, v)) = found.next() else {
            return Ok(None);
        };
        let more = found.count();
        if more > 0 {
            return Err(format!("field {name} is given {} times", more + 1));
        }
        std::str::from_utf8(v)
            .map(Some)
            .map_err(|_| format!("field {name} is not UTF-8: {}", shown(v)))
    }

    fn need(&self, name: &str) -> Result<&str, String> {
        match self.get(name)? {
            Some(v) if !v.is_empty() => Ok(v),
            Some(_) => Err(format!("field {name} is empty")),
            None => Err(format!("field {name} is missing")),
        }
    }

    /// A name the aggregate is stored under: non-empty, at most `max` characters, no NUL.
    fn name(&self, field: &str, max: usize) -> Result<&str, String> {
        let v = self.need(field)?;
        let chars = v.chars().count();
        if chars > max {
            return Err(format!(
                "field {field} has {chars} characters; the contract allows at most {max}"
            ));
        }
        if v.contains('\0') {
            return Err(format!("field {field} contains a NUL character"));
        }
        Ok(v)
    }

    /// The identity of the event; an error makes the entry [`NotAnEvent`].
    fn event(&self, stream_id: &str, deliveries: u32) -> Result<Delivery, String> {
        let event_id = self.need(field::ID)?;
        let event_id = Uuid::parse_str(event_id)
            .map_err(|e| format!("{} {event_id:?} is not a UUID: {e}", field::ID))?;
        let seq = self.need(field::AGGREGATE_SEQ)?;
        let aggregate_seq: i64 =
            seq.parse().ok().filter(|s| *s >= 1).ok_or_else(|| {
                format!("{} {seq:?} is not a sequence number", field::AGGREGATE_SEQ)
            })?;
        let mut d = Delivery {
            stream_id: stream_id.to_owned(),
            event_id,
            event_type: self.need(field::TYPE)?.to_owned(),
            source: String::new(),
            aggregate_type: self
                .name(field::AGGREGATE_TYPE, MAX_AGGREGATE_TYPE_CHARS)?
                .to_owned(),
            aggregate_id: self
                .name(field::SUBJECT, MAX_AGGREGATE_ID_CHARS)?
                .to_owned(),
            aggregate_seq,
            schema_version: String::new(),
            time: String::new(),
            traceparent: None,
            tracestate: None,
            headers: Map::new(),
            data: "null".to_owned(),
            deliveries,
            raw: Vec::new(),
            defect: None,
        };
        if let Err(defect) = self.rest(&mut d) {
            d.defect = Some(defect);
        }
        Ok(d)
    }

    /// Everything but the identity; an error is the delivery's defect.
    fn rest(&self, d: &mut Delivery) -> Result<(), String> {
        if let Some((k, _)) = self.0.iter().find(|(k, _)| std::str::from_utf8(k).is_err()) {
            return Err(format!("a field name is not UTF-8: {}", shown(k)));
        }
        for name in [field::SPECVERSION, field::CONTENT_TYPE] {
            self.get(name)?;
        }
        d.source = self.get(field::SOURCE)?.unwrap_or_default().to_owned();
        d.schema_version = self
            .get(field::SCHEMA_VERSION)?
            .unwrap_or_default()
            .to_owned();
        d.time = self.get(field::TIME)?.unwrap_or_default().to_owned();
        d.traceparent = self.get(field::TRACEPARENT)?.map(str::to_owned);
        d.tracestate = self.get(field::TRACESTATE)?.map(str::to_owned);
        if let Some(text) = self.get(field::HEADERS)? {
            d.headers = serde_json::from_str(text)
                .map_err(|e| format!("{} is not a JSON object: {e}", field::HEADERS))?;
        }
        if let Some(text) = self.get(field::DATA)? {
            serde_json::from_str::<IgnoredAny>(text)
                .map_err(|e| format!("{} is not JSON: {e}", field::DATA))?;
            d.data = text.to_owned();
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::publish::{Message, entry_fields};

    fn entry(m: Message) -> Vec<RawField> {
        entry_fields(m)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.into_bytes()))
            .collect()
    }

    fn with(mut fields: Vec<RawField>, name: &str, value: &[u8]) -> Vec<RawField> {
        fields.retain(|(k, _)| k.as_slice() != name.as_bytes());
        fields.push((name.as_bytes().to_vec(), value.to_vec()));
        fields
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
        assert_eq!(d.defect(), None);
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
        let mut fields = entry(message());
        fields.retain(|(k, _)| k.as_slice() != field::AGGREGATE_SEQ.as_bytes());
        let err = Delivery::decode("1-0".into(), fields, 1).unwrap_err();
        assert!(err.reason.contains("ce_aggregateseq is missing"), "{err}");
        assert_eq!(
            err.raw.len(),
            12,
            "every field kept for the dead-letter stream"
        );

        let cases: [(&str, &[u8], &str); 7] = [
            (field::ID, b"not-a-uuid", "not a UUID"),
            (field::AGGREGATE_SEQ, b"0", "not a sequence number"),
            (
                field::AGGREGATE_SEQ,
                b"99999999999999999999",
                "not a sequence number",
            ),
            (field::SUBJECT, b"o-\xff", "ce_subject is not UTF-8"),
            (field::SUBJECT, b"o\x001", "NUL"),
            (field::AGGREGATE_TYPE, b"", "ce_aggregatetype is empty"),
            (field::TYPE, b"\xc3", "ce_type is not UTF-8"),
        ];
        for (name, value, why) in cases {
            let err =
                Delivery::decode("1-0".into(), with(entry(message()), name, value), 1).unwrap_err();
            assert!(err.reason.contains(why), "{name}: {err}");
        }
        let long = "x".repeat(MAX_AGGREGATE_ID_CHARS + 1);
        let err = Delivery::decode(
            "1-0".into(),
            with(entry(message()), field::SUBJECT, long.as_bytes()),
            1,
        )
        .unwrap_err();
        assert!(err.reason.contains("at most 512"), "{err}");

        let mut twice = entry(message());
        twice.push((
            field::ID.as_bytes().to_vec(),
            b"0193a4b2-7c1e-7d2f-9a3b-000000000000".to_vec(),
        ));
        let err = Delivery::decode("1-0".into(), twice, 1).unwrap_err();
        assert!(err.reason.contains("ce_id is given 2 times"), "{err}");
    }

    #[test]
    fn an_event_with_a_defect_beyond_its_identity_decodes_with_the_defect() {
        let mut bad_name = entry(message());
        bad_name.push((b"x-\xff\xfe".to_vec(), b"1".to_vec()));
        let cases: [(Vec<RawField>, &str); 5] = [
            (bad_name, "a field name is not UTF-8"),
            (
                with(entry(message()), field::DATA, b"{not json"),
                "data is not JSON",
            ),
            (
                with(entry(message()), field::DATA, b"\xff"),
                "data is not UTF-8",
            ),
            (
                with(entry(message()), field::HEADERS, b"[1]"),
                "headers is not a JSON object",
            ),
            (
                with(entry(message()), field::TIME, b"\x80"),
                "ce_time is not UTF-8",
            ),
        ];
        for (fields, why) in cases {
            let d = Delivery::decode("1-0".into(), fields, 1).unwrap();
            assert_eq!(d.aggregate_seq, 7, "the identity is kept");
            let defect = d.defect().unwrap_or_default();
            assert!(defect.contains(why), "{why}: {defect:?}");
        }
    }
}
