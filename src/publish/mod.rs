//! Publishing to Redis Streams. This module never touches the database.
//!
//! A batch is a list of [`StreamBatch`]es, one per stream. Each is appended by one call of a Lua
//! script that first checks the partition's fencing epoch at Redis (a hash field next to the
//! stream, in the same hash slot) and only then runs the `XADD`s — atomically, so a node that lost
//! its lease cannot append behind the new owner's entries. The calls of one batch are pipelined
//! (on a Redis Cluster: sent one by one, all at once; see [`RedisConn::run_each`]).

mod clock;
mod conn;
mod entry;
mod error;
mod recover;
mod script;
mod server;
mod trim;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use redis::cluster_routing::Slot;

pub use conn::{RedisConn, Topology, companion_key, connection_info, hash_tag, parse_seed};
pub use entry::{Entry, Message, entry_fields, field};
pub use error::{ErrorClass, PublishError, classify_code};
pub use recover::StreamPosition;
pub use server::{PersistenceConfig, ServerFacts};
pub use trim::{TrimReport, TrimRule};

/// A stream entry id `ms-seq` as numbers, ordered as Redis orders them.
pub fn parse_entry_id(id: &str) -> Option<(i64, i64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// An epoch that skips the Redis fence. Only the `fence-off` fault point uses it.
pub const UNFENCED: i64 = -1;

/// Entries of one partition for one stream, in the order they must appear, fenced by that
/// partition's lease epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamBatch {
    /// Full stream key (prefix included).
    pub stream: String,
    /// The partition the entries belong to.
    pub partition: i32,
    /// The partition's lease epoch (the fencing token).
    pub epoch: i64,
    /// The stream was written before (by any node, as far as this node knows): its fence hash
    /// must exist, or Redis lost its data and nothing is appended ([`StreamOutcome::Lost`]).
    pub known: bool,
    /// The newest entry id the partition is known to have appended to the stream, as
    /// `(ms, seq)`: when Redis holds an older one for the partition, it lost the entries after
    /// it, and nothing is appended ([`StreamOutcome::Lost`]).
    pub expect: Option<(i64, i64)>,
    /// The entries, in order.
    pub entries: Vec<Entry>,
}

/// What became of one [`StreamBatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamOutcome {
    /// Every entry was appended; their stream entry ids, in order.
    Published(Vec<String>),
    /// The fence at Redis holds a newer epoch: this node lost the partition. Nothing appended.
    Fenced {
        /// The epoch found at Redis.
        current: i64,
    },
    /// The partition's fence at Redis is not an epoch (someone else wrote it): nothing appended,
    /// nothing can be until it is fixed, and no event is to blame
    /// ([`PublishError::bad_fence`]).
    BadFence {
        /// The fence key.
        fence: String,
        /// What the partition's field holds (its first bytes); `None`: the key is not a hash.
        value: Option<String>,
    },
    /// The stream is known to have been written, but its fence hash is gone, or the newest entry
    /// of the partition Redis holds is older than [`StreamBatch::expect`]: Redis lost data
    /// (restarted empty or from an older snapshot, failed over to a replica that lagged,
    /// evicted it). Nothing appended.
    Lost,
    /// The first `ids.len()` entries were appended, then Redis refused the next one.
    Failed {
        /// Ids of the entries appended before the failure.
        ids: Vec<String>,
        /// Why the next entry was refused.
        error: PublishError,
    },
}

/// Connection settings.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// `redis://` URL. Never logged: it may carry a password.
    pub url: String,
    /// Prefix of every key Outpost writes.
    pub key_prefix: String,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Per-request timeout.
    pub response_timeout: Duration,
    /// A single Redis or a Redis Cluster.
    pub topology: Topology,
}

/// A publishing connection (multiplexed, reconnecting by itself; a single Redis or a cluster).
#[derive(Clone)]
pub struct Publisher {
    conn: RedisConn,
    prefix: String,
    /// How long the node waits for a round of calls before giving up on it.
    limit: Duration,
    /// Readings of Redis's clocks, for each call's deadline (`clock`).
    clock: Arc<clock::RedisClock>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("prefix", &self.prefix)
            .field("conn", &self.conn)
            .finish()
    }
}

