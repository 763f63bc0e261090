//! `outpost_stream`: streams Outpost appended to, with the newest entry id seen acknowledged.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_stream")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub stream: String,
    pub incarnation: i64,
    pub last_ms: i64,
    pub last_seq: i64,
    pub updated_at: DateTimeWithTimeZone,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
