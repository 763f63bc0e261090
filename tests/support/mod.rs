//! Shared test harness: each test gets its own migrated PostgreSQL database (a copy of a template
//! migrated once per schema version) and its own Redis key prefix, so tests run in parallel, in
//! one process (`cargo test`) or one process each (`cargo nextest`).
//!
//! Servers: `TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`) and
//! `TEST_REDIS_URL` (default `redis://127.0.0.1:6379`).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use outpost::store::{self, ConnectSettings, Store, admin};

pub mod consumer;
pub mod http;
pub mod pg_server;
pub mod proxy;
pub mod redis_cluster;

/// Server URL of the test PostgreSQL.
pub fn server_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// URL of the test Redis.
pub fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Name of the template database for the current migrations: a hash of the migration sources,
/// so changing a migration builds a fresh template.
fn template_name() -> String {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migration/src");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("migration sources")
        .map(|e| e.expect("dir entry").path())
        .collect();
    files.sort();
    let mut h = DefaultHasher::new();
    for f in files {
        std::fs::read(&f).expect("read migration").hash(&mut h);
    }
    format!("outpost_tpl_{:016x}", h.finish())
}

const TEMPLATE_LOCK: i64 = 0x6f75_7470_7465_6d70;

async fn ensure_template() -> String {
    let server = server_url();
    let name = template_name();
    let building = format!("{name}_build");
    admin::with_server_lock(&server, TEMPLATE_LOCK, || async {
        if !admin::create_database(&server, &building, None).await? {
            // A build that crashed half-way left this behind: start over.
            admin::drop_database(&server, &building).await?;
            admin::create_database(&server, &building, None).await?;
        }
        if admin::database_exists(&server, &name).await? {
            admin::drop_database(&server, &building).await?;
            return Ok(());
        }
        let store = connect_to(&admin::database_url(&server, &building)?, 2).await?;
        store::migrate_up(&store).await?;
        store.connection().clone().close().await.ok();
        admin::rename_database(&server, &building, &name).await
    })
    .await
    .expect("template database");
    name
}

async fn connect_to(url: &str, pool: u32) -> Result<Store, store::StoreError> {
    Store::connect(&ConnectSettings::new(url, "outpost test", pool)).await
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A migrated database of the test's own, dropped when the value is dropped.
#[derive(Debug)]
pub struct TestDb {
    /// Database name.
    pub name: String,
    /// Its URL.
    pub url: String,
    /// A pool on it.
    pub store: Store,
}

impl TestDb {
    /// Creates a fresh migrated database with a pool of 20 connections.
    pub async fn new() -> Self {
        Self::with_pool(20).await
    }

    /// Creates a fresh migrated database with a pool of `pool` connections.
    pub async fn with_pool(pool: u32) -> Self {
        let template = ensure_template().await;
        let server = server_url();
        let name = format!(
            "outpost_t_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
        );
        let mut tries = 0;
        loop {
            match admin::create_database(&server, &name, Some(&template)).await {
                Ok(_) => break,
                // Another process is copying the template at this instant: try again shortly.
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("creating test database: {e}"),
            }
        }
        let url = admin::database_url(&server, &name).expect("url");
        let store = connect_to(&url, pool).await.expect("connect test database");
        Self { name, url, store }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (server, name) = (server_url(), self.name.clone());
        // Drop runs outside async; a short-lived runtime on a plain thread does the work.
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                let _ = rt.block_on(admin::drop_database(&server, &name));
            }
        })
        .join();
    }
}

/// A Redis key prefix of the test's own; its keys are deleted on drop.
#[derive(Debug)]
pub struct TestRedis {
    /// The prefix, e.g. `t:3f2a...:`.
    pub prefix: String,
    /// Client on the test Redis.
    pub client: redis::Client,
}

impl TestRedis {
    /// A fresh prefix.
    pub fn new() -> Self {
        let client = redis::Client::open(redis_url()).expect("redis url");
        Self {
            prefix: format!("t:{}:", uuid::Uuid::new_v4().simple()),
            client,
        }
    }

    /// A multiplexed connection with a generous response timeout (the default 500 ms is too
    /// short for large reads on a busy test machine).
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(30)));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .expect("redis connection")
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        let pattern = format!("{}*", self.prefix);
        if let Ok(mut c) = self.client.get_connection() {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query(&mut c)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: Result<(), _> = redis::cmd("DEL").arg(keys).query(&mut c);
            }
        }
    }
}

/// A loopback port free at the moment of asking (for a server the test starts).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a loopback port")
        .local_addr()
        .expect("its address")
        .port()
}

