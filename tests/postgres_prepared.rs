//! Two-phase commit: a producer's transaction prepared (`PREPARE TRANSACTION`) and left in doubt,
//! as a transaction manager leaves it between its two phases, or forever when the manager is
//! gone. It holds its aggregate's lock and its low ids, and no session owns it any more. Other
//! aggregates flow past it; its aggregate's next writer waits for it; the storage figures name it;
//! once committed it is delivered in its place in the aggregate's order, and once rolled back it
//! leaves no hole in the sequence. A transaction that sent the nudge cannot be prepared, so such
//! producers set `outpost.nudge` off (`docs/contract.md`). Needs a server with
//! `max_prepared_transactions` above zero: a PostgreSQL of the test's own.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::produce::{EventFact, Producer};
use outpost::store::Store;
use sea_orm::{ConnectionTrait, DbErr, TransactionTrait};
use serde_json::json;
use support::pg_server::OwnPostgres;
use support::{Deliveries, TestRedis, commit_facts, scalar_on as scalar, wait_until};
use uuid::Uuid;

/// Writes one event of aggregate `aggregate` with plain SQL and prepares the transaction as
/// `gid`, leaving it to whoever commits or rolls it back later; `nudge_off` sets `outpost.nudge`
/// off first.
async fn prepare_one(
    store: &Store,
    aggregate: &str,
    event_id: Uuid,
    gid: &str,
    nudge_off: bool,
) -> Result<(), DbErr> {
    let setting = if nudge_off {
        "SET LOCAL outpost.nudge = off;"
    } else {
        ""
    };
    store
        .connection()
        .execute_unprepared(&format!(
            "BEGIN; {setting} \
             INSERT INTO outpost_event (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('{event_id}', 'kind0', '{aggregate}', 't', '{{}}'); \
             PREPARE TRANSACTION '{gid}'"
        ))
        .await
        .map(|_| ())
}

/// Commits one event of aggregate `aggregate` through the producer API; returns its id.
async fn commit_one(store: &Store, aggregate: &str, payload: serde_json::Value) -> Vec<String> {
    commit_facts(
        store,
        vec![EventFact::new("kind0", aggregate, "t", payload)],
    )
    .await
}

