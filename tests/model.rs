//! A seeded, randomized test of the relay's hot path against a model of what must be true.
//!
//! Each seed drives one world — a database and a Redis prefix of its own, three partitions, four
//! aggregates per partition, each aggregate writing one of four streams (so a partition's batch
//! spans several streams, one of which starts as a key of the wrong type) — through a few
//! hundred random steps: transactions committed or rolled back; group batches over random
//! subsets of the partitions, with the per-partition or the poll claim, under the current lease
//! or a stale one; another owner's epoch written into a stream's fence; leases moved to a new
//! epoch; the poisoned stream healed; quarantined aggregates replayed. After every step a checker
//! compares the outbox, the history and the streams with the model:
//!
//! - every committed event is in exactly one of the outbox and the history, and no event of a
//!   rolled-back transaction is anywhere (G1, G2);
//! - every row in the history is in the stream its event was routed to, under the entry id the
//!   row records and with its own event id: no row is marked published without its own entry;
//! - the first appearances of each aggregate's events in its stream come in sequence order (G3);
//! - a failing or quarantined event holds its aggregate at or before its sequence, and no later
//!   event of a held aggregate is pending (G5).
//!
//! Odd seeds also limit one stream (40/s, burst 2) and claim six rows at a time, so that
//! partitions claim past rows that wait for a permit (`dispatch::cursor`).
//!
//! At the end every fault is lifted, everything is replayed and delivered, and each aggregate's
//! first appearances must be exactly 1, 2, 3, …
//!
//! `OUTPOST_MODEL_SEEDS` (default 20), `OUTPOST_MODEL_STEPS` (default 250) and
//! `OUTPOST_MODEL_SEED` (one seed only, to reproduce a failure) set the run; a failure names its
//! seed and step.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outpost::dispatch::batch::{BatchError, Claim, Worker};
use outpost::produce::{EventFact, Producer};
use outpost::store::{Actor, Lease, LeaseRef, Role, Selection};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use serde_json::json;
use support::{TestDb, TestRedis, aggregate_in, worker_for};

const PARTITIONS: [i32; 3] = [5, 17, 42];
const STREAMS: [&str; 4] = ["s0", "s1", "s2", "bad"];
const NODE: &str = "n1";
const LEASE_MS: u64 = 600_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_hot_path_keeps_the_model_under_random_faults() {
    let steps = usize::try_from(env_u64("OUTPOST_MODEL_STEPS", 250)).unwrap();
    let seeds: Vec<u64> = match std::env::var("OUTPOST_MODEL_SEED") {
        Ok(one) => vec![one.parse().expect("OUTPOST_MODEL_SEED is a number")],
        Err(_) => {
            let base = env_u64("OUTPOST_MODEL_BASE", 0);
            (base..base + env_u64("OUTPOST_MODEL_SEEDS", 20)).collect()
        }
    };
    println!("model: seeds {seeds:?}, {steps} steps each");
    // Five worlds at a time: each has its own database and Redis prefix.
    for chunk in seeds.chunks(5) {
        let runs = chunk.iter().map(|&seed| {
            tokio::spawn(async move {
                let mut world = World::new(seed).await;
                world.run(steps).await;
                world.steps_done
            })
        });
        for (seed, run) in chunk.iter().zip(futures::future::join_all(runs).await) {
            match run {
                Ok(n) => println!("model: seed {seed} kept the model over {n} steps"),
                Err(e) => {
                    let why = e
                        .try_into_panic()
                        .ok()
                        .and_then(|p| {
                            p.downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        })
                        .unwrap_or_default();
                    panic!(
                        "seed {seed} broke the model (reproduce with OUTPOST_MODEL_SEED={seed}): \
                         {why}"
                    );
                }
            }
        }
    }
}

/// One event the model knows of.
#[derive(Debug, Clone)]
struct Known {
    aggregate: usize,
    seq: i64,
}

