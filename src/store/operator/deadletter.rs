//! Replaying and discarding quarantined events, by selection or by filter, each with its audit row
//! in the same transaction.
//!
//! Both actions take the events' aggregates' locks first, in key order (the order in which the
//! relay and the producer API take them), then change the events, then set each aggregate's
//! `blocked_seq` again from its events still failing (`retry_wait` or `quarantined`; NULL when
//! none is), and finally release the aggregate's `held` events that come before it, all of them
//! when it is NULL. So a replayed event and the successors that waited for it are `pending` again
//! together, keep their event ids and are claimed in id order, which is sequence order; a
//! discarded event stops holding its successors back, like an event routed nowhere. A replayed
//! event behind another failing event of its aggregate becomes `held`, not `pending`.

use sea_orm::{ConnectionTrait, DatabaseTransaction, TransactionTrait};
use serde::Serialize;
use serde_json::json;

use super::super::sql::{num_array, text_array};
use super::super::{Store, StoreError, stmt};
use super::audit::{self, Actor, Role, refuse};
use super::search::{EventFilter, EventState};

/// Most events one bulk action changes: a filter matching more is refused (narrow it).
pub const MAX_BULK: u64 = 100_000;

/// Which events an action applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// These event ids; every one must be quarantined.
    Ids(Vec<uuid::Uuid>),
    /// Every quarantined event matching the filter, which the operator confirmed to be
    /// `expected` events: a different count at the time of the action refuses it.
    Matching {
        /// The filter (its state, when set, must be `quarantined`).
        filter: EventFilter,
        /// The count the operator saw and confirmed.
        expected: u64,
    },
}

/// What an action changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Outcome {
    /// Quarantined events replayed or discarded.
    pub events: u64,
    /// Held events of their aggregates released to `pending` with them.
    pub released: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Replay,
    Discard,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Replay => "event.replay",
            Action::Discard => "event.discard",
        }
    }
}

/// A quarantined row picked by a selection.
struct Target {
    id: i64,
    aggregate_type: String,
    aggregate_id: String,
}

impl Store {
    /// Replays quarantined events: `pending` again with a fresh attempt budget and the same
    /// event id, their aggregates' held successors released after them in sequence order.
    /// Needs the operator role; audited in the same transaction.
    pub async fn replay_events(
        &self,
        actor: &Actor,
        selection: &Selection,
        reason: &str,
    ) -> Result<Outcome, StoreError> {
        self.settle_dead_letters(Action::Replay, actor, selection, reason)
            .await
    }

    /// Discards quarantined events: `discarded` for good (aged out by the janitor
    /// `retention.discarded_secs` after now); their aggregates' held successors go on without
    /// them. Needs the operator role; audited in the same transaction.
    pub async fn discard_events(
        &self,
        actor: &Actor,
        selection: &Selection,
        reason: &str,
    ) -> Result<Outcome, StoreError> {
        self.settle_dead_letters(Action::Discard, actor, selection, reason)
            .await
    }

    async fn settle_dead_letters(
        &self,
        action: Action,
        actor: &Actor,
        selection: &Selection,
        reason: &str,
    ) -> Result<Outcome, StoreError> {
        let name = action.name();
        actor.require(Role::Operator, name)?;
        let reason = reason.trim();
        if reason.is_empty() || reason.len() > 1000 {
            return Err(refuse(
                actor,
                name,
                "input",
                "say why in a reason of 1 to 1,000 characters (it goes into the audit log)"
                    .to_owned(),
            ));
        }
        check_selection(actor, name, selection)?;
        let txn = self
            .connection()
            .begin()
            .await
            .map_err(StoreError::from_db)?;
        let targets = select_targets(&txn, actor, name, selection).await?;
        let outcome = apply(&txn, action, &targets).await?;
        if outcome.events != targets.len() as u64 {
            txn.rollback().await.map_err(StoreError::from_db)?;
            return Err(refuse(
                actor,
                name,
                "state",
                "some of the events changed state meanwhile; nothing was changed: search again"
                    .to_owned(),
            ));
        }
        audit::record(
            &txn,
            actor,
            name,
            "",
            audit_detail(selection, outcome, reason),
        )
        .await?;
        txn.commit().await.map_err(StoreError::from_db)?;
        tracing::info!(
            actor = %actor.name,
            role = %actor.role,
            action = name,
            events = outcome.events,
            released = outcome.released,
            "operator action done"
        );
        Ok(outcome)
    }
}

