//! The producer API and the outbox schema against a real PostgreSQL.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use outpost::produce::{Declaration, Event, EventFact, Limits, ProduceError, Producer};
use outpost::store::{NodeInfo, Nudge, NudgeListener, StoreError};
use sea_orm::{ConnectionTrait, DbBackend, EntityTrait, Statement, TransactionTrait};
use serde::Serialize;
use serde_json::json;
use support::{TestDb, scalar, wait_until};

#[derive(Serialize)]
struct OrderPaid {
    order_id: String,
    amount_cents: i64,
}

impl Event for OrderPaid {
    fn aggregate_type(&self) -> &str {
        "order"
    }
    fn aggregate_id(&self) -> String {
        self.order_id.clone()
    }
    fn event_type(&self) -> &str {
        "order.paid"
    }
}

fn paid(id: &str) -> OrderPaid {
    OrderPaid {
        order_id: id.to_owned(),
        amount_cents: 1200,
    }
}

async fn seqs(db: &TestDb, aggregate_id: &str) -> Vec<i64> {
    db.store
        .connection()
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT aggregate_seq FROM outpost_event WHERE aggregate_type = 'order' \
             AND aggregate_id = $1 ORDER BY aggregate_seq",
            [aggregate_id.into()],
        ))
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.try_get_by_index::<i64>(0).unwrap())
        .collect()
}

/// Registers node `n1` asking for nudges, and listens for them.
async fn nudged_node(db: &TestDb) -> NudgeListener {
    db.store
        .register_node(&NodeInfo {
            node_id: "n1".into(),
            hostname: "h".into(),
            pid: 1,
            version: "t".into(),
        })
        .await
        .unwrap();
    db.store.set_wants_nudge("n1", true, 60_000).await.unwrap();
    NudgeListener::connect(&db.url).await.unwrap()
}

#[tokio::test]
async fn rolled_back_event_leaves_no_row_and_no_sequence_hole() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let txn = db.store.connection().begin().await.unwrap();
    p.enqueue(&txn, &paid("o-1")).await.unwrap();
    txn.rollback().await.unwrap();
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 0);

    let txn = db.store.connection().begin().await.unwrap();
    let e = p.enqueue(&txn, &paid("o-1")).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(e.aggregate_seq, 1, "the rolled-back event left no hole");
    assert_eq!(e.status, "pending");
}

#[tokio::test]
async fn committed_event_has_every_contract_field_and_the_trace_context() {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt;

    let db = TestDb::new().await;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let p = Producer::default();
    let span = tracing::info_span!("checkout");
    let txn = db.store.connection().begin().await.unwrap();
    let enqueued = {
        let _entered = span.enter();
        p.enqueue(&txn, &paid("o-7")).await.unwrap()
    };
    txn.commit().await.unwrap();

    let row = entity::outpost_event::Entity::find_by_id(enqueued.id)
        .one(db.store.connection())
        .await
        .unwrap()
        .expect("row");
    assert_eq!(row.event_id, enqueued.event_id);
    assert_eq!(row.aggregate_type, "order");
    assert_eq!(row.aggregate_id, "o-7");
    assert_eq!(row.aggregate_seq, 1);
    assert_eq!(row.event_type, "order.paid");
    assert_eq!(row.schema_version, "1");
    assert_eq!(
        row.payload,
        json!({"order_id": "o-7", "amount_cents": 1200})
    );
    assert!(row.txid > 0);
    assert_eq!(row.txid, enqueued.txid);
    assert!((0..64).contains(&row.partition));
    assert_eq!(row.status, "pending");
    assert_eq!(row.attempts, 0);
    let tp = row.headers["traceparent"]
        .as_str()
        .expect("traceparent header");
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!((parts[0], parts[1].len(), parts[2].len()), ("00", 32, 16));

    // Partition is the documented function of the aggregate key.
    let expected = scalar(&db, "SELECT outpost_partition_of('order', 'o-7', 64)::int8").await;
    assert_eq!(i64::from(row.partition), expected);
}

