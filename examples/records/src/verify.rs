//! The verdict: after the writers stopped and the relay and the consumer drained, does what was
//! delivered and applied match what was committed?
//!
//! - every committed fact (the outbox and the published history) was applied once, none
//!   twice, nothing applied that was not committed;
//! - each record's events were applied in their sequence order, without a gap;
//! - every mutation whose declared content changed has its event, and no other mutation has one
//!   (recomputed from the history's before and after images, not from what the writer said);
//! - the read model equals what the source rows say.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
};
use uuid::Uuid;

use crate::model::{applied, history, link, record, view};
use crate::service::{AGGREGATE, Action, declared_change};

/// Why the verdict could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Reading the database failed.
    #[error("reading the database: {0}")]
    Db(#[from] DbErr),
    /// A history row names an action the application does not know.
    #[error("history row {0} has an unknown action {1:?}")]
    UnknownAction(i64, String),
    /// A history row's images could not be compared.
    #[error("history row {0}: {1}")]
    Images(i64, outpost::produce::ProduceError),
}

/// The counts the verdict is made of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Event facts committed for the application's aggregate.
    pub committed: u64,
    /// Of these, published by the relay (moved to the published history).
    pub published: u64,
    /// Distinct events the consumer applied.
    pub applied: u64,
    /// Committed but never applied.
    pub lost: u64,
    /// Applied more than once.
    pub duplicates: u64,
    /// Applied but never committed.
    pub unexpected: u64,
    /// Aggregates whose events were applied out of sequence order or with a gap.
    pub out_of_order: u64,
    /// Mutations (history rows).
    pub mutations: u64,
    /// Mutations that changed only undeclared fields.
    pub undeclared_changes: u64,
    /// Of these, the ones that have an event (must be 0).
    pub undeclared_with_event: u64,
    /// Mutations whose declared content changed but that have no event (must be 0).
    pub declared_without_event: u64,
    /// Committed facts no mutation names (must be 0).
    pub facts_without_mutation: u64,
    /// Records in the source.
    pub records: u64,
    /// Links in the source.
    pub links: u64,
    /// Records whose view row differs from the source (or is missing, or is left over).
    pub view_mismatches: u64,
    /// A few of the mismatches, described.
    pub examples: Vec<String>,
}

impl Verdict {
    /// True when every check holds.
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.duplicates == 0
            && self.unexpected == 0
            && self.out_of_order == 0
            && self.undeclared_with_event == 0
            && self.declared_without_event == 0
            && self.facts_without_mutation == 0
            && self.view_mismatches == 0
    }

    fn example(&mut self, what: String) {
        if self.examples.len() < 5 {
            self.examples.push(what);
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "mutations committed        {}", self.mutations)?;
        writeln!(
            f,
            "  undeclared changes only  {} (events for them: {})",
            self.undeclared_changes, self.undeclared_with_event
        )?;
        writeln!(
            f,
            "  declared, but no event   {}",
            self.declared_without_event
        )?;
        writeln!(f, "event facts committed      {}", self.committed)?;
        writeln!(f, "  published                {}", self.published)?;
        writeln!(f, "  applied once             {}", self.applied)?;
        writeln!(f, "  lost                     {}", self.lost)?;
        writeln!(f, "  duplicates               {}", self.duplicates)?;
        writeln!(f, "  out of order             {}", self.out_of_order)?;
        writeln!(f, "  unexpected               {}", self.unexpected)?;
        writeln!(
            f,
            "  without a mutation       {}",
            self.facts_without_mutation
        )?;
        writeln!(
            f,
            "read model                 {} ({} records, {} links; {} differ)",
            if self.view_mismatches == 0 {
                "equals the source"
            } else {
                "DIFFERS from the source"
            },
            self.records,
            self.links,
            self.view_mismatches
        )?;
        for e in &self.examples {
            writeln!(f, "  e.g. {e}")?;
        }
        write!(
            f,
            "verdict: {} ({} lost, {} duplicates, {} out of order, {} events for undeclared \
             changes, {} declared changes without an event, read model {})",
            if self.passed() { "PASS" } else { "FAIL" },
            self.lost,
            self.duplicates,
            self.out_of_order,
            self.undeclared_with_event,
            self.declared_without_event,
            if self.view_mismatches == 0 {
                "equals the source"
            } else {
                "differs from the source"
            }
        )
    }
}

/// A committed fact, from the outbox or the published history.
#[derive(Debug, Clone)]
struct Fact {
    event_id: Uuid,
    aggregate_id: String,
    aggregate_seq: i64,
}

