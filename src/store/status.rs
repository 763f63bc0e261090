//! Backlog figures for operators (`outpost status`, metrics, the panel).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sea_orm::ConnectionTrait;

use super::{Store, StoreError, stmt};

/// Rows in one delivery state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusCount {
    /// `pending`, `retry_wait`, `held`, `published`, `quarantined`, `discarded` or
    /// `no_destination`.
    pub status: String,
    /// Number of rows.
    pub rows: i64,
}

/// Undelivered rows of one partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionBacklog {
    /// Partition number.
    pub partition: i32,
    /// Rows waiting to be published (pending or waiting for a retry).
    pub ready: i64,
    /// Current lease owner, if any.
    pub owner: Option<String>,
    /// Lease epoch (fencing token).
    pub epoch: i64,
    /// Paused by an operator.
    pub paused: bool,
}

/// A relay node as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeStatus {
    /// Node id.
    pub node_id: String,
    /// Host and process.
    pub hostname: String,
    /// Process id.
    pub pid: i32,
    /// Outpost version.
    pub version: String,
    /// Seconds since its last heartbeat (database clock).
    pub heartbeat_age_secs: f64,
    /// Partitions it holds.
    pub leases: i64,
}

/// The backlog as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    /// Rows by state (states with no rows are left out).
    pub by_status: Vec<StatusCount>,
    /// Every partition, with its undelivered rows and lease.
    pub partitions: Vec<PartitionBacklog>,
    /// Registered relay nodes.
    pub nodes: Vec<NodeStatus>,
    /// Age in seconds of the oldest row not yet delivered (pending, retrying or held), by the
    /// database clock; `None` when there is none.
    pub oldest_pending_age_secs: Option<f64>,
}

/// Reads the backlog figures. Counting by state scans the table; the other figures use indexes.
pub async fn backlog(store: &Store) -> Result<Backlog, StoreError> {
    let db = store.connection();
    let by_status = count_by_status(db).await?;
    let partitions = store.partitions_status().await?;
    let (_, oldest_pending_age_secs) = oldest_undelivered(db).await?;
    let nodes = store.nodes_status().await?;
    Ok(Backlog {
        by_status,
        partitions,
        nodes,
        oldest_pending_age_secs,
    })
}