#[tokio::test]
async fn explicit_traceparent_is_kept_and_no_span_means_no_header() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let txn = db.store.connection().begin().await.unwrap();
    let a = p
        .enqueue_facts(
            &txn,
            vec![
                EventFact::new("order", "o-1", "order.paid", json!({})).header("traceparent", tp),
                EventFact::new("order", "o-2", "order.paid", json!({})),
            ],
        )
        .await
        .unwrap();
    txn.commit().await.unwrap();
    let rows = entity::outpost_event::Entity::find()
        .all(db.store.connection())
        .await
        .unwrap();
    let h = |id: i64| rows.iter().find(|r| r.id == id).unwrap().headers.clone();
    assert_eq!(h(a[0].id)["traceparent"], json!(tp));
    assert_eq!(h(a[1].id), json!({}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_of_one_aggregate_get_gap_free_sequence_in_commit_order() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let stop = Arc::new(AtomicBool::new(false));

    // A reader that looks at the aggregate over and over: what it sees must always be 1..k,
    // i.e. sequence n is never visible before sequence n-1 (commit order).
    let reader = {
        let (store, stop) = (db.store.clone(), stop.clone());
        tokio::spawn(async move {
            let mut looks = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let rows = store
                    .connection()
                    .query_all_raw(Statement::from_string(
                        DbBackend::Postgres,
                        "SELECT aggregate_seq FROM outpost_event WHERE aggregate_id = 'hot' \
                         ORDER BY aggregate_seq",
                    ))
                    .await
                    .unwrap();
                let seen: Vec<i64> = rows
                    .iter()
                    .map(|r| r.try_get_by_index(0).unwrap())
                    .collect();
                let expected: Vec<i64> = (1..=seen.len() as i64).collect();
                assert_eq!(seen, expected, "a reader saw a gap");
                looks += 1;
            }
            looks
        })
    };

    let mut writers = Vec::new();
    for w in 0..12 {
        let (store, p) = (db.store.clone(), p.clone());
        writers.push(tokio::spawn(async move {
            let mut committed = 0;
            for i in 0..25 {
                let txn = store.connection().begin().await.unwrap();
                p.enqueue(&txn, &paid("hot")).await.unwrap();
                if (w + i) % 4 == 0 {
                    txn.rollback().await.unwrap();
                } else {
                    txn.commit().await.unwrap();
                    committed += 1;
                }
            }
            committed
        }));
    }
    let mut committed = 0;
    for w in writers {
        committed += w.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    assert!(reader.await.unwrap() > 0);
    assert_eq!(
        seqs(&db, "hot").await,
        (1..=committed).collect::<Vec<i64>>()
    );
}

/// The pid of the session that runs `conn`'s next statements.
async fn backend_pid<C: ConnectionTrait>(conn: &C) -> i32 {
    conn.query_one_raw(Statement::from_string(
        DbBackend::Postgres,
        "SELECT pg_backend_pid()",
    ))
    .await
    .unwrap()
    .unwrap()
    .try_get_by_index(0)
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_of_different_aggregates_do_not_wait_on_each_other() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let held = db.store.connection().begin().await.unwrap();
    p.enqueue(&held, &paid("a")).await.unwrap();

    // Another aggregate commits while the first transaction is still open.
    let other = db.store.connection().begin().await.unwrap();
    p.enqueue(&other, &paid("b")).await.unwrap();
    other.commit().await.unwrap();

    // The same aggregate waits for the open transaction: its session shows a lock wait.
    let same = db.store.connection().begin().await.unwrap();
    let same_pid = backend_pid(&same).await;
    let (store, p2) = (db.store.clone(), p.clone());
    let blocked = tokio::spawn(async move {
        p2.enqueue(&same, &paid("a")).await.unwrap();
        same.commit().await.unwrap();
        drop(store);
    });
    wait_until(
        30,
        "the second writer of aggregate a to wait on its lock",
        || {
            let store = db.store.clone();
            async move {
                let r = store
                    .connection()
                    .query_one_raw(Statement::from_sql_and_values(
                        DbBackend::Postgres,
                        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                        [same_pid.into()],
                    ))
                    .await
                    .unwrap();
                r.and_then(|r| r.try_get_by_index::<Option<bool>>(0).ok().flatten()) == Some(true)
            }
        },
    )
    .await;
    held.commit().await.unwrap();
    blocked.await.unwrap();
    assert_eq!(seqs(&db, "a").await, vec![1, 2]);
    assert_eq!(seqs(&db, "b").await, vec![1]);
}

#[tokio::test]
async fn plain_sql_insert_gets_the_same_sequence_partition_and_nudge() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let mut listener = nudged_node(&db).await;

    let txn = db.store.connection().begin().await.unwrap();
    let first = p.enqueue(&txn, &paid("o-9")).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(
        listener.recv().await.unwrap(),
        Nudge::Partitions(vec![first.partition])
    );

    // The contract's INSERT, exactly as docs/contract.md shows it.
    db.store
        .connection()
        .execute_unprepared(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'o-9', 'order.shipped', '{\"carrier\": \"ups\"}')",
        )
        .await
        .unwrap();
    assert_eq!(
        listener.recv().await.unwrap(),
        Nudge::Partitions(vec![first.partition])
    );
    let rows = entity::outpost_event::Entity::find()
        .all(db.store.connection())
        .await
        .unwrap();
    let sql_row = rows
        .iter()
        .find(|r| r.event_type == "order.shipped")
        .unwrap();
    assert_eq!(sql_row.aggregate_seq, 2);
    assert_eq!(sql_row.partition, first.partition);
    assert!(sql_row.txid > first.txid);
    assert_eq!(sql_row.status, "pending");
    assert_eq!(sql_row.schema_version, "1");

    // With no node asking for nudges, inserts send none.
    db.store.set_wants_nudge("n1", false, 60_000).await.unwrap();
    let txn = db.store.connection().begin().await.unwrap();
    p.enqueue(&txn, &paid("o-10")).await.unwrap();
    txn.commit().await.unwrap();
    db.store.set_wants_nudge("n1", true, 60_000).await.unwrap();
    let txn = db.store.connection().begin().await.unwrap();
    let last = p.enqueue(&txn, &paid("o-11")).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(
        listener.recv().await.unwrap(),
        Nudge::Partitions(vec![last.partition]),
        "the o-10 insert, made while no node asked, sent no nudge"
    );
}

