//! The demo's Redis: the configured one when it answers; otherwise a private `redis-server` on a
//! free loopback port when one is on the `PATH` (stopped when the demo ends); otherwise an error
//! that says how to get one.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::bail;

/// The Redis the demo uses.
#[derive(Debug)]
pub(super) struct DemoRedis {
    /// Its URL.
    pub url: String,
    /// What to tell the user about it.
    pub label: String,
    /// The private server, stopped on drop.
    private: Option<Child>,
}

impl DemoRedis {
    /// Whether the demo started this server (its keys need no cleaning).
    pub fn is_private(&self) -> bool {
        self.private.is_some()
    }
}

impl Drop for DemoRedis {
    fn drop(&mut self) {
        if let Some(child) = self.private.as_mut() {
            // A throwaway server without persistence: nothing to flush.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Answers PING within two seconds?
async fn ping(url: &str) -> Result<(), redis::RedisError> {
    let client = redis::Client::open(url)?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(2)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    redis::cmd("PING").query_async::<String>(&mut conn).await?;
    Ok(())
}

/// `redis-server` on the `PATH`, if any.
fn find_redis_server() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file())
}

/// The configured Redis (`url`, shown as `shown`), or a private one.
pub(super) async fn pick(url: &str, shown: &str) -> anyhow::Result<DemoRedis> {
    let err = match ping(url).await {
        Ok(()) => {
            return Ok(DemoRedis {
                url: url.to_owned(),
                label: format!("{shown} (configured)"),
                private: None,
            });
        }
        Err(e) => e,
    };
    if err.kind() == redis::ErrorKind::AuthenticationFailed
        || err
            .code()
            .is_some_and(|c| c == "NOAUTH" || c == "WRONGPASS")
    {
        bail!(
            "Redis at {shown} refused the credentials ({err}): put the right user and password \
             in redis.url (redis://USER:PASSWORD@HOST:PORT), e.g. OUTPOST_REDIS__URL"
        );
    }
    let Some(server) = find_redis_server() else {
        bail!(
            "Redis is not reachable at {shown} ({err}) and redis-server is not on the PATH: \
             start one (Debian/Ubuntu: `apt-get install redis-server`; macOS: `brew install \
             redis`; or `docker run -p 6379:6379 redis:7`), or point redis.url \
             (OUTPOST_REDIS__URL) at yours"
        );
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(&server)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let private = DemoRedis {
        url: format!("redis://127.0.0.1:{port}"),
        label: format!(
            "a private redis-server on 127.0.0.1:{port} (Redis at {shown} is not reachable: {err})"
        ),
        private: Some(child),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match ping(&private.url).await {
            Ok(()) => return Ok(private),
            Err(e) if tokio::time::Instant::now() > deadline => {
                bail!(
                    "the private redis-server ({}) did not answer: {e}",
                    server.display()
                )
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Deletes the keys under `prefix` (the demo's streams and fences from an earlier run).
pub(super) async fn delete_prefix(url: &str, prefix: &str) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("DEL")
                .arg(&keys)
                .query_async::<()>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
