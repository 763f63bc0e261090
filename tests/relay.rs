//! The relay against real PostgreSQL and Redis: order, loss, out-of-order commits, poison,
//! database session loss, locks on and columns added to the outbox, a held vacuum horizon,
//! wake-ups, graceful shutdown.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use outpost::produce::{EventFact, Producer};
use outpost::store::{Actor, Role, Selection};
use rand::Rng;
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde_json::json;
use support::{
    Deliveries, TestDb, TestRedis, assert_all_published, relay_config, scalar, wait_for_idle_node,
    wait_until,
};

async fn commit(db: &TestDb, facts: Vec<EventFact>) -> Vec<String> {
    support::commit_facts(&db.store, facts).await
}

async fn wait_delivered(redis: &TestRedis, n: usize, secs: u64) -> Deliveries {
    let mut conn = redis.conn().await;
    wait_until(secs, &format!("{n} distinct events in the streams"), || {
        let prefix = redis.prefix.clone();
        let mut c = conn.clone();
        async move { Deliveries::collect(&mut c, &prefix).await.unique() >= n }
    })
    .await;
    Deliveries::collect(&mut conn, &redis.prefix).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_committed_event_is_published_once_in_order_and_rolled_back_ones_never() {
    let db = TestDb::with_pool(24).await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "order-node")).await;

    let committed = Arc::new(Mutex::new(HashSet::new()));
    let rolled_back = Arc::new(Mutex::new(HashSet::new()));
    let mut writers = Vec::new();
    for w in 0..16u64 {
        let (store, committed, rolled_back) =
            (db.store.clone(), committed.clone(), rolled_back.clone());
        writers.push(tokio::spawn(async move {
            use rand::SeedableRng;
            let p = Producer::default();
            let mut rng = rand::rngs::StdRng::seed_from_u64(w);
            let mut written = 0;
            while written < 1250 {
                let n = rng.random_range(1..=3usize).min(1250 - written);
                let facts: Vec<EventFact> = (0..n)
                    .map(|_| {
                        let agg = rng.random_range(0..200u32);
                        EventFact::new(
                            format!("kind{}", agg % 4),
                            format!("a{agg}"),
                            "thing.happened",
                            json!({"writer": w}),
                        )
                    })
                    .collect();
                let ids: Vec<String> = facts.iter().map(|f| f.id().to_string()).collect();
                let txn = store.connection().begin().await.unwrap();
                p.enqueue_facts(&txn, facts).await.unwrap();
                if rng.random_bool(0.05) {
                    txn.rollback().await.unwrap();
                    rolled_back.lock().unwrap().extend(ids);
                } else {
                    txn.commit().await.unwrap();
                    committed.lock().unwrap().extend(ids);
                    written += n;
                }
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let committed = committed.lock().unwrap().clone();
    assert_eq!(committed.len(), 20_000);
    let delivered = wait_delivered(&redis, committed.len(), 180).await;

    assert_eq!(delivered.duplicates(), 0, "no faults: no duplicates");
    assert_eq!(delivered.order_violations(), Vec::<(String, String)>::new());
    let seen: HashSet<String> = delivered.copies.keys().cloned().collect();
    assert_eq!(seen, committed, "exactly the committed events");
    let rolled_back = rolled_back.lock().unwrap().clone();
    assert!(!rolled_back.is_empty());
    assert!(
        rolled_back.is_disjoint(&seen),
        "a rolled-back event was published"
    );
    assert_all_published(&db).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_transaction_with_a_lower_id_is_not_skipped() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "ooo-node")).await;
    let p = Producer::default();

    let first = commit(
        &db,
        vec![EventFact::new("kind0", "held", "t", json!({"n": 1}))],
    )
    .await;
    // A transaction takes a lower id and stays open...
    let open = db.store.connection().begin().await.unwrap();
    let late = EventFact::new("kind0", "held", "t", json!({"n": 2}));
    let late_id = late.id().to_string();
    p.enqueue_facts(&open, vec![late]).await.unwrap();
    // ...while later ids of other aggregates commit and are published.
    let mut others = Vec::new();
    for i in 0..50 {
        others.extend(
            commit(
                &db,
                vec![EventFact::new("kind1", format!("o{i}"), "t", json!({}))],
            )
            .await,
        );
    }
    let d = wait_delivered(&redis, 51, 60).await;
    assert!(
        !d.copies.contains_key(&late_id),
        "uncommitted event published"
    );
    open.commit().await.unwrap();

    let d = wait_delivered(&redis, 52, 60).await;
    assert!(
        d.copies.contains_key(&late_id),
        "the late commit was skipped"
    );
    assert!(d.copies.contains_key(&first[0]));
    assert_eq!(
        d.order.get(&("kind0".to_owned(), "held".to_owned())),
        Some(&vec![1, 2])
    );
    assert_eq!(d.duplicates(), 0);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_quarantined_and_holds_back_only_its_own_aggregates() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let mut conn = redis.conn().await;
    // A key of the wrong type sits where the `poison` aggregate type's stream should be.
    let poisoned = format!("{}events:poison", redis.prefix);
    let _: () = redis::cmd("SET")
        .arg(&poisoned)
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();

    // Find a healthy aggregate in the same partition as poison/p0.
    let part = scalar(&db, "SELECT outpost_partition_of('poison', 'p0', 64)::int8").await;
    let neighbour = (0..10_000)
        .map(|i| format!("n{i}"))
        .find(|id| {
            let sql = format!("SELECT outpost_partition_of('good', '{id}', 64)::int8");
            futures::executor::block_on(scalar(&db, &sql)) == part
        })
        .unwrap();

    let mut poison_ids = Vec::new();
    for n in 0..3 {
        poison_ids.extend(
            commit(
                &db,
                vec![EventFact::new("poison", "p0", "t", json!({"n": n}))],
            )
            .await,
        );
    }
    let node = support::start_node(relay_config(&db, &redis, "poison-node")).await;
    let mut good = Vec::new();
    for n in 0..20 {
        good.extend(
            commit(
                &db,
                vec![EventFact::new(
                    "good",
                    neighbour.clone(),
                    "t",
                    json!({"n": n}),
                )],
            )
            .await,
        );
        good.extend(
            commit(
                &db,
                vec![EventFact::new("good", format!("g{n}"), "t", json!({}))],
            )
            .await,
        );
    }
    // Every other aggregate, including one in the same partition, is delivered.
    let d = wait_delivered(&redis, good.len(), 60).await;
    assert!(good.iter().all(|id| d.copies.contains_key(id)));

    wait_until(60, "the poison event to be quarantined", || async {
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'quarantined'",
        )
        .await
            == 1
    })
    .await;
    let row = db
        .store
        .connection()
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT attempts, last_error, aggregate_seq FROM outpost_event WHERE status = 'quarantined'",
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        row.try_get_by_index::<i32>(0).unwrap(),
        1,
        "a key of the wrong type at the stream never heals by itself: quarantined at the first \
         attempt"
    );
    assert!(
        row.try_get_by_index::<String>(1)
            .unwrap()
            .starts_with("WRONGTYPE")
    );
    assert_eq!(row.try_get_by_index::<i64>(2).unwrap(), 1);
    // Its successors wait, held, in order; a new event of the aggregate is held too.
    poison_ids.extend(
        commit(
            &db,
            vec![EventFact::new("poison", "p0", "t", json!({"n": 3}))],
        )
        .await,
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'held'"
        )
        .await,
        3
    );

    // Fix the cause and release the aggregate: the held chain is published in order, same ids.
    let _: () = redis::cmd("DEL")
        .arg(&poisoned)
        .query_async(&mut conn)
        .await
        .unwrap();
    let quarantined: uuid::Uuid = db
        .store
        .connection()
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT event_id FROM outpost_event WHERE status = 'quarantined' \
             AND aggregate_type = 'poison' AND aggregate_id = 'p0'",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index(0)
        .unwrap();
    let done = db
        .store
        .replay_events(
            &Actor::new("relay-test", Role::Operator),
            &Selection::Ids(vec![quarantined]),
            "the stream was fixed",
        )
        .await
        .unwrap();
    assert_eq!(
        (done.events, done.released),
        (1, 3),
        "the poison and its 3 held successors"
    );
    let d = wait_delivered(&redis, good.len() + 4, 60).await;
    assert_eq!(
        d.order.get(&("poison".to_owned(), "p0".to_owned())),
        Some(&vec![1, 2, 3, 4])
    );
    for id in &poison_ids {
        assert_eq!(
            d.copies.get(id),
            Some(&1),
            "original event id {id} published once"
        );
    }
    assert!(d.order_violations().is_empty());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_database_sessions_are_survived_without_loss() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "pgkill-node")).await;
    let mut ids = Vec::new();
    let mut killed = 0;
    for round in 0..5 {
        for i in 0..100 {
            ids.extend(
                commit(
                    &db,
                    vec![EventFact::new(
                        "kind0",
                        format!("a{}", i % 20),
                        "t",
                        json!({"r": round}),
                    )],
                )
                .await,
            );
        }
        // Kill every session of the node, the LISTEN connection included (after the first round,
        // whichever the node has reopened by then).
        killed += scalar(
            &db,
            "SELECT count(pg_terminate_backend(pid))::int8 FROM pg_stat_activity \
             WHERE application_name LIKE 'outpost %pgkill-node'",
        )
        .await;
        assert!(killed > 0, "the node's sessions were found");
    }

    let d = wait_delivered(&redis, ids.len(), 120).await;
    assert!(
        ids.iter().all(|id| d.copies.contains_key(id)),
        "nothing lost"
    );
    assert!(d.order_violations().is_empty());
    node.shutdown().await;
}

