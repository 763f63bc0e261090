//! The `outpost-records` binary.

fn main() -> std::process::ExitCode {
    outpost_records::cli::main()
}