/// `outpost.nudge = off` (what producers whose transactions are prepared for two-phase commit
/// set: a transaction that sent a NOTIFY cannot be prepared) keeps a transaction from nudging,
/// through the trigger and through the producer API's statement for many events alike.
#[tokio::test]
async fn a_transaction_with_the_nudge_turned_off_sends_none() {
    let db = TestDb::new().await;
    let mut listener = nudged_node(&db).await;
    let partition = |id: String| {
        let db = &db;
        async move {
            scalar(
                db,
                &format!("SELECT outpost_partition_of('o', '{id}', 64)::int8"),
            )
            .await
        }
    };
    let quiet = ["o-1", "o-2", "o-3"];
    let mut quiet_partitions = HashSet::new();
    for id in quiet {
        quiet_partitions.insert(partition(id.to_owned()).await);
    }
    // An aggregate whose partition none of the quiet ones has, so its nudge tells them apart.
    let mut loud = String::new();
    for n in 0.. {
        loud = format!("z-{n}");
        if !quiet_partitions.contains(&partition(loud.clone()).await) {
            break;
        }
    }
    let fact = |id: &str| EventFact::new("o", id, "t", json!({}));

    // One event through the trigger, two through the statement for many events, then one with
    // the nudge on.
    let mut last = Vec::new();
    for (value, facts) in [
        ("off", vec![fact(quiet[0])]),
        ("'FALSE'", vec![fact(quiet[1]), fact(quiet[2])]),
        ("on", vec![fact(&loud)]),
    ] {
        let txn = db.store.connection().begin().await.unwrap();
        txn.execute_unprepared(&format!("SET LOCAL outpost.nudge = {value}"))
            .await
            .unwrap();
        last = Producer::default()
            .enqueue_facts(&txn, facts)
            .await
            .unwrap();
        txn.commit().await.unwrap();
    }
    assert_eq!(
        listener.recv().await.unwrap(),
        Nudge::Partitions(vec![last[0].partition]),
        "the transactions with the nudge off sent none"
    );
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_event").await,
        4,
        "and their events were written"
    );
}