struct World {
    seed: u64,
    step: usize,
    steps_done: usize,
    rng: StdRng,
    db: TestDb,
    /// Keeps the prefix's keys until the world ends (they are deleted on drop).
    _redis: TestRedis,
    conn: redis::aio::MultiplexedConnection,
    worker: Worker,
    /// (aggregate id, partition, stream name)
    aggregates: Vec<(String, i32, &'static str)>,
    leases: HashMap<i32, LeaseRef>,
    stale: Vec<LeaseRef>,
    /// The poisoned stream still holds a string.
    poisoned: bool,
    committed: HashMap<String, Known>,
    rolled_back: HashSet<String>,
    /// Per stream, the last entry id read.
    cursor: HashMap<String, String>,
    /// (stream key, entry id) → event id.
    entries: HashMap<(String, String), String>,
    /// Event ids seen in a stream.
    appeared: HashSet<String>,
    /// Per aggregate, the sequence of its latest first appearance.
    first: HashMap<usize, i64>,
}

impl World {
    async fn new(seed: u64) -> Self {
        let db = TestDb::with_pool(8).await;
        let redis = TestRedis::new();
        let conn = redis.conn().await;
        // Odd seeds limit stream s1 and claim a few rows at a time, so partitions move past
        // rows waiting for a permit (the claim cursor) while everything else goes on.
        let limits: &[(&str, &str)] = if seed % 2 == 1 {
            &[
                ("rate_limit.streams.s1", "40"),
                ("rate_limit.burst", "2"),
                ("relay.batch_rows", "6"),
            ]
        } else {
            &[]
        };
        let worker = worker_for(&db, &redis, 3, limits).await;
        let mut aggregates = Vec::new();
        for &p in &PARTITIONS {
            for (k, stream) in STREAMS.iter().enumerate() {
                let id = aggregate_in(&db, p, i64::try_from(k).unwrap()).await;
                aggregates.push((id, p, *stream));
            }
        }
        let mut world = Self {
            seed,
            step: 0,
            steps_done: 0,
            rng: StdRng::seed_from_u64(seed),
            db,
            _redis: redis,
            conn,
            worker,
            aggregates,
            leases: HashMap::new(),
            stale: Vec::new(),
            poisoned: true,
            committed: HashMap::new(),
            rolled_back: HashSet::new(),
            cursor: HashMap::new(),
            entries: HashMap::new(),
            appeared: HashSet::new(),
            first: HashMap::new(),
        };
        let key = world.key("bad");
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg("not a stream")
            .query_async(&mut world.conn)
            .await
            .unwrap();
        let taken = world
            .db
            .store
            .acquire_partitions(NODE, LEASE_MS, &[], 64)
            .await
            .unwrap();
        for l in taken {
            world.leases.insert(l.partition, lease_ref(&l));
        }
        world
    }

    fn key(&self, stream: &str) -> String {
        self.worker.publisher.stream_key(stream)
    }

    fn fail(&self, what: impl std::fmt::Display) -> ! {
        panic!("seed {} step {}: {what}", self.seed, self.step)
    }

    async fn run(&mut self, steps: usize) {
        for step in 0..steps {
            self.step = step;
            match self.rng.random_range(0..100) {
                0..30 => self.commit().await,
                30..75 => self.batch().await,
                75..82 => self.bump_fence().await,
                82..88 => self.move_lease().await,
                88..92 => self.heal().await,
                _ => self.replay().await,
            }
            self.check().await;
            self.steps_done = step + 1;
        }
        self.step = steps;
        self.drain().await;
    }

