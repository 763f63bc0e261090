//! Publishing to a Redis Cluster of three local masters: streams in many slots with no CROSSSLOT
//! error; a busy stream's slot moved (`redis-cli --cluster reshard`) under load, and its master
//! killed and replaced by its replica under load, without loss or order violation, while two
//! consumer-helper members apply that stream exactly once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use outpost::app::NodeHandle;
use outpost::consume::Topology;
use outpost::produce::EventFact;
use redis::cluster_async::ClusterConnection;
use serde_json::json;
use support::consumer;
use support::redis_cluster::RedisCluster;
use support::{Deliveries, TestDb, relay_config_with, scalar, wait_until};

fn prefix() -> String {
    format!("t:{}:", uuid::Uuid::new_v4().simple())
}

/// A relay node in this process publishing to the cluster, with `extra` settings.
async fn cluster_node(
    db: &TestDb,
    cluster: &RedisCluster,
    prefix: &str,
    extra: &[(&str, &str)],
) -> NodeHandle {
    let mut settings = vec![("redis.cluster", "true")];
    settings.extend_from_slice(extra);
    support::start_node(relay_config_with(
        db,
        &cluster.url(),
        prefix,
        "node-a",
        &settings,
    ))
    .await
}

/// Waits until every committed event is in the streams; checks none is missing, none is extra,
/// first deliveries are in order per aggregate, and no row needed a second attempt.
async fn check_delivered(db: &TestDb, cluster: &RedisCluster, prefix: &str, ids: &[String]) {
    check_delivered_with(db, cluster, prefix, ids, true).await;
}

