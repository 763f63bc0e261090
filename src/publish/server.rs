//! What Outpost needs to know about the Redis server: its identity (`run_id`, which changes
//! whenever the process restarts or a replica takes over) and the settings that decide whether
//! an acknowledged entry can disappear (eviction, persistence).

use redis::Value;

use super::{PublishError, Publisher};

/// The facts read with one `INFO server memory persistence` (every heartbeat).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerFacts {
    /// `run_id`: a random id Redis draws at every start.
    pub run_id: String,
    /// `maxmemory_policy`: anything but `noeviction` may evict a stream.
    pub maxmemory_policy: String,
    /// `aof_enabled`: append-only file persistence is on.
    pub aof_enabled: bool,
    /// `redis_version`.
    pub version: String,
}

impl ServerFacts {
    /// Whether Redis may evict keys (and with them streams and fences) under memory pressure.
    pub fn may_evict(&self) -> bool {
        self.maxmemory_policy != "noeviction"
    }

    /// One view of several primaries (a cluster, by address): the run ids joined as
    /// `address=run_id,…` (any node that restarts or fails over changes it), the first policy
    /// that may evict, persistence only when every primary has it, the lowest version.
    fn combine<'a>(nodes: impl IntoIterator<Item = (&'a str, Self)>) -> Self {
        let nodes: Vec<(&str, Self)> = nodes.into_iter().collect();
        if let [(_, one)] = nodes.as_slice() {
            return one.clone();
        }
        let mut run_ids: Vec<String> = nodes
            .iter()
            .map(|(addr, f)| format!("{addr}={}", f.run_id))
            .collect();
        run_ids.sort();
        let mut policy = nodes
            .iter()
            .map(|(_, f)| f.maxmemory_policy.clone())
            .find(|p| p != "noeviction");
        if policy.is_none() && !nodes.is_empty() {
            policy = Some("noeviction".to_owned());
        }
        Self {
            run_id: if nodes.iter().any(|(_, f)| f.run_id.is_empty()) {
                String::new()
            } else {
                run_ids.join(",")
            },
            maxmemory_policy: policy.unwrap_or_default(),
            aof_enabled: !nodes.is_empty() && nodes.iter().all(|(_, f)| f.aof_enabled),
            version: nodes
                .iter()
                .map(|(_, f)| f.version.clone())
                .min_by_key(|v| {
                    v.split('.')
                        .map(|p| p.parse::<u32>().unwrap_or(0))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        }
    }

    fn parse(info: &str) -> Self {
        let mut facts = Self::default();
        for line in info.lines() {
            let Some((k, v)) = line.trim().split_once(':') else {
                continue;
            };
            match k {
                "run_id" => facts.run_id = v.to_owned(),
                "maxmemory_policy" => facts.maxmemory_policy = v.to_owned(),
                "aof_enabled" => facts.aof_enabled = v == "1",
                "redis_version" => facts.version = v.to_owned(),
                _ => {}
            }
        }
        facts
    }
}

/// Persistence settings, read with `CONFIG GET` (which managed services may refuse: then
/// `None`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PersistenceConfig {
    /// `save`: RDB snapshot rules (`""` = no snapshots).
    pub save: Option<String>,
    /// `appendfsync`: `always`, `everysec` or `no`.
    pub appendfsync: Option<String>,
}

impl Publisher {
    /// Reads [`ServerFacts`] in one round trip (one per primary on a cluster); doubles as the
    /// readiness ping.
    pub async fn server_facts(&self) -> Result<ServerFacts, PublishError> {
        let infos = self
            .conn
            .info_all(&["server", "memory", "persistence"])
            .await
            .map_err(PublishError::from_redis)?;
        let facts = ServerFacts::combine(
            infos
                .iter()
                .map(|(addr, text)| (addr.as_str(), ServerFacts::parse(text))),
        );
        if facts.run_id.is_empty() {
            return Err(PublishError::event(
                "PROTOCOL",
                "INFO server did not report a run_id",
            ));
        }
        Ok(facts)
    }

    /// Reads the persistence settings; a refused `CONFIG GET` leaves them `None`.
    pub async fn persistence_config(&self) -> PersistenceConfig {
        let mut c = self.conn.clone();
        let mut get = async |name: &str| -> Option<String> {
            let v: Value = redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(&mut c)
                .await
                .ok()?;
            match v {
                Value::Array(items) => items.get(1).and_then(super::script::text),
                Value::Map(pairs) => pairs.first().and_then(|(_, v)| super::script::text(v)),
                _ => None,
            }
        };
        let save = get("save").await;
        let appendfsync = get("appendfsync").await;
        PersistenceConfig { save, appendfsync }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_info() {
        let f = ServerFacts::parse(
            "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\n# Memory\r\n\
             maxmemory_policy:allkeys-lru\r\n# Persistence\r\naof_enabled:1\r\n",
        );
        assert_eq!(f.run_id, "abc123");
        assert_eq!(f.version, "7.0.15");
        assert!(f.aof_enabled);
        assert!(f.may_evict());
    }

    #[test]
    fn combines_cluster_primaries() {
        let node = |run_id: &str, policy: &str, aof: bool, version: &str| ServerFacts {
            run_id: run_id.to_owned(),
            maxmemory_policy: policy.to_owned(),
            aof_enabled: aof,
            version: version.to_owned(),
        };
        let f = ServerFacts::combine([
            ("b:2", node("r2", "noeviction", true, "7.0.15")),
            ("a:1", node("r1", "allkeys-lru", true, "7.10.0")),
            ("c:3", node("r3", "noeviction", false, "7.2.0")),
        ]);
        assert_eq!(f.run_id, "a:1=r1,b:2=r2,c:3=r3");
        assert!(f.may_evict());
        assert!(!f.aof_enabled);
        assert_eq!(f.version, "7.0.15");
        let one = node("r", "noeviction", false, "7.0.15");
        assert_eq!(ServerFacts::combine([("", one.clone())]), one);
    }
}
