//! Finding events: searches by state, destination, event type, aggregate, error code and time,
//! one page at a time by keyset (`id` order), capped counts, and one event whole.
//!
//! Every search is one statement built from the filters that are set, with the state written into
//! it (from the fixed list of states, never from input) so PostgreSQL can use the partial index
//! of that state even for a generic plan: `outpost_event_parked (status, id)` for parked states,
//! `outpost_event_dead_code` for quarantined rows by code, `outpost_event_parked_type` by event
//! type, the aggregate's unique key `(aggregate_type, aggregate_id, aggregate_seq)` for one
//! aggregate. A count reads at most [`COUNT_CAP`] rows and says when it stopped there.

use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, Value};
use serde::{Deserialize, Serialize};

use super::super::{Store, StoreError, stmt};

/// Counts of matching events stop here (and say so): a count never scans millions of rows.
pub const COUNT_CAP: u64 = 10_000;
/// Largest page of a search.
pub const MAX_PAGE: u32 = 500;

/// A delivery state of a row in the outbox (published events live in `outpost_published`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventState {
    /// Ready to publish.
    Pending,
    /// Failed; retried later.
    RetryWait,
    /// Waiting behind an earlier failing event of its aggregate.
    Held,
    /// Failed `relay.max_attempts` times, or once for a reason that can never pass: a dead
    /// letter.
    Quarantined,
    /// Given up on by an operator.
    Discarded,
    /// Routed nowhere.
    NoDestination,
}

impl EventState {
    /// Every state, in the order of the lifecycle.
    pub const ALL: [EventState; 6] = [
        EventState::Pending,
        EventState::RetryWait,
        EventState::Held,
        EventState::Quarantined,
        EventState::Discarded,
        EventState::NoDestination,
    ];

    /// The state's name, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Pending => "pending",
            EventState::RetryWait => "retry_wait",
            EventState::Held => "held",
            EventState::Quarantined => "quarantined",
            EventState::Discarded => "discarded",
            EventState::NoDestination => "no_destination",
        }
    }
}

impl std::str::FromStr for EventState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown state {s:?}: use one of pending, retry_wait, held, quarantined, \
                     discarded, no_destination"
                )
            })
    }
}

/// Which events: every filter that is set must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventFilter {
    /// Delivery state.
    pub state: Option<EventState>,
    /// The explicit `destination` the producer set (events routed by the routing rules have
    /// none; find those by aggregate or event type).
    pub destination: Option<String>,
    /// Event type.
    pub event_type: Option<String>,
    /// Aggregate type.
    pub aggregate_type: Option<String>,
    /// Aggregate id (with `aggregate_type`).
    pub aggregate_id: Option<String>,
    /// Failure code: the first word of `last_error` (`WRONGTYPE`, `UNROUTABLE`, …).
    pub error_code: Option<String>,
    /// Recorded at or after.
    pub recorded_from: Option<DateTime<Utc>>,
    /// Recorded before.
    pub recorded_to: Option<DateTime<Utc>>,
}

impl EventFilter {
    /// Checks the filter makes sense; the message says what to change.
    pub fn check(&self) -> Result<(), String> {
        if self.aggregate_id.is_some() && self.aggregate_type.is_none() {
            return Err("an aggregate id needs its aggregate type too (aggregate_type)".to_owned());
        }
        if let (Some(from), Some(to)) = (self.recorded_from, self.recorded_to)
            && from >= to
        {
            return Err(format!(
                "the time range is empty: recorded_from {from} is not before recorded_to {to}"
            ));
        }
        for (name, v) in [
            ("destination", &self.destination),
            ("event_type", &self.event_type),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("error_code", &self.error_code),
        ] {
            if v.as_deref().is_some_and(|v| v.is_empty() || v.len() > 512) {
                return Err(format!("{name} must be 1 to 512 characters when set"));
            }
        }
        Ok(())
    }

    /// True when no filter is set.
    pub fn is_empty(&self) -> bool {
        *self == EventFilter::default()
    }

