//! Scenarios: what a run offers, read from YAML and validated before anything starts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde::Deserialize;

/// Which API the simulated gateways call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetKind {
    /// `limiter.v1.RateLimiter/ShouldAllow`, one call per request.
    Native,
    /// Envoy's `ShouldRateLimit`: domain = tenant, entries `route` and `user` (the key).
    Envoy,
    /// The embedded agent: decisions in-process from leased tokens.
    Agent,
    /// The empty RPC on the same server: the transport floor.
    Ping,
}

impl TargetKind {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Envoy => "envoy",
            Self::Agent => "agent",
            Self::Ping => "ping",
        }
    }
}

/// How arrivals are spaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Arrivals {
    /// Exponential gaps (a Poisson process).
    #[default]
    Poisson,
    /// Equal gaps.
    Fixed,
}

/// How requests spread over tenants.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Skew {
    /// Every tenant alike.
    #[default]
    Uniform,
    /// Zipf with exponent `zipf_s`.
    Zipf,
    /// The first tenant takes `hot_share` of the requests, the others share the rest.
    Hot,
}

/// The store of the servers a scenario starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Store {
    /// The embedded memory store.
    #[default]
    Memory,
    /// A `redis-server` the run starts on a free port.
    Redis,
}

/// A time in a scenario: `250ms`, `2s`, `1m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span(pub Duration);

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        limiter_core::rate::parse_duration(&s)
            .map(|n| Span(Duration::from_nanos(n)))
            .map_err(serde::de::Error::custom)
    }
}

/// Tenants and their skew.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenants {
    /// Explicit names; when empty, `count` names `{prefix}{i}`.
    #[serde(default)]
    pub names: Vec<String>,
    /// How many generated names.
    #[serde(default = "default_count")]
    pub count: usize,
    /// Prefix of generated names.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Spread of requests over tenants.
    #[serde(default)]
    pub skew: Skew,
    /// Zipf exponent.
    #[serde(default = "default_zipf")]
    pub zipf_s: f64,
    /// The hot tenant's share.
    #[serde(default = "default_hot")]
    pub hot_share: f64,
    /// Distinct keys per tenant (0: requests carry no key).
    #[serde(default)]
    pub keys: usize,
}

fn default_count() -> usize {
    10
}
fn default_prefix() -> String {
    "tenant-".to_owned()
}
fn default_zipf() -> f64 {
    1.1
}
fn default_hot() -> f64 {
    0.5
}

impl Tenants {
    /// The tenants' names.
    pub fn list(&self) -> Vec<String> {
        if self.names.is_empty() {
            (0..self.count).map(|i| format!("{}{i}", self.prefix)).collect()
        } else {
            self.names.clone()
        }
    }
}

/// A route requests are sent to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteLoad {
    /// Its name.
    pub name: String,
    /// Its share of requests, relative to the other routes.
    #[serde(default = "one")]
    pub weight: u32,
    /// Units per request.
    #[serde(default = "one_u64")]
    pub cost: u64,
}

fn one() -> u32 {
    1
}
fn one_u64() -> u64 {
    1
}

/// One part of the offered load over time.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    /// Requests per second, over all gateways, for `for`.
    #[serde(default)]
    pub rate: f64,
    /// How long.
    #[serde(default, rename = "for")]
    pub length: Span,
    /// Instead of a rate: this many requests at once (spread over gateways).
    #[serde(default)]
    pub burst: u64,
}

/// What a fault does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL to a server node (`node0`, ...) or a gateway process (`gateway3`).
    Kill(String),
    /// Start a killed server node again on its addresses.
    Restart(String),
    /// Cut a gateway off from the servers for a while (its connections are dropped
    /// and new ones refused).
    Cut(String, Duration),
    /// Stop `redis-server` (SIGSTOP) for a while, then let it go on (SIGCONT).
    StopRedis(Duration),
}

