//! The producer API: write event facts inside the application's own transaction.
//!
//! ```no_run
//! # use outpost::produce::{Event, Producer};
//! # use sea_orm::TransactionTrait;
//! #[derive(serde::Serialize)]
//! struct OrderPaid { order_id: String, amount_cents: i64 }
//!
//! impl Event for OrderPaid {
//!     fn aggregate_type(&self) -> &str { "order" }
//!     fn aggregate_id(&self) -> String { self.order_id.clone() }
//!     fn event_type(&self) -> &str { "order.paid" }
//! }
//!
//! # async fn f(db: sea_orm::DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
//! let producer = Producer::default();
//! let txn = db.begin().await?;
//! // ... the business change, on `txn` ...
//! producer.enqueue(&txn, &OrderPaid { order_id: "o-1".into(), amount_cents: 1200 }).await?;
//! txn.commit().await?;
//! # Ok(()) }
//! ```
//!
//! Everything is validated before the insert, so a bad event never reaches the database and the
//! caller's transaction stays usable. The database then fills in the sequence, partition,
//! transaction id and wake-up nudge, exactly as it does for a plain SQL `INSERT` from any other
//! language (see `docs/contract.md`).

mod declared;
pub mod load;
mod trace;
mod validate;

use std::borrow::Cow;
use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sea_orm::ConnectionTrait;
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::store::{self, InsertedEvent, NewEventRow, StoreError};

pub use declared::{ChangeSet, Declaration};
pub use trace::current_trace_context;
pub use validate::Limits;

/// A typed event. Implement it for the payload type; the payload is serialised with serde.
pub trait Event: Serialize {
    /// The aggregate's type, e.g. `order`. Part of the ordering scope.
    fn aggregate_type(&self) -> &str;
    /// The aggregate's id within its type. Events of one aggregate are delivered in order.
    fn aggregate_id(&self) -> String;
    /// The event's type, e.g. `order.paid`.
    fn event_type(&self) -> &str;
    /// The payload's schema version, `MAJOR[.MINOR[.PATCH]]`.
    fn schema_version(&self) -> Cow<'_, str> {
        Cow::Borrowed("1")
    }
}

/// An event fact built field by field, for untyped producers (and for [`Event`]s, which are
/// turned into one).
#[derive(Debug, Clone, PartialEq)]
pub struct EventFact {
    event_id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    aggregate_version: Option<i64>,
    event_type: String,
    schema_version: String,
    occurred_at: Option<DateTime<Utc>>,
    payload: Value,
    headers: Value,
    destination: Option<String>,
}

impl EventFact {
    /// A fact with a fresh event id (UUIDv7), schema version `1` and no headers.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Value,
    ) -> Self {
        Self {
            event_id: Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            aggregate_version: None,
            event_type: event_type.into(),
            schema_version: "1".to_owned(),
            occurred_at: None,
            payload,
            headers: Value::Object(serde_json::Map::new()),
            destination: None,
        }
    }

    /// Builds a fact from a typed event.
    pub fn from_event<E: Event + ?Sized>(event: &E) -> Result<Self, ProduceError> {
        let payload = serde_json::to_value(event).map_err(ProduceError::Encode)?;
        Ok(Self::new(
            event.aggregate_type(),
            event.aggregate_id(),
            event.event_type(),
            payload,
        )
        .schema_version(event.schema_version()))
    }

    /// Sets the event id (for replays or producer-side idempotence). Must be unique.
    pub fn event_id(mut self, id: Uuid) -> Self {
        self.event_id = id;
        self
    }
    /// Sets the payload's schema version.
    pub fn schema_version(mut self, v: impl Into<String>) -> Self {
        self.schema_version = v.into();
        self
    }
    /// Sets when the fact happened (defaults to the transaction's start time).
    pub fn occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.occurred_at = Some(at);
        self
    }
    /// Carries the producer's own aggregate version as data (it is not the delivery sequence).
    pub fn aggregate_version(mut self, v: i64) -> Self {
        self.aggregate_version = Some(v);
        self
    }
    /// Adds one header (a string value).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        if let Value::Object(map) = &mut self.headers {
            map.insert(name.into(), Value::String(value.into()));
        }
        self
    }
    /// Replaces all headers with a JSON value, which must be an object of strings.
    pub fn headers_json(mut self, headers: Value) -> Self {
        self.headers = headers;
        self
    }
    /// Sends this event to an explicit destination stream, overriding routing.
    pub fn destination(mut self, stream: impl Into<String>) -> Self {
        self.destination = Some(stream.into());
        self
    }
    /// The event id this fact will be written with.
    pub fn id(&self) -> Uuid {
        self.event_id
    }
}

