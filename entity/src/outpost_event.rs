//! `outpost_event`: one event fact and its delivery state.

use sea_orm::entity::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, DeriveEntityModel, Serialize, Deserialize)]
#[sea_orm(table_name = "outpost_event")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: i64,
    #[sea_orm(unique)]
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
    pub status: String,
    pub attempts: i32,
    pub next_attempt_at: DateTimeWithTimeZone,
    pub last_error: Option<String>,
    pub published_at: Option<DateTimeWithTimeZone>,
    pub stream_id: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
