//! The `outpost` binary as an operator meets it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

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
