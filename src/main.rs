//! The `outpost` binary.

fn main() -> std::process::ExitCode {
    outpost::cli::main()
}
