//! The consumer helpers read streams anyone with Redis access can write to. Hostile or broken
//! entries — field names or values that are not UTF-8, payloads that are not JSON, ids that are
//! not UUIDs, missing fields, forged sequences — go to the dead-letter stream with a reason, and
//! never stall the group: the rest of the batch is applied, and taking over or reclaiming
//! pending entries moves past them. An event id reused by another aggregate is not taken for a
//! duplicate. Real PostgreSQL and Redis.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;

use outpost::publish::companion_key;
use sea_orm::ConnectionTrait;
use support::consumer::{
    Ev, Running, append, append_foreign, append_raw, check, create_effects, effects, entries_raw,
    field_of, pending, recorder, settings, tail, wait_applied_and_acknowledged,
};
use support::{TestDb, TestRedis, scalar, wait_until};

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// A database with the effects table, a key prefix, the stream's key and a connection.
async fn setup() -> (TestDb, TestRedis, String, redis::aio::MultiplexedConnection) {
    let (db, redis) = (TestDb::new().await, TestRedis::new());
    create_effects(&db).await;
    let stream = format!("{}events:order", redis.prefix);
    let conn = redis.conn().await;
    (db, redis, stream, conn)
}

fn ev(aggregate: &str, seq: i64) -> Ev {
    Ev::new(aggregate, seq, "order.changed")
}

async fn dead_count(redis: &TestRedis, dead: &str) -> i64 {
    redis::cmd("XLEN")
        .arg(dead)
        .query_async(&mut redis.conn().await)
        .await
        .unwrap()
}

/// The `dead_reason` of every entry in the dead-letter stream.
async fn dead_reasons(redis: &TestRedis, dead: &str) -> Vec<String> {
    entries_raw(&mut redis.conn().await, dead)
        .await
        .iter()
        .map(|e| field_of(e, "dead_reason").unwrap_or_default())
        .collect()
}

/// Asserts that exactly `n` reasons contain `what`.
fn assert_reason(reasons: &[String], what: &str, n: usize) {
    let found = reasons.iter().filter(|r| r.contains(what)).count();
    assert_eq!(
        found, n,
        "{n} dead letters saying {what:?}; all: {reasons:#?}"
    );
}

