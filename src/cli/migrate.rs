//! `outpost migrate up|down|status`.

use clap::Subcommand;

use crate::config::Config;
use crate::store;

/// What to do with the schema.
#[derive(Debug, Subcommand)]
pub enum MigrateAction {
    /// Apply every pending migration.
    Up,
    /// Revert migrations (destroys Outpost's tables and their events).
    Down {
        /// How many to revert (default: one).
        #[arg(long, default_value_t = 1)]
        steps: u32,
        /// Required: confirms that the outbox's data may be destroyed.
        #[arg(long)]
        yes: bool,
    },
    /// List migrations and whether each is applied.
    Status,
}

pub(crate) async fn run(config: &Config, action: MigrateAction) -> anyhow::Result<()> {
    if matches!(action, MigrateAction::Up) {
        create_database_if_missing(config).await;
    }
    let store = super::connect(config, "migrate").await?;
    match action {
        MigrateAction::Up => {
            store::migrate_up(&store).await?;
            print_status(&store).await
        }
        MigrateAction::Down { steps, yes } => {
            if !yes {
                anyhow::bail!(
                    "reverting migrations drops Outpost's tables and every event in them; \
                     run again with --yes to confirm"
                );
            }
            store::migrate_down(&store, Some(steps)).await?;
            print_status(&store).await
        }
        MigrateAction::Status => print_status(&store).await,
    }
}

async fn print_status(store: &store::Store) -> anyhow::Result<()> {
    for m in store::migrate_status(store).await? {
        let state = if m.applied { "applied" } else { "pending" };
        println!("{state:8} {}", m.name);
    }
    Ok(())
}

/// `migrate up` on a fresh server: create the configured database when it does not exist yet.
/// Failing to (no right to connect to the `postgres` database, say) is not an error here: the
/// connection that follows reports what is wrong.
async fn create_database_if_missing(config: &Config) {
    let Ok(url) = config.database.url() else {
        return;
    };
    let Ok(parsed) = url::Url::parse(url.expose()) else {
        return;
    };
    let name = parsed.path().trim_start_matches('/').to_owned();
    if name.is_empty() || name == "postgres" {
        return;
    }
    if let Ok(false) = store::admin::database_exists(url.expose(), &name).await {
        match store::admin::create_database(url.expose(), &name, None).await {
            Ok(_) => println!("created database {name}"),
            Err(e) => tracing::warn!("could not create database {name}: {e}"),
        }
    }
}