/// Waits until `check` returns true, polling every 20 ms, failing after `secs` seconds (a
/// deadlock guard, not a timing assertion).
pub async fn wait_until<F, Fut>(secs: u64, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if check().await {
            return;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {secs} s waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A relay configuration for `db` and `redis` with short timings suited to tests: heartbeat
/// 200 ms, lease 2 s, batches of 100, max 3 attempts with 20 ms backoff, admin on a free port.
pub fn relay_config(db: &TestDb, redis: &TestRedis, node_id: &str) -> outpost::config::Config {
    relay_config_for(db, redis, node_id, &[])
}

/// [`relay_config`] with extra `key=value` overrides.
pub fn relay_config_for(
    db: &TestDb,
    redis: &TestRedis,
    node_id: &str,
    extra: &[(&str, &str)],
) -> outpost::config::Config {
    relay_config_with(db, &redis_url(), &redis.prefix, node_id, extra)
}

/// The test relay settings as `(key, value)` overrides, `extra` last (so it wins).
fn relay_overrides(
    database_url: &str,
    redis_url: &str,
    prefix: &str,
    node_id: &str,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    [
        ("database.url", database_url),
        ("database.pool_size", "8"),
        ("redis.url", redis_url),
        ("redis.key_prefix", prefix),
        ("redis.response_timeout_ms", "1000"),
        ("redis.connect_timeout_ms", "1000"),
        ("node.id", node_id),
        ("node.heartbeat_ms", "200"),
        ("node.lease_ms", "2000"),
        ("admin.listen", "127.0.0.1:0"),
        ("relay.batch_rows", "100"),
        ("relay.workers", "2"),
        ("relay.max_attempts", "3"),
        ("relay.backoff_base_ms", "20"),
        ("relay.backoff_max_ms", "100"),
        ("relay.transient_backoff_max_ms", "500"),
        ("relay.shutdown_timeout_ms", "5000"),
        // Tests read every stream whole at the end to count what was delivered; a trimming
        // round (every minute) in a long test would remove what consumers acknowledged. The
        // trimming tests switch it back on.
        ("retention.trim_streams", "false"),
    ]
    .iter()
    .chain(extra.iter())
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect()
}

/// Like [`relay_config`] with a Redis URL of choice and extra `key=value` overrides.
pub fn relay_config_with(
    db: &TestDb,
    redis_url: &str,
    prefix: &str,
    node_id: &str,
    extra: &[(&str, &str)],
) -> outpost::config::Config {
    relay_config_at(&db.url, redis_url, prefix, node_id, extra)
}

/// Like [`relay_config_with`] with a database URL of choice (a server of the test's own).
pub fn relay_config_at(
    database_url: &str,
    redis_url: &str,
    prefix: &str,
    node_id: &str,
    extra: &[(&str, &str)],
) -> outpost::config::Config {
    let overrides = relay_overrides(database_url, redis_url, prefix, node_id, extra);
    outpost::config::load(&outpost::config::LoadOptions {
        file: None,
        overrides,
        env: false,
        env_vars: None,
    })
    .expect("test relay configuration")
}

/// Every entry of a stream: (entry id, fields), read in pages.
pub async fn read_stream(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    key: &str,
) -> Vec<(String, std::collections::HashMap<String, String>)> {
    let mut out = Vec::new();
    let mut start = "-".to_owned();
    loop {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(key)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .expect("XRANGE");
        let n = reply.ids.len();
        for e in reply.ids {
            let fields = e
                .map
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        redis::from_redis_value_ref::<String>(v).unwrap_or_default(),
                    )
                })
                .collect();
            start = format!("({}", e.id);
            out.push((e.id, fields));
        }
        if n < 1000 {
            return out;
        }
    }
}

/// Entries in every stream under `prefix` (copies included): a cheap measure of progress to
/// wait on, where reading the streams whole would, every few milliseconds, take the CPU the
/// nodes in the test's process need (a debug build parses a large stream slowly).
pub async fn stream_entries(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
) -> usize {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}events:*"))
        .query_async(conn)
        .await
        .expect("KEYS");
    let mut n = 0;
    for k in keys {
        // A key of another type (a poison test's) counts nothing.
        let len: redis::RedisResult<usize> = redis::cmd("XLEN").arg(&k).query_async(conn).await;
        n += len.unwrap_or(0);
    }
    n
}

