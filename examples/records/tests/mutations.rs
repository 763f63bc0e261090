//! Each mutation writes exactly its business row, audit row, history row and — when declared
//! content changed — one event fact; all or nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use entity::outpost_event;
use outpost::produce::Producer;
use outpost_records::model::{audit, history, link, record};
use outpost_records::service::{Action, NewRecord, RecordChange, Records, RecordsError};
use sea_orm::{DatabaseConnection, EntityTrait, PaginatorTrait, QueryOrder};
use support::TestDb;

/// Rows in each table that a mutation writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rows {
    records: u64,
    links: u64,
    audits: u64,
    histories: u64,
    events: u64,
}

async fn rows(db: &DatabaseConnection) -> Rows {
    Rows {
        records: record::Entity::find().count(db).await.unwrap(),
        links: link::Entity::find().count(db).await.unwrap(),
        audits: audit::Entity::find().count(db).await.unwrap(),
        histories: history::Entity::find().count(db).await.unwrap(),
        events: outpost_event::Entity::find().count(db).await.unwrap(),
    }
}

fn new_record(title: &str) -> NewRecord {
    NewRecord {
        kind: "account".to_owned(),
        title: title.to_owned(),
        status: "new".to_owned(),
        notes: "first note".to_owned(),
    }
}

async fn last_event(db: &DatabaseConnection) -> outpost_event::Model {
    outpost_event::Entity::find()
        .order_by_desc(outpost_event::Column::Id)
        .one(db)
        .await
        .unwrap()
        .expect("an event")
}

async fn last_history(db: &DatabaseConnection) -> history::Model {
    history::Entity::find()
        .order_by_desc(history::Column::Id)
        .one(db)
        .await
        .unwrap()
        .expect("a history row")
}

/// Checks that `after` is `before` plus one audit and one history row, `events` events,
/// and the business-row changes given.
fn assert_delta(what: &str, before: Rows, after: Rows, records: i64, links: i64, events: u64) {
    let expected = Rows {
        records: before.records.checked_add_signed(records).unwrap(),
        links: before.links.checked_add_signed(links).unwrap(),
        audits: before.audits + 1,
        histories: before.histories + 1,
        events: before.events + events,
    };
    assert_eq!(after, expected, "{what}: rows written");
}

#[tokio::test]
async fn each_mutation_writes_its_rows_and_an_event_only_for_declared_content() {
    let t = TestDb::new().await;
    let db = t.store.connection();
    let app = Records::new(db.clone(), Producer::default());

    let r0 = rows(db).await;
    let a = app.create("alice", new_record("Acme")).await.unwrap();
    let r1 = rows(db).await;
    assert_delta("create", r0, r1, 1, 0, 1);
    let ev = last_event(db).await;
    assert_eq!(
        (
            ev.event_type.as_str(),
            ev.aggregate_type.as_str(),
            ev.aggregate_id.clone()
        ),
        ("record.created", "record", a.target_id.to_string())
    );
    assert_eq!(Some(ev.event_id), a.event_id);
    let h = last_history(db).await;
    assert_eq!(
        (h.id, h.audit_id, h.event_id),
        (a.history_id, a.audit_id, a.event_id)
    );
    assert!(h.before.is_none());
    assert_eq!(h.after.as_ref().unwrap()["title"], "Acme");

    // Declared content (title): audit, history and an event.
    let change = RecordChange {
        title: Some("Acme Ltd".to_owned()),
        ..RecordChange::default()
    };
    let u = app.update("alice", a.target_id, change).await.unwrap();
    let r2 = rows(db).await;
    assert_delta("update of the title", r1, r2, 0, 0, 1);
    let ev = last_event(db).await;
    assert_eq!(ev.event_type, "record.changed");
    assert_eq!(ev.payload["changed"], serde_json::json!(["title"]));
    assert_eq!(ev.payload["before"]["title"], "Acme");
    assert_eq!(ev.payload["after"]["title"], "Acme Ltd");
    assert_eq!(Some(ev.event_id), u.event_id);

    // Only undeclared content (notes): audit and history, no event.
    let change = RecordChange {
        notes: Some("second note".to_owned()),
        ..RecordChange::default()
    };
    let n = app.update("bob", a.target_id, change).await.unwrap();
    let r3 = rows(db).await;
    assert_delta("update of the notes only", r2, r3, 0, 0, 0);
    assert_eq!(n.event_id, None);
    let h = last_history(db).await;
    assert_eq!(h.before.as_ref().unwrap()["notes"], "first note");
    assert_eq!(h.after.as_ref().unwrap()["notes"], "second note");
    assert_eq!(h.event_id, None);
    let audit_row = audit::Entity::find_by_id(n.audit_id)
        .one(db)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (audit_row.actor.as_str(), audit_row.action.as_str()),
        ("bob", Action::RecordUpdate.as_str())
    );

    let b = app.create("alice", new_record("Globex")).await.unwrap();
    let r4 = rows(db).await;
    assert_delta("second create", r3, r4, 1, 0, 1);

    let l = app
        .link("carol", a.target_id, b.target_id, "supplier")
        .await
        .unwrap();
    let r5 = rows(db).await;
    assert_delta("link", r4, r5, 0, 1, 1);
    let ev = last_event(db).await;
    assert_eq!(
        (ev.event_type.as_str(), ev.aggregate_id.clone()),
        ("record.linked", a.target_id.to_string())
    );
    assert_eq!(ev.payload["after"]["to_id"], b.target_id.to_string());

    // A linked record cannot be deleted; nothing is written.
    let refused = app.delete("carol", b.target_id).await;
    assert!(matches!(refused, Err(RecordsError::HasLinks(id)) if id == b.target_id));
    assert_eq!(rows(db).await, r5, "a refused delete writes nothing");
    // A link to a record that does not exist is refused; nothing is written.
    let nowhere = uuid::Uuid::now_v7();
    let refused = app.link("carol", a.target_id, nowhere, "supplier").await;
    assert!(matches!(refused, Err(RecordsError::LinkEndMissing { to, .. }) if to == nowhere));
    assert_eq!(rows(db).await, r5, "a refused link writes nothing");

    app.unlink("carol", l.target_id).await.unwrap();
    let r6 = rows(db).await;
    assert_delta("unlink", r5, r6, 0, -1, 1);
    assert_eq!(last_event(db).await.event_type, "record.unlinked");

    let d = app.delete("carol", b.target_id).await.unwrap();
    let r7 = rows(db).await;
    assert_delta("delete", r6, r7, -1, 0, 1);
    let ev = last_event(db).await;
    assert_eq!(
        (ev.event_type.as_str(), ev.aggregate_id.clone()),
        ("record.deleted", b.target_id.to_string())
    );
    assert_eq!(Some(ev.event_id), d.event_id);
    // Per record, the events carry the gap-free sequence 1, 2, 3, … in commit order.
    let seqs: Vec<i64> = outpost_event::Entity::find()
        .order_by_asc(outpost_event::Column::Id)
        .all(db)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.aggregate_id == a.target_id.to_string())
        .map(|e| e.aggregate_seq)
        .collect();
    assert_eq!(seqs, vec![1, 2, 3, 4]);
}

