//! The native gRPC service, `limiter.v1.RateLimiter`.

use std::sync::Arc;

use limiter_proto::limiter::v1 as pb;
use pb::rate_limiter_server::RateLimiter;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::api::routing;
use crate::cluster::peers::{Peer, checked_hop, moved};
use crate::convert;
use crate::error::{ServerError, element_status};
use crate::metrics::Api;
use crate::owner::Owner;

/// `limiter.v1.RateLimiter` over an [`Owner`].
#[derive(Debug, Clone)]
pub struct NativeService {
    owner: Arc<Owner>,
}

impl NativeService {
    /// The service over `owner`.
    pub fn new(owner: Arc<Owner>) -> Self {
        Self { owner }
    }

    fn hop<T>(&self, request: &Request<T>) -> Result<u8, Status> {
        checked_hop(request, self.owner.shared().is_some())
    }
}

fn refuse(e: ServerError) -> Status {
    crate::metrics::count_invalid(Api::Native, e.field());
    e.into()
}

#[tonic::async_trait]
impl RateLimiter for NativeService {
    async fn should_allow(
        &self,
        request: Request<pb::ShouldAllowRequest>,
    ) -> Result<Response<pb::ShouldAllowResponse>, Status> {
        let hop = self.hop(&request)?;
        let req = request.into_inner();
        let span = crate::trace::span!(
            "decide",
            api = "native",
            tenant = %crate::trace::short(&req.tenant),
            route = %crate::trace::short(&req.route),
            cost = req.cost.unwrap_or(0),
        );
        let mut answers = routing::should_allow(&self.owner, std::slice::from_ref(&req), hop)
            .instrument(span)
            .await
            .map_err(|(_, e)| refuse(e))?;
        Ok(Response::new(answers.pop().unwrap_or_default()))
    }

    async fn should_allow_batch(
        &self,
        request: Request<pb::ShouldAllowBatchRequest>,
    ) -> Result<Response<pb::ShouldAllowBatchResponse>, Status> {
        let hop = self.hop(&request)?;
        let batch = request.into_inner();
        let max = self.owner.limits().max_batch;
        if batch.requests.len() > max {
            return Err(refuse(ServerError::TooLarge {
                what: "requests",
                got: batch.requests.len(),
                max,
            }));
        }
        if batch.requests.is_empty() {
            return Err(refuse(ServerError::invalid(
                "requests",
                "at least one request is required",
            )));
        }
        let first = batch.requests.first();
        let span = crate::trace::span!(
            "decide",
            api = "native",
            tenant = %crate::trace::short(first.map_or("", |r| r.tenant.as_str())),
            route = %crate::trace::short(first.map_or("", |r| r.route.as_str())),
            requests = batch.requests.len(),
        );
        let responses = routing::should_allow(&self.owner, &batch.requests, hop)
            .instrument(span)
            .await
            .map_err(|(i, e)| element_status(Api::Native, "requests", i, e))?;
        Ok(Response::new(pb::ShouldAllowBatchResponse { responses }))
    }

    async fn report_cost(
        &self,
        request: Request<pb::ReportCostRequest>,
    ) -> Result<Response<pb::ReportCostResponse>, Status> {
        let hop = self.hop(&request)?;
        let r = request.into_inner();
        let call = |peer: Peer, hop| {
            let r = r.clone();
            async move { peer.report_cost(r, hop).await }
        };
        if let Some(answer) = at_owner(&self.owner, &r.tenant, hop, call).await? {
            return Ok(Response::new(answer));
        }
        let core = named(&r.tenant, &r.route, &r.key, false);
        let s = self.owner.report_cost(&core, &r.ticket, r.actual_cost).await.map_err(refuse)?;
        Ok(Response::new(pb::ReportCostResponse {
            charged: s.charged,
            refunded: s.refunded,
            remaining: s.remaining,
        }))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let hop = self.hop(&request)?;
        let r = request.into_inner();
        let call = |peer: Peer, hop| {
            let r = r.clone();
            async move { peer.release(r, hop).await }
        };
        if let Some(answer) = at_owner(&self.owner, &r.tenant, hop, call).await? {
            return Ok(Response::new(answer));
        }
        let core = named(&r.tenant, &r.route, &r.key, false);
        if r.turn != 0 {
            self.owner.leave_line(&core, r.turn).map_err(refuse)?;
            if r.permit.is_empty() {
                return Ok(Response::new(pb::ReleaseResponse { released: false, units: 0 }));
            }
        }
        let done = self.owner.release(&core, &r.permit).await.map_err(refuse)?;
        Ok(Response::new(pb::ReleaseResponse { released: done.released, units: done.units }))
    }

    async fn renew(
        &self,
        request: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        let hop = self.hop(&request)?;
        let r = request.into_inner();
        let call = |peer: Peer, hop| {
            let r = r.clone();
            async move { peer.renew(r, hop).await }
        };
        if let Some(answer) = at_owner(&self.owner, &r.tenant, hop, call).await? {
            return Ok(Response::new(answer));
        }
        let core = named(&r.tenant, &r.route, &r.key, false);
        let (left, contended) = self.owner.renew(&core, &r.permit).await.map_err(refuse)?;
        Ok(Response::new(pb::RenewResponse {
            expires_in: Some(convert::duration(left)),
            contended,
        }))
    }

