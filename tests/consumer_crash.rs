//! A consumer that dies between its commit and its acknowledgement loses nothing and applies
//! nothing twice; the deliberately wrong order (acknowledge, then commit) loses the event, and
//! the same checker says so. Needs the `failpoints` feature (`scripts/test` enables it).

#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;

use outpost::consume::{ConsumeError, Consumer};
use support::consumer::{
    Ev, Running, append, applied, check, create_effects, pending, recorder, settings,
};
use support::{TestDb, TestRedis, wait_until};

/// Fault points are process-wide: tests of this file that arm them run one at a time.
static FAULTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const EVENTS: i64 = 20;

/// Writes one aggregate's events, runs a member until the fault point `point` kills it (after
/// it processed exactly one event), then a second member until the stream is drained. Returns
/// the checker's verdict and the second member's stats.
async fn crash_then_take_over(
    point: &str,
    ack_before_commit: bool,
) -> (support::consumer::Check, outpost::consume::ConsumerStats) {
    let (db, redis) = (TestDb::new().await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);
    let mut conn = redis.conn().await;
    let events: Vec<Ev> = (1..=EVENTS)
        .map(|s| Ev::new("a1", s, "order.changed"))
        .collect();
    append(&mut conn, &stream, &events).await;

    let mut first = settings(&redis, &stream, "billing", "dies");
    first.ack_before_commit = ack_before_commit;
    let consumer = Consumer::connect(first, db.store.connection().clone(), recorder("dies"))
        .await
        .unwrap();
    {
        let _armed = FAULTS.lock().await;
        fail::cfg(point, "1*return").unwrap();
        let died = consumer.run_until(std::future::pending()).await;
        fail::remove(point);
        assert!(
            matches!(died, Err(ConsumeError::Fault(p)) if p == point),
            "the member died at {point}: {died:?}"
        );
    }

    let mut takes_over = settings(&redis, &stream, "billing", "takes-over");
    takes_over.max_deliveries = 2;
    let second = Running::start(takes_over, &db, recorder("takes-over")).await;
    wait_until(60, "every entry acknowledged or dead-lettered", || async {
        pending(&mut redis.conn().await, &stream, "billing").await == 0
            && (ack_before_commit || applied(&db).await == EVENTS)
    })
    .await;
    let stats = second.stop().await;
    let want: BTreeMap<String, Vec<i64>> = [("a1".to_owned(), (1..=EVENTS).collect())].into();
    (check(&db, &want).await, stats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_killed_after_commit_before_ack_is_taken_over_and_applies_once() {
    let (result, stats) = crash_then_take_over("consume-after-commit", false).await;
    assert!(result.is_clean(), "{result:?}");
    assert_eq!(result.applied as i64, EVENTS);
    assert!(
        stats.taken_over >= 1,
        "the dead member's entries were taken over: {stats:?}"
    );
    assert!(
        stats.duplicates >= 1,
        "the committed event was skipped, not applied again: {stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledging_before_commit_loses_the_event_and_the_checker_sees_it() {
    let (result, _) = crash_then_take_over("consume-after-ack", true).await;
    // Event 1 was acknowledged but never committed: it is gone, and with it the aggregate's
    // order; the later events wait for it, then go to the dead-letter stream as a gap.
    assert!(
        result.missing.contains(&("a1".to_owned(), 1)),
        "the checker reports the lost event: {result:?}"
    );
    assert!(!result.is_clean());
}