/// With the `records-after-writes` fault point armed, every mutation fails after its four rows
/// were written, and none of them is left: not the business row, the audit row, the history row
/// nor the event.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_failure_after_the_event_insert_leaves_none_of_the_rows() {
    let t = TestDb::new().await;
    let db = t.store.connection();
    let app = Records::new(db.clone(), Producer::default());
    let a = app.create("alice", new_record("Acme")).await.unwrap();
    let b = app.create("alice", new_record("Globex")).await.unwrap();
    let l = app
        .link("alice", a.target_id, b.target_id, "supplier")
        .await
        .unwrap();
    let c = app.create("alice", new_record("Initech")).await.unwrap();
    let before = rows(db).await;
    let record_a = record::Entity::find_by_id(a.target_id)
        .one(db)
        .await
        .unwrap();

    let scenario = fail::FailScenario::setup();
    fail::cfg("records-after-writes", "return").unwrap();
    let declared = RecordChange {
        title: Some("changed".to_owned()),
        status: Some("open".to_owned()),
        notes: Some("changed".to_owned()),
    };
    let outcomes = [
        (
            "create",
            app.create("alice", new_record("Umbrella")).await.err(),
        ),
        (
            "update",
            app.update("alice", a.target_id, declared).await.err(),
        ),
        (
            "link",
            app.link("alice", b.target_id, a.target_id, "x").await.err(),
        ),
        ("unlink", app.unlink("alice", l.target_id).await.err()),
        ("delete", app.delete("alice", c.target_id).await.err()),
    ];
    scenario.teardown();
    for (what, err) in outcomes {
        assert!(
            matches!(err, Some(RecordsError::Fault("records-after-writes"))),
            "{what}: {err:?}"
        );
    }
    assert_eq!(
        rows(db).await,
        before,
        "nothing of the failed mutations is left"
    );
    assert_eq!(
        record::Entity::find_by_id(a.target_id)
            .one(db)
            .await
            .unwrap(),
        record_a,
        "the failed update left the record as it was"
    );
    // Without the fault, the same mutations go through.
    let change = RecordChange {
        title: Some("changed".to_owned()),
        ..RecordChange::default()
    };
    app.update("alice", a.target_id, change).await.unwrap();
    assert_eq!(rows(db).await.events, before.events + 1);
}