async fn last_seq(db: &TestDb, group: &str, aggregate: &str) -> i64 {
    scalar(
        db,
        &format!(
            "SELECT last_seq FROM outpost_consumer_position WHERE consumer_group = '{group}' \
             AND aggregate_id = '{aggregate}'"
        ),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_entries_are_dead_lettered_with_a_reason_and_the_rest_of_the_batch_applies() {
    let (db, redis, stream, mut conn) = setup().await;
    let dead = format!("{stream}:dead");

    let firsts: Vec<Ev> = (0..4).map(|a| ev(&format!("a{a}"), 1)).collect();
    let rests: Vec<Ev> = (2..=5)
        .flat_map(|s| (0..4).map(move |a| ev(&format!("a{a}"), s)))
        .collect();
    // Events whose identity is sound but whose rest is not: dead-lettered in their aggregate's
    // order, which then moves past them (each aggregate's sequence 2 is applied).
    let bad_name = b"x-\xff\xfe".to_vec();
    let defects: Vec<Fields> = vec![
        ev("x-name", 1).tampered(&bad_name, b"1"),
        ev("x-json", 1).tampered(b"data", b"{\"seq\":1,"),
        ev("x-value", 1).tampered(b"ce_time", b"\xff\x00"),
    ];
    let after_defects: Vec<Ev> = ["x-name", "x-json", "x-value"]
        .iter()
        .map(|a| ev(a, 2))
        .collect();
    // Entries that are not events at all, and forged sequences far past the position.
    let not_events: Vec<Fields> = vec![
        vec![(b"\xff\xfe".to_vec(), b"x".to_vec())],
        ev("a0", 9).tampered(b"ce_id", b"not-a-uuid"),
        ev("zz", 1).tampered(b"ce_subject", b"o-\xc3"),
        ev("zz", 1).tampered(b"ce_subject", b"o-\x001"),
        ev("a1", 2).tampered(b"ce_aggregateseq", b"2x"),
    ];
    let forged = [ev("a1", 1_000_000_000_000), ev("a2", i64::MAX)];

    // One batch, hostile entries among the good ones.
    append(&mut conn, &stream, &firsts).await;
    for f in defects.iter().chain(&not_events) {
        append_raw(&mut conn, &stream, f).await;
    }
    append(&mut conn, &stream, &forged).await;
    append_foreign(&mut conn, &stream).await;
    append(&mut conn, &stream, &after_defects).await;
    append(&mut conn, &stream, &rests).await;

    let running = Running::start(
        settings(&redis, &stream, "hostile", "m1"),
        &db,
        recorder("m1"),
    )
    .await;
    let want_dead = (defects.len() + not_events.len() + forged.len() + 1) as i64;
    wait_until(30, "every hostile entry dead-lettered", || async {
        dead_count(&redis, &dead).await == want_dead
    })
    .await;
    wait_applied_and_acknowledged(&db, &redis, &stream, "hostile", 23).await;
    let stats = running.stop().await;
    assert_eq!(stats.processed, 23, "{stats:?}");
    assert_eq!(stats.dead_lettered, want_dead as u64, "{stats:?}");

    let mut want: BTreeMap<String, Vec<i64>> = (0..4)
        .map(|a| (format!("a{a}"), (1..=5).collect()))
        .collect();
    for a in ["x-name", "x-json", "x-value"] {
        want.insert(a.into(), vec![2]);
    }
    let result = check(&db, &want).await;
    assert!(result.is_clean(), "{result:?}");
    assert_eq!(result.applied, 23, "no hostile entry was applied");

    let reasons = dead_reasons(&redis, &dead).await;
    assert_reason(&reasons, "malformed entry: a field name is not UTF-8", 1);
    assert_reason(&reasons, "malformed entry: data is not JSON", 1);
    assert_reason(&reasons, "malformed entry: field ce_time is not UTF-8", 1);
    assert_reason(&reasons, "not an Outpost event: field ce_id is missing", 2);
    assert_reason(&reasons, "is not a UUID", 1);
    assert_reason(&reasons, "field ce_subject is not UTF-8", 1);
    assert_reason(&reasons, "field ce_subject contains a NUL character", 1);
    assert_reason(&reasons, "\"2x\" is not a sequence number", 1);
    assert_reason(&reasons, "(max_seq_ahead): a forged or corrupt entry", 2);
    // The dead letters keep the fields byte for byte.
    let kept = entries_raw(&mut conn, &dead).await;
    assert!(
        kept.iter()
            .any(|e| e.iter().any(|(k, v)| *k == bad_name && v == b"1")),
        "the field name that is not UTF-8 is kept as it was"
    );
    // The forged sequences did not move the positions; the defects did.
    assert_eq!(last_seq(&db, "hostile", "a1").await, 5);
    assert_eq!(last_seq(&db, "hostile", "a2").await, 5);
    let dead_in_inbox = scalar(
        &db,
        "SELECT count(*) FROM outpost_inbox WHERE consumer_group = 'hostile' \
         AND outcome = 'dead_lettered'",
    )
    .await;
    assert_eq!(dead_in_inbox, 3, "the three defects, each in its aggregate");
}

/// Hostile entries left pending at other members: one dead (taken over after
/// `member_timeout`), one alive but stuck (its entries reclaimed with `XAUTOCLAIM` after
/// `claim_idle`). Both ways move past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn taking_over_and_reclaiming_move_past_hostile_entries() {
    let (db, redis, stream, mut conn) = setup().await;
    let dead = format!("{stream}:dead");
    let group = "reclaim";
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    let read_as = |member: &'static str| {
        let (stream, client) = (stream.clone(), redis.client.clone());
        async move {
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            let _: redis::Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(group)
                .arg(member)
                .arg("COUNT")
                .arg(100)
                .arg("STREAMS")
                .arg(&stream)
                .arg(">")
                .query_async(&mut c)
                .await
                .unwrap();
        }
    };
    // Pending at a member that died without a liveness key.
    append_raw(&mut conn, &stream, &[(b"\xff".to_vec(), b"\xfe".to_vec())]).await;
    append(&mut conn, &stream, &[ev("a0", 1)]).await;
    append_raw(&mut conn, &stream, &ev("x", 1).tampered(b"\xc0name", b"v")).await;
    append(&mut conn, &stream, &[ev("x", 2)]).await;
    read_as("gone").await;
    // Pending at a member that is alive (its key renewed) but stuck.
    append_raw(&mut conn, &stream, &ev("a1", 1).tampered(b"ce_id", b"\xff")).await;
    append(&mut conn, &stream, &[ev("a1", 1)]).await;
    append(&mut conn, &stream, &[ev("a1", 999_999_999_999)]).await;
    read_as("stuck").await;
    let alive = format!(
        "{}:{group}:stuck",
        companion_key(&redis.prefix, "member", &stream).unwrap()
    );
    let _: () = redis::cmd("SET")
        .arg(&alive)
        .arg(1)
        .arg("EX")
        .arg(600)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pending(&mut conn, &stream, group).await, 7);

    let running = Running::start(settings(&redis, &stream, group, "m1"), &db, recorder("m1")).await;
    append(&mut conn, &stream, &[ev("a0", 2), ev("a1", 2)]).await;
    wait_until(30, "every hostile entry dead-lettered", || async {
        dead_count(&redis, &dead).await == 4
    })
    .await;
    wait_applied_and_acknowledged(&db, &redis, &stream, group, 5).await;
    let stats = running.stop().await;
    // The stuck member's entries can only be reclaimed; the dead one's are taken over, or, on
    // a slow machine, reclaimed first.
    assert!(stats.reclaimed >= 3, "{stats:?}");
    assert!(stats.taken_over + stats.reclaimed >= 7, "{stats:?}");
    let want: BTreeMap<String, Vec<i64>> = [
        ("a0".to_owned(), vec![1, 2]),
        ("a1".to_owned(), vec![1, 2]),
        ("x".to_owned(), vec![2]),
    ]
    .into();
    let result = check(&db, &want).await;
    assert!(result.is_clean(), "{result:?}");
    let reasons = dead_reasons(&redis, &dead).await;
    assert_reason(&reasons, "field ce_id is missing", 1);
    assert_reason(&reasons, "a field name is not UTF-8", 1);
    assert_reason(&reasons, "field ce_id is not UTF-8", 1);
    assert_reason(&reasons, "max_seq_ahead", 1);
    let _: () = redis::cmd("DEL")
        .arg(&alive)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Two aggregates' events share an event id (a producer's bug, or a forged entry): each is
