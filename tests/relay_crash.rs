//! Crash the relay at each fault point (process abort), restart it, and check that nothing is
//! lost and that duplicates appear only where a crash fell between publish and mark — at most
//! one batch, always with the same event id. Needs the `failpoints` feature (`scripts/test` enables
//! it); without it the fault points do not exist and these tests are not compiled.

#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;

use outpost::produce::{EventFact, Producer};
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde_json::json;
use support::{Deliveries, TestDb, TestRedis, relay_args, spawn_outpost, wait_exit, wait_until};

const EVENTS: usize = 1000;
const BATCH: usize = 100;

/// `n` aggregate ids of type `kind` whose partition is `partition`.
async fn ids_in_partition(db: &TestDb, kind: &str, partition: i32, n: usize) -> Vec<String> {
    db.store
        .connection()
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT id FROM (SELECT 'a' || g AS id FROM generate_series(0, 100000) g) x \
             WHERE outpost_partition_of($1, id, 64) = $2 LIMIT $3",
            [kind.into(), partition.into(), (n as i64).into()],
        ))
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.try_get_by_index::<String>(0).unwrap())
        .collect()
}

/// Preloads the events, crashes a node at `point`, restarts it and returns what was delivered.
/// With `one_partition`, every aggregate lives in partition 0, so exactly one batch is in flight
/// when the node crashes; otherwise the events spread over every partition.
async fn crash_at(point: &str, one_partition: bool) -> (TestDb, Deliveries) {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    // Two aggregate types, so a batch spans two streams and `mid-batch` falls between them.
    let (kind0, kind1) = if one_partition {
        (
            ids_in_partition(&db, "kind0", 0, 20).await,
            ids_in_partition(&db, "kind1", 0, 20).await,
        )
    } else {
        let ids: Vec<String> = (0..200).map(|i| format!("a{i}")).collect();
        (ids.clone(), ids)
    };
    let facts: Vec<EventFact> = (0..EVENTS)
        .map(|i| {
            let (kind, ids) = if i % 2 == 0 {
                ("kind0", &kind0)
            } else {
                ("kind1", &kind1)
            };
            EventFact::new(kind, ids[(i / 2) % ids.len()].clone(), "t", json!({"i": i}))
        })
        .collect();
    // One statement per event, so ids alternate between the two types (one multi-row insert
    // would group them by aggregate).
    let txn = db.store.connection().begin().await.unwrap();
    for fact in facts {
        Producer::default()
            .enqueue_facts(&txn, vec![fact])
            .await
            .unwrap();
    }
    txn.commit().await.unwrap();

    let node_id = format!("crash-{point}");
    let args = relay_args(&db, &support::redis_url(), &redis.prefix, &node_id, &[]);
    let mut child = spawn_outpost(&args, &[("FAILPOINTS", &format!("{point}=1*return"))]);
    let status = wait_exit(&mut child, 60).await;
    assert!(!status.success(), "the node aborted at {point}: {status:?}");

    // Restart (same node id, as a supervisor would) and let it drain.
    let mut child = spawn_outpost(&args, &[]);
    let mut conn = redis.conn().await;
    wait_until(120, "every event to be delivered after the restart", || {
        let (prefix, mut c) = (redis.prefix.clone(), conn.clone());
        async move { Deliveries::collect(&mut c, &prefix).await.unique() >= EVENTS }
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert_eq!(d.unique(), EVENTS, "0 lost");
    assert!(d.order_violations().is_empty(), "order per aggregate holds");
    (db, d)
}

macro_rules! crash_tests {
    ($($name:ident: $point:literal => $dups:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let (_db, d) = crash_at($point, true).await;
            let allowed: std::ops::RangeInclusive<usize> = $dups;
            assert!(
                allowed.contains(&d.duplicates()),
                "{} duplicates after a crash at {}, expected {:?}",
                d.duplicates(), $point, allowed
            );
        }
    )*};
}

crash_tests! {
    crash_after_claim_loses_nothing_and_duplicates_nothing: "after-claim" => 0..=0;
    crash_before_publish_loses_nothing_and_duplicates_nothing: "before-publish" => 0..=0;
    crash_mid_batch_duplicates_at_most_one_batch: "mid-batch" => 1..=BATCH;
    crash_after_publish_duplicates_at_most_one_batch: "after-publish" => 1..=BATCH;
    crash_before_mark_duplicates_at_most_one_batch: "before-mark" => 1..=BATCH;
    crash_after_mark_loses_nothing_and_duplicates_nothing: "after-mark" => 0..=0;
}

/// With every partition busy, a crash duplicates at most the batch each partition had between
/// publish and mark: never more than one batch per partition, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_with_every_partition_busy_duplicates_at_most_one_batch_per_partition() {
    let (db, d) = crash_at("after-publish", false).await;
    let mut per_partition: HashMap<i64, usize> = HashMap::new();
    for (event_id, copies) in &d.copies {
        if *copies < 2 {
            continue;
        }
        let row = db
            .store
            .connection()
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT partition::int8 FROM outpost_published WHERE event_id = $1::uuid",
                [event_id.clone().into()],
            ))
            .await
            .unwrap()
            .unwrap();
        *per_partition
            .entry(row.try_get_by_index::<i64>(0).unwrap())
            .or_default() += copies - 1;
    }
    assert!(
        !per_partition.is_empty(),
        "the crash after publishing duplicated its batch"
    );
    for (p, dups) in per_partition {
        assert!(
            dups <= BATCH,
            "partition {p} duplicated {dups} events, more than one batch"
        );
    }
}
