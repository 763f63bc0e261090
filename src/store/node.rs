//! Relay nodes: registration, heartbeats and the "nudge me" flag.

use sea_orm::ConnectionTrait;

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
    /// the node polls because it is busy). The request lasts `ttl_ms` unless a heartbeat
    /// ([`Store::lease_tick`]) extends it: a node that died asking is not nudged for ever.
    pub async fn set_wants_nudge(
        &self,
        node_id: &str,
        wants: bool,
        ttl_ms: u64,
    ) -> Result<(), StoreError> {
        self.connection()
            .execute_raw(stmt(
                "UPDATE outpost_node SET wants_nudge = $2, heartbeat_at = now(), \
                   nudge_until = now() + $3 * interval '1 millisecond' WHERE node_id = $1",
                [
                    node_id.into(),
                    wants.into(),
                    i64::try_from(ttl_ms).unwrap_or(i64::MAX).into(),
                ],
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
}
