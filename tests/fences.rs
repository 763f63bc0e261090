//! The fences at Redis against values Outpost did not write, and epochs past what Lua's numbers
//! hold exactly. A fence that holds no epoch stops only its partition's appends to its stream (a
//! fence key that is not a hash: the stream's), as a transient fault: retried, counted, nothing
//! quarantined, no attempt burned; once an operator fixes it the events go out in order. An epoch
//! of 1e14 or more is an epoch like any other, compared digit by digit: a fence of 1e14 the
//! database never handed out is moved past, and epochs that differ beyond 2^53 still fence each
//! other.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use outpost::produce::EventFact;
use outpost::publish::{
    Publisher, RedisSettings, StreamBatch, StreamOutcome, Topology, companion_key,
};
use serde_json::json;
use support::{
    Deliveries, TestDb, TestRedis, aggregate_in, commit_facts, relay_config, scalar, start_node,
    wait_until,
};

/// The partition whose fence the tests spoil, and a partition left alone.
const SPOILT: i32 = 5;
const HEALTHY: i32 = 9;

/// The fence hash of aggregate type `order`'s stream (default routing: `events:order`).
fn fence_of_orders(redis: &TestRedis) -> String {
    let stream = format!("{}events:order", redis.prefix);
    companion_key(&redis.prefix, "fence", &stream).unwrap()
}

/// Runs a Redis command whose answer does not matter.
async fn command(conn: &mut redis::aio::MultiplexedConnection, args: &[&str]) {
    let _: () = redis::cmd(args[0])
        .arg(&args[1..])
        .query_async(conn)
        .await
        .unwrap();
}

async fn hset(conn: &mut redis::aio::MultiplexedConnection, key: &str, field: i32, value: &str) {
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg(field)
        .arg(value)
        .query_async(conn)
        .await
        .unwrap();
}

async fn hget(conn: &mut redis::aio::MultiplexedConnection, key: &str, field: i32) -> String {
    redis::cmd("HGET")
        .arg(key)
        .arg(field)
        .query_async(conn)
        .await
        .unwrap()
}

