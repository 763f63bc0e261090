//! `outpost dead-letter list|show|replay|discard`: find quarantined events and put them right.

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};

use crate::config::Config;
use crate::store::{EventFilter, EventState, MAX_BULK, Selection, Store};

/// What to do with dead letters.
#[derive(Debug, Subcommand)]
pub enum DeadLetterAction {
    /// List events matching filters (quarantined ones unless --state says otherwise).
    List(ListArgs),
    /// Show one event whole: payload, headers, trace context, attempts, last error and its code.
    Show {
        /// The event id (`ce_id` in the stream).
        event_id: uuid::Uuid,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Publish quarantined events again, same event ids; their aggregates' held events follow.
    Replay(ActArgs),
    /// Give up on quarantined events for good; their aggregates' held events go on without them.
    Discard(ActArgs),
}

/// Filters shared by every subcommand.
#[derive(Debug, Args)]
pub struct FilterArgs {
    /// Delivery state: pending, retry_wait, held, quarantined, discarded, no_destination.
    #[arg(long)]
    state: Option<EventState>,
    /// The destination the producer set explicitly.
    #[arg(long)]
    destination: Option<String>,
    /// Event type.
    #[arg(long)]
    event_type: Option<String>,
    /// Aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Aggregate id (with --aggregate-type).
    #[arg(long, requires = "aggregate_type")]
    aggregate_id: Option<String>,
    /// Failure code, the first word of the last error (WRONGTYPE, UNROUTABLE, OVERSIZE, …).
    #[arg(long)]
    code: Option<String>,
    /// Recorded at or after this time (RFC 3339, e.g. 2026-12-06T10:00:00Z).
    #[arg(long)]
    since: Option<DateTime<Utc>>,
    /// Recorded before this time (RFC 3339).
    #[arg(long)]
    until: Option<DateTime<Utc>>,
}

impl FilterArgs {
    fn filter(&self, default_state: Option<EventState>) -> EventFilter {
        EventFilter {
            state: self.state.or(default_state),
            destination: self.destination.clone(),
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            error_code: self.code.clone(),
            recorded_from: self.since,
            recorded_to: self.until,
        }
    }
}

/// Options of `dead-letter list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Show events after this row id (the `next:` line of the previous page).
    #[arg(long)]
    after: Option<i64>,
    /// Events per page (1 to 500).
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Options of `dead-letter replay|discard`.
#[derive(Debug, Args)]
pub struct ActArgs {
    /// Event ids of quarantined events.
    #[arg(
        required_unless_present = "all_matching",
        conflicts_with = "all_matching"
    )]
    event_ids: Vec<uuid::Uuid>,
    /// Every quarantined event matching the filters: shows the count, and acts only with --yes.
    #[arg(long)]
    all_matching: bool,
    #[command(flatten)]
    filter: FilterArgs,
    /// Confirms an --all-matching action.
    #[arg(long)]
    yes: bool,
    /// With --all-matching: act only if exactly this many events match (the count shown before).
    #[arg(long)]
    expect: Option<u64>,
    /// Why (written to the audit log).
    #[arg(long)]
    reason: String,
}

pub(super) async fn run(config: &Config, action: DeadLetterAction) -> anyhow::Result<()> {
    let store = super::connect(config, "dead-letter").await?;
    match action {
        DeadLetterAction::List(args) => list(&store, args).await,
        DeadLetterAction::Show { event_id, json } => show(&store, event_id, json).await,
        DeadLetterAction::Replay(args) => act(&store, args, true).await,
        DeadLetterAction::Discard(args) => act(&store, args, false).await,
    }
}

async fn list(store: &Store, args: ListArgs) -> anyhow::Result<()> {
    let filter = args.filter.filter(Some(EventState::Quarantined));
    let page = store.search_events(&filter, args.after, args.limit).await?;
    let count = store.count_events(&filter, crate::store::COUNT_CAP).await?;
    if args.json {
        let v = serde_json::json!({ "page": page, "matching": count });
        super::emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
        return Ok(());
    }
    use std::fmt::Write as _;
    let mut out = String::new();
    writeln!(
        out,
        "{}{} matching event(s)",
        if count.capped { "at least " } else { "" },
        count.rows
    )?;
    if !page.events.is_empty() {
        writeln!(
            out,
            "{:<36}  {:<14} {:<12} {:>3}  {:<20}  aggregate (seq)  event type",
            "event id", "state", "code", "att", "recorded (UTC)"
        )?;
    }
    for e in &page.events {
        writeln!(
            out,
            "{}  {:<14} {:<12} {:>3}  {:<20}  {}/{} ({})  {}",
            e.event_id,
            e.state,
            e.error_code.as_deref().unwrap_or("-"),
            e.attempts,
            e.recorded_at.format("%Y-%m-%d %H:%M:%S"),
            e.aggregate_type,
            e.aggregate_id,
            e.aggregate_seq,
            e.event_type
        )?;
    }
    if let Some(next) = page.next_after {
        writeln!(out, "next: --after {next}")?;
    }
    super::emit(&out);
    Ok(())
}