/// Entries of every stream under `prefix` matching `events:*`, keyed by stream.
pub async fn read_streams(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
) -> std::collections::BTreeMap<String, Vec<(String, std::collections::HashMap<String, String>)>> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}events:*"))
        .query_async(conn)
        .await
        .expect("KEYS");
    let mut out = std::collections::BTreeMap::new();
    for k in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&k)
            .query_async(conn)
            .await
            .expect("TYPE");
        if kind != "stream" {
            continue;
        }
        let entries = read_stream(conn, &k).await;
        out.insert(k, entries);
    }
    out
}

/// Delivery facts from the streams: per event id how often it appears, and per aggregate the
/// sequence numbers in stream order (first deliveries only).
#[derive(Debug, Default)]
pub struct Deliveries {
    /// event id → number of entries carrying it.
    pub copies: std::collections::HashMap<String, usize>,
    /// (aggregate type, aggregate id) → sequences in order of first delivery.
    pub order: std::collections::HashMap<(String, String), Vec<i64>>,
    /// Entries that came after a later event of their aggregate in the same stream: stale
    /// entries a consumer applying every delivery in stream order would go back in time with.
    pub stale: usize,
}

impl Deliveries {
    /// Collects deliveries from every stream under `prefix`.
    pub async fn collect(
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        prefix: &str,
    ) -> Self {
        let mut d = Deliveries::default();
        for (_, entries) in read_streams(conn, prefix).await {
            let mut highest: std::collections::HashMap<(String, String), i64> =
                std::collections::HashMap::new();
            for (_, f) in entries {
                let aggregate = (
                    f.get("ce_aggregatetype").cloned().unwrap_or_default(),
                    f.get("ce_subject").cloned().unwrap_or_default(),
                );
                let seq: i64 = f
                    .get("ce_aggregateseq")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(-1);
                let top = highest.entry(aggregate).or_insert(seq);
                if seq < *top {
                    d.stale += 1;
                }
                *top = (*top).max(seq);
                let id = f.get("ce_id").cloned().unwrap_or_default();
                let n = d.copies.entry(id).or_insert(0);
                *n += 1;
                if *n == 1 {
                    let key = (
                        f.get("ce_aggregatetype").cloned().unwrap_or_default(),
                        f.get("ce_subject").cloned().unwrap_or_default(),
                    );
                    let seq = f
                        .get("ce_aggregateseq")
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(-1);
                    d.order.entry(key).or_default().push(seq);
                }
            }
        }
        d
    }

    /// Distinct events delivered.
    pub fn unique(&self) -> usize {
        self.copies.len()
    }

    /// Entries beyond the first of each event.
    pub fn duplicates(&self) -> usize {
        self.copies.values().map(|n| n - 1).sum()
    }

    /// Aggregates whose first deliveries are not 1, 2, 3, … in order.
    pub fn order_violations(&self) -> Vec<(String, String)> {
        self.order
            .iter()
            .filter(|(_, seqs)| seqs.iter().enumerate().any(|(i, s)| *s != i as i64 + 1))
            .map(|(k, _)| k.clone())
            .collect()
    }
}

/// Sends the crate's logs to the test's captured output (shown when a test fails).
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("outpost=info")),
        )
        .with_test_writer()
        .try_init();
}

/// `key=value` overrides of [`relay_config_with`], as `--set` arguments for the `outpost` binary.
pub fn relay_args(
    db: &TestDb,
    redis_url: &str,
    prefix: &str,
    node_id: &str,
    extra: &[(&str, &str)],
) -> Vec<String> {
    relay_overrides(&db.url, redis_url, prefix, node_id, extra)
        .into_iter()
        .flat_map(|(k, v)| ["--set".to_owned(), format!("{k}={v}")])
        .collect()
}

/// Starts `outpost run` as a child process with the test's settings and `env` added.
pub fn spawn_outpost(args: &[String], env: &[(&str, &str)]) -> NodeProcess {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_outpost"));
    cmd.args(args)
        .arg("run")
        .current_dir(std::env::temp_dir())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTPOST_") || k == "FAILPOINTS" {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    NodeProcess(cmd.spawn().expect("spawn outpost"))
}

/// An `outpost run` process started by a test. Killed when dropped, so a failing test leaves no
/// node behind (not even one it stopped with SIGSTOP).
#[derive(Debug)]
pub struct NodeProcess(pub std::process::Child);

