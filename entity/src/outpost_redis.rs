//! `outpost_redis`: the Redis instance last seen (run id) and its incarnation.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_redis")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub singleton: bool,
    pub run_id: Option<String>,
    pub incarnation: i64,
    pub seen_at: DateTimeWithTimeZone,
    pub lost_at: Option<DateTimeWithTimeZone>,
    pub republished: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
