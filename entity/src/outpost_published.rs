//! `outpost_published`: an event that was published, kept for `retention.published_secs`.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_published")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: i64,
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_seq: i64,
    pub aggregate_version: Option<i64>,
    pub event_type: String,
    pub schema_version: String,
    pub occurred_at: DateTimeWithTimeZone,
    pub recorded_at: DateTimeWithTimeZone,
    #[sea_orm(column_type = "JsonBinary")]
    pub payload: Json,
    #[sea_orm(column_type = "JsonBinary")]
    pub headers: Json,
    pub destination: Option<String>,
    pub partition: i32,
    pub txid: i64,
    pub attempts: i32,
    pub published_at: DateTimeWithTimeZone,
    pub stream_id: String,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
