//! The `outpost` binary as an operator meets it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Command;

use sea_orm::{ConnectionTrait, DbBackend, Statement};

fn outpost() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outpost"));
    // Run from an empty directory so the repository's config/outpost.toml is not picked up,
    // and with no OUTPOST_* variables from the caller's environment.
    c.current_dir(std::env::temp_dir());
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTPOST_") {
            c.env_remove(k);
        }
    }
    c
}

fn temp_file(name: &str, contents: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("outpost-cli-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

const PASSWORD: &str = "hunter2-s3cret";

#[test]
fn config_check_reports_every_problem_with_its_source_and_exits_2() {
    let file = temp_file(
        "check.toml",
        &format!(
            "[database]\nurl = \"postgres://app:{PASSWORD}@db:5432/app\"\n\n[relay]\n\
             batch_rows = 0\nbatch_sizee = 10\n"
        ),
    );
    let out = outpost()
        .args(["config", "check", "--config"])
        .arg(&file)
        .env(
            "OUTPOST_REDIS__URL",
            format!("redis://:{PASSWORD}@cache:6379"),
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let shown = file.display().to_string();
    assert!(
        stderr.contains(&format!("{shown}:5")),
        "out-of-range value with its line: {stderr}"
    );
    assert!(stderr.contains("relay.batch_rows"), "{stderr}");
    assert!(
        stderr.contains(&format!("{shown}:6")),
        "unknown key with its line: {stderr}"
    );
    assert!(stderr.contains("batch_sizee"), "{stderr}");
    assert!(
        !stderr.contains(PASSWORD) && !stdout.contains(PASSWORD),
        "{stderr}{stdout}"
    );
    std::fs::remove_file(file).ok();
}

#[test]
fn config_print_redacts_secrets_and_check_passes_on_a_good_file() {
    let file = temp_file(
        "print.toml",
        &format!("[database]\nurl = \"postgres://app:{PASSWORD}@db:5432/app\"\n"),
    );
    let out = outpost()
        .args(["config", "print", "--config"])
        .arg(&file)
        .env("OUTPOST_NODE__ID", "node-a")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains(PASSWORD), "{stdout}");
    assert!(
        stdout.contains("postgres://app:***@db:5432/app"),
        "{stdout}"
    );
    assert!(stdout.contains("node-a"), "{stdout}");

    let out = outpost()
        .args(["config", "check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success());
    std::fs::remove_file(file).ok();
}

#[test]
fn a_command_needing_the_database_says_which_key_to_set() {
    let out = outpost().args(["status"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("database.url is not set"), "{stderr}");
    assert!(stderr.contains("OUTPOST_DATABASE__URL"), "{stderr}");
}

/// `outpost run` against `database_url` and `redis_url`: its exit status and stderr.
fn run_node(database_url: &str, redis_url: &str) -> (bool, String) {
    let out = outpost()
        .args(["--set", &format!("database.url={database_url}")])
        .args(["--set", &format!("redis.url={redis_url}")])
        .args(["--set", "database.connect_timeout_ms=1000"])
        .args(["--set", "redis.connect_timeout_ms=1000"])
        .args(["--set", "admin.listen=127.0.0.1:0"])
        .arg("run")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `outpost <args>` against `db`: exit success, stdout and stderr.
fn run_on(db: &support::TestDb, args: &[&str]) -> (bool, String, String) {
    let out = outpost()
        .args(["--set", &format!("database.url={}", db.url)])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The errors a newcomer meets on the way to a running node each name the cause and the fix.
#[tokio::test]
async fn first_run_errors_name_the_cause_and_the_fix() {
    let server = support::server_url();
    let redis = support::redis_url();
    let url = |db: &str| outpost::store::admin::database_url(&server, db).unwrap();

    // No PostgreSQL where database.url points.
    let closed = format!(
        "postgres://postgres@127.0.0.1:{}/outpost",
        support::free_port()
    );
    let (ok, err) = run_node(&closed, &redis);
    assert!(!ok);
    assert!(
        err.contains("check database.url and that PostgreSQL is running"),
        "{err}"
    );

    // A user PostgreSQL does not know (a wrong password is refused the same way, 28P01).
    let mut stranger = url::Url::parse(&url("postgres")).unwrap();
    stranger.set_username("no_such_user_x").unwrap();
    stranger.set_password(Some("wrong")).unwrap();
    let (ok, err) = run_node(stranger.as_str(), &redis);
    assert!(!ok);
    assert!(err.contains("PostgreSQL refused the login"), "{err}");
    assert!(
        err.contains("fix the user and password in database.url"),
        "{err}"
    );
    assert!(!err.contains("wrong"), "the password is not shown: {err}");

    // The database does not exist.
    let missing = format!("outpost_missing_{}", std::process::id());
    let (ok, err) = run_node(&url(&missing), &redis);
    assert!(!ok);
    assert!(
        err.contains(&format!("database \"{missing}\" does not exist")),
        "{err}"
    );
    assert!(err.contains("run `outpost migrate up`"), "{err}");

    // The database exists, the migrations have not run.
    let empty = format!("outpost_empty_{}", std::process::id());
    outpost::store::admin::drop_database(&server, &empty)
        .await
        .unwrap();
    outpost::store::admin::create_database(&server, &empty, None)
        .await
        .unwrap();
    let (ok, err) = run_node(&url(&empty), &redis);
    outpost::store::admin::drop_database(&server, &empty)
        .await
        .unwrap();
    assert!(!ok);
    assert!(
        err.contains("is behind this version's migrations: run `outpost migrate up`"),
        "{err}"
    );

    // No Redis where redis.url points.
    let db = support::TestDb::new().await;
    let no_redis = format!("redis://127.0.0.1:{}", support::free_port());
    let (ok, err) = run_node(&db.url, &no_redis);
    assert!(!ok);
    assert!(
        err.contains("cannot reach Redis (check redis.url and that Redis is running)"),
        "{err}"
    );
}

/// `outpost demo` runs the `outpost-records` binary beside it; without one it says how to build
/// it.
#[test]
fn demo_without_the_records_binary_says_how_to_build_it() {
    let dir = std::env::temp_dir().join(format!("outpost-cli-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let alone = dir.join("outpost");
    std::fs::copy(env!("CARGO_BIN_EXE_outpost"), &alone).unwrap();
    let out = Command::new(&alone)
        .args(["demo", "--duration", "5"])
        .current_dir(&dir)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cargo build --release --workspace"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_shown_replayed_by_filter_with_confirmation_and_audited() {
    let db = support::TestDb::new().await;
    for a in 0..3 {
        let facts = (0..2)
            .map(|n| {
                outpost::produce::EventFact::new(
                    "order",
                    format!("o{a}"),
                    "order.placed",
                    serde_json::json!({"n": n}),
                )
            })
            .collect();
        support::commit_facts(&db.store, facts).await;
    }
    for sql in [
        "UPDATE outpost_event SET status = CASE WHEN aggregate_seq = 1 THEN 'quarantined' \
           ELSE 'held' END, attempts = 3, \
           last_error = CASE WHEN aggregate_seq = 1 THEN 'WRONGTYPE Operation against a key' END",
        "UPDATE outpost_aggregate SET blocked_seq = 1",
    ] {
        db.store
            .connection()
            .execute_raw(Statement::from_string(DbBackend::Postgres, sql))
            .await
            .unwrap();
    }

    let (ok, out, err) = run_on(&db, &["status"]);
    assert!(ok, "{err}");
    assert!(out.contains("quarantined by error code"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("WRONGTYPE") && l.ends_with(" 3")),
        "{out}"
    );

    let (ok, out, err) = run_on(&db, &["dead-letter", "list", "--code", "WRONGTYPE"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("3 matching event(s)"), "{out}");
    let first_id = out
        .lines()
        .nth(2)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();

    let (ok, out, err) = run_on(&db, &["dead-letter", "show", &first_id]);
    assert!(ok, "{err}");
    assert!(out.contains("error code:    WRONGTYPE"), "{out}");
    assert!(out.contains("\"n\": 0"), "{out}");

    // --all-matching shows the count and changes nothing without --yes.
    let act = [
        "dead-letter",
        "replay",
        "--all-matching",
        "--code",
        "WRONGTYPE",
        "--reason",
        "fixed",
    ];
    let (ok, out, err) = run_on(&db, &act);
    assert!(ok, "{err}");
    assert!(
        out.starts_with("3 quarantined event(s) match; nothing was changed"),
        "{out}"
    );
    let (ok, _, err) = run_on(&db, &[&act[..], &["--yes", "--expect", "2"]].concat());
    assert!(!ok);
    assert!(err.contains("not the 2 given with --expect"), "{err}");
    let (ok, out, err) = run_on(&db, &[&act[..], &["--yes", "--expect", "3"]].concat());
    assert!(ok, "{err}");
    assert!(
        out.contains("replayed 3 event(s); 3 held event(s)"),
        "{out}"
    );

    let (ok, out, err) = run_on(
        &db,
        &["dead-letter", "discard", &first_id, "--reason", "gone"],
    );
    assert!(!ok, "{out}");
    assert!(err.contains("not quarantined"), "{err}");

    let (ok, out, err) = run_on(&db, &["audit"]);
    assert!(ok, "{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains("event.replay")).count(),
        1,
        "{out}"
    );
    assert!(!out.contains("event.discard"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_shown_once_listed_without_its_secret_and_revoked() {
    let db = support::TestDb::new().await;
    let (ok, out, err) = run_on(
        &db,
        &[
            "admin",
            "token",
            "create",
            "--role",
            "operator",
            "--name",
            "ops-alice",
        ],
    );
    assert!(ok, "{err}");
    let token = out.trim().to_owned();
    assert!(token.starts_with("opk_"), "{out}");
    assert!(err.contains("shown once"), "{err}");
    let actor = db.store.authenticate(&token).await.unwrap().unwrap();
    assert_eq!(actor.name, "ops-alice");

    let (ok, out, err) = run_on(&db, &["admin", "token", "list"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("ops-alice") && out.contains("operator"),
        "{out}"
    );
    // `opk_<id>_<secret>`: the secret is base64url, which may itself hold `_`.
    let secret = token.splitn(3, '_').nth(2).unwrap();
    assert!(secret.len() >= 40, "a whole secret: {secret}");
    assert!(!out.contains(secret) && !err.contains(secret), "{out}{err}");

    let (ok, _, err) = run_on(
        &db,
        &["admin", "token", "create", "--role", "root", "--name", "x"],
    );
    assert!(!ok);
    assert!(err.contains("viewer") && err.contains("admin"), "{err}");

    let (ok, out, err) = run_on(&db, &["admin", "token", "revoke", "--name", "ops-alice"]);
    assert!(ok, "{err}");
    assert!(out.contains("revoked"), "{out}");
    assert_eq!(db.store.authenticate(&token).await.unwrap(), None);
    let (ok, out, err) = run_on(&db, &["audit", "--json"]);
    assert!(ok, "{err}");
    assert!(!out.contains(secret), "{out}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let actions: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, vec!["token.revoke", "token.create"]);
}
