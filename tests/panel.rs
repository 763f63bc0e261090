//! The operator panel of a running node against real PostgreSQL and Redis: log in, see the
//! backlog, find a quarantined event, replay it through the confirm step and see it in its
//! stream; forged and cross-site actions refused without a change.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outpost::produce::EventFact;
use outpost::store::AuditQuery;
use serde_json::json;
use support::http::{FORM, call_with, panel_login};
use support::{Deliveries, TestDb, TestRedis, relay_config, scalar, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_logs_in_finds_a_dead_letter_and_replays_it_while_forged_posts_change_nothing()
{
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let mut conn = redis.conn().await;
    let poisoned = support::poison_stream(&mut conn, &redis, "poison").await;
    let mut ids = Vec::new();
    for n in 0..2 {
        let fact = EventFact::new("poison", "p0", "thing.happened", json!({"n": n}));
        ids.extend(support::commit_facts(&db.store, vec![fact]).await);
    }
    let node = support::start_node(relay_config(&db, &redis, "panel-node")).await;
    let addr = node.admin_addr().to_string();
    support::wait_quarantined(&db, 1).await;
    let token = support::operator_token(&db, "ops-panel").await;

    // A wrong token does not log in; the right one does.
    let origin = format!("http://{addr}");
    let bad = call_with(
        &addr,
        "POST",
        "/panel/login",
        &[("Origin", &origin)],
        Some((FORM, "token=opk_1_nope")),
    )
    .await;
    assert_eq!(bad.status, 401);
    assert!(bad.body.contains("not valid"), "{}", bad.body);
    let foreign = call_with(
        &addr,
        "POST",
        "/panel/login",
        &[("Origin", "http://evil.example")],
        Some((FORM, &format!("token={token}"))),
    )
    .await;
    assert_eq!(foreign.status, 403, "a cross-site login is refused");
    let (cookie, csrf) = panel_login(&addr, &token).await.unwrap();
    let get = |path: &'static str| {
        let (addr, cookie) = (addr.clone(), cookie.clone());
        async move { call_with(&addr, "GET", path, &[("Cookie", &cookie)], None).await }
    };

    // The overview shows the backlog figure and the one quarantined event.
    let overview = get("/panel").await;
    assert_eq!(overview.status, 200);
    assert!(
        overview.body.contains(r#"id="backlog">"#),
        "{}",
        overview.body
    );
    assert!(
        overview.body.contains(r#"href="/panel/dead-letters">1<"#),
        "one quarantined: {}",
        overview.body
    );
    assert!(overview.body.contains("WRONGTYPE"), "quarantined by code");
    let dead = get("/panel/dead-letters").await;
    assert!(dead.body.contains(&ids[0]), "{}", dead.body);
    assert!(
        dead.body.contains("1 matching event(s) in quarantine"),
        "{}",
        dead.body
    );
    let detail = call_with(
        &addr,
        "GET",
        &format!("/panel/events/{}", ids[0]),
        &[("Cookie", &cookie)],
        None,
    )
    .await;
    assert!(
        detail.body.contains("WRONGTYPE Operation"),
        "last error shown"
    );
    assert!(
        detail.body.contains("&#34;n&#34;: 0"),
        "payload shown: {}",
        detail.body
    );

    // Forged and cross-site posts are refused and change nothing.
    let apply = format!("action=replay&id={}&reason=fixed", ids[0]);
    let attempts: [(Vec<(&str, &str)>, String); 4] = [
        (vec![("Origin", &origin)], apply.clone()),
        (
            vec![("Origin", &origin)],
            format!("csrf=wrong-{csrf}&{apply}"),
        ),
        (
            vec![("Origin", "http://evil.example")],
            format!("csrf={csrf}&{apply}"),
        ),
        (
            vec![("Sec-Fetch-Site", "cross-site"), ("Origin", &origin)],
            format!("csrf={csrf}&{apply}"),
        ),
    ];
    for (mut headers, body) in attempts {
        headers.push(("Cookie", &cookie));
        let r = call_with(
            &addr,
            "POST",
            "/panel/dead-letters/apply",
            &headers,
            Some((FORM, &body)),
        )
        .await;
        assert_eq!(r.status, 403, "{headers:?} {body}: {}", r.body);
    }
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM outpost_event WHERE status = 'quarantined'"
        )
        .await,
        1
    );
    assert!(
        db.store
            .audit_log(&AuditQuery::default())
            .await
            .unwrap()
            .iter()
            .all(|r| r.action == "token.create")
    );

    // Fix the cause, confirm, replay: the event and its held successor reach the stream in order.
    let _: () = redis::cmd("DEL")
        .arg(&poisoned)
        .query_async(&mut conn)
        .await
        .unwrap();
    let headers = [("Origin", origin.as_str()), ("Cookie", cookie.as_str())];
    let confirm = call_with(
        &addr,
        "POST",
        "/panel/dead-letters/confirm",
        &headers,
        Some((FORM, &format!("csrf={csrf}&action=replay&id={}", ids[0]))),
    )
    .await;
    assert_eq!(confirm.status, 200);
    assert!(
        confirm.body.contains("Replay 1 event(s)?"),
        "{}",
        confirm.body
    );
    let done = call_with(
        &addr,
        "POST",
        "/panel/dead-letters/apply",
        &headers,
        Some((FORM, &format!("csrf={csrf}&{apply}"))),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert!(
        done.body.contains("Replayed 1 event(s); 1 held event(s)"),
        "{}",
        done.body
    );
    wait_until(60, "the replayed events in their stream", || {
        let (mut c, prefix) = (conn.clone(), redis.prefix.clone());
        async move { support::stream_entries(&mut c, &prefix).await >= 2 }
    })
    .await;
    let d = Deliveries::collect(&mut conn, &redis.prefix).await;
    assert_eq!(
        d.order.get(&("poison".to_owned(), "p0".to_owned())),
        Some(&vec![1, 2])
    );
    for id in &ids {
        assert_eq!(d.copies.get(id), Some(&1));
    }
    let log = db.store.audit_log(&AuditQuery::default()).await.unwrap();
    assert_eq!(
        (log[0].action.as_str(), log[0].actor.as_str()),
        ("event.replay", "ops-panel")
    );
    assert_eq!(log[0].detail["reason"], "fixed");

    // Logging out ends the session.
    let out = call_with(
        &addr,
        "POST",
        "/panel/logout",
        &headers,
        Some((FORM, &format!("csrf={csrf}"))),
    )
    .await;
    assert_eq!(out.status, 303);
    assert_eq!(get("/panel").await.status, 303, "back to the login page");
    node.shutdown().await;
}
