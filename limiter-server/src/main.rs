//! `limiter-server`: run the server, or check a policy file (see [`limiter_server::cli`]).

fn main() -> std::process::ExitCode {
    limiter_server::cli::main()
}
