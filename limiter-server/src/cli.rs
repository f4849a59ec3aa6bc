//! The command line of `limiter-server`: run the server, or check a policy file.
//!
//! ```text
//! limiter-server [--config FILE] [--policy FILE]   serve (config: YAML + LIMITER__* env)
//! limiter-server check-config POLICY_FILE          validate a policy file and exit
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use crate::config::{EXIT_BAD_CONFIG, ServerConfig};
use crate::owner::reload::read_policy;
use crate::{Listeners, Server};

const USAGE: &str = "usage:
  limiter-server [--config FILE] [--policy FILE]
      Serve. The configuration is YAML (optional) plus LIMITER__* environment
      variables (LIMITER__LISTEN, LIMITER__ADMIN_LISTEN, LIMITER__POLICY_FILE, ...);
      --policy sets the policy file.
  limiter-server check-config POLICY_FILE
      Validate a policy file, print every mistake, exit 0 if valid, 64 if not.";

fn bad_config(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("{msg}");
    ExitCode::from(EXIT_BAD_CONFIG as u8)
}

/// Runs the command line in `std::env::args`; returns the process's exit status.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("check-config") => match args.get(1) {
            Some(file) if args.len() == 2 => check_config(file),
            _ => bad_config(USAGE),
        },
        Some("-h" | "--help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => serve(&args),
    }
}

fn check_config(file: &str) -> ExitCode {
    crate::trace::init_logs();
    // The same size limit as the server's (its setting, from the environment).
    let max = std::env::var("LIMITER__LIMITS__MAX_POLICY_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(crate::owner::reload::DEFAULT_MAX_POLICY_BYTES);
    match read_policy(&PathBuf::from(file), max) {
        Ok((p, _)) => {
            println!(
                "{file}: ok ({} routes, {} tenants{})",
                p.routes.len(),
                p.tenants.len(),
                if p.default_tenant.is_some() { ", a default tenant" } else { "" }
            );
            ExitCode::SUCCESS
        }
        Err(e) => bad_config(e),
    }
}

fn serve(args: &[String]) -> ExitCode {
    let mut config_file = None;
    let mut policy = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.next()) {
            ("--config", Some(v)) => config_file = Some(PathBuf::from(v)),
            ("--policy", Some(v)) => policy = Some(v.clone()),
            _ => return bad_config(format!("unexpected argument `{a}`\n{USAGE}")),
        }
    }
    let mut env: Vec<(String, String)> = std::env::vars().collect();
    if let Some(p) = policy {
        env.push(("LIMITER__POLICY_FILE".to_owned(), p));
    }
    // Everything is validated before any socket is bound.
    let config = match ServerConfig::load_with_env(config_file.as_deref(), env) {
        Ok(c) => c,
        Err(e) => return bad_config(e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Stores start their connection tasks as they are built (Redis): inside the runtime.
    // Logs and traces before anything logs; the exporter's client runs on the runtime.
    let entered = runtime.enter();
    let traces = match crate::trace::init(&config.tracing, &config.cluster.node_id) {
        Ok(g) => g,
        Err(e) => return bad_config(e),
    };
    let server = match Server::new(config.clone()) {
        Ok(s) => s,
        Err(e) => return bad_config(e),
    };
    drop(entered);
    let code = runtime.block_on(async move {
        let bind = |addr| async move { tokio::net::TcpListener::bind(addr).await };
        let listeners = match (bind(config.listen).await, bind(config.admin_listen).await) {
            (Ok(grpc), Ok(admin)) => Listeners { grpc, admin },
            (Err(e), _) => return fail(&format!("cannot listen on {}: {e}", config.listen)),
            (_, Err(e)) => return fail(&format!("cannot listen on {}: {e}", config.admin_listen)),
        };
        match server.run(listeners, shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&e.to_string()),
        }
    });
    // Spans still queued are sent while the runtime (the exporter's client) lives.
    {
        let _runtime = runtime.enter();
        drop(traces);
    }
    code
}

fn fail(msg: &str) -> ExitCode {
    tracing::error!("{msg}");
    ExitCode::FAILURE
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