#[tokio::test]
async fn producers_cannot_forge_delivery_state() {
    let db = TestDb::new().await;
    db.store
        .connection()
        .execute_unprepared(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, \
             status, attempts, aggregate_seq, partition, id, txid) \
             VALUES ('order', 'x', 'order.paid', '{}', 'published', 99, 42, 9999, 5, 7)",
        )
        .await
        .unwrap();
    let row = entity::outpost_event::Entity::find()
        .one(db.store.connection())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.status.as_str(), row.attempts, row.aggregate_seq),
        ("pending", 0, 1)
    );
    assert!(row.partition < 64);
    // Naming its own transaction's id claims the columns only Outpost fills in: by hand it is
    // refused (with or without an id, sequence and partition; see tests/owned_columns.rs).
    let err = db
        .store
        .connection()
        .execute_unprepared(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, txid) \
             VALUES ('order', 'x', 'order.paid', '{}', txid_current())",
        )
        .await
        .map(|_| ())
        .map_err(StoreError::from_db);
    assert!(
        matches!(&err, Err(StoreError::Rejected { constraint, detail })
            if constraint == "outpost_event_owned_columns_check"
                && detail.contains("leave these columns out")),
        "{err:?}"
    );
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 1);
}

#[derive(Serialize)]
struct Customer {
    email: String,
    name: String,
    last_login: String,
}

#[tokio::test]
async fn declared_content_enqueues_only_on_declared_changes() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let decl = Declaration::new("customer", "customer.contact_changed", &["email", "name"]);
    let before = Customer {
        email: "a@example.com".into(),
        name: "Ada".into(),
        last_login: "mon".into(),
    };
    let login_only = Customer {
        last_login: "tue".into(),
        ..before_clone(&before)
    };
    let txn = db.store.connection().begin().await.unwrap();
    let none = p
        .enqueue_declared(&txn, &decl, "c-1", Some(&before), Some(&login_only))
        .await
        .unwrap();
    assert!(none.is_none());
    let new_email = Customer {
        email: "ada@example.com".into(),
        ..before_clone(&login_only)
    };
    let some = p
        .enqueue_declared(&txn, &decl, "c-1", Some(&login_only), Some(&new_email))
        .await
        .unwrap()
        .expect("an event");
    txn.commit().await.unwrap();
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 1);
    let row = entity::outpost_event::Entity::find_by_id(some.id)
        .one(db.store.connection())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.event_type, "customer.contact_changed");
    assert_eq!(
        row.payload,
        json!({
            "changed": ["email"],
            "before": {"email": "a@example.com"},
            "after": {"email": "ada@example.com"},
        })
    );
}

fn before_clone(c: &Customer) -> Customer {
    Customer {
        email: c.email.clone(),
        name: c.name.clone(),
        last_login: c.last_login.clone(),
    }
}

/// Runs `facts` through the producer in a transaction, expects an error, and checks that the
/// transaction is still usable and that nothing was written.
async fn rejected(db: &TestDb, p: &Producer, facts: Vec<EventFact>) -> ProduceError {
    let txn = db.store.connection().begin().await.unwrap();
    let err = p
        .enqueue_facts(&txn, facts)
        .await
        .expect_err("must be refused");
    // Refused before the insert: the caller's transaction still works.
    txn.execute_unprepared("SELECT 1").await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(scalar(db, "SELECT count(*) FROM outpost_event").await, 0);
    err
}

