//! `outpost_inbox`: event ids a consumer group has processed, per aggregate.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_inbox")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub consumer_group: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub event_id: Uuid,
    /// Empty in rows recorded before the inbox knew aggregates.
    #[sea_orm(primary_key, auto_increment = false)]
    pub aggregate_type: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub aggregate_id: String,
    pub processed_at: DateTimeWithTimeZone,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