/// Reads everything and reaches the verdict. Call it once the writers stopped and the consumer
/// applied what it will apply.
pub async fn verify<C: ConnectionTrait>(db: &C) -> Result<Verdict, VerifyError> {
    let mut v = Verdict::default();

    // Committed facts.
    use entity::{outpost_event as outbox, outpost_published as published};
    let pending: Vec<(Uuid, String, i64)> = outbox::Entity::find()
        .select_only()
        .columns([
            outbox::Column::EventId,
            outbox::Column::AggregateId,
            outbox::Column::AggregateSeq,
        ])
        .filter(outbox::Column::AggregateType.eq(AGGREGATE))
        .into_tuple()
        .all(db)
        .await?;
    let done: Vec<(Uuid, String, i64)> = published::Entity::find()
        .select_only()
        .columns([
            published::Column::EventId,
            published::Column::AggregateId,
            published::Column::AggregateSeq,
        ])
        .filter(published::Column::AggregateType.eq(AGGREGATE))
        .into_tuple()
        .all(db)
        .await?;
    v.published = done.len() as u64;
    let facts: HashMap<Uuid, Fact> = pending
        .into_iter()
        .chain(done)
        .map(|(event_id, aggregate_id, aggregate_seq)| {
            (
                event_id,
                Fact {
                    event_id,
                    aggregate_id,
                    aggregate_seq,
                },
            )
        })
        .collect();
    v.committed = facts.len() as u64;

    // What the consumer applied, in the order it applied it.
    let applied_rows = applied::Entity::find()
        .order_by_asc(applied::Column::Id)
        .all(db)
        .await?;
    let mut seen: HashSet<Uuid> = HashSet::with_capacity(applied_rows.len());
    let mut last_seq: HashMap<&str, i64> = HashMap::new();
    let mut disordered: HashSet<&str> = HashSet::new();
    for a in &applied_rows {
        if !seen.insert(a.event_id) {
            v.duplicates += 1;
            v.example(format!("event {} applied twice", a.event_id));
        }
        if !facts.contains_key(&a.event_id) {
            v.unexpected += 1;
            v.example(format!("event {} applied but never committed", a.event_id));
        }
        let last = last_seq.entry(a.aggregate_id.as_str()).or_insert(0);
        if a.aggregate_seq != *last + 1 && disordered.insert(a.aggregate_id.as_str()) {
            v.example(format!(
                "record {} applied seq {} after {}",
                a.aggregate_id, a.aggregate_seq, last
            ));
        }
        *last = a.aggregate_seq;
    }
    v.out_of_order = disordered.len() as u64;
    v.applied = seen.len() as u64;
    for f in facts.values() {
        if !seen.contains(&f.event_id) {
            v.lost += 1;
            v.example(format!(
                "event {} (record {} seq {}) committed, never applied",
                f.event_id, f.aggregate_id, f.aggregate_seq
            ));
        }
    }

    // Every mutation has its event exactly when its declared content changed.
    let histories = history::Entity::find()
        .order_by_asc(history::Column::Id)
        .all(db)
        .await?;
    v.mutations = histories.len() as u64;
    let mut named: HashSet<Uuid> = HashSet::with_capacity(histories.len());
    for h in &histories {
        let action = Action::parse(&h.action)
            .ok_or_else(|| VerifyError::UnknownAction(h.id, h.action.clone()))?;
        let declared = declared_change(action, h.before.as_ref(), h.after.as_ref())
            .map_err(|e| VerifyError::Images(h.id, e))?;
        match (declared, h.event_id) {
            (true, None) => {
                v.declared_without_event += 1;
                v.example(format!(
                    "{} of {} changed declared content and has no event",
                    h.action, h.target_id
                ));
            }
            (false, Some(id)) => {
                v.undeclared_changes += 1;
                v.undeclared_with_event += 1;
                v.example(format!(
                    "{} of {} changed no declared field but has event {id}",
                    h.action, h.target_id
                ));
            }
            (false, None) => v.undeclared_changes += 1,
            (true, Some(_)) => {}
        }
        if let Some(id) = h.event_id {
            named.insert(id);
            if !facts.contains_key(&id) {
                v.lost += 1;
                v.example(format!(
                    "{} of {} names event {id}, which is not committed",
                    h.action, h.target_id
                ));
            }
        }
    }
    for f in facts.values() {
        if !named.contains(&f.event_id) {
            v.facts_without_mutation += 1;
            v.example(format!("event {} belongs to no mutation", f.event_id));
        }
    }

    // The read model against the source rows.
    let records = record::Entity::find().all(db).await?;
    let links = link::Entity::find().all(db).await?;
    v.records = records.len() as u64;
    v.links = links.len() as u64;
    let mut link_count: HashMap<Uuid, i64> = HashMap::new();
    for l in &links {
        *link_count.entry(l.from_id).or_default() += 1;
        *link_count.entry(l.to_id).or_default() += 1;
    }
    let mut views: BTreeMap<Uuid, view::Model> = view::Entity::find()
        .all(db)
        .await?
        .into_iter()
        .map(|r| (r.record_id, r))
        .collect();
    for r in &records {
        let expected_links = link_count.get(&r.id).copied().unwrap_or(0);
        match views.remove(&r.id) {
            None => {
                v.view_mismatches += 1;
                v.example(format!("record {} has no view row", r.id));
            }
            Some(row) => {
                let same = row.kind.as_deref() == Some(r.kind.as_str())
                    && row.title.as_deref() == Some(r.title.as_str())
                    && row.status.as_deref() == Some(r.status.as_str())
                    && row.links == expected_links
                    && !row.deleted;
                if !same {
                    v.view_mismatches += 1;
                    v.example(format!(
                        "record {}: source ({}, {:?}, {}, {} links), view ({:?}, {:?}, {:?}, {} links{})",
                        r.id,
                        r.kind,
                        r.title,
                        r.status,
                        expected_links,
                        row.kind,
                        row.title,
                        row.status,
                        row.links,
                        if row.deleted { ", deleted" } else { "" }
                    ));
                }
            }
        }
    }
    // What is left in the view are records the source no longer has: deleted, without links.
    for (id, row) in views {
        if !row.deleted || row.links != 0 {
            v.view_mismatches += 1;
            v.example(format!(
                "record {id} is gone from the source, its view row is {}deleted with {} links",
                if row.deleted { "" } else { "not " },
                row.links
            ));
        }
    }
    Ok(v)
}
