//! `outpost audit`: the log of operator actions, newest first.

use clap::Args;

use crate::config::Config;
use crate::store::AuditQuery;

/// Options of `outpost audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Only this action (event.replay, event.discard, partition.pause, partition.resume,
    /// token.create, token.revoke).
    #[arg(long)]
    action: Option<String>,
    /// Only this actor.
    #[arg(long)]
    actor: Option<String>,
    /// Rows older than this id (the `next:` line of the previous page).
    #[arg(long)]
    before: Option<i64>,
    /// Rows per page (1 to 1,000).
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub(super) async fn run(config: &Config, args: AuditArgs) -> anyhow::Result<()> {
    let store = super::connect(config, "audit").await?;
    let rows = store
        .audit_log(&AuditQuery {
            action: args.action,
            actor: args.actor,
            before: args.before,
            limit: Some(args.limit),
        })
        .await?;
    if args.json {
        super::emit(&format!("{}\n", serde_json::to_string_pretty(&rows)?));
        return Ok(());
    }
    use std::fmt::Write as _;
    let mut out = String::new();
    if rows.is_empty() {
        writeln!(out, "(no audit rows)")?;
    }
    for r in &rows {
        writeln!(
            out,
            "{:>6}  {}  {:<17} {} ({})  {}  {}",
            r.id,
            r.at.format("%Y-%m-%d %H:%M:%S UTC"),
            r.action,
            r.actor,
            r.role,
            r.target,
            r.detail
        )?;
    }
    if rows.len() == args.limit.clamp(1, 1000) as usize
        && let Some(last) = rows.last()
    {
        writeln!(out, "next: --before {}", last.id)?;
    }
    super::emit(&out);
    Ok(())
}
