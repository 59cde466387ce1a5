//! Why a request could not be placed ([`RouteError`], and the OpenAI error both transports
//! answer it with), and why a run-time pool change failed ([`PoolError`]).

use crate::scheduling::flow::{Eviction, Refusal};
use crate::scheduling::ScheduleError;
use strata_api::ApiError;

/// Why a request could not be placed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error("the pool is saturated and the request is sheddable")]
    Shed,
    #[error("too many requests are waiting for capacity")]
    QueueFull,
    /// Flow control refused it on arrival.
    #[error("flow control refused the request: {}", .0.as_str())]
    Refused(Refusal),
    /// Flow control evicted it from its queue.
    #[error("the request waited past its time to live ({})", .0.as_str())]
    Evicted(Eviction),
}

impl RouteError {
    /// The OpenAI error both transports answer a routing failure with.
    pub fn to_api_error(&self) -> ApiError {
        match self {
            RouteError::Shed => ApiError::rate_limited(
                "The service is saturated; this request is sheddable. Retry later.",
            ),
            RouteError::QueueFull | RouteError::Refused(Refusal::Capacity) => {
                ApiError::rate_limited("Too many requests are waiting for capacity. Retry later.")
            }
            RouteError::Refused(Refusal::Shed) => ApiError::rate_limited(
                "The service is saturated; this request is sheddable. Retry later.",
            ),
            RouteError::Evicted(Eviction::Ttl) => {
                ApiError::unavailable("The request waited for capacity past its time to live.")
            }
            RouteError::Evicted(Eviction::HeldTtl) => {
                ApiError::unavailable("No replica became ready within the request's time to live.")
            }
            RouteError::Schedule(ScheduleError::UnknownModel(m)) => ApiError::model_not_found(m),
            RouteError::Schedule(ScheduleError::UnknownProfile(p)) => ApiError::invalid(
                crate::headers::PROFILE,
                format!("Unknown scheduling profile `{p}`."),
            ),
            RouteError::Schedule(ScheduleError::NoReadyEndpoint) => {
                ApiError::unavailable("No replica is ready.")
            }
            RouteError::Schedule(ScheduleError::Filtered(_)) => {
                ApiError::unavailable("No replica can take this request.")
            }
        }
    }
}

/// Errors from run-time pool changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("endpoint `{0}` is already registered")]
    Exists(String),
    #[error("no endpoint `{0}`")]
    Unknown(String),
}
