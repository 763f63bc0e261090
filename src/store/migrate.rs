//! Applying and reverting Outpost's migrations.

use migration::{Migrator, MigratorTrait};

use sea_orm::{ConnectionTrait, DatabaseTransaction, TransactionTrait};

use super::{Store, StoreError, stmt};

/// One migration and whether it is applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationState {
    /// Migration name (dated).
    pub name: String,
    /// Applied to this database.
    pub applied: bool,
}

/// Advisory lock key held while migrating ("outpost" in ASCII), so that several nodes or test
/// processes starting at once apply each migration exactly once.
const MIGRATION_LOCK: i64 = 0x006f_7574_706f_7374;

/// Applies every pending migration, in one transaction under an advisory lock: safe to run
/// concurrently from several nodes, and all-or-nothing.
pub async fn migrate_up(store: &Store) -> Result<(), StoreError> {
    let txn = locked_transaction(store).await?;
    Migrator::up(&txn, None)
        .await
        .map_err(StoreError::from_db)?;
    txn.commit().await.map_err(StoreError::from_db)
}

/// Reverts the last `steps` migrations (all of them when `None`). Destroys Outpost's tables.
pub async fn migrate_down(store: &Store, steps: Option<u32>) -> Result<(), StoreError> {
    let txn = locked_transaction(store).await?;
    Migrator::down(&txn, steps)
        .await
        .map_err(StoreError::from_db)?;
    txn.commit().await.map_err(StoreError::from_db)
}

async fn locked_transaction(store: &Store) -> Result<DatabaseTransaction, StoreError> {
    let txn = store
        .connection()
        .begin()
        .await
        .map_err(StoreError::from_db)?;
    txn.execute_raw(stmt(
        "SELECT pg_advisory_xact_lock($1)",
        [MIGRATION_LOCK.into()],
    ))
    .await
    .map_err(StoreError::from_db)?;
    Ok(txn)
}

/// Lists every migration Outpost knows and whether it is applied here.
pub async fn migrate_status(store: &Store) -> Result<Vec<MigrationState>, StoreError> {
    let applied: Vec<String> =
        match Migrator::get_applied_migrations_read_only(store.connection()).await {
            Ok(list) => list.iter().map(|m| m.name().to_owned()).collect(),
            Err(e) => return Err(StoreError::from_db(e)),
        };
    Ok(Migrator::migrations()
        .iter()
        .map(|m| MigrationState {
            name: m.name().to_owned(),
            applied: applied.iter().any(|a| a == m.name()),
        })
        .collect())
}
