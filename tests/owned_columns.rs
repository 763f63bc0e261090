//! Columns Outpost owns cannot be written by a producer. A plain `INSERT` that names its own
//! transaction's `txid` (which used to make the insert trigger step aside) together with an id,
//! a sequence, a partition or a delivery state of its choosing is refused with an error that
//! says what to leave out; the aggregate's next writer, the relay's marks and the claim are
//! unaffected. The producer API's statement for many events still writes its own rows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::produce::{EventFact, Producer};
use outpost::store::StoreError;
use sea_orm::{ConnectionTrait, TransactionTrait};
use serde_json::json;
use support::{TestDb, commit_facts, scalar};

/// A plain-SQL producer's insert for aggregate `order`/`o-1` that names its own transaction's
/// `txid` and the owned `columns` with `values`.
async fn forge(db: &TestDb, columns: &str, values: &str) -> Result<(), StoreError> {
    db.store
        .connection()
        .execute_unprepared(&format!(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, txid, \
             {columns}) \
             VALUES ('order', 'o-1', 'order.paid', '{{}}', txid_current(), {values})"
        ))
        .await
        .map(|_| ())
        .map_err(StoreError::from_db)
}

/// The insert was refused as one that claims owned columns, naming `column` and saying to leave
/// them out.
fn assert_refused(result: &Result<(), StoreError>, column: &str) {
    match result {
        Err(StoreError::Rejected { constraint, detail }) => {
            assert_eq!(constraint, "outpost_event_owned_columns_check", "{detail}");
            assert!(detail.contains(column), "names {column}: {detail}");
            assert!(detail.contains("leave these columns out"), "{detail}");
        }
        other => panic!("the forged row was not refused: {other:?}"),
    }
}

/// The partition the database computes for `order`/`aggregate`.
async fn partition_of(db: &TestDb, aggregate: &str) -> i64 {
    scalar(
        db,
        &format!(
            "SELECT outpost_partition_of('order', '{aggregate}', \
                    (SELECT partition_count FROM outpost_meta))::int8"
        ),
    )
    .await
}

async fn enqueue(db: &TestDb, aggregate: &str) -> outpost::produce::Enqueued {
    let txn = db.store.connection().begin().await.unwrap();
    let out = Producer::default()
        .enqueue_facts(
            &txn,
            vec![EventFact::new("order", aggregate, "order.paid", json!({}))],
        )
        .await
        .unwrap();
    txn.commit().await.unwrap();
    out.into_iter().next().unwrap()
}

#[tokio::test]
async fn a_forged_sequence_is_refused_and_the_aggregates_next_writer_gets_its_number() {
    let db = TestDb::new().await;
    let p = partition_of(&db, "o-1").await;
    // The next number the aggregate would hand out, written by hand: the aggregate's next
    // honest writer would then fail on the unique key, rolling back its business transaction.
    let forged = forge(
        &db,
        "id, aggregate_seq, partition",
        &format!("nextval('outpost_event_id_seq'), 1, {p}"),
    )
    .await;
    assert_refused(&forged, "aggregate_seq");

    let honest = enqueue(&db, "o-1").await;
    assert_eq!(honest.aggregate_seq, 1);
    let many = commit_facts(
        &db.store,
        (0..3)
            .map(|i| EventFact::new("order", "o-1", "order.paid", json!({ "i": i })))
            .collect(),
    )
    .await;
    assert_eq!(many.len(), 3);
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FILTER (WHERE aggregate_seq = n) FROM \
             (SELECT aggregate_seq, row_number() OVER (ORDER BY aggregate_seq) AS n \
              FROM outpost_event WHERE aggregate_id = 'o-1') s"
        )
        .await,
        4,
        "the aggregate's sequence is 1 to 4 without a gap"
    );
}

#[tokio::test]
async fn a_forged_id_already_in_the_history_is_refused_and_shared_marks_go_through() {
    let db = TestDb::new().await;
    // One event published and moved to the history by a mark under a lease.
    let first = enqueue(&db, "o-2").await;
    db.store
        .connection()
        .execute_unprepared(
            "UPDATE outpost_partition SET owner = 'n1', epoch = 1, \
             lease_until = now() + interval '1 hour'",
        )
        .await
        .unwrap();
    let held = db
        .store
        .mark_published_many(
            "n1",
            &[(first.partition, 1)],
            &[(first.id, "1-1".to_owned())],
            &[],
            false,
        )
        .await
        .unwrap();
    assert_eq!(held, [first.partition]);
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        1
    );

    // A row under the published event's id: marking it would collide in the history, failing
    // the shared mark of every partition it is recorded with.
    let p = partition_of(&db, "o-1").await;
    let forged = forge(
        &db,
        "id, aggregate_seq, partition",
        &format!("{}, 1, {p}", first.id),
    )
    .await;
    assert_refused(&forged, "id");

    let a = enqueue(&db, "o-1").await;
    let b = enqueue(&db, "o-3").await;
    assert!(a.id > first.id && b.id > first.id);
    let mut leases = vec![(a.partition, 1)];
    if b.partition != a.partition {
        leases.push((b.partition, 1));
    }
    let held = db
        .store
        .mark_published_many(
            "n1",
            &leases,
            &[(a.id, "1-2".to_owned()), (b.id, "1-3".to_owned())],
            &[],
            false,
        )
        .await
        .unwrap();
    assert_eq!(held.len(), leases.len());
    assert_eq!(
        scalar(&db, "SELECT count(DISTINCT id) FROM outpost_published").await,
        3
    );
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 0);
}

