//! `/metrics`, `/livez`, `/readyz`: unauthenticated, for probes and scrapers (bind
//! `admin.listen` to a private address).

use actix_web::{HttpResponse, web};
use serde_json::json;

use super::AppState;

pub(super) async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    match &state.metrics {
        Some(h) => HttpResponse::Ok()
            .content_type("text/plain; version=0.0.4")
            .body(h.render()),
        None => HttpResponse::ServiceUnavailable()
            .body("metrics are recorded by another recorder in this process"),
    }
}

pub(super) async fn livez() -> HttpResponse {
    HttpResponse::Ok().body("live\n")
}

/// Ready or not, and why: the database, Redis, the supervisor, leases, and the Redis settings
/// that decide whether it keeps what it acknowledged (never server versions).
pub(super) async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    use std::sync::atomic::Ordering::Relaxed;
    let h = &state.health;
    let server = h
        .redis_server
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let redis_server = server.map(|(facts, persistence)| {
        json!({
            "maxmemory_policy": facts.maxmemory_policy,
            "may_evict": facts.may_evict(),
            "eviction_refused": h.eviction_refused.load(Relaxed),
            "appendonly": facts.aof_enabled,
            "appendfsync": persistence.appendfsync,
            "save": persistence.save,
        })
    });
    let body = json!({
        "ready": h.ready(),
        "database": h.database.load(Relaxed),
        "redis": h.redis.load(Relaxed),
        "supervisor": h.running.load(Relaxed),
        "leases": h.leases.load(Relaxed),
        "redis_server": redis_server,
    });
    if h.ready() {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}
