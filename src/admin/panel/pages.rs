//! The panel's read-only pages.

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};

use super::views::{self, EventRow, FilterForm, age, utc};
use super::{Form, PanelError, PanelUser, State, html};
use crate::store::{self, AuditQuery, COUNT_CAP, EventFilter, EventState, Role};

type User = web::ReqData<PanelUser>;

/// `GET /panel`: backlog, oldest undelivered age, quarantined by code, nodes.
pub async fn overview(state: State, user: User) -> Result<HttpResponse, PanelError> {
    let store::Overview {
        backlog: figures,
        nodes,
        quarantined_by_code: codes,
        publish_rate: rate,
    } = state.store.overview().await?;
    let rows = |s: &str| {
        figures
            .by_status
            .iter()
            .find(|c| c.status == s)
            .map_or(0, |c| c.rows)
    };
    let page = views::Overview {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        oldest: figures
            .oldest_pending_age_secs
            .map_or_else(|| "none".to_owned(), |s| format!("{s:.1} s")),
        counted: figures.counted_secs_ago.map_or_else(
            || "not counted yet: a node counts once it has worked".to_owned(),
            |s| format!("counted {s:.0} s ago"),
        ),
        backlog: rows("pending") + rows("retry_wait") + rows("held"),
        quarantined: codes.iter().map(|(_, n)| n).sum(),
        publish_rate: format!("{rate:.0}/s"),
        states: figures
            .by_status
            .iter()
            .map(|s| {
                let estimated = s.status == "published" && s.rows >= store::PUBLISHED_COUNTED_UP_TO;
                let name = if estimated {
                    format!("{} (estimated)", s.status)
                } else {
                    s.status.clone()
                };
                (name, s.rows)
            })
            .collect(),
        codes,
        nodes: nodes
            .iter()
            .map(|n| {
                (
                    n.node_id.clone(),
                    n.hostname.clone(),
                    n.leases,
                    format!("{:.1} s ago", n.heartbeat_age_secs),
                    n.version.clone(),
                )
            })
            .collect(),
    };
    Ok(html(StatusCode::OK, &page))
}

/// `GET /panel/partitions`.
pub async fn partitions(state: State, user: User) -> Result<HttpResponse, PanelError> {
    let partitions = state.store.partitions_status().await?;
    let page = views::Partitions {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        can_act: user.actor.role >= Role::Operator,
        rows: partitions
            .iter()
            .map(|p| {
                (
                    p.partition,
                    p.ready,
                    p.owner.clone().unwrap_or_else(|| "-".to_owned()),
                    p.epoch,
                    p.paused,
                )
            })
            .collect(),
    };
    Ok(html(StatusCode::OK, &page))
}

/// The filter typed into a form (or carried in hidden fields): empty fields are unset.
pub fn filter_of(form: &Form) -> Result<(EventFilter, FilterForm), PanelError> {
    let text = |n: &str| form.get(n).map(str::to_owned);
    let time = |n: &str| {
        form.get(n)
            .map(|t| {
                chrono::DateTime::parse_from_rfc3339(t)
                    .map(|t| t.with_timezone(&chrono::Utc))
                    .map_err(|e| {
                        PanelError::bad(format!(
                            "{n} is not an RFC 3339 time ({e}); e.g. 2026-12-06T10:00:00Z"
                        ))
                    })
            })
            .transpose()
    };
    let state = form
        .get("state")
        .filter(|s| *s != "any")
        .map(str::parse::<EventState>)
        .transpose()
        .map_err(PanelError::bad)?;
    let filter = EventFilter {
        state,
        destination: text("destination"),
        event_type: text("event_type"),
        aggregate_type: text("aggregate_type"),
        aggregate_id: text("aggregate_id"),
        error_code: text("error_code"),
        recorded_from: time("recorded_from")?,
        recorded_to: time("recorded_to")?,
    };
    let shown = |n: &str| form.get(n).unwrap_or_default().to_owned();
    let typed = FilterForm {
        aggregate_type: shown("aggregate_type"),
        aggregate_id: shown("aggregate_id"),
        event_type: shown("event_type"),
        error_code: shown("error_code"),
        destination: shown("destination"),
        recorded_from: shown("recorded_from"),
        recorded_to: shown("recorded_to"),
    };
    Ok((filter, typed))
}

/// The fields that carry a filter to the next step.
pub fn filter_fields(f: &FilterForm) -> Vec<(&'static str, String)> {
    [
        ("aggregate_type", &f.aggregate_type),
        ("aggregate_id", &f.aggregate_id),
        ("event_type", &f.event_type),
        ("error_code", &f.error_code),
        ("destination", &f.destination),
        ("recorded_from", &f.recorded_from),
        ("recorded_to", &f.recorded_to),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(k, v)| (k, v.clone()))
    .collect()
}