impl Store {
    /// Every partition with its rows ready to publish (read through the claim's indexes, so it
    /// costs what the backlog holds), owner, epoch and pause.
    pub async fn partitions_status(&self) -> Result<Vec<PartitionBacklog>, StoreError> {
        self.connection()
            .query_all_raw(stmt(
                "SELECT p.partition, coalesce(c.ready, 0), p.owner, p.epoch, p.paused \
                 FROM outpost_partition p \
                 LEFT JOIN (SELECT partition, count(*) AS ready FROM outpost_event \
                            WHERE status IN ('pending', 'retry_wait') GROUP BY partition) c \
                        ON c.partition = p.partition \
                 ORDER BY p.partition",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .into_iter()
            .map(|r| {
                Ok(PartitionBacklog {
                    partition: r.try_get_by_index(0).map_err(StoreError::from_db)?,
                    ready: r.try_get_by_index(1).map_err(StoreError::from_db)?,
                    owner: r.try_get_by_index(2).map_err(StoreError::from_db)?,
                    epoch: r.try_get_by_index(3).map_err(StoreError::from_db)?,
                    paused: r.try_get_by_index(4).map_err(StoreError::from_db)?,
                })
            })
            .collect()
    }

    /// The registered relay nodes with their heartbeat age and leases.
    pub async fn nodes_status(&self) -> Result<Vec<NodeStatus>, StoreError> {
        self.connection()
            .query_all_raw(stmt(
                "SELECT n.node_id, n.hostname, n.pid, n.version, \
                        extract(epoch FROM now() - n.heartbeat_at)::float8, \
                        (SELECT count(*) FROM outpost_partition p WHERE p.owner = n.node_id) \
                 FROM outpost_node n ORDER BY n.node_id",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .into_iter()
            .map(|r| {
                Ok(NodeStatus {
                    node_id: r.try_get_by_index(0).map_err(StoreError::from_db)?,
                    hostname: r.try_get_by_index(1).map_err(StoreError::from_db)?,
                    pid: r.try_get_by_index(2).map_err(StoreError::from_db)?,
                    version: r.try_get_by_index(3).map_err(StoreError::from_db)?,
                    heartbeat_age_secs: r.try_get_by_index(4).map_err(StoreError::from_db)?,
                    leases: r.try_get_by_index(5).map_err(StoreError::from_db)?,
                })
            })
            .collect()
    }
}

/// Published rows counted exactly up to this many; above it, the planner's estimate.
pub const PUBLISHED_COUNTED_UP_TO: i64 = 100_000;

/// Rows by state: the outbox (rows on their way, bounded by delivery) counted; the history
/// counted up to [`PUBLISHED_COUNTED_UP_TO`] rows and estimated above (it holds the retention
/// window, millions of rows on a busy system, and is counted every period).
async fn count_by_status(db: &impl ConnectionTrait) -> Result<Vec<StatusCount>, StoreError> {
    db.query_all_raw(stmt(
        "SELECT status, count(*) FROM outpost_event GROUP BY status \
         UNION ALL \
         SELECT 'published', CASE WHEN c.n < $1 THEN c.n ELSE greatest(c.n, \
                  (SELECT reltuples::int8 FROM pg_class \
                   WHERE oid = 'outpost_published'::regclass)) END \
           FROM (SELECT count(*) AS n FROM (SELECT FROM outpost_published LIMIT $1) s) c \
          WHERE c.n > 0 \
         ORDER BY 1",
        [PUBLISHED_COUNTED_UP_TO.into()],
    ))
    .await
    .map_err(StoreError::from_db)?
    .into_iter()
    .map(|r| {
        Ok(StatusCount {
            status: r.try_get_by_index(0).map_err(StoreError::from_db)?,
            rows: r.try_get_by_index(1).map_err(StoreError::from_db)?,
        })
    })
    .collect()
}

/// When the oldest undelivered row (pending, retrying or held) was recorded, and its age in
/// seconds by the database clock; both `None` when there is none. Uses indexes only.
async fn oldest_undelivered(
    db: &impl ConnectionTrait,
) -> Result<(Option<DateTime<Utc>>, Option<f64>), StoreError> {
    let row = db
        .query_one_raw(stmt(
            "SELECT min(t.recorded_at), extract(epoch FROM now() - min(t.recorded_at))::float8 \
             FROM ( \
               SELECT e.recorded_at FROM outpost_partition p, LATERAL ( \
                 SELECT recorded_at FROM outpost_event \
                 WHERE partition = p.partition AND status = 'pending' \
                 ORDER BY id LIMIT 1) e \
               UNION ALL \
               (SELECT min(recorded_at) FROM outpost_event WHERE status = 'retry_wait') \
               UNION ALL \
               (SELECT recorded_at FROM outpost_event WHERE status = 'held' ORDER BY id LIMIT 1) \
             ) t",
            [],
        ))
        .await
        .map_err(StoreError::from_db)?;
    match row {
        Some(r) => Ok((
            r.try_get_by_index(0).map_err(StoreError::from_db)?,
            r.try_get_by_index(1).map_err(StoreError::from_db)?,
        )),
        None => Ok((None, None)),
    }
}

/// The backlog figures every node reports as metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct BacklogFigures {
    /// Rows by state (states with no rows are left out).
    pub by_status: Vec<StatusCount>,
    /// Age now, in seconds by the database clock, of the oldest row that was undelivered when
    /// the figures were counted: while that row waits, the oldest undelivered age; once it has
    /// gone out, more than that until the next count (the figures are at most one counting
    /// period old).
    pub oldest_pending_age_secs: Option<f64>,
    /// Seconds since the figures were counted; `None` before the first count.
    pub counted_secs_ago: Option<f64>,
    /// This call counted them (rather than reading another node's count).
    pub counted: bool,
}

/// What an operator's overview shows: the stored backlog figures, the nodes, quarantined events
/// by code and the publish rate. Read without scanning the outbox or walking the head of its
/// ready index, so polling it costs a draining node next to nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Overview {
    /// Rows by state and the oldest undelivered age, as the nodes last counted them.
    pub backlog: BacklogFigures,
    /// Registered relay nodes.
    pub nodes: Vec<NodeStatus>,
    /// Quarantined events by failure code, most first.
    pub quarantined_by_code: Vec<(String, i64)>,
    /// Events published per second over the last minute.
    pub publish_rate: f64,
}

impl Store {
    /// The cluster's backlog figures, counted at most once per `every` by all nodes together.
    /// When the stored count is older than `every` and `may_count`, this call claims the refresh
    /// (so no other node counts meanwhile), counts and stores the figures; otherwise it reads
    /// the stored ones, whose oldest age is computed now.
    pub async fn shared_backlog(
        &self,
        every: Duration,
        may_count: bool,
    ) -> Result<BacklogFigures, StoreError> {
        let db = self.connection();
        let claimed = may_count
            && db
                .query_one_raw(stmt(
                    "UPDATE outpost_backlog SET counted_at = now() \
                     WHERE counted_at <= now() - make_interval(secs => $1) RETURNING true",
                    [every.as_secs_f64().into()],
                ))
                .await
                .map_err(StoreError::from_db)?
                .is_some();
        if claimed {
            let by_status = count_by_status(db).await?;
            let (oldest_at, oldest_pending_age_secs) = oldest_undelivered(db).await?;
            let counts: serde_json::Map<String, serde_json::Value> = by_status
                .iter()
                .map(|c| (c.status.clone(), c.rows.into()))
                .collect();
            db.execute_raw(stmt(
                "UPDATE outpost_backlog SET by_status = $1, oldest_at = $2, counted_at = now()",
                [serde_json::Value::Object(counts).into(), oldest_at.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
            return Ok(BacklogFigures {
                by_status,
                oldest_pending_age_secs,
                counted_secs_ago: Some(0.0),
                counted: true,
            });
        }
        self.stored_backlog().await
    }

    /// The backlog figures as the nodes last stored them ([`Store::shared_backlog`]), with the
    /// oldest undelivered age computed now. One read of a one-row table.
    pub async fn stored_backlog(&self) -> Result<BacklogFigures, StoreError> {
        let db = self.connection();
        let row = db
            .query_one_raw(stmt(
                "SELECT by_status, extract(epoch FROM now() - oldest_at)::float8, \
                        CASE WHEN isfinite(counted_at) \
                             THEN extract(epoch FROM now() - counted_at)::float8 END \
                 FROM outpost_backlog",
                [],
            ))
            .await
            .map_err(StoreError::from_db)?
            .ok_or_else(|| StoreError::Corrupt("outpost_backlog has no row".to_owned()))?;
        let counts: serde_json::Value = row.try_get_by_index(0).map_err(StoreError::from_db)?;
        let mut by_status: Vec<StatusCount> = counts
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(status, rows)| {
                Some(StatusCount {
                    status: status.clone(),
                    rows: rows.as_i64()?,
                })
            })
            .collect();
        by_status.sort_by(|a, b| a.status.cmp(&b.status));
        Ok(BacklogFigures {
            by_status,
            oldest_pending_age_secs: row.try_get_by_index(1).map_err(StoreError::from_db)?,
            counted_secs_ago: row.try_get_by_index(2).map_err(StoreError::from_db)?,
            counted: false,
        })
    }

    /// What the operator's overview shows ([`Overview`]): four small reads, made at once on
    /// the pool.
    pub async fn overview(&self) -> Result<Overview, StoreError> {
        let (backlog, nodes, quarantined_by_code, publish_rate) = futures::try_join!(
            self.stored_backlog(),
            self.nodes_status(),
            self.quarantined_by_code(),
            self.publish_rate()
        )?;
        Ok(Overview {
            backlog,
            nodes,
            quarantined_by_code,
            publish_rate,
        })
    }
}