    /// A transaction of one to four events of random aggregates; one in ten rolls back.
    async fn commit(&mut self) {
        let n = self.rng.random_range(1..=4);
        let facts: Vec<(usize, EventFact)> = (0..n)
            .map(|_| {
                let a = self.rng.random_range(0..self.aggregates.len());
                let (id, _, stream) = &self.aggregates[a];
                let fact = EventFact::new("order", id.clone(), "order.changed", json!({"a": a}))
                    .destination(*stream);
                (a, fact)
            })
            .collect();
        let ids: Vec<(usize, String)> = facts
            .iter()
            .map(|(a, f)| (*a, f.id().to_string()))
            .collect();
        let txn = self.db.store.connection().begin().await.unwrap();
        let inserted = Producer::default()
            .enqueue_facts(&txn, facts.into_iter().map(|(_, f)| f).collect())
            .await
            .unwrap();
        if self.rng.random_bool(0.1) {
            txn.rollback().await.unwrap();
            self.rolled_back.extend(ids.into_iter().map(|(_, id)| id));
        } else {
            txn.commit().await.unwrap();
            for ((aggregate, id), row) in ids.into_iter().zip(inserted) {
                self.committed.insert(
                    id,
                    Known {
                        aggregate,
                        seq: row.aggregate_seq,
                    },
                );
            }
        }
    }

    /// A group batch over a random subset of the partitions, in random order, each under its
    /// current lease or (sometimes) a stale one; outcomes handled as the supervisor would.
    async fn batch(&mut self) {
        let mut parts: Vec<i32> = PARTITIONS.to_vec();
        parts.shuffle(&mut self.rng);
        parts.truncate(self.rng.random_range(1..=PARTITIONS.len()));
        let mut group: Vec<LeaseRef> = Vec::new();
        for p in parts {
            let stale = self.stale.iter().filter(|l| l.partition == p).cloned();
            let stale: Vec<LeaseRef> = stale.collect();
            let lease = if !stale.is_empty() && self.rng.random_bool(0.15) {
                stale[self.rng.random_range(0..stale.len())].clone()
            } else {
                self.leases[&p].clone()
            };
            group.push(lease);
        }
        let claim = if self.rng.random_bool(0.5) {
            Claim::PerPartition
        } else {
            Claim::Poll
        };
        let outcomes = self.worker.run_together(&group, claim, |_| {}).await;
        for (lease, outcome) in group.iter().zip(outcomes) {
            let current = self.leases[&lease.partition].epoch == lease.epoch;
            match outcome {
                Ok(_) | Err(BatchError::Transient(_)) => {}
                Err(BatchError::Fenced { current: seen }) if current => {
                    // The supervisor's answer: the database still names this node as owner,
                    // so the fence came from history the database does not have; jump past it.
                    match self
                        .db
                        .store
                        .advance_epoch(NODE, lease.partition, lease.epoch, seen, LEASE_MS)
                        .await
                        .unwrap()
                    {
                        Some(epoch) => self.renew(lease.partition, epoch),
                        None => self.fail("a fenced lease the database still gave us vanished"),
                    }
                }
                Err(BatchError::LeaseLost(why)) if current => {
                    self.fail(format!("the current lease was refused: {why}"))
                }
                Err(_) => {}
            }
        }
    }

    fn renew(&mut self, partition: i32, epoch: i64) {
        let old = self.leases[&partition].clone();
        self.stale.push(old);
        self.leases.insert(
            partition,
            LeaseRef {
                partition,
                node_id: NODE.to_owned(),
                epoch,
            },
        );
    }

    /// Another owner's epoch (a little ahead of ours) in a random stream's fence.
    async fn bump_fence(&mut self) {
        let p = PARTITIONS[self.rng.random_range(0..PARTITIONS.len())];
        let stream = STREAMS[self.rng.random_range(0..3)];
        let epoch = self.leases[&p].epoch + self.rng.random_range(1..3);
        let fence = self.worker.publisher.fence_key(&self.key(stream)).unwrap();
        let _: () = redis::cmd("HSET")
            .arg(fence)
            .arg(p.to_string())
            .arg(epoch.to_string())
            .query_async(&mut self.conn)
            .await
            .unwrap();
    }

