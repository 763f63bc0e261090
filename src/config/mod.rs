//! Typed configuration for Outpost, loaded with [figment].
//!
//! # Layering
//!
//! Each layer overrides the ones before it, key by key:
//!
//! 1. **Built-in defaults** ([`Config::default`]). They contain no endpoints:
//!    `database.url` and `redis.url` are unset, and the commands that need them
//!    ask for them with [`DatabaseConfig::url`] / [`RedisConfig::url`].
//! 2. **A TOML file**: the path given with `--config` ([`LoadOptions::file`],
//!    which must exist), otherwise `config/outpost.toml` relative to the working
//!    directory when it exists. `config/outpost.example.toml` documents every key.
//! 3. **Environment variables** `OUTPOST_<SECTION>__<KEY>`, e.g.
//!    `OUTPOST_DATABASE__URL` sets `database.url` and `OUTPOST_RELAY__BATCH_ROWS`
//!    sets `relay.batch_rows`. Section and key names are case-insensitive; an
//!    entry of `routing.overrides` keeps its case
//!    (`OUTPOST_ROUTING__OVERRIDES__OrderPlaced=none`). Lists accept `a,b,c`.
//! 4. **Flag overrides**: `(key path, value)` pairs from the command line
//!    (`--set relay.batch_rows=500`, `--node-id` as `node.id`).
//!
//! Values from the environment and flags are strings; they are typed by the key
//! they set (a string key keeps `123` as the string `"123"`).
//!
//! # Errors
//!
//! [`load`] reports every problem at once in [`ConfigErrors`]: unknown keys from
//! any layer (including stray `OUTPOST_*` variables), type errors (each section
//! is deserialized separately, and a bad key is dropped and the section retried,
//! so one mistake does not hide the next), and out-of-range or inconsistent
//! values. Each [`Problem`] names where the value came from: `file:line`, the
//! environment variable, or the flag.
//!
//! # Secrets
//!
//! The connection URLs are [`Secret`]s: they print with their password replaced
//! by `***`, and no problem message ever contains their value.

mod error;
mod layers;
mod load;
mod schema;
mod secret;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use error::{ConfigErrors, Problem};
pub use load::{LoadOptions, load};
pub use secret::{REDACTED, Secret};

/// The file read when `--config` is not given, relative to the working directory.
pub const DEFAULT_FILE: &str = "config/outpost.toml";

/// Prefix of the environment variables read by [`load`].
pub const ENV_PREFIX: &str = "OUTPOST_";

/// The value of a `routing.overrides` entry meaning "this event type has no
/// destination".
pub const NO_DESTINATION: &str = "none";

/// The placeholders a stream template may use.
pub const TEMPLATE_PLACEHOLDERS: &[&str] = &["aggregate_type", "event_type", "partition"];

/// The whole configuration. See the [module documentation](self) for how it is
/// loaded and `config/outpost.example.toml` for every key.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[database]`: the Postgres database holding the outbox.
    pub database: DatabaseConfig,
    /// `[redis]`: the Redis server the events are published to.
    pub redis: RedisConfig,
    /// `[node]`: this relay process among its peers.
    pub node: NodeConfig,
    /// `[admin]`: the admin/metrics HTTP endpoint.
    pub admin: AdminConfig,
    /// `[producer]`: limits enforced on what producers write.
    pub producer: ProducerConfig,
    /// `[relay]`: the publishing loop.
    pub relay: RelayConfig,
    /// `[routing]`: which stream each event goes to.
    pub routing: RoutingConfig,
    /// `[rate_limit]`: publishing rate limits.
    pub rate_limit: RateLimitConfig,
    /// `[retention]`: ageing rows out of the outbox, trimming streams, re-publishing after a
    /// Redis data loss.
    pub retention: RetentionConfig,
    /// `[log]`: logging.
    pub log: LogConfig,
}

/// `[database]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `postgres://` or `postgresql://` URL; unset by default.
    pub url: Option<Secret>,
    /// Connections in the pool, 1..=512.
    pub pool_size: u32,
    /// Connection timeout in milliseconds, 100..=600000.
    pub connect_timeout_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: None,
            pool_size: 16,
            connect_timeout_ms: 5000,
        }
    }
}

impl DatabaseConfig {
    /// The database URL, or an error telling how to set it.
    pub fn url(&self) -> Result<&Secret, ConfigErrors> {
        self.url.as_ref().ok_or_else(|| not_set("database.url"))
    }

