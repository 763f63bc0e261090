//! Makes a lease's epoch part of a key of `outpost_partition`.
//!
//! A mark checks the lease it was published under and holds it for the length of the statement.
//! With `(partition, epoch)` unique, PostgreSQL treats a change of epoch as a key update: the
//! mark's `FOR KEY SHARE` lock then blocks a takeover (which bumps the epoch) until the mark has
//! committed, while lease renewals, releases and pauses, which leave the epoch alone, never wait
//! for a mark and a mark never waits for them. Without it a mark had to lock `FOR SHARE`, and a
//! renewal of many leases could deadlock with a mark of several partitions.

use sea_orm_migration::prelude::*;

use crate::execute_postgres;

#[derive(Debug, DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        execute_postgres(
            manager,
            "ALTER TABLE outpost_partition \
             ADD CONSTRAINT outpost_partition_epoch_key UNIQUE (partition, epoch)",
        )
        .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        execute_postgres(
            manager,
            "ALTER TABLE outpost_partition DROP CONSTRAINT IF EXISTS outpost_partition_epoch_key",
        )
        .await
    }
}
