//! Outpost's schema migrations.
//!
//! Every migration is dated and frozen: once released it never changes meaning. Migrations do not
//! import the `entity` crate, so a later change to an entity cannot rewrite history. SQL that only
//! one backend understands stays inside the migration that needs it and names the backend; a
//! backend without an implementation is refused with a clear error rather than half-migrated.

pub use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DbBackend;

/// The `Migration` of a module whose `up` and `down` are its PostgreSQL texts `UP` and `DOWN`.
macro_rules! sql_migration {
    () => {
        #[derive(Debug, DeriveMigrationName)]
        pub struct Migration;

        #[async_trait::async_trait]
        impl MigrationTrait for Migration {
            async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
                crate::execute_postgres(manager, UP).await
            }

            async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
                crate::execute_postgres(manager, DOWN).await
            }
        }
    };
}

mod m20261201_000001_outbox;
mod m20261201_000002_lease_fence_key;
mod m20261201_000003_consumer;
mod m20261201_000004_retention;
mod m20261201_000005_backlog;
mod m20261202_000006_insert_checks;
mod m20261202_000007_lean_insert;
mod m20261203_000008_published_history;
mod m20261205_000009_nudge_opt_out;
mod m20261206_000010_insert_fixes;
mod m20261206_000011_stream_positions;
mod m20261206_000012_owned_columns;
mod m20261206_000013_operator_surface;
mod m20261207_000014_inbox_by_aggregate;
mod m20261207_000015_payload_limit;

/// The ordered list of Outpost's migrations, recorded in `outpost_migrations`.
#[derive(Debug)]
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261201_000001_outbox::Migration),
            Box::new(m20261201_000002_lease_fence_key::Migration),
            Box::new(m20261201_000003_consumer::Migration),
            Box::new(m20261201_000004_retention::Migration),
            Box::new(m20261201_000005_backlog::Migration),
            Box::new(m20261202_000006_insert_checks::Migration),
            Box::new(m20261202_000007_lean_insert::Migration),
            Box::new(m20261203_000008_published_history::Migration),
            Box::new(m20261205_000009_nudge_opt_out::Migration),
            Box::new(m20261206_000010_insert_fixes::Migration),
            Box::new(m20261206_000011_stream_positions::Migration),
            Box::new(m20261206_000012_owned_columns::Migration),
            Box::new(m20261206_000013_operator_surface::Migration),
            Box::new(m20261207_000014_inbox_by_aggregate::Migration),
            Box::new(m20261207_000015_payload_limit::Migration),
        ]
    }

    fn migration_table_name() -> DynIden {
        "outpost_migrations".into_iden()
    }
}

/// Refuses a backend the migrations have no SQL for, with an error that says so.
fn require_postgres(manager: &SchemaManager) -> Result<(), DbErr> {
    match manager.get_database_backend() {
        DbBackend::Postgres => Ok(()),
        other => Err(DbErr::Migration(format!(
            "Outpost's schema is implemented for PostgreSQL only; {other:?} is not supported yet"
        ))),
    }
}

/// Runs a migration's SQL, written for PostgreSQL, after [`require_postgres`].
async fn execute_postgres(manager: &SchemaManager<'_>, sql: &str) -> Result<(), DbErr> {
    require_postgres(manager)?;
    manager.get_connection().execute_unprepared(sql).await?;
    Ok(())
}
