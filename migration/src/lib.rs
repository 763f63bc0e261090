//! Outpost's schema migrations.
//!
//! Every migration is dated and frozen: once released it never changes meaning. Migrations do not
//! import the `entity` crate, so a later change to an entity cannot rewrite history. SQL that only
//! one backend understands stays inside the migration that needs it and names the backend; a
//! backend without an implementation is refused with a clear error rather than half-migrated.

pub use sea_orm_migration::prelude::*;

mod m20261201_000001_outbox;

/// The ordered list of Outpost's migrations, recorded in `outpost_migrations`.
#[derive(Debug)]
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(m20261201_000001_outbox::Migration)]
    }

    fn migration_table_name() -> DynIden {
        "outpost_migrations".into_iden()
    }
}