    /// The `WHERE` conditions (joined by `AND`, starting with `true`) with their values appended
    /// to `values` as `$n` parameters.
    pub(in crate::store) fn conditions(&self, values: &mut Vec<Value>) -> String {
        let mut sql = String::from("true");
        if let Some(s) = self.state {
            // A literal from the fixed list, so the state's partial index serves generic plans.
            sql.push_str(&format!(" AND status = '{}'", s.as_str()));
        }
        let mut bind = |sql: &mut String, column: &str, op: &str, v: Value| {
            values.push(v);
            sql.push_str(&format!(" AND {column} {op} ${}", values.len()));
        };
        let text = |v: &Option<String>| v.clone().map(Value::from);
        for (column, v) in [
            ("destination", text(&self.destination)),
            ("event_type", text(&self.event_type)),
            ("aggregate_type", text(&self.aggregate_type)),
            ("aggregate_id", text(&self.aggregate_id)),
            ("outpost_error_code(last_error)", text(&self.error_code)),
        ] {
            if let Some(v) = v {
                bind(&mut sql, column, "=", v);
            }
        }
        if let Some(t) = self.recorded_from {
            bind(&mut sql, "recorded_at", ">=", t.into());
        }
        if let Some(t) = self.recorded_to {
            bind(&mut sql, "recorded_at", "<", t.into());
        }
        sql
    }
}

/// An event in a list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventSummary {
    /// Row id: the keyset of searches (pass the last one as `after`).
    pub id: i64,
    /// The event id consumers see (`ce_id`).
    pub event_id: uuid::Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Sequence within the aggregate.
    pub aggregate_seq: i64,
    /// Event type.
    pub event_type: String,
    /// Delivery state.
    pub state: String,
    /// Publishing attempts made.
    pub attempts: i32,
    /// Failure code of the last attempt, if it failed.
    pub error_code: Option<String>,
    /// When the event was recorded.
    pub recorded_at: DateTime<Utc>,
}

/// One page of a search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventPage {
    /// The events, in id order.
    pub events: Vec<EventSummary>,
    /// Pass as `after` for the next page; `None` on the last page.
    pub next_after: Option<i64>,
}

/// A count of matching events, exact up to [`COUNT_CAP`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MatchCount {
    /// Events counted.
    pub rows: u64,
    /// True when counting stopped at the cap: there are at least `rows`.
    pub capped: bool,
}

/// The W3C trace context an event carried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceContext {
    /// `traceparent` header.
    pub traceparent: String,
    /// `tracestate` header, when there was one.
    pub tracestate: Option<String>,
}

/// One event, whole.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventDetail {
    /// Its list entry.
    #[serde(flatten)]
    pub summary: EventSummary,
    /// Payload schema version.
    pub schema_version: String,
    /// When the fact happened (producer's clock).
    pub occurred_at: Option<DateTime<Utc>>,
    /// The payload.
    pub payload: serde_json::Value,
    /// The producer's headers.
    pub headers: serde_json::Value,
    /// The trace context from the headers.
    pub trace: Option<TraceContext>,
    /// The last failure, starting with its code.
    pub last_error: Option<String>,
    /// Explicit destination.
    pub destination: Option<String>,
    /// Partition.
    pub partition: i32,
    /// Next attempt (for `retry_wait`), or when it was discarded (for `discarded`).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When it was appended to its stream (published events).
    pub published_at: Option<DateTime<Utc>>,
    /// The stream entry id (published events).
    pub stream_id: Option<String>,
}

/// The list columns, in [`summary`]'s order.
const SUMMARY_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, aggregate_seq, \
     event_type, status, attempts, outpost_error_code(last_error), recorded_at";

fn summary(r: &sea_orm::QueryResult) -> Result<EventSummary, StoreError> {
    let g = StoreError::from_db;
    Ok(EventSummary {
        id: r.try_get_by_index(0).map_err(g)?,
        event_id: r.try_get_by_index(1).map_err(g)?,
        aggregate_type: r.try_get_by_index(2).map_err(g)?,
        aggregate_id: r.try_get_by_index(3).map_err(g)?,
        aggregate_seq: r.try_get_by_index(4).map_err(g)?,
        event_type: r.try_get_by_index(5).map_err(g)?,
        state: r.try_get_by_index(6).map_err(g)?,
        attempts: r.try_get_by_index(7).map_err(g)?,
        error_code: r.try_get_by_index(8).map_err(g)?,
        recorded_at: r.try_get_by_index(9).map_err(g)?,
    })
}

/// The statement of a search page: `limit + 1` rows, to tell whether there is a next page.
fn search_sql(filter: &EventFilter, after: Option<i64>, limit: u32) -> (String, Vec<Value>) {
    let mut values = Vec::new();
    let mut sql = format!(
        "SELECT {SUMMARY_COLUMNS} FROM outpost_event WHERE {}",
        filter.conditions(&mut values)
    );
    if let Some(a) = after {
        values.push(a.into());
        sql.push_str(&format!(" AND id > ${}", values.len()));
    }
    values.push((i64::from(limit) + 1).into());
    sql.push_str(&format!(" ORDER BY id LIMIT ${}", values.len()));
    (sql, values)
}

