//! Reading an engine's `GET /metrics` (Prometheus text format) into one
//! [`EndpointMetrics`], whatever the engine kind (PROTOCOLS §2).
//!
//! Pure: text in, values out. The parser is deliberately small and tolerant (it reads
//! only sample lines and skips what it does not understand), but a body in which none of
//! the kind's queue metrics appear is an error, so that an endpoint serving garbage is
//! treated as stale rather than as idle.

use std::time::Duration;

use crate::endpoint::EngineKind;
use crate::scheduling::EndpointMetrics;

/// Metric names per engine kind.
#[derive(Debug, Clone, Copy)]
pub struct MetricNames {
    pub waiting: &'static str,
    pub running: &'static str,
    /// KV use 0..1, with an older alias.
    pub kv_use: &'static [&'static str],
    /// `(metric, label)` carrying the block size in a label, or the metric's value when
    /// the label is empty.
    pub block_size: Option<(&'static str, &'static str)>,
}

/// The names a kind exports (PROTOCOLS §2 table). Strata exports vLLM's.
pub const fn names(kind: EngineKind) -> MetricNames {
    match kind {
        EngineKind::Vllm | EngineKind::Strata => MetricNames {
            waiting: "vllm:num_requests_waiting",
            running: "vllm:num_requests_running",
            kv_use: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            block_size: Some(("vllm:cache_config_info", "block_size")),
        },
        EngineKind::Sglang => MetricNames {
            waiting: "sglang:num_queue_reqs",
            running: "sglang:num_running_reqs",
            kv_use: &["sglang:token_usage"],
            block_size: Some(("sglang:cache_config_info", "page_size")),
        },
        EngineKind::Trtllm => MetricNames {
            waiting: "trtllm_num_requests_waiting",
            running: "trtllm_num_requests_running",
            kv_use: &["trtllm_kv_cache_utilization"],
            block_size: Some(("trtllm_kv_cache_tokens_per_block", "")),
        },
        EngineKind::Llamacpp => MetricNames {
            waiting: "llamacpp:requests_deferred",
            running: "llamacpp:requests_processing",
            kv_use: &[],
            block_size: None,
        },
    }
}

/// vLLM's LoRA info metric (labels `max_lora`, `running_lora_adapters`,
/// `waiting_lora_adapters`).
pub const VLLM_LORA_INFO: &str = "vllm:lora_requests_info";

/// Why a `/metrics` body was not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    #[error("no `{0}` sample in the metrics body")]
    Missing(&'static str),
    #[error("metrics body is not UTF-8")]
    NotUtf8,
}

