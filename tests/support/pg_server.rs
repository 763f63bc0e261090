//! A PostgreSQL server of the test's own (`initdb` in a temporary directory, a free loopback
//! port), so that killing its postmaster with SIGKILL — a crash of the database server — and
//! restarting it disturbs no other test. Run as the `postgres` system user when the test runs as
//! root (PostgreSQL refuses to run as root).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use outpost::store::{Store, admin};

use super::wait_until;

/// The server's binaries: `pg_config --bindir`, else the newest `/usr/lib/postgresql/*/bin`.
fn bin_dir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return dir;
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's binaries (pg_config --bindir or /usr/lib/postgresql/*/bin)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|d| d.join("initdb").exists())
        .collect();
    found.sort();
    found.pop().expect("initdb under /usr/lib/postgresql/*/bin")
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A PostgreSQL server owned by the test.
pub struct OwnPostgres {
    port: u16,
    dir: PathBuf,
    bin: PathBuf,
    as_postgres: bool,
    /// `name=value` server settings beyond the defaults below.
    settings: Vec<String>,
    child: Option<Child>,
}

impl OwnPostgres {
    /// Creates a cluster and starts its server; returns once it accepts connections.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// [`OwnPostgres::start`] with `name=value` server settings of the test's own (e.g.
    /// `max_prepared_transactions=4`).
    pub async fn start_with(settings: &[&str]) -> Self {
        let port = super::free_port();
        let dir = std::env::temp_dir().join(format!("outpost-pg-{port}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let as_postgres = running_as_root();
        if as_postgres {
            let ok = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok,
                "chown of the test's data directory to the postgres user"
            );
        }
        let mut pg = Self {
            port,
            dir,
            bin: bin_dir(),
            as_postgres,
            settings: settings.iter().map(ToString::to_string).collect(),
            child: None,
        };
        let data = pg.dir.join("data");
        let status = pg
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("initdb");
        assert!(status.success(), "initdb of the test's own server");
        pg.start_server().await;
        pg
    }

    /// `program` from the server's binaries, as the `postgres` user when running as root.
    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// The server process, its log appended to `server.log`.
    fn spawn_server(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .unwrap();
        self.command("postgres")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.dir.display()))
            .args(["-c", "shared_buffers=32MB", "-c", "max_connections=60"])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("postgres")
    }

    /// Starts the server and waits until it accepts connections. A start right after a kill can
    /// find the old server's last processes still holding its shared memory and give up: then
    /// it is started again.
    async fn start_server(&mut self) {
        self.child = Some(self.spawn_server());
        let isready = self.bin.join("pg_isready");
        let port = self.port.to_string();
        wait_until(
            60,
            "the test's own PostgreSQL to accept connections",
            || {
                let gave_up = self
                    .child
                    .as_mut()
                    .is_some_and(|c| c.try_wait().ok().flatten().is_some());
                if gave_up {
                    self.child = Some(self.spawn_server());
                }
                let ready = Command::new(&isready)
                    .args(["-q", "-h", "127.0.0.1", "-p", &port])
                    .status()
                    .is_ok_and(|s| s.success());
                async move { ready }
            },
        )
        .await;
    }

    /// The URL of database `name` on this server.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Creates database `name`, migrated, and returns a pool of `pool` connections on it.
    pub async fn migrated_database(&self, name: &str, pool: u32) -> Store {
        admin::create_database(&self.url("postgres"), name, None)
            .await
            .expect("create database");
        let store = Store::connect(&outpost::store::ConnectSettings::new(
            self.url(name),
            "outpost test",
            pool,
        ))
        .await
        .expect("connect");
        outpost::store::migrate_up(&store).await.expect("migrate");
        store
    }

    /// Starts a node on database `name` of this server (see [`OwnPostgres::migrated_database`])
    /// under `redis`'s prefix, with the tests' relay settings.
    pub async fn start_node(
        &self,
        name: &str,
        redis: &super::TestRedis,
        node_id: &str,
    ) -> outpost::app::NodeHandle {
        let config = super::relay_config_at(
            &self.url(name),
            &super::redis_url(),
            &redis.prefix,
            node_id,
            &[],
        );
        super::start_node(config).await
    }

    /// A crash of the server: SIGKILL to the postmaster (its backends notice and exit; the next
    /// start runs crash recovery, and waits out any of them still holding shared memory).
    pub fn kill(&mut self) {
        let Some(mut c) = self.child.take() else {
            // Not running (its `postmaster.pid` is stale and may name another process by now).
            return;
        };
        let pid_file = std::fs::read_to_string(self.dir.join("data/postmaster.pid"));
        if let Some(pid) = pid_file
            .ok()
            .and_then(|t| t.lines().next().map(str::to_owned))
        {
            let _ = Command::new("kill").args(["-9", pid.trim()]).status();
        }
        // The postmaster itself, or runuser, which exits when it does.
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Starts the server again after [`OwnPostgres::kill`].
    pub async fn restart(&mut self) {
        self.start_server().await;
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
