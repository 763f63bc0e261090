//! Configuration loading: layering, error reporting and secret hygiene.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use outpost::config::{Config, ConfigErrors, LoadOptions, Problem, Secret, load};

/// A TOML file under the temp dir, removed on drop.
struct TempToml {
    path: PathBuf,
}

impl TempToml {
    fn new(contents: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "outpost-config-test-{}-{}-{}.toml",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        ));
        std::fs::write(&path, contents).expect("write temp config");
        Self { path }
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// The source label of line `line` of this file.
    fn at(&self, line: usize) -> String {
        format!("{}:{line}", self.path.display())
    }
}

impl Drop for TempToml {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn vars(pairs: &[(&str, &str)]) -> Option<Vec<(String, String)>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    )
}

fn options(file: Option<&Path>, env: &[(&str, &str)], flags: &[(&str, &str)]) -> LoadOptions {
    LoadOptions {
        file: file.map(Path::to_path_buf),
        overrides: flags
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        env: true,
        env_vars: vars(env),
    }
}

fn load_err(opts: &LoadOptions) -> ConfigErrors {
    match load(opts) {
        Ok(config) => panic!("expected problems, got {config:?}"),
        Err(e) => e,
    }
}

fn problem<'a>(errors: &'a ConfigErrors, key: &str) -> &'a Problem {
    errors
        .problems
        .iter()
        .find(|p| p.key == key)
        .unwrap_or_else(|| panic!("no problem about {key} in:\n{errors}"))
}

#[test]
fn example_file_parses_to_the_defaults() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/outpost.example.toml");
    let opts = LoadOptions {
        file: Some(example),
        env: false,
        ..LoadOptions::default()
    };
    let config = load(&opts).unwrap_or_else(|e| panic!("example does not load:\n{e}"));
    assert_eq!(config, Config::default());
}

#[test]
fn quick_start_file_sets_only_the_endpoints() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/outpost.toml");
    let opts = LoadOptions {
        file: Some(file),
        env: false,
        ..LoadOptions::default()
    };
    let config = load(&opts).unwrap_or_else(|e| panic!("outpost.toml does not load:\n{e}"));
    let mut expected = Config::default();
    expected.database.url = Some(Secret::new("postgres://postgres@127.0.0.1:5432/outpost"));
    expected.redis.url = Some(Secret::new("redis://127.0.0.1:6379"));
    assert_eq!(config, expected);
}

#[test]
fn defaults_have_no_endpoints_and_validate() {
    let config = Config::default();
    assert!(config.database.url.is_none());
    assert!(config.redis.url.is_none());
    config.validate().expect("defaults are valid");
    let err = config
        .database
        .url()
        .expect_err("no database url by default");
    assert_eq!(
        err.problems[0].message,
        "database.url is not set: set it in config/outpost.toml or OUTPOST_DATABASE__URL"
    );
}

#[test]
fn file_problems_are_all_reported_with_file_and_line() {
    let file = TempToml::new(
        "\
# a comment
[relay]
batch_rows = 0
batch_byts = 2048
busy_poll_ms = \"fast\"
max_attempts = -1

[log]
format = 5

[tracing]
level = \"debug\"
",
    );
    let errors = load_err(&options(Some(file.path()), &[], &[]));

    let unknown = problem(&errors, "relay.batch_byts");
    assert_eq!(unknown.source, file.at(4));
    assert!(
        unknown.message.contains("unknown key"),
        "{}",
        unknown.message
    );
    assert!(
        unknown.message.contains("did you mean `relay.batch_bytes`"),
        "{}",
        unknown.message
    );

    let range = problem(&errors, "relay.batch_rows");
    assert_eq!(range.source, file.at(3));
    assert!(range.message.contains("1 and 10000"), "{}", range.message);

    // Several type errors in one section, and one in another section.
    let busy = problem(&errors, "relay.busy_poll_ms");
    assert_eq!(busy.source, file.at(5));
    assert!(busy.message.contains("\"fast\""), "{}", busy.message);
    assert_eq!(problem(&errors, "relay.max_attempts").source, file.at(6));
    assert_eq!(problem(&errors, "log.format").source, file.at(9));

    let section = problem(&errors, "tracing");
    assert_eq!(section.source, file.at(11));

    assert_eq!(errors.problems.len(), 6, "{errors}");
    println!("{errors}");
    // Display: one line per problem.
    assert_eq!(errors.to_string().lines().count(), errors.problems.len());
}