#[tokio::test]
async fn bad_input_is_refused_with_a_clear_error_and_nothing_half_written() {
    let db = TestDb::new().await;
    let p = Producer::new(Limits {
        max_payload_bytes: 1000,
        max_header_bytes: 500,
    });
    let ok = || EventFact::new("order", "o-1", "order.paid", json!({}));

    let e = rejected(
        &db,
        &p,
        vec![ok(), EventFact::new("order", "", "order.paid", json!({}))],
    )
    .await;
    assert!(e.to_string().contains("aggregate_id is missing"), "{e}");

    let e = rejected(
        &db,
        &p,
        vec![EventFact::new("order", "o-1", " ", json!({}))],
    )
    .await;
    assert!(e.to_string().contains("event_type is missing"), "{e}");

    let big = json!({"blob": "x".repeat(2000)});
    let e = rejected(
        &db,
        &p,
        vec![ok(), EventFact::new("order", "o-1", "t", big)],
    )
    .await;
    assert!(
        matches!(e, ProduceError::PayloadTooLarge { limit: 1000, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("producer.max_payload_bytes"), "{e}");

    let e = rejected(&db, &p, vec![ok().headers_json(json!(["a", "b"]))]).await;
    assert!(
        e.to_string().contains("headers must be a JSON object"),
        "{e}"
    );
    let e = rejected(&db, &p, vec![ok().headers_json(json!({"n": 1}))]).await;
    assert!(
        e.to_string().contains("header \"n\" must be a string"),
        "{e}"
    );

    let e = rejected(&db, &p, vec![ok().schema_version("v2")]).await;
    assert!(e.to_string().contains("schema_version"), "{e}");
    assert!(e.to_string().contains("MAJOR[.MINOR[.PATCH]]"), "{e}");

    let id = uuid::Uuid::new_v4();
    let e = rejected(&db, &p, vec![ok().event_id(id), ok().event_id(id)]).await;
    assert!(
        matches!(e, ProduceError::DuplicateInBatch(d) if d == id),
        "{e}"
    );
}

#[tokio::test]
async fn duplicate_event_id_is_refused_by_the_database() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let id = uuid::Uuid::new_v4();
    let txn = db.store.connection().begin().await.unwrap();
    p.enqueue_facts(
        &txn,
        vec![EventFact::new("order", "o-1", "order.paid", json!({})).event_id(id)],
    )
    .await
    .unwrap();
    txn.commit().await.unwrap();

    let txn = db.store.connection().begin().await.unwrap();
    let err = p
        .enqueue_facts(
            &txn,
            vec![EventFact::new("order", "o-2", "order.paid", json!({})).event_id(id)],
        )
        .await
        .expect_err("duplicate");
    assert!(
        matches!(err, ProduceError::Store(StoreError::DuplicateEventId(d)) if d == id),
        "{err}"
    );
    assert!(err.to_string().contains("already in the outbox"), "{err}");
    txn.rollback().await.unwrap();
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 1);
    assert_eq!(seqs(&db, "o-2").await, Vec::<i64>::new());
}

#[tokio::test]
async fn the_schema_refuses_bad_rows_from_plain_sql() {
    let db = TestDb::new().await;
    // (what, statement, what the error must name)
    let cases = [
        (
            "missing aggregate_id",
            "INSERT INTO outpost_event (aggregate_type, event_type, payload) VALUES ('o', 't', '{}')",
            r#"column "aggregate_id" of relation "outpost_event" violates not-null"#,
        ),
        (
            "blank event_type",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', '1', '  ', '{}')",
            "outpost_event_event_type_check",
        ),
        (
            "bad schema_version",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, schema_version) VALUES ('o', '1', 't', '{}', 'v1')",
            r#"outpost_event_schema_version_check": schema_version "v1" is not MAJOR[.MINOR[.PATCH]]"#,
        ),
        (
            "headers not an object",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, headers) VALUES ('o', '1', 't', '{}', '[1]')",
            "outpost_event_headers_check",
        ),
        (
            "header value not a string",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, headers) VALUES ('o', '1', 't', '{}', '{\"a\": 1}')",
            "outpost_event_headers_check",
        ),
        (
            "control character in type",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) VALUES (E'o\\n', '1', 't', '{}')",
            r#"outpost_event_aggregate_type_check": aggregate_type "o\n""#,
        ),
        (
            "payload over 1 MiB",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', '1', 't', jsonb_build_object('x', repeat(md5(random()::text), 40000)))",
            "outpost_event_payload_size_check",
        ),
        (
            "empty destination",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload, destination) VALUES ('o', '1', 't', '{}', '')",
            "outpost_event_destination_check",
        ),
        (
            "missing payload",
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', '1', 't', NULL)",
            r#"column "payload" of relation "outpost_event" violates not-null"#,
        ),
    ];
    for (what, sql, named) in cases {
        let err = match db.store.connection().execute_unprepared(sql).await {
            Ok(_) => panic!("{what} was accepted"),
            Err(e) => StoreError::from_db(e),
        };
        // Read by its SQLSTATE as a refused row (never a transient failure to retry), naming
        // the rule: the constraint for CHECK rules, the column for NOT NULL ones.
        match &err {
            StoreError::Rejected { constraint, detail } => {
                assert!(detail.contains(named), "{what}: {detail}");
                if named.starts_with("outpost_event_") {
                    assert!(
                        !constraint.is_empty() && named.starts_with(constraint.as_str()),
                        "{what}: {constraint}"
                    );
                }
            }
            other => panic!("{what}: not a refused row: {other}"),
        }
    }
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 0);
    // Refused rows leave no sequence hole either.
    db.store
        .connection()
        .execute_unprepared(
            "INSERT INTO outpost_event (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('o', '1', 't', '{}')",
        )
        .await
        .unwrap();
    assert_eq!(
        scalar(&db, "SELECT max(aggregate_seq) FROM outpost_event").await,
        1
    );
}

