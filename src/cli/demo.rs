//! `outpost demo`: the records scenario end to end, verified. The scenario is an application of
//! its own (`examples/records`, the `outpost-records` binary), which depends on this crate; this
//! command runs that binary's `demo` in place of this process, with the same `--config` and
//! `--set` options, so Ctrl-C and the exit status reach it directly.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::Cli;

/// The binary that holds the scenario.
pub const RECORDS_BIN: &str = "outpost-records";

/// Options of `outpost demo`, handed to `outpost-records demo` as they are (`outpost demo
/// --help` lists them).
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// `--duration`, `--nodes`, `--writers`, `--rate`, `--database`, `--key-prefix`, `--drop`, …
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "OPTIONS"
    )]
    pub args: Vec<String>,
}

/// Where `outpost-records` is: next to this binary (`cargo build --workspace` puts both in
/// `target/<profile>/`; the container image has both in one directory).
fn records_binary() -> Option<PathBuf> {
    let me = std::env::current_exe().ok()?;
    let candidate = me.with_file_name(RECORDS_BIN);
    candidate.is_file().then_some(candidate)
}

/// Replaces this process with `outpost-records demo …`; returns only when that fails.
pub(super) fn run(cli: &Cli, args: &DemoArgs) -> ExitCode {
    let Some(bin) = records_binary() else {
        eprintln!(
            "outpost: the demo is the records application's `{RECORDS_BIN}` binary, which is \
             not next to this one: build both with `cargo build --release --workspace` (or run \
             it directly: `cargo run --release -p outpost-records -- demo`)"
        );
        return ExitCode::FAILURE;
    };
    let mut cmd = std::process::Command::new(&bin);
    if let Some(file) = &cli.config {
        cmd.arg("--config").arg(file);
    }
    for item in &cli.set {
        cmd.arg("--set").arg(item);
    }
    cmd.arg("demo").args(&args.args);
    let err = cmd.exec();
    eprintln!("outpost: cannot run {}: {err}", bin.display());
    ExitCode::FAILURE
}
