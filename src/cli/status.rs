//! `outpost status`.

use clap::Args;

use super::emit;
use crate::config::Config;
use crate::store::{self, PUBLISHED_COUNTED_UP_TO};

/// Options of `outpost status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print every partition, not only those with a backlog, an owner or a pause.
    #[arg(long)]
    all: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub(super) async fn run(config: &Config, args: StatusArgs) -> anyhow::Result<()> {
    let store = super::connect(config, "status").await?;
    let backlog = store::backlog(&store).await?;
    let dead = store.quarantined_by_code().await?;
    if args.json {
        let v = serde_json::json!({
            "by_status": backlog.by_status.iter()
                .map(|s| (s.status.clone(), serde_json::Value::from(s.rows)))
                .collect::<serde_json::Map<_, _>>(),
            "oldest_pending_age_secs": backlog.oldest_pending_age_secs,
            "quarantined_by_code": dead.iter()
                .map(|(code, n)| (code.clone(), serde_json::Value::from(*n)))
                .collect::<serde_json::Map<_, _>>(),
            "nodes": backlog.nodes.iter().map(|n| serde_json::json!({
                "node_id": n.node_id, "hostname": n.hostname, "pid": n.pid,
                "version": n.version, "heartbeat_age_secs": n.heartbeat_age_secs,
                "leases": n.leases,
            })).collect::<Vec<_>>(),
            "partitions": backlog.partitions.iter().map(|p| serde_json::json!({
                "partition": p.partition, "ready": p.ready, "owner": p.owner,
                "epoch": p.epoch, "paused": p.paused,
            })).collect::<Vec<_>>(),
        });
        emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
        return Ok(());
    }
    use std::fmt::Write as _;
    let mut out = String::new();
    writeln!(out, "events by state:")?;
    if backlog.by_status.is_empty() {
        writeln!(out, "  (none)")?;
    }
    for s in &backlog.by_status {
        let about = if s.status == "published" && s.rows >= PUBLISHED_COUNTED_UP_TO {
            "  (estimated)"
        } else {
            ""
        };
        writeln!(out, "  {:<15} {:>12}{about}", s.status, s.rows)?;
    }
    if !dead.is_empty() {
        writeln!(
            out,
            "quarantined by error code (`outpost dead-letter list --code CODE`):"
        )?;
        for (code, n) in &dead {
            writeln!(
                out,
                "  {:<15} {n:>12}",
                if code.is_empty() { "(none)" } else { code }
            )?;
        }
    }
    match backlog.oldest_pending_age_secs {
        Some(age) => writeln!(out, "oldest pending: {age:.3} s")?,
        None => writeln!(out, "oldest pending: none")?,
    }
    writeln!(out, "nodes ({}):", backlog.nodes.len())?;
    for n in &backlog.nodes {
        writeln!(
            out,
            "  {:<24} leases {:>4}  heartbeat {:>7.1} s ago  {} pid {} v{}",
            n.node_id, n.leases, n.heartbeat_age_secs, n.hostname, n.pid, n.version
        )?;
    }
    writeln!(out, "partitions ({}):", backlog.partitions.len())?;
    writeln!(
        out,
        "  {:>9} {:>10} {:>8} {:>6}  owner",
        "partition", "ready", "epoch", "paused"
    )?;
    for p in backlog
        .partitions
        .iter()
        .filter(|p| args.all || p.ready > 0 || p.owner.is_some() || p.paused)
    {
        writeln!(
            out,
            "  {:>9} {:>10} {:>8} {:>6}  {}",
            p.partition,
            p.ready,
            p.epoch,
            if p.paused { "yes" } else { "no" },
            p.owner.as_deref().unwrap_or("-")
        )?;
    }
    emit(&out);
    Ok(())
}
