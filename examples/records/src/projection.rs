//! The consumer's side: a handler that keeps `record_view` (each record's last declared state
//! and its link count) from the `record` events, through Outpost's consumer helpers — which open
//! the transaction, check the aggregate's sequence, record the event in the inbox, commit and
//! only then acknowledge. So each event is applied exactly once, in order per record.

use outpost::consume::{
    ConsumeError, Consumer, ConsumerSettings, ConsumerStats, Delivery, Handler, HandlerError,
};
use sea_orm::sea_query::{Expr, ExprTrait, OnConflict};
use sea_orm::{ActiveModelTrait, DatabaseConnection, DatabaseTransaction, EntityTrait, Set};
use serde::Deserialize;
use uuid::Uuid;

use crate::model::{applied, view};
use crate::service::AGGREGATE;

/// The consumer group that keeps the read model.
pub const GROUP: &str = "record-view";

/// The stream the relay writes the application's events to, under the default routing
/// template `events:{aggregate_type}`.
pub fn stream() -> String {
    format!("events:{AGGREGATE}")
}

/// Applies `record` events to `record_view` and logs each in `record_applied`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Projection;

/// A record event's payload, as declared content writes it: the changed fields before and after.
#[derive(Debug, Deserialize)]
struct Change {
    #[serde(default)]
    after: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    before: serde_json::Map<String, serde_json::Value>,
}

impl Change {
    fn after_str(&self, field: &str) -> Option<String> {
        self.after
            .get(field)
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    }

    /// The other end of a link, from whichever side holds the link's fields.
    fn link_ends(&self) -> Result<(Uuid, Uuid), HandlerError> {
        let side = if self.after.is_empty() || self.after.get("to_id").is_some_and(|v| v.is_null())
        {
            &self.before
        } else {
            &self.after
        };
        let id = |f: &str| {
            side.get(f)
                .and_then(|v| v.as_str())
                .and_then(|s| Uuid::parse_str(s).ok())
                .ok_or_else(|| HandlerError::permanent(format!("link event without {f}")))
        };
        Ok((id("from_id")?, id("to_id")?))
    }
}

impl Handler for Projection {
    async fn handle(
        &self,
        event: &Delivery,
        txn: &DatabaseTransaction,
    ) -> Result<(), HandlerError> {
        let record_id = Uuid::parse_str(&event.aggregate_id).map_err(|e| {
            HandlerError::permanent(format!("aggregate id {:?}: {e}", event.aggregate_id))
        })?;
        let change: Change = event.payload()?;
        match event.event_type.as_str() {
            "record.created" => {
                let fields = Fields {
                    kind: Some(change.after_str("kind")),
                    title: Some(change.after_str("title")),
                    status: Some(change.after_str("status")),
                    deleted: false,
                };
                upsert(txn, record_id, event.aggregate_seq, fields).await?;
            }
            "record.changed" => {
                let field = |f: &str| change.after.contains_key(f).then(|| change.after_str(f));
                let fields = Fields {
                    title: field("title"),
                    status: field("status"),
                    ..Fields::default()
                };
                upsert(txn, record_id, event.aggregate_seq, fields).await?;
            }
            "record.deleted" => {
                let fields = Fields {
                    deleted: true,
                    ..Fields::default()
                };
                upsert(txn, record_id, event.aggregate_seq, fields).await?;
            }
            "record.linked" | "record.unlinked" => {
                let delta = if event.event_type == "record.linked" {
                    1
                } else {
                    -1
                };
                let (from, to) = change.link_ends()?;
                // Both ends in one order everywhere, so two links applied at once cannot
                // deadlock on each other's rows.
                let (first, second) = if from <= to { (from, to) } else { (to, from) };
                for id in [first, second] {
                    let own = id == record_id;
                    add_links(txn, id, delta, own.then_some(event.aggregate_seq)).await?;
                }
            }
            other => {
                return Err(HandlerError::permanent(format!(
                    "unknown event type {other:?}"
                )));
            }
        }
        applied::ActiveModel {
            event_id: Set(event.event_id),
            aggregate_id: Set(event.aggregate_id.clone()),
            aggregate_seq: Set(event.aggregate_seq),
            event_type: Set(event.event_type.clone()),
            stream_id: Set(event.stream_id.clone()),
            ..Default::default()
        }
        .insert(txn)
        .await?;
        Ok(())
    }
}