/// A fault at a time of the run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFault {
    /// When, from the start.
    pub at: Span,
    /// `kill: node1` or `kill: gateway3`.
    #[serde(default)]
    pub kill: Option<String>,
    /// `restart: node1`.
    #[serde(default)]
    pub restart: Option<String>,
    /// `cut: gateway2` with `for`.
    #[serde(default)]
    pub cut: Option<String>,
    /// `stop_redis: 2s`.
    #[serde(default)]
    pub stop_redis: Option<Span>,
    /// How long a cut lasts.
    #[serde(default, rename = "for")]
    pub length: Option<Span>,
}

/// A validated fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// When, from the start.
    pub at: Duration,
    /// What.
    pub action: Action,
}

impl Fault {
    /// A short description for reports.
    pub fn describe(&self) -> String {
        let at = self.at.as_secs_f64();
        match &self.action {
            Action::Kill(t) => format!("{at:.1} s: kill {t}"),
            Action::Restart(t) => format!("{at:.1} s: restart {t}"),
            Action::Cut(t, d) => format!("{at:.1} s: cut {t} off for {:.1} s", d.as_secs_f64()),
            Action::StopRedis(d) => format!("{at:.1} s: stop Redis for {:.1} s", d.as_secs_f64()),
        }
    }

    /// The interval it disturbs, from `at` to its end (kills: to the end of the run).
    pub fn window(&self, run: Duration) -> (Duration, Duration) {
        match &self.action {
            Action::Cut(_, d) | Action::StopRedis(d) => (self.at, self.at + *d),
            Action::Kill(_) | Action::Restart(_) => (self.at, run),
        }
    }
}

/// The servers a scenario starts itself.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnServers {
    /// How many nodes (static membership when more than one).
    #[serde(default = "one_usize")]
    pub nodes: usize,
    /// Their store.
    #[serde(default)]
    pub store: Store,
}

fn one_usize() -> usize {
    1
}

/// The raw YAML form.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    name: String,
    target: TargetKind,
    policy: PathBuf,
    #[serde(default)]
    servers: Option<OwnServers>,
    #[serde(default)]
    address: Option<String>,
    #[serde(default)]
    admin: Option<String>,
    #[serde(default = "one_usize")]
    gateways: usize,
    #[serde(default)]
    gateway_processes: bool,
    #[serde(default)]
    arrivals: Arrivals,
    #[serde(default = "default_seed")]
    seed: u64,
    tenants: Tenants,
    routes: Vec<RouteLoad>,
    phases: Vec<Phase>,
    #[serde(default = "default_in_flight")]
    max_in_flight: usize,
    #[serde(default = "default_timeout")]
    timeout: Span,
    #[serde(default = "default_late")]
    late_after: Span,
    #[serde(default)]
    faults: Vec<RawFault>,
    #[serde(default)]
    chaos: Option<RawChaos>,
    #[serde(default)]
    settle: Span,
}

/// What chaos may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChaosKind {
    /// SIGKILL a node, restart it after the outage.
    KillNode,
    /// Cut a gateway off for the outage.
    CutGateway,
    /// Stop Redis for the outage.
    StopRedis,
}

/// Random faults, drawn from a seed when the scenario is read.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChaos {
    #[serde(default = "default_seed")]
    seed: u64,
    faults: usize,
    kinds: Vec<ChaosKind>,
    /// Longest outage.
    outage: Span,
    /// No fault starts before.
    from: Span,
    /// Every fault is over by.
    until: Span,
}

fn default_seed() -> u64 {
    1
}
fn default_in_flight() -> usize {
    256
}
fn default_timeout() -> Span {
    Span(Duration::from_secs(1))
}
fn default_late() -> Span {
    Span(Duration::from_millis(5))
}

/// Where the servers are.
#[derive(Debug, Clone)]
pub enum Servers {
    /// The run starts them.
    Own(OwnServers),
    /// Already running: gRPC URL and admin address (for `/metrics`).
    External {
        /// `http://host:port`.
        address: String,
        /// `host:port` of the admin listener, if known.
        admin: Option<String>,
    },
}

