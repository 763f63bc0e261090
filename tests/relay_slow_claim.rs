//! A node whose claims take longer than the pause between its busy polls still goes idle, and stays
//! idle. Its
//! own test binary: fault points are process-wide. Needs the `failpoints` feature.

#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use sea_orm::ConnectionTrait;
use serde_json::json;
use support::{TestDb, TestRedis, relay_config_for, scalar, wait_for_idle_node, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_claims_outlast_the_busy_poll_still_goes_idle() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    // Count the times a node goes idle (sets `wants_nudge`) and wakes (clears it).
    db.store
        .connection()
        .execute_unprepared(
            "CREATE SEQUENCE went_idle; CREATE SEQUENCE woke; \
             CREATE FUNCTION count_flag() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN PERFORM nextval(CASE WHEN NEW.wants_nudge THEN 'went_idle' ELSE 'woke' END); \
             RETURN NEW; END $$; \
             CREATE TRIGGER count_flag BEFORE UPDATE OF wants_nudge ON outpost_node \
             FOR EACH ROW WHEN (NEW.wants_nudge IS DISTINCT FROM OLD.wants_nudge) \
             EXECUTE FUNCTION count_flag()",
        )
        .await
        .unwrap();
    let count =
        |seq: &str| format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {seq}");
    let node = support::start_node(relay_config_for(
        &db,
        &redis,
        "slow-claim-node",
        &[("relay.busy_poll_ms", "2"), ("relay.idle_after_ms", "20")],
    ))
    .await;
    wait_until(30, "every partition leased", || async {
        scalar(
            &db,
            "SELECT count(*) FROM outpost_partition WHERE owner = 'slow-claim-node'",
        )
        .await
            == 64
    })
    .await;
    wait_for_idle_node(&db).await;

    // From now on every claim takes 10 ms, five times the pause between busy polls: each poll
    // starts while the one before still holds the partitions. An event wakes the node; once it
    // is published, the node must go idle again.
    fail::cfg("claim", "sleep(10)").unwrap();
    let before = scalar(&db, &count("went_idle")).await;
    support::commit_facts(
        &db.store,
        vec![outpost::produce::EventFact::new(
            "kind0",
            "a",
            "t",
            json!({}),
        )],
    )
    .await;
    wait_until(30, "the node to go idle again after the event", || async {
        scalar(&db, &count("went_idle")).await > before
    })
    .await;
    // It stays idle: nothing wakes it for three heartbeats (600 ms). A poll still under way when
    // it went idle must not count as work found and wake it again.
    let woke = scalar(&db, &count("woke")).await;
    let since = scalar(
        &db,
        "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8",
    )
    .await;
    wait_until(30, "three more heartbeats", || async {
        scalar(
            &db,
            &format!(
                "SELECT count(*) FROM outpost_node WHERE node_id = 'slow-claim-node' \
                 AND heartbeat_at > to_timestamp({since} / 1000.0) + interval '600 ms'"
            ),
        )
        .await
            == 1
    })
    .await;
    assert_eq!(
        scalar(&db, &count("woke")).await,
        woke,
        "the node woke with nothing to do"
    );
    fail::remove("claim");
    support::assert_all_published(&db).await;
    node.shutdown().await;
}