    async fn usage(
        &self,
        request: Request<pb::UsageRequest>,
    ) -> Result<Response<pb::UsageResponse>, Status> {
        let hop = self.hop(&request)?;
        let r = request.into_inner();
        let call = |peer: Peer, hop| {
            let r = r.clone();
            async move { peer.usage(r, hop).await }
        };
        if let Some(answer) = at_owner(&self.owner, &r.tenant, hop, call).await? {
            return Ok(Response::new(answer));
        }
        let core = named(&r.tenant, &r.route, &r.key, true);
        let u = self.owner.usage(&core).await.map_err(refuse)?;
        Ok(Response::new(usage_response(&u)))
    }

    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        let hop = self.hop(&request)?;
        let r = request.into_inner();
        let max = self.owner.limits().max_batch;
        if r.items.len() > max {
            return Err(refuse(ServerError::TooLarge { what: "items", got: r.items.len(), max }));
        }
        if r.agent_id.is_empty() {
            return Err(refuse(ServerError::invalid("agent_id", "must not be empty")));
        }
        let span = crate::trace::span!(
            "lease",
            agent = %crate::trace::short(&r.agent_id),
            tenant = %crate::trace::short(r.items.first().map_or("", |i| i.tenant.as_str())),
            route = %crate::trace::short(r.items.first().map_or("", |i| i.route.as_str())),
            items = r.items.len(),
        );
        let grants = routing::lease(&self.owner, &r, hop)
            .instrument(span)
            .await
            .map_err(|(i, e)| element_status(Api::Lease, "items", i, e))?;
        Ok(Response::new(pb::LeaseResponse { grants }))
    }

    async fn ping(
        &self,
        _: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(pb::PingResponse {}))
    }

    async fn topology(
        &self,
        request: Request<pb::TopologyRequest>,
    ) -> Result<Response<pb::TopologyResponse>, Status> {
        let r = request.into_inner();
        let max = self.owner.limits().max_batch;
        if r.tenants.len() > max {
            return Err(refuse(ServerError::TooLarge {
                what: "tenants",
                got: r.tenants.len(),
                max,
            }));
        }
        let ready = self.owner.is_ready();
        let answer = match self.owner.cluster() {
            Some(c) => c.topology(&r.tenants, ready),
            None => pb::TopologyResponse { ready, ..Default::default() },
        };
        Ok(Response::new(answer))
    }

    async fn handoff(
        &self,
        request: Request<pb::HandoffRequest>,
    ) -> Result<Response<pb::HandoffResponse>, Status> {
        let Some(cluster) = self.owner.shared() else {
            return Err(Status::permission_denied(
                "this node is not in a cluster and accepts no handoffs",
            ));
        };
        if self.hop(&request)? == 0 {
            return Err(Status::permission_denied("handoffs come from other nodes only"));
        }
        let r = request.into_inner();
        let policy = self.owner.policies().current();
        let accepted = cluster
            .receive(&r, self.owner.store().limiter(), self.owner.leases(), &policy.policy)
            .map_err(Status::permission_denied)?;
        Ok(Response::new(pb::HandoffResponse { accepted }))
    }

    async fn replicate(
        &self,
        request: Request<pb::ReplicateRequest>,
    ) -> Result<Response<pb::ReplicateResponse>, Status> {
        let Some(cluster) = self.owner.shared() else {
            return Err(Status::permission_denied(
                "this node is not in a cluster and holds no replicas",
            ));
        };
        if self.hop(&request)? == 0 {
            return Err(Status::permission_denied("replicas come from other nodes only"));
        }
        let r = request.into_inner();
        let resync =
            cluster.replication().receive(cluster, &r).map_err(Status::permission_denied)?;
        Ok(Response::new(pb::ReplicateResponse { resync }))
    }
}

/// The wire usage view.
fn usage_response(u: &crate::owner::Usage) -> pb::UsageResponse {
    pb::UsageResponse {
        levels: u
            .levels
            .iter()
            .map(|l| pb::LevelUsage {
                scope: convert::scope(l.scope).into(),
                limit: Some(convert::limit(&l.limit, Some(&l.name), u.now)),
                remaining: l.remaining,
                reset_after: Some(convert::duration(l.reset_after)),
                reset_at: convert::rfc3339(u.now.saturating_add(l.reset_after)),
                shared: l.shared,
            })
            .collect(),
        open_tickets: u.open_tickets,
        open_ticket_units: u.open_ticket_units,
        held_permits: u.held_permits,
        held_permit_units: u.held_permit_units,
        policy_version: u.policy_version,
        unknown_tenant: u.unknown_tenant,
    }
}

/// A call about `tenant` answered by its owner when another node owns it (forwarded
/// once, following one redirect); `None` when this node answers it.
async fn at_owner<T, F, Fut>(
    owner: &Owner,
    tenant: &str,
    hop: u8,
    call: F,
) -> Result<Option<T>, Status>
where
    F: Fn(Peer, u8) -> Fut,
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    let Some(cluster) = owner.cluster() else { return Ok(None) };
    match routing::target(cluster, tenant, hop).await {
        Some(Err(member)) => Err(moved(&member.address)),
        Some(Ok(member)) => routing::forward_once(cluster, &member, tenant, call).await,
        None => Ok(None),
    }
}

/// The request a report or a usage query names (an empty key: none).
fn named<'a>(
    tenant: &'a str,
    route: &'a str,
    key: &'a str,
    dry_run: bool,
) -> limiter_core::policy::Request<'a> {
    let key = (!key.is_empty()).then_some(key);
    limiter_core::policy::Request { tenant, route, key, cost: None, dry_run }
}
