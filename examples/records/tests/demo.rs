//! A short `outpost-records demo` (the scenario `outpost demo` runs) reaches the verdict PASS,
//! and the verdict catches a mutation that skipped its event.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::{Command, Output, Stdio};

const PASS: &str = "verdict: PASS (0 lost, 0 duplicates, 0 out of order, 0 events for \
                    undeclared changes, 0 declared changes without an event, read model equals \
                    the source)";

/// Runs a demo of `seconds` on a database and key prefix of its own, with `env` added.
fn demo(seconds: u64, env: &[(&str, &str)]) -> (Output, String) {
    demo_with_redis(seconds, env, &support::redis_url())
}

/// [`demo`] with `redis.url` set to `redis`.
fn demo_with_redis(seconds: u64, env: &[(&str, &str)], redis: &str) -> (Output, String) {
    let id = support::unique();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outpost-records"));
    cmd.args(["--set", &format!("database.url={}", support::server_url())])
        .args(["--set", &format!("redis.url={redis}")])
        .args(["demo", "--duration", &seconds.to_string(), "--writers", "3"])
        .args(["--nodes", "2", "--drop", "--drain-timeout", "60"])
        .args(["--database", &format!("records_demo_{id}")])
        .args(["--key-prefix", &format!("t:demo:{id}:")])
        // Away from the repository's config/outpost.toml: only the settings above apply.
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTPOST_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run outpost-records demo");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    (out, stdout)
}

#[test]
fn a_short_demo_passes_its_verdict() {
    let (out, stdout) = demo(8, &[]);
    assert!(stdout.contains(PASS), "no passing verdict in the output");
    assert!(out.status.success(), "exit status {:?}", out.status);
    // It did write: committed events, and undeclared-only updates that emitted nothing.
    let committed = count_after(&stdout, "event facts committed");
    let undeclared = count_after(&stdout, "undeclared changes only");
    assert!(
        committed > 0 && undeclared > 0,
        "{committed} events, {undeclared} undeclared"
    );
}

/// One mutation, the 40th, skips its event (as a broken application would): the verdict fails
/// and names it.
#[cfg(feature = "failpoints")]
#[test]
fn the_verdict_fails_when_a_mutation_skips_its_event() {
    let (out, stdout) = demo(
        5,
        &[("FAILPOINTS", "records-skip-event=39*off->1*return->off")],
    );
    assert!(!stdout.contains(PASS), "a skipped event went unnoticed");
    assert!(
        stdout.contains("verdict: FAIL") && stdout.contains("1 declared changes without an event"),
        "the verdict does not name the skipped event"
    );
    assert!(!out.status.success());
}

/// With no Redis where `redis.url` points and `redis-server` on the `PATH`, the demo runs on a
/// private server of its own and stops it at the end.
#[test]
fn without_redis_the_demo_starts_a_private_one() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (out, stdout) = demo_with_redis(4, &[], &format!("redis://127.0.0.1:{port}"));
    assert!(
        stdout.contains("a private redis-server on 127.0.0.1:"),
        "no private Redis"
    );
    assert!(stdout.contains(PASS), "no passing verdict in the output");
    assert!(out.status.success());
    let private: u16 = stdout
        .split("a private redis-server on 127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .expect("the private server's port");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", private)).is_err(),
        "the private redis-server still runs"
    );
}

fn count_after(stdout: &str, label: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no line {label:?}"));
    line.trim_start()[label.len()..]
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {line:?}"))
}
