//! Test databases of the records application: each test gets a fresh database of its own on the
//! server of `TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`),
//! migrated, with the application's tables, dropped at the end; and a Redis key prefix of its
//! own on `TEST_REDIS_URL` (default `redis://127.0.0.1:6379`).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use outpost::store::{Store, admin};

/// Server URL of the test PostgreSQL.
pub fn server_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// URL of the test Redis.
pub fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A unique lower-case suffix.
pub fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// A database of the test's own, dropped when the value is dropped.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub store: Store,
}

impl TestDb {
    pub async fn new() -> Self {
        let server = server_url();
        let name = format!("records_t_{}", unique());
        admin::create_database(&server, &name, None)
            .await
            .expect("create the test database");
        let url = admin::database_url(&server, &name).expect("url");
        let store = outpost_records::cli::open(&url, 8, "test")
            .await
            .expect("open the test database");
        Self { name, url, store }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (server, name) = (server_url(), self.name.clone());
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                let _ = rt.block_on(admin::drop_database(&server, &name));
            }
        })
        .join();
    }
}
