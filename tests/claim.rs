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

/// Rows of `outpost_event` the plan's scans read: those they returned and those they read and
/// then dropped by a filter.
fn rows_read(plan: &serde_json::Value) -> f64 {
    let mut total = 0.0;
    if plan.get("Relation Name").and_then(|v| v.as_str()) == Some("outpost_event") {
        let loops = plan["Actual Loops"].as_f64().unwrap_or(1.0);
        for key in [
            "Actual Rows",
            "Rows Removed by Filter",
            "Rows Removed by Index Recheck",
        ] {
            total += plan.get(key).and_then(|v| v.as_f64()).unwrap_or(0.0) * loops;
        }
    }
    if let Some(children) = plan.get("Plans").and_then(|v| v.as_array()) {
        total += children.iter().map(rows_read).sum::<f64>();
    }
    total
}

#[tokio::test]
async fn a_claim_reads_due_retries_only() {
    use sea_orm::ConnectionTrait;
    let db = TestDb::new().await;
    let aggregate = support::aggregate_in(&db, 5, 0).await;
    let other = support::aggregate_in(&db, 5, 1).await;
    commit_facts(
        &db.store,
        (0..2000)
            .map(|i| {
                EventFact::new(
                    "order",
                    aggregate.as_str(),
                    "order.placed",
                    json!({ "i": i }),
                )
            })
            .chain((0..4).map(|i| {
                EventFact::new("order", other.as_str(), "order.placed", json!({ "i": i }))
            }))
            .collect(),
    )
    .await;
    // Of the first aggregate, every row waits for a retry: 1,995 of them an hour from now, five
    // (every 400th) due. The other aggregate's four rows are pending.
    db.store
        .connection()
        .execute_unprepared(&format!(
            "UPDATE outpost_event SET status = 'retry_wait', attempts = 1, \
                 next_attempt_at = CASE WHEN aggregate_seq % 400 = 1 \
                                        THEN now() - interval '1 second' \
                                        ELSE now() + interval '1 hour' END \
              WHERE aggregate_id = '{aggregate}'; \
             ANALYZE outpost_event;"
        ))
        .await
        .unwrap();
    let due = support::scalar(
        &db,
        "SELECT count(*) FROM outpost_event \
         WHERE status = 'pending' OR (status = 'retry_wait' AND next_attempt_at <= now())",
    )
    .await;
    assert_eq!(due, 9);

    let each = db.store.claim_many(&[5], 100, u64::MAX).await.unwrap();
    let polled = db
        .store
        .claim_polled(&[5], 100, u64::MAX, 100)
        .await
        .unwrap();
    assert_eq!(each.len(), 9, "the due retries and the pending rows");
    assert_eq!(polled, each);
    let ids: Vec<i64> = each.iter().map(|r| r.id).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(ids, sorted, "in id order");
    let retried = each.iter().filter(|r| r.attempts == 1).count();
    assert_eq!(retried, 5);

    // The retries that are not due are not read: each scan reads what it returns.
    for polled in [false, true] {
        let plan = db
            .store
            .explain_claim(&[5], 100, u64::MAX, polled)
            .await
            .unwrap();
        let read = rows_read(&plan[0]["Plan"]);
        assert!(
            read <= 9.0,
            "polled {polled}: the claim read {read} rows of the outbox for 9 ready: {plan:#}"
        );
    }
}