/// Every id delivered, none twice, each aggregate in sequence order.
fn assert_once_in_order(d: &Deliveries, ids: &[String]) {
    assert!(
        ids.iter().all(|id| d.copies.contains_key(id)),
        "nothing lost"
    );
    assert_eq!(d.duplicates(), 0, "nothing published twice");
    assert!(d.order_violations().is_empty());
}

/// Ten transactions of ten events over aggregates `a0`..`a9` of `kind0`, one after the other.
async fn commit_hundred(db: &TestDb, round: u32) -> Vec<String> {
    let mut ids = Vec::new();
    for tx in 0..10 {
        let facts = (0..10)
            .map(|i| EventFact::new("kind0", format!("a{i}"), "t", json!({"r": round, "tx": tx})))
            .collect();
        ids.extend(commit(db, facts).await);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_on_the_outbox_longer_than_a_lease_delays_delivery_but_costs_no_lease() {
    // An operator's `ALTER TABLE`, `VACUUM FULL` or `LOCK TABLE` holds the outbox in ACCESS
    // EXCLUSIVE mode: producers and the node's claims wait behind it. The node must keep its
    // leases meanwhile (their renewal gives up on the outbox and renews without reading it), and
    // deliver everything once the lock is gone, in order and once each.
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "lock-node")).await;
    let mut ids = commit_hundred(&db, 0).await;
    wait_delivered(&redis, ids.len(), 60).await;
    let epochs = scalar(&db, "SELECT sum(epoch)::int8 FROM outpost_partition").await;

    let lock = db.store.connection().begin().await.unwrap();
    lock.execute_unprepared("LOCK TABLE outpost_event IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let locked_ms: i64 = lock
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index(0)
        .unwrap();
    let store = db.store.clone();
    let writer = tokio::spawn(async move {
        let facts = (0..10)
            .map(|i| EventFact::new("kind0", format!("a{i}"), "t", json!({"while": "locked"})))
            .collect();
        support::commit_facts(&store, facts).await
    });
    wait_until(30, "a producer waiting for the lock", || async {
        scalar(
            &db,
            "SELECT count(*) FROM pg_locks \
             WHERE relation = 'outpost_event'::regclass AND NOT granted",
        )
        .await
            >= 1
    })
    .await;
    // More than a lease length (2 s) passes with the outbox locked, and the node renews every
    // lease after that: without those renewals every lease would have expired by then.
    wait_until(
        30,
        "every lease renewed a lease length after the lock",
        || async {
            scalar(
                &db,
                &format!(
                    "SELECT count(*) FROM outpost_partition WHERE owner = 'lock-node' \
                     AND lease_until > to_timestamp({locked_ms} / 1000.0) + interval '4 seconds'"
                ),
            )
            .await
                == 64
        },
    )
    .await;
    assert!(
        !writer.is_finished(),
        "the producer still waits for the lock"
    );
    lock.commit().await.unwrap();

    ids.extend(writer.await.unwrap());
    let d = wait_delivered(&redis, ids.len(), 60).await;
    assert_once_in_order(&d, &ids);
    assert_eq!(
        scalar(&db, "SELECT sum(epoch)::int8 FROM outpost_partition").await,
        epochs,
        "no lease was lost and taken again"
    );
    assert_all_published(&db).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_holding_the_vacuum_horizon_stops_no_delivery_and_is_reported() {
    // A forgotten session `idle in transaction` (or a long report) keeps a snapshot: every row
    // the node marks stays behind as a dead version vacuum cannot remove. Delivery goes on
    // regardless, and the storage figures behind the `OutpostVacuumHorizonHeld` alert name the
    // holder's age until it ends.
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "horizon-node")).await;
    let holder = db.store.connection().begin().await.unwrap();
    holder
        .execute_unprepared("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    holder
        .execute_unprepared("SELECT count(*) FROM outpost_event")
        .await
        .unwrap();

    let mut ids = commit_hundred(&db, 0).await;
    ids.extend(commit_hundred(&db, 1).await);
    let d = wait_delivered(&redis, ids.len(), 60).await;
    assert_once_in_order(&d, &ids);
    assert_all_published(&db).await;

    let vacuum = || async {
        db.store
            .connection()
            .execute_unprepared("VACUUM outpost_event")
            .await
            .unwrap();
    };
    vacuum().await;
    let held = db.store.storage_figures().await.unwrap();
    assert!(
        held.xmin_age_xids >= 20,
        "the holder's snapshot is older than the 20 producer transactions: {held:?}"
    );
    assert!(held.oldest_xact_secs > 0.0, "{held:?}");
    assert!(
        held.dead_tuples >= 200,
        "the 200 delivered rows stay behind as dead versions: {held:?}"
    );

    holder.commit().await.unwrap();
    // Without the holder, the next vacuum removes them and the horizon is free again (a node's
    // statement in flight holds it for an instant, hence the wait).
    wait_until(
        30,
        "the dead versions vacuumed and the horizon free",
        || async {
            vacuum().await;
            let f = db.store.storage_figures().await.unwrap();
            f.dead_tuples == 0 && f.xmin_age_xids < 20
        },
    )
    .await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn columns_added_to_the_outbox_while_a_node_runs_change_nothing() {
    // Teams add columns of their own to the outbox (a tenant, a region) while nodes run: the
    // node's prepared statements are planned again and keep their shape, producers of either
    // kind keep writing, and the published history takes the rows without the new columns.
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "column-node")).await;
    let mut ids = commit_hundred(&db, 0).await;
    wait_delivered(&redis, ids.len(), 60).await;

    db.store
        .connection()
        .execute_unprepared(
            "ALTER TABLE outpost_event ADD COLUMN tenant text; \
             ALTER TABLE outpost_event ADD COLUMN region text NOT NULL DEFAULT 'eu'",
        )
        .await
        .unwrap();
    ids.extend(commit_hundred(&db, 1).await);
    for i in 0..10 {
        let id = uuid::Uuid::new_v4().to_string();
        db.store
            .connection()
            .execute_unprepared(&format!(
                "INSERT INTO outpost_event \
                   (event_id, aggregate_type, aggregate_id, event_type, payload, tenant) \
                 VALUES ('{id}', 'kind0', 'a{i}', 't', '{{\"plain\": true}}', 'acme')"
            ))
            .await
            .unwrap();
        ids.push(id);
    }

    let d = wait_delivered(&redis, ids.len(), 60).await;
    assert_once_in_order(&d, &ids);
    assert_all_published(&db).await;
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        i64::try_from(ids.len()).unwrap()
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_nudge_waits_for_the_scheduled_poll() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "nonudge-node")).await;
    wait_for_idle_node(&db).await;
    // The nudge gets lost: the idle node waits for one, but its request is gone from the table
    // and cannot come back, so the producer's insert sends none.
    db.store
        .connection()
        .execute_unprepared(
            "CREATE FUNCTION test_lose_nudges() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN NEW.wants_nudge := false; RETURN NEW; END $$; \
             CREATE TRIGGER test_lose_nudges BEFORE UPDATE ON outpost_node \
             FOR EACH ROW EXECUTE FUNCTION test_lose_nudges(); \
             UPDATE outpost_node SET wants_nudge = false;",
        )
        .await
        .unwrap();
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_node WHERE wants_nudge").await,
        0
    );
    let id = commit(&db, vec![EventFact::new("kind0", "a", "t", json!({}))]).await;
    let d = wait_delivered(&redis, 1, 30).await;
    assert!(d.copies.contains_key(&id[0]));
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_long_heartbeat_the_nudge_delivers() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let config = support::relay_config_for(
        &db,
        &redis,
        "nudge-node",
        &[
            ("relay.idle_after_ms", "50"),
            ("node.heartbeat_ms", "20000"),
            ("node.lease_ms", "60000"),
        ],
    );
    assert_eq!(config.node.heartbeat_ms, 20_000, "later overrides win");
    let node = support::start_node(config).await;
    wait_for_idle_node(&db).await;
    // The node is idle, so it no longer polls on its own, and its next scheduled poll (the
    // heartbeat tick) is twenty seconds away at the least: only the nudge can deliver in time.
    let id = commit(&db, vec![EventFact::new("kind0", "a", "t", json!({}))]).await;
    let d = wait_delivered(&redis, 1, 10).await;
    assert!(d.copies.contains_key(&id[0]));
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_no_partition_to_deliver_asks_for_no_nudges() {
    // A node whose every partition is paused (or a standby node holding none, or one that has
    // not taken its leases yet) has nothing a nudge could wake: were it to ask, every producer's
    // commit would send a NOTIFY for nothing, and a transaction meant for two-phase commit could
    // not be prepared.
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let partitions = scalar(&db, "SELECT partition_count::int8 FROM outpost_meta").await;
    let all: Vec<i32> = (0..i32::try_from(partitions).unwrap()).collect();
    db.store
        .set_paused(&all, true, "test", "operator")
        .await
        .unwrap();
    let node = support::start_node(relay_config(&db, &redis, "paused-node")).await;
    // Holding every partition, two heartbeats after its start: far longer without work than
    // `relay.idle_after_ms` (20 ms), after which a node delivering partitions asks for nudges.
    wait_until(
        30,
        "the node to hold its paused partitions for two heartbeats",
        || async {
            node.owned_partitions().await.len() == all.len()
                && scalar(
                    &db,
                    "SELECT count(*) FROM outpost_node \
                     WHERE heartbeat_at >= started_at + interval '400 milliseconds'",
                )
                .await
                    == 1
        },
    )
    .await;
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_node WHERE wants_nudge").await,
        0,
        "a node with every partition paused asks for no nudges"
    );
    // Resumed, its partitions are delivered; idle again, it asks for nudges.
    let ids = commit_nth(&db, 1).await;
    db.store
        .set_paused(&all, false, "test", "operator")
        .await
        .unwrap();
    let d = wait_delivered(&redis, 1, 30).await;
    assert!(d.copies.contains_key(&ids[0]));
    wait_for_idle_node(&db).await;
    node.shutdown().await;
}

