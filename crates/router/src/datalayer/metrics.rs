//! Reading an engine's `GET /metrics` into the scheduler's [`EndpointMetrics`], whatever the
//! engine kind: the page is parsed once, by `strata_api::model_server::parse_load` (the one
//! reader every Strata component uses), and the scheduler keeps the fields it scores on next
//! to when they were read. A body in which none of the kind's queue metrics appear is an
//! error, so an endpoint serving garbage is treated as stale rather than as idle.

use std::time::Duration;

pub use strata_api::model_server::{parse_load, LoadSample, MetricsError};

use crate::endpoint::EngineKind;
use crate::scheduling::EndpointMetrics;

impl EndpointMetrics {
    /// The scheduler's view of a load sample read at `updated`.
    pub fn from_load(load: &LoadSample, updated: Duration) -> EndpointMetrics {
        EndpointMetrics {
            waiting: load.waiting,
            running: load.running,
            kv_use: load.kv_use,
            block_size: load.block_size,
            num_blocks: load.num_blocks,
            max_lora: load.max_lora,
            lora_running: load.lora_running.clone(),
            lora_waiting: load.lora_waiting.clone(),
            updated,
        }
    }
}

/// Reads a `/metrics` body for an engine of `kind`; `updated` is stamped on the result.
pub fn parse_metrics(
    kind: EngineKind,
    body: &[u8],
    updated: Duration,
) -> Result<(EndpointMetrics, LoadSample), MetricsError> {
    let load = parse_load(kind, body)?;
    Ok((EndpointMetrics::from_load(&load, updated), load))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_millis(7);

    #[test]
    fn the_scheduler_sees_what_the_page_says() {
        let body = "vllm:num_requests_waiting 3\nvllm:num_requests_running 5\nvllm:kv_cache_usage_perc 0.25\nvllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"64\"} 1\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 1\n";
        let (m, load) = parse_metrics(EngineKind::Strata, body.as_bytes(), T).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_use), (3.0, 5.0, Some(0.25)));
        assert_eq!((m.block_size, m.num_blocks), (Some(32), Some(64)));
        assert_eq!(
            (m.max_lora, m.lora_running.as_slice()),
            (Some(2), &["a".to_string()][..])
        );
        assert_eq!(m.updated, T);
        assert_eq!(load.waiting, 3.0);
        assert!(parse_metrics(EngineKind::Vllm, b"<html>", T).is_err());
    }

    /// A real vLLM 0.32 page (CPU build, `--block-size 32`).
    #[test]
    fn reads_a_real_vllm_page() {
        let page = include_bytes!("../../../../tests/fixtures/vllm-0.32/metrics.txt");
        let (m, _) = parse_metrics(EngineKind::Vllm, page, T).unwrap();
        assert_eq!(m.block_size, Some(32));
        assert_eq!(m.num_blocks, Some(2912));
        assert_eq!((m.waiting, m.running), (0.0, 0.0));
    }
}