    /// The lease given back and taken again: a new epoch; the old one is kept to run batches as
    /// a node that lost it would.
    async fn move_lease(&mut self) {
        let p = PARTITIONS[self.rng.random_range(0..PARTITIONS.len())];
        let old = self.leases[&p].clone();
        let released = Lease {
            partition: p,
            epoch: old.epoch,
            paused: false,
        };
        self.db
            .store
            .release_partitions(NODE, &[released])
            .await
            .unwrap();
        // Every other partition is ours and stays at its epoch.
        let holding: Vec<i32> = (0..64).filter(|x| *x != p).collect();
        let taken = self
            .db
            .store
            .acquire_partitions(NODE, LEASE_MS, &holding, 1)
            .await
            .unwrap();
        let new = taken
            .iter()
            .find(|l| l.partition == p)
            .unwrap_or_else(|| self.fail("a released partition was not taken again"));
        self.renew(p, new.epoch);
    }

    async fn heal(&mut self) {
        if self.poisoned {
            let _: () = redis::cmd("DEL")
                .arg(self.key("bad"))
                .query_async(&mut self.conn)
                .await
                .unwrap();
            self.poisoned = false;
        }
    }

    /// Quarantined events replayed as an operator replays them (audited; their aggregates'
    /// held successors follow).
    async fn replay(&mut self) {
        let rows = self
            .query("SELECT event_id FROM outpost_event WHERE status = 'quarantined'")
            .await;
        let ids: Vec<uuid::Uuid> = rows
            .iter()
            .map(|r| r.try_get_by_index(0).unwrap())
            .collect();
        if ids.is_empty() {
            return;
        }
        let operator = Actor::new("model-test", Role::Operator);
        let done = self
            .db
            .store
            .replay_events(&operator, &Selection::Ids(ids.clone()), "model test")
            .await
            .unwrap();
        assert_eq!(done.events, ids.len() as u64);
    }

    async fn query(&self, sql: &str) -> Vec<sea_orm::QueryResult> {
        self.db
            .store
            .connection()
            .query_all_raw(Statement::from_string(DbBackend::Postgres, sql))
            .await
            .unwrap()
    }

    /// Reads what the streams gained since the last check and checks every invariant.
    async fn check(&mut self) {
        self.read_streams().await;
        // Outbox and history.
        let outbox = self
            .query(
                "SELECT e.event_id::text, e.aggregate_seq, e.status, a.blocked_seq \
                 FROM outpost_event e JOIN outpost_aggregate a USING (aggregate_type, aggregate_id)",
            )
            .await;
        let history = self
            .query("SELECT event_id::text, destination, stream_id FROM outpost_published")
            .await;
        let mut found: HashSet<String> = HashSet::new();
        for r in &outbox {
            let id: String = r.try_get_by_index(0).unwrap();
            let seq: i64 = r.try_get_by_index(1).unwrap();
            let status: String = r.try_get_by_index(2).unwrap();
            let blocked: Option<i64> = r.try_get_by_index(3).unwrap();
            match status.as_str() {
                "retry_wait" | "quarantined" if blocked.is_none_or(|b| b > seq) => {
                    self.fail(format!(
                        "event {id} ({status}, seq {seq}) does not hold its aggregate ({blocked:?})"
                    ))
                }
                "pending" if blocked.is_some_and(|b| seq > b) => self.fail(format!(
                    "event {id} (seq {seq}) is pending behind its aggregate's hold at {blocked:?}"
                )),
                _ => {}
            }
            if !found.insert(id.clone()) {
                self.fail(format!("event {id} twice in the outbox"));
            }
        }
        for r in &history {
            let id: String = r.try_get_by_index(0).unwrap();
            let destination: String = r.try_get_by_index(1).unwrap();
            let entry: String = r.try_get_by_index(2).unwrap();
            if !found.insert(id.clone()) {
                self.fail(format!(
                    "event {id} in the outbox and the history, or twice"
                ));
            }
            let stream = self.key(&destination);
            match self.entries.get(&(stream.clone(), entry.clone())) {
                Some(e) if *e == id => {}
                Some(other) => self.fail(format!(
                    "event {id} is marked published as {stream} {entry}, which carries event {other}"
                )),
                None => self.fail(format!(
                    "event {id} is marked published as {stream} {entry}, which is not in the stream"
                )),
            }
        }
        for id in self.committed.keys() {
            if !found.contains(id) {
                self.fail(format!(
                    "committed event {id} is neither in the outbox nor in history"
                ));
            }
        }
        if let Some(id) = self.rolled_back.iter().find(|id| found.contains(*id)) {
            self.fail(format!(
                "event {id} of a rolled-back transaction was written"
            ));
        }
    }

