//! What the server benches share: a policy of four levels (global ceiling, route,
//! tenant, tenant x route) and a per-key limit, all far above the load, so every
//! decision walks its whole chain and is admitted.

pub(crate) const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100000000/s, burst: 100000000 }
routes:
  /search:
    limit: { algorithm: sliding_counter, limit: 100000000, window: 1s }
tenants:
  acme:
    limit: { algorithm: token_bucket, rate: 100000000/s, burst: 100000000 }
    routes:
      /search: { algorithm: fixed_window, limit: 100000000, window: 1s }
    per_key: { algorithm: token_bucket, rate: 1000000/s, burst: 1000000 }
";