#[tokio::test]
async fn a_forged_partition_is_refused_and_the_aggregate_stays_in_its_own() {
    let db = TestDb::new().await;
    let honest = enqueue(&db, "o-1").await;
    let p = partition_of(&db, "o-1").await;
    assert_eq!(i64::from(honest.partition), p);
    // The aggregate's next event in another partition: another owner would publish it, maybe
    // before the first.
    let other = (p + 1) % 64;
    let forged = forge(
        &db,
        "id, aggregate_seq, partition",
        &format!("nextval('outpost_event_id_seq'), 2, {other}"),
    )
    .await;
    assert_refused(&forged, "partition");

    let next = enqueue(&db, "o-1").await;
    assert_eq!((next.aggregate_seq, i64::from(next.partition)), (2, p));
    assert_eq!(
        scalar(
            &db,
            "SELECT count(DISTINCT partition) FROM outpost_event WHERE aggregate_id = 'o-1'"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn a_forged_delivery_state_is_refused() {
    let db = TestDb::new().await;
    let p = partition_of(&db, "o-1").await;
    for status in ["published", "quarantined", "retry_wait", "discarded"] {
        let forged = forge(
            &db,
            "id, aggregate_seq, partition, status, attempts",
            &format!("nextval('outpost_event_id_seq'), 1, {p}, '{status}', 7"),
        )
        .await;
        assert_refused(&forged, "status");
    }
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 0);
    // Named without the owned columns beside it, its own transaction's id is refused the same
    // way (it was a NOT NULL error before).
    let bare = forge(&db, "schema_version", "'1'").await;
    assert_refused(&bare, "txid");

    let honest = enqueue(&db, "o-1").await;
    assert_eq!(
        (honest.aggregate_seq, honest.status.as_str()),
        (1, "pending")
    );
}

#[tokio::test]
async fn the_setting_that_lets_outpost_write_its_columns_ends_with_its_statement() {
    let db = TestDb::new().await;
    let p = partition_of(&db, "o-1").await;
    // In one transaction: the producer API's statement for many events, then a forged row.
    let txn = db.store.connection().begin().await.unwrap();
    let out = Producer::default()
        .enqueue_facts(
            &txn,
            (0..2)
                .map(|i| EventFact::new("order", "o-1", "order.paid", json!({ "i": i })))
                .collect(),
        )
        .await
        .unwrap();
    assert_eq!(
        out.iter().map(|e| e.aggregate_seq).collect::<Vec<_>>(),
        [1, 2]
    );
    let forged = txn
        .execute_unprepared(&format!(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, txid, \
             id, aggregate_seq, partition) \
             VALUES ('order', 'o-1', 'order.paid', '{{}}', txid_current(), \
                     nextval('outpost_event_id_seq'), 3, {p})"
        ))
        .await
        .map(|_| ())
        .map_err(StoreError::from_db);
    assert_refused(&forged, "aggregate_seq");
    txn.rollback().await.unwrap();
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 0);
}

/// Reverting `m20261206_000012_owned_columns` gives back the trigger that any row with its own
/// transaction's `txid` skipped and the claim's single index; applying it again today's.
#[tokio::test]
async fn the_owned_columns_migration_reverts_and_reapplies() {
    let db = TestDb::new().await;
    let steps = support::migrations_from(&db, "m20261206_000012_owned_columns").await;
    let index = |name: &str| format!("SELECT count(*) FROM pg_indexes WHERE indexname = '{name}'");
    outpost::store::migrate_down(&db.store, Some(steps))
        .await
        .unwrap();
    assert_eq!(scalar(&db, &index("outpost_event_ready")).await, 1);
    assert_eq!(scalar(&db, &index("outpost_event_pending")).await, 0);
    // The trigger of before: a plain insert is filled in, one with its own txid skips it.
    forge(
        &db,
        "id, aggregate_seq, partition",
        "nextval('outpost_event_id_seq'), 7, 0",
    )
    .await
    .unwrap();
    db.store
        .connection()
        .execute_unprepared(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'o-2', 'order.paid', '{}')",
        )
        .await
        .unwrap();
    assert_eq!(
        scalar(&db, "SELECT sum(aggregate_seq)::int8 FROM outpost_event").await,
        8
    );

    outpost::store::migrate_up(&db.store).await.unwrap();
    assert_eq!(scalar(&db, &index("outpost_event_ready")).await, 0);
    assert_eq!(scalar(&db, &index("outpost_event_retry_due")).await, 1);
    let forged = forge(
        &db,
        "id, aggregate_seq, partition",
        "nextval('outpost_event_id_seq'), 8, 0",
    )
    .await;
    assert_refused(&forged, "aggregate_seq");
    let honest = enqueue(&db, "o-2").await;
    assert_eq!(honest.aggregate_seq, 2);
}
