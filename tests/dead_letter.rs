//! Dead-letter operations against real PostgreSQL and Redis: searches, one event whole, bulk
//! replay and discard by filter with a running relay, and an audit log that matches the changes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::produce::EventFact;
use outpost::store::{Actor, AuditQuery, EventFilter, EventState, Role, Selection, StoreError};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use serde_json::json;
use support::{Deliveries, TestDb, TestRedis, relay_config, scalar, wait_until};

async fn exec(db: &TestDb, sql: &str) {
    db.store
        .connection()
        .execute_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap();
}

fn operator() -> Actor {
    Actor::new("ops-test", Role::Operator)
}

/// Commits `per` events for each of `aggregates` aggregates of `kind`, one transaction per
/// aggregate; returns the event ids by aggregate, in sequence order.
async fn commit_aggregates(
    db: &TestDb,
    kind: &str,
    aggregates: usize,
    per: usize,
) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for a in 0..aggregates {
        let facts = (0..per)
            .map(|n| {
                EventFact::new(
                    kind,
                    format!("{kind}{a}"),
                    "thing.happened",
                    json!({"n": n}),
                )
            })
            .collect();
        out.push(support::commit_facts(&db.store, facts).await);
    }
    out
}

/// Parks the events of `kind` as the relay leaves an aggregate whose first `failed` events failed
/// for good: those quarantined with `error`, the rest held behind them.
async fn quarantine(db: &TestDb, kind: &str, failed: i64, error: &str) {
    exec(
        db,
        &format!(
            "UPDATE outpost_event SET status = CASE WHEN aggregate_seq <= {failed} \
               THEN 'quarantined' ELSE 'held' END, \
               attempts = CASE WHEN aggregate_seq <= {failed} THEN 3 ELSE 0 END, \
               last_error = CASE WHEN aggregate_seq <= {failed} THEN '{error}' END \
             WHERE aggregate_type = '{kind}'"
        ),
    )
    .await;
    exec(
        db,
        &format!("UPDATE outpost_aggregate SET blocked_seq = 1 WHERE aggregate_type = '{kind}'"),
    )
    .await;
}

