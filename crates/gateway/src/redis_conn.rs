//! A shared Redis connection that never blocks the request path for long.
//!
//! Every call is bounded by a timeout. After a failure the connection is dropped and no new
//! connect is attempted for [`RETRY_AFTER`], so a dead Redis costs each request one
//! fast error, not one connect timeout; callers then apply their configured failure mode.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;

const RETRY_AFTER: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis url: {0}")]
    Url(String),
    #[error("redis unavailable: {0}")]
    Unavailable(String),
    #[error("redis call timed out")]
    Timeout,
}

pub struct RedisConn {
    client: redis::Client,
    timeout: Duration,
    state: Mutex<ConnState>,
}

struct ConnState {
    conn: Option<MultiplexedConnection>,
    down_until: Option<Instant>,
}

impl RedisConn {
    pub fn new(url: &str, timeout: Duration) -> Result<RedisConn, RedisError> {
        let client = redis::Client::open(url).map_err(|e| RedisError::Url(e.to_string()))?;
        Ok(RedisConn {
            client,
            timeout,
            state: Mutex::new(ConnState {
                conn: None,
                down_until: None,
            }),
        })
    }

    async fn connection(&self) -> Result<MultiplexedConnection, RedisError> {
        {
            let st = self.state.lock();
            if let Some(c) = &st.conn {
                return Ok(c.clone());
            }
            if let Some(until) = st.down_until {
                if Instant::now() < until {
                    return Err(RedisError::Unavailable("recently failed".into()));
                }
            }
        }
        let fut = self.client.get_multiplexed_async_connection();
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(c)) => {
                let mut st = self.state.lock();
                st.conn = Some(c.clone());
                st.down_until = None;
                Ok(c)
            }
            Ok(Err(e)) => {
                self.mark_down();
                Err(RedisError::Unavailable(e.to_string()))
            }
            Err(_) => {
                self.mark_down();
                Err(RedisError::Timeout)
            }
        }
    }

    fn mark_down(&self) {
        let mut st = self.state.lock();
        st.conn = None;
        st.down_until = Some(Instant::now() + RETRY_AFTER);
    }

    /// Runs one script invocation with the timeout; drops the connection on failure.
    pub async fn invoke<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, RedisError> {
        let mut conn = self.connection().await?;
        match tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if !is_script_error(&e) {
                    self.mark_down();
                }
                Err(RedisError::Unavailable(e.to_string()))
            }
            Err(_) => {
                self.mark_down();
                Err(RedisError::Timeout)
            }
        }
    }

    /// Runs one command with the timeout; drops the connection on failure.
    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, RedisError> {
        let mut conn = self.connection().await?;
        match tokio::time::timeout(self.timeout, cmd.query_async(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.mark_down();
                Err(RedisError::Unavailable(e.to_string()))
            }
            Err(_) => {
                self.mark_down();
                Err(RedisError::Timeout)
            }
        }
    }
}

fn is_script_error(e: &redis::RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::ResponseError)
}
