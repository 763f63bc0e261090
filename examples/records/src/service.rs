//! The mutations. Each one is one transaction that writes the business row, an audit row, a
//! history row (before and after) and — when a declared field changed — the event fact, through
//! Outpost's producer API. Either all of them commit or none does.

use std::sync::LazyLock;

use chrono::Utc;
use outpost::produce::{Declaration, ProduceError, Producer};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, DatabaseConnection, DatabaseTransaction, DbErr, EntityTrait,
    ExprTrait, IntoActiveModel, PaginatorTrait, QueryFilter, QuerySelect, Set, SqlErr,
    TransactionTrait,
};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::model::{audit, history, link, record};

/// The aggregate type of every event the application emits: a record's events, and the events
/// of the links leaving it, are ordered together.
pub const AGGREGATE: &str = "record";

/// The mutations, as the audit and history rows name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A record was created (`record.created`).
    RecordCreate,
    /// A record was changed (`record.changed`, only when `title` or `status` changed).
    RecordUpdate,
    /// A record was deleted (`record.deleted`).
    RecordDelete,
    /// A link was created (`record.linked`, on the aggregate of the record it leaves).
    LinkCreate,
    /// A link was removed (`record.unlinked`).
    LinkDelete,
}

impl Action {
    /// Every action.
    pub const ALL: [Action; 5] = [
        Action::RecordCreate,
        Action::RecordUpdate,
        Action::RecordDelete,
        Action::LinkCreate,
        Action::LinkDelete,
    ];

    /// The name written in the audit and history rows.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::RecordCreate => "record.create",
            Action::RecordUpdate => "record.update",
            Action::RecordDelete => "record.delete",
            Action::LinkCreate => "link.create",
            Action::LinkDelete => "link.delete",
        }
    }

    /// The action named `name` in an audit or history row.
    pub fn parse(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.as_str() == name)
    }

    /// `record` or `link`.
    pub fn target_type(self) -> &'static str {
        match self {
            Action::RecordCreate | Action::RecordUpdate | Action::RecordDelete => "record",
            Action::LinkCreate | Action::LinkDelete => "link",
        }
    }

    /// The declared content of the action's event: which fields of the row before and after
    /// make up the event, and so decide whether there is one.
    pub fn declaration(self) -> &'static Declaration {
        let d = &*DECLARATIONS;
        match self {
            Action::RecordCreate => &d.created,
            Action::RecordUpdate => &d.changed,
            Action::RecordDelete => &d.deleted,
            Action::LinkCreate => &d.linked,
            Action::LinkDelete => &d.unlinked,
        }
    }
}

struct Declarations {
    created: Declaration,
    changed: Declaration,
    deleted: Declaration,
    linked: Declaration,
    unlinked: Declaration,
}

static DECLARATIONS: LazyLock<Declarations> = LazyLock::new(|| {
    let record_fields = ["kind", "title", "status"];
    let link_fields = ["id", "from_id", "to_id", "kind"];
    Declarations {
        created: Declaration::new(AGGREGATE, "record.created", &record_fields),
        // `notes` and `version` are not event content: a change to them alone emits nothing.
        changed: Declaration::new(AGGREGATE, "record.changed", &["title", "status"]),
        deleted: Declaration::new(AGGREGATE, "record.deleted", &record_fields),
        linked: Declaration::new(AGGREGATE, "record.linked", &link_fields),
        unlinked: Declaration::new(AGGREGATE, "record.unlinked", &link_fields),
    }
});

