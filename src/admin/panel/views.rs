//! The panel's pages as askama templates (`templates/`), each a struct with what it shows. Every
//! page has `who` (empty before login) and `csrf` for the layout's log-out form.

use askama::Template;
use chrono::{DateTime, Utc};

/// How long ago `t` was, for people: "42 s ago", "5 min ago", "3 h ago", "2 d ago".
pub fn age(t: DateTime<Utc>) -> String {
    let secs = (Utc::now() - t).num_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s} s ago"),
        s if s < 7200 => format!("{} min ago", s / 60),
        s if s < 172_800 => format!("{} h ago", s / 3600),
        s => format!("{} d ago", s / 86_400),
    }
}

/// A time as shown: UTC to the second.
pub fn utc(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

#[derive(Template)]
#[template(path = "login.html")]
pub struct Login {
    pub who: String,
    pub csrf: String,
    pub error: String,
}

#[derive(Template)]
#[template(path = "message.html")]
pub struct Message {
    pub who: String,
    pub csrf: String,
    pub heading: String,
    pub text: String,
    /// `ok`, `error` or `warning`.
    pub class: &'static str,
    pub back: String,
}

#[derive(Template)]
#[template(path = "overview.html")]
pub struct Overview {
    pub who: String,
    pub csrf: String,
    pub oldest: String,
    /// When the nodes last counted the backlog.
    pub counted: String,
    pub backlog: i64,
    pub quarantined: i64,
    pub publish_rate: String,
    pub states: Vec<(String, i64)>,
    pub codes: Vec<(String, i64)>,
    /// node, host, leases, heartbeat age, version
    pub nodes: Vec<(String, String, i64, String, String)>,
}

#[derive(Template)]
#[template(path = "partitions.html")]
pub struct Partitions {
    pub who: String,
    pub csrf: String,
    pub can_act: bool,
    /// partition, ready, owner, epoch, paused
    pub rows: Vec<(i32, i64, String, i64, bool)>,
}

/// The filter form's values, as typed.
#[derive(Debug, Default, Clone)]
pub struct FilterForm {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub error_code: String,
    pub destination: String,
    pub recorded_from: String,
    pub recorded_to: String,
}

/// An event in a list.
pub struct EventRow {
    pub event_id: String,
    pub short_id: String,
    pub state: String,
    pub code: String,
    pub attempts: i32,
    pub aggregate: String,
    pub event_type: String,
    pub recorded: String,
    pub age: String,
}

#[derive(Template)]
#[template(path = "events.html")]
pub struct Events {
    pub who: String,
    pub csrf: String,
    pub heading: &'static str,
    pub here: &'static str,
    pub dead: bool,
    pub can_act: bool,
    pub states: Vec<(&'static str, bool)>,
    pub f: FilterForm,
    pub matching: String,
    pub rows: Vec<EventRow>,
    /// The filter, carried to the confirm step of an "all matching" action.
    pub hidden: Vec<(&'static str, String)>,
    pub next: String,
}

#[derive(Template)]
#[template(path = "event.html")]
pub struct Event {
    pub who: String,
    pub csrf: String,
    pub event_id: String,
    pub can_act: bool,
    pub facts: Vec<(&'static str, String)>,
    pub headers: String,
    pub payload: String,
}

#[derive(Template)]
#[template(path = "confirm.html")]
pub struct Confirm {
    pub who: String,
    pub csrf: String,
    pub heading: String,
    pub text: String,
    pub action: &'static str,
    pub hidden: Vec<(String, String)>,
    pub needs_reason: bool,
    pub button: String,
    pub back: String,
}

/// A row of the audit log as shown.
pub struct AuditRow {
    pub id: i64,
    pub at: String,
    pub age: String,
    pub actor: String,
    pub role: String,
    pub action: String,
    pub target: String,
    pub detail: String,
}

#[derive(Template)]
#[template(path = "audit.html")]
pub struct Audit {
    pub who: String,
    pub csrf: String,
    pub rows: Vec<AuditRow>,
    pub next: String,
}

#[derive(Template)]
#[template(path = "config.html")]
pub struct ConfigPage {
    pub who: String,
    pub csrf: String,
    pub toml: String,
}
