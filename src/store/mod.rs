//! All SQL lives here.
//!
//! `store` is the seam between Outpost and its database: callers speak in terms of events,
//! batches, leases and figures; this module turns them into statements for the backend in use.
//! It never touches Redis. Today the only backend is PostgreSQL; a statement that another backend
//! would write differently is built in one place here, so adding a backend does not touch callers.

pub mod admin;
pub mod bench;
mod claim;
mod error;
mod events;
pub mod inbox;
mod lease;
mod listen;
mod migrate;
mod node;
pub mod operator;
mod positions;
mod retention;
mod sql;
mod status;

use std::time::Duration;

use sea_orm::sqlx::postgres::PgConnectOptions;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement,
};

pub use claim::{BatchResult, ClaimedEvent, FailedEvent, LeaseRef, MAX_PAYLOAD_BYTES, Recorded};
pub use error::{DbErrorKind, StoreError, classify};
pub use events::{InsertedEvent, NewEventRow, insert_events};
pub use lease::{Lease, LeaseTick};
pub use listen::{Nudge, NudgeListener, WAKEUP_CHANNEL};
pub use migrate::{MigrationState, migrate_down, migrate_status, migrate_up};
pub use node::NodeInfo;
pub use operator::audit::{Actor, AuditEntry, AuditQuery, Role};
pub use operator::deadletter::{MAX_BULK, Outcome, Selection};
pub use operator::search::{
    COUNT_CAP, EventDetail, EventFilter, EventPage, EventState, EventSummary, MatchCount,
};
pub use operator::tokens::{NewToken, TokenInfo};
pub use positions::{LostStream, PartitionRecovery, StreamMark};
pub use retention::{Expiry, JANITOR_LOCK, RedisRecord, StorageFigures, StreamRecord};
pub use status::{
    Backlog, BacklogFigures, NodeStatus, Overview, PUBLISHED_COUNTED_UP_TO, PartitionBacklog,
    StatusCount, backlog,
};

/// How a pool is opened: the URL and the knobs an operator may tune.
#[derive(Debug, Clone)]
pub struct ConnectSettings {
    /// A `postgres://` URL. Never logged: it may carry a password.
    pub url: String,
    /// Upper bound of pooled connections.
    pub pool_size: u32,
    /// How long to wait for a new connection before giving up.
    pub connect_timeout: Duration,
    /// `application_name` shown in `pg_stat_activity`, so an operator can tell relay sessions
    /// apart (and terminate them) without guessing.
    pub application_name: String,
    /// The session settings of the relay's workers:
    /// - `synchronous_commit = off`: their writes are marks and retry records, and a mark lost in
    ///   a database crash only means its rows are published again (a duplicate with the same
    ///   event id), never a lost event. Lease changes and operator actions always commit durably.
    /// - `plan_cache_mode = force_generic_plan`: their statements have fixed shapes whose
    ///   parameters are arrays (partitions, ids), and PostgreSQL would otherwise plan each claim
    ///   and mark again at every execution: planning a claim of 8 partitions took more than half
    ///   as long as running it (`EXPLAIN ANALYZE` at a 300,000-row backlog), and under a steady
    ///   flow every few events need one. The generic plans use the same indexes
    ///   (`docs/operations.md`).
    pub relay_worker: bool,
    /// `lock_timeout` of every session in the pool: a statement waiting longer than this for a
    /// lock fails (SQLSTATE 55P03) instead of waiting on. `None` waits as long as it takes.
    pub lock_timeout: Option<Duration>,
}

impl ConnectSettings {
    /// A pool of at most `pool_size` sessions at `url` named `application_name`, with the usual
    /// settings: a 10 s connect timeout, durable commits, plans chosen by PostgreSQL, and no
    /// `lock_timeout`. Change what differs with struct update syntax.
    pub fn new(
        url: impl Into<String>,
        application_name: impl Into<String>,
        pool_size: u32,
    ) -> Self {
        Self {
            url: url.into(),
            pool_size,
            connect_timeout: Duration::from_secs(10),
            application_name: application_name.into(),
            relay_worker: false,
            lock_timeout: None,
        }
    }
}

/// A handle on Outpost's database: a connection pool plus the backend it speaks.
#[derive(Debug, Clone)]
pub struct Store {
    db: DatabaseConnection,
}

impl Store {
    /// Opens a pool. Sessions prefer index scans (`random_page_cost = 1.1`): the claim query must
    /// use the partial ready index even when the backlog is large and the statistics are stale.
    pub async fn connect(settings: &ConnectSettings) -> Result<Self, StoreError> {
        let mut opts = ConnectOptions::new(settings.url.clone());
        let app = settings.application_name.clone();
        let (sync_commit, plans) = if settings.relay_worker {
            ("off", "force_generic_plan")
        } else {
            ("on", "auto")
        };
        let mut session = vec![
            ("random_page_cost", "1.1".to_owned()),
            ("synchronous_commit", sync_commit.to_owned()),
            ("plan_cache_mode", plans.to_owned()),
        ];
        if let Some(wait) = settings.lock_timeout {
            // At least 1 ms: 0 would mean no timeout at all.
            session.push(("lock_timeout", wait.as_millis().max(1).to_string()));
        }
        opts.max_connections(settings.pool_size)
            .min_connections(0)
            .connect_timeout(settings.connect_timeout)
            .acquire_timeout(settings.connect_timeout)
            // A ping before every checkout would add a round trip to every query; a broken
            // connection shows up as a transient error on use instead.
            .test_before_acquire_if_idle_for(Duration::from_secs(30))
            .sqlx_logging(false)
            .map_sqlx_postgres_opts(move |o: PgConnectOptions| {
                o.application_name(&app)
                    .options(session.iter().map(|(k, v)| (*k, v.as_str())))
            });
        let db = Database::connect(opts).await.map_err(StoreError::from_db)?;
        if db.get_database_backend() != DbBackend::Postgres {
            return Err(StoreError::UnsupportedBackend(format!(
                "{:?}",
                db.get_database_backend()
            )));
        }
        Ok(Self { db })
    }

    /// Wraps an existing SeaORM connection (the application's own pool, say).
    pub fn from_connection(db: DatabaseConnection) -> Self {
        Self { db }
    }

    /// The underlying SeaORM connection, for callers that run their own transactions.
    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    /// The partition count fixed by the schema.
    pub async fn partition_count(&self) -> Result<u32, StoreError> {
        let row = self
            .db
            .query_one_raw(stmt("SELECT partition_count FROM outpost_meta", []))
            .await
            .map_err(StoreError::from_db)?
            .ok_or(StoreError::NotMigrated)?;
        let n: i32 = row.try_get_by_index(0).map_err(StoreError::from_db)?;
        u32::try_from(n).map_err(|_| StoreError::Corrupt(format!("partition_count is {n}")))
    }
}

/// A Postgres statement with positional parameters.
fn stmt<I>(sql: &str, values: I) -> Statement
where
    I: IntoIterator<Item = sea_orm::Value>,
{
    Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
}