    /// `connect_timeout_ms` as a [`Duration`].
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
}

/// `[redis]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` URL; unset by default.
    pub url: Option<Secret>,
    /// Prepended to every Redis key Outpost writes; at most 64 characters.
    pub key_prefix: String,
    /// Connection timeout in milliseconds, 100..=600000.
    pub connect_timeout_ms: u64,
    /// Timeout of one command in milliseconds, 100..=600000.
    pub response_timeout_ms: u64,
    /// What to do when Redis may evict keys (`maxmemory-policy` other than `noeviction`):
    /// [`REFUSE`] (the node does not start, `/readyz` says not ready) or [`WARN`].
    pub maxmemory_policy_check: String,
    /// `url` names a node of a Redis Cluster (not a single Redis).
    pub cluster: bool,
    /// More cluster nodes (`host:port`) to learn the layout from when `url`'s is down.
    pub cluster_seeds: Vec<String>,
}

/// `redis.maxmemory_policy_check`: refuse to run against a Redis that may evict keys.
pub const REFUSE: &str = "refuse";
/// `redis.maxmemory_policy_check`: run, but log a warning and report it.
pub const WARN: &str = "warn";

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            key_prefix: String::new(),
            connect_timeout_ms: 5000,
            response_timeout_ms: 5000,
            maxmemory_policy_check: REFUSE.to_owned(),
            cluster: false,
            cluster_seeds: Vec::new(),
        }
    }
}

impl RedisConfig {
    /// The Redis URL, or an error telling how to set it.
    pub fn url(&self) -> Result<&Secret, ConfigErrors> {
        self.url.as_ref().ok_or_else(|| not_set("redis.url"))
    }

    /// `connect_timeout_ms` as a [`Duration`].
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// A single Redis, or a cluster with its extra seed nodes.
    pub fn topology(&self) -> crate::publish::Topology {
        if self.cluster {
            crate::publish::Topology::Cluster {
                seeds: self.cluster_seeds.clone(),
            }
        } else {
            crate::publish::Topology::Single
        }
    }

    /// `response_timeout_ms` as a [`Duration`].
    pub fn response_timeout(&self) -> Duration {
        Duration::from_millis(self.response_timeout_ms)
    }

    /// `key` with [`key_prefix`](Self::key_prefix) prepended.
    pub fn key(&self, key: &str) -> String {
        format!("{}{key}", self.key_prefix)
    }
}

fn not_set(key: &str) -> ConfigErrors {
    ConfigErrors::one(
        key,
        "default",
        format!(
            "{key} is not set: set it in {DEFAULT_FILE} or {}",
            layers::env_var_name(key)
        ),
    )
}

/// `[node]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// This node's id; `""` means "derive from hostname and pid at start".
    pub id: String,
    /// Heartbeat interval in milliseconds, 100..=60000.
    pub heartbeat_ms: u64,
    /// Lease duration in milliseconds; at least 3 × `heartbeat_ms`.
    pub lease_ms: u64,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            id: String::new(),
            heartbeat_ms: 1000,
            lease_ms: 10_000,
        }
    }
}

impl NodeConfig {
    /// The configured id, or `None` when it is to be derived at start.
    pub fn configured_id(&self) -> Option<&str> {
        (!self.id.is_empty()).then_some(self.id.as_str())
    }

    /// `heartbeat_ms` as a [`Duration`].
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }

    /// `lease_ms` as a [`Duration`].
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
}

/// `[admin]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin/metrics HTTP endpoint, `ip:port`.
    pub listen: String,
    /// Sustained requests per second the JSON API allows each client address, and each token,
    /// before answering 429 with `Retry-After`.
    pub requests_per_sec: u32,
    /// Requests a client address or a token may send at once above the sustained rate.
    pub burst: u32,
    /// Largest request body the JSON API reads; a larger one is answered 413.
    pub max_body_bytes: u32,
    /// Marks the panel's session cookie `Secure` (sent over HTTPS only). Set it whenever TLS is
    /// in front of the endpoint; without TLS a `Secure` cookie is never sent back and nobody
    /// can log in.
    pub cookie_secure: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9400".to_owned(),
            requests_per_sec: 20,
            burst: 40,
            max_body_bytes: 65_536,
            cookie_secure: false,
        }
    }
}

