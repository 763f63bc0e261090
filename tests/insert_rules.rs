//! What the insert trigger guarantees producers beyond the row rules: an idempotent insert takes
//! no sequence number, a time no stream entry can carry is refused, and a request for nudges
//! dies with the node that made it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use outpost::produce::{EventFact, Producer};
use outpost::store::{Nudge, NudgeListener};
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde_json::json;
use support::{TestDb, TestRedis, redis_url, relay_args, scalar, spawn_outpost, wait_until};

/// The plain-SQL insert a producer in another language writes, made idempotent by its event id.
fn idempotent_insert(event_id: uuid::Uuid, aggregate: &str) -> Statement {
    Statement::from_sql_and_values(
        DbBackend::Postgres,
        "INSERT INTO outpost_event (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'order', $2, 'order.placed', '{}') ON CONFLICT (event_id) DO NOTHING",
        [event_id.into(), aggregate.into()],
    )
}

async fn seqs(db: &TestDb, aggregate: &str) -> Vec<i64> {
    db.store
        .connection()
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT aggregate_seq FROM outpost_event WHERE aggregate_id = $1 \
             ORDER BY aggregate_seq",
            [aggregate.into()],
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.try_get_by_index::<i64>(0).unwrap())
        .collect()
}

#[tokio::test]
async fn an_idempotent_insert_repeated_takes_no_sequence_number() {
    let db = TestDb::new().await;
    let conn = db.store.connection();
    let e = uuid::Uuid::new_v4();
    for _ in 0..3 {
        conn.execute_raw(idempotent_insert(e, "o-1")).await.unwrap();
    }
    conn.execute_raw(idempotent_insert(uuid::Uuid::new_v4(), "o-1"))
        .await
        .unwrap();
    assert_eq!(seqs(&db, "o-1").await, [1, 2]);
    assert_eq!(
        scalar(&db, "SELECT last_seq FROM outpost_aggregate").await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_idempotent_insert_of_the_same_event_takes_no_sequence_number() {
    let db = TestDb::new().await;
    let e = uuid::Uuid::new_v4();
    // The first writer holds the aggregate's lock with the event written, not yet committed.
    let first = db.store.connection().begin().await.unwrap();
    first
        .execute_raw(idempotent_insert(e, "o-1"))
        .await
        .unwrap();
    // The second retries the same insert (its first try timed out, say): it waits for the lock.
    let store = db.store.clone();
    let second = tokio::spawn(async move {
        let txn = store.connection().begin().await.unwrap();
        txn.execute_raw(idempotent_insert(e, "o-1")).await.unwrap();
        txn.execute_raw(idempotent_insert(uuid::Uuid::new_v4(), "o-1"))
            .await
            .unwrap();
        txn.commit().await.unwrap();
    });
    wait_until(
        20,
        "the second insert to wait for the aggregate's lock",
        || async {
            scalar(
                &db,
                "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO outpost_event%'",
            )
            .await
                == 1
        },
    )
    .await;
    first.commit().await.unwrap();
    second.await.unwrap();
    assert_eq!(seqs(&db, "o-1").await, [1, 2]);
}

#[tokio::test]
async fn a_time_no_stream_entry_can_carry_is_refused_at_insert() {
    let db = TestDb::new().await;
    let conn = db.store.connection();
    for time in [
        "infinity",
        "-infinity",
        "10000-01-01 00:00:00+00",
        "0001-01-01 BC",
    ] {
        let err = conn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, \
                 occurred_at) VALUES ('order', 'o-1', 'order.placed', '{}', $1::timestamptz)",
                [time.into()],
            ))
            .await
            .expect_err(time);
        let text = err.to_string();
        assert!(
            text.contains("outpost_event_occurred_at_check") && text.contains("occurred_at"),
            "{time}: {text}"
        );
    }
    // The producer API's statement for many events keeps the same rule.
    let far = chrono::NaiveDate::from_ymd_opt(10_000, 1, 1)
        .unwrap()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc();
    let facts = vec![
        EventFact::new("order", "o-2", "order.placed", json!({})),
        EventFact::new("order", "o-3", "order.placed", json!({})).occurred_at(far),
    ];
    let txn = conn.begin().await.unwrap();
    let err = Producer::default()
        .enqueue_facts(&txn, facts)
        .await
        .expect_err("a year past 9999");
    assert!(
        err.to_string().contains("occurred_at"),
        "the error names the column: {err}"
    );
    drop(txn);
    // The edges are kept.
    for time in ["0001-01-01 00:00:00+00", "9999-12-31 23:59:59.999999+00"] {
        conn.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, \
             occurred_at) VALUES ('order', 'o-4', 'order.placed', '{}', $1::timestamptz)",
            [time.into()],
        ))
        .await
        .unwrap();
    }
    assert_eq!(seqs(&db, "o-4").await, [1, 2]);
}

