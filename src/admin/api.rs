//! The JSON API, `/api/v1/...`: status, partitions, nodes, events, dead letters, the audit log,
//! the configuration and tokens. Every handler calls the same store function as the CLI; the
//! route table ([`super::routes`]) says which role each needs. The OpenAPI document
//! ([`ApiDoc`]) is generated from the annotations here.

use std::sync::Arc;

use actix_web::{HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;
use utoipa::OpenApi;

use super::ApiState;
use super::problem::ApiError;
use crate::store::{
    self, Actor, AuditQuery, COUNT_CAP, EventFilter, EventState, MAX_BULK, Role, Selection,
};

type State = web::Data<Arc<ApiState>>;
type Caller = web::ReqData<Actor>;

/// The OpenAPI 3 document of the API.
#[derive(OpenApi)]
#[openapi(
    info(title = "Outpost operator API", description = "Dead letters, partitions, audit log and \
        tokens. Authenticate with `Authorization: Bearer <token>`."),
    paths(
        status, partitions, pause, resume, nodes, events, event, replay, discard, audit,
        configuration, tokens, create_token, revoke_token, openapi
    ),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
#[derive(Debug)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

fn ok(v: serde_json::Value) -> HttpResponse {
    HttpResponse::Ok().json(v)
}

/// Rows by state and the oldest undelivered age (as the nodes last counted them, every 15 s: a
/// poll never scans the outbox nor walks the head of its ready index), quarantined events by
/// code and the publish rate (both read now).
#[utoipa::path(get, path = "/api/v1/status", responses(
    (status = 200, description = "Backlog figures", body = Object)))]
pub async fn status(state: State) -> Result<HttpResponse, ApiError> {
    let o = state.store.overview().await?;
    Ok(ok(json!({
        "by_state": o.backlog.by_status.iter()
            .map(|s| (s.status.clone(), json!(s.rows)))
            .collect::<serde_json::Map<_, _>>(),
        "by_state_counted_every_secs": crate::dispatch::supervisor::BACKLOG_EVERY.as_secs(),
        "counted_secs_ago": o.backlog.counted_secs_ago,
        "published_estimated": o.backlog.by_status.iter()
            .any(|s| s.status == "published" && s.rows >= store::PUBLISHED_COUNTED_UP_TO),
        "quarantined_by_code": o.quarantined_by_code.iter()
            .map(|(c, n)| (c.clone(), json!(n)))
            .collect::<serde_json::Map<_, _>>(),
        "oldest_pending_age_secs": o.backlog.oldest_pending_age_secs,
        "publish_rate_per_sec": o.publish_rate,
        "nodes": o.nodes.len(),
    })))
}

/// Every partition: ready rows, owner, epoch, paused.
#[utoipa::path(get, path = "/api/v1/partitions", responses(
    (status = 200, description = "Partitions", body = Object)))]
pub async fn partitions(state: State) -> Result<HttpResponse, ApiError> {
    let list: Vec<_> = state
        .store
        .partitions_status()
        .await?
        .iter()
        .map(|p| {
            json!({"partition": p.partition, "ready": p.ready, "owner": p.owner,
                   "epoch": p.epoch, "paused": p.paused})
        })
        .collect();
    Ok(ok(json!({ "partitions": list })))
}

/// Partitions to pause or resume.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionsBody {
    /// Partition numbers.
    #[serde(default)]
    partitions: Vec<i32>,
    /// Every partition.
    #[serde(default)]
    all: bool,
}

async fn set_paused(
    state: &ApiState,
    actor: &Actor,
    body: PartitionsBody,
    paused: bool,
) -> Result<HttpResponse, ApiError> {
    let count = i32::try_from(state.store.partition_count().await?).unwrap_or(i32::MAX);
    let list: Vec<i32> = if body.all {
        (0..count).collect()
    } else {
        body.partitions
    };
    if list.is_empty() {
        return Err(ApiError::bad_request(
            "name the partitions (\"partitions\": [3, 7]) or \"all\": true",
        ));
    }
    if let Some(bad) = list.iter().find(|p| !(0..count).contains(*p)) {
        return Err(ApiError::bad_request(format!(
            "there is no partition {bad}: partitions are numbered 0 to {}",
            count - 1
        )));
    }
    let changed = state.store.pause_partitions(actor, &list, paused).await?;
    Ok(ok(json!({ "requested": list, "changed": changed })))
}

/// Pauses partitions (their owner applies it at its next heartbeat). Operator.
#[utoipa::path(post, path = "/api/v1/partitions/pause", request_body = Object, responses(
    (status = 200, description = "Partitions whose state changed", body = Object)))]
pub async fn pause(
    state: State,
    actor: Caller,
    body: web::Json<PartitionsBody>,
) -> Result<HttpResponse, ApiError> {
    set_paused(&state, &actor, body.into_inner(), true).await
}

