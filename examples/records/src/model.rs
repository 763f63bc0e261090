//! The application's tables, as SeaORM entities: the business rows (`record`, `record_link`),
//! what every mutation leaves beside them (`record_audit`, `record_history`), and the consumer's
//! read model (`record_view`, with `record_applied`, the log of what it applied, which the
//! verdict reads).

/// `record`: a custom object. `title` and `status` are the declared event content; `notes` and
/// `version` are not, so a change to them alone emits no event.
pub mod record {
    use sea_orm::entity::prelude::*;
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
    #[sea_orm(table_name = "record")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub kind: String,
        pub title: String,
        pub status: String,
        pub notes: String,
        pub version: i64,
        pub updated_at: DateTimeWithTimeZone,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// `record_link`: a directed link between two records. A record with links cannot be deleted
/// (the foreign keys refuse it): unlink first.
pub mod link {
    use sea_orm::entity::prelude::*;
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
    #[sea_orm(table_name = "record_link")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: Uuid,
        pub from_id: Uuid,
        pub to_id: Uuid,
        pub kind: String,
        pub created_at: DateTimeWithTimeZone,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {
        #[sea_orm(
            belongs_to = "super::record::Entity",
            from = "Column::FromId",
            to = "super::record::Column::Id"
        )]
        From,
        #[sea_orm(
            belongs_to = "super::record::Entity",
            from = "Column::ToId",
            to = "super::record::Column::Id"
        )]
        To,
    }

    impl ActiveModelBehavior for ActiveModel {}
}

/// `record_audit`: who did what to which record or link, and when.
pub mod audit {
    use sea_orm::entity::prelude::*;
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
    #[sea_orm(table_name = "record_audit")]
    pub struct Model {
        #[sea_orm(primary_key)]
        pub id: i64,
        pub actor: String,
        /// `record.create`, `record.update`, `record.delete`, `link.create`, `link.delete`.
        pub action: String,
        /// `record` or `link`.
        pub target_type: String,
        pub target_id: Uuid,
        pub at: DateTimeWithTimeZone,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// `record_history`: the row before and after each mutation, and the event it emitted (none when
/// no declared field changed).
pub mod history {
    use sea_orm::entity::prelude::*;
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
    #[sea_orm(table_name = "record_history")]
    pub struct Model {
        #[sea_orm(primary_key)]
        pub id: i64,
        pub audit_id: i64,
        /// The audit row's action.
        pub action: String,
        pub target_type: String,
        pub target_id: Uuid,
        #[sea_orm(column_type = "JsonBinary", nullable)]
        pub before: Option<Json>,
        #[sea_orm(column_type = "JsonBinary", nullable)]
        pub after: Option<Json>,
        pub event_id: Option<Uuid>,
        pub at: DateTimeWithTimeZone,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// `record_view`: the read model the consumer keeps — each record's last declared state and
/// its link count. A deleted record keeps its row, marked `deleted`.
pub mod view {
    use sea_orm::entity::prelude::*;
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
    #[sea_orm(table_name = "record_view")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub record_id: Uuid,
        pub kind: Option<String>,
        pub title: Option<String>,
        pub status: Option<String>,
        /// Links from or to the record.
        pub links: i64,
        pub deleted: bool,
        /// Events of the record's own aggregate applied.
        pub events: i64,
        /// The aggregate sequence of the last one.
        pub last_seq: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// `record_applied`: every event the consumer applied, in the order it applied them (`id`).
pub mod applied {
    use sea_orm::entity::prelude::*;
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, Serialize, Deserialize)]
    #[sea_orm(table_name = "record_applied")]
    pub struct Model {
        #[sea_orm(primary_key)]
        pub id: i64,
        pub event_id: Uuid,
        pub aggregate_id: String,
        pub aggregate_seq: i64,
        pub event_type: String,
        pub stream_id: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}
