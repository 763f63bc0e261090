//! Creates the application's tables (idempotent). Outpost's own tables come from its migrations
//! (`outpost::store::migrate_up`), which the application runs first.

use sea_orm::{ConnectionTrait, DbErr, EntityTrait, Schema};

use crate::model::{applied, audit, history, link, record, view};

/// Creates every table of [`crate::model`] that does not exist yet.
pub async fn create_tables<C: ConnectionTrait>(db: &C) -> Result<(), DbErr> {
    let schema = Schema::new(db.get_database_backend());
    create(db, &schema, record::Entity).await?;
    create(db, &schema, link::Entity).await?;
    create(db, &schema, audit::Entity).await?;
    create(db, &schema, history::Entity).await?;
    create(db, &schema, view::Entity).await?;
    create(db, &schema, applied::Entity).await?;
    Ok(())
}

async fn create<C: ConnectionTrait, E: EntityTrait>(
    db: &C,
    schema: &Schema,
    entity: E,
) -> Result<(), DbErr> {
    let mut table = schema.create_table_from_entity(entity);
    table.if_not_exists();
    db.execute(&table).await?;
    Ok(())
}