async fn count_where(db: &TestDb, cond: &str) -> i64 {
    scalar(
        db,
        &format!("SELECT count(*) FROM outpost_event WHERE {cond}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bulk_replay_by_filter_delivers_every_event_again_in_order_and_discard_moves_only_its_own()
{
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    // 100 aggregates with 10 quarantined events and 2 held behind them each: the replay's.
    let replayed = commit_aggregates(&db, "dl", 100, 12).await;
    quarantine(
        &db,
        "dl",
        10,
        "WRONGTYPE Operation against a key holding the wrong kind of value",
    )
    .await;
    // Dead letters of another code (to be discarded) and of the same code but another type
    // (left alone by both).
    commit_aggregates(&db, "big", 20, 2).await;
    quarantine(&db, "big", 1, "OVERSIZE entry of 2000000 bytes").await;
    commit_aggregates(&db, "keep", 10, 2).await;
    quarantine(&db, "keep", 1, "WRONGTYPE Operation against a key").await;
    let node = support::start_node(relay_config(&db, &redis, "dl-node")).await;

    let filter = EventFilter {
        aggregate_type: Some("dl".to_owned()),
        error_code: Some("WRONGTYPE".to_owned()),
        ..EventFilter::default()
    };
    let quarantined = EventFilter {
        state: Some(EventState::Quarantined),
        ..filter.clone()
    };
    let count = db.store.count_events(&quarantined, 10_000).await.unwrap();
    assert_eq!((count.rows, count.capped), (1000, false));
    // Pages by keyset cover every match once, in id order.
    let (mut seen, mut after) = (Vec::new(), None);
    loop {
        let page = db
            .store
            .search_events(&quarantined, after, 300)
            .await
            .unwrap();
        seen.extend(page.events.iter().map(|e| e.id));
        match page.next_after {
            Some(a) => after = Some(a),
            None => break,
        }
    }
    assert_eq!(seen.len(), 1000);
    assert!(seen.windows(2).all(|w| w[0] < w[1]));

    // A count that no longer holds is refused and changes nothing.
    let stale = Selection::Matching {
        filter: filter.clone(),
        expected: 999,
    };
    let err = db
        .store
        .replay_events(&operator(), &stale, "fixed the stream key")
        .await;
    assert!(
        matches!(err, Err(StoreError::Refused { kind: "count", .. })),
        "{err:?}"
    );
    assert_eq!(count_where(&db, "status = 'quarantined'").await, 1030);

    let all = Selection::Matching {
        filter: filter.clone(),
        expected: 1000,
    };
    let outcome = db
        .store
        .replay_events(&operator(), &all, "fixed the stream key")
        .await
        .unwrap();
    assert_eq!((outcome.events, outcome.released), (1000, 200));

    let mut conn = redis.conn().await;
    wait_until(120, "the 1,200 replayed events in their stream", || {
        let (mut c, prefix) = (conn.clone(), redis.prefix.clone());
        async move { support::stream_entries(&mut c, &prefix).await >= 1200 }
    })
    .await;
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    for (a, ids) in replayed.iter().enumerate() {
        assert_eq!(
            d.order.get(&("dl".to_owned(), format!("dl{a}"))),
            Some(&(1..=12).collect::<Vec<i64>>()),
            "aggregate dl{a}: replayed events in sequence order, held successors after them"
        );
        for id in ids {
            assert_eq!(
                d.copies.get(id),
                Some(&1),
                "{id} delivered once with its event id"
            );
        }
    }
    assert_eq!(
        d.unique(),
        1200,
        "nothing but the replayed events and their successors"
    );

    // Bulk discard of the other code: exactly those 20 move, their held successors go on.
    let big = EventFilter {
        error_code: Some("OVERSIZE".to_owned()),
        ..EventFilter::default()
    };
    let outcome = db
        .store
        .discard_events(
            &operator(),
            &Selection::Matching {
                filter: big,
                expected: 20,
            },
            "payloads too large for good",
        )
        .await
        .unwrap();
    assert_eq!((outcome.events, outcome.released), (20, 20));
    assert_eq!(
        count_where(&db, "status = 'discarded' AND aggregate_type = 'big'").await,
        20
    );
    assert_eq!(
        count_where(&db, "status = 'discarded' AND aggregate_type <> 'big'").await,
        0
    );
    assert_eq!(
        count_where(&db, "aggregate_type = 'keep' AND status = 'quarantined'").await,
        10
    );
    assert_eq!(
        count_where(&db, "aggregate_type = 'keep' AND status = 'held'").await,
        10
    );
    wait_until(
        60,
        "the discarded events' successors to be published",
        || async {
            count_where(&db, "aggregate_type = 'big' AND status <> 'discarded'").await == 0
        },
    )
    .await;
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_published WHERE aggregate_type = 'big'"
        )
        .await,
        20
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_aggregate WHERE blocked_seq IS NOT NULL"
        )
        .await,
        10,
        "only the untouched aggregates are still held"
    );

    // One audit row per action, with what it did.
    let log = db.store.audit_log(&AuditQuery::default()).await.unwrap();
    let actions: Vec<(&str, u64)> = log
        .iter()
        .map(|r| (r.action.as_str(), r.detail["count"].as_u64().unwrap()))
        .collect();
    assert_eq!(actions, vec![("event.discard", 20), ("event.replay", 1000)]);
    assert_eq!(log[1].detail["reason"], "fixed the stream key");
    assert_eq!(log[1].detail["filter"]["aggregate_type"], "dl");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_event_is_found_by_its_code_shown_whole_and_replayed_by_id() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let mut conn = redis.conn().await;
    let poisoned = support::poison_stream(&mut conn, &redis, "poison").await;
    let mut ids = Vec::new();
    for n in 0..3 {
        let fact = EventFact::new("poison", "p0", "thing.happened", json!({"n": n})).header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        ids.extend(support::commit_facts(&db.store, vec![fact]).await);
    }
    let node = support::start_node(relay_config(&db, &redis, "poison-node")).await;
    wait_until(60, "the poison event to be quarantined", || async {
        count_where(&db, "status = 'quarantined'").await == 1
    })
    .await;

    let found = db
        .store
        .search_events(
            &EventFilter {
                state: Some(EventState::Quarantined),
                error_code: Some("WRONGTYPE".to_owned()),
                ..EventFilter::default()
            },
            None,
            50,
        )
        .await
        .unwrap();
    assert_eq!(found.events.len(), 1);
    let first = &found.events[0];
    // A key of the wrong type at the stream: quarantined at the first attempt.
    assert_eq!((first.aggregate_seq, first.attempts), (1, 1));
    assert_eq!(first.event_id.to_string(), ids[0]);
    let detail = db
        .store
        .event_detail(first.event_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(detail.summary.error_code.as_deref(), Some("WRONGTYPE"));
    assert!(
        detail
            .last_error
            .as_deref()
            .unwrap()
            .starts_with("WRONGTYPE ")
    );
    assert_eq!(detail.payload, json!({"n": 0}));
    assert_eq!(
        detail.trace.as_ref().map(|t| t.traceparent.as_str()),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(
        db.store.quarantined_by_code().await.unwrap(),
        vec![("WRONGTYPE".to_owned(), 1)]
    );
    let held = db
        .store
        .count_events(
            &EventFilter {
                state: Some(EventState::Held),
                ..EventFilter::default()
            },
            100,
        )
        .await
        .unwrap();
    assert_eq!(held.rows, 2);

    // Replaying a held event is refused: only quarantined ones can be.
    let held_id: uuid::Uuid = ids[1].parse().unwrap();
    let err = db
        .store
        .replay_events(&operator(), &Selection::Ids(vec![held_id]), "try")
        .await;
    assert!(
        matches!(err, Err(StoreError::Refused { kind: "state", .. })),
        "{err:?}"
    );

    let _: () = redis::cmd("DEL")
        .arg(&poisoned)
        .query_async(&mut conn)
        .await
        .unwrap();
    let outcome = db
        .store
        .replay_events(
            &operator(),
            &Selection::Ids(vec![first.event_id]),
            "deleted the bad key",
        )
        .await
        .unwrap();
    assert_eq!((outcome.events, outcome.released), (1, 2));
    wait_until(60, "the aggregate's three events in its stream", || {
        let (mut c, prefix) = (conn.clone(), redis.prefix.clone());
        async move { support::stream_entries(&mut c, &prefix).await >= 3 }
    })
    .await;
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert_eq!(
        d.order.get(&("poison".to_owned(), "p0".to_owned())),
        Some(&vec![1, 2, 3])
    );
    for id in &ids {
        assert_eq!(d.copies.get(id), Some(&1));
    }
    // The mark follows Redis's reply: wait for the row to reach the history.
    wait_until(60, "the replayed event to be marked published", || async {
        let e = db
            .store
            .event_detail(first.event_id)
            .await
            .unwrap()
            .unwrap();
        e.summary.state == "published"
    })
    .await;
    let published = db
        .store
        .event_detail(first.event_id)
        .await
        .unwrap()
        .unwrap();
    assert!(published.stream_id.is_some());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_rows_match_the_mutations_one_to_one_and_refusals_leave_none() {
    let db = TestDb::new().await;
    commit_aggregates(&db, "a", 6, 2).await;
    quarantine(&db, "a", 1, "UNROUTABLE stream name longer than 1024 bytes").await;
    let dead: Vec<uuid::Uuid> = db
        .store
        .search_events(
            &EventFilter {
                state: Some(EventState::Quarantined),
                ..EventFilter::default()
            },
            None,
            50,
        )
        .await
        .unwrap()
        .events
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(dead.len(), 6);
    let admin = Actor::new("root-test", Role::Admin);
    let viewer = Actor::new("viewer-test", Role::Viewer);
    let ops = operator();
    let mut expected: Vec<(String, String, u64)> = Vec::new();
    let mut expect = |actor: &Actor, action: &str, count: u64| {
        expected.push((actor.name.clone(), action.to_owned(), count));
    };

    // Refused, each for its own reason: nothing changes, no audit row.
    let refused = [
        db.store
            .replay_events(&viewer, &Selection::Ids(vec![dead[0]]), "viewers cannot")
            .await
            .map(|_| ()),
        db.store
            .replay_events(&ops, &Selection::Ids(vec![dead[0]]), "  ")
            .await
            .map(|_| ()),
        db.store
            .discard_events(
                &ops,
                &Selection::Ids(vec![dead[0], uuid::Uuid::new_v4()]),
                "x",
            )
            .await
            .map(|_| ()),
        db.store
            .pause_partitions(&viewer, &[0], true)
            .await
            .map(|_| ()),
        db.store
            .create_token(&ops, "ops-bob", Role::Admin)
            .await
            .map(|_| ()),
        db.store.revoke_token(&admin, "nobody").await.map(|_| ()),
        db.store.list_tokens(&ops).await.map(|_| ()),
    ];
    for r in refused {
        assert!(matches!(r, Err(StoreError::Refused { .. })), "{r:?}");
    }
    assert!(
        db.store
            .audit_log(&AuditQuery::default())
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(count_where(&db, "status = 'quarantined'").await, 6);

    // The scripted mix.
    db.store
        .replay_events(&ops, &Selection::Ids(vec![dead[0], dead[1]]), "fixed")
        .await
        .unwrap();
    expect(&ops, "event.replay", 2);
    db.store
        .discard_events(&ops, &Selection::Ids(vec![dead[2]]), "obsolete")
        .await
        .unwrap();
    expect(&ops, "event.discard", 1);
    db.store
        .pause_partitions(&ops, &[1, 2], true)
        .await
        .unwrap();
    expect(&ops, "partition.pause", 0);
    let created = db
        .store
        .create_token(&admin, "ops-alice", Role::Operator)
        .await
        .unwrap();
    expect(&admin, "token.create", 0);
    let again = db
        .store
        .create_token(&admin, "ops-alice", Role::Viewer)
        .await;
    assert!(
        matches!(again, Err(StoreError::Refused { kind: "input", .. })),
        "{again:?}"
    );
    let alice = db
        .store
        .authenticate(&created.token)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (alice.name.as_str(), alice.role),
        ("ops-alice", Role::Operator)
    );
    db.store
        .replay_events(
            &alice,
            &Selection::Matching {
                filter: EventFilter::default(),
                expected: 3,
            },
            "the rest too",
        )
        .await
        .unwrap();
    expect(&alice, "event.replay", 3);
    db.store
        .pause_partitions(&alice, &[1, 2], false)
        .await
        .unwrap();
    expect(&alice, "partition.resume", 0);
    db.store.revoke_token(&admin, "ops-alice").await.unwrap();
    expect(&admin, "token.revoke", 0);
    assert_eq!(
        db.store.authenticate(&created.token).await.unwrap(),
        None,
        "revoked"
    );
    let mut forged = created.token.clone();
    forged.pop();
    forged.push('x');
    assert_eq!(db.store.authenticate(&forged).await.unwrap(), None);
    assert_eq!(db.store.authenticate("opk_1_short").await.unwrap(), None);

    let log = db.store.audit_log(&AuditQuery::default()).await.unwrap();
    let got: Vec<(String, String, u64)> = log
        .iter()
        .rev()
        .map(|r| {
            (
                r.actor.clone(),
                r.action.clone(),
                r.detail["count"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(got, expected);
    let tokens = db.store.list_tokens(&admin).await.unwrap();
    assert_eq!(tokens.len(), 1);
    assert!(tokens[0].revoked_at.is_some());
    // The token never reaches the audit log or the token table.
    assert_eq!(
        scalar(
            &db,
            &format!(
                "SELECT count(*) FROM outpost_audit WHERE detail::text LIKE '%{}%' \
                 OR target LIKE '%{}%'",
                &created.token[created.token.len() - 20..],
                &created.token[created.token.len() - 20..]
            )
        )
        .await,
        0
    );
    assert_eq!(count_where(&db, "status = 'quarantined'").await, 0);
    assert_eq!(count_where(&db, "status = 'discarded'").await, 1);
}
