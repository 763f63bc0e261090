//! One connection type for a single Redis and for a Redis Cluster.
//!
//! On a single Redis it is a [`ConnectionManager`] (multiplexed, reconnecting by itself). On a
//! cluster it is the redis crate's cluster connection, which learns the slot map from any seed
//! node, follows `MOVED` and `ASK` redirects, retries `TRYAGAIN` (a multi-key command met a slot
//! half-way through a migration) and refreshes the map after a failover.
//!
//! A cluster refuses a pipeline whose commands live in different hash slots, and its client
//! retries a whole pipeline when one command in it is redirected (running the others twice), so
//! [`RedisConn::run_each`] sends a batch's commands one by one, all at once, on a cluster. Every
//! key Outpost writes next to a stream (its fence, the consumer helper's counts) shares the
//! stream's slot ([`companion_key`]), so one script can touch both.

use std::time::Duration;

use futures::future::join_all;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, Slot,
    SlotAddr,
};
use redis::{
    Client, Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisError,
    RedisFuture, RedisResult, Value,
};

/// A single Redis or a Redis Cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Topology {
    /// One Redis server (or a proxy in front of several).
    #[default]
    Single,
    /// A Redis Cluster. The URL names one of its nodes; `seeds` (`host:port`) name more, tried
    /// when that one is down at start. Credentials and TLS come from the URL.
    Cluster {
        /// More nodes to learn the cluster's layout from.
        seeds: Vec<String>,
    },
}

impl Topology {
    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster { .. })
    }
}

