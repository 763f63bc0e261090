//! Rate limits are the cluster's: nodes take permits from one budget in Redis, per partition's
//! batch, so a limited stream neither exceeds its rate with several nodes nor holds up the
//! partitions of another stream.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::produce::EventFact;
use serde_json::json;
use support::{Deliveries, TestDb, TestRedis, wait_until};

/// Milliseconds part of a stream entry id.
fn entry_ms(id: &str) -> i64 {
    id.split('-').next().and_then(|ms| ms.parse().ok()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_share_one_stream_budget_and_a_limited_stream_holds_up_no_other() {
    let db = TestDb::with_pool(8).await;
    let redis = TestRedis::new();
    // "slow" events go to events:slow, limited to 5/s with a burst of 5 over the cluster; "fast"
    // events go to events:fast, unlimited. Both spread over every partition. The slow stream
    // needs half a minute under its limit: the unlimited one has that long to be out.
    let (rate, burst, slow_n, fast_n) = (5_i64, 5_i64, 150_usize, 600_usize);
    let routes = [
        ("routing.overrides.slow", "events:slow"),
        ("routing.overrides.fast", "events:fast"),
    ];
    let limits = [
        ("rate_limit.streams.events:slow", "5"),
        ("rate_limit.burst", "5"),
    ];
    let settings: Vec<(&str, &str)> = routes.iter().chain(&limits).copied().collect();
    let mut facts: Vec<EventFact> = (0..slow_n)
        .map(|i| EventFact::new("order", format!("s{i}"), "slow", json!({ "i": i })))
        .collect();
    facts.extend(
        (0..fast_n)
            .map(|i| EventFact::new("order", format!("f{}", i % 150), "fast", json!({ "i": i }))),
    );
    // An aggregate with events of both streams: its fast events wait behind its slow one.
    facts.push(EventFact::new("order", "mixed", "slow", json!({})));
    facts.push(EventFact::new("order", "mixed", "fast", json!({})));
    support::commit_facts(&db.store, facts).await;

    let a = support::start_node(support::relay_config_for(&db, &redis, "rate-a", &settings)).await;
    let b = support::start_node(support::relay_config_for(&db, &redis, "rate-b", &settings)).await;
    wait_until(30, "both nodes to own partitions", || async {
        !a.owned_partitions().await.is_empty() && !b.owned_partitions().await.is_empty()
    })
    .await;
    let mut conn = redis.conn().await;
    let slow_key = format!("{}events:slow", redis.prefix);
    let fast_key = format!("{}events:fast", redis.prefix);
    wait_until(30, "every fast event to be published", || {
        let mut c = conn.clone();
        let key = fast_key.clone();
        async move { support::read_stream(&mut c, &key).await.len() > fast_n }
    })
    .await;
    let slow_then = support::read_stream(&mut conn, &slow_key).await.len();
    assert!(
        slow_then < slow_n,
        "the unlimited stream was published while the limited one was still waiting for \
         permits ({slow_then} of {} slow events out)",
        slow_n + 1
    );
    wait_until(
        30,
        "forty slow events to be published under the limit",
        || {
            let mut c = conn.clone();
            let key = slow_key.clone();
            async move { support::read_stream(&mut c, &key).await.len() >= 40 }
        },
    )
    .await;
    a.shutdown().await;
    b.shutdown().await;
    let limited = support::read_stream(&mut conn, &slow_key).await;

    // A node without the limit publishes the rest.
    let c = support::start_node(support::relay_config_for(&db, &redis, "rate-c", &routes)).await;
    wait_until(60, "every slow event to be published", || {
        let mut c = conn.clone();
        let key = slow_key.clone();
        async move { support::read_stream(&mut c, &key).await.len() > slow_n }
    })
    .await;
    c.shutdown().await;

    // The budget held for the two nodes together: in any stretch of the stream, at most the
    // burst plus the rate times its length went out (one second of slack for the time between a
    // permit and its append). Two budgets of their own would have let out twice as many.
    let at: Vec<i64> = limited.iter().map(|(id, _)| entry_ms(id)).collect();
    for i in 0..at.len() {
        for j in i..at.len() {
            let count = i64::try_from(j - i + 1).unwrap();
            let allowed = burst + rate * (at[j] - at[i] + 1000) / 1000;
            assert!(
                count <= allowed,
                "{count} slow events within {} ms: more than the cluster's limit allows \
                 ({allowed})",
                at[j] - at[i]
            );
        }
    }
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert_eq!(d.unique(), slow_n + fast_n + 2);
    assert_eq!(d.duplicates(), 0);
    // Per stream, every aggregate in order; the mixed aggregate spans two streams and is
    // checked by time below.
    let violations: Vec<_> = d
        .order_violations()
        .into_iter()
        .filter(|(_, id)| id != "mixed")
        .collect();
    assert!(violations.is_empty(), "{violations:?}");
    let mixed_at = |entries: &[(String, std::collections::HashMap<String, String>)]| {
        entries
            .iter()
            .find(|(_, f)| f.get("ce_subject").map(String::as_str) == Some("mixed"))
            .map(|(id, _)| entry_ms(id))
            .unwrap()
    };
    let slow = support::read_stream(&mut conn, &slow_key).await;
    let fast = support::read_stream(&mut conn, &fast_key).await;
    assert!(
        mixed_at(&fast) >= mixed_at(&slow),
        "the mixed aggregate's fast event went out after its slow one"
    );
}

/// A limited stream's backlog sits at the head of every partition, more rows of it in each than
/// one claim reads: the other stream's rows behind it are published at once all the same, and
/// no aggregate's events overtake one another, whichever streams they go to.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limited_backlog_in_every_partition_holds_up_no_other_stream() {
    let db = TestDb::with_pool(8).await;
    let redis = TestRedis::new();
    let routes = [
        ("routing.overrides.slow", "events:slow"),
        ("routing.overrides.fast", "events:fast"),
        // Claims of 20 rows: each partition has several claims' worth of slow rows at its head.
        ("relay.batch_rows", "20"),
    ];
    let limits = [
        ("rate_limit.streams.events:slow", "5"),
        ("rate_limit.burst", "5"),
    ];
    let settings: Vec<(&str, &str)> = routes.iter().chain(&limits).copied().collect();
    // 800 slow events first (40 aggregates of 20: 160 s under the limit), then the rest.
    let slow: Vec<EventFact> = (0..800)
        .map(|i| EventFact::new("order", format!("s{}", i % 40), "slow", json!({ "i": i })))
        .collect();
    support::commit_facts(&db.store, slow).await;
    // Aggregates of the fast stream only, and aggregates that go to both: a fast event after a
    // slow one waits for it; a fast event before a slow one does not.
    let fast_only = 300;
    let mut facts: Vec<EventFact> = (0..fast_only)
        .map(|i| EventFact::new("order", format!("f{}", i % 60), "fast", json!({ "i": i })))
        .collect();
    for m in 0..10 {
        for kind in ["fast", "slow", "fast", "fast"] {
            facts.push(EventFact::new("order", format!("m{m}"), kind, json!({})));
        }
    }
    support::commit_facts(&db.store, facts).await;
    let total = 800 + fast_only + 40;
    let partitions =
        support::scalar(&db, "SELECT count(DISTINCT partition) FROM outpost_event").await;
    assert!(
        partitions >= 8,
        "the slow backlog spreads over {partitions} partitions"
    );

    let a = support::start_node(support::relay_config_for(
        &db, &redis, "cursor-a", &settings,
    ))
    .await;
    let mut conn = redis.conn().await;
    let slow_key = format!("{}events:slow", redis.prefix);
    let fast_key = format!("{}events:fast", redis.prefix);
    let subject = |f: &std::collections::HashMap<String, String>| {
        f.get("ce_subject").cloned().unwrap_or_default()
    };
    // Every fast event that waits for no slow one: the fast-only aggregates' and each mixed
    // aggregate's first.
    wait_until(
        30,
        "the fast stream's events behind the slow backlog",
        || {
            let mut c = conn.clone();
            let key = fast_key.clone();
            async move {
                let out = support::read_stream(&mut c, &key).await;
                out.iter()
                    .filter(|(_, f)| subject(f).starts_with('f'))
                    .count()
                    == fast_only
                    && out
                        .iter()
                        .filter(|(_, f)| subject(f).starts_with('m'))
                        .count()
                        >= 10
            }
        },
    )
    .await;
    let slow_then = support::read_stream(&mut conn, &slow_key).await.len();
    assert!(
        slow_then < 300,
        "{slow_then} slow events out: the limit of 5/s did not hold"
    );
    a.shutdown().await;

    // A node without the limit publishes the rest.
    let b = support::start_node(support::relay_config_for(&db, &redis, "cursor-b", &routes)).await;
    wait_until(60, "every event to be published", || {
        let mut c = conn.clone();
        let prefix = redis.prefix.clone();
        async move { Deliveries::collect(&mut c, &prefix).await.unique() == total }
    })
    .await;
    b.shutdown().await;
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert_eq!(d.duplicates(), 0);
    // Across both streams, each aggregate's events went out in sequence order: by entry time
    // (milliseconds, so equal times pass), and by sequence within each stream.
    let mut at: std::collections::HashMap<String, Vec<(i64, i64)>> = Default::default();
    for key in [&slow_key, &fast_key] {
        for (id, f) in support::read_stream(&mut conn, key).await {
            let seq: i64 = f["ce_aggregateseq"].parse().unwrap();
            at.entry(subject(&f))
                .or_default()
                .push((seq, entry_ms(&id)));
        }
    }
    for (aggregate, mut events) in at {
        events.sort_unstable();
        let seqs: Vec<i64> = events.iter().map(|(s, _)| *s).collect();
        let expected: Vec<i64> = (1..=i64::try_from(seqs.len()).unwrap()).collect();
        assert_eq!(seqs, expected, "{aggregate}: every event once");
        assert!(
            events.windows(2).all(|w| w[0].1 <= w[1].1),
            "{aggregate}: an event went out before an earlier one of its aggregate: {events:?}"
        );
    }
    // Within each stream (the mixed aggregates were checked across both above).
    let violations: Vec<_> = d
        .order_violations()
        .into_iter()
        .filter(|(_, id)| !id.starts_with('m'))
        .collect();
    assert!(violations.is_empty(), "{violations:?}");
}