/// Commits one event, then a marker notification of its own, and says whether a nudge arrived
/// before the marker (notifications of different transactions arrive in commit order).
async fn commit_nudges(db: &TestDb, listener: &mut NudgeListener) -> bool {
    let conn = db.store.connection();
    conn.execute_unprepared(
        "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', 'o-1', 'order.placed', '{}')",
    )
    .await
    .unwrap();
    conn.execute_unprepared("NOTIFY outpost_wakeup, '-1'")
        .await
        .unwrap();
    let mut nudged = false;
    loop {
        match tokio::time::timeout(Duration::from_secs(20), listener.recv())
            .await
            .expect("the marker notification")
            .unwrap()
        {
            Nudge::Partitions(p) if p == [-1] => return nudged,
            _ => nudged = true,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_idle_stops_asking_for_nudges_when_its_heartbeat_ends() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let args = relay_args(&db, &redis_url(), &redis.prefix, "n1", &[]);
    let mut node = spawn_outpost(&args, &[]);
    support::wait_for_idle_node(&db).await;
    let mut listener = NudgeListener::connect(&db.url).await.unwrap();
    assert!(
        commit_nudges(&db, &mut listener).await,
        "an idle node is nudged"
    );
    support::wait_for_idle_node(&db).await;
    node.kill().unwrap();
    node.wait().unwrap();
    // Its lease time (2 s here) after its last heartbeat, the node is gone.
    wait_until(
        30,
        "the killed node's heartbeat to be older than its lease",
        || async {
            scalar(
                &db,
                "SELECT count(*) FROM outpost_node WHERE heartbeat_at < now() - interval '2500 ms'",
            )
            .await
                == 1
        },
    )
    .await;
    assert!(
        !commit_nudges(&db, &mut listener).await,
        "a commit after the only node died sends no NOTIFY"
    );
}

/// Producers writing several aggregates per transaction in random orders never deadlock through
/// the producer API: its statement for many events locks aggregates in key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactions_of_several_aggregates_in_any_order_do_not_deadlock() {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    let db = TestDb::new().await;
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let writers = (0..8u64).map(|w| {
        let store = db.store.clone();
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ w);
            for _ in 0..60 {
                let mut aggregates: Vec<String> = (0..6).map(|a| format!("d{a}")).collect();
                aggregates.shuffle(&mut rng);
                aggregates.truncate(rng.random_range(2..=4));
                let facts = aggregates
                    .iter()
                    .map(|a| EventFact::new("order", a.clone(), "order.placed", json!({})))
                    .collect();
                let txn = store.connection().begin().await.unwrap();
                Producer::default()
                    .enqueue_facts(&txn, facts)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
                txn.commit().await.unwrap();
            }
        })
    });
    for w in futures::future::join_all(writers).await {
        w.unwrap();
    }
    assert!(scalar(&db, "SELECT count(*) FROM outpost_event").await > 0);
    // Every aggregate's sequence is gap-free.
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_aggregate a \
             WHERE a.last_seq <> (SELECT count(*) FROM outpost_event e \
                                  WHERE e.aggregate_id = a.aggregate_id)"
        )
        .await,
        0
    );
}
