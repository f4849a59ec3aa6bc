//! The APIs a simulated gateway calls, behind one `call`.

use std::sync::Arc;
use std::time::Duration;

use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest};
use limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use limiter_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use tonic::transport::{Channel, Endpoint};

use crate::record::{self, Kind, Source};
use crate::scenario::TargetKind;
use crate::workload::{NO_KEY, Planned};

/// The names behind the indices of planned requests.
#[derive(Debug, Clone)]
pub struct Names {
    /// Tenants.
    pub tenants: Vec<String>,
    /// Routes.
    pub routes: Vec<String>,
    /// Keys (`k{i}`), as many as the most keys of a tenant.
    pub keys: Vec<String>,
}

impl Names {
    /// The key of a planned request, as our API gets it.
    pub fn key(&self, i: u32) -> Option<&str> {
        (i != NO_KEY).then(|| self.keys[i as usize].as_str())
    }

    /// The key the server derives from an Envoy descriptor (`user=k{i}`).
    pub fn envoy_key(&self, i: u32) -> Option<String> {
        self.key(i).map(|k| format!("{ENVOY_KEY_ENTRY}={k}"))
    }
}

/// The descriptor entry that carries the key in Envoy requests.
pub const ENVOY_KEY_ENTRY: &str = "user";

/// A connected caller of one API.
#[derive(Clone)]
pub enum Target {
    /// `ShouldAllow`.
    Native(RateLimiterClient<Channel>),
    /// `ShouldRateLimit`.
    Envoy(RateLimitServiceClient<Channel>),
    /// The embedded agent.
    Agent(Arc<Agent>),
    /// `Ping`.
    Ping(RateLimiterClient<Channel>),
}

/// A lazily connected channel to `url`.
///
/// # Errors
///
/// When the URL is not one.
pub fn channel(url: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(url.to_owned())?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_millis(500))
        .connect_lazy())
}

impl Target {
    /// A caller of `kind` at `url`; `id` names an agent.
    ///
    /// # Errors
    ///
    /// When the URL is not one, or the agent cannot be built.
    pub fn new(kind: TargetKind, url: &str, id: &str) -> anyhow::Result<Self> {
        Ok(match kind {
            TargetKind::Native => Self::Native(RateLimiterClient::new(channel(url)?)),
            TargetKind::Ping => Self::Ping(RateLimiterClient::new(channel(url)?)),
            TargetKind::Envoy => Self::Envoy(RateLimitServiceClient::new(channel(url)?)),
            TargetKind::Agent => {
                Self::Agent(Arc::new(Agent::new(AgentConfig::new(url.to_owned(), id.to_owned()))?))
            }
        })
    }

