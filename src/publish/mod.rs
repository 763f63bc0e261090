//! Publishing to Redis Streams. This module never touches the database.
//!
//! A batch is a list of [`StreamBatch`]es, one per stream. Each is appended by one call of a Lua
//! script that first checks the partition's fencing epoch at Redis (a hash field next to the
//! stream, in the same hash slot) and only then runs the `XADD`s — atomically, so a node that lost
//! its lease cannot append behind the new owner's entries. The calls of one batch are pipelined.

mod entry;
mod error;
mod recover;
mod script;
mod server;
mod trim;

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Value};

pub use entry::{Message, entry_fields, field};
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
    /// The entries' fields, one `Vec` of `(name, value)` per entry.
    pub entries: Vec<Vec<(&'static str, String)>>,
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
    /// The stream is known to have been written, but its fence hash is gone: Redis lost its data
    /// (restarted empty, failed over to a replica without it, evicted it). Nothing appended.
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
}

/// A publishing connection (multiplexed, reconnecting by itself).
#[derive(Clone)]
pub struct Publisher {
    conn: ConnectionManager,
    prefix: String,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl Publisher {
    /// Connects. Fails when Redis cannot be reached within the connect timeout.
    pub async fn connect(settings: &RedisSettings) -> Result<Self, PublishError> {
        let client = Client::open(settings.url.as_str())
            .map_err(|e| PublishError::config(format!("redis.url is not usable: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.connect_timeout))
            .set_response_timeout(Some(settings.response_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(PublishError::from_redis)?;
        Ok(Self {
            conn,
            prefix: settings.key_prefix.clone(),
        })
    }

    /// The full key of a stream name.
    pub fn stream_key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The fence key of a stream: a hash (partition → epoch) whose hash tag is the stream key, so
    /// both land in the same Redis Cluster slot.
    pub fn fence_key(&self, stream_key: &str) -> String {
        format!("{}outpost:fence:{{{stream_key}}}", self.prefix)
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

    /// Appends every batch, each fenced by its partition's epoch, in one pipelined call. An
    /// `Err` means the outcome of the whole call is unknown (connection lost, timeout): some
    /// entries may have been appended.
    pub async fn publish(
        &self,
        batches: &[StreamBatch],
    ) -> Result<Vec<StreamOutcome>, PublishError> {
        if batches.is_empty() {
            return Ok(Vec::new());
        }
        let mut c = self.conn.clone();
        let replies = match self.run(&mut c, batches).await {
            Err(e) if e.is_noscript() => {
                script::load(&mut c).await?;
                self.run(&mut c, batches).await?
            }
            other => other?,
        };
        Ok(replies)
    }

    async fn run(
        &self,
        c: &mut ConnectionManager,
        batches: &[StreamBatch],
    ) -> Result<Vec<StreamOutcome>, PublishError> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for b in batches {
            pipe.add_command(script::call(
                &self.fence_key(&b.stream),
                &b.stream,
                b.partition,
                b.epoch,
                b.known,
                &b.entries,
            ));
        }
        let replies: Vec<redis::RedisResult<Value>> = pipe
            .query_async(c)
            .await
            .map_err(PublishError::from_redis)?;
        let mut out = Vec::with_capacity(replies.len());
        for reply in replies {
            match reply {
                Ok(v) => out.push(script::parse_reply(v)?),
                Err(e) => {
                    let err = PublishError::from_redis(e);
                    if err.class() == ErrorClass::Permanent {
                        out.push(StreamOutcome::Failed {
                            ids: Vec::new(),
                            error: err,
                        });
                    } else {
                        // NOSCRIPT, OOM, LOADING, a cluster redirect...: the call as a whole
                        // must be retried.
                        return Err(err);
                    }
                }
            }
        }
        Ok(out)
    }
}