#[test]
fn syntax_errors_name_the_line() {
    let file = TempToml::new("[relay]\nbatch_rows = 5\nbatch_bytes = = 3\n");
    let errors = load_err(&options(Some(file.path()), &[], &[]));
    assert!(
        errors.problems.iter().any(|p| p.source == file.at(3)),
        "{errors}"
    );
}

#[test]
fn missing_explicit_file_is_a_problem() {
    let path = std::env::temp_dir().join(format!(
        "outpost-config-test-{}-does-not-exist.toml",
        std::process::id()
    ));
    let errors = load_err(&options(Some(&path), &[], &[]));
    assert_eq!(errors.problems.len(), 1, "{errors}");
    assert_eq!(errors.problems[0].source, "flag --config");
    assert!(
        errors.problems[0].message.contains("does-not-exist"),
        "{errors}"
    );
}

#[test]
fn unknown_environment_variable_is_reported_by_name() {
    let errors = load_err(&options(
        None,
        &[
            ("OUTPOST_RELAY__BATCH_ROW", "5"),
            ("OUTPOST_TYPO", "x"),
            ("UNRELATED_VARIABLE", "ignored"),
        ],
        &[],
    ));
    let p = problem(&errors, "relay.batch_row");
    assert_eq!(p.source, "environment variable OUTPOST_RELAY__BATCH_ROW");
    assert!(
        p.message.contains("OUTPOST_RELAY__BATCH_ROWS"),
        "{}",
        p.message
    );
    assert_eq!(
        problem(&errors, "typo").source,
        "environment variable OUTPOST_TYPO"
    );
    assert_eq!(errors.problems.len(), 2, "{errors}");
}

#[test]
fn environment_overrides_file_and_flags_override_environment() {
    let file =
        TempToml::new("[relay]\nbatch_rows = 100\nworkers = 2\n\n[node]\nid = \"from-file\"\n");
    let env = [
        ("OUTPOST_RELAY__BATCH_ROWS", "200"),
        ("OUTPOST_RELAY__WORKERS", "3"),
        ("OUTPOST_NODE__ID", "from-env"),
    ];

    let config = load(&options(Some(file.path()), &env[..1], &[])).expect("loads");
    assert_eq!(config.relay.batch_rows, 200);
    assert_eq!(config.relay.workers, 2);
    assert_eq!(config.node.id, "from-file");

    let flags = [("relay.batch_rows", "300"), ("node.id", "from-flag")];
    let config = load(&options(Some(file.path()), &env, &flags)).expect("loads");
    assert_eq!(config.relay.batch_rows, 300);
    assert_eq!(config.relay.workers, 3);
    assert_eq!(config.node.id, "from-flag");

    // Without the environment layer, the file value stays.
    let opts = LoadOptions {
        env: false,
        ..options(Some(file.path()), &env, &[])
    };
    assert_eq!(load(&opts).expect("loads").relay.batch_rows, 100);
}