async fn show(store: &Store, event_id: uuid::Uuid, json: bool) -> anyhow::Result<()> {
    let Some(e) = store.event_detail(event_id).await? else {
        anyhow::bail!(
            "no event {event_id} in the outbox or the published history (it may have aged out)"
        );
    };
    if json {
        super::emit(&format!("{}\n", serde_json::to_string_pretty(&e)?));
        return Ok(());
    }
    use std::fmt::Write as _;
    let s = &e.summary;
    let mut out = String::new();
    writeln!(out, "event id:      {}", s.event_id)?;
    writeln!(out, "state:         {}", s.state)?;
    writeln!(
        out,
        "aggregate:     {}/{} sequence {} (partition {})",
        s.aggregate_type, s.aggregate_id, s.aggregate_seq, e.partition
    )?;
    writeln!(
        out,
        "event type:    {} (schema {})",
        s.event_type, e.schema_version
    )?;
    writeln!(
        out,
        "recorded at:   {} UTC",
        s.recorded_at.format("%Y-%m-%d %H:%M:%S%.3f")
    )?;
    if let Some(t) = e.occurred_at {
        writeln!(
            out,
            "occurred at:   {} UTC",
            t.format("%Y-%m-%d %H:%M:%S%.3f")
        )?;
    }
    writeln!(out, "attempts:      {}", s.attempts)?;
    writeln!(
        out,
        "error code:    {}",
        s.error_code.as_deref().unwrap_or("-")
    )?;
    writeln!(
        out,
        "last error:    {}",
        e.last_error.as_deref().unwrap_or("-")
    )?;
    if let Some(d) = &e.destination {
        writeln!(out, "destination:   {d}")?;
    }
    if let (Some(at), Some(id)) = (e.published_at, &e.stream_id) {
        writeln!(
            out,
            "published at:  {} UTC as entry {id}",
            at.format("%Y-%m-%d %H:%M:%S%.3f")
        )?;
    }
    match &e.trace {
        Some(t) => writeln!(
            out,
            "trace:         {}{}",
            t.traceparent,
            t.tracestate
                .as_deref()
                .map(|s| format!(" ({s})"))
                .unwrap_or_default()
        )?,
        None => writeln!(out, "trace:         -")?,
    }
    writeln!(
        out,
        "headers:\n{}",
        serde_json::to_string_pretty(&e.headers)?
    )?;
    writeln!(
        out,
        "payload:\n{}",
        serde_json::to_string_pretty(&e.payload)?
    )?;
    super::emit(&out);
    Ok(())
}

async fn act(store: &Store, args: ActArgs, replay: bool) -> anyhow::Result<()> {
    let verb = if replay { "replay" } else { "discard" };
    let actor = super::cli_actor();
    let selection = if args.all_matching {
        let filter = args.filter.filter(None);
        if filter.state.is_some_and(|s| s != EventState::Quarantined) {
            anyhow::bail!("only quarantined events can be {verb}ed: leave --state out");
        }
        let filter = EventFilter {
            state: Some(EventState::Quarantined),
            ..filter
        };
        let count = store.count_events(&filter, MAX_BULK + 1).await?;
        if count.rows > MAX_BULK {
            anyhow::bail!(
                "more than {MAX_BULK} quarantined events match; narrow the filters \
                 (--code, --aggregate-type, --since, …)"
            );
        }
        if let Some(expected) = args.expect
            && expected != count.rows
        {
            anyhow::bail!(
                "{} quarantined events match now, not the {expected} given with --expect; \
                 nothing was changed",
                count.rows
            );
        }
        if !args.yes {
            println!(
                "{} quarantined event(s) match; nothing was changed. Run again with --yes \
                 (and --expect {} to insist on that count) to {verb} them.",
                count.rows, count.rows
            );
            return Ok(());
        }
        Selection::Matching {
            filter,
            expected: count.rows,
        }
    } else {
        Selection::Ids(args.event_ids)
    };
    let outcome = if replay {
        store
            .replay_events(&actor, &selection, &args.reason)
            .await?
    } else {
        store
            .discard_events(&actor, &selection, &args.reason)
            .await?
    };
    println!(
        "{verb}ed {} event(s); {} held event(s) of their aggregates released",
        outcome.events, outcome.released
    );
    Ok(())
}