/// The value of a counter without labels on the node's `/metrics` (0 before its first increase).
async fn counter(node: &outpost::app::NodeHandle, name: &str) -> f64 {
    let (_, text) = support::http_get(&node.admin_addr().to_string(), "/metrics").await;
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .find_map(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The epoch of partition [`SPOILT`]'s lease in the database.
async fn lease_epoch(db: &TestDb) -> i64 {
    scalar(
        db,
        &format!("SELECT epoch FROM outpost_partition WHERE partition = {SPOILT}"),
    )
    .await
}

async fn published(db: &TestDb) -> i64 {
    scalar(db, "SELECT count(*) FROM outpost_published").await
}

fn order(aggregate: &str, n: i64) -> EventFact {
    EventFact::new("order", aggregate, "order.placed", json!({ "n": n }))
}

/// A node with the first event of an aggregate of partition [`SPOILT`] published, so that the
/// stream and its fence exist: the node, a connection, the aggregate and the fence key.
struct Started {
    node: outpost::app::NodeHandle,
    conn: redis::aio::MultiplexedConnection,
    spoilt: String,
    fence: String,
}

async fn start_with_one_published(db: &TestDb, redis: &TestRedis) -> Started {
    let conn = redis.conn().await;
    let spoilt = aggregate_in(db, SPOILT, 0).await;
    let node = start_node(relay_config(db, redis, "n1")).await;
    commit_facts(&db.store, vec![order(&spoilt, 1)]).await;
    wait_until(30, "the first event to be published", || async {
        published(db).await == 1
    })
    .await;
    Started {
        node,
        conn,
        spoilt,
        fence: fence_of_orders(redis),
    }
}

/// How a fence is spoilt.
enum Spoil {
    /// The partition's field set to this value.
    Field(&'static str),
    /// The key replaced by a string.
    NotAHash,
}

/// How an operator puts a spoilt fence right.
enum Fix {
    /// `HDEL` the partition's field: the owner writes its epoch at its next append.
    Remove,
    /// `HSET` the field to the partition's epoch (`outpost status`, `outpost_partition`).
    SetToLeaseEpoch,
    /// `DEL` the key: the relay handles it as a fence Redis lost, re-publishing the recent
    /// events of the partitions that wrote the stream.
    DeleteKey,
}

/// A node delivers one event of partition [`SPOILT`], then its fence is spoilt: the partition's
/// next events are not appended, nothing is quarantined, no attempt is counted,
/// `outpost_fence_invalid_total` rises, and partition [`HEALTHY`] on the same stream goes on.
/// After `fix`, every event goes out in order (once, unless the fix re-publishes).
async fn spoilt_fence_is_retried_until_fixed(spoil: Spoil, fix: Fix) {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let Started {
        node,
        mut conn,
        spoilt,
        fence,
    } = start_with_one_published(&db, &redis).await;
    let healthy = aggregate_in(&db, HEALTHY, 0).await;
    match spoil {
        Spoil::Field(value) => hset(&mut conn, &fence, SPOILT, value).await,
        Spoil::NotAHash => {
            command(&mut conn, &["SET", &fence, "not a hash"]).await;
        }
    }
    let before = counter(&node, "outpost_fence_invalid_total").await;
    for n in 2..=4 {
        commit_facts(&db.store, vec![order(&spoilt, n)]).await;
    }
    commit_facts(&db.store, vec![order(&healthy, 1)]).await;
    // A spoilt field stops its own partition; a key that is not a hash, every partition's
    // appends to its stream.
    let healthy_waits = matches!(spoil, Spoil::NotAHash);
    let blamed = "SELECT count(*) FROM outpost_event WHERE status <> 'pending' OR attempts > 0";
    wait_until(
        30,
        "the healthy partition to be done and the spoilt fence to be met again and again \
         (or an event to be blamed for it)",
        || async {
            published(&db).await == if healthy_waits { 1 } else { 2 }
                && (counter(&node, "outpost_fence_invalid_total").await >= before + 3.0
                    || scalar(&db, blamed).await > 0)
        },
    )
    .await;
    assert_eq!(
        scalar(&db, blamed).await,
        0,
        "a spoilt fence burns no attempt and quarantines nothing"
    );
    assert!(counter(&node, "outpost_fence_invalid_total").await >= before + 3.0);
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_event").await,
        if healthy_waits { 4 } else { 3 },
        "the spoilt fence's events wait"
    );
    if let Spoil::Field(value) = spoil {
        assert_eq!(
            hget(&mut conn, &fence, SPOILT).await,
            value,
            "left as it was"
        );
    }

    match fix {
        Fix::Remove => {
            command(&mut conn, &["HDEL", &fence, &SPOILT.to_string()]).await;
        }
        Fix::SetToLeaseEpoch => {
            let epoch = lease_epoch(&db).await;
            hset(&mut conn, &fence, SPOILT, &epoch.to_string()).await;
        }
        Fix::DeleteKey => {
            command(&mut conn, &["DEL", &fence]).await;
        }
    }
    wait_until(30, "every event to be published", || async {
        published(&db).await == 5
    })
    .await;
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert_eq!(
        d.order.get(&("order".to_owned(), spoilt.clone())),
        Some(&vec![1, 2, 3, 4])
    );
    if !matches!(fix, Fix::DeleteKey) {
        assert_eq!(d.duplicates(), 0);
    }
    let epoch = lease_epoch(&db).await;
    assert_eq!(hget(&mut conn, &fence, SPOILT).await, epoch.to_string());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_that_is_not_a_number_stops_its_partition_until_the_field_is_removed() {
    spoilt_fence_is_retried_until_fixed(Spoil::Field("abc"), Fix::Remove).await;
}

/// A fence key that is not a hash can only be deleted; the relay then re-creates it as after a
/// Redis data loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_that_is_not_a_hash_stops_its_stream_until_it_is_deleted() {
    spoilt_fence_is_retried_until_fixed(Spoil::NotAHash, Fix::DeleteKey).await;
}

/// `i64::MAX`: no epoch the database can hand out is above it, so it cannot be an epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_past_every_epoch_stops_its_partition_until_it_is_set_to_the_lease_epoch() {
    spoilt_fence_is_retried_until_fixed(Spoil::Field("9223372036854775807"), Fix::SetToLeaseEpoch)
        .await;
}

/// A fence of 1e14 the database never handed out (Lua wrote it back as `1e+14`, an unreadable
/// reply, and every event of the partition was quarantined in turn): the owner moves its epoch
/// past it, as past any fence newer than the database, and delivers in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_of_1e14_is_an_epoch_the_owner_moves_past() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let mut s = start_with_one_published(&db, &redis).await;
    hset(&mut s.conn, &s.fence, SPOILT, "100000000000000").await;
    for n in 2..=4 {
        commit_facts(&db.store, vec![order(&s.spoilt, n)]).await;
    }
    wait_until(30, "every event to be published", || async {
        published(&db).await == 4
    })
    .await;
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_published WHERE attempts > 0"
        )
        .await,
        0
    );
    let epoch = lease_epoch(&db).await;
    assert_eq!(epoch, 100_000_000_000_001);
    assert_eq!(hget(&mut s.conn, &s.fence, SPOILT).await, "100000000000001");
    let d = Deliveries::collect(&mut s.conn, &redis.prefix).await;
    assert_eq!(
        d.order.get(&("order".to_owned(), s.spoilt.clone())),
        Some(&vec![1, 2, 3, 4])
    );
    s.node.shutdown().await;
}