impl std::ops::Deref for NodeProcess {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for NodeProcess {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for a child to exit (a deadlock guard of `secs` seconds) and returns its status.
pub async fn wait_exit(child: &mut std::process::Child, secs: u64) -> std::process::ExitStatus {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if tokio::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("child did not exit within {secs} s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Commits `facts` in one transaction through the producer API; returns their ids.
pub async fn commit_facts(store: &Store, facts: Vec<outpost::produce::EventFact>) -> Vec<String> {
    use sea_orm::TransactionTrait;
    let ids = facts.iter().map(|f| f.id().to_string()).collect();
    let txn = store.connection().begin().await.expect("begin");
    outpost::produce::Producer::default()
        .enqueue_facts(&txn, facts)
        .await
        .expect("enqueue");
    txn.commit().await.expect("commit");
    ids
}

/// A writer committing `facts(i)` for i = 0, 1, 2, … one transaction each, until `stop`;
/// returns the ids it committed.
pub fn write_until<F>(
    db: &TestDb,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    facts: F,
) -> tokio::task::JoinHandle<Vec<String>>
where
    F: Fn(u64) -> Vec<outpost::produce::EventFact> + Send + 'static,
{
    let store = db.store.clone();
    tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            ids.extend(commit_facts(&store, facts(i)).await);
            i += 1;
        }
        ids
    })
}

/// Stops the writers, waits until every event they committed is in the streams, and checks that
/// none is missing and that first deliveries are in order per aggregate. Returns the committed
/// ids and what was delivered.
pub async fn stop_and_check(
    redis: &TestRedis,
    stop: &std::sync::atomic::AtomicBool,
    writer: tokio::task::JoinHandle<Vec<String>>,
) -> (Vec<String>, Deliveries) {
    stop.store(true, Ordering::Relaxed);
    let ids = writer.await.unwrap();
    let conn = redis.conn().await;
    wait_until(120, "every committed event to be delivered", || {
        let (prefix, mut c, n) = (redis.prefix.clone(), conn.clone(), ids.len());
        async move { Deliveries::collect(&mut c, &prefix).await.unique() >= n }
    })
    .await;
    let d = Deliveries::collect(&mut conn.clone(), &redis.prefix).await;
    assert!(
        ids.iter().all(|id| d.copies.contains_key(id)),
        "nothing lost"
    );
    assert!(
        d.order_violations().is_empty(),
        "first deliveries in order per aggregate"
    );
    (ids, d)
}

/// The single `int8` value `sql` returns.
pub async fn scalar(db: &TestDb, sql: &str) -> i64 {
    scalar_on(&db.store, sql).await
}

/// [`scalar`] on any store (a database of a server the test owns).
pub async fn scalar_on(store: &Store, sql: &str) -> i64 {
    use sea_orm::ConnectionTrait;
    store
        .connection()
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            sql,
        ))
        .await
        .expect("query")
        .expect("a row")
        .try_get_by_index::<i64>(0)
        .expect("an int8")
}

/// Waits until a node has gone idle and asked producers for nudges.
pub async fn wait_for_idle_node(db: &TestDb) {
    wait_until(30, "the node to go idle and ask for nudges", || async {
        scalar(db, "SELECT count(*) FROM outpost_node WHERE wants_nudge").await == 1
    })
    .await;
}

/// Every row is published: the outbox is empty (published events live in `outpost_published`).
/// Waits for it: a reader can see an entry in Redis before its node has marked the row (the mark
/// follows Redis's reply, a round trip later over a slow link).
pub async fn assert_all_published(db: &TestDb) {
    wait_until(
        60,
        "every row to be published (an empty outbox)",
        || async { scalar(db, "SELECT count(*) FROM outpost_event").await == 0 },
    )
    .await;
}

/// How many migrations, from `name` on, `migrate_down` must revert to undo `name`.
pub async fn migrations_from(db: &TestDb, name: &str) -> u32 {
    let names: Vec<String> = outpost::store::migrate_status(&db.store)
        .await
        .expect("migration status")
        .into_iter()
        .map(|m| m.name)
        .collect();
    let at = names
        .iter()
        .position(|n| n == name)
        .expect("the migration exists");
    u32::try_from(names.len() - at).expect("a few migrations")
}

/// Starts a relay node in this process (its own thread and actix system).
pub async fn start_node(config: outpost::config::Config) -> outpost::app::NodeHandle {
    init_logs();
    tokio::task::spawn_blocking(move || outpost::app::start(&config))
        .await
        .expect("node thread")
        .expect("node starts")
}

/// A plain HTTP/1.0 GET: the status code and the whole response (status 0 when nothing answers).
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let _ = s
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}

