//! `outpost_node`: relay nodes and their heartbeats.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_node")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub node_id: String,
    pub started_at: DateTimeWithTimeZone,
    pub heartbeat_at: DateTimeWithTimeZone,
    pub wants_nudge: bool,
    pub version: String,
    pub hostname: String,
    pub pid: i32,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