    async fn read_streams(&mut self) {
        for stream in STREAMS {
            let key = self.key(stream);
            let start = self
                .cursor
                .get(&key)
                .map_or_else(|| "-".to_owned(), |c| format!("({c}"));
            let reply: redis::RedisResult<redis::streams::StreamRangeReply> = redis::cmd("XRANGE")
                .arg(&key)
                .arg(start)
                .arg("+")
                .query_async(&mut self.conn)
                .await;
            let reply = match reply {
                Ok(r) => r,
                // The poisoned stream while it holds a string.
                Err(e) if e.code() == Some("WRONGTYPE") => continue,
                Err(e) => self.fail(format!("reading {key}: {e}")),
            };
            for e in reply.ids {
                let field = |name: &str| {
                    e.map
                        .get(name)
                        .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
                        .unwrap_or_default()
                };
                let id = field("ce_id");
                if self.rolled_back.contains(&id) {
                    self.fail(format!(
                        "event {id} of a rolled-back transaction is in {key}"
                    ));
                }
                let Some(known) = self.committed.get(&id).cloned() else {
                    self.fail(format!(
                        "{key} {} carries event {id}, never committed",
                        e.id
                    ));
                };
                let seq: i64 = field("ce_aggregateseq").parse().unwrap_or(-1);
                if seq != known.seq {
                    self.fail(format!(
                        "event {id} appeared with seq {seq}, committed as {}",
                        known.seq
                    ));
                }
                if self.appeared.insert(id.clone()) {
                    let last = self.first.get(&known.aggregate).copied().unwrap_or(0);
                    if seq != last + 1 {
                        self.fail(format!(
                            "aggregate {} first showed seq {seq} after {last} ({key} {})",
                            self.aggregates[known.aggregate].0, e.id
                        ));
                    }
                    self.first.insert(known.aggregate, seq);
                }
                self.entries.insert((key.clone(), e.id.clone()), id);
                self.cursor.insert(key.clone(), e.id);
            }
        }
    }

    /// Lifts every fault and delivers everything; then every committed event must have
    /// appeared, each aggregate's in sequence order.
    async fn drain(&mut self) {
        self.heal().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            self.replay().await;
            let group: Vec<LeaseRef> = PARTITIONS.iter().map(|p| self.leases[p].clone()).collect();
            for (lease, outcome) in group.iter().zip(
                self.worker
                    .run_together(&group, Claim::PerPartition, |_| {})
                    .await,
            ) {
                if let Err(BatchError::Fenced { current }) = outcome {
                    let epoch = self
                        .db
                        .store
                        .advance_epoch(NODE, lease.partition, lease.epoch, current, LEASE_MS)
                        .await
                        .unwrap()
                        .unwrap_or_else(|| self.fail("the fenced lease vanished"));
                    self.renew(lease.partition, epoch);
                }
            }
            self.check().await;
            let left = self.query("SELECT 1 FROM outpost_event").await.len();
            if left == 0 {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                self.fail(format!(
                    "{left} events still in the outbox after the faults ended"
                ));
            }
            // Failed rows wait for their retry time (tens of milliseconds here).
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for (id, known) in &self.committed {
            if !self.appeared.contains(id) {
                self.fail(format!(
                    "committed event {id} (seq {}) never appeared",
                    known.seq
                ));
            }
        }
    }
}

fn lease_ref(l: &Lease) -> LeaseRef {
    LeaseRef {
        partition: l.partition,
        node_id: NODE.to_owned(),
        epoch: l.epoch,
    }
}
