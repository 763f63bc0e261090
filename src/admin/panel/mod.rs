//! The operator panel under `/panel`: server-rendered HTML (askama templates compiled into the
//! binary, one stylesheet, no JavaScript), readable in any browser. Pages: overview, partitions,
//! events (search and detail), dead letters (select, replay or discard, by selection or all
//! matching), audit log, configuration. Every action goes through a confirm page, and calls the
//! same store function as the CLI and the JSON API.
//!
//! - `session`: log-in sessions, the cookie, CSRF tokens and the origin check.
//! - `views`: the templates.
//! - `pages`: the read-only pages; `actions`: the confirm and apply steps.

pub mod actions;
pub mod pages;
pub mod session;
pub mod views;

use std::sync::Arc;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError, web};
use askama::Template;

use super::ApiState;
use super::problem::ApiError;
use crate::store::{Actor, Role, StoreError};
use session::Session;

type State = web::Data<Arc<ApiState>>;

/// The logged-in user of a panel request.
#[derive(Debug, Clone)]
pub struct PanelUser {
    /// Who, with which role.
    pub actor: Actor,
    /// The session (for its CSRF token).
    pub session: Session,
}

impl PanelUser {
    fn who(&self) -> String {
        format!("{} ({})", self.actor.name, self.actor.role)
    }
}

/// A page that could not be shown, as HTML.
#[derive(Debug, thiserror::Error)]
#[error("{text}")]
pub struct PanelError {
    status: StatusCode,
    heading: &'static str,
    text: String,
}

impl PanelError {
    fn new(status: StatusCode, heading: &'static str, text: impl Into<String>) -> Self {
        Self {
            status,
            heading,
            text: text.into(),
        }
    }

    fn bad(text: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "That did not work", text)
    }
}

impl From<StoreError> for PanelError {
    fn from(e: StoreError) -> Self {
        let api = ApiError::from(e);
        Self::new(api.status, api.title, api.detail)
    }
}

impl ResponseError for PanelError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let page = views::Message {
            who: String::new(),
            csrf: String::new(),
            heading: self.heading.to_owned(),
            text: self.text.clone(),
            class: "error",
            back: "/panel".to_owned(),
        };
        html(self.status, &page)
    }
}

/// Renders a page.
fn html(status: StatusCode, page: &impl Template) -> HttpResponse {
    match page.render() {
        Ok(body) => HttpResponse::build(status)
            .content_type("text/html; charset=utf-8")
            .body(body),
        Err(e) => {
            tracing::error!(error = %e, "panel: a page did not render");
            HttpResponse::InternalServerError()
                .content_type("text/plain; charset=utf-8")
                .body("the page did not render; the node's log has the error")
        }
    }
}

fn see_other(to: &str) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header(("Location", to))
        .finish()
}

/// The middleware of a panel page that needs `needed`: a live session whose token still
/// authenticates (else to the login page), the role, and for a POST the origin check (the CSRF
/// token is checked by the handler, which reads the form).
pub async fn require(
    needed: Role,
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let Some(state) = req.app_data::<State>().cloned() else {
        return Ok(req.into_response(HttpResponse::NotFound().finish()));
    };
    let http = req.request().clone();
    let user = match authorize(&state, &http, needed).await {
        Ok(Some(u)) => u,
        Ok(None) => return Ok(req.into_response(see_other("/panel/login"))),
        Err(e) => return Ok(req.error_response(e)),
    };
    req.extensions_mut().insert(user);
    next.call(req).await.map(|r| r.map_body(|_, b| b.boxed()))
}