/// One sample line: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses one sample line; `None` for comments, blanks and anything malformed.
pub fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
    {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let value = rest.split_ascii_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse::<f64>().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` and returns the labels and what follows the `}`.
fn parse_labels(mut s: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(tail) = s.strip_prefix('}') {
            return Some((labels, tail));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key, value));
        s = s[end + 1..].trim_start();
        if let Some(tail) = s.strip_prefix(',') {
            s = tail;
        }
    }
}

fn split_names(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// Reads a `/metrics` body for an engine of `kind`. `updated` is stamped on the result.
/// Gauges that appear several times (one per `model_name`) are summed for queues and
/// maxed for KV use.
pub fn parse_metrics(
    kind: EngineKind,
    body: &[u8],
    updated: Duration,
) -> Result<EndpointMetrics, MetricsError> {
    let text = std::str::from_utf8(body).map_err(|_| MetricsError::NotUtf8)?;
    let n = names(kind);
    let mut m = EndpointMetrics {
        updated,
        ..EndpointMetrics::default()
    };
    let (mut saw_waiting, mut saw_running) = (false, false);
    let mut lora_ts = f64::NEG_INFINITY;
    for line in text.lines() {
        let Some(s) = parse_sample(line) else {
            continue;
        };
        if !s.value.is_finite() {
            continue;
        }
        if s.name == n.waiting {
            m.waiting += s.value.max(0.0);
            saw_waiting = true;
        } else if s.name == n.running {
            m.running += s.value.max(0.0);
            saw_running = true;
        } else if n.kv_use.contains(&s.name) {
            let v = s.value.clamp(0.0, 1.0);
            m.kv_use = Some(m.kv_use.map_or(v, |old: f64| old.max(v)));
        } else if let Some((metric, label)) = n.block_size.filter(|(mn, _)| *mn == s.name) {
            let _ = metric;
            let size = if label.is_empty() {
                Some(s.value)
            } else {
                s.label(label).and_then(|v| v.parse::<f64>().ok())
            };
            if let Some(size) = size.filter(|v| *v >= 1.0 && *v <= 1e6) {
                m.block_size = Some(size as u32);
            }
            if let Some(blocks) = s.label("num_gpu_blocks").and_then(|v| v.parse().ok()) {
                m.num_blocks = Some(blocks);
            }
        } else if s.name == VLLM_LORA_INFO && s.value >= lora_ts {
            // One series per change; the newest (largest timestamp value) is current.
            lora_ts = s.value;
            m.max_lora = s.label("max_lora").and_then(|v| v.parse().ok());
            m.lora_running = s
                .label("running_lora_adapters")
                .map(split_names)
                .unwrap_or_default();
            m.lora_waiting = s
                .label("waiting_lora_adapters")
                .map(split_names)
                .unwrap_or_default();
        }
    }
    if !saw_waiting {
        return Err(MetricsError::Missing(n.waiting));
    }
    if !saw_running {
        return Err(MetricsError::Missing(n.running));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_millis(7);

    #[test]
    fn vllm_body_maps_every_signal() {
        let body = r#"# HELP vllm:num_requests_waiting x
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 5
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",engine="0"} 1.0
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters="c"} 1.6e9
"#;
        let m = parse_metrics(EngineKind::Vllm, body.as_bytes(), T).unwrap();
        assert_eq!(m.waiting, 3.0);
        assert_eq!(m.running, 5.0);
        assert_eq!(m.kv_use, Some(0.25));
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_blocks, Some(2048));
        assert_eq!(m.max_lora, Some(4));
        assert_eq!(m.lora_running, vec!["a", "b"]);
        assert!(m.lora_waiting.is_empty());
        assert_eq!(m.updated, T);
        // Strata reads the same names.
        assert_eq!(
            parse_metrics(EngineKind::Strata, body.as_bytes(), T).unwrap(),
            m
        );
    }

    #[test]
    fn old_vllm_kv_name_is_accepted() {
        let body = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.5\n";
        let m = parse_metrics(EngineKind::Vllm, body.as_bytes(), T).unwrap();
        assert_eq!(m.kv_use, Some(0.5));
        assert_eq!(m.block_size, None);
    }

    #[test]
    fn other_kinds() {
        let sg = "sglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:num_running_reqs{model_name=\"m\"} 4\nsglang:token_usage{model_name=\"m\"} 0.9\nsglang:cache_config_info{page_size=\"1\"} 1\n";
        let m = parse_metrics(EngineKind::Sglang, sg.as_bytes(), T).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_use, m.block_size),
            (2.0, 4.0, Some(0.9), Some(1))
        );
        let trt = "trtllm_num_requests_waiting 1\ntrtllm_num_requests_running 2\ntrtllm_kv_cache_utilization 0.1\ntrtllm_kv_cache_tokens_per_block 32\n";
        let m = parse_metrics(EngineKind::Trtllm, trt.as_bytes(), T).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_use, m.block_size),
            (1.0, 2.0, Some(0.1), Some(32))
        );
        let lc = "# HELP llamacpp:requests_processing x\nllamacpp:requests_processing 1\nllamacpp:requests_deferred 6\n";
        let m = parse_metrics(EngineKind::Llamacpp, lc.as_bytes(), T).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_use), (6.0, 1.0, None));
        // A vLLM body read as SGLang has none of the names.
        let vllm = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n";
        assert_eq!(
            parse_metrics(EngineKind::Sglang, vllm.as_bytes(), T),
            Err(MetricsError::Missing("sglang:num_queue_reqs"))
        );
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        for body in [
            &b"\xff\xfe"[..],
            b"",
            b"<html>oops</html>",
            b"vllm:num_requests_waiting{a=\"unterminated 3\n",
            b"vllm:num_requests_waiting NaN\nvllm:num_requests_running +Inf\n",
            b"{}}}{{ 1 2 3\n\0\0",
        ] {
            assert!(
                parse_metrics(EngineKind::Vllm, body, T).is_err(),
                "{body:?}"
            );
        }
        // Out-of-range values are clamped.
        let m = parse_metrics(
            EngineKind::Vllm,
            b"vllm:num_requests_waiting -4\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 7\n",
            T,
        )
        .unwrap();
        assert_eq!((m.waiting, m.kv_use), (0.0, Some(1.0)));
    }

    #[test]
    fn label_escapes() {
        let s = parse_sample(r#"x{a="q\"b\\c",b="2"} 1 123"#).unwrap();
        assert_eq!(
            s.labels,
            vec![("a", "q\"b\\c".to_string()), ("b", "2".to_string())]
        );
        assert_eq!(s.value, 1.0);
        assert!(parse_sample("bad name 1").is_none());
        assert!(parse_sample("x{a=1} 1").is_none());
    }
}
