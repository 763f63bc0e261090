//! `outpost_partition`: partition leases with their fencing epoch and pause flag.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_partition")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub partition: i32,
    pub owner: Option<String>,
    pub epoch: i64,
    pub lease_until: Option<DateTimeWithTimeZone>,
    pub paused: bool,
    pub paused_at: Option<DateTimeWithTimeZone>,
    pub paused_by: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
