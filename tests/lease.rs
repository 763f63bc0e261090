//! Lease locking against a real PostgreSQL: a mark holds its lease against a takeover, and never
//! waits for (or deadlocks with) renewals, releases or pauses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use support::{TestDb, scalar, wait_until};

const LEASE_MS: u64 = 60_000;

async fn exec(conn: &impl ConnectionTrait, sql: &str) {
    conn.execute_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .expect(sql);
}

#[tokio::test]
async fn a_mark_never_waits_for_a_renewal_a_release_or_a_pause() {
    let db = TestDb::new().await;
    let held = db
        .store
        .acquire_partitions("a", LEASE_MS, &[], 64)
        .await
        .unwrap();
    assert_eq!(held.len(), 64);
    let leases: Vec<(i32, i64)> = held.iter().map(|l| (l.partition, l.epoch)).collect();

    // A renewal of every lease, a pause and a release, all left uncommitted: they hold row
    // locks on every partition row.
    let txn = db.store.connection().begin().await.unwrap();
    exec(
        &txn,
        "UPDATE outpost_partition SET lease_until = now() + interval '1 minute' WHERE owner = 'a'",
    )
    .await;
    exec(
        &txn,
        "UPDATE outpost_partition SET paused = true WHERE partition = 7",
    )
    .await;
    exec(
        &txn,
        "UPDATE outpost_partition SET owner = NULL, lease_until = NULL WHERE partition = 9",
    )
    .await;

    // A mark of several partitions goes through at once and keeps every lease.
    let marked = tokio::time::timeout(
        Duration::from_secs(30),
        db.store.mark_published_many("a", &leases, &[], &[], false),
    )
    .await
    .expect("a mark must not wait for lease renewals, pauses or releases")
    .unwrap();
    assert_eq!(marked.len(), 64, "every lease still holds");
    txn.rollback().await.unwrap();
}

#[tokio::test]
async fn a_takeover_waits_for_a_mark_in_flight_and_the_mark_then_sees_its_lease_lost() {
    let db = TestDb::new().await;
    let held = db
        .store
        .acquire_partitions("a", LEASE_MS, &[], 2)
        .await
        .unwrap();
    let leases: Vec<(i32, i64)> = held.iter().map(|l| (l.partition, l.epoch)).collect();
    assert_eq!(leases, vec![(0, 1), (1, 1)]);

    // Another node takes partition 1 (its epoch moves on) but has not committed yet.
    let takeover = db.store.connection().begin().await.unwrap();
    exec(
        &takeover,
        "UPDATE outpost_partition SET owner = 'b', epoch = epoch + 1 WHERE partition = 1",
    )
    .await;

    // The old owner's mark must wait for the takeover to decide.
    let store = db.store.clone();
    let mark = tokio::spawn(async move {
        store
            .mark_published_many("a", &[(0, 1), (1, 1)], &[], &[], false)
            .await
    });
    wait_until(30, "the mark to wait on the lease row lock", || async {
        scalar(
            &db,
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock' \
               AND query LIKE '%FOR KEY SHARE%'",
        )
        .await
            == 1
    })
    .await;
    assert!(!mark.is_finished());

    takeover.commit().await.unwrap();
    let kept = mark.await.unwrap().unwrap();
    assert_eq!(kept, vec![0], "partition 1 is lost, partition 0 still held");
}