/// applied in its own aggregate, and the later events of the second flow. A true copy (same
/// aggregate, same id) is still a duplicate, and so is an event id recorded before the inbox
/// knew aggregates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_id_reused_by_another_aggregate_is_applied_in_both() {
    let (db, redis, stream, mut conn) = setup().await;
    let a1 = ev("A", 1);
    let mut b1 = ev("B", 1);
    b1.event_id = a1.event_id;
    let old = ev("C", 1);
    db.store
        .connection()
        .execute_unprepared(&format!(
            "INSERT INTO outpost_inbox (consumer_group, event_id, aggregate_type, aggregate_id) \
             VALUES ('ids', '{}', '', '')",
            old.event_id
        ))
        .await
        .unwrap();
    append(
        &mut conn,
        &stream,
        &[
            a1.clone(),
            b1,
            ev("B", 2),
            a1.clone(),
            ev("B", 3),
            old,
            ev("A", 2),
        ],
    )
    .await;
    let running = Running::start(settings(&redis, &stream, "ids", "m1"), &db, recorder("m1")).await;
    wait_applied_and_acknowledged(&db, &redis, &stream, "ids", 5).await;
    let stats = running.stop().await;
    assert_eq!(stats.processed, 5, "{stats:?}");
    assert_eq!(
        stats.duplicates, 2,
        "the copy of A1 and the old id: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    let want: BTreeMap<String, Vec<i64>> = [
        ("A".to_owned(), vec![1, 2]),
        ("B".to_owned(), vec![1, 2, 3]),
    ]
    .into();
    let result = check(&db, &want).await;
    assert!(result.is_clean(), "{result:?}");
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM consumer_effect WHERE aggregate = 'C'"
        )
        .await,
        0
    );
    assert_eq!(last_seq(&db, "ids", "B").await, 3);
}

