//! Redis outages against a Redis server owned by the test (its own port and data directory), so
//! pausing or killing it disturbs no other test: nothing is lost, no attempt is burned, the node
//! resumes by itself, and `/readyz` says not-ready meanwhile.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::consumer;

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outpost::produce::{EventFact, Producer};
use outpost::publish::{
    ErrorClass, Publisher, RedisSettings, StreamBatch, StreamOutcome, Topology,
};
use sea_orm::TransactionTrait;
use serde_json::json;
use support::{Deliveries, TestDb, assert_all_published, relay_config_with, scalar, wait_until};

/// A redis-server child of the test: by default with append-only persistence (fsync on every
/// write), so a kill -9 and restart keeps what it acknowledged.
struct OwnRedis {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
    args: Vec<&'static str>,
}

impl OwnRedis {
    fn start() -> Self {
        Self::start_with(&["--appendonly", "yes", "--appendfsync", "always"])
    }

    /// Without any persistence: a restart comes back empty.
    fn start_ephemeral() -> Self {
        Self::start_with(&["--appendonly", "no"])
    }

    fn start_with(args: &[&'static str]) -> Self {
        let port = support::free_port();
        let dir = std::env::temp_dir().join(format!("outpost-redis-{port}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut r = Self {
            port,
            dir,
            child: None,
            args: args.to_vec(),
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                // `DEBUG SLEEP`, for the outage that blocks the whole server.
                "--enable-debug-command",
                "local",
            ])
            .args(&self.args)
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        self.child = Some(child);
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.url()).unwrap();
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(30)));
        let mut last = None;
        for _ in 0..100 {
            match client
                .get_multiplexed_async_connection_with_config(&config)
                .await
            {
                Ok(c) => return c,
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("own redis not reachable: {last:?}");
    }

    /// kill -9, and wait until the process is really gone.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits until /readyz says not ready.
async fn wait_not_ready(addr: std::net::SocketAddr) {
    wait_until(30, "/readyz to say not ready", || async move {
        readyz(addr).await == 503
    })
    .await;
}

/// GET /readyz on the node's admin endpoint: the HTTP status code.
async fn readyz(addr: std::net::SocketAddr) -> u16 {
    readyz_body(addr).await.0
}

/// GET /readyz: the HTTP status code and the body.
async fn readyz_body(addr: std::net::SocketAddr) -> (u16, String) {
    let (code, text) = support::http_get(&addr.to_string(), "/readyz").await;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (code, body)
}

/// Writers that keep committing events until stopped; returns the committed ids.
fn writers(db: &TestDb, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<HashSet<String>> {
    let store = db.store.clone();
    tokio::spawn(async move {
        let ids = Arc::new(Mutex::new(HashSet::new()));
        let mut tasks = Vec::new();
        for w in 0..4 {
            let (store, ids, stop) = (store.clone(), ids.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let fact = EventFact::new(
                        "kind0",
                        format!("a{}", (i * 4 + w) % 50),
                        "t",
                        json!({"i": i}),
                    );
                    let id = fact.id().to_string();
                    let txn = store.connection().begin().await.unwrap();
                    Producer::default()
                        .enqueue_facts(&txn, vec![fact])
                        .await
                        .unwrap();
                    txn.commit().await.unwrap();
                    ids.lock().unwrap().insert(id);
                    i += 1;
                    // Pace the writers: about 200 events/s in all.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        ids.lock().unwrap().clone()
    })
}

enum Outage {
    /// `CLIENT PAUSE 10000 ALL`: commands are held before they run.
    Pause,
    /// `DEBUG SLEEP 10`: the server's event loop stops, commands it already read wait unrun
    /// and answers it has not written yet wait too.
    Sleep,
    Kill,
}

async fn survive(outage: Outage) {
    support::init_logs();
    let db = TestDb::new().await;
    let mut own = OwnRedis::start();
    let mut conn = own.conn().await;
    let config = relay_config_with(&db, &own.url(), "o:", "outage-node", &[]);
    let node = tokio::task::spawn_blocking(move || outpost::app::start(&config))
        .await
        .unwrap()
        .unwrap();
    let admin = node.admin_addr();
    wait_until(30, "/readyz to say ready", || async move {
        readyz(admin).await == 200
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let writing = writers(&db, stop.clone());
    wait_until(30, "some events to be published", || {
        let mut c = conn.clone();
        async move { Deliveries::collect(&mut c, "o:").await.unique() >= 100 }
    })
    .await;

    // The outage lasts ten seconds of wall time: that is the fault, not a wait for a condition.
    match outage {
        Outage::Pause => {
            let _: () = redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(10_000)
                .arg("ALL")
                .query_async(&mut conn)
                .await
                .unwrap();
            wait_not_ready(admin).await;
            tokio::time::sleep(Duration::from_secs(9)).await;
        }
        Outage::Sleep => {
            let mut sleeper = own.conn().await;
            let asleep = tokio::spawn(async move {
                let _: () = redis::cmd("DEBUG")
                    .arg("SLEEP")
                    .arg(10)
                    .query_async(&mut sleeper)
                    .await
                    .unwrap();
            });
            wait_not_ready(admin).await;
            // The server answers `DEBUG SLEEP` when it wakes up.
            asleep.await.unwrap();
        }
        Outage::Kill => {
            own.kill();
            wait_not_ready(admin).await;
            tokio::time::sleep(Duration::from_secs(10)).await;
            own.spawn();
            conn = own.conn().await;
        }
    }
    wait_until(60, "/readyz to say ready again", || async move {
        readyz(admin).await == 200
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let committed = writing.await.unwrap();

    wait_until(120, "every committed event to be delivered", || {
        let (mut c, n) = (conn.clone(), committed.len());
        async move { Deliveries::collect(&mut c, "o:").await.unique() >= n }
    })
    .await;
    let d = Deliveries::collect(&mut conn, "o:").await;
    let seen: HashSet<String> = d.copies.keys().cloned().collect();
    assert!(committed.is_subset(&seen), "nothing lost");
    assert!(d.order_violations().is_empty());
    println!("duplicates {}, stale entries {}", d.duplicates(), d.stale);
    if let Outage::Pause = outage {
        // A paused Redis answers the calls it ran before the pause; the ones it holds run ten
        // seconds later, long after the node gave up on them, and are refused as late.
        assert_eq!(d.duplicates(), 0, "no call held by the pause appended");
    }
    if let Outage::Sleep = outage {
        // The calls a sleeping server had read run when it wakes, ten seconds late, and are
        // refused; only those that ran just before the sleep and whose answers were held can
        // have appended entries the node then sent again: at most the batches under way (2
        // workers × 4 in flight × 100 rows).
        assert!(
            d.duplicates() <= 2 * 4 * 100,
            "at most the batches under way when the server fell asleep"
        );
    }
    assert_eq!(
        scalar(
            &db,
            "SELECT coalesce(max(attempts), 0)::int8 FROM ( \
               SELECT attempts FROM outpost_event \
               UNION ALL SELECT attempts FROM outpost_published) t"
        )
        .await,
        0,
        "no attempt burned"
    );
    assert_all_published(&db).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_paused_for_ten_seconds_loses_nothing_and_burns_no_attempt() {
    survive(Outage::Pause).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_asleep_for_ten_seconds_loses_nothing_and_burns_no_attempt() {
    survive(Outage::Sleep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_killed_and_restarted_loses_nothing_and_burns_no_attempt() {
    survive(Outage::Kill).await;
}

/// Calls of the publish script Redis has run (`INFO commandstats`; the test's own Redis).
async fn script_calls(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// A publisher of the test's own with a 500 ms response timeout.
async fn publisher(own: &OwnRedis) -> Publisher {
    Publisher::connect(&RedisSettings {
        url: own.url(),
        key_prefix: "late:".to_owned(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_millis(500),
        topology: Topology::Single,
    })
    .await
    .unwrap()
}

/// A batch of one event, the `seq`th of one aggregate, for `stream`.
fn one_event(stream: &str, seq: i64) -> StreamBatch {
    StreamBatch {
        stream: stream.to_owned(),
        partition: 0,
        epoch: 1,
        known: seq > 1,
        expect: None,
        entries: vec![support::plain_entry(seq)],
    }
}

fn published(out: &[StreamOutcome]) -> bool {
    matches!(out, [StreamOutcome::Published(_)])
}

/// A publish call that reaches Redis only after its node gave up on it appends nothing: here
/// Redis holds it (paused for writes) past the node's response timeout, then runs it. Without the
/// deadline every call would land whenever it got through — after the node had moved on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_run_after_its_node_gave_up_appends_nothing() {
    let own = OwnRedis::start_ephemeral();
    let mut conn = own.conn().await;
    let publisher = publisher(&own).await;
    let stream = publisher.stream_key("s");
    let batch = |seq| one_event(&stream, seq);
    let xlen = |mut c: redis::aio::MultiplexedConnection| {
        let stream = stream.clone();
        async move {
            redis::cmd("XLEN")
                .arg(&stream)
                .query_async::<u64>(&mut c)
                .await
                .unwrap()
        }
    };
    assert!(published(&publisher.publish(&[batch(1)]).await.unwrap()));
    let ran = script_calls(&mut conn).await;

    // Scripts wait while Redis is paused for writes; TIME is still answered.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("WRITE")
        .query_async(&mut conn)
        .await
        .unwrap();
    let gave_up = publisher.publish(&[batch(2)]).await.unwrap_err();
    assert_eq!(gave_up.class(), ErrorClass::Transient, "{gave_up}");
    wait_until(10, "Redis to run the call the node gave up on", || {
        let mut c = conn.clone();
        async move { script_calls(&mut c).await > ran }
    })
    .await;
    assert_eq!(
        xlen(conn.clone()).await,
        1,
        "the late call appended nothing"
    );

    // The node sends it again, and it is appended once.
    assert!(published(&publisher.publish(&[batch(2)]).await.unwrap()));
    assert_eq!(xlen(conn.clone()).await, 2);
}

/// Redis restarted empty mid-run (no persistence, killed and restarted): the node notices, sets
/// the retained window back to pending and publishes it again. Every committed event ends up in
/// the new Redis with its event id, each aggregate's events in sequence order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restarted_empty_is_noticed_and_the_window_republished() {
    support::init_logs();
    let db = TestDb::new().await;
    let mut own = OwnRedis::start_ephemeral();
    let mut conn = own.conn().await;
    let config = relay_config_with(&db, &own.url(), "o:", "loss-node", &[]);
    let node = support::start_node(config).await;
    // A consumer applies every event through the helper, before, across and after the loss.
    consumer::create_effects(&db).await;
    let applier = consumer::Running::start(
        consumer::settings_at(&own.url(), "o:", "o:events:kind0", "audit", "c1"),
        &db,
        consumer::recorder("c1"),
    )
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let writing = writers(&db, stop.clone());
    wait_until(
        30,
        "some events to be published and their positions recorded",
        || {
            let mut c = conn.clone();
            let db = &db;
            async move {
                Deliveries::collect(&mut c, "o:").await.unique() >= 100
                    && scalar(
                        db,
                        "SELECT count(*) FROM outpost_stream_position WHERE last_ms > 0",
                    )
                    .await
                        > 0
            }
        },
    )
    .await;

    own.kill();
    own.spawn();
    conn = own.conn().await;
    // The loss is noted first (a new incarnation), then each partition is recovered on its own.
    wait_until(60, "the loss to be noticed and recovered", || async {
        scalar(&db, "SELECT incarnation FROM outpost_redis").await >= 1
            && scalar(&db, "SELECT republished FROM outpost_redis").await >= 100
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let committed = writing.await.unwrap();

    wait_until(120, "every committed event to be in the new Redis", || {
        let (mut c, n) = (conn.clone(), committed.len());
        async move { Deliveries::collect(&mut c, "o:").await.unique() >= n }
    })
    .await;
    let d = Deliveries::collect(&mut conn, "o:").await;
    let seen: HashSet<String> = d.copies.keys().cloned().collect();
    assert_eq!(
        seen, committed,
        "every committed event, with its event id, nothing else"
    );
    assert!(
        d.order_violations().is_empty(),
        "each aggregate's events in sequence order: {:?}",
        d.order_violations()
    );
    assert_all_published(&db).await;

    // The consumer ends with every committed event applied once, in order: none lost.
    wait_until(
        60,
        "the consumer to apply every committed event",
        || async { consumer::applied(&db).await >= committed.len() as i64 },
    )
    .await;
    let stats = applier.stop().await;
    let result = consumer::check(&db, &consumer::outbox_expectation(&db).await).await;
    assert!(result.is_clean(), "consumer after the loss: {result:?}");
    assert_eq!(result.applied, committed.len());
    println!("consumer across the loss: {stats:?}");
    node.shutdown().await;
}

/// Redis restarted from an RDB snapshot taken a few seconds before (kill -9, then the snapshot
/// loaded at start): the fences came back with the streams, so nothing is missing, but the
/// entries appended after the snapshot are gone. The first append after the restart is refused
/// (the partition's newest entry at Redis is older than the node knows it appended), the check
/// finds the partitions behind their recorded positions, and exactly their events published
/// after the snapshot go back to pending and are published again. Every event in the history is
/// in its stream afterwards, each aggregate's events in order, and the loss is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restored_from_an_older_snapshot_is_noticed_and_what_it_lost_republished() {
    support::init_logs();
    let db = TestDb::new().await;
    let mut own = OwnRedis::start_with(&["--appendonly", "no", "--dbfilename", "snap.rdb"]);
    let mut conn = own.conn().await;
    let config = relay_config_with(&db, &own.url(), "o:", "snapshot-node", &[]);
    let node = support::start_node(config).await;

    let stop = Arc::new(AtomicBool::new(false));
    let writing = writers(&db, stop.clone());
    wait_until(30, "some events to be published and marked", || {
        let mut c = conn.clone();
        let db = &db;
        async move {
            Deliveries::collect(&mut c, "o:").await.unique() >= 100
                && scalar(db, "SELECT count(*) FROM outpost_stream_position").await > 0
        }
    })
    .await;
    let _: () = redis::cmd("SAVE").query_async(&mut conn).await.unwrap();
    let at_snapshot = Deliveries::collect(&mut conn, "o:").await.unique();
    // Writing goes on: these entries exist only in the Redis that is about to die.
    wait_until(30, "events published after the snapshot", || {
        let mut c = conn.clone();
        async move { Deliveries::collect(&mut c, "o:").await.unique() >= at_snapshot + 300 }
    })
    .await;
    let before_kill = Deliveries::collect(&mut conn, "o:").await.unique();
    own.kill();
    own.spawn();
    conn = own.conn().await;
    let restored = Deliveries::collect(&mut conn, "o:").await.unique();
    assert!(
        restored < before_kill,
        "the restart lost the entries after the snapshot ({restored} of {before_kill} left)"
    );

    wait_until(60, "the loss to be noticed and recovered", || async {
        scalar(&db, "SELECT republished FROM outpost_redis").await > 0
    })
    .await;
    assert!(
        scalar(&db, "SELECT incarnation FROM outpost_redis").await >= 1,
        "the loss is recorded"
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_redis WHERE lost_at IS NOT NULL"
        )
        .await,
        1,
        "the loss is reported with its time"
    );
    stop.store(true, Ordering::Relaxed);
    let committed = writing.await.unwrap();
    wait_until(120, "every committed event to be in Redis again", || {
        let (mut c, n) = (conn.clone(), committed.len());
        async move { Deliveries::collect(&mut c, "o:").await.unique() >= n }
    })
    .await;
    assert_all_published(&db).await;
    let d = Deliveries::collect(&mut conn, "o:").await;
    let seen: HashSet<String> = d.copies.keys().cloned().collect();
    assert_eq!(
        seen, committed,
        "every committed event is in its stream, nothing else"
    );
    let missing = scalar(
        &db,
        "SELECT count(*) FROM outpost_published WHERE stream_id !~ '^[0-9]+-[0-9]+$'",
    )
    .await;
    assert_eq!(missing, 0, "every history row names its entry");
    assert!(
        d.order_violations().is_empty(),
        "each aggregate's events first appear in sequence order: {:?}",
        d.order_violations()
    );
    // Every history row's entry is in Redis under the id the history names.
    let rows = history_entries(&db).await;
    let mut absent = 0;
    for (stream_id, event_id) in &rows {
        let found: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg("o:events:kind0")
            .arg(stream_id)
            .arg(stream_id)
            .query_async(&mut conn)
            .await
            .unwrap();
        let carries = found
            .first()
            .is_some_and(|(_, fields)| fields.iter().any(|(k, v)| k == "ce_id" && v == event_id));
        if !carries {
            absent += 1;
        }
    }
    assert_eq!(
        absent,
        0,
        "of {} history rows, {absent} not in their stream",
        rows.len()
    );
    println!(
        "committed {}, at snapshot {at_snapshot}, before the kill {before_kill}, after the \
         restart {restored}, re-published {}, duplicates {}",
        committed.len(),
        scalar(&db, "SELECT republished FROM outpost_redis").await,
        d.duplicates()
    );
    node.shutdown().await;
}

/// `(stream entry id, event id)` of every row of the history.
async fn history_entries(db: &TestDb) -> Vec<(String, String)> {
    use sea_orm::ConnectionTrait;
    db.store
        .connection()
        .query_all_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT stream_id, event_id::text FROM outpost_published ORDER BY id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                r.try_get_by_index(0).unwrap(),
                r.try_get_by_index(1).unwrap(),
            )
        })
        .collect()
}

/// A Redis that may evict keys is refused by default, and only warned about (and reported by
/// `/readyz`) when `redis.maxmemory_policy_check = "warn"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_that_may_evict_is_refused_or_reported() {
    support::init_logs();
    let db = TestDb::new().await;
    let own = OwnRedis::start_with(&["--appendonly", "no", "--maxmemory-policy", "allkeys-lru"]);
    let _ = own.conn().await;
    let config = relay_config_with(&db, &own.url(), "o:", "evict-node", &[]);
    let refused = tokio::task::spawn_blocking(move || outpost::app::start(&config))
        .await
        .unwrap();
    let err = refused.expect_err("a Redis that may evict is refused");
    assert!(err.to_string().contains("maxmemory-policy"), "{err}");

    let config = relay_config_with(
        &db,
        &own.url(),
        "o:",
        "evict-node",
        &[("redis.maxmemory_policy_check", "warn")],
    );
    let node = support::start_node(config).await;
    let admin = node.admin_addr();
    wait_until(30, "/readyz to say ready", || async move {
        readyz(admin).await == 200
    })
    .await;
    let (_, body) = readyz_body(admin).await;
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["redis_server"]["maxmemory_policy"], "allkeys-lru");
    assert_eq!(body["redis_server"]["may_evict"], true);
    assert_eq!(body["redis_server"]["appendonly"], false);
    node.shutdown().await;
}

/// A Redis that refuses `TIME` (here: the command is disabled; a proxy that does not pass it on
/// answers the same) still gets every event: its calls go without a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_refuses_time_still_gets_every_event() {
    let own = OwnRedis::start_with(&["--appendonly", "no", "--rename-command", "TIME", ""]);
    let mut conn = own.conn().await;
    let refused: redis::RedisResult<Vec<String>> = redis::cmd("TIME").query_async(&mut conn).await;
    assert!(refused.is_err(), "TIME is disabled");
    let publisher = publisher(&own).await;
    let stream = publisher.stream_key("s");
    for seq in 1..=3 {
        let out = publisher.publish(&[one_event(&stream, seq)]).await.unwrap();
        assert!(published(&out), "{out:?}");
    }
    let n: u64 = redis::cmd("XLEN")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 3);
}
