//! Whether a failed try of one target is tried again, and after how long: pure (the
//! policy, the target's state, the failure, a jitter sample and `now` in; a decision
//! out), so the simulator and the tests run it without clocks or sockets.
//!
//! The failure's class comes from [`crate::routing::classify`]: connect errors, timeouts,
//! 408, 429 and 5xx are retried; a refused certificate, a provider refusing the gateway's
//! key, a context-length error and a 404 move to the next target at once; other 4xx go to the client. A retry waits
//! `base·2ⁿ` (capped at [`BACKOFF_CAP`]) with equal jitter, or the upstream's
//! `Retry-After` when that is longer; a `Retry-After` beyond [`MAX_RETRY_AFTER`], no retry
//! left, or a wait that would reach the request's deadline moves to the next target
//! instead (a fallback may answer now).

use std::time::{Duration, Instant, SystemTime};

use crate::routing::{classify, Failure, Next};

/// The longest backoff between two tries of a target.
pub const BACKOFF_CAP: Duration = Duration::from_secs(5);

/// The longest `Retry-After` waited for; a longer one moves to the next target.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);

/// A model's retry settings (`retries`, `backoff_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Extra tries of the same target.
    pub retries: u32,
    /// Base of the exponential backoff, in ms.
    pub base_ms: u64,
}

/// One failed try as the policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct FailedTry<'a> {
    pub failure: &'a Failure,
    /// The wait the upstream asked for (`Retry-After`), when it did.
    pub retry_after: Option<Duration>,
    /// Retries of this target made before this try (0 after its first try).
    pub retries_made: u32,
}

/// What to do after a failed try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Try the same target again after this wait.
    Retry { after: Duration },
    /// Move to the next target of the plan.
    NextTarget,
    /// Give the upstream's answer to the client.
    Relay,
}

/// The decision after `failed` (`jitter` is a uniform sample in `[0, 1)`).
pub fn decide(
    policy: RetryPolicy,
    failed: FailedTry<'_>,
    jitter: f64,
    now: Instant,
    deadline: Instant,
) -> Decision {
    match classify(failed.failure) {
        Next::Relay => return Decision::Relay,
        Next::NextTarget => return Decision::NextTarget,
        Next::Retry => {}
    }
    if failed.retries_made >= policy.retries {
        return Decision::NextTarget;
    }
    let mut wait = backoff(policy.base_ms, failed.retries_made, jitter);
    if let Some(asked) = failed.retry_after {
        if asked > MAX_RETRY_AFTER {
            return Decision::NextTarget;
        }
        wait = wait.max(asked);
    }
    if now + wait >= deadline {
        return Decision::NextTarget;
    }
    Decision::Retry { after: wait }
}

/// Delay before retry number `n` (0-based): `base·2ⁿ`, capped at [`BACKOFF_CAP`], with
/// equal jitter (half fixed, half `jitter` of the other half) so that clients retrying
/// together spread out.
pub fn backoff(base_ms: u64, n: u32, jitter: f64) -> Duration {
    let cap = BACKOFF_CAP.as_millis() as u64;
    let exp = base_ms.saturating_mul(1u64 << n.min(16)).min(cap);
    let half = exp / 2;
    let jitter = if jitter.is_finite() {
        jitter.clamp(0.0, 1.0)
    } else {
        0.0
    };
    Duration::from_millis(exp - half + (half as f64 * jitter) as u64)
}

