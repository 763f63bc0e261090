//! A partition actor that panics is restarted by its supervisor and loses nothing. Its own test
//! binary: fault points are process-wide. Needs the `failpoints` feature.

#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::produce::{EventFact, Producer};
use sea_orm::TransactionTrait;
use serde_json::json;
use support::{Deliveries, TestDb, TestRedis, relay_config, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_partition_actor_is_restarted_and_loses_nothing() {
    support::init_logs();
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let facts: Vec<EventFact> = (0..500)
        .map(|i| EventFact::new("kind0", format!("a{}", i % 30), "t", json!({"i": i})))
        .collect();
    let txn = db.store.connection().begin().await.unwrap();
    Producer::default()
        .enqueue_facts(&txn, facts)
        .await
        .unwrap();
    txn.commit().await.unwrap();

    // The first three batches to start panic inside their actors.
    fail::cfg("actor-panic", "3*panic").unwrap();
    let config = relay_config(&db, &redis, "panic-node");
    let node = tokio::task::spawn_blocking(move || outpost::app::start(&config))
        .await
        .unwrap()
        .unwrap();
    let mut conn = redis.conn().await;
    wait_until(60, "every event to be delivered", || {
        let (prefix, mut c) = (redis.prefix.clone(), conn.clone());
        async move { Deliveries::collect(&mut c, &prefix).await.unique() >= 500 }
    })
    .await;
    fail::remove("actor-panic");
    assert_eq!(
        node.actor_restarts(),
        3,
        "each panic restarted its actor once"
    );
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert_eq!(d.unique(), 500);
    assert_eq!(d.duplicates(), 0, "the panics struck before publishing");
    assert!(d.order_violations().is_empty());
    node.shutdown().await;
}