/// Entries in the test's streams.
async fn in_streams(redis: &TestRedis) -> usize {
    support::stream_entries(&mut redis.conn().await, &redis.prefix).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prepared_transaction_holds_back_its_aggregate_only_and_leaves_no_hole() {
    support::init_logs();
    let pg = OwnPostgres::start_with(&["max_prepared_transactions=4"]).await;
    let store = pg.migrated_database("outpost", 8).await;
    let redis = TestRedis::new();
    let node = pg.start_node("outpost", &redis, "pg-prepared").await;

    // An idle node asks for nudges: a transaction that nudges it cannot be prepared, and is rolled
    // back whole.
    wait_until(30, "the idle node to ask for nudges", || async {
        scalar(
            &store,
            "SELECT count(*) FROM outpost_node WHERE wants_nudge",
        )
        .await
            == 1
    })
    .await;
    let refused = prepare_one(&store, "refused", Uuid::new_v4(), "outpost-refused", false)
        .await
        .expect_err("a transaction that sent a NOTIFY cannot be prepared");
    assert!(
        refused
            .to_string()
            .contains("cannot PREPARE a transaction that has executed"),
        "{refused}"
    );
    assert_eq!(
        scalar(
            &store,
            "SELECT count(*) FROM outpost_aggregate WHERE aggregate_id = 'refused'"
        )
        .await,
        0,
        "nothing of the refused transaction stays"
    );

    // With the nudge off, two transactions in doubt, holding the lowest ids of the test: one to be
    // committed, written with plain SQL; one to be rolled back, two events written through the
    // producer API's statement for many events.
    let kept = Uuid::new_v4();
    prepare_one(&store, "held", kept, "outpost-kept", true)
        .await
        .unwrap();
    let txn = store.connection().begin().await.unwrap();
    txn.execute_unprepared("SET LOCAL outpost.nudge = off")
        .await
        .unwrap();
    let doubtful: Vec<EventFact> = (0..2)
        .map(|i| EventFact::new("kind0", "doubt", "t", json!({ "i": i })))
        .collect();
    let dropped: Vec<String> = doubtful.iter().map(|f| f.id().to_string()).collect();
    Producer::default()
        .enqueue_facts(&txn, doubtful)
        .await
        .unwrap();
    txn.execute_unprepared("PREPARE TRANSACTION 'outpost-dropped'")
        .await
        .unwrap();
    // The session has no transaction left to end; PostgreSQL only warns.
    txn.commit().await.unwrap();
    assert_eq!(
        scalar(
            &store,
            "SELECT count(*) FROM outpost_node WHERE wants_nudge"
        )
        .await,
        1,
        "the node asked for nudges all along: only the setting kept these transactions from it"
    );

    // Everything written after them is delivered meanwhile.
    let mut expected: Vec<String> = Vec::new();
    for round in 0..5 {
        let facts = (0..20)
            .map(|k| EventFact::new("kind0", format!("a{k}"), "t", json!({ "round": round })))
            .collect();
        expected.extend(commit_facts(&store, facts).await);
    }
    wait_until(
        60,
        "the events written after the prepared ones to be delivered",
        || async { in_streams(&redis).await >= 100 },
    )
    .await;

    // The held aggregate's next writer waits for the prepared transaction's lock on it.
    let writer = tokio::spawn({
        let store = store.clone();
        async move { commit_one(&store, "held", json!({ "after": true })).await }
    });
    wait_until(
        30,
        "the held aggregate's writer to wait for the prepared transaction's lock",
        || async { scalar(&store, "SELECT count(*) FROM pg_locks WHERE NOT granted").await >= 1 },
    )
    .await;
    assert!(!writer.is_finished(), "the writer still waits");
    let held = store.storage_figures().await.unwrap();
    assert_eq!(held.prepared_xacts, 2, "{held:?}");
    assert!(
        held.xmin_age_xids >= 5,
        "the prepared transactions hold the horizon behind the five commits after them: {held:?}"
    );
    assert_eq!(
        in_streams(&redis).await,
        100,
        "nothing of theirs is delivered"
    );

    store
        .connection()
        .execute_unprepared("COMMIT PREPARED 'outpost-kept'")
        .await
        .unwrap();
    expected.push(kept.to_string());
    expected.extend(writer.await.unwrap());
    store
        .connection()
        .execute_unprepared("ROLLBACK PREPARED 'outpost-dropped'")
        .await
        .unwrap();
    // The rolled-back event took no place in its aggregate's sequence.
    expected.extend(commit_one(&store, "doubt", json!({ "again": true })).await);

    wait_until(60, "every committed event to be published", || async {
        scalar(&store, "SELECT count(*) FROM outpost_event").await == 0
            && in_streams(&redis).await >= expected.len()
    })
    .await;
    let d = Deliveries::collect(&mut redis.conn().await, &redis.prefix).await;
    for id in &expected {
        assert_eq!(d.copies.get(id), Some(&1), "{id} delivered once");
    }
    assert_eq!(d.unique(), expected.len(), "nothing else delivered");
    assert!(dropped.iter().all(|id| !d.copies.contains_key(id)));
    let order = |aggregate: &str| d.order.get(&("kind0".to_owned(), aggregate.to_owned()));
    assert_eq!(
        order("held"),
        Some(&vec![1, 2]),
        "the prepared event first, in its place"
    );
    assert_eq!(
        order("doubt"),
        Some(&vec![1]),
        "no hole where the rollback was"
    );
    assert!(
        d.order_violations().is_empty(),
        "{:?}",
        d.order_violations()
    );
    assert_eq!(store.storage_figures().await.unwrap().prepared_xacts, 0);
    node.shutdown().await;
}