/// A connection to a single Redis or a Redis Cluster; cheap to clone (clones share it).
#[derive(Clone)]
pub enum RedisConn {
    /// A single Redis.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "RedisConn::Single",
            Self::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl RedisConn {
    /// Connects to `url` (and, on a cluster, learns every node's slots). Fails when Redis cannot
    /// be reached within `connect_timeout`.
    pub async fn connect(
        url: &str,
        topology: &Topology,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Self> {
        match topology {
            Topology::Single => {
                let client = Client::open(connection_info(url)?)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(Some(response_timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                Ok(Self::Single(
                    ConnectionManager::new_with_config(client, config).await?,
                ))
            }
            Topology::Cluster { seeds } => {
                let nodes = cluster_nodes(url, seeds)?;
                // How long a caller waits for a command, the client's retries included.
                let wait = response_timeout * 2;
                let client = ClusterClientBuilder::new(nodes)
                    .connection_timeout(connect_timeout)
                    // A command that got no answer is never sent again: the caller gives up
                    // on it (`wait`) before a try of it times out, and the client re-sends only
                    // commands whose caller still waits. Sent again, a command held by a paused
                    // or slow server would run twice when the server catches up, and a
                    // publish call's deadline refuses neither copy.
                    .response_timeout(wait + Duration::from_secs(1))
                    .overall_response_timeout(Some(wait))
                    // Redirects and TRYAGAIN during a slot migration are retried quickly; a
                    // cluster that stays down surfaces as an error within about a second, and
                    // the relay backs off on its own.
                    .retries(6)
                    .min_retry_wait(10)
                    .max_retry_wait(500)
                    .build()?;
                Ok(Self::Cluster(client.get_async_connection().await?))
            }
        }
    }

    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// Runs `cmds` and returns each command's result in the order given, `None` for a command
    /// with no answer within `limit`. On a single Redis they go as one pipeline, which runs them
    /// in order; a pipeline that failed or timed out as a whole (connection lost) gives that to
    /// each command. On a cluster each command is sent on its own, all at once (the connection
    /// to each master still pipelines them on the wire), in no promised order, and each has its
    /// own `limit`: a master that does not answer costs only its own commands, and the answers
    /// of the others are kept (given up on, calls that ran would run again). One pipeline is
    /// not used on a cluster because the cluster client retries a whole pipeline when one of its
    /// commands is redirected, which would run the others twice — for the publish script,
    /// append their entries twice.
    pub async fn run_each(
        &self,
        cmds: Vec<Cmd>,
        limit: Duration,
    ) -> Vec<Option<RedisResult<Value>>> {
        match self {
            Self::Single(c) => {
                let n = cmds.len();
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for cmd in cmds {
                    pipe.add_command(cmd);
                }
                let mut conn = c.clone();
                let replies = tokio::time::timeout(
                    limit,
                    pipe.query_async::<Vec<RedisResult<Value>>>(&mut conn),
                )
                .await;
                match replies {
                    Ok(Ok(replies)) if replies.len() == n => {
                        replies.into_iter().map(Some).collect()
                    }
                    Ok(Ok(_)) => (0..n)
                        .map(|_| {
                            Some(Err(RedisError::from((
                                redis::ErrorKind::Client,
                                "a pipeline returned fewer replies than commands",
                            ))))
                        })
                        .collect(),
                    Ok(Err(e)) => (0..n).map(|_| Some(Err(e.clone()))).collect(),
                    Err(_) => (0..n).map(|_| None).collect(),
                }
            }
            Self::Cluster(c) => {
                join_all(cmds.iter().map(|cmd| {
                    let mut conn = c.clone();
                    async move {
                        tokio::time::timeout(limit, cmd.query_async::<Value>(&mut conn))
                            .await
                            .ok()
                    }
                }))
                .await
            }
        }
    }

    /// `TIME`: `[seconds, microseconds]` of Redis's clock; on a cluster, of the primary holding
    /// `slot` (any primary without one).
    pub async fn time(&self, slot: Option<Slot>) -> RedisResult<Vec<String>> {
        let cmd = redis::cmd("TIME");
        match self {
            Self::Single(c) => cmd.query_async(&mut c.clone()).await,
            Self::Cluster(c) => {
                let node = match slot {
                    Some(slot) => SingleNodeRoutingInfo::SpecificNode(Route::with_slot(
                        slot,
                        SlotAddr::Master,
                    )),
                    None => SingleNodeRoutingInfo::RandomPrimary,
                };
                let reply = c
                    .clone()
                    .route_command(cmd, RoutingInfo::SingleNode(node))
                    .await?;
                Ok(redis::from_redis_value(reply)?)
            }
        }
    }

    /// `INFO <sections>` from every primary: `(address, text)` per node. On a single Redis the
    /// address is empty.
    pub async fn info_all(&self, sections: &[&str]) -> RedisResult<Vec<(String, String)>> {
        let mut cmd = redis::cmd("INFO");
        for s in sections {
            cmd.arg(*s);
        }
        match self {
            Self::Single(c) => {
                let text: String = cmd.query_async(&mut c.clone()).await?;
                Ok(vec![(String::new(), text)])
            }
            Self::Cluster(c) => {
                let reply = c
                    .clone()
                    .route_command(
                        cmd,
                        RoutingInfo::MultiNode((
                            MultipleNodeRoutingInfo::AllMasters,
                            Some(ResponsePolicy::Special),
                        )),
                    )
                    .await?;
                let pairs = match reply {
                    Value::Map(pairs) => pairs,
                    other => {
                        return Err(RedisError::from((
                            redis::ErrorKind::Parse,
                            "INFO on every primary did not answer per node",
                            format!("{other:?}"),
                        )));
                    }
                };
                let mut out = Vec::with_capacity(pairs.len());
                for (addr, text) in pairs {
                    if let Value::ServerError(e) = text {
                        return Err(e.into());
                    }
                    out.push((
                        redis::from_redis_value::<String>(addr)?,
                        redis::from_redis_value::<String>(text)?,
                    ));
                }
                out.sort();
                Ok(out)
            }
        }
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// The connection settings of `url`, with `TCP_NODELAY` set (the redis crate leaves Nagle's
/// algorithm on). Without it the kernel may hold back the last, partly filled segment of a large
/// write until the previous one is acknowledged, and Redis, having no reply to send before the
/// whole command arrived, may delay that acknowledgement by up to 40 ms: a batch's pipeline of
/// `XADD`s could stall for that long.
pub fn connection_info(url: &str) -> RedisResult<ConnectionInfo> {
    let info = url.into_connection_info()?;
    let tcp = info.tcp_settings().clone().set_nodelay(true);
    Ok(info.set_tcp_settings(tcp))
}

/// The cluster's seed nodes: `url` first, then each `host:port` of `seeds` with the URL's
/// credentials and settings.
fn cluster_nodes(url: &str, seeds: &[String]) -> RedisResult<Vec<redis::ConnectionInfo>> {
    let first = connection_info(url)?;
    let mut nodes = vec![first.clone()];
    for seed in seeds {
        let (host, port) = parse_seed(seed).map_err(|message| {
            RedisError::from((redis::ErrorKind::InvalidClientConfig, "bad seed", message))
        })?;
        let addr = match first.addr() {
            ConnectionAddr::Tcp(..) => ConnectionAddr::Tcp(host, port),
            _ => {
                return Err(RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "cluster seeds need a redis:// URL",
                )));
            }
        };
        nodes.push(first.clone().set_addr(addr));
    }
    Ok(nodes)
}

/// Parses `host:port` (IPv6 hosts in brackets: `[::1]:7000`).
pub fn parse_seed(seed: &str) -> Result<(String, u16), String> {
    let bad = || format!("{seed:?} is not host:port (e.g. 10.0.0.2:6379 or [::1]:6379)");
    let (host, port) = seed.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() || host.contains(['/', '@', ' ']) {
        return Err(bad());
    }
    let port: u16 = port.parse().map_err(|_| bad())?;
    if port == 0 {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

/// The hash tag Redis Cluster hashes `key` by: the text between the first `{` and the first `}`
/// after it, when not empty; `None` when the whole key is hashed.
pub fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let close = rest.find('}')?;
    (close > 0).then(|| &rest[..close])
}

/// A key of Outpost's own that lives next to `stream` (same hash slot on a cluster):
/// `<prefix>outpost:<kind>:{<stream>}`, or, when the stream key carries a hash tag of its own,
/// `<prefix>outpost:<kind>:{<tag>}:<stream>`. Errors when the stream key holds braces that do
/// not form a hash tag (no key name can then share its slot by construction).
pub fn companion_key(prefix: &str, kind: &str, stream: &str) -> Result<String, String> {
    if let Some(tag) = hash_tag(prefix) {
        // Every key starts with the prefix, whose tag decides the slot of all of them.
        return Ok(format!("{prefix}outpost:{kind}:{{{tag}}}:{stream}"));
    }
    if prefix.contains(['{', '}']) {
        return Err(format!(
            "the key prefix {prefix:?} holds braces that are not a hash tag; use none, or one \
             {{tag}} such as \"{{outpost}}:\""
        ));
    }
    match hash_tag(stream) {
        Some(tag) => Ok(format!("{prefix}outpost:{kind}:{{{tag}}}:{stream}")),
        None if stream.contains(['{', '}']) => Err(format!(
            "the stream key {stream:?} holds braces that are not a Redis Cluster hash tag; \
             remove them, or use one non-empty {{tag}}"
        )),
        None => Ok(format!("{prefix}outpost:{kind}:{{{stream}}}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_turn_nagle_off_and_keep_what_the_url_says() {
        let info = connection_info("redis://:secret@127.0.0.1:6390/3").expect("a redis URL");
        assert!(info.tcp_settings().nodelay());
        assert_eq!(
            info.addr(),
            &ConnectionAddr::Tcp("127.0.0.1".to_owned(), 6390)
        );
        assert_eq!(info.redis_settings().db(), 3);
        let seeds =
            cluster_nodes("redis://127.0.0.1:7000", &["127.0.0.1:7001".to_owned()]).expect("seeds");
        assert!(seeds.iter().all(|n| n.tcp_settings().nodelay()));
        assert!(connection_info("http://127.0.0.1").is_err());
    }

    #[test]
    fn companion_keys_share_the_stream_slot() {
        for (prefix, stream) in [
            ("", "orders"),
            ("t:1:", "t:1:events:order"),
            ("{app}:", "{app}:orders"),
            ("x{app}y:", "x{app}y:orders"),
            ("", "{orders}.events"),
            ("p:", "p:a{b}c"),
        ] {
            let key = companion_key(prefix, "fence", stream).expect(stream);
            assert!(key.starts_with(prefix), "{key}");
            assert_eq!(
                Slot::for_key(&key),
                Slot::for_key(stream),
                "{prefix} {stream}"
            );
        }
        // Distinct streams with the same tag get distinct companions.
        assert_ne!(
            companion_key("", "fence", "{t}a").expect("tagged"),
            companion_key("", "fence", "{t}b").expect("tagged")
        );
        assert!(companion_key("", "fence", "a}b").is_err());
        assert!(companion_key("", "fence", "{}x").is_err());
        assert!(companion_key("a}", "fence", "a}x").is_err());
    }

    #[test]
    fn the_plain_format_is_kept_for_keys_without_braces() {
        assert_eq!(
            companion_key("p:", "fence", "p:s").expect("plain"),
            "p:outpost:fence:{p:s}"
        );
    }

    #[test]
    fn seeds() {
        assert_eq!(parse_seed("10.0.0.2:7000"), Ok(("10.0.0.2".into(), 7000)));
        assert_eq!(parse_seed("[::1]:7000"), Ok(("::1".into(), 7000)));
        assert_eq!(parse_seed("redis-1:6379"), Ok(("redis-1".into(), 6379)));
        for bad in ["host", "host:0", ":6379", "host:x", "redis://h:1", "u@h:1"] {
            assert!(parse_seed(bad).is_err(), "{bad}");
        }
    }
}
