//! The admin HTTP endpoint on `admin.listen`: `/metrics`, `/livez`, `/readyz` for probes and
//! scrapers (no token), and the operator JSON API under `/api/v1` (bearer tokens with roles,
//! rate-limited, bodies limited, errors as `application/problem+json`, OpenAPI document at
//! `/api/v1/openapi.json`).
//!
//! - `routes`: the one table of routes, the role each needs, registered as it stands.
//! - `guard`: authentication, roles and rate limits.
//! - `api`: the handlers, each calling the store function the CLI calls too.
//! - `health`: the probes and metrics.
//! - `problem`: errors as problems.
//!
//! Every answer carries the security headers (a CSP of `default-src 'self'; frame-ancestors
//! 'none'`, `nosniff`, no referrer, `Cache-Control: no-store`).

mod api;
mod guard;
mod health;
mod panel;
mod problem;
pub mod routes;

use std::net::SocketAddr;
use std::sync::Arc;

use actix_web::middleware::DefaultHeaders;
use actix_web::{App, HttpServer, error::JsonPayloadError, web};

pub use api::ApiDoc;
use problem::ApiError;

use crate::config::Config;
use crate::health::Health;
use crate::store::Store;

struct AppState {
    health: Arc<Health>,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

/// What the API needs: the database, the rate limits and the configuration to show.
#[derive(Debug)]
pub struct ApiState {
    store: Store,
    limits: guard::Limits,
    /// The effective configuration, secrets redacted.
    config: serde_json::Value,
    /// The same, as the panel shows it.
    config_toml: String,
    max_body: usize,
    /// The panel's log-in sessions.
    sessions: panel::session::Sessions,
    /// Mark the session cookie `Secure` (`admin.cookie_secure`).
    cookie_secure: bool,
}

impl ApiState {
    /// The API of a node running with `config` on `store`.
    pub fn new(store: Store, config: &Config) -> Self {
        Self {
            store,
            limits: guard::Limits::new(config.admin.requests_per_sec, config.admin.burst),
            config: serde_json::to_value(config.redacted()).unwrap_or_default(),
            config_toml: config.to_redacted_toml(),
            max_body: config.admin.max_body_bytes as usize,
            sessions: panel::session::Sessions::default(),
            cookie_secure: config.admin.cookie_secure,
        }
    }
}

/// Starts the admin endpoint on `listen` (port 0 picks a free port) inside the current actix
/// system and returns the bound address.
///
/// Refuses to start on an address other than loopback while no API token exists: the panel and
/// the API would be reachable with nobody able to log in, and the endpoint serves `/metrics`
/// without a token. The error says how to create one.
pub async fn serve(
    listen: SocketAddr,
    health: Arc<Health>,
    api: ApiState,
) -> std::io::Result<SocketAddr> {
    if !listen.ip().is_loopback() {
        let tokens = api
            .store
            .live_tokens()
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        if tokens == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "no API token exists, and the panel and API must not be reachable from other \
                 hosts without one: create one with `outpost admin token create --role admin \
                 --name <who>`, or set admin.listen to a loopback address",
            ));
        }
    }
    let state = web::Data::new(AppState {
        health,
        metrics: crate::metrics::install(),
    });
    let max_body = api.max_body;
    let api = web::Data::new(Arc::new(api));
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .app_data(api.clone())
            .app_data(
                web::JsonConfig::default()
                    .limit(max_body)
                    .error_handler(json_error),
            )
            .app_data(web::PayloadConfig::default().limit(max_body))
            .app_data(web::QueryConfig::default().error_handler(|e, _| {
                ApiError::bad_request(format!("bad query parameters: {e}")).into()
            }))
            .app_data(
                web::PathConfig::default()
                    .error_handler(|e, _| ApiError::bad_request(format!("bad path: {e}")).into()),
            )
            .wrap(
                DefaultHeaders::new()
                    .add((
                        "Content-Security-Policy",
                        "default-src 'self'; frame-ancestors 'none'",
                    ))
                    .add(("X-Content-Type-Options", "nosniff"))
                    .add(("Referrer-Policy", "no-referrer"))
                    .add(("X-Frame-Options", "DENY"))
                    .add(("Cache-Control", "no-store")),
            )
            .configure(routes::register)
            .default_service(web::to(|| async {
                Err::<actix_web::HttpResponse, _>(ApiError::not_found(
                    "no such route: /api/v1/openapi.json lists them",
                ))
            }))
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .bind(listen)?;
    let addr = server.addrs().first().copied().unwrap_or(listen);
    actix::spawn(server.run());
    Ok(addr)
}

fn json_error(e: JsonPayloadError, _: &actix_web::HttpRequest) -> actix_web::Error {
    match e {
        JsonPayloadError::Overflow { limit }
        | JsonPayloadError::OverflowKnownLength { limit, .. } => ApiError::new(
            actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
            "payload too large",
            format!("the body is larger than admin.max_body_bytes ({limit} bytes)"),
        )
        .into(),
        JsonPayloadError::ContentType => {
            ApiError::bad_request("send the body as JSON (Content-Type: application/json)").into()
        }
        e => ApiError::bad_request(format!("the body is not the JSON expected: {e}")).into(),
    }
}