    /// Calls once for `p`; the answer as a record's kind, label and source.
    pub async fn call(&self, names: &Names, p: &Planned) -> (Kind, u8, Source) {
        let tenant = &names.tenants[p.tenant as usize];
        let route = &names.routes[usize::from(p.route)];
        match self {
            Self::Native(c) => {
                let req = pb::ShouldAllowRequest {
                    tenant: tenant.clone(),
                    route: route.clone(),
                    key: names.key(p.key).unwrap_or_default().to_owned(),
                    cost: Some(p.cost),
                    ..Default::default()
                };
                match c.clone().should_allow(req).await {
                    Ok(r) => {
                        let r = r.into_inner();
                        if r.allowed {
                            (Kind::Admitted, 0, Source::Remote)
                        } else {
                            let label = pb::Reason::try_from(r.reason)
                                .ok()
                                .and_then(crate::target::core_reason)
                                .map_or(record::OVER_LIMIT, record::reason_label);
                            (Kind::Rejected, label, Source::Remote)
                        }
                    }
                    Err(s) => (Kind::Error, record::status_label(&s), Source::Remote),
                }
            }
            Self::Ping(c) => match c.clone().ping(pb::PingRequest {}).await {
                Ok(_) => (Kind::Admitted, 0, Source::Remote),
                Err(s) => (Kind::Error, record::status_label(&s), Source::Remote),
            },
            Self::Envoy(c) => {
                let mut entries = vec![Entry { key: "route".to_owned(), value: route.clone() }];
                if let Some(k) = names.key(p.key) {
                    entries.push(Entry { key: ENVOY_KEY_ENTRY.to_owned(), value: k.to_owned() });
                }
                let req = RateLimitRequest {
                    domain: tenant.clone(),
                    descriptors: vec![RateLimitDescriptor {
                        entries,
                        limit: None,
                        hits_addend: Some(p.cost),
                    }],
                    hits_addend: 0,
                };
                match c.clone().should_rate_limit(req).await {
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => {
                        (Kind::Admitted, 0, Source::Remote)
                    }
                    Ok(_) => (Kind::Rejected, record::OVER_LIMIT, Source::Remote),
                    Err(s) => (Kind::Error, record::status_label(&s), Source::Remote),
                }
            }
            Self::Agent(a) => {
                let req = AgentRequest { tenant, route, key: names.key(p.key), cost: p.cost };
                match a.decide(&req).await {
                    Ok(o) => {
                        let source = match o.source {
                            limiter_gateway_agent::Source::Local => Source::Local,
                            limiter_gateway_agent::Source::Owner => Source::Owner,
                            limiter_gateway_agent::Source::Granted => Source::Granted,
                            limiter_gateway_agent::Source::Fallback => Source::Fallback,
                        };
                        if o.allowed {
                            (Kind::Admitted, 0, source)
                        } else {
                            let label = o.reason.map_or(record::OVER_LIMIT, record::reason_label);
                            (Kind::Rejected, label, source)
                        }
                    }
                    Err(_) => (Kind::Error, record::OTHER, Source::Owner),
                }
            }
        }
    }

    /// Calls to owners so far and the items they carried (agents only).
    pub fn owner_calls(&self) -> Option<Calls> {
        match self {
            Self::Agent(a) => {
                let st = a.stats();
                Some(Calls { calls: st.owner_calls, items: st.owner_items })
            }
            _ => None,
        }
    }

    /// Gives an agent's leases back (a clean stop).
    pub async fn shutdown(&self) {
        if let Self::Agent(a) = self {
            a.shutdown().await;
        }
    }
}

/// An agent's owner calls and the items (keys) they carried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    /// Calls made.
    pub calls: u64,
    /// Items carried by them.
    pub items: u64,
}

impl std::ops::Add for Calls {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self { calls: self.calls + o.calls, items: self.items + o.items }
    }
}

impl Calls {
    /// The line a gateway process prints of them.
    pub fn to_line(self) -> String {
        format!("C {} {}", self.calls, self.items)
    }

    /// Parses [`Self::to_line`]'s output.
    pub fn from_line(line: &str) -> Option<Self> {
        let mut it = line.strip_prefix("C ")?.split(' ');
        let calls = it.next()?.parse().ok()?;
        let items = it.next()?.parse().ok()?;
        Some(Self { calls, items })
    }
}

/// Our core reason of a wire reason.
pub fn core_reason(r: pb::Reason) -> Option<limiter_core::Reason> {
    use limiter_core::Reason as R;
    Some(match r {
        pb::Reason::GlobalCeiling => R::GlobalCeiling,
        pb::Reason::RouteLimit => R::RouteLimit,
        pb::Reason::TenantLimit => R::TenantLimit,
        pb::Reason::TenantRouteLimit => R::TenantRouteLimit,
        pb::Reason::KeyLimit => R::KeyLimit,
        pb::Reason::EmergencyCeiling => R::EmergencyCeiling,
        pb::Reason::LimiterUnavailable => R::LimiterUnavailable,
        pb::Reason::UnknownTenant => R::UnknownTenant,
        pb::Reason::ShareLimit => R::ShareLimit,
        pb::Reason::Unspecified => return None,
    })
}
