//! Harness for the consumer helpers: entries written in the relay's exact format, a handler that
//! records every effect in the consumer's database, and the checker that decides whether each
//! aggregate's effects were applied once each, in sequence order.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use outpost::consume::{
    Consumer, ConsumerSettings, ConsumerStats, Delivery, Handler, HandlerError,
};
use outpost::publish::{Message, entry_fields};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, Statement};
use tokio::sync::oneshot;

use super::{TestDb, TestRedis, redis_url};

/// One event as the relay would publish it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ev {
    pub aggregate: String,
    pub seq: i64,
    pub event_type: String,
    pub event_id: uuid::Uuid,
}

impl Ev {
    pub fn new(aggregate: &str, seq: i64, event_type: &str) -> Self {
        Self {
            aggregate: aggregate.to_owned(),
            seq,
            event_type: event_type.to_owned(),
            event_id: uuid::Uuid::new_v4(),
        }
    }

    /// The entry's fields as bytes, with `name` set to `value` (added when absent, every copy
    /// replaced when present): an entry as someone who can `XADD` could forge it.
    pub fn tampered(&self, name: &[u8], value: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = self
            .fields()
            .into_iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.into_bytes()))
            .filter(|(k, _)| k.as_slice() != name)
            .collect();
        fields.push((name.to_vec(), value.to_vec()));
        fields
    }

    fn fields(&self) -> Vec<(&'static str, String)> {
        entry_fields(Message {
            event_id: self.event_id.to_string(),
            event_type: self.event_type.clone(),
            aggregate_type: "order".into(),
            aggregate_id: self.aggregate.clone(),
            aggregate_seq: self.seq,
            schema_version: "1".into(),
            time: "2026-12-01T00:00:00.000000Z".into(),
            payload: format!(r#"{{"seq":{}}}"#, self.seq),
            headers: "{}".into(),
        })
        .expect("entry fields")
    }
}

/// Appends `events` to `stream`, in order, as the relay would.
pub async fn append(conn: &mut redis::aio::MultiplexedConnection, stream: &str, events: &[Ev]) {
    let mut pipe = redis::pipe();
    for e in events {
        pipe.cmd("XADD").arg(stream).arg("*");
        for (k, v) in e.fields() {
            pipe.arg(k).arg(v);
        }
    }
    let _: Vec<String> = pipe.query_async(conn).await.expect("XADD");
}

/// Appends an entry that is not an Outpost event (no identity, no sequence).
pub async fn append_foreign(conn: &mut redis::aio::MultiplexedConnection, stream: &str) {
    let _: String = redis::cmd("XADD")
        .arg(stream)
        .arg("*")
        .arg("hello")
        .arg("world")
        .query_async(conn)
        .await
        .expect("XADD");
}

/// Appends an entry made of exactly `fields`, whatever bytes they hold.
pub async fn append_raw(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    fields: &[(Vec<u8>, Vec<u8>)],
) {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(k.as_slice()).arg(v.as_slice());
    }
    let _: String = cmd.query_async(conn).await.expect("XADD");
}

/// Every entry of `stream` (a dead-letter stream), fields as bytes in order; read without
/// assuming UTF-8, as a hostile entry's fields are kept there as they were.
pub async fn entries_raw(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .expect("XRANGE");
    let bytes = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => b.clone(),
        other => panic!("unexpected field in XRANGE: {other:?}"),
    };
    let redis::Value::Array(items) = reply else {
        panic!("unexpected XRANGE reply: {reply:?}")
    };
    items
        .iter()
        .map(|item| match item {
            redis::Value::Array(pair) => match pair.as_slice() {
                [_, redis::Value::Array(kv)] => kv
                    .chunks_exact(2)
                    .map(|c| (bytes(&c[0]), bytes(&c[1])))
                    .collect(),
                other => panic!("unexpected XRANGE entry: {other:?}"),
            },
            other => panic!("unexpected XRANGE entry: {other:?}"),
        })
        .collect()
}

