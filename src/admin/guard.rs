//! Who is asking and whether they may: bearer tokens, roles and rate limits.
//!
//! Every API route is wrapped by [`require`] with the least role it needs. The guard first
//! limits the client address (before any database work, so anonymous floods cost nothing but
//! this check), then reads `Authorization: Bearer <token>` and looks the token up
//! ([`Store::authenticate`]: hashed, compared in constant time), then limits the token's
//! identity, then checks the role. The actor goes into the request's extensions for the handler.
//! Refusals are answered as problems (401, 403, 429) and never show the token.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{HttpMessage, web};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};

use super::ApiState;
use super::problem::ApiError;
use crate::store::{Actor, Role, Store};

/// The rate limits of the API: one bucket per client address, one per token identity.
#[derive(Debug)]
pub struct Limits {
    by_address: DefaultKeyedRateLimiter<IpAddr>,
    by_identity: DefaultKeyedRateLimiter<String>,
}

impl Limits {
    /// `per_sec` sustained with `burst` above it, for each address and each identity.
    pub fn new(per_sec: u32, burst: u32) -> Self {
        let quota = Quota::per_second(NonZeroU32::new(per_sec).unwrap_or(NonZeroU32::MIN))
            .allow_burst(NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN));
        Self {
            by_address: DefaultKeyedRateLimiter::keyed(quota),
            by_identity: DefaultKeyedRateLimiter::keyed(quota),
        }
    }

    pub(super) fn check_address(&self, ip: IpAddr) -> Result<(), ApiError> {
        self.by_address
            .check_key(&ip)
            .map_err(|n| ApiError::too_many(secs(&n), "this address"))
    }

    fn check_identity(&self, name: &str) -> Result<(), ApiError> {
        self.by_identity
            .check_key(&name.to_owned())
            .map_err(|n| ApiError::too_many(secs(&n), "this token"))
    }
}

fn secs(n: &governor::NotUntil<<DefaultClock as Clock>::Instant>) -> u64 {
    n.wait_time_from(DefaultClock::default().now())
        .as_secs_f64()
        .ceil() as u64
}

/// The token of `Authorization: Bearer <token>`, if the header has that form.
fn bearer(req: &ServiceRequest) -> Option<String> {
    let value = req.headers().get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_owned())
}

/// Authenticates the request and checks it may do what needs `needed`.
async fn authorize(
    store: &Store,
    limits: &Limits,
    req: &ServiceRequest,
    needed: Role,
) -> Result<Actor, ApiError> {
    if let Some(addr) = req.peer_addr() {
        limits.check_address(addr.ip())?;
    }
    let token = bearer(req).ok_or_else(ApiError::unauthorized)?;
    let actor = store
        .authenticate(&token)
        .await?
        .ok_or_else(ApiError::unauthorized)?;
    limits.check_identity(&actor.name)?;
    let action = format!(
        "{} {}",
        req.method(),
        req.match_pattern().unwrap_or_default()
    );
    actor.require(needed, &action)?;
    Ok(actor)
}

/// The middleware of a route that needs `needed`.
pub async fn require(
    needed: Role,
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let Some(state) = req.app_data::<web::Data<Arc<ApiState>>>().cloned() else {
        return Err(ApiError::new(
            actix_web::http::StatusCode::NOT_FOUND,
            "not found",
            "the API is not served by this endpoint",
        )
        .into());
    };
    match authorize(&state.store, &state.limits, &req, needed).await {
        Ok(actor) => {
            req.extensions_mut().insert(actor);
            next.call(req).await.map(|r| r.map_body(|_, b| b.boxed()))
        }
        Err(e) => Ok(req.error_response(e)),
    }
}
