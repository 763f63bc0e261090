//! Errors of the JSON API as `application/problem+json` (RFC 9457): a status, a title and a
//! detail that says what was wrong and how to go on. Database errors are logged in full and
//! answered without their text.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::store::StoreError;

/// An answer other than success.
#[derive(Debug, thiserror::Error)]
#[error("{title}: {detail}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Short, fixed summary of the kind of problem.
    pub title: &'static str,
    /// What was wrong and how to go on.
    pub detail: String,
    /// Seconds to wait, for 429.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A problem with `status`.
    pub fn new(status: StatusCode, title: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            title,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// 400: the request itself is wrong.
    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad request", detail)
    }

    /// 401: no token, or one that is not valid.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send a valid token as `Authorization: Bearer <token>` (create one with \
             `outpost admin token create --role viewer --name <who>`)",
        )
    }

    /// 404.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not found", detail)
    }

    /// 429 with the seconds to wait.
    pub fn too_many(retry_after: u64, who: &str) -> Self {
        Self {
            retry_after: Some(retry_after.max(1)),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too many requests",
                format!(
                    "{who} sent more requests than admin.requests_per_sec and admin.burst allow; \
                     retry after the seconds in Retry-After"
                ),
            )
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Refused { kind, message } => {
                let (status, title) = match kind {
                    "role" => (StatusCode::FORBIDDEN, "forbidden"),
                    "state" | "count" => (StatusCode::CONFLICT, "conflict"),
                    "not_found" => (StatusCode::NOT_FOUND, "not found"),
                    _ => (StatusCode::BAD_REQUEST, "bad request"),
                };
                Self::new(status, title, message)
            }
            e if e.is_transient() => {
                tracing::warn!(error = %e, "admin API: database unavailable");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database unavailable",
                    "the database did not answer; try again shortly",
                )
            }
            e => {
                tracing::error!(error = %e, "admin API: database error");
                Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error",
                    "the database refused the request; the node's log has the error",
                )
            }
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        r.content_type("application/problem+json");
        if let Some(s) = self.retry_after {
            r.insert_header(("Retry-After", s.to_string()));
        }
        r.body(
            json!({
                "type": "about:blank",
                "title": self.title,
                "status": self.status.as_u16(),
                "detail": self.detail,
            })
            .to_string(),
        )
    }
}