impl AdminConfig {
    /// `listen` as a socket address ([`load`] has checked that it parses).
    pub fn listen_addr(&self) -> Result<SocketAddr, std::net::AddrParseError> {
        self.listen.parse()
    }
}

/// `[producer]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProducerConfig {
    /// Largest accepted event payload in bytes, 1..=262144: the producer API's own check, which
    /// may only lower the database's limit (`store::MAX_PAYLOAD_BYTES`).
    pub max_payload_bytes: usize,
    /// Largest accepted headers in bytes, 1..=65536.
    pub max_header_bytes: usize,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        Self {
            max_payload_bytes: crate::store::MAX_PAYLOAD_BYTES,
            max_header_bytes: 8192,
        }
    }
}

/// `[relay]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Rows claimed per batch, 1..=10000.
    pub batch_rows: u32,
    /// Payload and header bytes per batch, as the relay loads them (JSON text, uncompressed),
    /// 1024..=67108864.
    pub batch_bytes: usize,
    /// Batches a worker runs at once (claim to mark); bounds memory and database concurrency.
    pub max_in_flight: u32,
    /// Publishing workers; 0 means the number of cores. 0..=64.
    pub workers: u32,
    /// Poll interval while the node is busy, in milliseconds, 1..=1000. An idle node's scheduled
    /// poll is its heartbeat.
    pub busy_poll_ms: u64,
    /// Time without work before asking producers for a nudge, ms, 1..=60000.
    pub idle_after_ms: u64,
    /// Publishing attempts before an event is given up on, 1..=1000 (failures that can never
    /// succeed give up at the first; transient ones count none).
    pub max_attempts: u32,
    /// First retry delay in milliseconds, 1..=3600000.
    pub backoff_base_ms: u64,
    /// Largest retry delay in milliseconds; at least `backoff_base_ms`.
    pub backoff_max_ms: u64,
    /// Largest delay after a transient (connection) error, ms, 10..=600000.
    pub transient_backoff_max_ms: u64,
    /// Delete rows once published instead of marking them.
    pub delete_published: bool,
    /// Time given to in-flight work at shutdown, ms, 100..=600000.
    pub shutdown_timeout_ms: u64,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch_rows: 500,
            batch_bytes: 4_194_304,
            max_in_flight: 4,
            workers: 0,
            busy_poll_ms: 1,
            idle_after_ms: 20,
            max_attempts: 10,
            backoff_base_ms: 500,
            backoff_max_ms: 300_000,
            transient_backoff_max_ms: 10_000,
            delete_published: false,
            shutdown_timeout_ms: 10_000,
        }
    }
}

impl RelayConfig {
    /// The number of workers: `workers`, or the number of cores when it is 0.
    pub fn effective_workers(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            n => n as usize,
        }
    }

    /// `busy_poll_ms` as a [`Duration`].
    pub fn busy_poll(&self) -> Duration {
        Duration::from_millis(self.busy_poll_ms)
    }

    /// `idle_after_ms` as a [`Duration`].
    pub fn idle_after(&self) -> Duration {
        Duration::from_millis(self.idle_after_ms)
    }

    /// `backoff_base_ms` as a [`Duration`].
    pub fn backoff_base(&self) -> Duration {
        Duration::from_millis(self.backoff_base_ms)
    }

    /// `backoff_max_ms` as a [`Duration`].
    pub fn backoff_max(&self) -> Duration {
        Duration::from_millis(self.backoff_max_ms)
    }

    /// `transient_backoff_max_ms` as a [`Duration`].
    pub fn transient_backoff_max(&self) -> Duration {
        Duration::from_millis(self.transient_backoff_max_ms)
    }

    /// `shutdown_timeout_ms` as a [`Duration`].
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }
}

/// `[routing]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// Stream template; placeholders [`TEMPLATE_PLACEHOLDERS`].
    pub stream: String,
    /// Event type → stream template, or [`NO_DESTINATION`].
    pub overrides: BTreeMap<String, String>,
    /// Event types that have no destination.
    pub no_destination: Vec<String>,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            stream: "events:{aggregate_type}".to_owned(),
            overrides: BTreeMap::new(),
            no_destination: Vec::new(),
        }
    }
}