/// The view fields an event sets; `None` leaves a field as it is.
#[derive(Debug, Default)]
struct Fields {
    kind: Option<Option<String>>,
    title: Option<Option<String>>,
    status: Option<Option<String>>,
    deleted: bool,
}

/// Writes the record's view row: the event's fields, one more event applied at sequence `seq`;
/// a row not there yet (a link to the record was applied first) is created.
async fn upsert(
    txn: &DatabaseTransaction,
    id: Uuid,
    seq: i64,
    fields: Fields,
) -> Result<(), HandlerError> {
    let mut updates = vec![view::Column::LastSeq];
    for (col, touched) in [
        (view::Column::Kind, fields.kind.is_some()),
        (view::Column::Title, fields.title.is_some()),
        (view::Column::Status, fields.status.is_some()),
        (view::Column::Deleted, fields.deleted),
    ] {
        if touched {
            updates.push(col);
        }
    }
    let row = view::ActiveModel {
        record_id: Set(id),
        kind: Set(fields.kind.flatten()),
        title: Set(fields.title.flatten()),
        status: Set(fields.status.flatten()),
        links: Set(0),
        deleted: Set(fields.deleted),
        events: Set(1),
        last_seq: Set(seq),
    };
    let mut on_conflict = OnConflict::column(view::Column::RecordId);
    on_conflict.update_columns(updates).value(
        view::Column::Events,
        Expr::col((view::Entity, view::Column::Events)).add(1),
    );
    view::Entity::insert(row)
        .on_conflict(on_conflict)
        .exec(txn)
        .await?;
    Ok(())
}

/// Adds `delta` to a record's link count (creating its row when the link is applied before the
/// record's creation); `own_seq` is the event's sequence when the record is the event's own
/// aggregate.
async fn add_links(
    txn: &DatabaseTransaction,
    id: Uuid,
    delta: i64,
    own_seq: Option<i64>,
) -> Result<(), HandlerError> {
    let row = view::ActiveModel {
        record_id: Set(id),
        kind: Set(None),
        title: Set(None),
        status: Set(None),
        links: Set(delta),
        deleted: Set(false),
        events: Set(i64::from(own_seq.is_some())),
        last_seq: Set(own_seq.unwrap_or(0)),
    };
    let mut on_conflict = OnConflict::column(view::Column::RecordId);
    on_conflict.value(
        view::Column::Links,
        Expr::col((view::Entity, view::Column::Links)).add(delta),
    );
    if own_seq.is_some() {
        on_conflict
            .value(
                view::Column::Events,
                Expr::col((view::Entity, view::Column::Events)).add(1),
            )
            .update_column(view::Column::LastSeq);
    }
    view::Entity::insert(row)
        .on_conflict(on_conflict)
        .exec(txn)
        .await?;
    Ok(())
}

/// Where the consumer reads and how it is named.
#[derive(Debug, Clone)]
pub struct ConsumerTarget {
    /// `redis.url`.
    pub redis_url: String,
    /// `redis.key_prefix`.
    pub key_prefix: String,
    /// This member's name.
    pub member: String,
}

/// Connects a consumer of the application's stream, as a member of [`GROUP`], applying to `db`
/// (which holds the read model, the inbox and the positions).
pub async fn connect(
    target: &ConsumerTarget,
    db: DatabaseConnection,
) -> Result<Consumer<Projection>, ConsumeError> {
    // The relay writes the stream under `redis.key_prefix`; the helper takes the full key.
    let key = format!("{}{}", target.key_prefix, stream());
    let mut settings = ConsumerSettings::new(target.redis_url.clone(), key, GROUP);
    settings.key_prefix = target.key_prefix.clone();
    settings.consumer = target.member.clone();
    Consumer::connect(settings, db, Projection).await
}

/// Runs a consumer until `stop` completes, then returns what it did.
pub async fn run(
    target: &ConsumerTarget,
    db: DatabaseConnection,
    stop: impl std::future::Future<Output = ()>,
) -> Result<ConsumerStats, ConsumeError> {
    let consumer = connect(target, db).await?;
    consumer.run_until(stop).await
}
