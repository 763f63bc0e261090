//! `outpost pause|resume`: stop or restart publishing of partitions.

use clap::Args;

use crate::config::Config;

/// Which partitions.
#[derive(Debug, Args)]
pub struct PartitionArgs {
    /// Partition numbers (see `outpost status`).
    #[arg(required_unless_present = "all")]
    partitions: Vec<i32>,
    /// Every partition.
    #[arg(long, conflicts_with = "partitions")]
    all: bool,
}

pub(super) async fn run(config: &Config, args: PartitionArgs, pause: bool) -> anyhow::Result<()> {
    let store = super::connect(config, if pause { "pause" } else { "resume" }).await?;
    let count = i32::try_from(store.partition_count().await?)?;
    let partitions: Vec<i32> = if args.all {
        (0..count).collect()
    } else {
        args.partitions
    };
    if let Some(bad) = partitions.iter().find(|p| !(0..count).contains(*p)) {
        anyhow::bail!(
            "there is no partition {bad}: partitions are numbered 0 to {}",
            count - 1
        );
    }
    let actor = super::cli_actor();
    let changed = store.pause_partitions(&actor, &partitions, pause).await?;
    let verb = if pause { "paused" } else { "resumed" };
    println!(
        "{verb} {} partition(s){}; the owning node applies it at its next heartbeat",
        changed.len(),
        if changed.len() < partitions.len() {
            format!(" ({} already {verb})", partitions.len() - changed.len())
        } else {
            String::new()
        }
    );
    Ok(())
}