#[test]
fn environment_values_are_typed_by_their_key() {
    let config = load(&options(
        None,
        &[
            ("OUTPOST_NODE__ID", "123"),
            ("OUTPOST_RELAY__DELETE_PUBLISHED", "true"),
            ("OUTPOST_RETENTION__REPUBLISH_WINDOW_SECS", "0"),
            ("OUTPOST_ROUTING__NO_DESTINATION", "AuditTrail, Heartbeat"),
            (
                "OUTPOST_ROUTING__OVERRIDES__OrderPlaced",
                "orders:{partition}",
            ),
            ("OUTPOST_ROUTING__STREAM", "e:{event_type}"),
        ],
        &[],
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.node.id, "123");
    assert!(config.relay.delete_published);
    assert_eq!(config.routing.no_destination, ["AuditTrail", "Heartbeat"]);
    assert_eq!(
        config.routing.template_for("OrderPlaced"),
        Some("orders:{partition}")
    );
    assert_eq!(config.routing.template_for("Other"), Some("e:{event_type}"));
}

#[test]
fn bad_environment_value_names_the_variable() {
    let errors = load_err(&options(
        None,
        &[
            ("OUTPOST_RELAY__BATCH_ROWS", "lots"),
            ("OUTPOST_DATABASE__POOL_SIZE", "0"),
        ],
        &[],
    ));
    let p = problem(&errors, "relay.batch_rows");
    assert_eq!(p.source, "environment variable OUTPOST_RELAY__BATCH_ROWS");
    assert!(p.message.contains("\"lots\""), "{}", p.message);
    assert!(
        p.message.contains("OUTPOST_RELAY__BATCH_ROWS="),
        "{}",
        p.message
    );
    let p = problem(&errors, "database.pool_size");
    assert_eq!(p.source, "environment variable OUTPOST_DATABASE__POOL_SIZE");
    assert_eq!(errors.problems.len(), 2, "{errors}");
}

#[test]
fn bad_flag_value_names_the_flag() {
    let errors = load_err(&options(
        None,
        &[],
        &[("relay.workers", "65"), ("relay.nope", "1")],
    ));
    assert_eq!(
        problem(&errors, "relay.workers").source,
        "flag --set relay.workers"
    );
    assert_eq!(
        problem(&errors, "relay.nope").source,
        "flag --set relay.nope"
    );
}

const PASSWORD: &str = "s3cr3t-Pa55";

fn assert_hidden(errors: &ConfigErrors) {
    for p in &errors.problems {
        assert!(!p.message.contains(PASSWORD), "secret in message: {p:?}");
        assert!(!p.source.contains(PASSWORD), "secret in source: {p:?}");
    }
    assert!(!errors.to_string().contains(PASSWORD));
    assert!(!format!("{errors:?}").contains(PASSWORD));
}

#[test]
fn database_password_never_appears_in_output() {
    let url = format!("postgres://app:{PASSWORD}@db.internal:5432/outpost");
    let file = TempToml::new(&format!(
        "[database]\nurl = \"{url}\"\n\n[redis]\nurl = \"rediss://:{PASSWORD}@cache:6380\"\n"
    ));
    let config = load(&options(Some(file.path()), &[], &[])).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.database.url().expect("set").expose(), url);

    let redacted = config.to_redacted_toml();
    assert!(!redacted.contains(PASSWORD), "{redacted}");
    assert!(
        redacted.contains("postgres://app:***@db.internal:5432/outpost"),
        "{redacted}"
    );
    assert!(redacted.contains("rediss://:***@cache:6380"), "{redacted}");
    let debug = format!("{config:?}");
    assert!(!debug.contains(PASSWORD), "{debug}");
    assert!(debug.contains("***"), "{debug}");
    assert!(
        !format!(
            "{:?}",
            options(
                None,
                &[("OUTPOST_DATABASE__URL", &url)],
                &[("database.url", &url)]
            )
        )
        .contains(PASSWORD)
    );

    // Every key is in the redacted TOML: it reads back as the same configuration,
    // apart from the redacted passwords.
    let mut back: Config = toml::from_str(&redacted).unwrap_or_else(|e| panic!("{e}\n{redacted}"));
    back.database.url = config.database.url.clone();
    back.redis.url = config.redis.url.clone();
    assert_eq!(back, config);

    // Wrong scheme: reported without the value.
    let errors = load_err(&options(
        None,
        &[(
            "OUTPOST_DATABASE__URL",
            &format!("mysql://app:{PASSWORD}@db/x"),
        )],
        &[],
    ));
    assert_eq!(
        problem(&errors, "database.url").source,
        "environment variable OUTPOST_DATABASE__URL"
    );
    assert_hidden(&errors);

    // Not a URL at all.
    let errors = load_err(&options(None, &[], &[("database.url", PASSWORD)]));
    assert_eq!(
        problem(&errors, "database.url").source,
        "flag --set database.url"
    );
    assert_hidden(&errors);

    // Type errors on the secret key do not echo the value.
    let file = TempToml::new(&format!("[database]\nurl = [\"{url}\"]\n"));
    let errors = load_err(&options(Some(file.path()), &[], &[]));
    assert_eq!(problem(&errors, "database.url").source, file.at(2));
    assert_hidden(&errors);
    let file = TempToml::new("[database]\nurl = 987654321\n");
    let errors = load_err(&options(Some(file.path()), &[], &[]));
    assert!(!errors.to_string().contains("987654321"), "{errors}");

    // A misspelt key holding the URL is reported without its value.
    let errors = load_err(&options(None, &[("OUTPOST_DATABASE__URI", &url)], &[]));
    assert_eq!(
        problem(&errors, "database.uri").source,
        "environment variable OUTPOST_DATABASE__URI"
    );
    assert_hidden(&errors);
}

