//! What a node reports about itself: readiness and liveness for the admin endpoints, and the
//! machine's host name. A leaf: the supervisor writes [`Health`], the admin endpoints read it,
//! and neither imports the other.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use metrics::gauge;

use crate::metrics as m;
use crate::publish::{PersistenceConfig, ServerFacts};

/// What readiness and liveness report; updated by the supervisor.
#[derive(Debug, Default)]
pub struct Health {
    /// The last lease tick reached the database.
    pub database: AtomicBool,
    /// The last ping reached Redis.
    pub redis: AtomicBool,
    /// The supervisor is running (not shutting down).
    pub running: AtomicBool,
    /// Leases held.
    pub leases: AtomicU64,
    /// Redis may evict keys and `redis.maxmemory_policy_check` says to refuse that.
    pub eviction_refused: AtomicBool,
    /// What Redis said about itself at the last heartbeat, and its persistence settings.
    pub redis_server: std::sync::Mutex<Option<(ServerFacts, PersistenceConfig)>>,
}

impl Health {
    /// Ready to do work: database and Redis reachable, Redis not allowed to evict keys (unless
    /// only warned about), supervisor running.
    pub fn ready(&self) -> bool {
        self.database.load(Ordering::Relaxed)
            && self.redis.load(Ordering::Relaxed)
            && self.running.load(Ordering::Relaxed)
            && !self.eviction_refused.load(Ordering::Relaxed)
    }

    /// Records what Redis said about itself; `persistence` is kept from before when `None`.
    pub fn set_redis(
        &self,
        facts: ServerFacts,
        persistence: Option<PersistenceConfig>,
        refuse_eviction: bool,
    ) {
        self.eviction_refused
            .store(refuse_eviction && facts.may_evict(), Ordering::Relaxed);
        gauge!(m::REDIS_MAY_EVICT).set(f64::from(u8::from(facts.may_evict())));
        gauge!(m::REDIS_AOF).set(f64::from(u8::from(facts.aof_enabled)));
        let mut slot = self
            .redis_server
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let persistence = persistence
            .or_else(|| slot.take().map(|(_, p)| p))
            .unwrap_or_default();
        *slot = Some((facts, persistence));
    }
}

/// This machine's host name (for node ids, consumer names and the audit log).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "node".to_owned())
}
