//! Calls to other nodes: forwarded decisions (single ones batched per peer), lease
//! calls, topology checks and handoffs. One lazily connected channel per peer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use limiter_proto::connect::{AuthChannel, ClientSecurity};
use limiter_proto::envoy::service::ratelimit::v3 as rls;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Status};
use tracing::Instrument as _;

pub use crate::convert::{FORWARDED, OWNER};

/// Single decisions queued for one peer are sent together, at most this many.
const MAX_FORWARD_BATCH: usize = 100;

/// Batches in flight to one peer at a time.
const FORWARDS_IN_FLIGHT: usize = 8;

type Waiting = (pb::ShouldAllowRequest, oneshot::Sender<Result<pb::ShouldAllowResponse, Status>>);

/// One other node.
#[derive(Debug, Clone)]
pub struct Peer {
    address: Arc<str>,
    native: RateLimiterClient<AuthChannel>,
    envoy: RateLimitServiceClient<AuthChannel>,
    queue: mpsc::Sender<Waiting>,
    timeout: Duration,
}

/// The hop of a call that arrived, refused when it claims to come from another node
/// but this node has none (alone, a node has no reason to accept a peer's call: the
/// metadata is a header any client can send).
///
/// # Errors
///
/// `PERMISSION_DENIED` for a forwarded call on a node alone; `INVALID_ARGUMENT` for a
/// hop that is not a small number.
pub fn checked_hop<T>(request: &Request<T>, clustered: bool) -> Result<u8, Status> {
    let Some(value) = request.metadata().get(FORWARDED) else { return Ok(0) };
    if !clustered {
        return Err(Status::permission_denied(format!(
            "{FORWARDED}: this node is not in a cluster and accepts no calls from peers"
        )));
    }
    value.to_str().ok().and_then(|v| v.parse().ok()).ok_or_else(|| {
        Status::invalid_argument(format!("{FORWARDED}: expected a hop count (1 or 2)"))
    })
}

fn with_hop<T>(message: T, hop: u8, timeout: Duration) -> Request<T> {
    let mut r = Request::new(message);
    r.metadata_mut().insert(FORWARDED, hop.to_string().parse().expect("a number is ASCII"));
    r.set_timeout(timeout);
    // The trace goes on to the next node (when spans are exported).
    crate::trace::inject(r.metadata_mut());
    r
}

/// [`with_hop`] with the context of `span` (the forward's own) as the trace parent.
fn with_hop_in<T>(span: &tracing::Span, message: T, hop: u8, timeout: Duration) -> Request<T> {
    span.in_scope(|| with_hop(message, hop, timeout))
}

/// A `FAILED_PRECONDITION` saying `owner` owns the tenant now.
pub fn moved(owner: &str) -> Status {
    let mut s =
        Status::failed_precondition(format!("this node does not own the tenant; {owner} does"));
    if let Ok(v) = owner.parse() {
        s.metadata_mut().insert(OWNER, v);
    }
    s
}

/// The owner a `moved` answer names.
pub fn moved_to(status: &Status) -> Option<String> {
    (status.code() == tonic::Code::FailedPrecondition)
        .then(|| status.metadata().get(OWNER)?.to_str().ok().map(str::to_owned))
        .flatten()
}

impl Peer {
    fn new(address: &str, timeout: Duration, security: &ClientSecurity) -> Result<Self, String> {
        let channel = security
            .connect_lazy(address, |e| e.connect_timeout(timeout).tcp_nodelay(true))
            .map_err(|e| format!("peer address `{address}`: {e}"))?;
        let native = RateLimiterClient::new(channel.clone());
        let envoy = RateLimitServiceClient::new(channel);
        let (queue, rx) = mpsc::channel(4 * MAX_FORWARD_BATCH);
        tokio::spawn(batch_loop(native.clone(), rx, timeout));
        Ok(Self { address: address.into(), native, envoy, queue, timeout })
    }

    /// Forwards one decision; queued with others bound for the same peer.
    ///
    /// # Errors
    ///
    /// The peer's answer, or `UNAVAILABLE` when it cannot be reached.
    pub async fn allow(
        &self,
        req: pb::ShouldAllowRequest,
    ) -> Result<pb::ShouldAllowResponse, Status> {
        if crate::trace::sampled() {
            // A traced request goes on its own, carrying its trace; a batch carries one.
            let span = self.span("ShouldAllow");
            let r = with_hop_in(&span, req, 1, self.timeout);
            return async {
                Ok::<_, Status>(self.native.clone().should_allow(r).await?.into_inner())
            }
            .instrument(span)
            .await;
        }
        let (tx, rx) = oneshot::channel();
        self.queue.send((req, tx)).await.map_err(|_| Status::unavailable("forwarding stopped"))?;
        rx.await.map_err(|_| Status::unavailable("forwarding stopped"))?
    }

    /// A span for a forwarded call of `rpc`.
    fn span(&self, rpc: &'static str) -> tracing::Span {
        crate::trace::span!("forward", peer = %self.address, rpc, otel.kind = "client")
    }

