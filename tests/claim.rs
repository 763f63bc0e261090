//! The relay's two reads of ready rows: the bounded read of each partition, and the busy poll's
//! single scan over many partitions, which must return exactly the same rows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::produce::EventFact;
use outpost::store::ClaimedEvent;
use serde_json::json;
use support::{TestDb, commit_facts};

fn keys(rows: &[ClaimedEvent]) -> Vec<(i32, i64)> {
    rows.iter().map(|r| (r.partition, r.id)).collect()
}

#[tokio::test]
async fn the_polls_single_scan_returns_what_the_per_partition_read_returns() {
    let db = TestDb::new().await;
    // 300 events over 40 aggregates with payloads from a few bytes to a few kilobytes, so that
    // partitions hold different numbers of rows of different sizes.
    let facts = (0..300)
        .map(|i| {
            EventFact::new(
                "order",
                format!("o{}", i % 40),
                "order.placed",
                json!({ "i": i, "pad": "x".repeat((i * 37) % 3000) }),
            )
        })
        .collect();
    commit_facts(&db.store, facts).await;
    let all: Vec<i32> = (0..64).collect();
    let some: Vec<i32> = (0..64).filter(|p| p % 3 != 0).collect();

    for partitions in [&all, &some] {
        for (max_rows, max_bytes) in [
            (1, u64::MAX),
            (3, u64::MAX),
            (500, 8_000),
            (2, 1),
            (7, 65_536),
        ] {
            let each = db
                .store
                .claim_many(partitions, max_rows, max_bytes)
                .await
                .unwrap();
            assert!(!each.is_empty());
            // Room for every ready row: the single scan, with the bounds applied as it reads.
            let polled = db
                .store
                .claim_polled(partitions, max_rows, max_bytes, 500)
                .await
                .unwrap();
            assert_eq!(
                keys(&polled),
                keys(&each),
                "rows {max_rows}, bytes {max_bytes}, {} partitions",
                partitions.len()
            );
            assert_eq!(polled, each);
            // More rows ready than the cap: it reads them per partition instead.
            let over = db
                .store
                .claim_polled(partitions, max_rows, max_bytes, 10)
                .await
                .unwrap();
            assert_eq!(over, each);
        }
    }

    // Ordered by partition, then id; every partition's rows are a prefix of its ready rows.
    let rows = db
        .store
        .claim_polled(&all, 500, u64::MAX, 500)
        .await
        .unwrap();
    assert_eq!(rows.len(), 300);
    let mut sorted = keys(&rows);
    sorted.sort_unstable();
    assert_eq!(keys(&rows), sorted);
    assert!(
        db.store
            .claim_polled(&[], 5, 5, 5)
            .await
            .unwrap()
            .is_empty()
    );
}
