//! Retention against real PostgreSQL and Redis: the janitor deletes only rows past their window,
//! in bounded batches, one node at a time; no-destination rows age out; the trimmer never drops
//! an entry a consumer group has not acknowledged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use outpost::config::RetentionConfig;
use outpost::dispatch::housekeeping;
use outpost::produce::{EventFact, Producer};
use outpost::publish::{Publisher, RedisSettings, TrimRule};
use outpost::store::{Expiry, JANITOR_LOCK, LostStream};
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde_json::json;
use support::{TestDb, TestRedis, scalar, wait_until};

async fn commit(db: &TestDb, facts: Vec<EventFact>) {
    let txn = db.store.connection().begin().await.unwrap();
    Producer::default()
        .enqueue_facts(&txn, facts)
        .await
        .unwrap();
    txn.commit().await.unwrap();
}

async fn exec(db: &TestDb, sql: &str) {
    db.store
        .connection()
        .execute_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap();
}

fn facts(n: usize, event_type: &str) -> Vec<EventFact> {
    (0..n)
        .map(|i| EventFact::new("order", format!("o{}", i % 40), event_type, json!({"i": i})))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn janitor_deletes_only_rows_past_their_window_in_bounded_batches() {
    let db = TestDb::new().await;
    commit(&db, facts(1000, "order.placed")).await;
    // 700 published two hours ago, 200 published just now, 100 still pending.
    db.store.age_as_published(Some(700), 7200).await.unwrap();
    db.store.age_as_published(Some(200), 0).await.unwrap();
    // Old rows in the other states: quarantined stays, discarded and no_destination age out.
    exec(
        &db,
        "UPDATE outpost_event SET recorded_at = now() - interval '400 days', \
           next_attempt_at = now() - interval '400 days' WHERE status = 'pending'",
    )
    .await;
    exec(
        &db,
        "UPDATE outpost_event SET status = CASE WHEN id % 3 = 0 THEN 'quarantined' \
           WHEN id % 3 = 1 THEN 'discarded' ELSE 'no_destination' END WHERE status = 'pending'",
    )
    .await;
    let quarantined = scalar(
        &db,
        "SELECT count(*) FROM outpost_event WHERE status = 'quarantined'",
    )
    .await;
    let recent = scalar(
        &db,
        "SELECT count(*) FROM outpost_published WHERE published_at > now() - interval '1 hour'",
    )
    .await;
    assert_eq!(recent, 200);

    // Another node's janitor holds the lock: this one deletes nothing.
    let other = db.store.connection().begin().await.unwrap();
    other
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT pg_advisory_xact_lock($1)",
            [JANITOR_LOCK.into()],
        ))
        .await
        .unwrap();
    assert_eq!(
        db.store
            .delete_expired(Expiry::Published, 3600, 300)
            .await
            .unwrap(),
        None
    );
    other.rollback().await.unwrap();

    // Batches never exceed the configured size.
    let mut batches = Vec::new();
    loop {
        let n = db
            .store
            .delete_expired(Expiry::Published, 3600, 300)
            .await
            .unwrap()
            .expect("the lock is free");
        batches.push(n);
        if n == 0 {
            break;
        }
    }
    assert_eq!(batches, [300, 300, 100, 0]);
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        200,
        "only rows past the window are deleted"
    );

    // A whole sweep: the other states by their own windows; quarantined rows stay.
    let config = RetentionConfig {
        batch_rows: 7,
        batch_pause_ms: 0,
        ..RetentionConfig::default()
    };
    let swept = housekeeping::sweep(&db.store, &config).await.unwrap();
    assert_eq!(swept.published, 0);
    assert_eq!(
        swept.no_destination + swept.discarded,
        100 - quarantined as u64
    );
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_event").await,
        quarantined,
        "quarantined rows remain"
    );
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        200,
        "recent published rows remain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_destination_rows_reach_their_state_then_age_out() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let routing = [("routing.no_destination", "audit.noted")];
    let config = support::relay_config_for(
        &db,
        &redis,
        "nd-node",
        &[routing[0], ("retention.enabled", "false")],
    );
    let node = support::start_node(config).await;
    commit(&db, facts(50, "audit.noted")).await;
    commit(&db, facts(50, "order.placed")).await;
    wait_until(30, "50 no_destination and 50 published rows", || async {
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'no_destination'",
        )
        .await
            == 50
            && scalar(&db, "SELECT count(*) FROM outpost_published").await == 50
    })
    .await;
    node.shutdown().await;

    // The janitor of the next node ages them out after a (short) period; published rows stay.
    let config = support::relay_config_for(
        &db,
        &redis,
        "nd-node",
        &[
            routing[0],
            ("retention.no_destination_secs", "1"),
            ("retention.interval_ms", "100"),
        ],
    );
    let node = support::start_node(config).await;
    wait_until(30, "no_destination rows to age out", || async {
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'no_destination'",
        )
        .await
            == 0
    })
    .await;
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        50
    );
    node.shutdown().await;
}