/// The value of `name` among `fields`, as text (lossy).
pub fn field_of(fields: &[(Vec<u8>, Vec<u8>)], name: &str) -> Option<String> {
    fields
        .iter()
        .find(|(k, _)| k.as_slice() == name.as_bytes())
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}

/// Creates the table the recording handler writes to.
pub async fn create_effects(db: &TestDb) {
    db.store
        .connection()
        .execute_unprepared(
            "CREATE TABLE consumer_effect (id bigserial PRIMARY KEY, aggregate text NOT NULL, \
             seq bigint NOT NULL, event_id uuid NOT NULL, consumer text NOT NULL)",
        )
        .await
        .expect("create consumer_effect");
}

/// Records every event it is given in `consumer_effect`; fails as configured.
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    pub name: String,
    /// Event types refused permanently.
    pub permanent: HashSet<String>,
    /// Event types that always ask for a retry.
    pub retry: HashSet<String>,
    /// Never finish: a member that hangs (then dies) with its entries pending.
    pub hang: bool,
}

impl Handler for Recorder {
    async fn handle(
        &self,
        event: &Delivery,
        txn: &DatabaseTransaction,
    ) -> Result<(), HandlerError> {
        if self.hang {
            std::future::pending::<()>().await;
        }
        if self.permanent.contains(&event.event_type) {
            return Err(HandlerError::permanent("this type is refused"));
        }
        if self.retry.contains(&event.event_type) {
            return Err(HandlerError::retry("a dependency is down"));
        }
        let p: serde_json::Value = event.payload()?;
        if let Some(seq) = p.get("seq") {
            assert_eq!(seq, event.aggregate_seq, "payload matches the entry");
        }
        txn.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO consumer_effect (aggregate, seq, event_id, consumer) \
                 VALUES ($1, $2, $3, $4)",
            [
                event.aggregate_id.clone().into(),
                event.aggregate_seq.into(),
                event.event_id.into(),
                self.name.clone().into(),
            ],
        ))
        .await?;
        Ok(())
    }
}

/// Settings for a test consumer: short claim and hold times, the test's key prefix.
pub fn settings(redis: &TestRedis, stream: &str, group: &str, name: &str) -> ConsumerSettings {
    settings_at(&redis_url(), &redis.prefix, stream, group, name)
}

/// [`settings`] for any Redis and key prefix.
pub fn settings_at(
    url: &str,
    prefix: &str,
    stream: &str,
    group: &str,
    name: &str,
) -> ConsumerSettings {
    let mut s = ConsumerSettings::new(url, stream, group);
    s.key_prefix = prefix.to_owned();
    s.consumer = name.to_owned();
    s.block = Duration::from_millis(200);
    s.claim_idle = Duration::from_secs(1);
    s.claim_interval = Duration::from_millis(200);
    s.order_wait = Duration::from_millis(500);
    s.member_timeout = Duration::from_millis(500);
    s.retry_backoff = Duration::from_millis(20);
    s
}

/// A consumer running in the background until stopped.
pub struct Running {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<ConsumerStats, outpost::consume::ConsumeError>>,
}

impl Running {
    pub async fn start(settings: ConsumerSettings, db: &TestDb, handler: Recorder) -> Self {
        let consumer = Consumer::connect(settings, db.store.connection().clone(), handler)
            .await
            .expect("consumer connects");
        let (stop, rx) = oneshot::channel();
        let task = tokio::spawn(consumer.run_until(async move {
            let _ = rx.await;
        }));
        Self { stop, task }
    }

    pub async fn stop(self) -> ConsumerStats {
        let _ = self.stop.send(());
        self.task
            .await
            .expect("consumer task")
            .expect("consumer ran")
    }
}

/// What the checker found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Check {
    /// (aggregate, seq) never applied.
    pub missing: Vec<(String, i64)>,
    /// (aggregate, seq) applied more than once.
    pub duplicated: Vec<(String, i64)>,
    /// Aggregates whose effects are not in sequence order.
    pub out_of_order: Vec<String>,
    /// Effects applied in all.
    pub applied: usize,
}

impl Check {
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty() && self.duplicated.is_empty() && self.out_of_order.is_empty()
    }
}

