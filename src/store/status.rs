//! Backlog figures for operators (`outpost status`, metrics, the panel).

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
    let by_status = db
        .query_all_raw(stmt(
            "SELECT status, count(*) FROM outpost_event GROUP BY status ORDER BY status",
            [],
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
        .collect::<Result<Vec<_>, StoreError>>()?;

    let partitions = db
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
        .collect::<Result<Vec<_>, StoreError>>()?;

    let oldest = db
        .query_one_raw(stmt(
            "SELECT extract(epoch FROM now() - min(t.recorded_at))::float8 FROM ( \
               SELECT e.recorded_at FROM outpost_partition p, LATERAL ( \
                 SELECT recorded_at FROM outpost_event \
                 WHERE partition = p.partition AND status IN ('pending', 'retry_wait') \
                 ORDER BY id LIMIT 1) e \
               UNION ALL \
               (SELECT recorded_at FROM outpost_event WHERE status = 'held' ORDER BY id LIMIT 1) \
             ) t",
            [],
        ))
        .await
        .map_err(StoreError::from_db)?;
    let oldest_pending_age_secs = match oldest {
        Some(r) => r
            .try_get_by_index::<Option<f64>>(0)
            .map_err(StoreError::from_db)?,
        None => None,
    };
    let nodes = db
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
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(Backlog {
        by_status,
        partitions,
        nodes,
        oldest_pending_age_secs,
    })
}