impl Publisher {
    /// Connects. Fails when Redis cannot be reached within the connect timeout.
    pub async fn connect(settings: &RedisSettings) -> Result<Self, PublishError> {
        // The prefix must leave room for a fence next to every stream.
        companion_key(
            &settings.key_prefix,
            "fence",
            &format!("{}s", settings.key_prefix),
        )
        .map_err(|e| PublishError::config(format!("redis.key_prefix: {e}")))?;
        let conn = RedisConn::connect(
            &settings.url,
            &settings.topology,
            settings.connect_timeout,
            settings.response_timeout,
        )
        .await
        .map_err(|e| {
            if e.kind() == redis::ErrorKind::InvalidClientConfig {
                PublishError::config(format!("redis.url is not usable: {e}"))
            } else {
                PublishError::from_redis(e)
            }
        })?;
        // A cluster connection retries a command within twice the response timeout.
        let limit = if settings.topology.is_cluster() {
            settings.response_timeout * 2
        } else {
            settings.response_timeout
        };
        Ok(Self {
            conn,
            prefix: settings.key_prefix.clone(),
            limit,
            clock: Arc::new(clock::RedisClock::new()),
        })
    }

    /// The connection (shared by clones).
    pub fn connection(&self) -> &RedisConn {
        &self.conn
    }

    /// The full key of a stream name.
    pub fn stream_key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The fence key of a stream: a hash (partition → epoch) in the stream's hash slot, so both
    /// are on the same Redis Cluster node and one script can check one and append to the other.
    pub fn fence_key(&self, stream_key: &str) -> Result<String, PublishError> {
        companion_key(&self.prefix, "fence", stream_key).map_err(|e| PublishError::event("KEY", e))
    }

    /// Round trip to Redis (readiness).
    pub async fn ping(&self) -> Result<(), PublishError> {
        let mut c = self.conn.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .map_err(PublishError::from_redis)?;
        Ok(())
    }

    /// Whose clock decides a call's deadline for `stream`: the single Redis, or the cluster
    /// primary holding the stream's slot.
    fn clock_source(&self, stream: &str) -> clock::Source {
        self.conn.is_cluster().then(|| Slot::for_key(stream))
    }

    /// A fresh reading of each of `sources`' clocks, reading with `TIME` those without one, or
    /// why it could not be read. A server that does not answer costs only its own calls: on a
    /// cluster, a paused primary answers no `TIME` either (it comes behind the calls it holds on
    /// the same connection), and the other primaries' calls go on without it.
    async fn read_clocks(
        &self,
        sources: &[clock::Source],
    ) -> HashMap<clock::Source, Result<clock::Reading, PublishError>> {
        let now = Instant::now();
        let mut readings = HashMap::new();
        let mut unread = Vec::new();
        for &source in sources {
            if readings.contains_key(&source) || unread.contains(&source) {
                continue;
            }
            match self.clock.fresh(source, now) {
                Some(r) => {
                    readings.insert(source, Ok(r));
                }
                None => unread.push(source),
            }
        }
        let answers = join_all(unread.iter().map(|&source| async move {
            let reading = async {
                let answer = tokio::time::timeout(self.limit, self.conn.time(source))
                    .await
                    .map_err(|_| PublishError::timed_out(self.limit))?
                    .map_err(PublishError::from_redis);
                let received = Instant::now();
                let ms = match answer {
                    Ok(time) => Some(clock::time_ms(&time).ok_or_else(|| {
                        PublishError::event("PROTOCOL", "unexpected reply to TIME")
                    })?),
                    // The server refused the command itself (a proxy that does not pass it on, an
                    // ACL without it): calls go without a deadline.
                    Err(e) if e.class() != ErrorClass::Transient => {
                        if !self
                            .clock
                            .warned
                            .swap(true, std::sync::atomic::Ordering::Relaxed)
                        {
                            tracing::warn!(
                                error = %e,
                                "Redis refuses TIME: publish calls go without a deadline, so calls \
                                 held up in the network may append late copies (allow TIME for \
                                 Outpost's user, or connect to Redis without a proxy)"
                            );
                        }
                        None
                    }
                    Err(e) => return Err(e),
                };
                Ok::<_, PublishError>(self.clock.record(source, ms, received))
            };
            (source, reading.await)
        }))
        .await;
        readings.extend(answers);
        readings
    }