/// A node that goes idle 50 ms after its last work and polls on its own only every 20 s (its
/// heartbeat), started and left idle; then `sql` runs (it changes how the node's row behaves).
async fn idle_node_then(
    db: &TestDb,
    redis: &TestRedis,
    node_id: &str,
    sql: &str,
) -> outpost::app::NodeHandle {
    let config = support::relay_config_for(
        db,
        redis,
        node_id,
        &[
            ("relay.idle_after_ms", "50"),
            ("node.heartbeat_ms", "20000"),
            ("node.lease_ms", "60000"),
        ],
    );
    let node = support::start_node(config).await;
    wait_for_idle_node(db).await;
    db.store.connection().execute_unprepared(sql).await.unwrap();
    node
}

/// How many times the sequence `name` was drawn from (0 before the first `nextval`).
async fn times_drawn(db: &TestDb, name: &str) -> i64 {
    scalar(
        db,
        &format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {name}"),
    )
    .await
}

/// Waits until the node is idle again, then commits a second event and checks that it arrives
/// by its nudge (the scheduled poll is twenty seconds away), after `ids`, each once in order.
async fn second_event_is_nudged(
    db: &TestDb,
    redis: &TestRedis,
    node: outpost::app::NodeHandle,
    mut ids: Vec<String>,
) {
    wait_for_idle_node(db).await;
    ids.extend(commit_nth(db, 2).await);
    let d = wait_delivered(redis, 2, 10).await;
    assert_once_in_order(&d, &ids);
    node.shutdown().await;
}

