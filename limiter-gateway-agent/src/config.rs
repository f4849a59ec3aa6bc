//! The agent's configuration.

use std::collections::HashMap;
use std::time::Duration;

use limiter_core::policy::FailurePolicy;
use limiter_proto::connect::ClientSecurity;

/// How an agent reaches its owner and behaves when it cannot.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The owner's gRPC endpoint, like `http://127.0.0.1:50051`.
    pub owner: String,
    /// This agent's id, stable for its life (leases are settled only by their holder).
    pub agent_id: String,
    /// Deadline of one call to the owner.
    pub rpc_timeout: Duration,
    /// The renewal period: the background task runs a round every half of it
    /// (jittered by ±10%), grants are sized to it, and a rationed key is renewed at
    /// least this often while used.
    pub renew_interval: Duration,
    /// A lease is given up this fraction of its hold early (on top of counting from
    /// when the request was sent), so the agent always stops before the owner. It
    /// also covers the agent's clock running slow: its counter is trusted only
    /// within [`crate::COUNTER_TOLERANCE_PPM`] (0.1%) of the OS clock, so keep the
    /// margin above that.
    pub deadline_margin: f64,
    /// Consecutive failed calls that open the circuit breaker.
    pub breaker_threshold: u32,
    /// While open, one call is tried this often to see if the owner is back.
    pub probe_interval: Duration,
    /// A key unused this long gives its balance back.
    pub idle_after: Duration,
    /// Failure policy of routes the owner has not described yet (by route name).
    pub routes: HashMap<String, FailurePolicy>,
    /// Failure policy of any other route.
    pub default_failure: FailurePolicy,
    /// Learn the ring from the owner endpoint's topology call and send each key's
    /// lease calls straight to its tenant's owner (off: every call goes to `owner`,
    /// which forwards what it does not own).
    pub route_by_ring: bool,
    /// How often the ring is read again (also at once after a redirect).
    pub topology_interval: Duration,
    /// TLS and token of calls to owners (default: plaintext, no token). With TLS,
    /// `host:port` addresses are dialled as `https://`.
    pub security: ClientSecurity,
    /// The longest an owner's refusal answers a key's like requests here (never past
    /// the wait the owner gave, never more than an eighth of the lease's TTL): one
    /// renewal interval by default (250 ms). A key refused while leasing is asked
    /// for again in the renewer's next round, so units other agents give back are
    /// found within it. Zero: every refusal is the owner's.
    pub refusal_cap: Duration,
    /// Hold the permits of concurrency levels here, in blocks the owner issues (on by
    /// default): a request takes and returns its permit locally, and the blocks are
    /// renewed, grown and given back in the background. Off: every request of such a
    /// chain asks the owner, and its permit is released there.
    pub local_permits: bool,
    /// The most permits one block asks for (blocks grow by doubling up to this; a
    /// block a pool does not need goes back at its next renewal).
    pub max_permit_block: u32,
    /// The most items one lease call carries: the owner's `limits.max_batch` (100 by
    /// default; a call above it is refused whole). A round with more keys due sends
    /// them in several calls at once.
    pub max_items: usize,
}

impl AgentConfig {
    /// Defaults for an owner endpoint and an agent id.
    pub fn new(owner: impl Into<String>, agent_id: impl Into<String>) -> Self {
        Self {
            owner: owner.into(),
            agent_id: agent_id.into(),
            rpc_timeout: Duration::from_millis(250),
            renew_interval: Duration::from_millis(250),
            deadline_margin: 0.005,
            breaker_threshold: 2,
            probe_interval: Duration::from_millis(250),
            idle_after: Duration::from_secs(2),
            routes: HashMap::new(),
            default_failure: FailurePolicy::FailClosed,
            route_by_ring: false,
            topology_interval: Duration::from_secs(5),
            security: ClientSecurity::plaintext(),
            refusal_cap: Duration::from_millis(250),
            local_permits: true,
            max_permit_block: 8,
            max_items: 100,
        }
    }

    /// Calling owners with `security` (TLS, a client certificate, a token).
    pub fn with_security(mut self, security: ClientSecurity) -> Self {
        self.security = security;
        self
    }

    /// Sending lease calls straight to each tenant's owner, by the ring.
    pub fn with_ring_routing(mut self) -> Self {
        self.route_by_ring = true;
        self
    }

    /// With a route's local failure policy.
    pub fn with_route(mut self, route: impl Into<String>, policy: FailurePolicy) -> Self {
        self.routes.insert(route.into(), policy);
        self
    }

    /// With the RPC timeout.
    pub fn with_rpc_timeout(mut self, t: Duration) -> Self {
        self.rpc_timeout = t;
        self
    }

    /// With the renewal interval.
    pub fn with_renew_interval(mut self, t: Duration) -> Self {
        self.renew_interval = t;
        self
    }

    /// With permits of concurrency levels held in local pools (`true`, the default)
    /// or asked of the owner per request (`false`).
    pub fn with_local_permits(mut self, on: bool) -> Self {
        self.local_permits = on;
        self
    }

    /// With the longest an owner's refusal is kept (see [`Self::refusal_cap`]).
    pub fn with_refusal_cap(mut self, t: Duration) -> Self {
        self.refusal_cap = t;
        self
    }
}
