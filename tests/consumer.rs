//! The consumer helpers against real PostgreSQL and Redis: once-only effects in sequence order
//! per aggregate, dead letters, and entries lost to trimming.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;

use outpost::consume::{Consumer, StartFrom};
use support::consumer::{
    Ev, Running, append, append_foreign, applied, check, create_effects, effects, pending,
    recorder, settings, tail,
};
use support::{TestDb, TestRedis, wait_until};

/// Every aggregate's sequences 1..=n.
fn expected(aggregates: usize, n: i64) -> BTreeMap<String, Vec<i64>> {
    (0..aggregates)
        .map(|a| (format!("a{a}"), (1..=n).collect()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_members_apply_each_event_once_in_order_despite_duplicates_and_replays() {
    let (db, redis) = (TestDb::new().await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);
    let mut conn = redis.conn().await;
    const AGGREGATES: usize = 100;
    const EVENTS: i64 = 10;
    let events: Vec<Vec<Ev>> = (0..AGGREGATES)
        .map(|a| {
            (1..=EVENTS)
                .map(|s| Ev::new(&format!("a{a}"), s, "order.changed"))
                .collect()
        })
        .collect();
    // Interleave the aggregates as concurrent producers would; inject a duplicate of every
    // seventh event right after it, and a replay of each tenth aggregate's first half later on.
    let mut entries = Vec::new();
    for s in 0..EVENTS as usize {
        for (a, evs) in events.iter().enumerate() {
            entries.push(evs[s].clone());
            if (a + s) % 7 == 0 {
                entries.push(evs[s].clone());
            }
            if s == 8 && a % 10 == 0 {
                entries.extend(evs[..5].iter().cloned());
            }
        }
    }
    // One aggregate's events arrive out of order (a replay put 2 before 1): 2 waits for 1. They
    // are appended after everything else, 1 only once a member holds 2, so 2 is read in a round
    // of its own and must be held (two entries read in one round are simply sorted).
    let late = [
        Ev::new("late", 2, "order.changed"),
        Ev::new("late", 1, "order.changed"),
    ];
    let total = entries.len() + late.len();
    assert!(total > AGGREGATES * EVENTS as usize + 100);

    let a = Running::start(
        settings(&redis, &stream, "billing", "m1"),
        &db,
        recorder("m1"),
    )
    .await;
    let b = Running::start(
        settings(&redis, &stream, "billing", "m2"),
        &db,
        recorder("m2"),
    )
    .await;
    for chunk in entries.chunks(97) {
        append(&mut conn, &stream, chunk).await;
    }
    wait_until(60, "every in-order event applied", || async {
        applied(&db).await >= AGGREGATES as i64 * EVENTS
    })
    .await;
    let all_acknowledged =
        || async { pending(&mut redis.conn().await, &stream, "billing").await == 0 };
    wait_until(30, "every entry acknowledged", all_acknowledged).await;
    append(&mut conn, &stream, &late[..1]).await;
    // Read and not acknowledged: a member holds it (only 1 would let it apply).
    wait_until(30, "the out-of-order event read", || async {
        pending(&mut redis.conn().await, &stream, "billing").await == 1
    })
    .await;
    append(&mut conn, &stream, &late[1..]).await;
    let want = AGGREGATES as i64 * EVENTS + 2;
    wait_until(60, "every event applied", || async {
        applied(&db).await >= want
    })
    .await;
    wait_until(30, "every entry acknowledged", all_acknowledged).await;
    let (sa, sb) = (a.stop().await, b.stop().await);

    let mut want_map = expected(AGGREGATES, EVENTS);
    want_map.insert("late".into(), vec![1, 2]);
    let result = check(&db, &want_map).await;
    assert!(result.is_clean(), "{result:?}");
    assert_eq!(result.applied as i64, want);
    assert!(
        sa.processed > 0 && sb.processed > 0,
        "both members worked: {sa:?} {sb:?}"
    );
    assert_eq!(sa.processed + sb.processed, want as u64);
    // Every entry was applied or skipped as a duplicate; one held past the claim time under
    // load may also be reclaimed by the other member and skipped there.
    assert!(
        (sa.processed + sa.duplicates + sb.processed + sb.duplicates) as usize >= total,
        "every entry was either applied or skipped as a duplicate"
    );
    assert!(sa.held + sb.held > 0, "the out-of-order event was held");
    assert_eq!(sa.lost + sb.lost, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_events_go_to_the_dead_letter_stream_and_everything_else_flows() {
    let (db, redis) = (TestDb::new().await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);
    let mut conn = redis.conn().await;
    // Every aggregate: changed, flagged (refused permanently), changed, audited (always asks
    // for a retry), changed.
    let types = [
        "order.changed",
        "order.flagged",
        "order.changed",
        "order.audited",
        "order.changed",
    ];
    let mut entries = Vec::new();
    for a in 0..20 {
        for (i, t) in types.iter().enumerate() {
            entries.push(Ev::new(&format!("a{a}"), i as i64 + 1, t));
        }
    }
    append(&mut conn, &stream, &entries).await;
    // And an entry that is not an Outpost event at all.
    append_foreign(&mut conn, &stream).await;

    let mut s = settings(&redis, &stream, "shipping", "m1");
    s.max_deliveries = 3;
    let mut handler = recorder("m1");
    handler.permanent.insert("order.flagged".into());
    handler.retry.insert("order.audited".into());
    let running = Running::start(s, &db, handler).await;
    let dead = format!("{stream}:dead");
    wait_until(60, "failing events dead-lettered", || async {
        let n: i64 = redis::cmd("XLEN")
            .arg(&dead)
            .query_async(&mut redis.conn().await)
            .await
            .unwrap();
        n == 41
    })
    .await;
    wait_until(30, "everything else applied", || async {
        applied(&db).await == 60
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 41);
    assert_eq!(stats.processed, 60);

    let want: BTreeMap<String, Vec<i64>> =
        (0..20).map(|a| (format!("a{a}"), vec![1, 3, 5])).collect();
    let result = check(&db, &want).await;
    assert!(result.is_clean(), "{result:?}");
    assert_eq!(result.applied, 60, "no refused event was applied");

    // The dead letters keep the original fields and say why, and after how many deliveries.
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(&dead)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let field = |e: &redis::streams::StreamId, k: &str| -> String {
        e.get::<String>(k).unwrap_or_default()
    };
    let flagged: Vec<_> = reply
        .ids
        .iter()
        .filter(|e| field(e, "ce_type") == "order.flagged")
        .collect();
    assert_eq!(flagged.len(), 20);
    assert!(
        flagged
            .iter()
            .all(|e| field(e, "dead_reason") == "this type is refused"
                && field(e, "dead_deliveries") == "1"
                && field(e, "dead_group") == "shipping"
                && !field(e, "ce_id").is_empty()
                && !field(e, "dead_stream_id").is_empty())
    );
    let audited: Vec<_> = reply
        .ids
        .iter()
        .filter(|e| field(e, "ce_type") == "order.audited")
        .collect();
    assert_eq!(audited.len(), 20);
    assert!(audited.iter().all(|e| field(e, "dead_deliveries") == "3"
        && field(e, "dead_reason").contains("a dependency is down")));
    let foreign: Vec<_> = reply
        .ids
        .iter()
        .filter(|e| field(e, "hello") == "world")
        .collect();
    assert_eq!(foreign.len(), 1);
    assert!(field(foreign[0], "dead_reason").contains("not an Outpost event"));
    // The inbox says what became of each.
    let dead_in_inbox = support::scalar(
        &db,
        "SELECT count(*) FROM outpost_inbox WHERE consumer_group = 'shipping' \
         AND outcome = 'dead_lettered'",
    )
    .await;
    assert_eq!(dead_in_inbox, 40);
    assert_eq!(pending(&mut conn, &stream, "shipping").await, 0);
}

/// The producer's database restored from a backup: sequences 4 and 5 are used again by new
/// events. The group applies them (their event ids are new), in order, and the events after them;
/// copies of events it applied before the restore are still skipped, whatever their sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn new_events_reusing_sequences_after_a_producer_restore_are_applied_in_order() {
    let (db, redis) = (TestDb::new().await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);
    let mut conn = redis.conn().await;
    let before: Vec<Ev> = (1..=5).map(|s| Ev::new("r", s, "order.changed")).collect();
    append(&mut conn, &stream, &before).await;
    let running = Running::start(
        settings(&redis, &stream, "books", "m1"),
        &db,
        recorder("m1"),
    )
    .await;
    wait_until(30, "the history before the restore applied", || async {
        applied(&db).await == 5
    })
    .await;

    // The restore point is after sequence 3: new facts take sequences 4, 5 and 6. A copy of the
    // old sequence 5 and of the old sequence 2 (a replay) arrives among them.
    let after: Vec<Ev> = (4..=6).map(|s| Ev::new("r", s, "order.changed")).collect();
    let mixed = [
        after[0].clone(),
        before[4].clone(),
        after[1].clone(),
        before[1].clone(),
        after[2].clone(),
    ];
    append(&mut conn, &stream, &mixed).await;
    wait_until(30, "the new events applied", || async {
        applied(&db).await == 8
    })
    .await;
    wait_until(30, "every entry acknowledged", || async {
        pending(&mut redis.conn().await, &stream, "books").await == 0
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(stats.processed, 8);
    assert_eq!(
        stats.duplicates, 2,
        "the two copies of old events were skipped"
    );

    let got = effects(&db).await;
    let want: Vec<(i64, uuid::Uuid)> = before
        .iter()
        .chain(&after)
        .map(|e| (e.seq, e.event_id))
        .collect();
    assert_eq!(
        got, want,
        "each event once, the rewound history in order after the old"
    );
    assert_eq!(
        support::scalar(
            &db,
            "SELECT last_seq FROM outpost_consumer_position WHERE consumer_group = 'books'"
        )
        .await,
        6
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn entries_trimmed_before_the_group_read_them_are_reported_as_lost() {
    let (db, redis) = (TestDb::new().await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);
    let mut conn = redis.conn().await;
    // The group exists (created by the helper) before anything is written.
    let s = settings(&redis, &stream, "audit", "m1");
    let consumer = Consumer::connect(s.clone(), db.store.connection().clone(), recorder("m1"))
        .await
        .unwrap();
    assert_eq!(s.start, StartFrom::Beginning);
    let events: Vec<Ev> = (1..=50)
        .map(|i| Ev::new(&format!("a{i}"), 1, "order.changed"))
        .collect();
    append(&mut conn, &stream, &events).await;
    // A member reads the first five, hangs in its handler and dies without acknowledging them.
    let mut ghost_settings = settings(&redis, &stream, "audit", "ghost");
    ghost_settings.batch = 5;
    let mut ghost_handler = recorder("ghost");
    ghost_handler.hang = true;
    let ghost = Consumer::connect(ghost_settings, db.store.connection().clone(), ghost_handler)
        .await
        .unwrap();
    let ghost = tokio::spawn(ghost.run_until(std::future::pending()));
    wait_until(30, "the ghost to hold five entries", || async {
        pending(&mut redis.conn().await, &stream, "audit").await == 5
    })
    .await;
    ghost.abort();
    // Then an unsafe trim keeps only the last 20: 5 pending and 25 unread entries are gone.
    let _: i64 = redis::cmd("XTRIM")
        .arg(&stream)
        .arg("MAXLEN")
        .arg(20)
        .query_async(&mut conn)
        .await
        .unwrap();

    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(async move {
        let _ = rx.await;
    }));
    wait_until(30, "the remaining entries applied", || async {
        applied(&db).await == 20
    })
    .await;
    // The ghost's entries are reclaimed after claim_idle and found gone.
    let lost_key = format!("{}outpost:consumer:{{{stream}}}", redis.prefix);
    wait_until(30, "every lost entry counted", || async {
        let n: Option<i64> = redis::cmd("HGET")
            .arg(&lost_key)
            .arg("lost:audit")
            .query_async(&mut redis.conn().await)
            .await
            .unwrap();
        n == Some(30)
    })
    .await;
    let _ = stop.send(());
    let stats = task.await.unwrap().unwrap();
    assert_eq!(stats.lost, 30, "{stats:?}");
    assert_eq!(stats.processed, 20);
    let want: BTreeMap<String, Vec<i64>> = (31..=50).map(|i| (format!("a{i}"), vec![1])).collect();
    assert!(check(&db, &want).await.is_clean());
    assert_eq!(pending(&mut conn, &stream, "audit").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_prints_entries_decoded_and_as_a_group_member_acknowledges_them() {
    let redis = TestRedis::new();
    let stream = format!("{}events:order", redis.prefix);
    let mut conn = redis.conn().await;
    let events: Vec<Ev> = (1..=3).map(|s| Ev::new("a1", s, "order.changed")).collect();
    append(&mut conn, &stream, &events).await;
    append_foreign(&mut conn, &stream).await;

    let text = tail(&redis, &["events:order", "--from", "0", "--no-follow"]);
    for s in 1..=3 {
        assert!(
            text.contains(&format!("order.changed  order/a1 #{s}")),
            "{text}"
        );
        assert!(text.contains(&format!("\"seq\": {s}")), "{text}");
    }
    assert!(text.contains("not an Outpost event"), "{text}");

    let json = tail(
        &redis,
        &[
            "events:order",
            "--group",
            "tailers",
            "--from",
            "0",
            "--count",
            "2",
            "--json",
        ],
    );
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["aggregate_seq"], 1);
    assert_eq!(lines[1]["event_id"], events[1].event_id.to_string());
    assert_eq!(
        pending(&mut conn, &stream, "tailers").await,
        0,
        "what it printed is acknowledged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_and_group_that_vanish_under_a_running_consumer_are_created_again() {
    let (db, redis) = (TestDb::new().await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);
    let mut conn = redis.conn().await;
    let events: Vec<Ev> = (1..=10)
        .map(|s| Ev::new("a1", s, "order.changed"))
        .collect();
    // Reclaim passes run every round, so the first command to meet the missing group is the
    // reclaim, not the read.
    let mut s = settings(&redis, &stream, "billing", "m1");
    s.claim_interval = std::time::Duration::from_millis(1);
    let running = Running::start(s, &db, recorder("m1")).await;
    append(&mut conn, &stream, &events[..5]).await;
    wait_until(30, "the first events applied", || async {
        applied(&db).await == 5
    })
    .await;

    // As after a Redis restart without persistence: the stream, its group and the helper's own
    // key are gone; the relay then writes the next events to a new stream.
    let state = format!("{}outpost:consumer:{{{stream}}}", redis.prefix);
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .arg(&state)
        .query_async(&mut conn)
        .await
        .unwrap();
    append(&mut conn, &stream, &events[5..]).await;
    wait_until(
        30,
        "the later events applied from the new stream",
        || async { applied(&db).await == 10 },
    )
    .await;
    running.stop().await;
    let want: BTreeMap<String, Vec<i64>> = [("a1".to_owned(), (1..=10).collect())].into();
    let result = check(&db, &want).await;
    assert!(result.is_clean(), "{result:?}");
}
