//! The admin HTTP endpoint: `/metrics`, `/livez`, `/readyz`.
//!
//! It reads state; it never writes to the database or Redis itself. (The operator panel and the
//! JSON API will live here too, acting through the supervisor.)

use std::net::SocketAddr;
use std::sync::Arc;

use actix_web::{App, HttpResponse, HttpServer, web};
use serde_json::json;

use crate::dispatch::supervisor::Health;

struct AppState {
    health: Arc<Health>,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

/// Starts the admin endpoint on `listen` (port 0 picks a free port) inside the current actix
/// system and returns the bound address.
pub fn serve(listen: SocketAddr, health: Arc<Health>) -> std::io::Result<SocketAddr> {
    let state = web::Data::new(AppState {
        health,
        metrics: crate::metrics::install(),
    });
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .route("/metrics", web::get().to(metrics))
            .route("/livez", web::get().to(livez))
            .route("/readyz", web::get().to(readyz))
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .bind(listen)?;
    let addr = server.addrs().first().copied().unwrap_or(listen);
    actix::spawn(server.run());
    Ok(addr)
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    match &state.metrics {
        Some(h) => HttpResponse::Ok()
            .content_type("text/plain; version=0.0.4")
            .body(h.render()),
        None => HttpResponse::ServiceUnavailable()
            .body("metrics are recorded by another recorder in this process"),
    }
}

async fn livez() -> HttpResponse {
    HttpResponse::Ok().body("live\n")
}

async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    use std::sync::atomic::Ordering::Relaxed;
    let h = &state.health;
    let server = h
        .redis_server
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let redis_server = server.map(|(facts, persistence)| {
        json!({
            "version": facts.version,
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