/// Why a mutation did not happen. Nothing of it was written.
#[derive(Debug, thiserror::Error)]
pub enum RecordsError {
    /// The record does not exist (any more).
    #[error("record {0} does not exist")]
    RecordNotFound(Uuid),
    /// One end of a new link does not exist (any more).
    #[error("record {from} or record {to} does not exist: a link needs both")]
    LinkEndMissing {
        /// The record the link leaves.
        from: Uuid,
        /// The record it points to.
        to: Uuid,
    },
    /// The link does not exist (any more).
    #[error("link {0} does not exist")]
    LinkNotFound(Uuid),
    /// The record still has links.
    #[error("record {0} still has links: unlink them before deleting it")]
    HasLinks(Uuid),
    /// The database refused or failed a statement (the transaction was rolled back).
    #[error("database: {0}")]
    Db(#[from] DbErr),
    /// The producer API refused the event (the transaction was rolled back).
    #[error("event fact: {0}")]
    Produce(#[from] ProduceError),
    /// A row could not be encoded for the history.
    #[error("cannot encode the row for the history: {0}")]
    Encode(#[from] serde_json::Error),
    /// A fault point armed by a test failed the transaction.
    #[error("fault injected at {0}")]
    Fault(&'static str),
}

/// What a committed mutation wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mutation {
    /// What it was.
    pub action: Action,
    /// The record or link.
    pub target_id: Uuid,
    /// Its audit row.
    pub audit_id: i64,
    /// Its history row.
    pub history_id: i64,
    /// Its event, or `None` when no declared field changed.
    pub event_id: Option<Uuid>,
}

/// A new record.
#[derive(Debug, Clone)]
pub struct NewRecord {
    /// The record's kind (its custom object type), e.g. `account`.
    pub kind: String,
    /// Declared content.
    pub title: String,
    /// Declared content.
    pub status: String,
    /// Not declared.
    pub notes: String,
}

/// A change to a record; `None` leaves a field as it is.
#[derive(Debug, Clone, Default)]
pub struct RecordChange {
    /// Declared content.
    pub title: Option<String>,
    /// Declared content.
    pub status: Option<String>,
    /// Not declared: changing only this writes audit and history but no event.
    pub notes: Option<String>,
}

/// Whether mutations write their event facts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Events {
    /// The application as designed: an event for every change of declared content.
    Emit,
    /// The same transactions without the event fact (history rows name no event): the
    /// baseline `outpost-records bench` measures the fact's cost against.
    Omit,
}

/// The application's write side.
#[derive(Debug, Clone)]
pub struct Records {
    db: DatabaseConnection,
    producer: Producer,
    events: Events,
}

impl Records {
    /// Mutations on `db` (migrated, tables created), writing events with `producer`.
    pub fn new(db: DatabaseConnection, producer: Producer) -> Self {
        Self::with_events(db, producer, Events::Emit)
    }

    /// Mutations that write their events or not.
    pub fn with_events(db: DatabaseConnection, producer: Producer, events: Events) -> Self {
        Self {
            db,
            producer,
            events,
        }
    }

    /// Creates a record.
    pub async fn create(&self, actor: &str, new: NewRecord) -> Result<Mutation, RecordsError> {
        let txn = self.db.begin().await?;
        let now = Utc::now().fixed_offset();
        let row = record::ActiveModel {
            id: Set(Uuid::now_v7()),
            kind: Set(new.kind),
            title: Set(new.title),
            status: Set(new.status),
            notes: Set(new.notes),
            version: Set(1),
            updated_at: Set(now),
        }
        .insert(&txn)
        .await?;
        let m = self
            .bookkeeping(
                &txn,
                actor,
                Action::RecordCreate,
                row.id,
                row.id,
                None,
                Some(&row),
            )
            .await?;
        commit(txn, m).await
    }

    /// Changes a record.
    pub async fn update(
        &self,
        actor: &str,
        id: Uuid,
        change: RecordChange,
    ) -> Result<Mutation, RecordsError> {
        let txn = self.db.begin().await?;
        let before = record::Entity::find_by_id(id)
            .lock_exclusive()
            .one(&txn)
            .await?
            .ok_or(RecordsError::RecordNotFound(id))?;
        let mut row = before.clone().into_active_model();
        if let Some(t) = change.title {
            row.title = Set(t);
        }
        if let Some(s) = change.status {
            row.status = Set(s);
        }
        if let Some(n) = change.notes {
            row.notes = Set(n);
        }
        row.version = Set(before.version + 1);
        row.updated_at = Set(Utc::now().fixed_offset());
        let after = row.update(&txn).await?;
        let m = self
            .bookkeeping(
                &txn,
                actor,
                Action::RecordUpdate,
                id,
                id,
                Some(&before),
                Some(&after),
            )
            .await?;
        commit(txn, m).await
    }

    /// Deletes a record that has no links.
    pub async fn delete(&self, actor: &str, id: Uuid) -> Result<Mutation, RecordsError> {
        let txn = self.db.begin().await?;
        // The row lock makes a concurrent link to this record wait for the outcome (its foreign
        // key check needs a share lock), so the count below stays true until the commit.
        let before = record::Entity::find_by_id(id)
            .lock_exclusive()
            .one(&txn)
            .await?
            .ok_or(RecordsError::RecordNotFound(id))?;
        let links = link::Entity::find()
            .filter(link::Column::FromId.eq(id).or(link::Column::ToId.eq(id)))
            .count(&txn)
            .await?;
        if links > 0 {
            return Err(RecordsError::HasLinks(id));
        }
        record::Entity::delete_by_id(id)
            .exec(&txn)
            .await
            .map_err(|e| fk_to(e, RecordsError::HasLinks(id)))?;
        let m = self
            .bookkeeping(
                &txn,
                actor,
                Action::RecordDelete,
                id,
                id,
                Some(&before),
                None,
            )
            .await?;
        commit(txn, m).await
    }

    /// Links record `from` to record `to`. The event belongs to `from`'s aggregate.
    pub async fn link(
        &self,
        actor: &str,
        from: Uuid,
        to: Uuid,
        kind: &str,
    ) -> Result<Mutation, RecordsError> {
        let txn = self.db.begin().await?;
        let row = link::ActiveModel {
            id: Set(Uuid::now_v7()),
            from_id: Set(from),
            to_id: Set(to),
            kind: Set(kind.to_owned()),
            created_at: Set(Utc::now().fixed_offset()),
        }
        .insert(&txn)
        .await
        .map_err(|e| fk_to(e, RecordsError::LinkEndMissing { from, to }))?;
        let m = self
            .bookkeeping(
                &txn,
                actor,
                Action::LinkCreate,
                row.id,
                from,
                None,
                Some(&row),
            )
            .await?;
        commit(txn, m).await
    }

    /// Removes a link.
    pub async fn unlink(&self, actor: &str, link_id: Uuid) -> Result<Mutation, RecordsError> {
        let txn = self.db.begin().await?;
        let before = link::Entity::find_by_id(link_id)
            .lock_exclusive()
            .one(&txn)
            .await?
            .ok_or(RecordsError::LinkNotFound(link_id))?;
        link::Entity::delete_by_id(link_id).exec(&txn).await?;
        let m = self
            .bookkeeping(
                &txn,
                actor,
                Action::LinkDelete,
                link_id,
                before.from_id,
                Some(&before),
                None,
            )
            .await?;
        commit(txn, m).await
    }

    /// The audit row, the event (when declared content changed) and the history row.
    #[allow(clippy::too_many_arguments)] // each is one fact of the mutation
    async fn bookkeeping<T: Serialize>(
        &self,
        txn: &DatabaseTransaction,
        actor: &str,
        action: Action,
        target_id: Uuid,
        aggregate: Uuid,
        before: Option<&T>,
        after: Option<&T>,
    ) -> Result<Mutation, RecordsError> {
        let now = Utc::now().fixed_offset();
        let audit = audit::ActiveModel {
            actor: Set(actor.to_owned()),
            action: Set(action.as_str().to_owned()),
            target_type: Set(action.target_type().to_owned()),
            target_id: Set(target_id),
            at: Set(now),
            ..Default::default()
        }
        .insert(txn)
        .await?;
        // The fault point is consulted only for mutations that must emit an event.
        let declared = action.declaration().diff(before, after)?.is_some();
        let event_id = if self.events == Events::Omit || (declared && skip_event()) {
            None
        } else {
            self.producer
                .enqueue_declared(
                    txn,
                    action.declaration(),
                    &aggregate.to_string(),
                    before,
                    after,
                )
                .await?
                .map(|e| e.event_id)
        };
        let history = history::ActiveModel {
            audit_id: Set(audit.id),
            action: Set(action.as_str().to_owned()),
            target_type: Set(action.target_type().to_owned()),
            target_id: Set(target_id),
            before: Set(before.map(serde_json::to_value).transpose()?),
            after: Set(after.map(serde_json::to_value).transpose()?),
            event_id: Set(event_id),
            at: Set(now),
            ..Default::default()
        }
        .insert(txn)
        .await?;
        fault_after_writes()?;
        Ok(Mutation {
            action,
            target_id,
            audit_id: audit.id,
            history_id: history.id,
            event_id,
        })
    }
}

async fn commit(txn: DatabaseTransaction, m: Mutation) -> Result<Mutation, RecordsError> {
    txn.commit().await?;
    Ok(m)
}

/// A foreign key violation becomes `instead`; anything else stays a database error.
fn fk_to(err: DbErr, instead: RecordsError) -> RecordsError {
    match err.sql_err() {
        Some(SqlErr::ForeignKeyConstraintViolation(_)) => instead,
        _ => RecordsError::Db(err),
    }
}

/// The `records-skip-event` fault point: the mutation writes its other rows but no event, as a
/// broken application would. Only the test that proves the demo's verdict catches such a
/// mutation arms it.
fn skip_event() -> bool {
    fail::fail_point!("records-skip-event", |_| true);
    false
}

/// The `records-after-writes` fault point: fails the transaction after all four rows were
/// written, before the commit.
fn fault_after_writes() -> Result<(), RecordsError> {
    fail::fail_point!("records-after-writes", |_| Err(RecordsError::Fault(
        "records-after-writes"
    )));
    Ok(())
}

/// The declared content that changed between two row images (as the history stores them), for
/// the verdict: `None` when no declared field changed, so no event may exist.
pub fn declared_change(
    action: Action,
    before: Option<&Value>,
    after: Option<&Value>,
) -> Result<bool, ProduceError> {
    Ok(action.declaration().diff(before, after)?.is_some())
}