async fn publisher(redis: &TestRedis) -> Publisher {
    Publisher::connect(&RedisSettings {
        url: support::redis_url(),
        key_prefix: redis.prefix.clone(),
        connect_timeout: Duration::from_secs(5),
        response_timeout: Duration::from_secs(5),
        topology: outpost::publish::Topology::Single,
    })
    .await
    .unwrap()
}

/// Reads up to `count` new entries as consumer `c1` of group `slow`; their ids.
async fn read_group(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    count: usize,
) -> Vec<String> {
    let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("slow")
        .arg("c1")
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query_async(conn)
        .await
        .unwrap();
    read.keys[0].ids.iter().map(|e| e.id.clone()).collect()
}

async fn ack(conn: &mut redis::aio::MultiplexedConnection, stream: &str, ids: &[String]) {
    let _: i64 = redis::cmd("XACK")
        .arg(stream)
        .arg("slow")
        .arg(ids)
        .query_async(conn)
        .await
        .unwrap();
}

async fn xlen(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("XLEN").arg(key).query_async(conn).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn trimming_never_drops_unacknowledged_entries_and_shrinks_after_acks() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let mut conn = redis.conn().await;
    let stream = format!("{}events:order", redis.prefix);
    let config = support::relay_config_for(
        &db,
        &redis,
        "trim-node",
        &[
            ("retention.trim_streams", "true"),
            ("retention.trim_interval_ms", "100"),
        ],
    );
    let node = support::start_node(config).await;
    commit(&db, facts(100, "order.placed")).await;
    wait_until(30, "100 entries in the stream", || {
        let (mut c, k) = (conn.clone(), stream.clone());
        async move { xlen(&mut c, &k).await == 100 }
    })
    .await;
    // A slow group: 30 read (10 of them acknowledged), 70 unread.
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("slow")
        .arg("0")
        .query_async(&mut conn)
        .await
        .unwrap();
    let ids = read_group(&mut conn, &stream, 30).await;
    assert_eq!(ids.len(), 30);
    // Read before the acknowledgement: the trimmer may run at any moment after it.
    let all: Vec<String> = support::read_stream(&mut conn, &stream)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    ack(&mut conn, &stream, &ids[..10]).await;

    // The node's trimmer removes the 10 acknowledged entries, and never more.
    wait_until(30, "the acknowledged entries to be trimmed", || {
        let (mut c, k) = (conn.clone(), stream.clone());
        async move { xlen(&mut c, &k).await == 90 }
    })
    .await;
    let publisher = publisher(&redis).await;
    let rule = TrimRule {
        ungrouped_after_ms: 0,
        max_len: 0,
    };
    let report = publisher.trim(&stream, rule).await.unwrap();
    assert_eq!((report.trimmed, report.groups), (0, Some(1)));
    let left: Vec<String> = support::read_stream(&mut conn, &stream)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(left, all[10..], "pending and unread entries are all kept");

    // The group acknowledges everything it read, then reads and acknowledges the rest.
    ack(&mut conn, &stream, &ids[10..]).await;
    wait_until(30, "the stream to shrink to the unread entries", || {
        let (mut c, k) = (conn.clone(), stream.clone());
        async move { xlen(&mut c, &k).await == 71 }
    })
    .await;
    let rest = read_group(&mut conn, &stream, 1000).await;
    assert_eq!(rest.len(), 70);
    ack(&mut conn, &stream, &rest).await;
    // Everything acknowledged: only the last-delivered entry itself is kept.
    wait_until(
        30,
        "the stream to shrink after the acknowledgements",
        || {
            let (mut c, k) = (conn.clone(), stream.clone());
            async move { xlen(&mut c, &k).await <= 1 }
        },
    )
    .await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_cap_counts_what_it_drops_and_streams_without_groups_are_kept_unless_asked() {
    let redis = TestRedis::new();
    let mut conn = redis.conn().await;
    let publisher = publisher(&redis).await;
    let grouped = format!("{}grouped", redis.prefix);
    let bare = format!("{}bare", redis.prefix);
    for key in [&grouped, &bare] {
        for i in 0..100 {
            let _: String = redis::cmd("XADD")
                .arg(key)
                .arg("*")
                .arg("i")
                .arg(i)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&grouped)
        .arg("g")
        .arg("0")
        .query_async(&mut conn)
        .await
        .unwrap();
    let keep = TrimRule {
        ungrouped_after_ms: 0,
        max_len: 0,
    };
    // No group has read anything, and the stream without groups is not trimmed by default.
    for key in [&grouped, &bare] {
        let r = publisher.trim(key, keep).await.unwrap();
        assert_eq!((r.trimmed, r.capped), (0, 0));
        assert_eq!(xlen(&mut conn, key).await, 100);
    }
    // The cap drops the oldest 40, all unacknowledged, and says so.
    let capped = TrimRule {
        ungrouped_after_ms: 0,
        max_len: 60,
    };
    let r = publisher.trim(&grouped, capped).await.unwrap();
    assert_eq!((r.trimmed, r.capped), (0, 40));
    assert_eq!(xlen(&mut conn, &grouped).await, 60);
    // Opted in, a stream without groups is trimmed by age (everything here is older than 0 ms
    // once a millisecond has passed; 1 ms is the smallest age).
    let aged = TrimRule {
        ungrouped_after_ms: 1,
        max_len: 0,
    };
    wait_until(10, "the stream without groups to be trimmed by age", || {
        let (p, k, mut c) = (publisher.clone(), bare.clone(), conn.clone());
        async move {
            p.trim(&k, aged).await.unwrap();
            xlen(&mut c, &k).await == 0
        }
    })
    .await;
    let missing = publisher
        .trim(&format!("{}none", redis.prefix), keep)
        .await
        .unwrap();
    assert_eq!(missing.groups, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_history_migration_reverts_and_reapplies_with_every_row() {
    let db = TestDb::new().await;
    commit(&db, facts(30, "order.placed")).await;
    db.store.age_as_published(Some(20), 300).await.unwrap();
    // Everything an event is, whichever table it sits in; delivery state apart.
    let fingerprint = "SELECT count(*) FROM ( \
          SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, payload::text, \
                 partition, txid FROM outpost_event \
          UNION SELECT id, event_id, aggregate_type, aggregate_id, aggregate_seq, payload::text, \
                 partition, txid FROM outpost_published) t";
    let steps = support::migrations_from(&db, "m20261203_000008_published_history").await;
    assert_eq!(scalar(&db, fingerprint).await, 30);

    outpost::store::migrate_down(&db.store, Some(steps))
        .await
        .unwrap();
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'published' \
             AND published_at < now() - interval '4 minutes' AND stream_id = '0-0'"
        )
        .await,
        20,
        "the history is back in the outbox as published rows"
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'pending'"
        )
        .await,
        10
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM pg_class WHERE relname = 'outpost_published'"
        )
        .await,
        0
    );

    outpost::store::migrate_up(&db.store).await.unwrap();
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        20
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'pending'"
        )
        .await,
        10
    );
    assert_eq!(
        scalar(&db, fingerprint).await,
        30,
        "no row changed on the way"
    );
}