/// What the database assigned to an enqueued event.
pub type Enqueued = InsertedEvent;

/// Why an event was not enqueued. Validation errors name the field and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ProduceError {
    /// A field is missing or malformed.
    #[error("invalid event: {field} {problem}")]
    Invalid {
        /// The offending field.
        field: &'static str,
        /// What is wrong and what is accepted.
        problem: String,
    },
    /// The encoded payload is over the configured limit.
    #[error(
        "payload of {size} bytes is over the limit of {limit} bytes (producer.max_payload_bytes); \
         store large content elsewhere and put a reference in the event"
    )]
    PayloadTooLarge {
        /// Encoded size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// Headers are over the configured limit.
    #[error(
        "headers of {size} bytes are over the limit of {limit} bytes (producer.max_header_bytes)"
    )]
    HeadersTooLarge {
        /// Encoded size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The same event id appears twice in one call.
    #[error("event_id {0} appears more than once in this batch; every event needs its own id")]
    DuplicateInBatch(Uuid),
    /// The payload could not be encoded as JSON.
    #[error("payload cannot be encoded as JSON: {0}")]
    Encode(serde_json::Error),
    /// The database refused or failed the insert. A refusal aborts the caller's transaction
    /// (PostgreSQL semantics): roll it back.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Writes event facts on a caller's connection or transaction.
#[derive(Debug, Clone, Default)]
pub struct Producer {
    limits: Limits,
}

impl Producer {
    /// A producer with the given limits.
    pub fn new(limits: Limits) -> Self {
        Self { limits }
    }

    /// The limits this producer validates against.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Enqueues one typed event.
    pub async fn enqueue<C, E>(&self, conn: &C, event: &E) -> Result<Enqueued, ProduceError>
    where
        C: ConnectionTrait,
        E: Event + ?Sized,
    {
        let fact = EventFact::from_event(event)?;
        let mut out = self.enqueue_facts(conn, vec![fact]).await?;
        out.pop()
            .ok_or_else(|| StoreError::Corrupt("insert returned no row".to_owned()).into())
    }

    /// Enqueues several typed events in one statement.
    pub async fn enqueue_all<C, E>(
        &self,
        conn: &C,
        events: &[E],
    ) -> Result<Vec<Enqueued>, ProduceError>
    where
        C: ConnectionTrait,
        E: Event,
    {
        let facts = events
            .iter()
            .map(EventFact::from_event)
            .collect::<Result<Vec<_>, _>>()?;
        self.enqueue_facts(conn, facts).await
    }

    /// Enqueues facts in one statement (per 6,000 rows). All are validated first: one bad fact
    /// means none is written. Rows are written grouped by aggregate (each aggregate keeping the
    /// order given), so concurrent producers lock aggregates in one order and never deadlock on
    /// each other; the result is in the order given.
    pub async fn enqueue_facts<C: ConnectionTrait>(
        &self,
        conn: &C,
        facts: Vec<EventFact>,
    ) -> Result<Vec<Enqueued>, ProduceError> {
        if facts.is_empty() {
            return Ok(Vec::new());
        }
        let trace = current_trace_context();
        let mut seen = HashSet::with_capacity(facts.len());
        let mut rows = Vec::with_capacity(facts.len());
        for fact in facts {
            if !seen.insert(fact.event_id) {
                return Err(ProduceError::DuplicateInBatch(fact.event_id));
            }
            rows.push(self.limits.row(fact, trace.as_ref())?);
        }
        // Insert in aggregate order (stable, so each aggregate keeps its own order): every
        // transaction then takes the aggregates' locks in the same order, and two producers
        // writing the same aggregates cannot deadlock. Results come back in the caller's order.
        let mut indexed: Vec<(usize, NewEventRow)> = rows.into_iter().enumerate().collect();
        indexed.sort_by(|(_, a), (_, b)| {
            (&a.aggregate_type, &a.aggregate_id).cmp(&(&b.aggregate_type, &b.aggregate_id))
        });
        let (order, sorted): (Vec<usize>, Vec<NewEventRow>) = indexed.into_iter().unzip();
        let inserted = store::insert_events(conn, &sorted).await?;
        let mut out: Vec<Option<Enqueued>> = vec![None; sorted.len()];
        for (pos, ev) in order.into_iter().zip(inserted) {
            out[pos] = Some(ev);
        }
        out.into_iter()
            .map(|e| e.ok_or_else(|| StoreError::Corrupt("insert lost a row".to_owned()).into()))
            .collect()
    }

    /// Validates a fact and encodes it as the row the database will receive, without writing it.
    pub fn prepare(&self, fact: EventFact) -> Result<NewEventRow, ProduceError> {
        self.limits.row(fact, current_trace_context().as_ref())
    }
}