/// A validated scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Its name (file names of reports).
    pub name: String,
    /// The API called.
    pub target: TargetKind,
    /// The policy file: the exact model's policy, and the servers' when the run starts
    /// them.
    pub policy: PathBuf,
    /// The servers.
    pub servers: Servers,
    /// Simulated gateways (each its own connection, or agent).
    pub gateways: usize,
    /// Gateways as processes of their own (they can be killed).
    pub gateway_processes: bool,
    /// Arrival spacing.
    pub arrivals: Arrivals,
    /// Seed of every random choice.
    pub seed: u64,
    /// Tenants.
    pub tenants: Tenants,
    /// Routes.
    pub routes: Vec<RouteLoad>,
    /// The offered load over time.
    pub phases: Vec<Phase>,
    /// Requests in flight at most, per gateway; an arrival beyond is not sent.
    pub max_in_flight: usize,
    /// Deadline of one request.
    pub timeout: Duration,
    /// A request sent later than this after its arrival is a late send.
    pub late_after: Duration,
    /// Faults.
    pub faults: Vec<Fault>,
    /// The YAML it was read from (gateway processes read it again).
    pub source: String,
    /// Whether the faults were drawn at random (the run then checks its invariants).
    pub chaos: bool,
    /// How long the run waits after the load before its last look at the servers
    /// (leases of killed gateways end, returns settle).
    pub settle: Duration,
}

