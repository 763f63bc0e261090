//! The backlog figures behind the metrics are counted by one node per period for the whole
//! cluster; the other nodes read that count.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use outpost::produce::EventFact;
use outpost::store::BacklogFigures;
use serde_json::json;
use support::{TestDb, commit_facts, scalar};

fn rows(f: &BacklogFigures, status: &str) -> i64 {
    f.by_status
        .iter()
        .find(|c| c.status == status)
        .map_or(0, |c| c.rows)
}

async fn commit(db: &TestDb, n: usize) {
    let facts = (0..n)
        .map(|i| EventFact::new("order", format!("o{i}"), "t", json!({"i": i})))
        .collect();
    commit_facts(&db.store, facts).await;
}

#[tokio::test]
async fn one_node_counts_per_period_and_the_others_read_its_figures() {
    let db = TestDb::new().await;
    commit(&db, 7).await;
    let hour = Duration::from_secs(3600);

    // The first node to look counts.
    let a = db.store.shared_backlog(hour, true).await.unwrap();
    assert!(a.counted);
    assert_eq!(rows(&a, "pending"), 7);
    assert!(a.oldest_pending_age_secs.is_some_and(|s| s >= 0.0));

    // Within the period another node reads the same figures instead of scanning.
    commit(&db, 5).await;
    let b = db.store.shared_backlog(hour, true).await.unwrap();
    assert!(!b.counted, "counted once per period");
    assert_eq!(rows(&b, "pending"), 7, "the stored count");
    assert!(b.oldest_pending_age_secs >= a.oldest_pending_age_secs);

    // A node that has not worked never counts, even when the figures are stale.
    let c = db
        .store
        .shared_backlog(Duration::ZERO, false)
        .await
        .unwrap();
    assert!(!c.counted);
    assert_eq!(rows(&c, "pending"), 7);

    // Past the period, the next node to look counts again.
    let d = db.store.shared_backlog(Duration::ZERO, true).await.unwrap();
    assert!(d.counted);
    assert_eq!(rows(&d, "pending"), 12);

    // Nothing undelivered: no oldest age.
    db.store.age_as_published(None, 0).await.unwrap();
    let e = db.store.shared_backlog(Duration::ZERO, true).await.unwrap();
    assert_eq!((rows(&e, "pending"), rows(&e, "published")), (0, 12));
    assert_eq!(e.oldest_pending_age_secs, None);
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_backlog").await,
        1,
        "one row for the cluster"
    );
}

/// The operator's overview (the panel's first page, `GET /api/v1/status`) reads the stored
/// figures, saying how old they are, and never counts or probes the outbox itself: polling it
/// must cost a draining node nothing.
#[tokio::test]
async fn the_overview_reads_the_stored_figures_and_says_when_they_were_counted() {
    let db = TestDb::new().await;
    commit(&db, 3).await;

    // Before any node has counted, the overview says so rather than showing zeros as counted.
    let before = db.store.overview().await.unwrap();
    assert_eq!(before.backlog.counted_secs_ago, None);
    assert_eq!(before.backlog.oldest_pending_age_secs, None);
    assert!(before.backlog.by_status.is_empty(), "{before:?}");
    assert!(!before.backlog.counted);

    // A node counts; the overview shows that count, and its age.
    let counted = db.store.shared_backlog(Duration::ZERO, true).await.unwrap();
    assert!(counted.counted);
    commit(&db, 4).await;
    let after = db.store.overview().await.unwrap();
    assert_eq!(
        rows(&after.backlog, "pending"),
        3,
        "the stored count, not a new one"
    );
    assert!(!after.backlog.counted);
    assert!(
        after
            .backlog
            .counted_secs_ago
            .is_some_and(|s| (0.0..60.0).contains(&s)),
        "{after:?}"
    );
    assert!(after.backlog.oldest_pending_age_secs >= counted.oldest_pending_age_secs);
    assert!(after.nodes.is_empty() && after.quarantined_by_code.is_empty());
    assert_eq!(after.publish_rate, 0.0);
    assert_eq!(
        scalar(
            &db,
            "SELECT (by_status->>'pending')::int8 FROM outpost_backlog"
        )
        .await,
        3,
        "reading the overview stored nothing"
    );
}
