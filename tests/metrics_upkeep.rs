//! A node nobody scrapes keeps its histograms' memory bounded: the exporter's upkeep folds the
//! recorded samples into their buckets on a timer, and their memory is used again. (A file of its
//! own: the test reads its own process's memory.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::{TestDb, TestRedis, wait_until};

/// This process's resident size, in KiB.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in the process status")
}

/// Records four million samples into a histogram of the node's recorder; returns how much the
/// resident size grew, in KiB.
fn record_samples() -> u64 {
    let before = resident_kib();
    let histogram = metrics::histogram!(outpost::metrics::CLAIM_SECONDS);
    for i in 0..4_000_000u32 {
        histogram.record(f64::from(i % 1000) / 1e6);
    }
    resident_kib().saturating_sub(before)
}

/// Four million samples recorded in a running node's process take about 35 MiB while they wait;
/// once the node's upkeep has folded them (no scrape of `/metrics`), four million more take no
/// more memory.
#[tokio::test]
async fn histogram_samples_are_folded_without_a_scrape() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let node = support::start_node(support::relay_config(&db, &redis, "upkeep-1")).await;
    let first = record_samples();
    assert!(
        first > 16 * 1024,
        "the samples take memory while they wait ({first} KiB)"
    );
    let done = outpost::metrics::upkeeps();
    wait_until(30, "the node's upkeep to run", || async {
        outpost::metrics::upkeeps() > done
    })
    .await;
    let second = record_samples();
    assert!(
        second < 4 * 1024,
        "the second samples reuse the first ones' memory (grew {second} KiB, {first} KiB before)"
    );
    node.shutdown().await;
}
