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

/// A claim past a cursor (a partition moving past rows that wait for a rate-limit permit)
/// returns the rows after it, except those of aggregates that still have a pending row at or
/// before it: no event overtakes an earlier one of its aggregate. It says which partitions
/// stopped at a bound.
#[tokio::test]
async fn a_claim_past_a_cursor_skips_aggregates_still_waiting_before_it() {
    let db = TestDb::new().await;
    // Four aggregates of one partition whose events interleave in id order.
    let p = 5;
    let mut aggregates = Vec::new();
    for skip in 0..4 {
        aggregates.push(support::aggregate_in(&db, p, skip).await);
    }
    for round in 0..5 {
        let facts = aggregates
            .iter()
            .map(|a| EventFact::new("order", a.clone(), "order.placed", json!({ "r": round })))
            .collect();
        commit_facts(&db.store, facts).await;
    }
    let all = db.store.claim_many(&[p], 500, u64::MAX).await.unwrap();
    assert_eq!(all.len(), 20);
    let rows: Vec<&ClaimedEvent> = all.iter().collect();
    // The cursor after the third row: three aggregates still wait before it, the fourth not.
    let cursor = rows[2].id;
    let waiting: std::collections::HashSet<&str> =
        rows[..3].iter().map(|r| r.aggregate_id.as_str()).collect();
    let expected: Vec<i64> = rows
        .iter()
        .filter(|r| r.id > cursor && !waiting.contains(r.aggregate_id.as_str()))
        .map(|r| r.id)
        .collect();
    assert_eq!(expected.len(), 5, "the fourth aggregate's rows");

    let (past, full) = db
        .store
        .claim_after(&[(p, cursor), (p + 64, 0)], 500, u64::MAX)
        .await
        .unwrap();
    assert_eq!(past.iter().map(|r| r.id).collect::<Vec<_>>(), expected);
    assert!(full.is_empty(), "nothing was left behind a bound: {full:?}");

    // Once the rows before the cursor are gone (published), their aggregates' later rows come.
    let before: Vec<i64> = rows[..3].iter().map(|r| r.id).collect();
    support::scalar(
        &db,
        &format!(
            "WITH d AS (DELETE FROM outpost_event WHERE id IN ({})) SELECT 0::int8",
            before
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ),
    )
    .await;
    let (past, _) = db
        .store
        .claim_after(&[(p, cursor)], 500, u64::MAX)
        .await
        .unwrap();
    let later: Vec<i64> = rows
        .iter()
        .filter(|r| r.id > cursor)
        .map(|r| r.id)
        .collect();
    assert_eq!(past.iter().map(|r| r.id).collect::<Vec<_>>(), later);

    // A cursor of 0 reads as the plain claim does; bounds are reported.
    let (from_start, full) = db.store.claim_after(&[(p, 0)], 3, u64::MAX).await.unwrap();
    assert_eq!(
        from_start,
        db.store.claim_many(&[p], 3, u64::MAX).await.unwrap()
    );
    assert_eq!(full, vec![p], "three rows of more");
    let (one, full) = db.store.claim_after(&[(p, 0)], 500, 1).await.unwrap();
    assert_eq!(one.len(), 1, "always one row, even over the byte bound");
    assert_eq!(full, vec![p], "stopped at the byte bound");
    let (_, full) = db
        .store
        .claim_after(&[(p, 0)], 500, u64::MAX)
        .await
        .unwrap();
    assert!(full.is_empty());
}
