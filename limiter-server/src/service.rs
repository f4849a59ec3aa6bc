//! The native gRPC service, `limiter.v1.RateLimiter`.

use std::sync::Arc;

use limiter_proto::limiter::v1 as pb;
use pb::rate_limiter_server::RateLimiter;
use tonic::{Request, Response, Status};

use crate::convert;
use crate::error::ServerError;
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
}

fn refuse(e: ServerError) -> Status {
    Owner::count_invalid(Api::Native, &e);
    e.into()
}

#[tonic::async_trait]
impl RateLimiter for NativeService {
    async fn should_allow(
        &self,
        request: Request<pb::ShouldAllowRequest>,
    ) -> Result<Response<pb::ShouldAllowResponse>, Status> {
        let req = request.into_inner();
        let core = convert::request(&req);
        let outcomes = self
            .owner
            .decide(Api::Native, std::slice::from_ref(&core), false, req.report_later)
            .await
            .map_err(|(_, e)| refuse(e))?;
        Ok(Response::new(convert::response(&outcomes[0])))
    }

    async fn should_allow_batch(
        &self,
        request: Request<pb::ShouldAllowBatchRequest>,
    ) -> Result<Response<pb::ShouldAllowBatchResponse>, Status> {
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
        let core: Vec<_> = batch.requests.iter().map(convert::request).collect();
        let outcomes =
            self.owner.decide(Api::Native, &core, false, false).await.map_err(|(i, e)| {
                Owner::count_invalid(Api::Native, &e);
                Status::invalid_argument(format!("requests[{i}]: {}", Status::from(e).message()))
            })?;
        Ok(Response::new(pb::ShouldAllowBatchResponse {
            responses: outcomes.iter().map(convert::response).collect(),
        }))
    }

    async fn report_cost(
        &self,
        request: Request<pb::ReportCostRequest>,
    ) -> Result<Response<pb::ReportCostResponse>, Status> {
        let r = request.into_inner();
        let core = limiter_core::policy::Request {
            tenant: &r.tenant,
            route: &r.route,
            key: (!r.key.is_empty()).then_some(r.key.as_str()),
            cost: None,
            dry_run: false,
        };
        let s = self.owner.report_cost(&core, &r.ticket, r.actual_cost).await.map_err(refuse)?;
        Ok(Response::new(pb::ReportCostResponse {
            charged: s.charged,
            refunded: s.refunded,
            remaining: s.remaining,
        }))
    }

    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        let r = request.into_inner();
        let max = self.owner.limits().max_batch;
        if r.items.len() > max {
            return Err(refuse(ServerError::TooLarge { what: "items", got: r.items.len(), max }));
        }
        let grants = self.owner.lease(&r.agent_id, &r.items).await.map_err(|(i, e)| {
            Owner::count_invalid(Api::Lease, &e);
            Status::invalid_argument(format!("items[{i}]: {}", Status::from(e).message()))
        })?;
        Ok(Response::new(pb::LeaseResponse { grants }))
    }

    async fn ping(
        &self,
        _: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(pb::PingResponse {}))
    }
}