/// Resumes partitions. Operator.
#[utoipa::path(post, path = "/api/v1/partitions/resume", request_body = Object, responses(
    (status = 200, description = "Partitions whose state changed", body = Object)))]
pub async fn resume(
    state: State,
    actor: Caller,
    body: web::Json<PartitionsBody>,
) -> Result<HttpResponse, ApiError> {
    set_paused(&state, &actor, body.into_inner(), false).await
}

/// Relay nodes with their heartbeat age and leases.
#[utoipa::path(get, path = "/api/v1/nodes", responses(
    (status = 200, description = "Nodes", body = Object)))]
pub async fn nodes(state: State) -> Result<HttpResponse, ApiError> {
    let list: Vec<_> = state
        .store
        .nodes_status()
        .await?
        .iter()
        .map(|n| {
            json!({"node_id": n.node_id, "hostname": n.hostname, "pid": n.pid,
                   "version": n.version, "heartbeat_age_secs": n.heartbeat_age_secs,
                   "leases": n.leases})
        })
        .collect();
    Ok(ok(json!({ "nodes": list })))
}

/// Search filters as query parameters.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventQuery {
    state: Option<String>,
    destination: Option<String>,
    event_type: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    error_code: Option<String>,
    recorded_from: Option<String>,
    recorded_to: Option<String>,
    after: Option<i64>,
    limit: Option<u32>,
}

fn time(name: &str, v: Option<&String>) -> Result<Option<DateTime<Utc>>, ApiError> {
    v.map(|t| {
        DateTime::parse_from_rfc3339(t)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| {
                ApiError::bad_request(format!(
                    "{name} is not an RFC 3339 time ({e}); e.g. 2026-12-06T10:00:00Z"
                ))
            })
    })
    .transpose()
}

impl EventQuery {
    fn filter(&self) -> Result<EventFilter, ApiError> {
        let state = self
            .state
            .as_deref()
            .map(str::parse::<EventState>)
            .transpose()
            .map_err(ApiError::bad_request)?;
        Ok(EventFilter {
            state,
            destination: self.destination.clone(),
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            error_code: self.error_code.clone(),
            recorded_from: time("recorded_from", self.recorded_from.as_ref())?,
            recorded_to: time("recorded_to", self.recorded_to.as_ref())?,
        })
    }
}

/// Events matching filters, one keyset page (`after` = the previous page's `next_after`), with
/// the count of matches (exact up to 10,000, `capped` above).
#[utoipa::path(get, path = "/api/v1/events", params(
    ("state" = Option<String>, Query, description = "pending, retry_wait, held, quarantined, discarded, no_destination"),
    ("destination" = Option<String>, Query, description = "Explicit destination"),
    ("event_type" = Option<String>, Query, description = "Event type"),
    ("aggregate_type" = Option<String>, Query, description = "Aggregate type"),
    ("aggregate_id" = Option<String>, Query, description = "Aggregate id (with aggregate_type)"),
    ("error_code" = Option<String>, Query, description = "Failure code: WRONGTYPE, UNROUTABLE, …"),
    ("recorded_from" = Option<String>, Query, description = "RFC 3339, inclusive"),
    ("recorded_to" = Option<String>, Query, description = "RFC 3339, exclusive"),
    ("after" = Option<i64>, Query, description = "Row id of the previous page's last event"),
    ("limit" = Option<u32>, Query, description = "1 to 500, 50 by default"),
), responses((status = 200, description = "A page of events", body = Object)))]
pub async fn events(state: State, q: web::Query<EventQuery>) -> Result<HttpResponse, ApiError> {
    let filter = q.filter()?;
    let page = state
        .store
        .search_events(&filter, q.after, q.limit.unwrap_or(50))
        .await?;
    let matching = state.store.count_events(&filter, COUNT_CAP).await?;
    Ok(ok(json!({
        "events": page.events,
        "next_after": page.next_after,
        "matching": matching,
    })))
}

/// One event whole: payload, headers, trace context, attempts, last error and its code.
#[utoipa::path(get, path = "/api/v1/events/{event_id}",
    params(("event_id" = String, Path, description = "Event id (UUID)")),
    responses((status = 200, description = "The event", body = Object),
              (status = 404, description = "No such event")))]
pub async fn event(state: State, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let id: uuid::Uuid = id
        .parse()
        .map_err(|_| ApiError::bad_request(format!("{id:?} is not an event id (a UUID)")))?;
    match state.store.event_detail(id).await? {
        Some(e) => Ok(HttpResponse::Ok().json(e)),
        None => Err(ApiError::not_found(format!(
            "no event {id} in the outbox or the published history (it may have aged out)"
        ))),
    }
}

/// A dead-letter action: `ids`, or a `filter` with the `expected` count the operator confirmed.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionBody {
    ids: Option<Vec<uuid::Uuid>>,
    filter: Option<EventQuery>,
    expected: Option<u64>,
    reason: String,
}

