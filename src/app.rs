//! The composition root: a node built from its configuration — store, publisher, worker
//! arbiters, the supervisor, housekeeping, the admin endpoints — and its shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::thread::JoinHandle;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::config::Config;
use crate::dispatch::batch::{LeaseDeadline, Shared, Worker};
use crate::dispatch::cursor::Cursors;
use crate::dispatch::housekeeping;
use crate::dispatch::ratelimit::RateLimits;
use crate::dispatch::redis_loss;
use crate::dispatch::route::Router;
use crate::dispatch::settings::RelaySettings;
use crate::dispatch::streams::StreamBook;
use crate::dispatch::supervisor::{NodeSupervisor, OwnedPartitions, Shutdown, SupervisorSettings};
use crate::dispatch::wakeup::WakePolicy;
use crate::health::{Health, hostname};
use crate::publish::{PersistenceConfig, PublishError, Publisher, RedisSettings, ServerFacts};
use crate::store::{ConnectSettings, NodeInfo, Store, StoreError};

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A configuration value is missing or unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// The database could not be reached or is not migrated.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Redis could not be reached (the error says so, and which key to check).
    #[error(transparent)]
    Redis(#[from] PublishError),
    /// Redis is configured in a way that can lose acknowledged entries, and the configuration
    /// says to refuse it.
    #[error("{0}")]
    Preflight(String),
    /// The admin endpoint could not listen.
    #[error("cannot listen on admin.listen {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// The node's thread failed.
    #[error("the node's runtime failed: {0}")]
    Runtime(String),
}

