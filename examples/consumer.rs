//! A consumer that keeps a projection of orders up to date from Outpost's stream, applying each
//! event exactly once and in order per order, through `outpost::consume`.
//!
//! ```text
//! cargo run --example consumer -- \
//!     --database-url postgres://postgres@127.0.0.1:5432/shop \
//!     --redis-url redis://127.0.0.1:6379 --stream events:order --group projection
//! ```
//!
//! Copy it: the handler is the only part that is yours. The helper opens the transaction,
//! checks the order's sequence, records the event in the inbox, commits and acknowledges.

use clap::Parser;
use outpost::consume::{Consumer, ConsumerSettings, Delivery, Handler, HandlerError};
use outpost::store::{ConnectSettings, Store, migrate_up};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, Statement};

#[derive(Debug, Parser)]
struct Args {
    /// The consumer's own database (the inbox and positions live there, next to the projection).
    #[arg(long, env = "CONSUMER_DATABASE_URL")]
    database_url: String,
    /// Redis holding the stream.
    #[arg(
        long,
        env = "CONSUMER_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// The stream's full key.
    #[arg(long, default_value = "events:order")]
    stream: String,
    /// The consumer group.
    #[arg(long, default_value = "order-projection")]
    group: String,
    /// This member's name (default: host and process id).
    #[arg(long)]
    consumer: Option<String>,
}

/// Applies order events to `order_projection`.
struct Project;

impl Handler for Project {
    async fn handle(
        &self,
        event: &Delivery,
        txn: &DatabaseTransaction,
    ) -> Result<(), HandlerError> {
        // Decode the payload only to check it is JSON; a real projection reads its fields.
        let payload: serde_json::Value = event.payload()?;
        txn.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO order_projection AS p (order_id, last_event, last_seq, events, last_payload) \
             VALUES ($1, $2, $3, 1, $4) \
             ON CONFLICT (order_id) DO UPDATE SET last_event = $2, last_seq = $3, \
               events = p.events + 1, last_payload = $4, updated_at = now()",
            [
                event.aggregate_id.clone().into(),
                event.event_type.clone().into(),
                event.aggregate_seq.into(),
                payload.into(),
            ],
        ))
        .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let store = Store::connect(&ConnectSettings {
        connect_timeout: std::time::Duration::from_secs(5),
        ..ConnectSettings::new(args.database_url.clone(), "outpost example consumer", 20)
    })
    .await?;
    // The helper's tables (outpost_inbox, outpost_consumer_position) and the projection.
    migrate_up(&store).await?;
    store
        .connection()
        .execute_unprepared(
            "CREATE TABLE IF NOT EXISTS order_projection ( \
               order_id text PRIMARY KEY, last_event text NOT NULL, last_seq bigint NOT NULL, \
               events bigint NOT NULL, last_payload jsonb, \
               updated_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;

    let mut settings = ConsumerSettings::new(args.redis_url, args.stream, args.group);
    if let Some(name) = args.consumer {
        settings.consumer = name;
    }
    let consumer = Consumer::connect(settings, store.connection().clone(), Project).await?;
    tracing::info!("consuming; Ctrl-C to stop");
    let stats = consumer
        .run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    tracing::info!(?stats, "stopped");
    Ok(())
}
