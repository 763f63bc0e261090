//! The JSON API of a running node against real PostgreSQL and Redis: every route × role, the
//! OpenAPI document against the routes registered, problems, limits and headers, and secrets
//! that never leave the node.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeSet, HashMap};

use outpost::admin::routes::ROUTES;
use outpost::store::{Actor, Role};
use support::http::{FORM, Resp, call_with, panel_login};
use support::{TestDb, TestRedis, relay_config_for, wait_until};

/// One HTTP/1.0 request with a JSON body.
async fn call(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Resp {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    call_with(
        addr,
        method,
        path,
        &headers,
        body.map(|b| ("application/json", b)),
    )
    .await
}

/// A node with the API on a free port and generous rate limits, and tokens of every role
/// (one revoked).
struct Setup {
    db: TestDb,
    _redis: TestRedis,
    node: outpost::app::NodeHandle,
    addr: String,
    tokens: HashMap<&'static str, String>,
    /// Panel sessions (cookie, CSRF token) by identity; the revoked one logged in before its
    /// token was revoked.
    sessions: HashMap<&'static str, (String, String)>,
}

/// `panel`: also log in to the panel with every token.
async fn setup(extra: &[(&str, &str)], panel: bool) -> Setup {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let mut overrides = vec![
        ("admin.requests_per_sec", "100000"),
        ("admin.burst", "100000"),
    ];
    overrides.extend_from_slice(extra);
    let node = support::start_node(relay_config_for(&db, &redis, "api-node", &overrides)).await;
    let addr = node.admin_addr().to_string();
    let root = Actor::new("test-root", Role::Admin);
    let mut tokens = HashMap::new();
    for (name, role) in [
        ("viewer", Role::Viewer),
        ("operator", Role::Operator),
        ("admin", Role::Admin),
        ("revoked", Role::Admin),
    ] {
        let t = db.store.create_token(&root, name, role).await.unwrap();
        tokens.insert(name, t.token);
    }
    wait_until(30, "the node to be ready", || {
        let addr = addr.clone();
        async move { call(&addr, "GET", "/readyz", None, None).await.status == 200 }
    })
    .await;
    let mut sessions = HashMap::new();
    for (who, token) in tokens.iter().filter(|_| panel) {
        sessions.insert(*who, panel_login(&addr, token).await.expect("panel login"));
    }
    db.store.revoke_token(&root, "revoked").await.unwrap();
    Setup {
        db,
        _redis: redis,
        node,
        addr,
        tokens,
        sessions,
    }
}

/// What a route is called with in the matrix (`{csrf}` and `{token}` in a body stand for the
/// identity's), and what it answers to someone allowed.
struct Case {
    path: String,
    body: Option<String>,
    allowed: u16,
    /// For a route that needs no token, what it answers without a valid one, when that differs.
    invalid: Option<u16>,
}

fn case(path: &str, body: Option<&str>, allowed: u16) -> Case {
    Case {
        path: path.to_owned(),
        body: body.map(str::to_owned),
        allowed,
        invalid: None,
    }
}

/// The matrix's entry for every route. A route missing here fails the test.
fn cases() -> HashMap<(&'static str, &'static str), Case> {
    let nobody = uuid::Uuid::new_v4();
    let act = format!(r#"{{"ids": ["{nobody}"], "reason": "matrix"}}"#);
    HashMap::from([
        (("GET", "/metrics"), case("/metrics", None, 200)),
        (("GET", "/livez"), case("/livez", None, 200)),
        (("GET", "/readyz"), case("/readyz", None, 200)),
        (
            ("GET", "/api/v1/openapi.json"),
            case("/api/v1/openapi.json", None, 200),
        ),
        (("GET", "/api/v1/status"), case("/api/v1/status", None, 200)),
        (
            ("GET", "/api/v1/partitions"),
            case("/api/v1/partitions", None, 200),
        ),
        (
            ("POST", "/api/v1/partitions/pause"),
            case(
                "/api/v1/partitions/pause",
                Some(r#"{"partitions": [5]}"#),
                200,
            ),
        ),
        (
            ("POST", "/api/v1/partitions/resume"),
            case(
                "/api/v1/partitions/resume",
                Some(r#"{"partitions": [5]}"#),
                200,
            ),
        ),
        (("GET", "/api/v1/nodes"), case("/api/v1/nodes", None, 200)),
        (
            ("GET", "/api/v1/events"),
            case("/api/v1/events?state=quarantined&limit=10", None, 200),
        ),
        (
            ("GET", "/api/v1/events/{event_id}"),
            case(&format!("/api/v1/events/{nobody}"), None, 404),
        ),
        (
            ("POST", "/api/v1/dead-letters/replay"),
            case("/api/v1/dead-letters/replay", Some(&act), 409),
        ),
        (
            ("POST", "/api/v1/dead-letters/discard"),
            case("/api/v1/dead-letters/discard", Some(&act), 409),
        ),
        (
            ("GET", "/api/v1/audit"),
            case("/api/v1/audit?limit=5", None, 200),
        ),
        (("GET", "/api/v1/config"), case("/api/v1/config", None, 200)),
        (("GET", "/api/v1/tokens"), case("/api/v1/tokens", None, 200)),
        (
            ("POST", "/api/v1/tokens"),
            case(
                "/api/v1/tokens",
                Some(r#"{"name": "made-by-matrix", "role": "viewer"}"#),
                201,
            ),
        ),
        (
            ("DELETE", "/api/v1/tokens/{name}"),
            case("/api/v1/tokens/made-by-matrix", None, 200),
        ),
        (
            ("GET", "/panel/static/panel.css"),
            case("/panel/static/panel.css", None, 200),
        ),
        (("GET", "/panel/login"), case("/panel/login", None, 200)),
        (
            ("POST", "/panel/login"),
            Case {
                invalid: Some(401),
                ..case("/panel/login", Some("token={token}"), 303)
            },
        ),
        (("GET", "/panel"), case("/panel", None, 200)),
        (
            ("GET", "/panel/partitions"),
            case("/panel/partitions", None, 200),
        ),
        (
            ("POST", "/panel/partitions/confirm"),
            case(
                "/panel/partitions/confirm",
                Some("csrf={csrf}&partition=5&action=pause"),
                200,
            ),
        ),
        (
            ("POST", "/panel/partitions/apply"),
            case(
                "/panel/partitions/apply",
                Some("csrf={csrf}&partition=5&action=resume"),
                200,
            ),
        ),
        (
            ("GET", "/panel/events"),
            case("/panel/events?state=held", None, 200),
        ),
        (
            ("GET", "/panel/events/{event_id}"),
            case(&format!("/panel/events/{nobody}"), None, 404),
        ),
        (
            ("GET", "/panel/dead-letters"),
            case("/panel/dead-letters", None, 200),
        ),
        (
            ("POST", "/panel/dead-letters/confirm"),
            case(
                "/panel/dead-letters/confirm",
                Some(&format!("csrf={{csrf}}&action=replay&id={nobody}")),
                200,
            ),
        ),
        (
            ("POST", "/panel/dead-letters/apply"),
            case(
                "/panel/dead-letters/apply",
                Some(&format!(
                    "csrf={{csrf}}&action=replay&id={nobody}&reason=matrix"
                )),
                409,
            ),
        ),
        (("GET", "/panel/audit"), case("/panel/audit", None, 200)),
        (("GET", "/panel/config"), case("/panel/config", None, 200)),
        (
            ("POST", "/panel/logout"),
            case("/panel/logout", Some("csrf={csrf}"), 303),
        ),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_each_role_as_expected_and_refusals_change_nothing() {
    let s = setup(&[], true).await;
    let cases = cases();
    let identities: [(&str, Option<Role>); 5] = [
        ("anonymous", None),
        ("revoked", None),
        ("viewer", Some(Role::Viewer)),
        ("operator", Some(Role::Operator)),
        ("admin", Some(Role::Admin)),
    ];
    let mut failures = Vec::new();
    for route in ROUTES {
        let Some(c) = cases.get(&(route.method, route.path)) else {
            panic!(
                "{} {} has no entry in the route x role matrix: add one",
                route.method, route.path
            );
        };
        for (who, role) in identities {
            let token = s.tokens.get(who).map(String::as_str);
            let expected = match (route.role, role) {
                (None, None) => c.invalid.unwrap_or(c.allowed),
                (None, Some(_)) => c.allowed,
                (Some(_), None) if route.panel => 303,
                (Some(_), None) => 401,
                (Some(needed), Some(has)) if has >= needed => c.allowed,
                (Some(_), Some(_)) => 403,
            };
            let r = if route.panel {
                let (cookie, csrf) = s.sessions.get(who).cloned().unwrap_or_default();
                let origin = format!("http://{}", s.addr);
                let body = c.body.as_ref().map(|b| {
                    b.replace("{csrf}", &csrf)
                        .replace("{token}", token.unwrap_or_default())
                });
                let mut headers = vec![("Origin", origin.as_str())];
                if !cookie.is_empty() {
                    headers.push(("Cookie", cookie.as_str()));
                }
                call_with(
                    &s.addr,
                    route.method,
                    &c.path,
                    &headers,
                    body.as_deref().map(|b| (FORM, b)),
                )
                .await
            } else {
                call(&s.addr, route.method, &c.path, token, c.body.as_deref()).await
            };
            if r.status != expected {
                failures.push(format!(
                    "{} {} as {who}: {} (expected {expected}) {}",
                    route.method, c.path, r.status, r.body
                ));
            }
            if r.status >= 400 && route.path.starts_with("/api/") {
                assert_eq!(
                    r.headers.get("content-type").map(String::as_str),
                    Some("application/problem+json"),
                    "{} {} as {who}",
                    route.method,
                    c.path
                );
            }
            for h in [
                "content-security-policy",
                "x-content-type-options",
                "cache-control",
            ] {
                assert!(r.headers.contains_key(h), "{h} on {} as {who}", c.path);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // Refused requests changed nothing: the audit log holds exactly the allowed changes.
    let log =
        s.db.store
            .audit_log(&outpost::store::AuditQuery {
                limit: Some(1000),
                ..Default::default()
            })
            .await
            .unwrap();
    let mut actions: Vec<(String, String)> = log
        .iter()
        .map(|r| (r.action.clone(), r.actor.clone()))
        .collect();
    actions.sort();
    let mut want: Vec<(String, String)> = [
        ("partition.pause", "admin"),
        ("partition.pause", "operator"),
        ("partition.resume", "admin"),
        ("partition.resume", "admin"),
        ("partition.resume", "operator"),
        ("partition.resume", "operator"),
        ("token.create", "admin"),
        ("token.create", "test-root"),
        ("token.create", "test-root"),
        ("token.create", "test-root"),
        ("token.create", "test-root"),
        ("token.revoke", "admin"),
        ("token.revoke", "test-root"),
    ]
    .iter()
    .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
    .collect();
    want.sort();
    assert_eq!(actions, want);
    s.node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_lists_exactly_the_registered_api_routes() {
    let s = setup(&[], false).await;
    let r = call(&s.addr, "GET", "/api/v1/openapi.json", None, None).await;
    assert_eq!(r.status, 200);
    let doc: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, ops)| {
            ops.as_object()
                .unwrap()
                .keys()
                .map(|m| (m.to_ascii_uppercase(), path.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    let registered: BTreeSet<(String, String)> = ROUTES
        .iter()
        .filter(|r| r.path.starts_with("/api/"))
        .map(|r| (r.method.to_owned(), r.path.to_owned()))
        .collect();
    assert_eq!(documented, registered);
    // And every registered API route answers (not 404) where the document says it is.
    for (method, path) in &registered {
        let concrete = path.replace("{event_id}", &uuid::Uuid::new_v4().to_string());
        let concrete = concrete.replace("{name}", "x");
        let r = call(
            &s.addr,
            method,
            &concrete,
            s.tokens.get("admin").map(String::as_str),
            Some("{}"),
        )
        .await;
        assert_ne!(r.body, "", "{method} {path}");
        assert!(
            !r.body.contains("no such route"),
            "{method} {path}: {}",
            r.body
        );
    }
    s.node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_limited_bursts_get_429_with_retry_after_and_errors_are_problems() {
    let s = setup(&[("admin.max_body_bytes", "1024")], false).await;
    let admin = s.tokens.get("admin").map(String::as_str);
    let big = format!(r#"{{"ids": [], "reason": "{}"}}"#, "x".repeat(4000));
    let r = call(
        &s.addr,
        "POST",
        "/api/v1/dead-letters/replay",
        admin,
        Some(&big),
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert!(r.body.contains("admin.max_body_bytes"), "{}", r.body);

    let r = call(&s.addr, "GET", "/api/v1/events?state=lost", admin, None).await;
    assert_eq!(r.status, 400);
    let p: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(p["status"], 400);
    assert!(p["detail"].as_str().unwrap().contains("quarantined"), "{p}");
    let r = call(
        &s.addr,
        "GET",
        "/api/v1/events?recorded_from=yesterday",
        admin,
        None,
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("RFC 3339"), "{}", r.body);
    let r = call(
        &s.addr,
        "POST",
        "/api/v1/dead-letters/replay",
        admin,
        Some(r#"{"reason": "x"}"#),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("expected"), "{}", r.body);
    let r = call(&s.addr, "GET", "/api/v1/nothing-here", admin, None).await;
    assert_eq!(r.status, 404);
    assert!(r.body.contains("openapi.json"), "{}", r.body);
    s.node.shutdown().await;

    // A node with a small budget: the burst passes, the next request gets 429 and Retry-After.
    let s = setup(
        &[("admin.requests_per_sec", "1"), ("admin.burst", "3")],
        false,
    )
    .await;
    let viewer = s.tokens.get("viewer").map(String::as_str);
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(call(&s.addr, "GET", "/api/v1/status", viewer, None).await);
    }
    let limited: Vec<&Resp> = statuses.iter().filter(|r| r.status == 429).collect();
    assert!(
        !limited.is_empty(),
        "{:?}",
        statuses.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert!(statuses[0].status == 200);
    let retry: u64 = limited[0]
        .headers
        .get("retry-after")
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    assert_eq!(
        limited[0].headers.get("content-type").map(String::as_str),
        Some("application/problem+json")
    );
    // Probes are never limited.
    assert_eq!(call(&s.addr, "GET", "/livez", None, None).await.status, 200);
    s.node.shutdown().await;
}

/// Runs `outpost` with `args` and returns stdout and stderr together.
fn outpost_output(args: &[String]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_outpost"));
    cmd.args(args).current_dir(std::env::temp_dir());
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTPOST_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_and_tokens_never_appear_in_answers_logs_metrics_or_the_audit_log() {
    const DB_PASSWORD: &str = "canary-db-Zq81x";
    const REDIS_PASSWORD: &str = "canary-redis-Kp27w";
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    // The test server trusts local connections whatever the password; Redis gets a user of
    // the test's own with a password.
    let mut db_url = url::Url::parse(&db.url).unwrap();
    db_url.set_password(Some(DB_PASSWORD)).unwrap();
    let user = format!("canary{}", uuid::Uuid::new_v4().simple());
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER".to_owned(),
            user.clone(),
            "on".to_owned(),
            format!(">{REDIS_PASSWORD}"),
            "~*".to_owned(),
            "&*".to_owned(),
            "+@all".to_owned(),
        ])
        .query_async(&mut conn)
        .await
        .unwrap();
    let redis_url = format!("redis://{user}:{REDIS_PASSWORD}@127.0.0.1:6379");
    let port = support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut args = support::relay_args(
        &db,
        &redis_url,
        &redis.prefix,
        "canary-node",
        &[
            ("admin.listen", &listen),
            ("log.level", "debug"),
            ("admin.requests_per_sec", "100000"),
            ("admin.burst", "100000"),
        ],
    );
    args.push("--set".to_owned());
    args.push(format!("database.url={db_url}"));
    let log_path = std::env::temp_dir().join(format!("outpost-canary-{user}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_outpost"));
    cmd.args(&args)
        .arg("run")
        .current_dir(std::env::temp_dir())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTPOST_") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    let mut node = support::NodeProcess(cmd.spawn().unwrap());
    wait_until(60, "the node to be ready", || {
        let listen = listen.clone();
        async move { support::http_get(&listen, "/readyz").await.0 == 200 }
    })
    .await;

    let root = Actor::new("test-root", Role::Admin);
    let admin = db
        .store
        .create_token(&root, "canary-admin", Role::Admin)
        .await
        .unwrap()
        .token;
    let mut seen = String::new();
    let created = call(
        &listen,
        "POST",
        "/api/v1/tokens",
        Some(&admin),
        Some(r#"{"name": "canary-viewer", "role": "viewer"}"#),
    )
    .await;
    assert_eq!(created.status, 201, "{}", created.body);
    let viewer: String = serde_json::from_str::<serde_json::Value>(&created.body).unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let (cookie, _) = panel_login(&listen, &admin).await.unwrap();
    for route in ROUTES.iter().filter(|r| r.method == "GET") {
        let path = route
            .path
            .replace("{event_id}", &uuid::Uuid::new_v4().to_string());
        if route.panel {
            let r = call_with(&listen, "GET", &path, &[("Cookie", &cookie)], None).await;
            seen.push_str(&format!("{:?}\n{}\n", r.headers, r.body));
            continue;
        }
        for token in [
            Some(admin.as_str()),
            Some(viewer.as_str()),
            None,
            Some("opk_1_forged"),
        ] {
            let r = call(&listen, "GET", &path, token, None).await;
            seen.push_str(&format!("{:?}\n{}\n", r.headers, r.body));
        }
    }
    for body in [
        r#"{"ids": [], "reason": "x"}"#,
        "not json",
        r#"{"partitions": [999]}"#,
    ] {
        for path in ["/api/v1/dead-letters/replay", "/api/v1/partitions/pause"] {
            let r = call(&listen, "POST", path, Some(&admin), Some(body)).await;
            seen.push_str(&format!("{}\n", r.body));
        }
    }
    let config = call(&listen, "GET", "/api/v1/config", Some(&viewer), None).await;
    assert!(config.body.contains("***"), "{}", config.body);
    let revoked = call(
        &listen,
        "DELETE",
        "/api/v1/tokens/canary-viewer",
        Some(&admin),
        None,
    )
    .await;
    seen.push_str(&revoked.body);
    let audit = db
        .store
        .audit_log(&outpost::store::AuditQuery::default())
        .await
        .unwrap();
    seen.push_str(&serde_json::to_string(&audit).unwrap());
    let mut cli = args[..args.len() - 2].to_vec();
    cli.extend(["--set".to_owned(), format!("database.url={db_url}")]);
    for extra in [
        vec!["status"],
        vec!["dead-letter", "list"],
        vec!["audit"],
        vec!["config", "print"],
        vec!["admin", "token", "list"],
    ] {
        let mut a = cli.clone();
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        seen.push_str(&outpost_output(&a));
    }
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &node.0.id().to_string()])
        .status();
    support::wait_exit(&mut node.0, 30).await;
    let logs = std::fs::read_to_string(&log_path).unwrap();
    std::fs::remove_file(&log_path).ok();
    let _: () = redis::cmd("ACL")
        .arg(&["DELUSER", user.as_str()])
        .query_async(&mut conn)
        .await
        .unwrap();

    assert!(
        logs.contains("node started"),
        "the node's log was captured: {logs}"
    );
    assert!(
        seen.contains("Configuration") && seen.contains("***"),
        "panel pages were captured"
    );
    assert!(
        seen.contains("outpost_") && seen.contains("canary-viewer"),
        "answers were captured"
    );
    // `opk_<id>_<secret>`: the secret is base64url, which may itself hold `_`.
    let secret = |t: &str| {
        let s = t.splitn(3, '_').nth(2).unwrap().to_owned();
        assert!(s.len() >= 40, "a whole secret, not a piece of one: {s}");
        s
    };
    for (what, canary) in [
        ("database password", DB_PASSWORD.to_owned()),
        ("Redis password", REDIS_PASSWORD.to_owned()),
        ("admin token", secret(&admin)),
        ("viewer token", secret(&viewer)),
    ] {
        assert!(!logs.contains(&canary), "{what} in the node's log");
        assert!(
            !seen.contains(&canary),
            "{what} in an answer, the audit log or the CLI"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_endpoint_refuses_to_listen_beyond_loopback_and_says_how_to_fix_it() {
    let db = TestDb::new().await;
    let redis = TestRedis::new();
    let config = relay_config_for(
        &db,
        &redis,
        "exposed-node",
        &[("admin.listen", "0.0.0.0:0")],
    );
    let start = |config: outpost::config::Config| async move {
        support::init_logs();
        tokio::task::spawn_blocking(move || outpost::app::start(&config))
            .await
            .unwrap()
    };
    let Err(err) = start(config.clone()).await else {
        panic!("a node without tokens listening beyond loopback started");
    };
    let text = err.to_string();
    assert!(text.contains("outpost admin token create"), "{text}");
    assert!(text.contains("loopback"), "{text}");
    let root = Actor::new("test-root", Role::Admin);
    db.store
        .create_token(&root, "first", Role::Admin)
        .await
        .unwrap();
    let node = start(config).await.expect("starts once a token exists");
    assert!(!node.admin_addr().ip().is_loopback());
    node.shutdown().await;
}
