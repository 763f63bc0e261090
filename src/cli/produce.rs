//! `outpost produce`: load through the real producer API.

use std::num::NonZeroU32;
use std::sync::Arc;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;
use crate::produce::load::{Committed, LoadSpec, WriteTarget, run_load};
use crate::produce::{Limits, Producer};

/// Options of `outpost produce`.
#[derive(Debug, Args)]
pub struct ProduceArgs {
    /// Events to write.
    #[arg(long, default_value_t = 10_000)]
    count: u64,
    /// Events per second across all writers (0: as fast as possible).
    #[arg(long, default_value_t = 0)]
    rate: u32,
    /// Distinct aggregates to spread the events over.
    #[arg(long, default_value_t = 1_000)]
    aggregates: u64,
    /// Approximate payload size in bytes.
    #[arg(long, default_value_t = 250)]
    payload_bytes: usize,
    /// Events per transaction.
    #[arg(long, default_value_t = 1)]
    tx_size: u32,
    /// Concurrent writers.
    #[arg(long, default_value_t = 16)]
    writers: u32,
    /// Aggregate type of the events.
    #[arg(long, default_value = "load")]
    aggregate_type: String,
    /// Event type of the events.
    #[arg(long, default_value = "load.tick")]
    event_type: String,
}

pub(super) async fn run(config: &Config, args: ProduceArgs) -> anyhow::Result<()> {
    if args.tx_size == 0 || args.writers == 0 || args.aggregates == 0 {
        anyhow::bail!("--tx-size, --writers and --aggregates must be at least 1");
    }
    let store = super::connect(config, "produce").await?;
    let producer = Producer::new(Limits {
        max_payload_bytes: config.producer.max_payload_bytes,
        max_header_bytes: config.producer.max_header_bytes,
    });
    let spec = LoadSpec {
        count: args.count,
        rate: NonZeroU32::new(args.rate),
        aggregates: args.aggregates,
        aggregate_type: args.aggregate_type,
        event_type: args.event_type,
        payload_bytes: args.payload_bytes,
        tx_size: args.tx_size,
        writers: args.writers,
        target: WriteTarget::Outbox,
    };
    let bar = ProgressBar::new(args.count);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} events  {per_sec}  eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let b = bar.clone();
    let report = run_load(
        &store,
        &producer,
        &spec,
        Arc::new(move |c: Committed| b.set_position(c.total)),
    )
    .await?;
    bar.finish_and_clear();
    println!(
        "committed {} events in {} transactions in {:.2} s: {:.0} events/s, {:.0} commits/s",
        report.events,
        report.commits,
        report.elapsed.as_secs_f64(),
        report.events_per_sec(),
        report.commits_per_sec()
    );
    Ok(())
}
