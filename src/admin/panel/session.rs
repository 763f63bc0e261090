//! Panel sessions: a token is entered once at `/panel/login`; the panel then keeps it on the
//! server and gives the browser only a random session id in a cookie (`HttpOnly`,
//! `SameSite=Strict`, `Secure` with `admin.cookie_secure`). Every request authenticates the
//! session's token again, so a revoked token logs its sessions out at once.
//!
//! Every mutating request carries the session's CSRF token in a form field and passes an
//! origin check: `Sec-Fetch-Site` must be `same-origin` when the browser sends it, and
//! otherwise `Origin` must name this host. A request failing either changes nothing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use actix_web::HttpRequest;
use base64::Engine as _;
use subtle::ConstantTimeEq as _;

/// Name of the session cookie.
pub const COOKIE: &str = "outpost_session";
/// How long a session lasts.
const LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// Most sessions kept at once (older ones are dropped first).
const MAX_SESSIONS: usize = 10_000;

/// A logged-in browser.
#[derive(Clone)]
pub struct Session {
    /// The token it logged in with (kept on the server only).
    pub token: String,
    /// The CSRF token its forms carry.
    pub csrf: String,
    created: Instant,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

/// The sessions of this node.
#[derive(Debug, Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

fn random() -> String {
    let mut bytes = [0u8; 32];
    rand::Rng::fill(&mut rand::rng(), &mut bytes);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

impl Sessions {
    /// Opens a session for `token`; returns its id.
    pub fn open(&self, token: String) -> String {
        let id = random();
        let mut map = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.retain(|_, s| s.created.elapsed() < LIFETIME);
        if map.len() >= MAX_SESSIONS
            && let Some(oldest) = map
                .iter()
                .min_by_key(|(_, s)| s.created)
                .map(|(k, _)| k.clone())
        {
            map.remove(&oldest);
        }
        map.insert(
            id.clone(),
            Session {
                token,
                csrf: random(),
                created: Instant::now(),
            },
        );
        id
    }

    /// The live session of the request's cookie.
    pub fn get(&self, req: &HttpRequest) -> Option<Session> {
        let id = cookie(req)?;
        let map = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(&id)
            .filter(|s| s.created.elapsed() < LIFETIME)
            .cloned()
    }

    /// Ends the request's session.
    pub fn close(&self, req: &HttpRequest) {
        if let Some(id) = cookie(req) {
            self.map
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
        }
    }
}

fn cookie(req: &HttpRequest) -> Option<String> {
    req.headers()
        .get_all("cookie")
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_owned())
}

/// The `Set-Cookie` value of a session.
pub fn set_cookie(id: &str, secure: bool) -> String {
    format!(
        "{COOKIE}={id}; Path=/panel; HttpOnly; SameSite=Strict; Max-Age={}{}",
        LIFETIME.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// The `Set-Cookie` value that removes the session cookie.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/panel; HttpOnly; SameSite=Strict; Max-Age=0")
}

/// `None` when the request comes from this site; otherwise why it is refused.
pub fn cross_site(req: &HttpRequest) -> Option<&'static str> {
    let header = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok());
    if let Some(site) = header("sec-fetch-site") {
        return (site != "same-origin").then_some("the request came from another site");
    }
    let Some(host) = header("host") else {
        return Some("the request names no Host");
    };
    match header("origin") {
        Some(origin) => {
            let origin_host = origin.split_once("://").map_or(origin, |(_, h)| h);
            (origin_host != host).then_some("the request came from another origin")
        }
        None => Some("the request carries neither Origin nor Sec-Fetch-Site"),
    }
}

/// True when `sent` is the session's CSRF token (compared in constant time).
pub fn csrf_ok(session: &Session, sent: Option<&str>) -> bool {
    sent.is_some_and(|s| bool::from(s.as_bytes().ct_eq(session.csrf.as_bytes())))
}
