//! Crashes of the database server itself: the postmaster of a PostgreSQL owned by the test is
//! killed with SIGKILL while writers commit and a node publishes, then started again (crash
//! recovery). Twice. Every committed event is delivered, nothing is delivered that was not
//! committed (a transaction whose commit got no answer may have committed or not, and either is
//! fine), each aggregate's first deliveries are its gap-free sequence 1, 2, 3, … in order (the
//! sequences survive recovery without a hole), no attempt is counted, `/readyz` says not-ready
//! while the server is down, and the node resumes by itself.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outpost::produce::{EventFact, Producer};
use outpost::store::Store;
use sea_orm::TransactionTrait;
use serde_json::json;
use support::pg_server::OwnPostgres;
use support::{Deliveries, TestRedis, scalar_on as scalar, wait_until};

/// What the writers know of their transactions.
#[derive(Default)]
struct Written {
    /// Their commit returned: these events are committed.
    committed: HashSet<String>,
    /// Their commit failed with the connection (the server died): committed or not, unknown.
    unknown: HashSet<String>,
}

/// Four writers committing two events of two of 60 aggregates per transaction until stopped,
/// carrying on through the crashes (a transaction that fails before its commit is not
/// committed and is simply written again as a new one).
fn writers(store: &Store, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Written> {
    let store = store.clone();
    tokio::spawn(async move {
        let written = Arc::new(Mutex::new(Written::default()));
        let mut tasks = Vec::new();
        for w in 0..4u64 {
            let (store, written, stop) = (store.clone(), written.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let facts: Vec<EventFact> = (0..2)
                        .map(|k| {
                            EventFact::new(
                                "kind0",
                                format!("a{}", (i * 8 + w * 2 + k) % 60),
                                "t",
                                json!({"w": w, "i": i}),
                            )
                        })
                        .collect();
                    let ids: Vec<String> = facts.iter().map(|f| f.id().to_string()).collect();
                    // While the server is down every step fails at once: pace the retries.
                    let retry = Duration::from_millis(20);
                    let Ok(txn) = store.connection().begin().await else {
                        tokio::time::sleep(retry).await;
                        continue;
                    };
                    if Producer::default()
                        .enqueue_facts(&txn, facts)
                        .await
                        .is_err()
                    {
                        drop(txn);
                        tokio::time::sleep(retry).await;
                        continue;
                    }
                    let outcome = txn.commit().await;
                    {
                        let mut written = written.lock().unwrap();
                        match outcome {
                            Ok(()) => written.committed.extend(ids),
                            Err(_) => written.unknown.extend(ids),
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        Arc::try_unwrap(written)
            .ok()
            .expect("the writers are done")
            .into_inner()
            .unwrap()
    })
}

/// Waits until the streams hold `n` more entries than now.
async fn wait_more(redis: &TestRedis, n: usize, what: &str) {
    let mut conn = redis.conn().await;
    let start = support::stream_entries(&mut conn, &redis.prefix).await;
    wait_until(60, what, || {
        let (prefix, mut c) = (redis.prefix.clone(), conn.clone());
        async move { support::stream_entries(&mut c, &prefix).await >= start + n }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_database_server_loses_nothing_and_the_node_resumes() {
    support::init_logs();
    let mut pg = OwnPostgres::start().await;
    let store = pg.migrated_database("outpost", 8).await;
    let redis = TestRedis::new();
    let node = pg.start_node("outpost", &redis, "pg-crash").await;
    let admin = node.admin_addr().to_string();
    let readyz = |want_ready: bool| {
        let admin = admin.clone();
        async move { (support::http_get(&admin, "/readyz").await.0 == 200) == want_ready }
    };
    wait_until(30, "/readyz to say ready", || readyz(true)).await;

    let stop = Arc::new(AtomicBool::new(false));
    let writing = writers(&store, stop.clone());
    wait_more(&redis, 200, "events published before the crash").await;

    for crash in 1..=2 {
        pg.kill();
        wait_until(
            30,
            "/readyz to say not ready while the server is down",
            || readyz(false),
        )
        .await;
        pg.restart().await;
        wait_until(60, "/readyz to say ready once the server is back", || {
            readyz(true)
        })
        .await;
        wait_more(
            &redis,
            200,
            &format!("events published after crash {crash}"),
        )
        .await;
    }

    stop.store(true, Ordering::Relaxed);
    let written = writing.await.unwrap();
    assert!(
        written.committed.len() >= 400,
        "the writers kept writing: {}",
        written.committed.len()
    );
    // Every row written is published at last: the committed ones and whichever of the unknown
    // ones did commit.
    wait_until(120, "the outbox to be empty", || async {
        scalar(&store, "SELECT count(*) FROM outpost_event").await == 0
    })
    .await;

    let d = Deliveries::collect(&mut redis.conn().await, &redis.prefix).await;
    let lost: Vec<&String> = written
        .committed
        .iter()
        .filter(|id| !d.copies.contains_key(*id))
        .collect();
    assert!(lost.is_empty(), "nothing committed is lost: {lost:?}");
    let unexpected: Vec<&String> = d
        .copies
        .keys()
        .filter(|id| !written.committed.contains(*id) && !written.unknown.contains(*id))
        .collect();
    assert!(
        unexpected.is_empty(),
        "nothing delivered that was not written: {unexpected:?}"
    );
    assert_eq!(
        scalar(&store, "SELECT count(*) FROM outpost_published").await,
        i64::try_from(d.unique()).unwrap(),
        "every published row is in the streams and nothing else is"
    );
    assert!(
        d.order_violations().is_empty(),
        "first deliveries are each aggregate's sequence 1, 2, 3, … in order: {:?}",
        d.order_violations()
    );
    assert_eq!(
        scalar(
            &store,
            "SELECT coalesce(max(attempts), 0)::int8 FROM outpost_published"
        )
        .await,
        0,
        "a database crash is transient: no attempt counted"
    );
    println!(
        "two database crashes: {} committed, {} with an unknown outcome ({} of them delivered), \
         duplicates {}",
        written.committed.len(),
        written.unknown.len(),
        written
            .unknown
            .iter()
            .filter(|id| d.copies.contains_key(*id))
            .count(),
        d.duplicates()
    );
    node.shutdown().await;
}
