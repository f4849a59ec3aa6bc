//! Errors of the server, and the one place they become gRPC status codes.

use limiter_core::RequestError;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The request can never succeed as sent (names, costs).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// A malformed call, naming the field at fault.
    #[error("{field}: {message}")]
    Invalid {
        /// The field at fault.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A bound of the server's configuration was exceeded.
    #[error("{what} is {got}, above the maximum of {max}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The configured maximum.
        max: usize,
    },
    /// A bounded resource is exhausted for now.
    #[error("{0}")]
    Exhausted(String),
    /// The limiter cannot decide (draining, no owner, a lost slice).
    #[error("limiter unavailable: {0}")]
    Unavailable(String),
    /// The store could not be reached.
    #[error("limiter unavailable: {0}")]
    Store(#[from] StoreError),
}

/// Why a call to the store failed (the Redis store; memory does not fail).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The circuit breaker is open: calls are refused at once until a probe answers.
    #[error("redis circuit breaker open")]
    BreakerOpen,
    /// Redis answered with an error, or the connection failed.
    #[error("redis: {0}")]
    Redis(#[source] redis::RedisError),
    /// No pooled connection could be had.
    #[error("redis pool: {0}")]
    Pool(#[source] bb8::RunError<redis::RedisError>),
    /// No answer within the command timeout.
    #[error("redis did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// An answer that is not what the script returns.
    #[error("redis: malformed {0} reply")]
    Malformed(&'static str),
}

impl ServerError {
    /// An invalid-field error.
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid { field, message: message.into() }
    }

    /// The request field at fault, if any (a bounded label for metrics).
    pub fn field(&self) -> &'static str {
        match self {
            Self::Request(e) => e.field(),
            Self::Invalid { field, .. } => field,
            Self::TooLarge { what, .. } => what,
            Self::Exhausted(_) | Self::Unavailable(_) | Self::Store(_) => "none",
        }
    }
}

impl From<ServerError> for tonic::Status {
    fn from(e: ServerError) -> Self {
        let message = e.to_string();
        match e {
            ServerError::Request(RequestError::NameTooLong { field, .. })
            | ServerError::Request(RequestError::EmptyName { field })
            | ServerError::Request(RequestError::ControlCharacter { field }) => {
                tonic::Status::invalid_argument(format!("{field}: {message}"))
            }
            ServerError::Request(RequestError::ZeroCost)
            | ServerError::Request(RequestError::CostAboveLimit { .. }) => {
                tonic::Status::invalid_argument(format!("cost: {message}"))
            }
            ServerError::Invalid { .. } | ServerError::TooLarge { .. } => {
                tonic::Status::invalid_argument(message)
            }
            ServerError::Exhausted(_) => tonic::Status::resource_exhausted(message),
            ServerError::Unavailable(_) | ServerError::Store(_) => {
                tonic::Status::unavailable(message)
            }
        }
    }
}

/// The status of element `i` of a call's `list` (`requests`, `descriptors`,
/// `items`) that failed, counted as refused for `api`: `UNAVAILABLE` stays what it
/// is, an exhausted bound is `RESOURCE_EXHAUSTED`, anything else is `INVALID_ARGUMENT`
/// naming the element.
pub fn element_status(
    api: crate::metrics::Api,
    list: &str,
    i: usize,
    e: ServerError,
) -> tonic::Status {
    if let ServerError::Exhausted(why) = e {
        // Counted where the bound is kept.
        return tonic::Status::resource_exhausted(format!("{list}[{i}]: {why}"));
    }
    crate::metrics::count_invalid(api, e.field());
    match e {
        ServerError::Unavailable(_) | ServerError::Store(_) => e.into(),
        e => tonic::Status::invalid_argument(format!(
            "{list}[{i}]: {}",
            tonic::Status::from(e).message()
        )),
    }
}
