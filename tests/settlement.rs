//! A group's replies are settled per partition: a partition fenced or lost on one of its streams
//! never hands its other replies to the partition after it in the group.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::dispatch::batch::Claim;
use outpost::produce::EventFact;
use outpost::store::LeaseRef;
use sea_orm::ConnectionTrait;
use support::{TestDb, TestRedis, aggregate_in, commit_facts, scalar, worker};

fn fact(aggregate: &str, destination: &str) -> EventFact {
    EventFact::new(
        "order",
        aggregate,
        "order.placed",
        serde_json::json!({"k": 1}),
    )
    .destination(destination)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_fenced_on_its_first_stream_leaves_the_next_partitions_replies_alone() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let worker = worker(&db, &redis, 5).await;
    let (p1, p2) = (3, 7);
    // Partition p1 writes two streams (a, then b); partition p2 one (c), which holds a key of
    // the wrong type, so its call fails for its first entry.
    let (x, y) = (
        aggregate_in(&db, p1, 0).await,
        aggregate_in(&db, p1, 1).await,
    );
    // The producer writes aggregates in key order: x's row comes first, so its stream is the
    // partition's first call.
    let (x, y) = if x < y { (x, y) } else { (y, x) };
    let z = aggregate_in(&db, p2, 0).await;
    commit_facts(&db.store, vec![fact(&x, "a"), fact(&y, "b"), fact(&z, "c")]).await;
    let publisher = &worker.publisher;
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("SET")
        .arg(publisher.stream_key("c"))
        .arg("not a stream")
        .query_async(&mut conn)
        .await
        .unwrap();
    // Another node's newer epoch on p1's first stream.
    let fence = publisher.fence_key(&publisher.stream_key("a")).unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&fence)
        .arg(p1.to_string())
        .arg("1000000")
        .query_async(&mut conn)
        .await
        .unwrap();

    let leases = db
        .store
        .acquire_partitions("n1", 60_000, &[], 64)
        .await
        .unwrap();
    let lease = |p: i32| LeaseRef {
        partition: p,
        node_id: "n1".to_owned(),
        epoch: leases.iter().find(|l| l.partition == p).unwrap().epoch,
    };
    let outcomes = worker
        .run_together(&[lease(p1), lease(p2)], Claim::PerPartition, |_| {})
        .await;

    assert!(
        matches!(
            outcomes[0],
            Err(outpost::dispatch::batch::BatchError::Fenced { current: 1_000_000 })
        ),
        "{outcomes:?}"
    );
    assert!(outcomes[1].is_ok(), "{outcomes:?}");
    // p2's event was never appended: it must not be marked published (with p1's entry id on b,
    // as it was when the replies of a group were one sequence).
    let published = scalar(
        &db,
        &format!("SELECT count(*) FROM outpost_published WHERE aggregate_id = '{z}'"),
    )
    .await;
    assert_eq!(published, 0, "p2's unpublished event was marked published");
    let failed = scalar(
        &db,
        &format!(
            "SELECT count(*) FROM outpost_event WHERE aggregate_id = '{z}' \
             AND status = 'quarantined' AND attempts = 1 AND last_error LIKE 'WRONGTYPE%'"
        ),
    )
    .await;
    assert_eq!(failed, 1, "p2's event is quarantined for its own failure");
    // p1 was fenced: nothing of it recorded.
    let p1_rows = scalar(
        &db,
        &format!(
            "SELECT count(*) FROM outpost_event WHERE partition = {p1} AND status = 'pending' \
             AND attempts = 0"
        ),
    )
    .await;
    assert_eq!(p1_rows, 2);
}

/// A node that lost a partition and still runs is refused on a stream the new owner has not
/// written since it took the partition: the new owner raises the fences of the streams it knows
/// when it takes a partition, before it publishes anything (a missing or older fence field let
/// the old owner's late append through).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_the_new_owner_has_not_written_yet_refuses_the_old_owner() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let p = 9;
    let x = aggregate_in(&db, p, 0).await;
    // A first node writes the stream, so it is known (recorded in outpost_stream), then leaves.
    let node = support::start_node(support::relay_config(&db, &redis, "a")).await;
    commit_facts(&db.store, vec![fact(&x, "s")]).await;
    support::wait_until(
        30,
        "the first event published and its stream recorded",
        || async {
            scalar(&db, "SELECT count(*) FROM outpost_published").await == 1
                && scalar(&db, "SELECT count(*) FROM outpost_stream").await == 1
        },
    )
    .await;
    node.shutdown().await;
    // The old owner takes the partition and claims nothing yet; then its lease runs out while
    // it is frozen, and the partition is paused, so the new owner publishes nothing there.
    let old = db
        .store
        .acquire_partitions("old", 60_000, &[], 64)
        .await
        .unwrap();
    let old_epoch = old.iter().find(|l| l.partition == p).unwrap().epoch;
    commit_facts(&db.store, vec![fact(&x, "s")]).await;
    db.store
        .set_paused(&[p], true, "test", "operator")
        .await
        .unwrap();
    db.store
        .connection()
        .execute_unprepared(
            "UPDATE outpost_partition SET lease_until = now() - interval '1 second' \
             WHERE owner = 'old'",
        )
        .await
        .unwrap();
    let node = support::start_node(support::relay_config(&db, &redis, "b")).await;
    support::wait_until(30, "the new owner to hold the partition", || async {
        scalar(
            &db,
            &format!(
                "SELECT count(*) FROM outpost_partition WHERE partition = {p} AND owner = 'b'"
            ),
        )
        .await
            == 1
    })
    .await;
    let new_epoch = scalar(
        &db,
        &format!("SELECT epoch FROM outpost_partition WHERE partition = {p}"),
    )
    .await;
    assert!(new_epoch > old_epoch);
    let zombie = worker(&db, &redis, 5).await;
    let fence = zombie
        .publisher
        .fence_key(&zombie.publisher.stream_key("s"))
        .unwrap();
    let client = redis.client.clone();
    support::wait_until(30, "the new owner to raise the stream's fence", || {
        let (fence, client) = (fence.clone(), client.clone());
        async move {
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            let at: Option<i64> = redis::cmd("HGET")
                .arg(&fence)
                .arg(p.to_string())
                .query_async(&mut conn)
                .await
                .unwrap();
            at == Some(new_epoch)
        }
    })
    .await;
    let mut conn = redis.conn().await;
    let lease = LeaseRef {
        partition: p,
        node_id: "old".to_owned(),
        epoch: old_epoch,
    };
    let outcome = zombie
        .run_together(&[lease], Claim::PerPartition, |_| {})
        .await;
    node.shutdown().await;
    assert!(
        matches!(
            outcome[0],
            Err(outpost::dispatch::batch::BatchError::Fenced { current }) if current == new_epoch
        ),
        "{outcome:?}"
    );
    let len: i64 = redis::cmd("XLEN")
        .arg(zombie.publisher.stream_key("s"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(len, 1, "the old owner appended nothing");
}