async fn list(
    state: State,
    user: User,
    req: HttpRequest,
    dead: bool,
) -> Result<HttpResponse, PanelError> {
    let form = Form::parse(req.query_string().as_bytes());
    let (mut filter, typed) = filter_of(&form)?;
    if dead {
        filter.state = Some(EventState::Quarantined);
    }
    let after = form.get("after").and_then(|a| a.parse().ok());
    let page = state.store.search_events(&filter, after, 50).await?;
    let count = state.store.count_events(&filter, COUNT_CAP).await?;
    let here = if dead {
        "/panel/dead-letters"
    } else {
        "/panel/events"
    };
    let next = page.next_after.map_or_else(String::new, |a| {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in filter_fields(&typed) {
            q.append_pair(k, &v);
        }
        if let Some(s) = filter.state.filter(|_| !dead) {
            q.append_pair("state", s.as_str());
        }
        q.append_pair("after", &a.to_string());
        format!("{here}?{}", q.finish())
    });
    let chosen = filter.state.map_or("any", EventState::as_str);
    let page = views::Events {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        heading: if dead { "Dead letters" } else { "Events" },
        here,
        dead,
        can_act: dead && user.actor.role >= Role::Operator,
        states: std::iter::once("any")
            .chain(EventState::ALL.iter().map(|s| s.as_str()))
            .map(|s| (s, s == chosen))
            .collect(),
        matching: format!(
            "{}{} matching event(s){}",
            if count.capped { "at least " } else { "" },
            count.rows,
            if dead { " in quarantine" } else { "" }
        ),
        rows: page.events.iter().map(row).collect(),
        hidden: filter_fields(&typed),
        f: typed,
        next,
    };
    Ok(html(StatusCode::OK, &page))
}

fn row(e: &store::EventSummary) -> EventRow {
    let id = e.event_id.to_string();
    EventRow {
        // The last group of the hyphenated form (36 ASCII characters): random bits, unlike the
        // first ones, which are the recording time and alike for every event of a minute.
        short_id: id[24..].to_owned(),
        event_id: id,
        state: e.state.clone(),
        code: e.error_code.clone().unwrap_or_default(),
        attempts: e.attempts,
        aggregate: format!(
            "{}/{} ({})",
            e.aggregate_type, e.aggregate_id, e.aggregate_seq
        ),
        event_type: e.event_type.clone(),
        recorded: utc(e.recorded_at),
        age: age(e.recorded_at),
    }
}

/// `GET /panel/events`: search.
pub async fn events(
    state: State,
    user: User,
    req: HttpRequest,
) -> Result<HttpResponse, PanelError> {
    list(state, user, req, false).await
}

/// `GET /panel/dead-letters`: quarantined events, to select and act on.
pub async fn dead_letters(
    state: State,
    user: User,
    req: HttpRequest,
) -> Result<HttpResponse, PanelError> {
    list(state, user, req, true).await
}

/// `GET /panel/events/{event_id}`: one event whole.
pub async fn event(
    state: State,
    user: User,
    id: web::Path<String>,
) -> Result<HttpResponse, PanelError> {
    let id: uuid::Uuid = id
        .parse()
        .map_err(|_| PanelError::bad(format!("{id:?} is not an event id (a UUID)")))?;
    let Some(e) = state.store.event_detail(id).await? else {
        return Err(PanelError::new(
            StatusCode::NOT_FOUND,
            "No such event",
            format!("no event {id} in the outbox or the published history (it may have aged out)"),
        ));
    };
    let s = &e.summary;
    let opt = |t: Option<chrono::DateTime<chrono::Utc>>| {
        t.map_or_else(|| "-".to_owned(), |t| format!("{} ({})", utc(t), age(t)))
    };
    let facts = vec![
        ("state", s.state.clone()),
        (
            "aggregate",
            format!("{}/{}", s.aggregate_type, s.aggregate_id),
        ),
        ("sequence", s.aggregate_seq.to_string()),
        ("partition", e.partition.to_string()),
        (
            "event type",
            format!("{} (schema {})", s.event_type, e.schema_version),
        ),
        (
            "recorded",
            format!("{} ({})", utc(s.recorded_at), age(s.recorded_at)),
        ),
        ("occurred", opt(e.occurred_at)),
        ("attempts", s.attempts.to_string()),
        (
            "error code",
            s.error_code.clone().unwrap_or_else(|| "-".to_owned()),
        ),
        (
            "last error",
            e.last_error.clone().unwrap_or_else(|| "-".to_owned()),
        ),
        (
            "destination",
            e.destination
                .clone()
                .unwrap_or_else(|| "(routing)".to_owned()),
        ),
        (
            "trace",
            e.trace
                .as_ref()
                .map_or_else(|| "-".to_owned(), |t| t.traceparent.clone()),
        ),
        ("published", opt(e.published_at)),
        (
            "stream entry",
            e.stream_id.clone().unwrap_or_else(|| "-".to_owned()),
        ),
    ];
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    let page = views::Event {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        event_id: id.to_string(),
        can_act: s.state == "quarantined" && user.actor.role >= Role::Operator,
        facts,
        headers: pretty(&e.headers),
        payload: pretty(&e.payload),
    };
    Ok(html(StatusCode::OK, &page))
}

/// `GET /panel/audit`.
pub async fn audit(state: State, user: User, req: HttpRequest) -> Result<HttpResponse, PanelError> {
    let form = Form::parse(req.query_string().as_bytes());
    let before = form.get("before").and_then(|b| b.parse().ok());
    let rows = state
        .store
        .audit_log(&AuditQuery {
            before,
            limit: Some(100),
            ..AuditQuery::default()
        })
        .await?;
    let next = match rows.last() {
        Some(last) if rows.len() == 100 => format!("/panel/audit?before={}", last.id),
        _ => String::new(),
    };
    let page = views::Audit {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        rows: rows
            .iter()
            .map(|r| views::AuditRow {
                id: r.id,
                at: utc(r.at),
                age: age(r.at),
                actor: r.actor.clone(),
                role: r.role.clone(),
                action: r.action.clone(),
                target: r.target.clone(),
                detail: r.detail.to_string(),
            })
            .collect(),
        next,
    };
    Ok(html(StatusCode::OK, &page))
}

/// `GET /panel/config`.
pub async fn config(state: State, user: User) -> HttpResponse {
    let page = views::ConfigPage {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        toml: state.config_toml.clone(),
    };
    html(StatusCode::OK, &page)
}
