//! Several nodes share the partitions: fair share, graceful handoff, no loss, no duplicates.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use outpost::app::NodeHandle;
use outpost::produce::EventFact;
use serde_json::json;
use support::{TestDb, TestRedis, relay_config, wait_until};

/// Writers committing batches of ten events over 300 aggregates until `stop`; returns the ids.
fn keep_writing(db: &TestDb, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<String>> {
    support::write_until(db, stop, |i| {
        (0..10)
            .map(|k| {
                EventFact::new(
                    "kind0",
                    format!("a{}", (i * 10 + k) % 300),
                    "t",
                    json!({"i": i}),
                )
            })
            .collect()
    })
}

/// Starts a node in this process and waits until it owns every partition.
async fn sole_node(db: &TestDb, redis: &TestRedis, id: &str) -> NodeHandle {
    let node = support::start_node(relay_config(db, redis, id)).await;
    wait_until(30, "the first node to own every partition", || async {
        owned(&node).await == 64
    })
    .await;
    node
}

async fn owned(node: &NodeHandle) -> usize {
    node.owned_partitions().await.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_share_partitions_fairly_and_hand_over_without_loss_or_duplicates() {
    let db = TestDb::with_pool(8).await;
    let redis = TestRedis::new();
    let a = sole_node(&db, &redis, "node-a").await;

    // Load runs throughout: writers commit events of 300 aggregates until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = keep_writing(&db, stop.clone());

    // Scale out: a second and a third node; each ends with its fair share (⌈64/3⌉ = 22, ±1).
    let b = support::start_node(relay_config(&db, &redis, "node-b")).await;
    wait_until(30, "a and b to split the partitions", || async {
        owned(&a).await == 32 && owned(&b).await == 32
    })
    .await;
    // The third node is an `outpost run` process, stopped below with SIGTERM.
    let args = support::relay_args(&db, &support::redis_url(), &redis.prefix, "node-c", &[]);
    let mut c = support::spawn_outpost(&args, &[]);
    wait_until(30, "a, b and c to share the partitions fairly", || async {
        let z = support::scalar(
            &db,
            "SELECT count(*) FROM outpost_partition WHERE owner = 'node-c'",
        )
        .await as usize;
        let (x, y) = (owned(&a).await, owned(&b).await);
        x + y + z == 64 && [x, y, z].iter().all(|n| (21..=22).contains(n))
    })
    .await;

    // Scale in gracefully: b shuts down, c gets SIGTERM; both hand their partitions over.
    b.shutdown().await;
    signal(&c, "-TERM");
    let status = support::wait_exit(&mut c, 30).await;
    assert!(
        status.success(),
        "SIGTERM ends the node cleanly: {status:?}"
    );
    wait_until(30, "a to own every partition again", || async {
        owned(&a).await == 64
    })
    .await;

    let (ids, d) = support::stop_and_check(&redis, &stop, writer).await;
    assert_eq!(d.unique(), ids.len(), "nothing else delivered");
    assert_eq!(d.duplicates(), 0, "graceful handoffs duplicate nothing");
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_node_is_taken_over_without_loss_or_order_violations() {
    let db = TestDb::with_pool(8).await;
    let redis = TestRedis::new();
    let a = support::start_node(relay_config(&db, &redis, "kill-a")).await;
    let b = support::start_node(relay_config(&db, &redis, "kill-b")).await;
    let args = support::relay_args(&db, &support::redis_url(), &redis.prefix, "kill-c", &[]);
    let mut c = support::spawn_outpost(&args, &[]);
    let owned_by_c = || {
        let db = &db;
        async move {
            support::scalar(
                db,
                "SELECT count(*) FROM outpost_partition WHERE owner = 'kill-c'",
            )
            .await
        }
    };
    wait_until(30, "the three nodes to share the partitions", || async {
        owned_by_c().await >= 21 && owned(&a).await >= 21 && owned(&b).await >= 21
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let writer = keep_writing(&db, stop.clone());
    let conn = redis.conn().await;
    wait_until(30, "publishing to be under way", || {
        let (prefix, mut c) = (redis.prefix.clone(), conn.clone());
        async move { support::stream_entries(&mut c, &prefix).await >= 500 }
    })
    .await;

    // kill -9 the third node in the middle of the run; the others take its partitions over once
    // its leases expire (2 s) plus a heartbeat.
    c.kill().unwrap();
    c.wait().unwrap();
    let killed = std::time::Instant::now();
    wait_until(30, "a and b to take over every partition", || async {
        owned(&a).await + owned(&b).await == 64
    })
    .await;
    println!(
        "takeover after kill -9: {:?} (lease 2 s, heartbeat 200 ms)",
        killed.elapsed()
    );

    // It comes back and gets its share again.
    let mut c = support::spawn_outpost(&args, &[]);
    wait_until(30, "the restarted node to get its share", || async {
        owned_by_c().await >= 21
    })
    .await;
    // One writer commits transactions of ten events one after another: about 450 events/s in a
    // debug build on two cores.
    wait_until(
        180,
        "at least 31,000 entries (30,000 events and room for copies) through the three nodes",
        || {
            let (prefix, mut c) = (redis.prefix.clone(), conn.clone());
            async move { support::stream_entries(&mut c, &prefix).await >= 31_000 }
        },
    )
    .await;
    let (ids, d) = support::stop_and_check(&redis, &stop, writer).await;
    assert!(ids.len() >= 30_000, "{} events written", ids.len());
    assert!(
        ids.iter().all(|id| d.copies.contains_key(id)),
        "nothing lost"
    );
    assert!(
        d.order_violations().is_empty(),
        "order per aggregate across the takeover"
    );
    println!(
        "{} events; duplicates from the crash: {}",
        ids.len(),
        d.duplicates()
    );
    let _ = c.kill();
    let _ = c.wait();
    a.shutdown().await;
    b.shutdown().await;
}

fn signal(child: &std::process::Child, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_stopped_past_its_lease_comes_back_without_loss_or_order_violations() {
    let db = TestDb::with_pool(8).await;
    let redis = TestRedis::new();
    let port = support::free_port();
    let admin = format!("127.0.0.1:{port}");
    let args = support::relay_args(
        &db,
        &support::redis_url(),
        &redis.prefix,
        "stop-a",
        &[("admin.listen", admin.as_str())],
    );
    let mut a = support::spawn_outpost(&args, &[]);
    let owned_by = |node: &'static str| {
        let db = &db;
        async move {
            support::scalar(
                db,
                &format!("SELECT count(*) FROM outpost_partition WHERE owner = '{node}'"),
            )
            .await
        }
    };
    wait_until(30, "node a to own every partition", || async {
        owned_by("stop-a").await == 64
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = keep_writing(&db, stop.clone());
    let conn = redis.conn().await;
    wait_until(30, "publishing to be under way", || {
        let (prefix, mut c) = (redis.prefix.clone(), conn.clone());
        async move { support::stream_entries(&mut c, &prefix).await >= 500 }
    })
    .await;

    // kill -STOP in the middle of the run, whatever a was doing; b takes over once a's leases
    // expire and publishes later events of the same aggregates.
    signal(&a, "-STOP");
    let b = support::start_node(relay_config(&db, &redis, "stop-b")).await;
    wait_until(30, "b to take over every partition", || async {
        owned(&b).await == 64
    })
    .await;
    wait_until(30, "b to publish", || {
        let (prefix, mut c) = (redis.prefix.clone(), conn.clone());
        async move { support::stream_entries(&mut c, &prefix).await >= 2000 }
    })
    .await;
    // a wakes up in the middle of whatever it was doing, finds its leases gone and takes its
    // fair share again through new leases.
    signal(&a, "-CONT");
    wait_until(30, "a to come back with new leases", || async {
        owned_by("stop-a").await >= 1 && owned(&b).await < 64
    })
    .await;
    let (_, d) = support::stop_and_check(&redis, &stop, writer).await;
    // Whether the stopped node had a publish or a mark in flight depends on where the signal
    // caught it (tests/cluster_zombie.rs freezes it at the worst moment on purpose); what it
    // refused is in its metrics.
    let (_, metrics) = support::http_get(&admin, "/metrics").await;
    let refused: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("outpost_fenced_total"))
        .collect();
    println!(
        "after SIGCONT: {refused:?}; duplicates {}, stale entries {}",
        d.duplicates(),
        d.stale
    );
    let _ = a.kill();
    let _ = a.wait();
    b.shutdown().await;
}

/// libfaketime, from Debian's `faketime` package (`scripts/test` installs it when missing).
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Starts a node as a process whose clocks run `shift` (e.g. `+10m`) off the real time.
fn spawn_skewed(db: &TestDb, redis: &TestRedis, id: &str, shift: &str) -> support::NodeProcess {
    assert!(
        std::path::Path::new(FAKETIME_LIB).exists(),
        "{FAKETIME_LIB} is missing: install Debian's faketime package (apt-get install faketime)"
    );
    // The shift must really apply to processes here: `date` under the same settings says so.
    let shifted = std::process::Command::new("date")
        .arg("+%s")
        .env("LD_PRELOAD", FAKETIME_LIB)
        .env("FAKETIME", shift)
        .output()
        .unwrap();
    let shifted: i64 = String::from_utf8_lossy(&shifted.stdout)
        .trim()
        .parse()
        .unwrap();
    let now = chrono::Utc::now().timestamp();
    assert!(
        (shifted - now).abs() >= 590,
        "faketime did not shift the clock ({shifted} vs {now})"
    );
    let args = support::relay_args(db, &support::redis_url(), &redis.prefix, id, &[]);
    support::spawn_outpost(&args, &[("LD_PRELOAD", FAKETIME_LIB), ("FAKETIME", shift)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_with_a_skewed_clock_neither_steals_leases_nor_keeps_them() {
    let db = TestDb::with_pool(8).await;
    let redis = TestRedis::new();
    let a = sole_node(&db, &redis, "skew-a").await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = keep_writing(&db, stop.clone());

    for (id, shift) in [("skew-ahead", "+10m"), ("skew-behind", "-10m")] {
        let owned_by = || {
            let db = &db;
            async move {
                support::scalar(
                    db,
                    &format!("SELECT count(*) FROM outpost_partition WHERE owner = '{id}'"),
                )
                .await
            }
        };
        let epochs_before =
            support::scalar(&db, "SELECT sum(epoch)::int8 FROM outpost_partition").await;
        let mut b = spawn_skewed(&db, &redis, id, shift);
        // It gets its fair share through a's handover, and never more: a node trusting its own
        // clock ten minutes ahead would see every lease of a as expired and take them all.
        let most = std::sync::atomic::AtomicI64::new(0);
        wait_until(30, "the skewed node to get its fair share", || {
            let (owned_by, most, a) = (&owned_by, &most, &a);
            async move {
                let n = owned_by().await;
                most.fetch_max(n, Ordering::Relaxed);
                n == 32 && owned(a).await == 32
            }
        })
        .await;
        assert_eq!(
            most.load(Ordering::Relaxed),
            32,
            "{id} ({shift}) never held more than its share"
        );
        let epochs_after =
            support::scalar(&db, "SELECT sum(epoch)::int8 FROM outpost_partition").await;
        assert_eq!(
            epochs_after - epochs_before,
            32,
            "exactly the 32 partitions handed over changed hands, once each"
        );
        // Killed, its leases expire by the database clock: a takes them back within the lease
        // (2 s) plus a heartbeat, not ten minutes later.
        b.kill().unwrap();
        b.wait().unwrap();
        let killed = std::time::Instant::now();
        wait_until(30, "a to take the dead node's partitions back", || async {
            owned(&a).await == 64
        })
        .await;
        println!(
            "{id} ({shift}): takeover after kill -9 in {:?}",
            killed.elapsed()
        );
    }

    support::stop_and_check(&redis, &stop, writer).await;
    a.shutdown().await;
}
