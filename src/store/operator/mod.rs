//! What operators do to events and who did it: searches, dead-letter replay and discard, the
//! audit log and API tokens. The CLI, the JSON API and the panel all call these functions; each
//! mutation checks the actor's role and writes its audit row in the transaction of the change.

pub mod audit;
pub mod deadletter;
pub mod search;
pub mod tokens;

use super::{Store, StoreError};
use audit::{Actor, Role};

impl Store {
    /// Pauses or resumes partitions as `actor` (who needs the operator role), audited in the
    /// same transaction ([`Store::set_paused`]). Returns the partitions whose state changed.
    pub async fn pause_partitions(
        &self,
        actor: &Actor,
        partitions: &[i32],
        paused: bool,
    ) -> Result<Vec<i32>, StoreError> {
        let action = if paused {
            "partition.pause"
        } else {
            "partition.resume"
        };
        actor.require(Role::Operator, action)?;
        self.set_paused(partitions, paused, &actor.name, actor.role.as_str())
            .await
    }
}
