//! The panel's actions: each is a confirm page (what will happen, to how many, with a reason
//! field) and an apply step. Both are POSTs carrying the session's CSRF token.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, web};

use super::pages::{filter_fields, filter_of};
use super::{Form, PanelError, PanelUser, State, html, views};
use crate::store::{EventFilter, EventState, MAX_BULK, Selection};

type User = web::ReqData<PanelUser>;

fn partitions_of(form: &Form) -> Result<Vec<i32>, PanelError> {
    let list: Vec<i32> = form
        .all("partition")
        .iter()
        .map(|p| {
            p.parse()
                .map_err(|_| PanelError::bad(format!("{p:?} is not a partition")))
        })
        .collect::<Result<_, _>>()?;
    if list.is_empty() {
        return Err(PanelError::bad("select at least one partition"));
    }
    Ok(list)
}

fn pause_of(form: &Form) -> Result<bool, PanelError> {
    match form.get("action") {
        Some("pause") => Ok(true),
        Some("resume") => Ok(false),
        _ => Err(PanelError::bad("choose pause or resume")),
    }
}

/// `POST /panel/partitions/confirm`.
pub async fn partitions_confirm(user: User, body: web::Bytes) -> Result<HttpResponse, PanelError> {
    let form = Form::checked(&user, &body)?;
    let list = partitions_of(&form)?;
    let pause = pause_of(&form)?;
    let verb = if pause { "Pause" } else { "Resume" };
    let mut hidden: Vec<(String, String)> = list
        .iter()
        .map(|p| ("partition".to_owned(), p.to_string()))
        .collect();
    hidden.push((
        "action".to_owned(),
        if pause { "pause" } else { "resume" }.to_owned(),
    ));
    let page = views::Confirm {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        heading: format!("{verb} {} partition(s)?", list.len()),
        text: format!(
            "{verb} partitions {}: their owner applies it at its next heartbeat.",
            list.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        action: "/panel/partitions/apply",
        hidden,
        needs_reason: false,
        button: verb.to_owned(),
        back: "/panel/partitions".to_owned(),
    };
    Ok(html(StatusCode::OK, &page))
}

/// `POST /panel/partitions/apply`.
pub async fn partitions_apply(
    state: State,
    user: User,
    body: web::Bytes,
) -> Result<HttpResponse, PanelError> {
    let form = Form::checked(&user, &body)?;
    let list = partitions_of(&form)?;
    let pause = pause_of(&form)?;
    let count = i32::try_from(state.store.partition_count().await?).unwrap_or(i32::MAX);
    if let Some(bad) = list.iter().find(|p| !(0..count).contains(*p)) {
        return Err(PanelError::bad(format!("there is no partition {bad}")));
    }
    let changed = state
        .store
        .pause_partitions(&user.actor, &list, pause)
        .await?;
    Ok(message(
        &user,
        "Done",
        format!(
            "{} {} partition(s).",
            if pause { "Paused" } else { "Resumed" },
            changed.len()
        ),
        "/panel/partitions",
    ))
}

fn message(user: &PanelUser, heading: &str, text: String, back: &str) -> HttpResponse {
    html(
        StatusCode::OK,
        &views::Message {
            who: user.who(),
            csrf: user.session.csrf.clone(),
            heading: heading.to_owned(),
            text,
            class: "ok",
            back: back.to_owned(),
        },
    )
}

/// What a dead-letter form asks for: the action, and the selection with the filter fields.
struct Asked {
    replay: bool,
    all: bool,
    ids: Vec<uuid::Uuid>,
    filter: EventFilter,
    fields: Vec<(&'static str, String)>,
}

fn asked(form: &Form) -> Result<Asked, PanelError> {
    let (replay, all) = match form.get("action") {
        Some("replay") => (true, false),
        Some("discard") => (false, false),
        Some("replay-all") => (true, true),
        Some("discard-all") => (false, true),
        _ => return Err(PanelError::bad("choose replay or discard")),
    };
    let ids = form
        .all("id")
        .iter()
        .map(|i| {
            i.parse()
                .map_err(|_| PanelError::bad(format!("{i:?} is not an event id")))
        })
        .collect::<Result<Vec<uuid::Uuid>, _>>()?;
    if !all && ids.is_empty() {
        return Err(PanelError::bad(
            "select at least one event (or act on all matching)",
        ));
    }
    let (filter, typed) = filter_of(form)?;
    let filter = EventFilter {
        state: Some(EventState::Quarantined),
        ..filter
    };
    Ok(Asked {
        replay,
        all,
        ids,
        filter,
        fields: filter_fields(&typed),
    })
}

/// `POST /panel/dead-letters/confirm`: what will happen to how many.
pub async fn dead_letters_confirm(
    state: State,
    user: User,
    body: web::Bytes,
) -> Result<HttpResponse, PanelError> {
    let form = Form::checked(&user, &body)?;
    let a = asked(&form)?;
    let verb = if a.replay { "Replay" } else { "Discard" };
    let what = if a.replay {
        "published again with the same event ids; the held events of their aggregates follow in order"
    } else {
        "discarded for good; the held events of their aggregates go on without them"
    };
    let mut hidden: Vec<(String, String)> = Vec::new();
    let (heading, text) = if a.all {
        let n = state
            .store
            .count_events(&a.filter, MAX_BULK + 1)
            .await?
            .rows;
        if n > MAX_BULK {
            return Err(PanelError::bad(format!(
                "more than {MAX_BULK} events match: narrow the filter"
            )));
        }
        hidden.extend(a.fields.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        hidden.push(("expected".to_owned(), n.to_string()));
        (
            format!("{verb} all {n} matching quarantined event(s)?"),
            format!("All {n} quarantined events matching the filter will be {what}."),
        )
    } else {
        hidden.extend(a.ids.iter().map(|i| ("id".to_owned(), i.to_string())));
        (
            format!("{verb} {} event(s)?", a.ids.len()),
            format!("The {} selected event(s) will be {what}.", a.ids.len()),
        )
    };
    let action = match (a.replay, a.all) {
        (true, false) => "replay",
        (false, false) => "discard",
        (true, true) => "replay-all",
        (false, true) => "discard-all",
    };
    hidden.push(("action".to_owned(), action.to_owned()));
    let page = views::Confirm {
        who: user.who(),
        csrf: user.session.csrf.clone(),
        heading,
        text,
        action: "/panel/dead-letters/apply",
        hidden,
        needs_reason: true,
        button: verb.to_owned(),
        back: "/panel/dead-letters".to_owned(),
    };
    Ok(html(StatusCode::OK, &page))
}

/// `POST /panel/dead-letters/apply`.
pub async fn dead_letters_apply(
    state: State,
    user: User,
    body: web::Bytes,
) -> Result<HttpResponse, PanelError> {
    let form = Form::checked(&user, &body)?;
    let a = asked(&form)?;
    let selection = if a.all {
        let expected = form
            .get("expected")
            .and_then(|e| e.parse().ok())
            .ok_or_else(|| PanelError::bad("the confirmed count is missing: start again"))?;
        Selection::Matching {
            filter: a.filter,
            expected,
        }
    } else {
        Selection::Ids(a.ids)
    };
    let reason = form.get("reason").unwrap_or_default();
    let outcome = if a.replay {
        state
            .store
            .replay_events(&user.actor, &selection, reason)
            .await?
    } else {
        state
            .store
            .discard_events(&user.actor, &selection, reason)
            .await?
    };
    Ok(message(
        &user,
        "Done",
        format!(
            "{} {} event(s); {} held event(s) of their aggregates released.",
            if a.replay { "Replayed" } else { "Discarded" },
            outcome.events,
            outcome.released
        ),
        "/panel/dead-letters",
    ))
}