impl Scenario {
    /// Reads and validates `path`; relative paths inside are relative to its folder.
    ///
    /// # Errors
    ///
    /// When the file cannot be read, or is not a valid scenario: the message names
    /// the file, and the line and field where the YAML is wrong.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let mut s =
            Self::from_yaml(&text).map_err(|e| anyhow::anyhow!("{}: {e:#}", path.display()))?;
        if s.policy.is_relative() {
            let base = path.parent().unwrap_or(Path::new("."));
            s.policy = base.join(&s.policy);
        }
        Ok(s)
    }

    /// Parses and validates a scenario.
    ///
    /// # Errors
    ///
    /// Every problem found, one per line.
    pub fn from_yaml(text: &str) -> anyhow::Result<Self> {
        let raw: Raw = serde_saphyr::from_str(text)?;
        let mut errors = Vec::new();
        let servers = match (raw.servers, raw.address) {
            (Some(s), None) => {
                if s.nodes == 0 {
                    errors.push("servers.nodes: at least 1".to_owned());
                }
                Servers::Own(s)
            }
            (None, Some(address)) => Servers::External { address, admin: raw.admin },
            (None, None) => Servers::Own(OwnServers { nodes: 1, store: Store::Memory }),
            (Some(_), Some(_)) => {
                errors.push("servers and address: give one (start servers, or use one)".to_owned());
                Servers::Own(OwnServers { nodes: 1, store: Store::Memory })
            }
        };
        if raw.gateways == 0 {
            errors.push("gateways: at least 1".to_owned());
        }
        if raw.gateway_processes && raw.target != TargetKind::Agent {
            errors.push("gateway_processes: only with target agent".to_owned());
        }
        if raw.tenants.list().is_empty() {
            errors.push("tenants: at least one".to_owned());
        }
        if raw.tenants.skew == Skew::Zipf
            && raw.tenants.zipf_s.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        {
            errors.push("tenants.zipf_s: must be above 0".to_owned());
        }
        if raw.tenants.skew == Skew::Hot && !(0.0..=1.0).contains(&raw.tenants.hot_share) {
            errors.push("tenants.hot_share: must be within 0..1".to_owned());
        }
        if raw.routes.is_empty() {
            errors.push("routes: at least one".to_owned());
        }
        for (i, r) in raw.routes.iter().enumerate() {
            if r.weight == 0 || r.cost == 0 {
                errors.push(format!("routes[{i}]: weight and cost must be at least 1"));
            }
        }
        if raw.phases.is_empty() {
            errors.push("phases: at least one".to_owned());
        }
        for (i, p) in raw.phases.iter().enumerate() {
            let timed = p.rate > 0.0 && !p.length.0.is_zero();
            if timed == (p.burst > 0) {
                errors.push(format!("phases[{i}]: give `rate` with `for`, or `burst`"));
            }
        }
        if raw.max_in_flight == 0 {
            errors.push("max_in_flight: at least 1".to_owned());
        }
        let mut faults = Vec::new();
        for (i, f) in raw.faults.into_iter().enumerate() {
            let action = match (f.kill, f.restart, f.cut, f.stop_redis) {
                (Some(t), None, None, None) => Action::Kill(t),
                (None, Some(t), None, None) => Action::Restart(t),
                (None, None, Some(t), None) => match f.length {
                    Some(d) => Action::Cut(t, d.0),
                    None => {
                        errors.push(format!("faults[{i}]: a cut needs `for`"));
                        continue;
                    }
                },
                (None, None, None, Some(d)) => Action::StopRedis(d.0),
                _ => {
                    errors.push(format!(
                        "faults[{i}]: give exactly one of kill, restart, cut, stop_redis"
                    ));
                    continue;
                }
            };
            let own = matches!(servers, Servers::Own(_));
            if !own {
                errors.push(format!("faults[{i}]: faults need servers the run starts"));
            }
            match &action {
                Action::Kill(t) | Action::Restart(t) | Action::Cut(t, _) => {
                    if let Err(e) = target_of(t, &servers, raw.gateways, raw.gateway_processes) {
                        errors.push(format!("faults[{i}]: {e}"));
                    }
                }
                Action::StopRedis(_) => {
                    if !matches!(&servers, Servers::Own(s) if s.store == Store::Redis) {
                        errors.push(format!("faults[{i}]: stop_redis needs servers.store: redis"));
                    }
                }
            }
            if matches!(&action, Action::Restart(t) if !t.starts_with("node")) {
                errors.push(format!("faults[{i}]: only nodes restart"));
            }
            faults.push(Fault { at: f.at.0, action });
        }
        let chaos = raw.chaos.is_some();
        if let Some(c) = &raw.chaos {
            match draw_chaos(c, &servers, raw.gateways, raw.gateway_processes) {
                Ok(mut drawn) => faults.append(&mut drawn),
                Err(e) => errors.push(format!("chaos: {e}")),
            }
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("\n"));
        }
        faults.sort_by_key(|f| f.at);
        Ok(Self {
            name: raw.name,
            target: raw.target,
            policy: raw.policy,
            servers,
            gateways: raw.gateways,
            gateway_processes: raw.gateway_processes,
            arrivals: raw.arrivals,
            seed: raw.seed,
            tenants: raw.tenants,
            routes: raw.routes,
            phases: raw.phases,
            max_in_flight: raw.max_in_flight,
            timeout: raw.timeout.0,
            late_after: raw.late_after.0,
            faults,
            source: text.to_owned(),
            chaos,
            settle: raw.settle.0,
        })
    }

    /// The run's length: the phases' lengths added up.
    pub fn duration(&self) -> Duration {
        self.phases.iter().map(|p| p.length.0).sum()
    }

    /// The offered rate (requests per second, all gateways) at `t`.
    pub fn rate_at(&self, t: Duration) -> f64 {
        let mut start = Duration::ZERO;
        for p in &self.phases {
            if t < start + p.length.0 {
                return p.rate;
            }
            start += p.length.0;
        }
        0.0
    }
}

/// What a fault names: a node or a gateway, by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultTarget {
    /// Server node `i`.
    Node(usize),
    /// Gateway `i`.
    Gateway(usize),
}

