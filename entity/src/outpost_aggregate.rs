//! `outpost_aggregate`: the per-aggregate sequence counter, partition and hold marker.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_aggregate")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub aggregate_type: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub aggregate_id: String,
    pub last_seq: i64,
    pub partition: i32,
    pub blocked_seq: Option<i64>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