/// A relay worker over the test's database and Redis prefix, as a node builds one, with a
/// publishing deadline a minute ahead and `max_attempts` attempts before quarantine: for tests
/// that run batches themselves.
pub async fn worker(
    db: &TestDb,
    redis: &TestRedis,
    max_attempts: u32,
) -> outpost::dispatch::batch::Worker {
    worker_for(db, redis, max_attempts, &[]).await
}

/// [`worker`] with extra `key=value` overrides of the relay configuration (routing, rate
/// limits, `relay.batch_rows`).
pub async fn worker_for(
    db: &TestDb,
    redis: &TestRedis,
    max_attempts: u32,
    extra: &[(&str, &str)],
) -> outpost::dispatch::batch::Worker {
    use outpost::dispatch::batch::{LeaseDeadline, Shared, Worker};
    use outpost::dispatch::settings::RelaySettings;
    let config = relay_config_for(db, redis, "n1", extra);
    let publisher = outpost::publish::Publisher::connect(&outpost::publish::RedisSettings {
        url: redis_url(),
        key_prefix: redis.prefix.clone(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(5),
        topology: outpost::publish::Topology::Single,
    })
    .await
    .expect("publisher");
    let shared = Shared {
        router: outpost::dispatch::route::Router::new(&config.routing),
        limits: outpost::dispatch::ratelimit::RateLimits::new(
            &config.rate_limit,
            &redis.prefix,
            |name| publisher.stream_key(name),
        ),
        settings: RelaySettings {
            batch_rows: config.relay.batch_rows,
            batch_bytes: 1 << 20,
            max_attempts,
            backoff_base: Duration::from_millis(5),
            backoff_max: Duration::from_millis(40),
            delete_published: false,
        },
        deadline: LeaseDeadline::new(),
        streams: outpost::dispatch::streams::StreamBook::default(),
        cursors: Default::default(),
    };
    shared
        .deadline
        .extend_to(std::time::Instant::now() + Duration::from_secs(3600));
    Worker {
        store: db.store.clone(),
        publisher,
        slots: std::sync::Arc::new(tokio::sync::Semaphore::new(4)),
        queue: std::sync::Arc::default(),
        shared: std::sync::Arc::new(shared),
    }
}

/// The `skip`th aggregate id of type `order` (`o1`, `o2`, …) that falls in `partition`.
pub async fn aggregate_in(db: &TestDb, partition: i32, skip: i64) -> String {
    let n = scalar(
        db,
        &format!(
            "SELECT g::int8 FROM generate_series(1, 100000) g \
             WHERE outpost_partition_of('order', 'o' || g, \
                                        (SELECT partition_count FROM outpost_meta)) = {partition} \
             ORDER BY g OFFSET {skip} LIMIT 1"
        ),
    )
    .await;
    format!("o{n}")
}

/// Puts a key of the wrong type where the stream of aggregate type `kind` goes, so that its
/// events fail with `WRONGTYPE` until the key is deleted; returns the key.
pub async fn poison_stream(
    conn: &mut redis::aio::MultiplexedConnection,
    redis: &TestRedis,
    kind: &str,
) -> String {
    let key = format!("{}events:{kind}", redis.prefix);
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("x")
        .query_async(conn)
        .await
        .expect("SET");
    key
}

/// Waits until `n` events of the test's outbox are quarantined.
pub async fn wait_quarantined(db: &TestDb, n: i64) {
    wait_until(60, "events to be quarantined", || async {
        scalar(
            db,
            "SELECT count(*) FROM outpost_event WHERE status = 'quarantined'",
        )
        .await
            == n
    })
    .await;
}

/// A new API token named `name` with the operator role.
pub async fn operator_token(db: &TestDb, name: &str) -> String {
    let root = outpost::store::Actor::new("test-root", outpost::store::Role::Admin);
    db.store
        .create_token(&root, name, outpost::store::Role::Operator)
        .await
        .unwrap()
        .token
}

/// A stream entry of the `seq`th event (event id `e<seq>`) of aggregate `kind`/`a`, with an empty
/// payload: for tests that publish without a database.
pub fn plain_entry(seq: i64) -> outpost::publish::Entry {
    outpost::publish::Entry::new(outpost::publish::Message {
        event_id: format!("e{seq}"),
        event_type: "t".to_owned(),
        aggregate_type: "kind".to_owned(),
        aggregate_id: "a".to_owned(),
        aggregate_seq: seq,
        schema_version: "1".to_owned(),
        time: "2026-12-03T00:00:00Z".to_owned(),
        payload: "{}".to_owned(),
        headers: "{}".to_owned(),
    })
    .expect("a plain entry encodes")
}