/// [`check_delivered`]; `in_order` false skips the order of first deliveries in the streams
/// (after a failover to a replica that lagged, re-published events follow later ones there; the
/// consumer helper restores the order).
async fn check_delivered_with(
    db: &TestDb,
    cluster: &RedisCluster,
    prefix: &str,
    ids: &[String],
    in_order: bool,
) {
    let conn = cluster.conn().await;
    wait_until(120, "every committed event to be delivered", || {
        let (mut c, n) = (conn.clone(), ids.len());
        async move { Deliveries::collect(&mut c, prefix).await.unique() >= n }
    })
    .await;
    let d = Deliveries::collect(&mut conn.clone(), prefix).await;
    assert!(
        ids.iter().all(|id| d.copies.contains_key(id)),
        "nothing lost"
    );
    assert_eq!(d.unique(), ids.len(), "nothing else delivered");
    assert!(
        !in_order || d.order_violations().is_empty(),
        "first deliveries in order per aggregate: {:?}",
        d.order_violations()
    );
    wait_until(30, "every row to be marked published", || async {
        scalar(db, "SELECT count(*) FROM outpost_event").await == 0
    })
    .await;
    assert_eq!(
        scalar(
            db,
            "SELECT count(*) FROM outpost_published WHERE attempts > 0"
        )
        .await,
        0,
        "no event failed permanently (a CROSSSLOT or a redirect would count an attempt)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_in_many_slots_publish_with_no_crossslot_error() {
    let cluster = RedisCluster::start(3).await;
    let db = TestDb::with_pool(8).await;
    let prefix = prefix();
    let types: Vec<String> = (0..24).map(|i| format!("kind{i}")).collect();

    // Transactions mixing every type, so one batch spans many streams in many slots.
    let mut ids = Vec::new();
    for round in 0..60 {
        let facts: Vec<EventFact> = (0..40)
            .map(|k| {
                let t = &types[k % types.len()];
                EventFact::new(t, format!("a{}", k % 20), "t", json!({"round": round}))
            })
            .collect();
        ids.extend(support::commit_facts(&db.store, facts).await);
    }

    let node = cluster_node(&db, &cluster, &prefix, &[]).await;
    check_delivered(&db, &cluster, &prefix, &ids).await;

    // The streams really are spread: every master serves some of them.
    let mut owners = BTreeSet::new();
    for t in &types {
        let slot = cluster.slot_of(&format!("{prefix}events:{t}")).await;
        owners.insert(cluster.owner(slot).await.0);
    }
    assert_eq!(owners.len(), 3, "streams on every master");

    let (code, metrics) = support::http_get(&node.admin_addr().to_string(), "/metrics").await;
    assert_eq!(code, 200);
    assert!(
        !metrics.contains("CROSSSLOT"),
        "no CROSSSLOT error counted:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("failures"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    node.shutdown().await;
}

/// Load on a busy stream: writers committing transactions of ten events (eight for 100
/// aggregates `b…` of the busy type, two for aggregates `q…` of seven quieter types), and two
/// consumer-helper members of group `billing` applying the busy stream.
struct BusyLoad {
    /// The busy stream's key.
    busy: String,
    conn: ClusterConnection,
    stop: Arc<AtomicBool>,
    writer: tokio::task::JoinHandle<Vec<String>>,
    members: Vec<consumer::Running>,
}

impl BusyLoad {
    /// Starts the consumers and the writers, and waits until the busy stream holds `fill`
    /// entries.
    async fn start(db: &TestDb, cluster: &RedisCluster, prefix: &str, fill: u64) -> Self {
        let busy = format!("{prefix}events:busy");
        consumer::create_effects(db).await;
        let seeds: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let mut members = Vec::new();
        for name in ["c1", "c2"] {
            let mut s = consumer::settings_at(&cluster.url(), prefix, &busy, "billing", name);
            s.topology = Topology::Cluster {
                seeds: seeds.clone(),
            };
            members.push(consumer::Running::start(s, db, consumer::recorder(name)).await);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let writer = support::write_until(db, stop.clone(), |i| {
            (0..10u64)
                .map(|k| {
                    let n = i * 10 + k;
                    if k < 8 {
                        EventFact::new("busy", format!("b{}", n % 100), "t", json!({"n": n}))
                    } else {
                        let t = format!("quiet{}", n % 7);
                        EventFact::new(&t, format!("q{}", n % 30), "t", json!({"n": n}))
                    }
                })
                .collect()
        });
        let load = Self {
            busy,
            conn: cluster.conn().await,
            stop,
            writer,
            members,
        };
        load.wait_for(fill, "the busy stream to fill up").await;
        load
    }

    /// Entries ever appended to the busy stream (`XINFO STREAM` `entries-added`): unlike its
    /// length, it does not shrink when the relay trims what the consumers acknowledged.
    async fn len(&self) -> u64 {
        let info: redis::Value = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(&self.busy)
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        let pairs: Vec<(String, redis::Value)> = match info {
            redis::Value::Map(m) => m
                .into_iter()
                .map(|(k, v)| (redis::from_redis_value(k).unwrap(), v))
                .collect(),
            other => {
                let flat: Vec<redis::Value> = redis::from_redis_value(other).unwrap();
                flat.chunks(2)
                    .map(|kv| (redis::from_redis_value_ref(&kv[0]).unwrap(), kv[1].clone()))
                    .collect()
            }
        };
        let added = pairs
            .into_iter()
            .find(|(k, _)| k == "entries-added")
            .expect("XINFO STREAM reports entries-added (Redis 7)");
        redis::from_redis_value(added.1).unwrap()
    }

    /// Waits until `n` entries have been appended to the busy stream.
    async fn wait_for(&self, n: u64, what: &str) {
        wait_until(60, what, || async { self.len().await >= n }).await;
    }

    /// Stops the writers; checks the streams ([`check_delivered_with`]) and that the consumers
    /// applied every busy event once, in order per aggregate. Returns the committed ids and the
    /// deliveries.
    async fn finish(
        self,
        db: &TestDb,
        cluster: &RedisCluster,
        prefix: &str,
        in_order: bool,
    ) -> (Vec<String>, Deliveries) {
        self.stop.store(true, Ordering::Relaxed);
        let ids = self.writer.await.unwrap();
        check_delivered_with(db, cluster, prefix, &ids, in_order).await;

        let mut expected = consumer::outbox_expectation(db).await;
        expected.retain(|aggregate, _| aggregate.starts_with('b'));
        let want = expected.values().map(Vec::len).sum::<usize>() as i64;
        wait_until(120, "the consumers to apply every busy event", || async {
            consumer::applied(db).await >= want
        })
        .await;
        for m in self.members {
            m.stop().await;
        }
        let check = consumer::check(db, &expected).await;
        assert!(check.is_clean(), "{check:?}");
        let d = Deliveries::collect(&mut self.conn.clone(), prefix).await;
        (ids, d)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn moving_a_busy_streams_slot_under_load_loses_nothing_and_breaks_no_order() {
    let cluster = RedisCluster::start(3).await;
    let db = TestDb::with_pool(8).await;
    let prefix = prefix();
    let node = cluster_node(&db, &cluster, &prefix, &[]).await;
    let load = BusyLoad::start(&db, &cluster, &prefix, 3000).await;

    // Move every slot of the busy stream's master, the busy one among them, while writers,
    // relay and consumers keep going.
    let slot = cluster.slot_of(&load.busy).await;
    let (from_port, from, count) = cluster.owner(slot).await;
    let (_, to, _) = cluster
        .layout()
        .await
        .into_iter()
        .find(|(port, _, _)| *port != from_port)
        .unwrap();
    let before = load.len().await;
    let started = std::time::Instant::now();
    cluster.reshard(&from, &to, count).await;
    eprintln!(
        "moved {count} slots (the busy one: {slot}) in {:?}",
        started.elapsed()
    );
    assert_eq!(cluster.owner(slot).await.1, to, "the busy slot moved");
    let moved_at = load.len().await;
    assert!(
        moved_at > before,
        "the busy stream was written while its slot moved ({before} → {moved_at})"
    );
    load.wait_for(moved_at + 2000, "the busy stream to grow at its new master")
        .await;

    let (ids, d) = load.finish(&db, &cluster, &prefix, true).await;
    let (_, metrics) = support::http_get(&node.admin_addr().to_string(), "/metrics").await;
    eprintln!(
        "{} events, {} duplicates; {}",
        ids.len(),
        d.duplicates(),
        metrics
            .lines()
            .filter(|l| l.starts_with("outpost_publish_failures"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_master_fails_over_to_its_replica_and_nothing_is_lost() {
    let mut cluster = RedisCluster::start_with_replicas(3, 1).await;
    let db = TestDb::with_pool(8).await;
    let prefix = prefix();
    // Every other node as a seed, so the relay could start with the first one down.
    let seeds: Vec<String> = cluster.ports[1..]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let node = cluster_node(
        &db,
        &cluster,
        &prefix,
        &[("redis.cluster_seeds", &seeds.join(","))],
    )
    .await;
    let load = BusyLoad::start(&db, &cluster, &prefix, 2000).await;

    // kill -9 of the busy stream's master, under load; its replica takes over.
    let slot = cluster.slot_of(&load.busy).await;
    let (master, _, _) = cluster.owner(slot).await;
    let started = std::time::Instant::now();
    cluster.kill(master);
    wait_until(60, "a replica to take over the busy slot", || async {
        cluster
            .try_owner(slot)
            .await
            .is_some_and(|(port, _, _)| port != master)
    })
    .await;
    eprintln!("failed over in {:?}", started.elapsed());
    let at = load.len().await;
    load.wait_for(at + 2000, "the busy stream to grow at the promoted replica")
        .await;
    eprintln!("publishing resumed {:?} after the kill", started.elapsed());

    // A replica that lagged would make the relay re-publish (same ids, after later ones in the
    // stream): first deliveries are not checked for order, the consumers' order is.
    let (ids, d) = load.finish(&db, &cluster, &prefix, false).await;
    eprintln!(
        "{} events, {} duplicates, {} aggregates with re-published events after later ones",
        ids.len(),
        d.duplicates(),
        d.order_violations().len()
    );
    node.shutdown().await;
}

/// A master paused for writes longer than the node waits for a call (twice the response timeout
/// on a cluster, 2 s here): the calls it holds run when the pause ends, after their deadline in
/// that master's clock, and append nothing; the calls the other masters answered meanwhile in
/// the same round count as published (before, the round's time limit, and with fault points
/// compiled in the second half of a split round, threw their answers away and they were
/// appended again: 1–197 copies). Nothing is lost, first deliveries stay in order, and no event
/// is appended twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_master_runs_the_calls_it_held_as_late_and_costs_no_copy() {
    let cluster = RedisCluster::start(3).await;
    let db = TestDb::with_pool(8).await;
    let prefix = prefix();
    let node = cluster_node(&db, &cluster, &prefix, &[]).await;
    let types: Vec<String> = (0..12).map(|i| format!("kind{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = support::write_until(&db, stop.clone(), move |i| {
        (0..4)
            .map(|k| {
                let n = i * 4 + k;
                let t = &types[usize::try_from(n).unwrap() % types.len()];
                EventFact::new(t, format!("a{}", n % 30), "t", json!({"n": n}))
            })
            .collect()
    });
    let conn = cluster.conn().await;
    let delivered = |n: usize| {
        let (mut c, prefix) = (conn.clone(), prefix.clone());
        async move { Deliveries::collect(&mut c, &prefix).await.unique() >= n }
    };
    wait_until(30, "events published before the pause", || delivered(200)).await;

    let slot = cluster.slot_of(&format!("{prefix}events:kind0")).await;
    let (port, _, _) = cluster.owner(slot).await;
    let mut master = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .arg("WRITE")
        .query_async(&mut master)
        .await
        .unwrap();
    // The pause is the fault: it ends by itself after 3 s. Publishing resumes after it.
    let at = Deliveries::collect(&mut conn.clone(), &prefix)
        .await
        .unique();
    wait_until(60, "publishing to resume after the pause", || {
        delivered(at + 400)
    })
    .await;

    stop.store(true, Ordering::Relaxed);
    let ids = writer.await.unwrap();
    check_delivered(&db, &cluster, &prefix, &ids).await;
    let d = Deliveries::collect(&mut conn.clone(), &prefix).await;
    // Copies per side: on the paused master, and on the others.
    let (mut held, mut others) = (0, 0);
    for (stream, entries) in support::read_streams(&mut conn.clone(), &prefix).await {
        let paused = cluster.owner(cluster.slot_of(&stream).await).await.0 == port;
        let mut seen = std::collections::HashMap::new();
        for (id, f) in entries {
            let event = f.get("ce_id").cloned().unwrap_or_default();
            if let Some(first) = seen.insert(event.clone(), id.clone()) {
                eprintln!("{event} in {stream} at {first} and {id} (paused master: {paused})");
                *(if paused { &mut held } else { &mut others }) += 1;
            }
        }
    }
    let (_, metrics) = support::http_get(&node.admin_addr().to_string(), "/metrics").await;
    let failures = metrics
        .lines()
        .filter(|l| l.starts_with("outpost_publish_failures_total"))
        .collect::<Vec<_>>();
    eprintln!(
        "{} events, {} copies ({held} on the paused master, {others} on the others); {failures:?}",
        ids.len(),
        d.duplicates()
    );
    assert_eq!(held, 0, "no call held by the pause appended");
    assert_eq!(others, 0, "no answer of the other masters was thrown away");
    node.shutdown().await;
}
