//! A server's services over a fixed policy, built once per fuzzing process, and a
//! runtime to call them on.

use std::sync::{Arc, OnceLock};

use limiter_server::Server;
use limiter_server::api::envoy::EnvoyService;
use limiter_server::api::native::NativeService;
use limiter_server::config::ServerConfig;

/// Every algorithm, every level, shadow mode, fail-open and leases.
pub const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100000/s, burst: 100000 }
unknown_tenants: use_default
lease: { mode: leased, ttl: 1s, max_batch: 50 }
routes:
  /a:
    cost: 2
    limit: { algorithm: sliding_counter, limit: 1000, window: 1s }
    on_limiter_failure: { mode: fail_open, emergency_ceiling: 10/s }
  /b:
    shadow: true
    lease: { mode: exact }
tenants:
  t:
    limit: { algorithm: token_bucket, rate: 100/s, burst: 200 }
    routes:
      /a: { algorithm: fixed_window, limit: 50, window: 1s }
    per_key: { algorithm: sliding_log, limit: 20, window: 10s }
  default:
    limit: { algorithm: sliding_log, limit: 100, window: 10s }
";

#[allow(dead_code)] // each target uses some of them
pub struct Services {
    pub native: NativeService,
    pub envoy: EnvoyService,
    pub runtime: tokio::runtime::Runtime,
}

pub fn services() -> &'static Services {
    static S: OnceLock<Services> = OnceLock::new();
    S.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("limiter-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("policies.yaml");
        std::fs::write(&file, POLICY).unwrap();
        let env = [("LIMITER__POLICY_FILE".to_owned(), file.display().to_string())];
        let config = ServerConfig::load_with_env(None, env).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let server = {
            let _rt = runtime.enter();
            Server::new(config.clone()).unwrap()
        };
        let owner: Arc<_> = server.owner().clone();
        Services {
            native: NativeService::new(owner.clone()),
            envoy: EnvoyService::new(owner, config.envoy.clone()),
            runtime,
        }
    })
}
