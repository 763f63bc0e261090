//! Relay nodes: registration, heartbeats and the "nudge me" flag.

use sea_orm::ConnectionTrait;

use super::sql::num_array;
use super::{Store, StoreError, stmt};

/// Who a node is, as recorded in `outpost_node`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Unique node id (`node.id`).
    pub node_id: String,
    /// Host the node runs on.
    pub hostname: String,
    /// Process id.
    pub pid: i32,
    /// Outpost version.
    pub version: String,
}

impl Store {
    /// Records a node as alive (or refreshes its row after a restart).
    pub async fn register_node(&self, node: &NodeInfo) -> Result<(), StoreError> {
        self.connection()
            .execute_raw(stmt(
                "INSERT INTO outpost_node (node_id, hostname, pid, version) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (node_id) DO UPDATE SET hostname = EXCLUDED.hostname, \
                   pid = EXCLUDED.pid, version = EXCLUDED.version, started_at = now(), \
                   heartbeat_at = now(), wants_nudge = false",
                [
                    node.node_id.clone().into(),
                    node.hostname.clone().into(),
                    node.pid.into(),
                    node.version.clone().into(),
                ],
            ))
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// Asks producers to NOTIFY on insert (`true`, the node is idle) or stops asking (`false`,
    /// the node polls because it is busy).
    pub async fn set_wants_nudge(&self, node_id: &str, wants: bool) -> Result<(), StoreError> {
        self.connection()
            .execute_raw(stmt(
                "UPDATE outpost_node SET wants_nudge = $2, heartbeat_at = now() WHERE node_id = $1",
                [node_id.into(), wants.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// Removes a node's row (clean shutdown).
    pub async fn deregister_node(&self, node_id: &str) -> Result<(), StoreError> {
        self.connection()
            .execute_raw(stmt(
                "DELETE FROM outpost_node WHERE node_id = $1",
                [node_id.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        Ok(())
    }

    /// Of the given partitions, those with at least one row ready to publish now. One index
    /// probe per partition on the (small) ready index; used by the busy poll.
    pub async fn ready_partitions(&self, partitions: &[i32]) -> Result<Vec<i32>, StoreError> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let list = num_array(partitions);
        let rows = self
            .connection()
            .query_all_raw(stmt(
                "SELECT p FROM unnest($1::int4[]) AS p WHERE EXISTS ( \
                   SELECT 1 FROM outpost_event e WHERE e.partition = p \
                   AND e.status IN ('pending', 'retry_wait') AND e.next_attempt_at <= now())",
                [list.into()],
            ))
            .await
            .map_err(StoreError::from_db)?;
        rows.into_iter()
            .map(|r| r.try_get_by_index::<i32>(0).map_err(StoreError::from_db))
            .collect()
    }
}
