//! A Redis Cluster of local masters, started by a test and stopped when dropped.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use redis::cluster_async::ClusterConnection;

use super::wait_until;

/// redis-server processes in cluster mode, slots spread over the masters by
/// `redis-cli --cluster create`, optionally each master with replicas.
#[derive(Debug)]
pub struct RedisCluster {
    /// Client ports of every node (each node's bus port is 10000 higher); which are masters is
    /// decided by `redis-cli` and told by [`RedisCluster::layout`].
    pub ports: Vec<u16>,
    /// A node not killed by the test, asked about the cluster's layout.
    live: u16,
    dir: std::path::PathBuf,
    children: Vec<Child>,
}

/// A port `p` such that `p` and `p + 10000` (the cluster bus) are both free now.
fn free_port_pair() -> u16 {
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        if port > 55_000 {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

impl RedisCluster {
    /// Starts the masters, creates the cluster and waits until every node reports it healthy.
    pub async fn start(masters: usize) -> Self {
        Self::start_with_replicas(masters, 0).await
    }

    /// Like [`start`](Self::start), each master with `replicas` replicas. Nodes consider a peer
    /// failed after one second without an answer, so a killed master's replica takes over soon.
    pub async fn start_with_replicas(masters: usize, replicas: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "outpost-cluster-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let mut cluster = Self {
            ports: Vec::new(),
            live: 0,
            dir,
            children: Vec::new(),
        };
        for _ in 0..masters * (1 + replicas) {
            let port = free_port_pair();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .arg("--cluster-config-file")
                .arg(cluster.dir.join(format!("nodes-{port}.conf")))
                .args([
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--repl-diskless-sync-delay",
                    "0",
                ])
                .arg("--dir")
                .arg(&cluster.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server on PATH");
            cluster.ports.push(port);
            cluster.children.push(child);
        }
        cluster.live = cluster.ports[0];
        for port in cluster.ports.clone() {
            wait_until(30, "a cluster node to answer", || async move {
                cli(port, &["PING"]).await.is_some_and(|r| r == "PONG")
            })
            .await;
        }
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        for p in &cluster.ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli on PATH");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for port in cluster.ports.clone() {
            wait_until(30, "every node to see the cluster healthy", || async move {
                cli(port, &["CLUSTER", "INFO"])
                    .await
                    .is_some_and(|r| r.contains("cluster_state:ok"))
            })
            .await;
        }
        if replicas > 0 {
            let want = masters * replicas;
            let ports = cluster.ports.clone();
            wait_until(60, "every replica to be in sync", || {
                let ports = ports.clone();
                async move {
                    let mut synced = 0;
                    for port in ports {
                        let info = cli(port, &["INFO", "replication"])
                            .await
                            .unwrap_or_default();
                        if info.contains("role:slave") && info.contains("master_link_status:up") {
                            synced += 1;
                        }
                    }
                    synced == want
                }
            })
            .await;
        }
        cluster
    }

    /// kill -9 of the node on `port`.
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|p| *p == port).expect("a node");
        let _ = self.children[i].kill();
        let _ = self.children[i].wait();
        if self.live == port {
            self.live = self.other_than(port);
        }
    }

    /// A node still running, other than `port`.
    pub fn other_than(&self, port: u16) -> u16 {
        *self
            .ports
            .iter()
            .find(|p| **p != port)
            .expect("another node")
    }

    /// A URL of one node (the relay learns the others from it).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.ports[0])
    }

    /// A cluster connection for checks (KEYS goes to every master, key commands to the owner).
    pub async fn conn(&self) -> ClusterConnection {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect();
        redis::cluster::ClusterClientBuilder::new(nodes)
            .response_timeout(Duration::from_secs(30))
            .build()
            .expect("cluster client")
            .get_async_connection()
            .await
            .expect("cluster connection")
    }

    /// The hash slot of `key`.
    pub async fn slot_of(&self, key: &str) -> u16 {
        cli(self.live, &["CLUSTER", "KEYSLOT", key])
            .await
            .and_then(|s| s.trim().parse().ok())
            .expect("CLUSTER KEYSLOT")
    }

    /// Per master: (port, node id, slots it serves).
    pub async fn layout(&self) -> Vec<(u16, String, Vec<u16>)> {
        let nodes = cli(self.live, &["CLUSTER", "NODES"])
            .await
            .expect("CLUSTER NODES");
        let mut out = Vec::new();
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let port: u16 = f[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .expect("node port");
            let mut slots = Vec::new();
            for range in &f[8..] {
                if range.starts_with('[') {
                    continue; // a slot being migrated, listed again by its owner
                }
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                let (a, b): (u16, u16) = (a.parse().expect("slot"), b.parse().expect("slot"));
                slots.extend(a..=b);
            }
            out.push((port, f[0].to_owned(), slots));
        }
        out
    }

    /// The master serving `slot`: (port, node id, how many slots it serves).
    pub async fn owner(&self, slot: u16) -> (u16, String, usize) {
        self.try_owner(slot)
            .await
            .expect("a master serves the slot")
    }

    /// The master serving `slot`, if a healthy one does.
    pub async fn try_owner(&self, slot: u16) -> Option<(u16, String, usize)> {
        self.layout()
            .await
            .into_iter()
            .find(|(_, _, slots)| slots.contains(&slot))
            .map(|(p, id, slots)| (p, id, slots.len()))
    }

    /// Runs `redis-cli --cluster reshard` moving `slots` slots from node `from` to node `to`
    /// (ids). Panics with its output when it fails.
    pub async fn reshard(&self, from: &str, to: &str, slots: usize) {
        let out = tokio::process::Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{}", self.live)])
            .args(["--cluster-from", from, "--cluster-to", to])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .await
            .expect("redis-cli on PATH");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !text.contains("[ERR]"),
            "redis-cli --cluster reshard failed: {}\n{}",
            text.lines().rev().take(20).collect::<Vec<_>>().join("\n"),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-cli -p port args…`: its output, `None` when it failed.
async fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = tokio::process::Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .await
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