/// Records the position `(ms, 0)` of stream `s` for every partition that has rows in the history,
/// and gives each history row the entry id `<ms>-<id>` of its publishing.
async fn positions_at(db: &TestDb, ms: i64) -> Vec<i32> {
    db.store
        .connection()
        .execute_unprepared(&format!(
            "INSERT INTO outpost_stream_position (partition, stream, last_ms, last_seq) \
             SELECT DISTINCT partition, 's', {ms}, 0 FROM outpost_published"
        ))
        .await
        .unwrap();
    let parts = db
        .store
        .connection()
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT DISTINCT partition FROM outpost_published ORDER BY 1",
        ))
        .await
        .unwrap();
    parts
        .iter()
        .map(|r| r.try_get_by_index::<i32>(0).unwrap())
        .collect()
}

/// After a Redis data loss a partition's retained window moves back into the outbox, every
/// event with its id, event id and sequence; an event whose id a producer wrote again after it
/// was published (the outbox then holds an event under that id) stays in the history instead of
/// failing the move, and the recovery completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_loss_moves_the_window_back_even_when_an_event_id_was_written_again() {
    let db = TestDb::new().await;
    let again = uuid::Uuid::now_v7();
    commit(
        &db,
        vec![
            EventFact::new("order", "o1", "order.placed", json!({"n": 1})).event_id(again),
            EventFact::new("order", "o2", "order.placed", json!({"n": 2})),
        ],
    )
    .await;
    db.store.age_as_published(None, 0).await.unwrap();
    let before = scalar(
        &db,
        "SELECT aggregate_seq FROM outpost_published WHERE aggregate_id = 'o2'",
    )
    .await;
    // The producer writes the first event's id again (a retry that did not know its first
    // transaction had committed): accepted, since the first one left the outbox.
    commit(
        &db,
        vec![EventFact::new("order", "o1", "order.placed", json!({"n": 1})).event_id(again)],
    )
    .await;

    // Redis kept nothing of stream `s`: every partition's window goes back.
    let mut republished = 0;
    for p in positions_at(&db, 1000).await {
        let lost = [LostStream {
            stream: "s".to_owned(),
            recorded: (1000, 0),
            kept: None,
        }];
        let recovery = db
            .store
            .recover_partition(p, &lost, 3600)
            .await
            .expect("the recovery runs")
            .expect("the positions are as read");
        republished += recovery.republished;
    }
    assert_eq!(republished, 1, "o2's event moves back, o1's first stays");
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'pending'"
        )
        .await,
        2,
        "o2's event re-queued, o1's second write pending"
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT aggregate_seq FROM outpost_event WHERE aggregate_id = 'o2'"
        )
        .await,
        before,
        "the re-queued event keeps its sequence"
    );
    assert_eq!(
        scalar(
            &db,
            &format!("SELECT count(*) FROM outpost_published WHERE event_id = '{again}'")
        )
        .await,
        1,
        "the first write of the repeated id stays in the history"
    );
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_stream_position").await,
        0,
        "a stream Redis kept nothing of loses its positions"
    );
}