/// A running node (in its own thread, with its own actix system).
#[derive(Debug)]
pub struct NodeHandle {
    node_id: String,
    system: System,
    supervisor: Addr<NodeSupervisor>,
    health: Arc<Health>,
    restarts: Arc<AtomicU64>,
    admin_addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl NodeHandle {
    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Readiness and liveness state.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Partition actors restarted after a panic so far.
    pub fn actor_restarts(&self) -> u64 {
        self.restarts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The admin endpoint's bound address (useful with port 0).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Partitions owned right now: `(partition, epoch, paused)`.
    pub async fn owned_partitions(&self) -> Vec<(i32, i64, bool)> {
        self.supervisor
            .send(OwnedPartitions)
            .await
            .unwrap_or_default()
    }

    /// Graceful shutdown: stop claiming, finish in-flight batches (up to
    /// `relay.shutdown_timeout_ms`), release every lease, deregister, stop the system.
    pub async fn shutdown(mut self) {
        let (tx, rx) = oneshot::channel();
        self.supervisor.do_send(Shutdown { done: tx });
        let _ = rx.await;
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }

    /// Stops the node's system at once, without releasing anything (a crash, for tests).
    pub fn kill(mut self) {
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The node id from configuration, or `<hostname>-<pid>`.
pub fn node_id(config: &Config) -> String {
    match config.node.configured_id() {
        Some(id) => id.to_owned(),
        None => format!("{}-{}", hostname(), std::process::id()),
    }
}

/// Starts a node in a thread of its own and returns once it is running (database and Redis
/// connected, node registered, admin endpoint listening).
pub fn start(config: &Config) -> Result<NodeHandle, NodeError> {
    let config = config.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("outpost-node".to_owned())
        .spawn(move || {
            let system = System::new();
            let started = system.block_on(boot(config));
            let ok = started.is_ok();
            let _ = tx.send(started.map(|parts| (parts, System::current())));
            if ok {
                // The runtime's context stays entered while the system stops and drops what its
                // tasks held: a database connection returned to its pool on drop spawns a task,
                // which panics outside a runtime.
                let handle = system.runtime().tokio_runtime().handle().clone();
                let _context = handle.enter();
                let _ = system.run();
            }
        })
        .map_err(|e| NodeError::Runtime(e.to_string()))?;
    let (parts, system) = rx.recv().map_err(|e| NodeError::Runtime(e.to_string()))??;
    Ok(NodeHandle {
        node_id: parts.node_id,
        system,
        supervisor: parts.supervisor,
        health: parts.health,
        restarts: parts.restarts,
        admin_addr: parts.admin_addr,
        thread: Some(thread),
    })
}

struct Booted {
    node_id: String,
    supervisor: Addr<NodeSupervisor>,
    health: Arc<Health>,
    restarts: Arc<AtomicU64>,
    admin_addr: SocketAddr,
}

async fn boot(config: Config) -> Result<Booted, NodeError> {
    let db_url = config
        .database
        .url()
        .map_err(|e| NodeError::Config(e.to_string()))?
        .expose()
        .to_owned();
    let redis = RedisSettings {
        url: config
            .redis
            .url()
            .map_err(|e| NodeError::Config(e.to_string()))?
            .expose()
            .to_owned(),
        key_prefix: config.redis.key_prefix.clone(),
        connect_timeout: config.redis.connect_timeout(),
        response_timeout: config.redis.response_timeout(),
        topology: config.redis.topology(),
    };
    let node_id = node_id(&config);
    let workers_n = config.relay.effective_workers().max(1);
    // A worker needs a connection per batch in flight; more would sit idle.
    let per_worker_pool =
        (config.database.pool_size / workers_n as u32).clamp(2, config.relay.max_in_flight.max(2));
    let connect = |purpose: &str, pool: u32, relay_worker: bool| ConnectSettings {
        connect_timeout: config.database.connect_timeout(),
        relay_worker,
        ..ConnectSettings::new(db_url.clone(), format!("outpost {purpose} {node_id}"), pool)
    };

    let store = Store::connect(&connect("supervisor", 4, false)).await?;
    if crate::store::migrate_status(&store)
        .await?
        .iter()
        .any(|m| !m.applied)
    {
        return Err(NodeError::Store(StoreError::NotMigrated));
    }
    let publisher = Publisher::connect(&redis).await?;
    let refuse_eviction = config.redis.maxmemory_policy_check == crate::config::REFUSE;
    let facts = preflight(&publisher, refuse_eviction).await?;
    store
        .register_node(&NodeInfo {
            node_id: node_id.clone(),
            hostname: hostname(),
            pid: i32::try_from(std::process::id()).unwrap_or(0),
            version: env!("CARGO_PKG_VERSION").to_owned(),
        })
        .await?;

    let shared = Arc::new(Shared {
        router: Router::new(&config.routing),
        limits: RateLimits::new(&config.rate_limit, &config.redis.key_prefix, |name| {
            publisher.stream_key(name)
        }),
        settings: RelaySettings {
            batch_rows: config.relay.batch_rows,
            batch_bytes: config.relay.batch_bytes as u64,
            max_attempts: config.relay.max_attempts,
            backoff_base: config.relay.backoff_base(),
            backoff_max: config.relay.backoff_max(),
            delete_published: config.relay.delete_published,
        },
        deadline: LeaseDeadline::new(),
        streams: StreamBook::default(),
        cursors: Cursors::default(),
    });
    // Streams written before are known from the start, so a Redis that lost them is noticed at
    // the first append; then the same check the supervisor runs when the run id changes.
    redis_loss::load_known(&store, &shared.streams).await?;
    let window = config.retention.republish_window_secs;
    let checked =
        redis_loss::check(&store, &publisher, &shared.streams, &facts.0.run_id, window).await;
    let checked_run_id = match checked {
        Ok(_) => Some(facts.0.run_id.clone()),
        Err(e) => {
            tracing::warn!(error = %e, "checking Redis for lost streams failed; retrying at the next heartbeat");
            None
        }
    };

    // Worker arbiters, each with its own pool and Redis connection created on its own thread.
    let mut workers = Vec::with_capacity(workers_n);
    for i in 0..workers_n {
        let arbiter = Arbiter::new().handle();
        let (tx, rx) = oneshot::channel();
        let (settings, redis, shared) = (
            connect(&format!("worker {i}"), per_worker_pool, true),
            redis.clone(),
            shared.clone(),
        );
        let slots = config.relay.max_in_flight as usize;
        arbiter.spawn(async move {
            let made = async {
                let store = Store::connect(&settings).await?;
                let publisher = Publisher::connect(&redis).await?;
                Ok::<_, NodeError>(Worker {
                    store,
                    publisher,
                    slots: Arc::new(tokio::sync::Semaphore::new(slots)),
                    queue: Arc::default(),
                    shared,
                })
            }
            .await;
            let _ = tx.send(made);
        });
        let worker = rx.await.map_err(|e| NodeError::Runtime(e.to_string()))??;
        workers.push((arbiter, worker));
    }

    let health = Arc::new(Health::default());
    health.set_redis(facts.0, Some(facts.1), refuse_eviction);
    let restarts = Arc::new(AtomicU64::new(0));
    let settings = SupervisorSettings {
        node_id: node_id.clone(),
        heartbeat: config.node.heartbeat(),
        lease: config.node.lease(),
        wake: WakePolicy {
            busy_poll: config.relay.busy_poll(),
            idle_after: config.relay.idle_after(),
        },
        transient_backoff: (
            Duration::from_millis(100),
            config.relay.transient_backoff_max(),
        ),
        shutdown_timeout: config.relay.shutdown_timeout(),
        database_url: db_url.clone(),
        republish_window_secs: window,
        refuse_eviction,
        checked_run_id,
    };
    // The ticks' own session, whose lock waits end after a quarter of a heartbeat: a lock on the
    // outbox then delays publishing but never the renewal of the leases (`Store::lease_tick`).
    let tick_store = Store::connect(&ConnectSettings {
        lock_timeout: Some(config.node.heartbeat() / 4),
        ..connect("heartbeat", 1, false)
    })
    .await?;
    let supervisor = NodeSupervisor::new(
        settings,
        store.clone(),
        publisher.clone(),
        workers,
        shared.clone(),
        health.clone(),
        restarts.clone(),
    )
    .with_tick_store(tick_store)
    .start();

    let retention = config.retention.clone();
    if retention.enabled {
        actix::spawn(housekeeping::janitor(store.clone(), retention.clone()));
    }
    if retention.trim_streams {
        actix::spawn(housekeeping::trimmer(
            store.clone(),
            publisher.clone(),
            retention,
        ));
    }
    actix::spawn(housekeeping::storage_metrics(store.clone()));
    actix::spawn(crate::metrics::upkeep(crate::metrics::UPKEEP_EVERY));

    let listen = config
        .admin
        .listen_addr()
        .map_err(|e| NodeError::Config(format!("admin.listen: {e}")))?;
    let admin_addr = crate::admin::serve(
        listen,
        health.clone(),
        crate::admin::ApiState::new(store.clone(), &config),
    )
    .await
    .map_err(|source| NodeError::Bind {
        addr: listen,
        source,
    })?;
    tracing::info!(node = %node_id, workers = workers_n, admin = ?admin_addr, "node started");
    Ok(Booted {
        node_id,
        supervisor,
        health,
        restarts,
        admin_addr,
    })
}

/// Checks, before the node starts, that Redis keeps what it acknowledges: a `maxmemory-policy`
/// that may evict keys is refused (or warned about, by `redis.maxmemory_policy_check`), and the
/// persistence settings are logged.
async fn preflight(
    publisher: &Publisher,
    refuse_eviction: bool,
) -> Result<(ServerFacts, PersistenceConfig), NodeError> {
    let facts = publisher.server_facts().await?;
    let persistence = publisher.persistence_config().await;
    tracing::info!(
        version = %facts.version,
        run_id = %facts.run_id,
        maxmemory_policy = %facts.maxmemory_policy,
        appendonly = facts.aof_enabled,
        appendfsync = persistence.appendfsync.as_deref().unwrap_or("unknown"),
        save = persistence.save.as_deref().unwrap_or("unknown"),
        "Redis"
    );
    if !facts.aof_enabled {
        tracing::warn!(
            "Redis runs without append-only persistence: a restart loses the streams; Outpost \
             notices and re-publishes retention.republish_window_secs, older events are lost to \
             consumers that had not read them (set appendonly yes)"
        );
    }
    if facts.may_evict() {
        let message = format!(
            "Redis maxmemory-policy is {:?}: under memory pressure Redis may evict a stream and \
             its acknowledged entries; set `maxmemory-policy noeviction` on Redis (Outpost backs \
             off while Redis answers OOM), or set redis.maxmemory_policy_check = \"warn\" to run \
             anyway",
            facts.maxmemory_policy
        );
        if refuse_eviction {
            return Err(NodeError::Preflight(message));
        }
        tracing::warn!("{message}");
    }
    Ok((facts, persistence))
}
