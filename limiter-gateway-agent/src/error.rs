//! Errors of the agent: requests that can never succeed, and permit calls the owner
//! did not answer.

/// A request the owner (or the agent) refuses as malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// Malformed: empty names, zero cost, a cost above a limit's capacity.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The owner's endpoint is not a valid URI.
    #[error("invalid owner endpoint `{0}`")]
    Endpoint(String),
    /// A permit's release or renewal the owner refused or did not answer.
    #[error("owner: {0}")]
    Owner(String),
}