/// A partial loss: only the events published after the newest entry Redis kept go back, the
/// partition's epoch moves on, the position is set back to what Redis kept, and a recovery based
/// on a position that moved since the check does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_partial_loss_moves_back_only_what_came_after_the_kept_entry() {
    let db = TestDb::new().await;
    commit(
        &db,
        (1..=3)
            .map(|n| EventFact::new("order", "o1", "order.placed", json!({"n": n})))
            .collect(),
    )
    .await;
    db.store.age_as_published(None, 0).await.unwrap();
    db.store
        .connection()
        .execute_unprepared(
            "UPDATE outpost_published SET stream_id = (aggregate_seq * 100)::text || '-0'",
        )
        .await
        .unwrap();
    let parts = positions_at(&db, 300).await;
    assert_eq!(parts.len(), 1);
    let p = parts[0];
    let epoch_sql = format!("SELECT epoch FROM outpost_partition WHERE partition = {p}");
    let before = scalar(&db, &epoch_sql).await;

    let stale = [LostStream {
        stream: "s".to_owned(),
        recorded: (250, 0),
        kept: Some((200, 0)),
    }];
    assert_eq!(
        db.store.recover_partition(p, &stale, 3600).await.unwrap(),
        None,
        "the position is no longer what the check read"
    );
    let lost = [LostStream {
        stream: "s".to_owned(),
        recorded: (300, 0),
        kept: Some((200, 0)),
    }];
    let recovery = db
        .store
        .recover_partition(p, &lost, 3600)
        .await
        .unwrap()
        .expect("recovered");
    assert_eq!(recovery.republished, 1);
    assert_eq!(recovery.outside_window, Some(0));
    assert_eq!(recovery.epoch, before + 1);
    assert_eq!(scalar(&db, &epoch_sql).await, before + 1);
    assert_eq!(
        scalar(
            &db,
            "SELECT aggregate_seq FROM outpost_event WHERE status = 'pending'"
        )
        .await,
        3,
        "only the third event was published after the kept entry"
    );
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        2
    );
    assert_eq!(
        scalar(&db, "SELECT last_ms FROM outpost_stream_position").await,
        200,
        "the position is what Redis kept"
    );
}