impl ActionBody {
    fn selection(&self) -> Result<Selection, ApiError> {
        match (&self.ids, &self.filter, self.expected) {
            (Some(ids), None, None) => Ok(Selection::Ids(ids.clone())),
            (None, Some(f), Some(expected)) if expected <= MAX_BULK => Ok(Selection::Matching {
                filter: f.filter()?,
                expected,
            }),
            _ => Err(ApiError::bad_request(format!(
                "send either \"ids\": [event ids], or \"filter\": {{…}} with \"expected\": the \
                 count of matching events you confirmed (at most {MAX_BULK})"
            ))),
        }
    }
}

/// Replays quarantined events (same event ids; held successors after them). Operator.
#[utoipa::path(post, path = "/api/v1/dead-letters/replay", request_body = Object, responses(
    (status = 200, description = "Events replayed and successors released", body = Object),
    (status = 409, description = "Not quarantined, or the count changed: nothing was changed")))]
pub async fn replay(
    state: State,
    actor: Caller,
    body: web::Json<ActionBody>,
) -> Result<HttpResponse, ApiError> {
    settle(&state, &actor, &body, true).await
}

async fn settle(
    state: &ApiState,
    actor: &Actor,
    body: &ActionBody,
    replay: bool,
) -> Result<HttpResponse, ApiError> {
    let selection = body.selection()?;
    let outcome = if replay {
        state
            .store
            .replay_events(actor, &selection, &body.reason)
            .await?
    } else {
        state
            .store
            .discard_events(actor, &selection, &body.reason)
            .await?
    };
    Ok(HttpResponse::Ok().json(outcome))
}

/// Discards quarantined events for good. Operator.
#[utoipa::path(post, path = "/api/v1/dead-letters/discard", request_body = Object, responses(
    (status = 200, description = "Events discarded and successors released", body = Object),
    (status = 409, description = "Not quarantined, or the count changed: nothing was changed")))]
pub async fn discard(
    state: State,
    actor: Caller,
    body: web::Json<ActionBody>,
) -> Result<HttpResponse, ApiError> {
    settle(&state, &actor, &body, false).await
}

/// The audit log, newest first (`before` = the last id of the previous page).
#[utoipa::path(get, path = "/api/v1/audit", params(
    ("action" = Option<String>, Query, description = "event.replay, event.discard, partition.pause, …"),
    ("actor" = Option<String>, Query, description = "Who"),
    ("before" = Option<i64>, Query, description = "Rows older than this id"),
    ("limit" = Option<u32>, Query, description = "1 to 1,000, 50 by default"),
), responses((status = 200, description = "Audit rows", body = Object)))]
pub async fn audit(state: State, q: web::Query<AuditQuery>) -> Result<HttpResponse, ApiError> {
    let rows = state.store.audit_log(&q).await?;
    Ok(ok(json!({ "audit": rows })))
}

/// The node's effective configuration, passwords redacted.
#[utoipa::path(get, path = "/api/v1/config", responses(
    (status = 200, description = "Configuration", body = Object)))]
pub async fn configuration(state: State) -> HttpResponse {
    HttpResponse::Ok().json(&state.config)
}

/// Every token (never its secret). Admin.
#[utoipa::path(get, path = "/api/v1/tokens", responses(
    (status = 200, description = "Tokens", body = Object)))]
pub async fn tokens(state: State, actor: Caller) -> Result<HttpResponse, ApiError> {
    let list = state.store.list_tokens(&actor).await?;
    Ok(ok(json!({ "tokens": list })))
}

/// A token to create.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTokenBody {
    name: String,
    role: Role,
}

/// Creates a token; the answer holds it, the only time it is shown. Admin.
#[utoipa::path(post, path = "/api/v1/tokens", request_body = Object, responses(
    (status = 201, description = "The token, shown once", body = Object)))]
pub async fn create_token(
    state: State,
    actor: Caller,
    body: web::Json<NewTokenBody>,
) -> Result<HttpResponse, ApiError> {
    let created = state
        .store
        .create_token(&actor, &body.name, body.role)
        .await?;
    Ok(HttpResponse::Created().json(json!({ "token": created.token, "info": created.info })))
}

/// Revokes the live token with this name. Admin.
#[utoipa::path(delete, path = "/api/v1/tokens/{name}",
    params(("name" = String, Path, description = "The token's name")),
    responses((status = 200, description = "Revoked", body = Object),
              (status = 404, description = "No live token of that name")))]
pub async fn revoke_token(
    state: State,
    actor: Caller,
    name: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let info = state.store.revoke_token(&actor, &name).await?;
    Ok(ok(json!({ "revoked": info })))
}

/// This document.
#[utoipa::path(get, path = "/api/v1/openapi.json", security(()), responses(
    (status = 200, description = "OpenAPI 3 document", body = Object)))]
pub async fn openapi() -> HttpResponse {
    HttpResponse::Ok().json(ApiDoc::openapi())
}