/// The plain-SQL insert of one row: every column at a valid value but those given.
fn insert_row(values: &[(&str, &str)]) -> String {
    let defaults = [
        ("aggregate_type", "'o'"),
        ("aggregate_id", "'1'"),
        ("event_type", "'t'"),
        ("payload", "'{}'"),
        ("schema_version", "'1'"),
        ("headers", "'{}'"),
        ("destination", "NULL"),
    ];
    let (columns, exprs): (Vec<&str>, Vec<&str>) = defaults
        .iter()
        .map(|&(c, d)| (c, values.iter().find(|v| v.0 == c).map_or(d, |v| v.1)))
        .unzip();
    format!(
        "INSERT INTO outpost_event ({}) VALUES ({})",
        columns.join(", "),
        exprs.join(", ")
    )
}

/// The trigger tests every rule at once and, only for a row that fails, finds the broken rule
/// one by one: rows at each rule's limits pass both, rows just past them are refused naming the
/// rule.
#[tokio::test]
async fn rows_at_the_limits_of_the_rules_are_accepted_and_just_past_them_refused() {
    let db = TestDb::new().await;
    let accepted = [
        insert_row(&[("aggregate_type", "repeat('a', 255)")]),
        insert_row(&[("aggregate_id", "repeat('é', 512)")]),
        insert_row(&[
            ("event_type", "repeat('é', 255)"),
            ("schema_version", "'0'"),
        ]),
        insert_row(&[("schema_version", "'123456789.0.1'")]),
        insert_row(&[
            ("schema_version", "'2.1'"),
            ("destination", "repeat('d', 512)"),
        ]),
        insert_row(&[("headers", "jsonb_build_object(repeat('k', 256), 'v')")]),
        insert_row(&[("headers", "jsonb_build_object(repeat('é', 256), '')")]),
        insert_row(&[("headers", "jsonb_build_object(repeat(E'\\n', 256), 'v')")]),
        insert_row(&[("headers", r#"'{"traceparent": "00-x", "b": "y"}'"#)]),
        insert_row(&[("aggregate_type", "'o é'"), ("event_type", "'order.paid'")]),
        // A blank destination is allowed: the rule refuses only empty ones.
        insert_row(&[("destination", "' '")]),
    ];
    for sql in &accepted {
        if let Err(e) = db.store.connection().execute_unprepared(sql).await {
            panic!("refused {sql}: {e}");
        }
    }
    let refused = [
        ("aggregate_type", "repeat('a', 256)"),
        ("aggregate_type", "E'o\\u0085'"),
        ("aggregate_id", "repeat('é', 513)"),
        ("aggregate_id", "' '"),
        ("event_type", "repeat('é', 256)"),
        ("event_type", "E'order\\u0085paid'"),
        ("event_type", "E'order\\x7f'"),
        ("schema_version", "'01'"),
        ("schema_version", "'1.2.3.4'"),
        ("schema_version", "''"),
        ("headers", "jsonb_build_object(repeat('k', 257), 'v')"),
        ("headers", "jsonb_build_object(repeat('é', 257), 'v')"),
        ("headers", r#"'{"": "v"}'"#),
        ("headers", r#"'{"a": "v", "b": null}'"#),
        ("headers", r#"'{"a": {"b": "c"}}'"#),
        ("headers", r#"'"text"'"#),
        (
            "headers",
            "jsonb_build_object('big', repeat(md5(random()::text), 3000))",
        ),
        ("destination", "repeat('d', 513)"),
        ("destination", "E'a\\tb'"),
    ];
    for (column, value) in refused {
        let sql = insert_row(&[(column, value)]);
        match db.store.connection().execute_unprepared(&sql).await {
            Err(e) => match StoreError::from_db(e) {
                StoreError::Rejected { constraint, .. } => {
                    assert_eq!(constraint, format!("outpost_event_{column}_check"), "{sql}");
                }
                other => panic!("{sql}: not refused as a bad row: {other}"),
            },
            Ok(_) => panic!("{sql} was accepted"),
        }
    }
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_event").await,
        i64::try_from(accepted.len()).unwrap()
    );
}

#[tokio::test]
async fn many_events_in_one_call_keep_their_order_and_ids() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let facts: Vec<EventFact> = (0..250)
        .map(|i| {
            EventFact::new(
                "order",
                format!("o-{}", i % 7),
                "order.paid",
                json!({"i": i}),
            )
        })
        .collect();
    let ids: Vec<uuid::Uuid> = facts.iter().map(EventFact::id).collect();
    let txn = db.store.connection().begin().await.unwrap();
    let out = p.enqueue_facts(&txn, facts).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(out.iter().map(|e| e.event_id).collect::<Vec<_>>(), ids);
    let distinct: HashSet<i64> = out.iter().map(|e| e.txid).collect();
    assert_eq!(distinct.len(), 1, "one transaction");
    for k in 0..7 {
        let n = (0..250).filter(|i| i % 7 == k).count() as i64;
        assert_eq!(
            seqs(&db, &format!("o-{k}")).await,
            (1..=n).collect::<Vec<_>>()
        );
    }
}

/// The row rules live in the insert trigger: PostgreSQL prepares every CHECK constraint anew for
/// each statement writing the table, which made one-row inserts and the relay's marks several
/// times slower (docs/benchmarks.md). Only the cheap status rule stays a constraint.
#[tokio::test]
async fn the_outbox_carries_no_check_constraint_but_the_status_rule() {
    let db = TestDb::new().await;
    let rows = db
        .store
        .connection()
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT conname::text FROM pg_constraint \
             WHERE conrelid = 'outpost_event'::regclass AND contype = 'c' ORDER BY conname",
        ))
        .await
        .unwrap();
    let names: Vec<String> = rows
        .iter()
        .map(|r| r.try_get_by_index(0).unwrap())
        .collect();
    assert_eq!(names, ["outpost_event_status_check"]);
}

/// Reverting `m20261202_000007_lean_insert` gives back the insert and nudge triggers of the
/// migration before, and applying it again today's: across both, rows get their sequence and
/// nudge, and bad rows are refused naming the rule.
#[tokio::test]
async fn the_lean_insert_migration_reverts_and_reapplies() {
    let db = TestDb::new().await;
    let steps = support::migrations_from(&db, "m20261202_000007_lean_insert").await;
    let mut listener = nudged_node(&db).await;
    let partition = scalar(&db, "SELECT outpost_partition_of('o', '1', 64)::int8").await;
    let partition = i32::try_from(partition).unwrap();
    // Not counted: the trigger that ends `outpost.filled_by_outpost` (a later migration, not
    // what this one changed).
    let triggers = "SELECT count(*) FROM pg_trigger \
                    WHERE tgrelid = 'outpost_event'::regclass AND NOT tgisinternal \
                      AND tgname <> 'outpost_event_filled_reset'";

    for (step, expected_triggers) in [("now", 1), ("reverted", 2), ("reapplied", 1)] {
        match step {
            "reverted" => outpost::store::migrate_down(&db.store, Some(steps))
                .await
                .unwrap(),
            "reapplied" => outpost::store::migrate_up(&db.store).await.unwrap(),
            _ => {}
        }
        assert_eq!(scalar(&db, triggers).await, expected_triggers, "{step}");
        db.store
            .connection()
            .execute_unprepared(&insert_row(&[]))
            .await
            .unwrap();
        assert_eq!(
            listener.recv().await.unwrap(),
            Nudge::Partitions(vec![partition]),
            "{step}"
        );
        let err = db
            .store
            .connection()
            .execute_unprepared(&insert_row(&[("schema_version", "'v2'")]))
            .await
            .map(|_| ())
            .map_err(StoreError::from_db);
        assert!(
            matches!(&err, Err(StoreError::Rejected { constraint, .. })
                if constraint == "outpost_event_schema_version_check"),
            "{step}: {err:?}"
        );
    }
    assert_eq!(
        scalar(&db, "SELECT max(aggregate_seq) FROM outpost_event").await,
        3
    );
}

/// Many events in one call are written by one statement that does the trigger's work for all of
/// them: each aggregate's sequence in the order given with ids drawn in that order, the held
/// state of a held-back aggregate, and one nudge per partition written while a node asks.
#[tokio::test]
async fn one_statement_for_many_events_sequences_holds_and_nudges_like_the_trigger() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let mut listener = nudged_node(&db).await;
    // o-0 exists and is held back (its earlier event waits for a retry); the others are new.
    let txn = db.store.connection().begin().await.unwrap();
    p.enqueue(&txn, &paid("o-0")).await.unwrap();
    txn.commit().await.unwrap();
    let first_nudge = listener.recv().await.unwrap();
    db.store
        .connection()
        .execute_unprepared(
            "UPDATE outpost_aggregate SET blocked_seq = 1 WHERE aggregate_id = 'o-0'",
        )
        .await
        .unwrap();

    let facts: Vec<EventFact> = (0..60)
        .map(|i| {
            EventFact::new(
                "order",
                format!("o-{}", i % 6),
                "order.paid",
                json!({"i": i}),
            )
        })
        .collect();
    let txn = db.store.connection().begin().await.unwrap();
    let out = p.enqueue_facts(&txn, facts).await.unwrap();
    txn.commit().await.unwrap();

    for k in 0..6 {
        let mine: Vec<&outpost::produce::Enqueued> = out.iter().skip(k).step_by(6).collect();
        let offset = i64::from(k == 0);
        assert_eq!(
            mine.iter().map(|e| e.aggregate_seq).collect::<Vec<_>>(),
            (1 + offset..=10 + offset).collect::<Vec<_>>(),
            "o-{k}: the sequence in the order given"
        );
        assert!(
            mine.windows(2).all(|w| w[0].id < w[1].id),
            "o-{k}: ids in sequence order"
        );
        let status = if k == 0 { "held" } else { "pending" };
        assert!(mine.iter().all(|e| e.status == status), "o-{k}: {status}");
    }
    let partitions: HashSet<i32> = out.iter().map(|e| e.partition).collect();
    let mut nudged = HashSet::new();
    while nudged.len() < partitions.len() {
        match listener.recv().await.unwrap() {
            Nudge::Partitions(ps) => nudged.extend(ps),
            Nudge::MaybeMissed => panic!("the listener lost its connection"),
        }
    }
    assert_eq!(nudged, partitions);
    assert_eq!(first_nudge, Nudge::Partitions(vec![out[0].partition]));

    // With no node asking, the statement sends none.
    db.store.set_wants_nudge("n1", false, 60_000).await.unwrap();
    let txn = db.store.connection().begin().await.unwrap();
    p.enqueue_facts(
        &txn,
        vec![
            EventFact::new("order", "o-20", "order.paid", json!({})),
            EventFact::new("order", "o-21", "order.paid", json!({})),
        ],
    )
    .await
    .unwrap();
    txn.commit().await.unwrap();
    db.store.set_wants_nudge("n1", true, 60_000).await.unwrap();
    let txn = db.store.connection().begin().await.unwrap();
    let last = p.enqueue(&txn, &paid("o-22")).await.unwrap();
    txn.commit().await.unwrap();
    assert_eq!(
        listener.recv().await.unwrap(),
        Nudge::Partitions(vec![last.partition]),
        "the inserts made while no node asked sent no nudge"
    );
}

/// The statement for many events applies the schema's rules itself (the producer checks first,
/// so only rows built past it reach them), with the same errors as the trigger.
#[tokio::test]
async fn one_statement_for_many_events_refuses_a_bad_row_and_writes_none() {
    let db = TestDb::new().await;
    let p = Producer::default();
    let good = p
        .prepare(EventFact::new("order", "o-1", "order.paid", json!({})))
        .unwrap();
    let mut bad = p
        .prepare(EventFact::new("order", "o-2", "order.paid", json!({})))
        .unwrap();
    bad.schema_version = "v2".to_owned();
    let txn = db.store.connection().begin().await.unwrap();
    let err = outpost::store::insert_events(&txn, &[good, bad])
        .await
        .unwrap_err();
    txn.rollback().await.unwrap();
    match err {
        StoreError::Rejected { constraint, detail } => {
            assert_eq!(constraint, "outpost_event_schema_version_check");
            assert!(
                detail.contains(r#"schema_version "v2" is not MAJOR"#),
                "{detail}"
            );
        }
        other => panic!("not refused as a bad row: {other}"),
    }
    assert_eq!(scalar(&db, "SELECT count(*) FROM outpost_event").await, 0);
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM outpost_aggregate").await,
        0
    );
}