#[test]
fn redacted_toml_shows_unset_urls_and_every_key() {
    let text = Config::default().to_redacted_toml();
    assert!(text.contains("# url is not set"), "{text}");
    for key in [
        "pool_size",
        "key_prefix",
        "lease_ms",
        "listen",
        "max_payload_bytes",
        "batch_rows",
        "overrides",
        "no_destination",
        "burst",
        "format",
    ] {
        assert!(text.contains(key), "{key} missing:\n{text}");
    }
    let back: Config = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(back, Config::default());
}

#[test]
fn unknown_template_placeholder_is_a_problem() {
    let file = TempToml::new(
        r#"[routing]
stream = "events:{tenant}"

[routing.overrides]
OrderPlaced = "orders:{partition}"
Audit = "none"
Refund = "refunds:{region}"
"#,
    );
    let errors = load_err(&options(Some(file.path()), &[], &[]));
    let p = problem(&errors, "routing.stream");
    assert_eq!(p.source, file.at(2));
    assert!(p.message.contains("{tenant}"), "{}", p.message);
    let p = problem(&errors, "routing.overrides.Refund");
    assert_eq!(p.source, file.at(7));
    assert!(p.message.contains("{region}"), "{}", p.message);
    assert_eq!(errors.problems.len(), 2, "{errors}");
}

#[test]
fn lease_shorter_than_three_heartbeats_is_a_problem() {
    let file = TempToml::new("[node]\nheartbeat_ms = 5000\n");
    let errors = load_err(&options(Some(file.path()), &[], &[]));
    let p = problem(&errors, "node.lease_ms");
    // lease_ms kept its default; the message says where heartbeat_ms came from.
    assert_eq!(p.source, "default");
    assert!(p.message.contains("15000"), "{}", p.message);
    assert!(p.message.contains(&file.at(2)), "{}", p.message);

    let errors = load_err(&options(None, &[], &[("node.lease_ms", "2000")]));
    assert_eq!(
        problem(&errors, "node.lease_ms").source,
        "flag --set node.lease_ms"
    );
}

#[test]
fn other_checks() {
    let errors = load_err(&options(
        None,
        &[],
        &[
            ("relay.backoff_base_ms", "1000"),
            ("relay.backoff_max_ms", "999"),
            ("admin.listen", "localhost:9400"),
            ("log.format", "xml"),
            ("log.level", "info,,=bad["),
            ("node.id", "has space"),
            ("redis.key_prefix", "a\nb"),
        ],
    ));
    for key in [
        "relay.backoff_max_ms",
        "admin.listen",
        "log.format",
        "log.level",
        "node.id",
        "redis.key_prefix",
    ] {
        let p = problem(&errors, key);
        assert_eq!(p.source, format!("flag --set {key}"));
    }
    assert_eq!(errors.to_string().lines().count(), errors.problems.len());
}

#[test]
fn stream_rate_limits_come_from_a_table_and_bad_entries_say_how_to_fix_them() {
    let file = TempToml::new(
        r#"[rate_limit]
per_stream_per_sec = 500

[rate_limit.streams]
"events:audit" = 100
"events:bulk" = 0
"#,
    );
    let config = load(&options(
        Some(file.path()),
        &[("OUTPOST_RATE_LIMIT__STREAMS__orders", "7")],
        &[("rate_limit.streams.payments", "20")],
    ))
    .expect("a valid configuration");
    let streams: Vec<(&str, u32)> = config
        .rate_limit
        .streams
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(
        streams,
        vec![
            ("events:audit", 100),
            ("events:bulk", 0),
            ("orders", 7),
            ("payments", 20)
        ]
    );

    let file = TempToml::new("[rate_limit.streams]\n\"events:audit\" = \"fast\"\n");
    let errors = load_err(&options(
        Some(file.path()),
        &[],
        &[("rate_limit.streams.orders", "-3")],
    ));
    let p = problem(&errors, "rate_limit.streams.events:audit");
    assert!(
        p.message.contains("whole number") && p.message.contains("[rate_limit.streams]"),
        "{}",
        p.message
    );
    let p = problem(&errors, "rate_limit.streams.orders");
    assert!(
        p.message.contains("--set rate_limit.streams."),
        "{}",
        p.message
    );
}
