//! Every route of the admin endpoint in one table: method, path, the least role it needs (none
//! for the health and metrics endpoints and the OpenAPI document) and its handler. The server
//! registers exactly this table; tests check the OpenAPI document and the role matrix against it.

use actix_web::middleware::from_fn;
use actix_web::web;

use super::panel::{self, actions, pages};
use super::{api, guard, health};
use crate::store::Role;

/// One route.
#[derive(Debug, Clone, Copy)]
pub struct RouteSpec {
    /// `GET`, `POST` or `DELETE`.
    pub method: &'static str,
    /// The path, with `{name}` for a path parameter.
    pub path: &'static str,
    /// The least role it needs; `None`: no token needed.
    pub role: Option<Role>,
    /// A panel page (a session cookie) rather than an API route (a bearer token).
    pub panel: bool,
    build: fn() -> actix_web::Route,
}

const fn route(
    method: &'static str,
    path: &'static str,
    role: Option<Role>,
    build: fn() -> actix_web::Route,
) -> RouteSpec {
    RouteSpec {
        method,
        path,
        role,
        panel: false,
        build,
    }
}

const fn page(
    method: &'static str,
    path: &'static str,
    role: Option<Role>,
    build: fn() -> actix_web::Route,
) -> RouteSpec {
    RouteSpec {
        method,
        path,
        role,
        panel: true,
        build,
    }
}

const V: Option<Role> = Some(Role::Viewer);
const O: Option<Role> = Some(Role::Operator);
const A: Option<Role> = Some(Role::Admin);

/// The routes, in the order they are registered.
pub const ROUTES: &[RouteSpec] = &[
    route("GET", "/metrics", None, || web::get().to(health::metrics)),
    route("GET", "/livez", None, || web::get().to(health::livez)),
    route("GET", "/readyz", None, || web::get().to(health::readyz)),
    route("GET", "/api/v1/openapi.json", None, || {
        web::get().to(api::openapi)
    }),
    route("GET", "/api/v1/status", V, || web::get().to(api::status)),
    route("GET", "/api/v1/partitions", V, || {
        web::get().to(api::partitions)
    }),
    route("POST", "/api/v1/partitions/pause", O, || {
        web::post().to(api::pause)
    }),
    route("POST", "/api/v1/partitions/resume", O, || {
        web::post().to(api::resume)
    }),
    route("GET", "/api/v1/nodes", V, || web::get().to(api::nodes)),
    route("GET", "/api/v1/events", V, || web::get().to(api::events)),
    route("GET", "/api/v1/events/{event_id}", V, || {
        web::get().to(api::event)
    }),
    route("POST", "/api/v1/dead-letters/replay", O, || {
        web::post().to(api::replay)
    }),
    route("POST", "/api/v1/dead-letters/discard", O, || {
        web::post().to(api::discard)
    }),
    route("GET", "/api/v1/audit", V, || web::get().to(api::audit)),
    route("GET", "/api/v1/config", V, || {
        web::get().to(api::configuration)
    }),
    route("GET", "/api/v1/tokens", A, || web::get().to(api::tokens)),
    route("POST", "/api/v1/tokens", A, || {
        web::post().to(api::create_token)
    }),
    route("DELETE", "/api/v1/tokens/{name}", A, || {
        web::delete().to(api::revoke_token)
    }),
    page("GET", "/panel/static/panel.css", None, || {
        web::get().to(panel::stylesheet)
    }),
    page("GET", "/panel/login", None, || {
        web::get().to(panel::login_page)
    }),
    page("POST", "/panel/login", None, || {
        web::post().to(panel::login)
    }),
    page("GET", "/panel", V, || web::get().to(pages::overview)),
    page("GET", "/panel/partitions", V, || {
        web::get().to(pages::partitions)
    }),
    page("POST", "/panel/partitions/confirm", O, || {
        web::post().to(actions::partitions_confirm)
    }),
    page("POST", "/panel/partitions/apply", O, || {
        web::post().to(actions::partitions_apply)
    }),
    page("GET", "/panel/events", V, || web::get().to(pages::events)),
    page("GET", "/panel/events/{event_id}", V, || {
        web::get().to(pages::event)
    }),
    page("GET", "/panel/dead-letters", V, || {
        web::get().to(pages::dead_letters)
    }),
    page("POST", "/panel/dead-letters/confirm", O, || {
        web::post().to(actions::dead_letters_confirm)
    }),
    page("POST", "/panel/dead-letters/apply", O, || {
        web::post().to(actions::dead_letters_apply)
    }),
    page("GET", "/panel/audit", V, || web::get().to(pages::audit)),
    page("GET", "/panel/config", V, || web::get().to(pages::config)),
    page("POST", "/panel/logout", V, || web::post().to(panel::logout)),
];

/// Registers [`ROUTES`]: one resource per path, each route behind the guard of its role.
pub fn register(cfg: &mut web::ServiceConfig) {
    let mut paths: Vec<&str> = Vec::new();
    for r in ROUTES {
        if !paths.contains(&r.path) {
            paths.push(r.path);
        }
    }
    for path in paths {
        let mut resource = web::resource(path);
        for r in ROUTES.iter().filter(|r| r.path == path) {
            let built = (r.build)();
            resource = resource.route(match (r.role, r.panel) {
                (Some(role), false) => {
                    built.wrap(from_fn(move |req, next| guard::require(role, req, next)))
                }
                (Some(role), true) => {
                    built.wrap(from_fn(move |req, next| panel::require(role, req, next)))
                }
                (None, _) => built,
            });
        }
        cfg.service(resource);
    }
}
