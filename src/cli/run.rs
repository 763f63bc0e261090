//! `outpost run`: run a relay node until SIGTERM or SIGINT.

use clap::Args;
use tokio::signal::unix::{SignalKind, signal};

use crate::app;
use crate::config::Config;

/// Options of `outpost run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Apply pending migrations first (creating the database when it does not exist).
    #[arg(long)]
    migrate: bool,
}

pub(super) async fn run(config: &Config, args: RunArgs) -> anyhow::Result<()> {
    if args.migrate {
        super::migrate::run(config, super::migrate::MigrateAction::Up).await?;
    }
    let config = config.clone();
    let handle = tokio::task::spawn_blocking(move || app::start(&config)).await??;
    println!(
        "outpost node {} running; metrics, /livez and /readyz on http://{}",
        handle.node_id(),
        handle.admin_addr()
    );
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
    handle.shutdown().await;
    Ok(())
}
