//! Rate limits: requests per minute and tokens per minute, per key and per tenant.
//!
//! The policy is GCRA (generic cell rate algorithm), in [`gcra`]: a pure function of
//! (theoretical arrival time, now, limit, period, cost) → decision, with no clock inside.
//! A limit of `L` per period `P` has emission interval `T = P / L`; a request of cost `c`
//! moves the stored time `tat` to `max(tat, now) + c·T` and is admitted when that lies at
//! most `P` ahead of now, so a quiet client may burst up to `L` at once and then proceeds at
//! the steady rate. One request checks several limits together and is admitted only when
//! all admit it (all-or-nothing, nothing is charged on refusal).
//!
//! Tokens are charged twice: an estimate before the call (prompt tokens + `max_tokens`),
//! then the difference once the real usage is known ([`Limiter::adjust`], which may refund).
//!
//! Backends: [`MemoryLimiter`] (one process) and [`RedisLimiter`], which runs the same
//! step as one Lua script so that replicas sharing a Redis share each limit atomically and
//! use Redis's clock. When Redis fails the configured [`FailureMode`] decides.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::FailureMode;
use crate::redis_conn::{RedisConn, RedisError};

/// One limit to check: a bucket name, its capacity per period and this request's cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitCheck {
    /// Bucket name, e.g. `k:<key id>:rpm` or `t:<tenant>:tpm`.
    pub bucket: String,
    pub limit: u64,
    pub period_us: i64,
    pub cost: u64,
    pub kind: LimitKind,
}

/// Whether a limit counts requests or tokens (decides which headers report it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    Tokens,
}

/// One GCRA step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub allowed: bool,
    /// The stored time after this step (unchanged when refused).
    pub tat_us: i64,
    /// When refused: how long until the same request would be admitted.
    pub retry_after_us: i64,
    /// Cost units still available right now after this step.
    pub remaining: u64,
    /// Time until the bucket is full again.
    pub reset_after_us: i64,
}

/// The pure GCRA policy. `tat_us` is the stored theoretical arrival time (None: never
/// used). A `cost` above `limit` can never be admitted.
pub fn gcra(tat_us: Option<i64>, now_us: i64, limit: u64, period_us: i64, cost: u64) -> Step {
    let limit = limit.max(1);
    let interval = period_us as f64 / limit as f64;
    let tat = tat_us.unwrap_or(now_us).max(now_us);
    let new_tat = tat + (cost as f64 * interval).round() as i64;
    let allowed = new_tat - now_us <= period_us;
    let stored = if allowed { new_tat } else { tat };
    let used = (stored - now_us) as f64;
    let remaining = ((period_us as f64 - used) / interval).floor().max(0.0) as u64;
    Step {
        allowed,
        tat_us: stored,
        retry_after_us: if allowed {
            0
        } else {
            new_tat - period_us - now_us
        },
        remaining: remaining.min(limit),
        reset_after_us: stored - now_us,
    }
}

/// Applies a correction of `delta` cost units (negative refunds) without refusing.
pub fn gcra_adjust(
    tat_us: Option<i64>,
    now_us: i64,
    limit: u64,
    period_us: i64,
    delta: i64,
) -> i64 {
    let interval = period_us as f64 / limit.max(1) as f64;
    let tat = tat_us.unwrap_or(now_us).max(now_us);
    (tat + (delta as f64 * interval).round() as i64).max(now_us)
}

/// The outcome of checking every limit of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitDecision {
    pub allowed: bool,
    pub retry_after: Duration,
    /// Per check, in the order given: (remaining, reset after).
    pub states: Vec<(u64, Duration)>,
    /// Index of a check whose cost exceeds its whole capacity (never admissible).
    pub too_large: Option<usize>,
    /// True when the backend failed and the failure mode admitted the request.
    pub degraded: bool,
}

impl LimitDecision {
    fn unlimited(n: usize) -> LimitDecision {
        LimitDecision {
            allowed: true,
            retry_after: Duration::ZERO,
            states: vec![(u64::MAX, Duration::ZERO); n],
            too_large: None,
            degraded: false,
        }
    }
}