/// Compares the effects in the consumer's database with `expected` (aggregate → sequences that
/// must be applied, once each, in order).
pub async fn check(db: &TestDb, expected: &BTreeMap<String, Vec<i64>>) -> Check {
    let rows = db
        .store
        .connection()
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT aggregate, seq FROM consumer_effect ORDER BY id",
        ))
        .await
        .expect("read effects");
    let mut applied: HashMap<String, Vec<i64>> = HashMap::new();
    for r in &rows {
        applied
            .entry(r.try_get_by_index(0).expect("aggregate"))
            .or_default()
            .push(r.try_get_by_index(1).expect("seq"));
    }
    let mut out = Check {
        applied: rows.len(),
        ..Check::default()
    };
    for (agg, want) in expected {
        let got = applied.get(agg).cloned().unwrap_or_default();
        for s in want {
            match got.iter().filter(|g| *g == s).count() {
                0 => out.missing.push((agg.clone(), *s)),
                1 => {}
                _ => out.duplicated.push((agg.clone(), *s)),
            }
        }
        if got.windows(2).any(|w| w[0] >= w[1]) {
            out.out_of_order.push(agg.clone());
        }
    }
    out
}

/// Every effect recorded, in the order applied: `(sequence, event id)`.
pub async fn effects(db: &TestDb) -> Vec<(i64, uuid::Uuid)> {
    db.store
        .connection()
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT seq, event_id FROM consumer_effect ORDER BY id",
        ))
        .await
        .expect("read effects")
        .iter()
        .map(|r| {
            (
                r.try_get_by_index(0).expect("seq"),
                r.try_get_by_index(1).expect("event_id"),
            )
        })
        .collect()
}

/// Number of effects recorded so far.
pub async fn applied(db: &TestDb) -> i64 {
    super::scalar(db, "SELECT count(*) FROM consumer_effect").await
}

/// Entries still pending (delivered, not acknowledged) in the group.
pub async fn pending(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    group: &str,
) -> i64 {
    let summary: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(conn)
        .await
        .expect("XPENDING");
    match summary {
        redis::Value::Array(parts) => match parts.first() {
            Some(redis::Value::Int(n)) => *n,
            _ => 0,
        },
        _ => 0,
    }
}

/// Waits until `n` effects are recorded and the group has nothing pending in `stream`.
pub async fn wait_applied_and_acknowledged(
    db: &TestDb,
    redis: &TestRedis,
    stream: &str,
    group: &str,
    n: i64,
) {
    super::wait_until(30, &format!("{n} events applied"), || async {
        applied(db).await == n
    })
    .await;
    super::wait_until(30, "every entry acknowledged", || async {
        pending(&mut redis.conn().await, stream, group).await == 0
    })
    .await;
}

/// Runs `outpost tail` with the test's Redis and key prefix; returns its stdout.
pub fn tail(redis: &TestRedis, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outpost"))
        .arg("--set")
        .arg(format!("redis.url={}", redis_url()))
        .arg("--set")
        .arg(format!("redis.key_prefix={}", redis.prefix))
        .arg("tail")
        .args(args)
        .current_dir(std::env::temp_dir())
        .env_remove("OUTPOST_DATABASE__URL")
        .output()
        .expect("run outpost tail");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The handler shared by several consumers.
pub fn recorder(name: &str) -> Recorder {
    Recorder {
        name: name.to_owned(),
        ..Recorder::default()
    }
}

/// Every event in the outbox, as the checker's expectation: aggregate id → sequences.
pub async fn outbox_expectation(db: &TestDb) -> BTreeMap<String, Vec<i64>> {
    let rows = db
        .store
        .connection()
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT aggregate_id, aggregate_seq FROM outpost_event ORDER BY aggregate_id, aggregate_seq",
        ))
        .await
        .expect("read the outbox");
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in rows {
        out.entry(r.try_get_by_index(0).expect("aggregate_id"))
            .or_default()
            .push(r.try_get_by_index(1).expect("aggregate_seq"));
    }
    out
}
