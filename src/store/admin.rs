//! Whole-database administration: scratch databases for benchmarks and tests.

use sea_orm::{ConnectionTrait, Database};

use super::{DbErrorKind, StoreError, classify, stmt};

/// `url` with its database name replaced by `name`.
pub fn database_url(url: &str, name: &str) -> Result<String, StoreError> {
    let mut u = url::Url::parse(url)
        .map_err(|e| StoreError::Unavailable(format!("database.url is not a valid URL: {e}")))?;
    u.set_path(&format!("/{name}"));
    Ok(u.to_string())
}

/// A one-connection pool on the server's `postgres` database.
async fn connect_admin(server_url: &str) -> Result<sea_orm::DatabaseConnection, StoreError> {
    let mut opts = sea_orm::ConnectOptions::new(database_url(server_url, "postgres")?);
    opts.max_connections(1)
        .min_connections(1)
        .sqlx_logging(false);
    Database::connect(opts).await.map_err(StoreError::from_db)
}

fn check_name(name: &str) -> Result<(), StoreError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(StoreError::Corrupt(format!(
            "database name {name:?} must be 1-63 characters of a-z, 0-9 and _"
        )))
    }
}

/// Creates database `name` on the server of `server_url` (optionally as a copy of `template`).
/// Returns `false` when it already exists.
pub async fn create_database(
    server_url: &str,
    name: &str,
    template: Option<&str>,
) -> Result<bool, StoreError> {
    check_name(name)?;
    if let Some(t) = template {
        check_name(t)?;
    }
    let admin = connect_admin(server_url).await?;
    let sql = match template {
        Some(t) => format!("CREATE DATABASE \"{name}\" TEMPLATE \"{t}\""),
        None => format!("CREATE DATABASE \"{name}\""),
    };
    let result = admin.execute_unprepared(&sql).await;
    let _ = admin.close().await;
    match result {
        Ok(_) => Ok(true),
        Err(e) if classify(&e) == DbErrorKind::Other && exists_error(&e) => Ok(false),
        Err(e) => Err(StoreError::from_db(e)),
    }
}

/// True for SQLSTATE 42P04 (duplicate database).
fn exists_error(e: &sea_orm::DbErr) -> bool {
    use sea_orm::{DbErr, RuntimeErr, sqlx};
    match e {
        DbErr::Exec(RuntimeErr::SqlxError(s)) | DbErr::Query(RuntimeErr::SqlxError(s)) => {
            matches!(&**s, sqlx::Error::Database(d) if d.code().as_deref() == Some("42P04"))
        }
        _ => false,
    }
}

/// Drops database `name`, disconnecting its sessions.
pub async fn drop_database(server_url: &str, name: &str) -> Result<(), StoreError> {
    check_name(name)?;
    let admin = connect_admin(server_url).await?;
    let result = admin
        .execute_unprepared(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .await;
    let _ = admin.close().await;
    result.map(|_| ()).map_err(StoreError::from_db)
}

/// Runs `f` while holding a server-wide advisory lock `key` on a dedicated connection (used to
/// build a shared template database once across concurrent processes).
pub async fn with_server_lock<F, Fut, T>(server_url: &str, key: i64, f: F) -> Result<T, StoreError>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    // A one-connection pool, so the session-level lock and unlock run on the same session (and
    // closing it releases the lock even if the unlock fails).
    let mut opts = sea_orm::ConnectOptions::new(database_url(server_url, "postgres")?);
    opts.max_connections(1)
        .min_connections(1)
        .sqlx_logging(false);
    let conn = Database::connect(opts).await.map_err(StoreError::from_db)?;
    conn.execute_raw(stmt("SELECT pg_advisory_lock($1)", [key.into()]))
        .await
        .map_err(StoreError::from_db)?;
    let out = f().await;
    let _ = conn
        .execute_raw(stmt("SELECT pg_advisory_unlock($1)", [key.into()]))
        .await;
    let _ = conn.close().await;
    out
}

/// True when database `name` exists on the server.
pub async fn database_exists(server_url: &str, name: &str) -> Result<bool, StoreError> {
    check_name(name)?;
    let admin = connect_admin(server_url).await?;
    let row = admin
        .query_one_raw(stmt(
            "SELECT 1 FROM pg_database WHERE datname = $1",
            [name.into()],
        ))
        .await;
    let _ = admin.close().await;
    Ok(row.map_err(StoreError::from_db)?.is_some())
}

/// Renames database `from` to `to` (no session may be connected to `from`).
pub async fn rename_database(server_url: &str, from: &str, to: &str) -> Result<(), StoreError> {
    check_name(from)?;
    check_name(to)?;
    let admin = connect_admin(server_url).await?;
    let result = admin
        .execute_unprepared(&format!("ALTER DATABASE \"{from}\" RENAME TO \"{to}\""))
        .await;
    let _ = admin.close().await;
    result.map(|_| ()).map_err(StoreError::from_db)
}