/// Commits one event of aggregate `a` with payload `{"n": n}`; returns its id.
async fn commit_nth(db: &TestDb, n: u32) -> Vec<String> {
    commit(db, vec![EventFact::new("kind0", "a", "t", json!({"n": n}))]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_for_nudges_is_made_again() {
    // A node going idle asks producers to nudge it. When that update fails, the node must not
    // wait for nudges nobody sends: it keeps polling and asks again.
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    // From now on every request for nudges fails, and is counted (a sequence is not rolled back
    // with the failed update).
    let node = idle_node_then(
        &db,
        &redis,
        "ask-node",
        "CREATE SEQUENCE ask_attempts; \
         CREATE FUNCTION refuse_ask() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM nextval('ask_attempts'); RAISE EXCEPTION 'refused for the test'; END $$; \
         CREATE TRIGGER refuse_ask BEFORE UPDATE OF wants_nudge ON outpost_node \
         FOR EACH ROW WHEN (NEW.wants_nudge AND NOT OLD.wants_nudge) \
         EXECUTE FUNCTION refuse_ask()",
    )
    .await;
    // An event wakes the node (its nudge); the node then goes idle again, and its request fails.
    let ids = commit_nth(&db, 1).await;
    wait_delivered(&redis, 1, 10).await;
    wait_until(
        10,
        "the node to ask again after its request failed",
        || async { times_drawn(&db, "ask_attempts").await >= 2 },
    )
    .await;
    db.store
        .connection()
        .execute_unprepared("DROP TRIGGER refuse_ask ON outpost_node")
        .await
        .unwrap();
    // Its next request goes through; an event committed after it is nudged.
    second_event_is_nudged(&db, &redis, node, ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_request_for_nudges_lands_after_the_wake_up_that_came_before_it() {
    // Waking up, the node clears `wants_nudge`; going idle again shortly after, it sets it. If
    // the clearing reached the database late (a slow connection, a pool under load) and both
    // writes were under way at once, it could land last: the node idle, the row saying "do not
    // nudge", and every event waiting for the scheduled poll, twenty seconds away here.
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    // The next write of the node row (the clearing) waits half a second before it touches the
    // row; the ones after it do not.
    let node = idle_node_then(
        &db,
        &redis,
        "order-node",
        "CREATE SEQUENCE node_writes; CREATE SEQUENCE slow_write_done; \
         CREATE FUNCTION slow_first_write() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF nextval('node_writes') = 1 THEN \
           PERFORM pg_sleep(0.5); PERFORM nextval('slow_write_done'); END IF; \
         RETURN NULL; END $$; \
         CREATE TRIGGER slow_first_write BEFORE UPDATE ON outpost_node \
         FOR EACH STATEMENT EXECUTE FUNCTION slow_first_write()",
    )
    .await;
    let ids = commit_nth(&db, 1).await;
    wait_delivered(&redis, 1, 10).await;
    wait_until(10, "the slow clearing to land", || async {
        times_drawn(&db, "slow_write_done").await == 1
    })
    .await;
    // The node went idle meanwhile: its request for nudges must be what the row says now.
    second_event_is_nudged(&db, &redis, node, ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_mid_batch_loses_and_duplicates_nothing() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let facts: Vec<EventFact> = (0..3000)
        .map(|i| {
            EventFact::new(
                format!("kind{}", i % 2),
                format!("a{}", i % 50),
                "t",
                json!({"i": i}),
            )
        })
        .collect();
    let ids = commit(&db, facts).await;
    // A slow rate keeps batches in flight, and leaves most events unpublished when the shutdown
    // comes (3,000 events take six seconds), however busy the machine is.
    let config = support::relay_config_for(
        &db,
        &redis,
        "graceful-node",
        &[
            ("rate_limit.global_per_sec", "500"),
            ("rate_limit.burst", "50"),
        ],
    );
    let node = support::start_node(config.clone()).await;
    let mut conn = redis.conn().await;
    wait_until(30, "publishing to be under way", || {
        let prefix = redis.prefix.clone();
        let mut c = conn.clone();
        async move { Deliveries::collect(&mut c, &prefix).await.unique() >= 300 }
    })
    .await;
    let before = std::time::Instant::now();
    node.shutdown().await;
    let took = before.elapsed();
    assert!(
        took < config.relay.shutdown_timeout(),
        "shutdown within its deadline ({took:?})"
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_partition WHERE owner IS NOT NULL"
        )
        .await,
        0,
        "every lease released"
    );
    let partial = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert!(partial.unique() < ids.len(), "stopped part-way");
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await as usize,
        partial.unique(),
        "every published entry was marked: the in-flight batch finished"
    );

    let node = support::start_node(relay_config(&db, &redis, "graceful-node-2")).await;
    let d = wait_delivered(&redis, ids.len(), 60).await;
    assert_eq!(d.duplicates(), 0);
    assert!(d.order_violations().is_empty());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_partition_publishes_nothing_survives_a_restart_and_resumes_in_order() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "pause-node")).await;
    let part = i32::try_from(
        scalar(
            &db,
            "SELECT outpost_partition_of('kind0', 'held', 64)::int8",
        )
        .await,
    )
    .unwrap();
    let mut before = commit(
        &db,
        vec![EventFact::new("kind0", "held", "t", json!({"n": 1}))],
    )
    .await;
    wait_delivered(&redis, 1, 30).await;

    let changed = db
        .store
        .set_paused(&[part], true, "test", "operator")
        .await
        .unwrap();
    assert_eq!(changed, vec![part]);
    wait_until(30, "the node to stop serving the paused partition", || {
        let owned = node.owned_partitions();
        async move {
            owned
                .await
                .iter()
                .any(|(p, _, paused)| *p == part && *paused)
        }
    })
    .await;
    let audited = scalar(
        &db,
        "SELECT count(*) FROM outpost_audit WHERE action = 'partition.pause'",
    )
    .await;
    assert_eq!(audited, 1, "the pause is audited");

    // Under load: the paused partition's events wait, every other partition flows.
    let mut held = Vec::new();
    let mut others = Vec::new();
    for n in 2..=11 {
        held.extend(
            commit(
                &db,
                vec![EventFact::new("kind0", "held", "t", json!({"n": n}))],
            )
            .await,
        );
        for i in 0..5 {
            let id = format!("o{n}-{i}");
            if scalar(
                &db,
                &format!("SELECT outpost_partition_of('kind1', '{id}', 64)::int8"),
            )
            .await
                != i64::from(part)
            {
                others.extend(commit(&db, vec![EventFact::new("kind1", id, "t", json!({}))]).await);
            }
        }
    }
    let d = wait_delivered(&redis, 1 + others.len(), 60).await;
    assert!(
        held.iter().all(|id| !d.copies.contains_key(id)),
        "a paused partition published"
    );

    // The pause is in the database: a restarted node honours it.
    node.shutdown().await;
    let node = support::start_node(relay_config(&db, &redis, "pause-node-2")).await;
    wait_until(30, "the new node to own the partition, paused", || {
        let owned = node.owned_partitions();
        async move {
            owned
                .await
                .iter()
                .any(|(p, _, paused)| *p == part && *paused)
        }
    })
    .await;
    others.extend(commit(&db, vec![EventFact::new("kind1", "late", "t", json!({}))]).await);
    let d = wait_delivered(&redis, 1 + others.len(), 60).await;
    assert!(
        held.iter().all(|id| !d.copies.contains_key(id)),
        "paused after the restart too"
    );

    // Resume: the held events follow, in order, none lost.
    db.store
        .set_paused(&[part], false, "test", "operator")
        .await
        .unwrap();
    let d = wait_delivered(&redis, 1 + others.len() + held.len(), 60).await;
    before.extend(held);
    assert!(before.iter().all(|id| d.copies.get(id) == Some(&1)));
    assert_eq!(
        d.order.get(&("kind0".to_owned(), "held".to_owned())),
        Some(&(1..=11).collect::<Vec<i64>>())
    );
    assert!(d.order_violations().is_empty());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_lost_history_moves_past_the_stale_fences_in_redis() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let part = scalar(&db, "SELECT outpost_partition_of('kind0', 'a', 64)::int8").await;
    // Redis remembers epoch 50 for the partition, from a database that was later restored or
    // recreated: this database hands out epochs from 1.
    let stream = format!("{}events:kind0", redis.prefix);
    let fence = format!("{}outpost:fence:{{{stream}}}", redis.prefix);
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("HSET")
        .arg(&fence)
        .arg(part)
        .arg(50)
        .query_async(&mut conn)
        .await
        .unwrap();

    let node = support::start_node(relay_config(&db, &redis, "restored-node")).await;
    let ids = commit(&db, vec![EventFact::new("kind0", "a", "t", json!({}))]).await;
    let d = wait_delivered(&redis, 1, 30).await;
    assert_eq!(d.copies.get(&ids[0]), Some(&1));
    let epoch = scalar(
        &db,
        &format!("SELECT epoch FROM outpost_partition WHERE partition = {part}"),
    )
    .await;
    assert!(
        epoch > 50,
        "the lease moved past the stale fence (epoch {epoch})"
    );
    node.shutdown().await;
}

/// The stream contract's field list, written out here on its own (not taken from the publisher),
/// for an event of aggregate `shape:a`, seq `seq`, with the given optional fields.
fn contract_fields(
    event_id: &str,
    seq: i64,
    optional: &[(&str, &str)],
    data: &str,
) -> Vec<(String, String)> {
    let mut f: Vec<(String, String)> = [
        ("ce_specversion", "1.0"),
        ("ce_id", event_id),
        ("ce_type", "shape.tested"),
        ("ce_source", "/outpost/shape"),
        ("ce_subject", "a"),
        ("ce_time", "2026-12-01T10:00:00.123456Z"),
        ("ce_aggregatetype", "shape"),
        ("ce_aggregateseq", &seq.to_string()),
        ("ce_schemaversion", "2.1"),
        ("content-type", "application/json"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    f.extend(
        optional
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    f.push(("data".to_owned(), data.to_owned()));
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_carry_the_contract_fields_in_order_for_every_header_shape() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(relay_config(&db, &redis, "shape-node")).await;
    let at = chrono::DateTime::parse_from_rfc3339("2026-12-01T10:00:00.123456Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    // Each event's headers, and the optional fields its entry must carry, in order.
    let shapes: Vec<(serde_json::Value, Vec<(&str, &str)>)> = vec![
        (json!({}), vec![]),
        (json!({"traceparent": tp}), vec![("traceparent", tp)]),
        (json!({"tracestate": "k=v"}), vec![("tracestate", "k=v")]),
        (
            json!({"tenant": "t1"}),
            vec![("headers", r#"{"tenant":"t1"}"#)],
        ),
        (
            json!({"tenant": "t1", "tracestate": "k=v", "traceparent": tp}),
            vec![
                ("traceparent", tp),
                ("tracestate", "k=v"),
                ("headers", r#"{"tenant":"t1"}"#),
            ],
        ),
    ];
    let facts: Vec<EventFact> = shapes
        .iter()
        .enumerate()
        .map(|(i, (headers, _))| {
            EventFact::new("shape", "a", "shape.tested", json!({ "n": i }))
                .schema_version("2.1")
                .occurred_at(at)
                .headers_json(headers.clone())
        })
        .collect();
    let ids = commit(&db, facts).await;
    wait_delivered(&redis, shapes.len(), 30).await;

    let mut conn = redis.conn().await;
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(format!("{}events:shape", redis.prefix))
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(entries.len(), shapes.len());
    for (i, ((_, fields), (_, optional))) in entries.iter().zip(&shapes).enumerate() {
        let seq = i64::try_from(i).unwrap() + 1;
        let data = &fields.last().unwrap().1;
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(data).unwrap(),
            json!({ "n": i })
        );
        assert_eq!(
            fields,
            &contract_fields(&ids[i], seq, optional, data),
            "entry {i}"
        );
    }
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_sharing_a_stream_share_its_order_and_a_second_stream_waits_its_turn() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    // `Shipped` is routed by an override to the default stream's name, `Audit` to a stream of
    // its own; the other types follow the default template.
    let config = support::relay_config_for(
        &db,
        &redis,
        "routes-node",
        &[
            ("routing.overrides.Shipped", "events:{aggregate_type}"),
            ("routing.overrides.Audit", "audit:{aggregate_type}"),
        ],
    );
    // Commit first, so the node's first batches see every aggregate's rows at once.
    let types = [
        "Created", "Shipped", "Audit", "Paid", "Audit", "Shipped", "Closed",
    ];
    let mut expected: Vec<(String, String, i64)> = Vec::new();
    for a in 0..20 {
        let facts: Vec<EventFact> = types
            .iter()
            .map(|t| EventFact::new("order", format!("o{a}"), *t, json!({ "t": t })))
            .collect();
        commit(&db, facts).await;
        for (i, t) in types.iter().enumerate() {
            let stream = if *t == "Audit" {
                "audit:order"
            } else {
                "events:order"
            };
            expected.push((
                format!("o{a}"),
                stream.to_owned(),
                i64::try_from(i).unwrap() + 1,
            ));
        }
    }
    let node = support::start_node(config).await;
    let conn = redis.conn().await;
    let read = |stream: &'static str| {
        let key = format!("{}{stream}", redis.prefix);
        let mut c = conn.clone();
        async move { support::read_stream(&mut c, &key).await }
    };
    let total = expected.len();
    wait_until(30, "every event in its stream", || {
        let (events, audit) = (read("events:order"), read("audit:order"));
        async move { events.await.len() + audit.await.len() >= total }
    })
    .await;
    for stream in ["events:order", "audit:order"] {
        let entries = read(stream).await;
        let mut seen: std::collections::HashMap<String, Vec<i64>> = Default::default();
        for (_, f) in &entries {
            seen.entry(f["ce_subject"].clone())
                .or_default()
                .push(f["ce_aggregateseq"].parse().unwrap());
        }
        for a in 0..20 {
            let want: Vec<i64> = expected
                .iter()
                .filter(|(agg, s, _)| *agg == format!("o{a}") && s == stream)
                .map(|(_, _, seq)| *seq)
                .collect();
            assert_eq!(seen.get(&format!("o{a}")), Some(&want), "{stream}, o{a}");
        }
    }
    assert_all_published(&db).await;
    node.shutdown().await;
}

/// The relay's worker sessions commit asynchronously and use generic plans; every other session
/// (the supervisor's leases, operators' commands) keeps PostgreSQL's defaults.
#[tokio::test]
async fn worker_sessions_commit_asynchronously_and_use_generic_plans() {
    let db = TestDb::new().await;
    for (relay_worker, commit, plans) in
        [(true, "off", "force_generic_plan"), (false, "on", "auto")]
    {
        let store = outpost::store::Store::connect(&outpost::store::ConnectSettings {
            relay_worker,
            ..outpost::store::ConnectSettings::new(db.url.clone(), "outpost test", 1)
        })
        .await
        .unwrap();
        let row = store
            .connection()
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT current_setting('synchronous_commit'), current_setting('plan_cache_mode'), \
                        current_setting('random_page_cost')",
            ))
            .await
            .unwrap()
            .unwrap();
        let got: (String, String, String) = (
            row.try_get_by_index(0).unwrap(),
            row.try_get_by_index(1).unwrap(),
            row.try_get_by_index(2).unwrap(),
        );
        assert_eq!(
            got,
            (commit.to_owned(), plans.to_owned(), "1.1".to_owned()),
            "relay_worker = {relay_worker}"
        );
    }
}