/// Combines per-check steps into one all-or-nothing decision (pure).
pub fn decide(checks: &[LimitCheck], steps: &[Step]) -> LimitDecision {
    let too_large = checks.iter().position(|c| c.cost > c.limit);
    let allowed = too_large.is_none() && steps.iter().all(|s| s.allowed);
    let retry_us = steps
        .iter()
        .map(|s| s.retry_after_us)
        .max()
        .unwrap_or(0)
        .max(0);
    LimitDecision {
        allowed,
        retry_after: Duration::from_micros(retry_us as u64),
        states: steps
            .iter()
            .map(|s| {
                (
                    s.remaining,
                    Duration::from_micros(s.reset_after_us.max(0) as u64),
                )
            })
            .collect(),
        too_large,
        degraded: false,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// The shared backend failed and the failure mode is closed.
    #[error("rate limiter backend unavailable: {0}")]
    Backend(#[from] RedisError),
}

/// In-process limiter: a map from bucket to stored time behind one lock.
pub struct MemoryLimiter {
    epoch: Instant,
    buckets: Mutex<HashMap<String, i64>>,
}

impl Default for MemoryLimiter {
    fn default() -> Self {
        MemoryLimiter {
            epoch: Instant::now(),
            buckets: Mutex::new(HashMap::new()),
        }
    }
}

const SWEEP_AT: usize = 100_000;

impl MemoryLimiter {
    fn now_us(&self) -> i64 {
        self.epoch.elapsed().as_micros() as i64
    }

    pub fn check(&self, checks: &[LimitCheck]) -> LimitDecision {
        let now = self.now_us();
        let mut buckets = self.buckets.lock();
        if buckets.len() > SWEEP_AT {
            // A bucket whose time has passed is indistinguishable from an absent one.
            buckets.retain(|_, tat| *tat > now);
        }
        let steps: Vec<Step> = checks
            .iter()
            .map(|c| {
                gcra(
                    buckets.get(&c.bucket).copied(),
                    now,
                    c.limit,
                    c.period_us,
                    c.cost,
                )
            })
            .collect();
        let d = decide(checks, &steps);
        if d.allowed {
            for (c, s) in checks.iter().zip(&steps) {
                buckets.insert(c.bucket.clone(), s.tat_us);
            }
        }
        d
    }

    pub fn adjust(&self, checks: &[LimitCheck], delta: i64) {
        let now = self.now_us();
        let mut buckets = self.buckets.lock();
        for c in checks {
            let tat = gcra_adjust(
                buckets.get(&c.bucket).copied(),
                now,
                c.limit,
                c.period_us,
                delta,
            );
            if tat > now {
                buckets.insert(c.bucket.clone(), tat);
            } else {
                buckets.remove(&c.bucket);
            }
        }
    }
}

/// The GCRA step of [`gcra`] over several buckets, atomically, on Redis's clock.
/// ARGV: mode (`check` | `adjust`), then per key: limit, period_us, cost (adjust: delta).
/// Returns: allowed (0/1), retry_after_us, then per key: remaining, reset_after_us.
const GCRA_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local mode = ARGV[1]
local n = #KEYS
local olds, news, limits, periods, intervals = {}, {}, {}, {}, {}
local allowed = 1
local retry = 0
for i = 1, n do
  local limit = tonumber(ARGV[2 + (i - 1) * 3])
  local period = tonumber(ARGV[3 + (i - 1) * 3])
  local cost = tonumber(ARGV[4 + (i - 1) * 3])
  if limit < 1 then limit = 1 end
  local interval = period / limit
  local tat = tonumber(redis.call('GET', KEYS[i]) or now)
  if tat < now then tat = now end
  local new_tat = tat + math.floor(cost * interval + 0.5)
  if mode == 'check' then
    if cost > limit or new_tat - now > period then
      allowed = 0
      local r = new_tat - period - now
      if r > retry then retry = r end
    end
  elseif new_tat < now then
    new_tat = now
  end
  olds[i], news[i], limits[i], periods[i], intervals[i] = tat, new_tat, limit, period, interval
end
local out = {allowed, retry}
for i = 1, n do
  local stored = olds[i]
  if allowed == 1 then stored = news[i] end
  if allowed == 1 or mode ~= 'check' then
    local ttl = math.ceil((stored - now) / 1000) + 1
    if stored > now then
      redis.call('SET', KEYS[i], string.format('%.0f', stored), 'PX', ttl)
    else
      redis.call('DEL', KEYS[i])
    end
  end
  local rem = math.floor((periods[i] - (stored - now)) / intervals[i])
  if rem < 0 then rem = 0 end
  if rem > limits[i] then rem = limits[i] end
  out[#out + 1] = rem
  out[#out + 1] = stored - now
end
return out
"#;

/// Limiter shared by replicas through Redis.
pub struct RedisLimiter {
    conn: RedisConn,
    script: redis::Script,
    prefix: String,
}

impl RedisLimiter {
    pub fn new(conn: RedisConn) -> RedisLimiter {
        RedisLimiter {
            conn,
            script: redis::Script::new(GCRA_LUA),
            prefix: "strata:rl:".into(),
        }
    }

    async fn run(
        &self,
        mode: &str,
        checks: &[LimitCheck],
        delta: Option<i64>,
    ) -> Result<Vec<i64>, RedisError> {
        let mut inv = self.script.prepare_invoke();
        inv.arg(mode);
        for c in checks {
            inv.key(format!("{}{}", self.prefix, c.bucket));
            inv.arg(c.limit).arg(c.period_us);
            match delta {
                Some(d) => inv.arg(d),
                None => inv.arg(c.cost),
            };
        }
        self.conn.invoke(&inv).await
    }

    pub async fn check(&self, checks: &[LimitCheck]) -> Result<LimitDecision, RedisError> {
        let out = self.run("check", checks, None).await?;
        if out.len() != 2 + 2 * checks.len() {
            return Err(RedisError::Unavailable("unexpected script reply".into()));
        }
        let allowed = out[0] == 1;
        let too_large = checks.iter().position(|c| c.cost > c.limit);
        Ok(LimitDecision {
            allowed,
            retry_after: Duration::from_micros(out[1].max(0) as u64),
            states: out[2..]
                .chunks(2)
                .map(|p| {
                    (
                        p[0].max(0) as u64,
                        Duration::from_micros(p[1].max(0) as u64),
                    )
                })
                .collect(),
            too_large,
            degraded: false,
        })
    }

    pub async fn adjust(&self, checks: &[LimitCheck], delta: i64) -> Result<(), RedisError> {
        self.run("adjust", checks, Some(delta)).await.map(|_| ())
    }
}

/// The configured limiter.
pub enum Limiter {
    Memory(MemoryLimiter),
    Redis(RedisLimiter),
}

impl Limiter {
    /// Checks and (when admitted) charges every limit. Backend failures follow
    /// `on_error`, read from the live config by the caller (so a reload applies it):
    /// open admits (marked `degraded`), closed returns the error.
    pub async fn check(
        &self,
        checks: &[LimitCheck],
        on_error: FailureMode,
    ) -> Result<LimitDecision, LimitError> {
        if checks.is_empty() {
            return Ok(LimitDecision::unlimited(0));
        }
        match self {
            Limiter::Memory(m) => Ok(m.check(checks)),
            Limiter::Redis(limiter) => match limiter.check(checks).await {
                Ok(d) => Ok(d),
                Err(e) => match on_error {
                    FailureMode::Open => {
                        tracing::warn!(error = %e, "rate limiter backend failed; admitting (fail open)");
                        let mut d = LimitDecision::unlimited(checks.len());
                        d.degraded = true;
                        Ok(d)
                    }
                    FailureMode::Closed => Err(LimitError::Backend(e)),
                },
            },
        }
    }

    /// Charges (positive) or refunds (negative) `delta` units on every check's bucket.
    /// Backend failures are logged and otherwise ignored: the request already ran.
    pub async fn adjust(&self, checks: &[LimitCheck], delta: i64) {
        if checks.is_empty() || delta == 0 {
            return;
        }
        match self {
            Limiter::Memory(m) => m.adjust(checks, delta),
            Limiter::Redis(limiter) => {
                if let Err(e) = limiter.adjust(checks, delta).await {
                    tracing::warn!(error = %e, "rate limit reconcile failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000_000;

    #[test]
    fn gcra_allows_a_burst_of_limit_then_the_steady_rate() {
        let mut tat = None;
        let mut admitted = 0;
        for _ in 0..20 {
            let s = gcra(tat, 0, 10, MIN, 1);
            if s.allowed {
                admitted += 1;
                tat = Some(s.tat_us);
            }
        }
        assert_eq!(admitted, 10);
        let refused = gcra(tat, 0, 10, MIN, 1);
        assert!(!refused.allowed);
        assert_eq!(
            refused.retry_after_us, 6_000_000,
            "one slot frees every 6 s"
        );
        assert_eq!(refused.remaining, 0);
        // After 6 s exactly one more fits.
        let s = gcra(tat, 6_000_000, 10, MIN, 1);
        assert!(s.allowed);
        assert!(!gcra(Some(s.tat_us), 6_000_000, 10, MIN, 1).allowed);
    }

    #[test]
    fn gcra_costs_and_remaining() {
        let s = gcra(None, 0, 1000, MIN, 300);
        assert!(s.allowed);
        assert_eq!(s.remaining, 700);
        let s2 = gcra(Some(s.tat_us), 0, 1000, MIN, 800);
        assert!(!s2.allowed);
        assert_eq!(s2.tat_us, s.tat_us, "refusal charges nothing");
        assert!(
            !gcra(None, 0, 1000, MIN, 1001).allowed,
            "above capacity never fits"
        );
    }

    #[test]
    fn adjust_refunds_and_charges() {
        let s = gcra(None, 0, 1000, MIN, 500);
        let refunded = gcra_adjust(Some(s.tat_us), 0, 1000, MIN, -400);
        assert_eq!(gcra(Some(refunded), 0, 1000, MIN, 0).remaining, 900);
        let floor = gcra_adjust(Some(s.tat_us), 0, 1000, MIN, -5000);
        assert_eq!(floor, 0, "a refund never goes below empty");
    }

    fn check(bucket: &str, limit: u64, cost: u64) -> LimitCheck {
        LimitCheck {
            bucket: bucket.into(),
            limit,
            period_us: MIN,
            cost,
            kind: LimitKind::Requests,
        }
    }

    #[test]
    fn memory_limiter_is_all_or_nothing() {
        let m = MemoryLimiter::default();
        let both = [check("a", 2, 1), check("b", 100, 1)];
        assert!(m.check(&both).allowed);
        assert!(m.check(&both).allowed);
        let d = m.check(&both);
        assert!(!d.allowed);
        assert!(d.retry_after > Duration::from_secs(20));
        // "b" was not charged by the refused request: 98 left.
        let d = m.check(&[check("b", 100, 1)]);
        assert_eq!(d.states[0].0, 97);
        let big = m.check(&[check("c", 10, 11)]);
        assert_eq!(big.too_large, Some(0));
        assert!(!big.allowed);
    }
}