/// The wait an upstream asked for: `retry-after-ms` (milliseconds, as OpenAI sends it)
/// or `Retry-After` (seconds, or an HTTP date read against `now`); `None` when absent or
/// unreadable. A date in the past is no wait.
pub fn retry_after(
    retry_after_ms: Option<&str>,
    retry_after: Option<&str>,
    now: SystemTime,
) -> Option<Duration> {
    if let Some(ms) = retry_after_ms.and_then(|v| v.trim().parse::<f64>().ok()) {
        if ms.is_finite() && ms >= 0.0 {
            return Some(Duration::from_millis(ms.min(u32::MAX as f64) as u64));
        }
    }
    let v = retry_after?.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs.min(u32::MAX as u64)));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: RetryPolicy = RetryPolicy {
        retries: 2,
        base_ms: 100,
    };

    fn failed(f: &Failure, retries_made: u32, retry_after: Option<Duration>) -> FailedTry<'_> {
        FailedTry {
            failure: f,
            retry_after,
            retries_made,
        }
    }

    #[test]
    fn retryable_failures_back_off_until_retries_run_out() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(60);
        for f in [
            Failure::Connect,
            Failure::Timeout,
            Failure::Status(429, String::new()),
            Failure::Status(503, String::new()),
            Failure::Status(529, String::new()),
        ] {
            let d = decide(POLICY, failed(&f, 0, None), 0.0, now, deadline);
            assert_eq!(
                d,
                Decision::Retry {
                    after: Duration::from_millis(50)
                },
                "{f:?}"
            );
            let d = decide(POLICY, failed(&f, 1, None), 1.0, now, deadline);
            assert_eq!(
                d,
                Decision::Retry {
                    after: Duration::from_millis(200)
                },
                "{f:?}"
            );
            let d = decide(POLICY, failed(&f, 2, None), 0.5, now, deadline);
            assert_eq!(d, Decision::NextTarget, "{f:?}");
        }
    }

    #[test]
    fn retry_after_is_honoured_within_bounds() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(60);
        let busy = Failure::Status(429, String::new());
        let asked = Some(Duration::from_secs(2));
        assert_eq!(
            decide(POLICY, failed(&busy, 0, asked), 0.0, now, deadline),
            Decision::Retry {
                after: Duration::from_secs(2)
            }
        );
        // Shorter than the backoff: the backoff stands.
        let short = Some(Duration::from_millis(1));
        assert_eq!(
            decide(POLICY, failed(&busy, 0, short), 0.0, now, deadline),
            Decision::Retry {
                after: Duration::from_millis(50)
            }
        );
        // Too long to wait, or past the deadline: the next target instead.
        let long = Some(MAX_RETRY_AFTER + Duration::from_secs(1));
        assert_eq!(
            decide(POLICY, failed(&busy, 0, long), 0.0, now, deadline),
            Decision::NextTarget
        );
        let soon = now + Duration::from_secs(1);
        assert_eq!(
            decide(POLICY, failed(&busy, 0, asked), 0.0, now, soon),
            Decision::NextTarget
        );
    }

    #[test]
    fn certificate_context_and_client_errors_are_not_retried() {
        let now = Instant::now();
        let deadline = now + Duration::from_secs(60);
        let tls = Failure::Tls("invalid peer certificate: Expired".into());
        assert_eq!(
            decide(POLICY, failed(&tls, 0, None), 0.0, now, deadline),
            Decision::NextTarget
        );
        let ctx = Failure::Status(400, "maximum context length is 10".into());
        assert_eq!(
            decide(POLICY, failed(&ctx, 0, None), 0.0, now, deadline),
            Decision::NextTarget
        );
        let bad = Failure::Status(401, "bad key".into());
        assert_eq!(
            decide(POLICY, failed(&bad, 0, None), 0.0, now, deadline),
            Decision::Relay
        );
        // A provider refusing the gateway's key: the next target at once, retries left.
        let refused = Failure::KeyRefused(401);
        assert_eq!(
            decide(POLICY, failed(&refused, 0, None), 0.0, now, deadline),
            Decision::NextTarget
        );
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        for n in 0..5 {
            for j in [0.0, 0.3, 0.999] {
                let d = backoff(100, n, j).as_millis() as u64;
                let exp = 100u64 << n;
                assert!(d >= exp / 2 && d <= exp, "{n} {j}: {d}");
            }
        }
        assert!(backoff(100, 30, 1.0) <= BACKOFF_CAP);
        assert_eq!(backoff(100, 0, f64::NAN), Duration::from_millis(50));
    }

    #[test]
    fn retry_after_headers_are_read() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            retry_after(None, Some("3"), now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            retry_after(Some("1500"), Some("3"), now),
            Some(Duration::from_millis(1500))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        assert_eq!(
            retry_after(None, Some(&later), now),
            Some(Duration::from_secs(7))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(7));
        assert_eq!(retry_after(None, Some(&past), now), Some(Duration::ZERO));
        assert_eq!(retry_after(None, Some("soon"), now), None);
        assert_eq!(retry_after(Some("-1"), None, now), None);
        assert_eq!(retry_after(None, None, now), None);
    }
}