    /// Appends every batch, each fenced by its partition's epoch, in one round of calls.
    ///
    /// `Err` when no call got through: each one failed transiently, before running (Redis
    /// loading, out of memory, cluster down) or with its outcome unknown (connection lost,
    /// timeout: some entries may have been appended). When only some calls failed that way,
    /// theirs are [`StreamOutcome::Failed`] with that error and no ids.
    pub async fn publish(
        &self,
        batches: &[StreamBatch],
    ) -> Result<Vec<StreamOutcome>, PublishError> {
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        let mut out: Vec<Option<StreamOutcome>> = vec![None; batches.len()];
        // (index in `batches`, fence key) of the calls to make.
        let mut todo: Vec<(usize, String)> = Vec::with_capacity(batches.len());
        for (i, b) in batches.iter().enumerate() {
            match self.fence_key(&b.stream) {
                Ok(fence) => todo.push((i, fence)),
                Err(error) => {
                    out[i] = Some(StreamOutcome::Failed {
                        ids: Vec::new(),
                        error,
                    });
                }
            }
        }
        // A node that never saw the script (a restarted Redis, a cluster node that just took
        // over a slot) answers NOSCRIPT without running anything: load it and send those again.
        let mut loaded = false;
        while !todo.is_empty() {
            let sources: Vec<clock::Source> = todo
                .iter()
                .map(|(i, _)| self.clock_source(&batches[*i].stream))
                .collect();
            let readings = self.read_clocks(&sources).await;
            // Every call carries the moment by which it must run, in its Redis's time: half the
            // node's wait for it, so that its answer still finds the node waiting. A call that
            // reaches Redis later (it sat in a partitioned network or a paused Redis) is
            // refused, so it cannot append a claim the node has moved past (`clock`).
            let sent = Instant::now();
            let mut calls = Vec::with_capacity(todo.len());
            let mut sending = Vec::with_capacity(todo.len());
            for ((i, fence), source) in todo.into_iter().zip(sources) {
                // `read_clocks` answers for every source.
                let deadline = match readings.get(&source) {
                    Some(Ok(r)) => self.clock.deadline(*r, sent, self.limit),
                    Some(Err(error)) => {
                        out[i] = Some(StreamOutcome::Failed {
                            ids: Vec::new(),
                            error: error.clone(),
                        });
                        continue;
                    }
                    None => 0,
                };
                calls.push(script::call(&fence, &batches[i], deadline));
                sending.push((i, fence, source));
            }
            let replies = if calls.is_empty() {
                Vec::new()
            } else {
                self.conn.run_each(calls, self.limit).await
            };
            let mut again = Vec::new();
            for ((i, fence, source), reply) in sending.into_iter().zip(replies) {
                let reply = match reply {
                    Some(r) => r.map_err(PublishError::from_redis),
                    None => Err(PublishError::timed_out(self.limit)),
                };
                out[i] = Some(match reply {
                    Ok(v) => {
                        // A reply that cannot be read fails its own call, not the others.
                        let outcome = script::parse_reply(v, &fence).unwrap_or_else(|error| {
                            StreamOutcome::Failed {
                                ids: Vec::new(),
                                error,
                            }
                        });
                        if matches!(&outcome, StreamOutcome::Failed { error, .. } if error.is_late())
                        {
                            // Maybe a server with another clock now: read it again.
                            self.clock.forget(source);
                        }
                        outcome
                    }
                    Err(error) => {
                        if error.is_noscript() && !loaded {
                            again.push((i, fence));
                            continue;
                        }
                        StreamOutcome::Failed {
                            ids: Vec::new(),
                            error,
                        }
                    }
                });
            }
            if !again.is_empty() {
                script::load(&mut self.conn.clone()).await?;
                loaded = true;
            }
            todo = again;
        }
        // Nothing went through anywhere (Redis down, every node refusing): one error for all.
        let refused = |o: &Option<StreamOutcome>| {
            matches!(o, Some(StreamOutcome::Failed { ids, error })
                if ids.is_empty() && error.class() == ErrorClass::Transient)
        };
        if out.iter().all(refused)
            && let Some(Some(StreamOutcome::Failed { error, .. })) = out.first()
        {
            return Err(error.clone());
        }
        Ok(out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| StreamOutcome::Failed {
                    ids: Vec::new(),
                    error: PublishError::event("PROTOCOL", "no reply for this stream"),
                })
            })
            .collect())
    }
}