async fn authorize(
    state: &ApiState,
    http: &HttpRequest,
    needed: Role,
) -> Result<Option<PanelUser>, PanelError> {
    if let Some(addr) = http.peer_addr() {
        state
            .limits
            .check_address(addr.ip())
            .map_err(|e| PanelError::new(e.status, "Slow down", e.detail))?;
    }
    let Some(session) = state.sessions.get(http) else {
        return Ok(None);
    };
    let Some(actor) = state.store.authenticate(&session.token).await? else {
        state.sessions.close(http);
        return Ok(None);
    };
    let action = format!(
        "{} {}",
        http.method(),
        http.match_pattern().unwrap_or_default()
    );
    if http.method() == actix_web::http::Method::POST
        && let Some(why) = session::cross_site(http)
    {
        let e = crate::store::operator::audit::refuse(&actor, &action, "input", why.to_owned());
        return Err(PanelError::new(
            StatusCode::FORBIDDEN,
            "Refused",
            e.to_string(),
        ));
    }
    actor
        .require(needed, &action)
        .map_err(|e| PanelError::new(StatusCode::FORBIDDEN, "Not allowed", e.to_string()))?;
    Ok(Some(PanelUser { actor, session }))
}

/// A submitted form (`application/x-www-form-urlencoded`), with repeated names kept.
#[derive(Debug, Default)]
pub struct Form(Vec<(String, String)>);

impl Form {
    fn parse(body: &[u8]) -> Self {
        Self(
            url::form_urlencoded::parse(body)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    /// The first non-empty value of `name`.
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, v)| k == name && !v.trim().is_empty())
            .map(|(_, v)| v.trim())
    }

    /// Every value of `name`.
    fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The form of a POST by `user`, refused unless it carries the session's CSRF token.
    fn checked(user: &PanelUser, body: &[u8]) -> Result<Self, PanelError> {
        let form = Self::parse(body);
        if session::csrf_ok(&user.session, form.get("csrf")) {
            Ok(form)
        } else {
            let e = crate::store::operator::audit::refuse(
                &user.actor,
                "panel form",
                "input",
                "the form's CSRF token is missing or wrong; reload the page and try again"
                    .to_owned(),
            );
            Err(PanelError::new(
                StatusCode::FORBIDDEN,
                "Refused",
                e.to_string(),
            ))
        }
    }
}

/// `GET /panel/static/panel.css`.
pub async fn stylesheet() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/css; charset=utf-8")
        .body(include_str!("../../../templates/panel.css"))
}

/// `GET /panel/login`.
pub async fn login_page() -> HttpResponse {
    html(
        StatusCode::OK,
        &views::Login {
            who: String::new(),
            csrf: String::new(),
            error: String::new(),
        },
    )
}

/// `POST /panel/login`: a token in, a session cookie out.
pub async fn login(state: State, req: HttpRequest, body: web::Bytes) -> HttpResponse {
    let refuse = |status: StatusCode, error: &str| {
        html(
            status,
            &views::Login {
                who: String::new(),
                csrf: String::new(),
                error: error.to_owned(),
            },
        )
    };
    if let Some(why) = session::cross_site(&req) {
        return refuse(StatusCode::FORBIDDEN, &format!("Refused: {why}."));
    }
    if let Some(addr) = req.peer_addr()
        && let Err(e) = state.limits.check_address(addr.ip())
    {
        return refuse(StatusCode::TOO_MANY_REQUESTS, &e.detail);
    }
    let form = Form::parse(&body);
    let token = form.get("token").unwrap_or_default().to_owned();
    match state.store.authenticate(&token).await {
        Ok(Some(_)) => {
            let id = state.sessions.open(token);
            HttpResponse::SeeOther()
                .insert_header(("Location", "/panel"))
                .insert_header(("Set-Cookie", session::set_cookie(&id, state.cookie_secure)))
                .finish()
        }
        Ok(None) => refuse(
            StatusCode::UNAUTHORIZED,
            "That token is not valid (mistyped, revoked or unknown).",
        ),
        Err(e) => PanelError::from(e).error_response(),
    }
}

/// `POST /panel/logout`.
pub async fn logout(
    state: State,
    req: HttpRequest,
    user: web::ReqData<PanelUser>,
    body: web::Bytes,
) -> Result<HttpResponse, PanelError> {
    Form::checked(&user, &body)?;
    state.sessions.close(&req);
    Ok(HttpResponse::SeeOther()
        .insert_header(("Location", "/panel/login"))
        .insert_header(("Set-Cookie", session::clear_cookie()))
        .finish())
}