fn check_selection(actor: &Actor, name: &str, selection: &Selection) -> Result<(), StoreError> {
    let problem = match selection {
        Selection::Ids(ids) if ids.is_empty() => Some("select at least one event".to_owned()),
        Selection::Ids(ids) if ids.len() as u64 > MAX_BULK => Some(format!(
            "{} events selected; at most {MAX_BULK} at once",
            ids.len()
        )),
        Selection::Matching { filter, .. } => match filter.check() {
            Err(e) => Some(e),
            Ok(()) if filter.state.is_some_and(|s| s != EventState::Quarantined) => Some(format!(
                "only quarantined events can be replayed or discarded; the filter names state {}",
                filter.state.map_or("", EventState::as_str)
            )),
            Ok(()) => None,
        },
        Selection::Ids(_) => None,
    };
    match problem {
        Some(p) => Err(refuse(actor, name, "input", p)),
        None => Ok(()),
    }
}

/// The quarantined rows of the selection, refusing a selection that names an event that is not
/// quarantined or a filter whose count is not the confirmed one.
async fn select_targets(
    txn: &DatabaseTransaction,
    actor: &Actor,
    name: &str,
    selection: &Selection,
) -> Result<Vec<Target>, StoreError> {
    let (sql, values, expected) = match selection {
        Selection::Ids(ids) => {
            let ids: Vec<String> = ids.iter().map(uuid::Uuid::to_string).collect();
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            (
                "SELECT id, aggregate_type, aggregate_id FROM outpost_event \
                 WHERE event_id = ANY($1::uuid[]) AND status = 'quarantined' ORDER BY id"
                    .to_owned(),
                vec![text_array(&ids).into()],
                ids.len() as u64,
            )
        }
        Selection::Matching { filter, expected } => {
            let filter = EventFilter {
                state: Some(EventState::Quarantined),
                ..filter.clone()
            };
            let mut values = Vec::new();
            let cond = filter.conditions(&mut values);
            values.push(i64::try_from(MAX_BULK + 1).unwrap_or(i64::MAX).into());
            (
                format!(
                    "SELECT id, aggregate_type, aggregate_id FROM outpost_event WHERE {cond} \
                     ORDER BY id LIMIT ${}",
                    values.len()
                ),
                values,
                *expected,
            )
        }
    };
    let targets = txn
        .query_all_raw(stmt(&sql, values))
        .await
        .map_err(StoreError::from_db)?
        .into_iter()
        .map(|r| {
            Ok(Target {
                id: r.try_get_by_index(0).map_err(StoreError::from_db)?,
                aggregate_type: r.try_get_by_index(1).map_err(StoreError::from_db)?,
                aggregate_id: r.try_get_by_index(2).map_err(StoreError::from_db)?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    let found = targets.len() as u64;
    if found == expected {
        return Ok(targets);
    }
    let message = match selection {
        Selection::Ids(_) => format!(
            "{} of the {expected} selected events are not quarantined (or do not exist); \
             nothing was changed: `outpost dead-letter show <event id>` tells their state",
            expected - found.min(expected)
        ),
        Selection::Matching { .. } if found > MAX_BULK => {
            format!("more than {MAX_BULK} events match; nothing was changed: narrow the filter")
        }
        Selection::Matching { .. } => format!(
            "{found} events match the filter now, not the {expected} confirmed; nothing was \
             changed: look at the count again and confirm it"
        ),
    };
    let kind = if matches!(selection, Selection::Ids(_)) {
        "state"
    } else {
        "count"
    };
    Err(refuse(actor, name, kind, message))
}

/// Changes the targets and releases what their aggregates no longer hold back.
async fn apply(
    txn: &DatabaseTransaction,
    action: Action,
    targets: &[Target],
) -> Result<Outcome, StoreError> {
    if targets.is_empty() {
        return Ok(Outcome::default());
    }
    let mut keys: Vec<(&str, &str)> = targets
        .iter()
        .map(|t| (t.aggregate_type.as_str(), t.aggregate_id.as_str()))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    let types = text_array(&keys.iter().map(|k| k.0).collect::<Vec<_>>());
    let ids = text_array(&keys.iter().map(|k| k.1).collect::<Vec<_>>());
    let rows = num_array(&targets.iter().map(|t| t.id).collect::<Vec<_>>());
    txn.execute_raw(stmt(
        "SELECT 1 FROM outpost_aggregate a \
         JOIN unnest($1::text[], $2::text[]) AS v(t, i) \
           ON a.aggregate_type = v.t AND a.aggregate_id = v.i \
         ORDER BY a.aggregate_type, a.aggregate_id FOR UPDATE OF a",
        [types.clone().into(), ids.clone().into()],
    ))
    .await
    .map_err(StoreError::from_db)?;
    // A replayed row waits as `held` until the release below finds nothing before it failing.
    let set = match action {
        Action::Replay => "status = 'held', attempts = 0, next_attempt_at = now()",
        // A discarded row's next_attempt_at is when it was discarded: the janitor ages it out
        // from then.
        Action::Discard => "status = 'discarded', next_attempt_at = now()",
    };
    let changed = txn
        .execute_raw(stmt(
            &format!(
                "UPDATE outpost_event SET {set} \
                 WHERE id = ANY($1::int8[]) AND status = 'quarantined'"
            ),
            [rows.clone().into()],
        ))
        .await
        .map_err(StoreError::from_db)?
        .rows_affected();
    txn.execute_raw(stmt(
        "UPDATE outpost_aggregate a SET blocked_seq = ( \
           SELECT min(e.aggregate_seq) FROM outpost_event e \
           WHERE e.aggregate_type = a.aggregate_type AND e.aggregate_id = a.aggregate_id \
             AND e.status IN ('retry_wait', 'quarantined')) \
         FROM unnest($1::text[], $2::text[]) AS v(t, i) \
         WHERE a.aggregate_type = v.t AND a.aggregate_id = v.i",
        [types.clone().into(), ids.clone().into()],
    ))
    .await
    .map_err(StoreError::from_db)?;
    let released = txn
        .query_all_raw(stmt(
            "UPDATE outpost_event e SET status = 'pending', next_attempt_at = now() \
             FROM unnest($1::text[], $2::text[]) AS v(t, i) \
             JOIN outpost_aggregate a ON a.aggregate_type = v.t AND a.aggregate_id = v.i \
             WHERE e.aggregate_type = v.t AND e.aggregate_id = v.i AND e.status = 'held' \
               AND (a.blocked_seq IS NULL OR e.aggregate_seq < a.blocked_seq) \
             RETURNING e.id = ANY($3::int8[])",
            [types.into(), ids.into(), rows.into()],
        ))
        .await
        .map_err(StoreError::from_db)?;
    let mut successors = 0;
    for r in released {
        let replayed: bool = r.try_get_by_index(0).map_err(StoreError::from_db)?;
        if !replayed {
            successors += 1;
        }
    }
    Ok(Outcome {
        events: changed,
        released: successors,
    })
}

fn audit_detail(selection: &Selection, outcome: Outcome, reason: &str) -> serde_json::Value {
    let mut detail = match selection {
        Selection::Ids(ids) => json!({ "ids": ids }),
        Selection::Matching { filter, expected } => {
            json!({ "filter": filter, "confirmed": expected })
        }
    };
    detail["count"] = outcome.events.into();
    detail["released"] = outcome.released.into();
    detail["reason"] = reason.into();
    detail
}