/// `outpost tail` prints hostile entries without letting them act on the terminal, in both
/// forms, and an entry with a field name that is not UTF-8 does not stop it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_prints_hostile_entries_escaped() {
    let (_db, redis, stream, mut conn) = setup().await;
    let id = "o-1\u{1b}]0;owned\u{7}\r\nfake line\u{9b}2J\u{202e}";
    let hostile = ev("x", 1).tampered(b"ce_subject", id.as_bytes());
    append_raw(&mut conn, &stream, &hostile).await;
    append_raw(
        &mut conn,
        &stream,
        &[(b"\xff\x1b[31m".to_vec(), "\u{9b}1;1H\n".as_bytes().to_vec())],
    )
    .await;
    append(&mut conn, &stream, &[ev("a", 1)]).await;
    let acts = |c: char| c.is_control() && c != '\n' || c == '\u{202e}';

    let text = tail(&redis, &["events:order", "--from", "0", "--no-follow"]);
    assert!(!text.contains(acts), "{text:?}");
    assert!(
        text.contains("order/o-1\\u{1b}]0;owned\\u{7}\\r\\nfake line\\u{9b}2J\\u{202e} #1"),
        "{text}"
    );
    assert!(text.contains("not an Outpost event"), "{text}");
    assert!(
        text.contains("order/a #1"),
        "the entries after it are printed: {text}"
    );
    // Three entries: the two events with their three-line payloads, and the other one with
    // its fields.
    assert_eq!(text.lines().count(), 4 + 2 + 4, "{text}");

    let json = tail(
        &redis,
        &["events:order", "--from", "0", "--no-follow", "--json"],
    );
    assert!(!json.contains(acts), "{json:?}");
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(
        lines[0]["aggregate_id"], id,
        "the exact value, JSON-escaped"
    );
}

/// Monotonic order applies any sequence above the position, so a forged sequence far ahead
/// used to be applied and set the position. Now it is dead-lettered and the position stays. A
/// forged event within `max_seq_ahead` is applied (nothing tells it apart), and the real event
/// at its sequence is still applied after it: the documented, bounded effect. The first event
/// of an aggregate the group has not seen is not bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_monotonic_order_a_forged_far_sequence_is_dead_lettered_and_the_position_stays() {
    let (db, redis, stream, mut conn) = setup().await;
    let dead = format!("{stream}:dead");
    let real: Vec<Ev> = (1..=4).map(|s| ev("m", s)).collect();
    let (far, near) = (ev("m", 1_000_000_000_000), ev("m", 3));
    append(
        &mut conn,
        &stream,
        &[
            real[0].clone(),
            real[1].clone(),
            far,
            near.clone(),
            real[2].clone(),
            real[3].clone(),
        ],
    )
    .await;
    // An aggregate the group first meets far into its history (a group started late): not
    // bounded.
    let late = [ev("n", 5_000_000), ev("n", 5_000_001)];
    append(&mut conn, &stream, &late).await;
    let mut s = settings(&redis, &stream, "mono", "m1");
    s.order = outpost::consume::OrderMode::Monotonic;
    let running = Running::start(s, &db, recorder("m1")).await;
    wait_until(30, "the far sequence dead-lettered", || async {
        dead_count(&redis, &dead).await == 1
    })
    .await;
    wait_applied_and_acknowledged(&db, &redis, &stream, "mono", 7).await;
    let stats = running.stop().await;
    assert_eq!((stats.processed, stats.dead_lettered), (7, 1), "{stats:?}");
    let late_ids: Vec<uuid::Uuid> = late.iter().map(|e| e.event_id).collect();
    let (late_got, got): (Vec<_>, Vec<_>) = effects(&db)
        .await
        .into_iter()
        .partition(|(_, id)| late_ids.contains(id));
    assert_eq!(late_got.len(), 2);
    assert_eq!(last_seq(&db, "mono", "n").await, 5_000_001);
    let want: Vec<(i64, uuid::Uuid)> = [&real[0], &real[1], &near, &real[2], &real[3]]
        .iter()
        .map(|e| (e.seq, e.event_id))
        .collect();
    assert_eq!(got, want);
    assert_eq!(last_seq(&db, "mono", "m").await, 4);
    assert_reason(&dead_reasons(&redis, &dead).await, "max_seq_ahead", 1);
}