fn bad_filter(message: String) -> StoreError {
    StoreError::Refused {
        kind: "input",
        message,
    }
}

impl Store {
    /// One page of the events in the outbox matching `filter`, in id order, after row `after`.
    pub async fn search_events(
        &self,
        filter: &EventFilter,
        after: Option<i64>,
        limit: u32,
    ) -> Result<EventPage, StoreError> {
        filter.check().map_err(bad_filter)?;
        let limit = limit.clamp(1, MAX_PAGE);
        let (sql, values) = search_sql(filter, after, limit);
        let mut events = self
            .connection()
            .query_all_raw(stmt(&sql, values))
            .await
            .map_err(StoreError::from_db)?
            .iter()
            .map(summary)
            .collect::<Result<Vec<_>, _>>()?;
        let more = events.len() > limit as usize;
        events.truncate(limit as usize);
        let next_after = if more {
            events.last().map(|e| e.id)
        } else {
            None
        };
        Ok(EventPage { events, next_after })
    }

    /// How many events match `filter`, counted up to `cap` rows ([`COUNT_CAP`] for pages; a bulk
    /// action counts up to its own limit, [`super::MAX_BULK`]).
    pub async fn count_events(
        &self,
        filter: &EventFilter,
        cap: u64,
    ) -> Result<MatchCount, StoreError> {
        filter.check().map_err(bad_filter)?;
        let mut values = Vec::new();
        let cond = filter.conditions(&mut values);
        values.push(i64::try_from(cap).unwrap_or(i64::MAX).into());
        let sql = format!(
            "SELECT count(*) FROM (SELECT 1 FROM outpost_event WHERE {cond} LIMIT ${}) s",
            values.len()
        );
        let n: i64 = self
            .connection()
            .query_one_raw(stmt(&sql, values))
            .await
            .map_err(StoreError::from_db)?
            .map(|r| r.try_get_by_index(0))
            .transpose()
            .map_err(StoreError::from_db)?
            .unwrap_or(0);
        let rows = u64::try_from(n).unwrap_or(0);
        Ok(MatchCount {
            rows,
            capped: rows >= cap,
        })
    }

    /// `EXPLAIN` of a search page and of its count (for `outpost bench admin`: which indexes
    /// they use).
    pub async fn explain_search(
        &self,
        filter: &EventFilter,
        after: Option<i64>,
    ) -> Result<Vec<String>, StoreError> {
        let (sql, values) = search_sql(filter, after, 50);
        let mut count_values = Vec::new();
        let cond = filter.conditions(&mut count_values);
        count_values.push(i64::try_from(COUNT_CAP).unwrap_or(i64::MAX).into());
        let count = format!(
            "SELECT count(*) FROM (SELECT 1 FROM outpost_event WHERE {cond} LIMIT ${}) s",
            count_values.len()
        );
        let mut plan = Vec::new();
        for (sql, values) in [(sql, values), (count, count_values)] {
            for r in self
                .connection()
                .query_all_raw(stmt(&format!("EXPLAIN {sql}"), values))
                .await
                .map_err(StoreError::from_db)?
            {
                plan.push(
                    r.try_get_by_index::<String>(0)
                        .map_err(StoreError::from_db)?,
                );
            }
        }
        Ok(plan)
    }