impl RoutingConfig {
    /// The stream template for `event_type`, or `None` when it has no
    /// destination (listed in `no_destination` or overridden with `"none"`).
    pub fn template_for(&self, event_type: &str) -> Option<&str> {
        if self.no_destination.iter().any(|e| e == event_type) {
            return None;
        }
        match self.overrides.get(event_type) {
            Some(t) if t == NO_DESTINATION => None,
            Some(t) => Some(t),
            None => Some(&self.stream),
        }
    }
}

/// `[rate_limit]`
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimitConfig {
    /// Events per second over all streams; 0 means unlimited.
    pub global_per_sec: u32,
    /// Events per second per stream; 0 means unlimited.
    pub per_stream_per_sec: u32,
    /// Burst size; 0 means "same as the rate".
    pub burst: u32,
    /// Events per second of named streams (the name a route gives, without the key prefix),
    /// instead of `per_stream_per_sec`; 0 makes a stream unlimited.
    pub streams: BTreeMap<String, u32>,
}

impl RateLimitConfig {
    /// The global rate, `None` when unlimited.
    pub fn global(&self) -> Option<NonZeroU32> {
        NonZeroU32::new(self.global_per_sec)
    }

    /// The per-stream rate, `None` when unlimited.
    pub fn per_stream(&self) -> Option<NonZeroU32> {
        NonZeroU32::new(self.per_stream_per_sec)
    }

    /// The burst to use with `rate`: `burst`, or `rate` itself when `burst` is 0.
    pub fn burst_for(&self, rate: NonZeroU32) -> NonZeroU32 {
        NonZeroU32::new(self.burst).unwrap_or(rate)
    }
}

/// `[retention]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Run the janitor (deletes rows past their window).
    pub enabled: bool,
    /// Seconds a published row is kept after publishing.
    pub published_secs: u64,
    /// Seconds a `no_destination` row is kept after it was recorded (90 days by default).
    pub no_destination_secs: u64,
    /// Seconds a `discarded` row is kept after it was discarded.
    pub discarded_secs: u64,
    /// Rows deleted per statement.
    pub batch_rows: u32,
    /// Pause between two delete statements, ms.
    pub batch_pause_ms: u64,
    /// Time between two janitor runs, ms.
    pub interval_ms: u64,
    /// `VACUUM` the outbox table after a janitor run that deleted rows (for databases where
    /// autovacuum is off or does not keep up).
    pub vacuum: bool,
    /// Seconds of published rows re-published after Redis lost data; 0 = alert only.
    pub republish_window_secs: u64,
    /// Trim streams below what every consumer group has acknowledged.
    pub trim_streams: bool,
    /// Time between two trimming rounds, ms.
    pub trim_interval_ms: u64,
    /// Streams without consumer groups: trim entries older than this many seconds; 0 = never.
    pub trim_ungrouped_after_secs: u64,
    /// Hard cap of entries per stream, dropping unacknowledged entries (logged); 0 = no cap.
    pub stream_max_len: u64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            published_secs: 86_400,
            no_destination_secs: 7_776_000,
            discarded_secs: 2_592_000,
            batch_rows: 1000,
            batch_pause_ms: 50,
            interval_ms: 60_000,
            vacuum: false,
            republish_window_secs: 3600,
            trim_streams: true,
            trim_interval_ms: 60_000,
            trim_ungrouped_after_secs: 0,
            stream_max_len: 0,
        }
    }
}

impl RetentionConfig {
    /// `batch_pause_ms` as a [`Duration`].
    pub fn batch_pause(&self) -> Duration {
        Duration::from_millis(self.batch_pause_ms)
    }

    /// `interval_ms` as a [`Duration`].
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// `trim_interval_ms` as a [`Duration`].
    pub fn trim_interval(&self) -> Duration {
        Duration::from_millis(self.trim_interval_ms)
    }
}

/// `[log]`
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A `tracing` `EnvFilter` directive.
    pub level: String,
    /// `text` or `json`.
    pub format: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: "info".to_owned(),
            format: "text".to_owned(),
        }
    }
}

impl LogConfig {
    /// Whether logs are written as JSON lines.
    pub fn is_json(&self) -> bool {
        self.format == "json"
    }
}