    /// Forwards a batch of decisions at hop `hop`.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn allow_batch(
        &self,
        requests: Vec<pb::ShouldAllowRequest>,
        hop: u8,
    ) -> Result<Vec<pb::ShouldAllowResponse>, Status> {
        let span = self.span("ShouldAllowBatch");
        let r = with_hop_in(&span, pb::ShouldAllowBatchRequest { requests }, hop, self.timeout);
        let call = async {
            Ok::<_, Status>(self.native.clone().should_allow_batch(r).await?.into_inner())
        };
        Ok(call.instrument(span).await?.responses)
    }

    /// Forwards a lease call (or leases a slice of a root key) at hop `hop`.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn lease(&self, req: pb::LeaseRequest, hop: u8) -> Result<pb::LeaseResponse, Status> {
        let span = self.span("Lease");
        let r = with_hop_in(&span, req, hop, self.timeout);
        async { Ok::<_, Status>(self.native.clone().lease(r).await?.into_inner()) }
            .instrument(span)
            .await
    }

    /// Forwards a cost report.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn report_cost(
        &self,
        req: pb::ReportCostRequest,
        hop: u8,
    ) -> Result<pb::ReportCostResponse, Status> {
        Ok(self.native.clone().report_cost(with_hop(req, hop, self.timeout)).await?.into_inner())
    }

    /// Forwards a permit's release.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn release(
        &self,
        req: pb::ReleaseRequest,
        hop: u8,
    ) -> Result<pb::ReleaseResponse, Status> {
        Ok(self.native.clone().release(with_hop(req, hop, self.timeout)).await?.into_inner())
    }

    /// Forwards a permit's renewal.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn renew(&self, req: pb::RenewRequest, hop: u8) -> Result<pb::RenewResponse, Status> {
        Ok(self.native.clone().renew(with_hop(req, hop, self.timeout)).await?.into_inner())
    }

    /// Forwards a usage query.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn usage(&self, req: pb::UsageRequest, hop: u8) -> Result<pb::UsageResponse, Status> {
        Ok(self.native.clone().usage(with_hop(req, hop, self.timeout)).await?.into_inner())
    }

    /// Forwards an Envoy request.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn should_rate_limit(
        &self,
        req: rls::RateLimitRequest,
        hop: u8,
    ) -> Result<rls::RateLimitResponse, Status> {
        let span = self.span("ShouldRateLimit");
        let r = with_hop_in(&span, req, hop, self.timeout);
        async { Ok::<_, Status>(self.envoy.clone().should_rate_limit(r).await?.into_inner()) }
            .instrument(span)
            .await
    }

    /// The peer's view of the ring (a health check), within `timeout`.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn topology(&self, timeout: Duration) -> Result<pb::TopologyResponse, Status> {
        let mut r = Request::new(pb::TopologyRequest::default());
        r.set_timeout(timeout);
        Ok(self.native.clone().topology(r).await?.into_inner())
    }

    /// Sends counters of tenants that now belong to the peer.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn handoff(&self, req: pb::HandoffRequest, timeout: Duration) -> Result<u64, Status> {
        let r = with_hop(req, 1, timeout);
        Ok(self.native.clone().handoff(r).await?.into_inner().accepted)
    }

    /// Sends changes to the peer's replica of this node's tenants; true when the peer
    /// asks for a full copy.
    ///
    /// # Errors
    ///
    /// As [`Self::allow`].
    pub async fn replicate(
        &self,
        req: pb::ReplicateRequest,
        timeout: Duration,
    ) -> Result<bool, Status> {
        let r = with_hop(req, 1, timeout);
        Ok(self.native.clone().replicate(r).await?.into_inner().resync)
    }
}

/// Sends what is queued for one peer as batches, several in flight.
async fn batch_loop(
    client: RateLimiterClient<AuthChannel>,
    mut rx: mpsc::Receiver<Waiting>,
    timeout: Duration,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(FORWARDS_IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_FORWARD_BATCH {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        let mut client = client.clone();
        tokio::spawn(async move {
            let (requests, waiters): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let n = requests.len();
            let r = with_hop(pb::ShouldAllowBatchRequest { requests }, 1, timeout);
            match client.should_allow_batch(r).await {
                Ok(resp) if resp.get_ref().responses.len() == n => {
                    for (w, answer) in waiters.into_iter().zip(resp.into_inner().responses) {
                        let _ = w.send(Ok(answer));
                    }
                }
                Ok(_) => {
                    for w in waiters {
                        let _ = w.send(Err(Status::internal("peer answered a different count")));
                    }
                }
                Err(status) => {
                    for w in waiters {
                        let _ = w.send(Err(status.clone()));
                    }
                }
            }
            drop(permit);
        });
    }
}

/// Clients of the peers, by address, made on first use.
#[derive(Debug)]
pub struct Peers {
    by_address: Mutex<HashMap<Arc<str>, Peer>>,
    timeout: Duration,
    security: ClientSecurity,
}

impl Peers {
    /// Clients whose calls time out after `timeout`, made with `security`.
    pub fn new(timeout: Duration, security: ClientSecurity) -> Self {
        Self { by_address: Mutex::default(), timeout, security }
    }

    /// The client of the node at `address`.
    ///
    /// # Errors
    ///
    /// An address that is not `host:port`.
    pub fn get(&self, address: &str) -> Result<Peer, Status> {
        let mut map = self.by_address.lock();
        if let Some(p) = map.get(address) {
            return Ok(p.clone());
        }
        let p = Peer::new(address, self.timeout, &self.security).map_err(Status::unavailable)?;
        map.insert(address.into(), p.clone());
        Ok(p)
    }

    /// Keeps the clients of the addresses `keep` says yes to.
    pub(crate) fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.by_address.lock().retain(|a, _| keep(a));
    }
}
