//! `limiter-server`'s command line, as a binary of this package for its tests.

fn main() -> std::process::ExitCode {
    limiter_server::cli::main()
}
