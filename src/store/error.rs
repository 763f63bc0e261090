//! Errors of the store, classified by what the caller should do next.

use sea_orm::DbErr;

/// What went wrong talking to the database.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached or dropped the connection. Retry after a pause.
    #[error("database unavailable: {0} (check database.url and that PostgreSQL is running)")]
    Unavailable(String),
    /// An event with this id is already in the outbox.
    #[error(
        "an event with event_id {0} is already in the outbox; every event needs its own event_id \
         (leave it unset to have one generated)"
    )]
    DuplicateEventId(uuid::Uuid),
    /// The schema refused a row (a CHECK, NOT NULL or unique constraint).
    #[error("the database refused the row: constraint {constraint} ({detail})")]
    Rejected {
        /// Name of the violated constraint, when the database reports one.
        constraint: String,
        /// The database's own description.
        detail: String,
    },
    /// PostgreSQL refused the login (SQLSTATE 28P01 wrong password, 28000 unknown role or no
    /// `pg_hba.conf` entry). Retrying does not help.
    #[error(
        "PostgreSQL refused the login ({0}): fix the user and password in database.url \
         (postgres://USER:PASSWORD@HOST:PORT/DATABASE)"
    )]
    LoginRefused(String),
    /// The database named by `database.url` does not exist (SQLSTATE 3D000).
    #[error(
        "{0}: run `outpost migrate up` (or start with `outpost run --migrate`), which creates it, \
         or fix the database name in database.url"
    )]
    DatabaseMissing(String),
    /// Outpost's tables are missing, or older than this version's migrations.
    #[error(
        "Outpost's schema is not installed in this database, or is behind this version's \
         migrations: run `outpost migrate up` (or start with `outpost run --migrate`)"
    )]
    NotMigrated,
    /// A value in the database breaks an invariant Outpost relies on.
    #[error("unexpected data in Outpost's tables: {0}")]
    Corrupt(String),
    /// The connection URL points at a database Outpost cannot use yet.
    #[error("unsupported database backend {0}: Outpost needs PostgreSQL")]
    UnsupportedBackend(String),
    /// The node no longer holds the partition's lease at this epoch: another node took it over.
    /// Nothing was recorded; the caller must drop its batch and stop working on the partition.
    #[error("lease on partition {partition} at epoch {epoch} was lost to another node")]
    LeaseLost {
        /// Partition number.
        partition: i32,
        /// The epoch the caller held.
        epoch: i64,
    },
    /// An operator action was refused (not allowed for the role, events not in the state the
    /// action needs, a confirmed count that no longer holds, bad input). Nothing was changed.
    #[error("{message}")]
    Refused {
        /// Why, as a fixed word: `role`, `state`, `count`, `input`, `not_found`.
        kind: &'static str,
        /// What was wrong and how to go on.
        message: String,
    },
    /// Any other database error.
    #[error("database error: {0}")]
    Db(DbErr),
}

/// The meaning of a database error, read from its SQLSTATE, never from its message text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DbErrorKind {
    /// 23505, with the constraint's name.
    UniqueViolation(String),
    /// 23514 / 23502 / 22xxx: the row itself is wrong.
    InvalidRow(String),
    /// 42P01: a table is missing.
    UndefinedTable,
    /// Connection refused, reset, closed, pool timeout, admin shutdown (57P01..57P03), 08xxx.
    Connection,
    /// 40001 / 40P01: serialization failure or deadlock; safe to retry the transaction.
    Retryable,
    /// 55P03: a lock was not granted within the session's `lock_timeout` (or `NOWAIT`).
    LockNotAvailable,
    /// Anything else.
    Other,
}

/// Reads the SQLSTATE (and constraint name) out of a SeaORM error.
pub fn classify(err: &DbErr) -> DbErrorKind {
    use sea_orm::{RuntimeErr, sqlx};
    let sqlx_err = match err {
        DbErr::Conn(_) | DbErr::ConnectionAcquire(_) => return DbErrorKind::Connection,
        DbErr::Exec(RuntimeErr::SqlxError(e)) | DbErr::Query(RuntimeErr::SqlxError(e)) => e,
        _ => return DbErrorKind::Other,
    };
    match &**sqlx_err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.to_string()).unwrap_or_default();
            let constraint = db.constraint().unwrap_or_default().to_owned();
            match code.as_str() {
                "23505" => DbErrorKind::UniqueViolation(constraint),
                "23514" | "23502" => DbErrorKind::InvalidRow(constraint),
                c if c.starts_with("22") => DbErrorKind::InvalidRow(constraint),
                "42P01" => DbErrorKind::UndefinedTable,
                "40001" | "40P01" => DbErrorKind::Retryable,
                "55P03" => DbErrorKind::LockNotAvailable,
                c if c.starts_with("08") || c.starts_with("57P") => DbErrorKind::Connection,
                _ => DbErrorKind::Other,
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => DbErrorKind::Connection,
        _ => DbErrorKind::Other,
    }
}

/// Why opening a session failed, when the server said so.
enum LoginProblem {
    Refused(String),
    NoDatabase(String),
}

/// Reads a refused login (28P01, 28000) or a missing database (3D000) out of a connection
/// error, by SQLSTATE.
fn login_problem(err: &DbErr) -> Option<LoginProblem> {
    use sea_orm::{RuntimeErr, sqlx};
    let (DbErr::Conn(RuntimeErr::SqlxError(e))
    | DbErr::Exec(RuntimeErr::SqlxError(e))
    | DbErr::Query(RuntimeErr::SqlxError(e))) = err
    else {
        return None;
    };
    let sqlx::Error::Database(db) = &**e else {
        return None;
    };
    let message = db.message().to_owned();
    match db.code().as_deref() {
        Some("28P01" | "28000") => Some(LoginProblem::Refused(message)),
        Some("3D000") => Some(LoginProblem::NoDatabase(message)),
        _ => None,
    }
}

impl StoreError {
    /// Maps a SeaORM error to the store's vocabulary.
    pub fn from_db(err: DbErr) -> Self {
        match login_problem(&err) {
            Some(LoginProblem::Refused(m)) => return StoreError::LoginRefused(m),
            Some(LoginProblem::NoDatabase(m)) => return StoreError::DatabaseMissing(m),
            None => {}
        }
        match classify(&err) {
            DbErrorKind::Connection => StoreError::Unavailable(err.to_string()),
            DbErrorKind::UndefinedTable => StoreError::NotMigrated,
            DbErrorKind::InvalidRow(constraint) | DbErrorKind::UniqueViolation(constraint) => {
                StoreError::Rejected {
                    constraint,
                    detail: err.to_string(),
                }
            }
            DbErrorKind::Retryable | DbErrorKind::LockNotAvailable | DbErrorKind::Other => {
                StoreError::Db(err)
            }
        }
    }

    /// True when the operation may succeed if retried after a pause (the database was
    /// unreachable, a transaction lost a serialization race, or a lock was not granted in time).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Unavailable(_) => true,
            StoreError::Db(e) => matches!(
                classify(e),
                DbErrorKind::Retryable | DbErrorKind::LockNotAvailable
            ),
            _ => false,
        }
    }
}