impl Config {
    /// Checks ranges and consistency; problems name `effective configuration`
    /// as their source. [`load`] runs the same checks and names the real sources.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let problems: Vec<Problem> = validate::check(self)
            .into_iter()
            .map(|issue| Problem {
                message: format!("{} {}", issue.key(), issue.message)
                    .trim()
                    .to_owned(),
                key: issue.key(),
                source: "effective configuration".to_owned(),
            })
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors { problems })
        }
    }

    /// A copy with every secret redacted (passwords replaced by `***`), safe to show.
    pub fn redacted(&self) -> Config {
        let mut shown = self.clone();
        shown.database.url = self
            .database
            .url
            .as_ref()
            .map(|s| Secret::new(s.redacted()));
        shown.redis.url = self.redis.url.as_ref().map(|s| Secret::new(s.redacted()));
        shown
    }

    /// The effective configuration as TOML, every key included, with the
    /// passwords of `database.url` and `redis.url` replaced by `***`. An unset
    /// URL is shown as a comment.
    pub fn to_redacted_toml(&self) -> String {
        let shown = self.redacted();
        let body = match toml::to_string(&shown) {
            Ok(body) => body,
            // Strings, integers, booleans, a list and a map of strings always
            // serialize to TOML; say so rather than panic if that ever changes.
            Err(e) => return format!("# cannot render the configuration as TOML: {e}\n"),
        };
        let mut out = String::from("# Effective Outpost configuration (secrets redacted)\n");
        for line in body.lines() {
            out.push_str(line);
            out.push('\n');
            let unset = match line {
                "[database]" if self.database.url.is_none() => Some("database.url"),
                "[redis]" if self.redis.url.is_none() => Some("redis.url"),
                _ => None,
            };
            if let Some(key) = unset {
                out.push_str(&format!(
                    "# url is not set (set it in {DEFAULT_FILE} or {})\n",
                    layers::env_var_name(key)
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use figment::value::Value;

    use super::*;

    fn keys_of(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
        if let Value::Dict(_, dict) = value {
            for (k, v) in dict {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if prefix.is_empty() {
                    keys_of(v, &key, out);
                } else {
                    out.insert(key);
                }
            }
        }
    }

    #[test]
    fn schema_lists_exactly_the_struct_fields() {
        let mut config = Config::default();
        config.database.url = Some(Secret::new("postgres://h/db"));
        config.redis.url = Some(Secret::new("redis://h"));
        let value = Value::serialize(&config).expect("serializes");
        let mut from_struct = BTreeSet::new();
        keys_of(&value, "", &mut from_struct);
        let from_schema: BTreeSet<String> = schema::FIELDS.iter().map(schema::Field::key).collect();
        assert_eq!(from_struct, from_schema);
        let sections: BTreeSet<&str> = schema::FIELDS.iter().map(|f| f.section).collect();
        assert_eq!(sections, schema::SECTIONS.iter().copied().collect());
    }

    #[test]
    fn example_file_names_every_key() {
        let text = include_str!("../../config/outpost.example.toml");
        let doc: toml::Table = toml::from_str(text).expect("example parses");
        for field in schema::FIELDS {
            let present = doc
                .get(field.section)
                .and_then(|s| s.as_table())
                .is_some_and(|s| s.contains_key(field.name));
            // The URLs have no default, so they appear commented out.
            let commented = text.contains(&format!("# {} = ", field.name));
            assert!(
                present || commented,
                "{} missing from the example",
                field.key()
            );
        }
    }

    #[test]
    fn url_accessors_explain_how_to_set() {
        let config = Config::default();
        let err = config.database.url().expect_err("unset");
        assert_eq!(
            err.problems[0].message,
            "database.url is not set: set it in config/outpost.toml or OUTPOST_DATABASE__URL"
        );
        let err = config.redis.url().expect_err("unset");
        assert_eq!(
            err.problems[0].message,
            "redis.url is not set: set it in config/outpost.toml or OUTPOST_REDIS__URL"
        );
    }

    #[test]
    fn routing_template_for() {
        let mut r = RoutingConfig::default();
        r.overrides.insert("A".into(), "a:{event_type}".into());
        r.overrides.insert("B".into(), NO_DESTINATION.into());
        r.no_destination.push("C".into());
        assert_eq!(r.template_for("A"), Some("a:{event_type}"));
        assert_eq!(r.template_for("B"), None);
        assert_eq!(r.template_for("C"), None);
        assert_eq!(r.template_for("D"), Some("events:{aggregate_type}"));
    }
}
