//! The scratch space every benchmark works in: a database of its own on the server of
//! `database.url` (dropped and created at the start, dropped at the end) and a Redis key prefix
//! of its own (`bench:<random>:`, whose keys are deleted at the end), never the configured
//! database or keys.

use std::time::Duration;

use anyhow::Context;
use redis::aio::MultiplexedConnection;

use crate::config::Config;
use crate::store::{self, ConnectSettings, Store, admin};

/// A benchmark's database and Redis prefix.
pub(super) struct Scratch {
    server: String,
    db_name: &'static str,
    /// The scratch database's URL.
    pub url: String,
    /// `redis.url`.
    pub redis_url: String,
    /// A client on it, for extra connections.
    pub redis: redis::Client,
    /// A connection with a generous response timeout.
    pub rconn: MultiplexedConnection,
    /// The benchmark's key prefix.
    pub prefix: String,
}

impl Scratch {
    /// Creates the scratch database `db_name` (dropping a leftover one) and picks a prefix.
    pub async fn create(config: &Config, db_name: &'static str) -> anyhow::Result<Self> {
        let server = config.database.url()?.expose().to_owned();
        let redis_url = config.redis.url()?.expose().to_owned();
        let redis = crate::publish::connection_info(&redis_url)
            .and_then(redis::Client::open)
            .context("redis.url is not usable")?;
        let rconn = redis_conn(&redis).await?;
        admin::drop_database(&server, db_name).await?;
        admin::create_database(&server, db_name, None).await?;
        Ok(Self {
            url: admin::database_url(&server, db_name)?,
            server,
            db_name,
            redis_url,
            redis,
            rconn,
            prefix: format!(
                "bench:{}:",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ),
        })
    }

    /// A migrated pool of `pool_size` on the scratch database.
    pub async fn store(&self, pool_size: u32, bench: &str) -> anyhow::Result<Store> {
        let store = Store::connect(&ConnectSettings::new(
            self.url.clone(),
            format!("outpost bench {bench}"),
            pool_size,
        ))
        .await?;
        store::migrate_up(&store).await?;
        Ok(store)
    }

    /// Deletes the prefix's keys and drops the database, whatever `outcome` was; a failed
    /// benchmark's error is the one reported.
    pub async fn finish<T>(mut self, outcome: anyhow::Result<T>) -> anyhow::Result<T> {
        let keys = delete_prefix_keys(&mut self.rconn, &self.prefix).await;
        let dropped = admin::drop_database(&self.server, self.db_name).await;
        let value = outcome?;
        keys?;
        dropped?;
        Ok(value)
    }
}

/// Runs a benchmark's parts until they end or the user interrupts them, then closes `store`'s
/// pool: the caller's cleanup ([`Scratch::finish`]) runs either way.
pub(super) async fn until_interrupted(
    parts: impl std::future::Future<Output = anyhow::Result<()>>,
    store: &Store,
) -> anyhow::Result<()> {
    let outcome = tokio::select! {
        r = parts => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted; cleaned up")),
    };
    store.connection().clone().close().await.ok();
    outcome
}

/// A connection whose replies may take a minute (benchmarks send large commands).
pub(super) async fn redis_conn(client: &redis::Client) -> anyhow::Result<MultiplexedConnection> {
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(60)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .context("connecting to Redis")
}

pub(super) async fn scan_keys(
    conn: &mut MultiplexedConnection,
    pattern: &str,
) -> anyhow::Result<Vec<String>> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// Deletes every key under `prefix` (SCAN + DEL).
pub(super) async fn delete_prefix_keys(
    conn: &mut MultiplexedConnection,
    prefix: &str,
) -> anyhow::Result<()> {
    let keys = scan_keys(conn, &format!("{prefix}*")).await?;
    for chunk in keys.chunks(500) {
        let _: u64 = redis::cmd("DEL").arg(chunk).query_async(conn).await?;
    }
    Ok(())
}