/// Reads `node3` or `gateway1`.
///
/// # Errors
///
/// When the name is neither, or out of range.
pub fn target_of(
    name: &str,
    servers: &Servers,
    gateways: usize,
    processes: bool,
) -> Result<FaultTarget, String> {
    if let Some(i) = name.strip_prefix("node").and_then(|n| n.parse::<usize>().ok()) {
        let nodes = match servers {
            Servers::Own(s) => s.nodes,
            Servers::External { .. } => 0,
        };
        if i >= nodes {
            return Err(format!("`{name}`: there are {nodes} nodes (node0..)"));
        }
        return Ok(FaultTarget::Node(i));
    }
    if let Some(i) = name.strip_prefix("gateway").and_then(|n| n.parse::<usize>().ok()) {
        if i >= gateways {
            return Err(format!("`{name}`: there are {gateways} gateways (gateway0..)"));
        }
        if !processes {
            return Err(format!(
                "`{name}`: gateways are faulted only with gateway_processes: true"
            ));
        }
        return Ok(FaultTarget::Gateway(i));
    }
    Err(format!("`{name}`: expected node<i> or gateway<i>"))
}

/// Draws `c.faults` faults of the kinds allowed, each lasting between a third of the
/// outage and all of it, inside `[from, until]`; no resource (a node, a gateway,
/// Redis) has two at once, and a killed node is restarted when its outage ends.
fn draw_chaos(
    c: &RawChaos,
    servers: &Servers,
    gateways: usize,
    processes: bool,
) -> Result<Vec<Fault>, String> {
    let (nodes, redis) = match servers {
        Servers::Own(s) => (s.nodes, s.store == Store::Redis),
        Servers::External { .. } => return Err("needs servers the run starts".to_owned()),
    };
    if c.kinds.is_empty() || c.faults == 0 {
        return Err("give kinds and a number of faults".to_owned());
    }
    if c.outage.0.is_zero() || c.from.0 + c.outage.0 > c.until.0 {
        return Err("from + outage must not pass until".to_owned());
    }
    for k in &c.kinds {
        match k {
            ChaosKind::StopRedis if !redis => {
                return Err("stop_redis needs servers.store: redis".to_owned());
            }
            ChaosKind::CutGateway if !processes => {
                return Err("cut_gateway needs gateway_processes: true".to_owned());
            }
            _ => {}
        }
    }
    let mut rng = crate::workload::Rng::new(c.seed);
    let mut free_at: std::collections::HashMap<String, Duration> = std::collections::HashMap::new();
    let mut out = Vec::new();
    let span = (c.until.0 - c.outage.0 - c.from.0).as_secs_f64();
    let mut tries = 0;
    while out.iter().filter(|f: &&Fault| !matches!(f.action, Action::Restart(_))).count() < c.faults
    {
        tries += 1;
        if tries > 100 * c.faults {
            return Err("cannot place that many faults without overlaps: fewer faults, or a longer interval".to_owned());
        }
        let kind = c.kinds[usize::try_from(rng.next_u64() % c.kinds.len() as u64).unwrap_or(0)];
        let at = c.from.0 + Duration::from_secs_f64(span * rng.unit());
        let d = c.outage.0.mul_f64(1.0 / 3.0 + 2.0 / 3.0 * rng.unit());
        let resource = match kind {
            ChaosKind::KillNode => format!("node{}", rng.next_u64() % nodes as u64),
            ChaosKind::CutGateway => format!("gateway{}", rng.next_u64() % gateways as u64),
            ChaosKind::StopRedis => "redis".to_owned(),
        };
        if free_at.get(&resource).is_some_and(|&t| t > at) {
            continue;
        }
        // Leave the resource alone a while after its fault: the next one then finds
        // it recovered.
        free_at.insert(resource.clone(), at + d + Duration::from_secs(1));
        match kind {
            ChaosKind::KillNode => {
                out.push(Fault { at, action: Action::Kill(resource.clone()) });
                out.push(Fault { at: at + d, action: Action::Restart(resource) });
            }
            ChaosKind::CutGateway => out.push(Fault { at, action: Action::Cut(resource, d) }),
            ChaosKind::StopRedis => out.push(Fault { at, action: Action::StopRedis(d) }),
        }
    }
    Ok(out)
}
