//! A node's memory: the claim's budget counts the bytes the relay loads (uncompressed), a payload
//! over the limit is refused by the database and, in an older row, by the claim without being
//! loaded, and a node's peak memory stays bounded while it drains large compressible payloads.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::store::{MAX_PAYLOAD_BYTES, StoreError};
use sea_orm::ConnectionTrait;
use support::{TestDb, TestRedis, scalar, wait_until};

/// A JSON object `{"pad": "aaa…"}` whose text, as PostgreSQL writes it out, is `bytes` long:
/// highly compressible, so it takes a small fraction of that on disk.
fn pad_payload(bytes: usize) -> String {
    // `{"pad": "` and `"}` around the padding.
    format!("jsonb_build_object('pad', repeat('a', {}))", bytes - 11)
}

/// Inserts `n` events of the aggregates `doc/d-<from + i>` with payloads of `bytes` as text.
async fn insert_docs(db: &TestDb, aggregates: &str, n: usize, bytes: usize) {
    db.store
        .connection()
        .execute_unprepared(&format!(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'doc', {aggregates}, 'doc.written', {} FROM generate_series(1, {n}) g",
            pad_payload(bytes)
        ))
        .await
        .expect("insert");
}

/// Each claim statement (plain, past a cursor, polled) stops at the budget in bytes as loaded:
/// ten compressible 200,000-byte payloads (a few KiB each on disk) with a budget of 450,000
/// bytes give two rows, not all ten.
#[tokio::test]
async fn every_claim_counts_the_budget_in_uncompressed_bytes() {
    let db = TestDb::new().await;
    insert_docs(&db, "'d-1'", 10, 200_000).await;
    let stored = scalar(
        &db,
        "SELECT sum(pg_column_size(payload))::int8 FROM outpost_event",
    )
    .await;
    assert!(
        stored < 200_000,
        "the payloads are compressed ({stored} bytes)"
    );
    let p =
        i32::try_from(scalar(&db, "SELECT min(partition)::int8 FROM outpost_event").await).unwrap();
    let budget = 450_000;

    let rows = db.store.claim_many(&[p], 500, budget).await.unwrap();
    assert_eq!(rows.len(), 2, "claim_many");
    let rows = db.store.claim_polled(&[p], 500, budget, 500).await.unwrap();
    assert_eq!(rows.len(), 2, "claim_polled");
    let (rows, full) = db.store.claim_after(&[(p, 0)], 500, budget).await.unwrap();
    assert_eq!(rows.len(), 2, "claim_after");
    assert_eq!(full, vec![p], "claim_after stopped at its byte bound");
    // Always at least one row, however large.
    let rows = db.store.claim_many(&[p], 500, 1024).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].payload.len(), 200_000);
    assert_eq!(rows[0].oversize, None);
}

/// The database refuses a payload over the limit, counted as the relay counts it (JSON text),
/// with a message giving both figures, and accepts one exactly at the limit.
#[tokio::test]
async fn the_database_refuses_a_payload_over_the_relays_limit() {
    let db = TestDb::new().await;
    assert_eq!(
        scalar(&db, "SELECT outpost_max_payload_bytes()::int8").await,
        i64::try_from(MAX_PAYLOAD_BYTES).unwrap(),
        "the database and the relay name the same limit"
    );
    insert_docs(&db, "'d-1'", 1, MAX_PAYLOAD_BYTES).await;
    let over = db
        .store
        .connection()
        .execute_unprepared(&format!(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('doc', 'd-2', 'doc.written', {})",
            pad_payload(MAX_PAYLOAD_BYTES + 1)
        ))
        .await
        .map_err(StoreError::from_db)
        .expect_err("a payload over the limit is refused");
    let text = over.to_string();
    assert!(
        text.contains("outpost_event_payload_size_check")
            && text.contains(&format!("{} bytes", MAX_PAYLOAD_BYTES + 1))
            && text.contains(&format!("limit of {MAX_PAYLOAD_BYTES} bytes")),
        "{text}"
    );
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 1);
}

/// A row over the limit written before the limit was lowered (the rules of an older schema) is
/// claimed without its payload and quarantined as `OVERSIZE` at its first attempt; its
/// aggregate's next event is held, and other aggregates are published.
#[tokio::test]
async fn an_older_row_over_the_limit_is_quarantined_at_once_without_being_loaded() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let steps = support::migrations_from(&db, "m20261207_000015_payload_limit").await;
    outpost::store::migrate_down(&db.store, Some(steps))
        .await
        .unwrap();
    let big = 600_000;
    insert_docs(&db, "'d-1'", 1, big).await;
    insert_docs(&db, "'d-1'", 1, 100).await;
    insert_docs(&db, "'d-' || (g + 1)", 3, 100).await;
    outpost::store::migrate_up(&db.store).await.unwrap();

    let p = i32::try_from(
        scalar(
            &db,
            "SELECT partition::int8 FROM outpost_event WHERE aggregate_id = 'd-1' LIMIT 1",
        )
        .await,
    )
    .unwrap();
    let rows = db.store.claim_many(&[p], 500, 1 << 20).await.unwrap();
    let first = rows
        .iter()
        .find(|r| r.aggregate_id == "d-1")
        .expect("the large row is claimed");
    assert_eq!(first.oversize, Some(big as u64));
    assert_eq!(first.payload, "null", "the payload is not loaded");
    assert_eq!(first.undecodable, None);

    let node = support::start_node(support::relay_config(&db, &redis, "memory-1")).await;
    support::wait_quarantined(&db, 1).await;
    wait_until(30, "the other aggregates to be published", || async {
        scalar(&db, "SELECT count(*) FROM outpost_published").await == 3
    })
    .await;
    node.shutdown().await;
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'quarantined' AND attempts = 1 \
               AND aggregate_seq = 1 AND last_error LIKE 'OVERSIZE payload of 600000 bytes%'"
        )
        .await,
        1,
        "quarantined at its first attempt"
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'held' AND aggregate_seq = 2"
        )
        .await,
        1
    );
}

/// The peak memory (`VmHWM`) of process `pid`, in KiB.
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in the process status")
}

/// An `outpost run` process with `relay.batch_bytes` at 1 MiB drains 500 compressible payloads
/// at the limit (256 KiB each as text, about 3 KiB on disk; 125 MiB in all) with a peak
/// resident size of at most 64 MiB.
#[tokio::test]
async fn a_node_draining_large_compressible_payloads_stays_within_64_mib() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    for chunk in 0..10 {
        insert_docs(
            &db,
            &format!("'d-' || (g + {})", chunk * 50),
            50,
            MAX_PAYLOAD_BYTES,
        )
        .await;
    }
    let args = support::relay_args(
        &db,
        &support::redis_url(),
        &redis.prefix,
        "memory-rss",
        &[("relay.batch_bytes", "1048576")],
    );
    let node = support::spawn_outpost(&args, &[]);
    support::assert_all_published(&db).await;
    let peak = peak_kib(node.id());
    eprintln!("peak resident size of the node: {peak} KiB");
    assert!(peak <= 64 * 1024, "peak resident size {peak} KiB");
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_published").await,
        500
    );
}