fn batch(stream: &str, epoch: i64, seq: i64) -> StreamBatch {
    StreamBatch {
        stream: stream.to_owned(),
        partition: SPOILT,
        epoch,
        known: false,
        expect: None,
        entries: vec![support::plain_entry(seq)],
    }
}

/// The script reads and compares fences exactly: epochs beyond 2^53 that differ by one fence
/// each other (as doubles they were equal, and the older epoch appended), leading zeros are
/// read, and values that are no epoch (not digits, not below `i64::MAX`, a key that is not a
/// hash) are reported as such, appending nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publish_script_compares_large_epochs_exactly_and_reports_fences_that_hold_none() {
    let redis = TestRedis::new();
    let mut conn = redis.conn().await;
    let publisher = Publisher::connect(&RedisSettings {
        url: support::redis_url(),
        key_prefix: redis.prefix.clone(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(5),
        topology: Topology::Single,
    })
    .await
    .unwrap();
    let stream = publisher.stream_key("s");
    let fence = publisher.fence_key(&stream).unwrap();
    let publish = |epoch: i64, seq: i64| {
        let (publisher, stream) = (&publisher, &stream);
        async move {
            let mut out = publisher
                .publish(&[batch(stream, epoch, seq)])
                .await
                .unwrap();
            assert_eq!(out.len(), 1);
            out.remove(0)
        }
    };
    let xlen = |mut c: redis::aio::MultiplexedConnection| {
        let stream = stream.clone();
        async move {
            redis::cmd("XLEN")
                .arg(&stream)
                .query_async::<i64>(&mut c)
                .await
                .unwrap()
        }
    };

    let big: i64 = 123_456_789_012_345_679;
    assert!(matches!(publish(big, 1).await, StreamOutcome::Published(_)));
    assert_eq!(hget(&mut conn, &fence, SPOILT).await, big.to_string());
    assert_eq!(
        publish(big - 1, 2).await,
        StreamOutcome::Fenced { current: big },
        "an epoch one below, beyond 2^53"
    );
    assert!(matches!(
        publish(big + 1, 2).await,
        StreamOutcome::Published(_)
    ));
    assert_eq!(hget(&mut conn, &fence, SPOILT).await, (big + 1).to_string());

    hset(&mut conn, &fence, SPOILT, "0007").await;
    assert_eq!(publish(6, 3).await, StreamOutcome::Fenced { current: 7 });
    assert!(matches!(publish(7, 3).await, StreamOutcome::Published(_)));
    assert_eq!(xlen(conn.clone()).await, 3);

    for value in [
        "abc",
        "-5",
        "1e+14",
        "9223372036854775807",
        "99999999999999999999",
    ] {
        hset(&mut conn, &fence, SPOILT, value).await;
        assert_eq!(
            publish(8, 4).await,
            StreamOutcome::BadFence {
                fence: fence.clone(),
                value: Some(value.to_owned())
            },
            "{value}"
        );
    }
    command(&mut conn, &["SET", &fence, "not a hash"]).await;
    assert_eq!(
        publish(8, 4).await,
        StreamOutcome::BadFence {
            fence: fence.clone(),
            value: None
        }
    );
    assert_eq!(
        xlen(conn.clone()).await,
        3,
        "nothing appended past a bad fence"
    );
}