    /// The cluster's publish rate, events per second, from the newest 1,000 events published
    /// in the last minute (read backwards through the history's index on `published_at`, so it
    /// costs the same at any rate): their count over the time they span, or over the minute
    /// when there were fewer.
    pub async fn publish_rate(&self) -> Result<f64, StoreError> {
        let row = self
            .connection()
            .query_one_raw(stmt(
                "SELECT count(*), extract(epoch FROM now() - min(published_at))::float8 \
                 FROM (SELECT published_at FROM outpost_published \
                       WHERE published_at > now() - interval '60 seconds' \
                       ORDER BY published_at DESC LIMIT 1000) s",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let Some(r) = row else { return Ok(0.0) };
        let n: i64 = r.try_get_by_index(0).map_err(StoreError::from_db)?;
        let span: Option<f64> = r.try_get_by_index(1).map_err(StoreError::from_db)?;
        let span = if n >= 1000 {
            span.unwrap_or(60.0)
        } else {
            60.0
        };
        Ok(n as f64 / span.max(0.001))
    }

    /// Quarantined events by failure code, most first (for `outpost status` and the overview).
    pub async fn quarantined_by_code(&self) -> Result<Vec<(String, i64)>, StoreError> {
        self.connection()
            .query_all_raw(stmt(
                "SELECT coalesce(outpost_error_code(last_error), ''), count(*) FROM outpost_event \
                 WHERE status = 'quarantined' GROUP BY 1 ORDER BY 2 DESC, 1",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .into_iter()
            .map(|r| {
                Ok((
                    r.try_get_by_index(0).map_err(StoreError::from_db)?,
                    r.try_get_by_index(1).map_err(StoreError::from_db)?,
                ))
            })
            .collect()
    }

    /// One event by its event id: from the outbox, or else the newest copy in the published
    /// history. `None` when neither has it.
    pub async fn event_detail(
        &self,
        event_id: uuid::Uuid,
    ) -> Result<Option<EventDetail>, StoreError> {
        let row = self
            .connection()
            .query_one_raw(stmt(
                &format!(
                    "SELECT * FROM ( \
                       SELECT {SUMMARY_COLUMNS}, schema_version, {OCCURRED}, payload, headers, \
                              last_error, destination, partition, next_attempt_at, \
                              published_at, stream_id, 0 AS rank \
                       FROM outpost_event WHERE event_id = $1 \
                       UNION ALL \
                       (SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, \
                              event_type, 'published', attempts, NULL, recorded_at, \
                              schema_version, {OCCURRED}, payload, headers, NULL, destination, \
                              partition, NULL, published_at, stream_id, 1 \
                        FROM outpost_published WHERE event_id = $1 ORDER BY id DESC LIMIT 1) \
                     ) e ORDER BY rank LIMIT 1"
                ),
                [event_id.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        let Some(r) = row else { return Ok(None) };
        let g = StoreError::from_db;
        let headers: serde_json::Value = r.try_get_by_index(13).map_err(g)?;
        let header = |k: &str| headers.get(k).and_then(|v| v.as_str()).map(str::to_owned);
        let trace = header("traceparent").map(|traceparent| TraceContext {
            traceparent,
            tracestate: header("tracestate"),
        });
        Ok(Some(EventDetail {
            summary: summary(&r)?,
            schema_version: r.try_get_by_index(10).map_err(g)?,
            occurred_at: r.try_get_by_index(11).map_err(g)?,
            payload: r.try_get_by_index(12).map_err(g)?,
            trace,
            headers,
            last_error: r.try_get_by_index(14).map_err(g)?,
            destination: r.try_get_by_index(15).map_err(g)?,
            partition: r.try_get_by_index(16).map_err(g)?,
            next_attempt_at: r.try_get_by_index(17).map_err(g)?,
            published_at: r.try_get_by_index(18).map_err(g)?,
            stream_id: r.try_get_by_index(19).map_err(g)?,
        }))
    }
}

/// `occurred_at`, or NULL for a time outside the years 1 to 9999 (which cannot be decoded).
const OCCURRED: &str = "CASE WHEN occurred_at BETWEEN '0001-01-01 00:00:00+00' \
     AND '9999-12-31 23:59:59.999999+00' THEN occurred_at END";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn conditions_bind_every_value_and_write_only_known_states() {
        let f = EventFilter {
            state: Some(EventState::Quarantined),
            event_type: Some("x'; DROP TABLE outpost_event; --".to_owned()),
            aggregate_type: Some("order".to_owned()),
            aggregate_id: Some("o-1".to_owned()),
            error_code: Some("WRONGTYPE".to_owned()),
            ..EventFilter::default()
        };
        let mut values = Vec::new();
        let sql = f.conditions(&mut values);
        assert_eq!(
            sql,
            "true AND status = 'quarantined' AND event_type = $1 AND aggregate_type = $2 \
             AND aggregate_id = $3 AND outpost_error_code(last_error) = $4"
        );
        assert_eq!(values.len(), 4);
        assert!(f.check().is_ok());
        assert!("gone".parse::<EventState>().is_err());
        for s in EventState::ALL {
            assert_eq!(s.as_str().parse::<EventState>(), Ok(s));
        }
    }

    #[test]
    fn a_filter_that_cannot_match_says_what_to_change() {
        let f = EventFilter {
            aggregate_id: Some("o-1".to_owned()),
            ..EventFilter::default()
        };
        assert!(f.check().unwrap_err().contains("aggregate_type"));
        let now = Utc::now();
        let f = EventFilter {
            recorded_from: Some(now),
            recorded_to: Some(now),
            ..EventFilter::default()
        };
        assert!(f.check().unwrap_err().contains("empty"));
        let f = EventFilter {
            event_type: Some(String::new()),
            ..EventFilter::default()
        };
        assert!(f.check().unwrap_err().contains("event_type"));
    }
}
