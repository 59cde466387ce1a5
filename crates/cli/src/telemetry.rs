//! Logging and trace export for every role the `strata` binary runs.
//!
//! Logs go to stderr through `tracing-subscriber`'s fmt layer, filtered by `--log` /
//! `RUST_LOG`. Trace spans (`tracing` target [`SPAN_TARGET`], made by the gateway, router
//! and engine through `strata_api::trace`) are exported over OTLP/HTTP (protobuf) only when
//! an endpoint is configured, by `--otlp-endpoint` or the standard variables
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`; the service name
//! is `OTEL_SERVICE_NAME` or the role's (`strata-gateway`, ...). Without an endpoint no
//! exporter exists and the trace spans are disabled at their call sites.

use strata_api::trace::SPAN_TARGET;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// The path OTLP/HTTP serves traces on, appended to a base endpoint.
const TRACES_PATH: &str = "/v1/traces";

/// Where and as whom to export, once resolved from the flag and the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpTarget {
    /// The full URL spans are POSTed to.
    pub traces_url: String,
    pub service_name: String,
}

/// The export target from `--otlp-endpoint` (a base URL, like
/// `OTEL_EXPORTER_OTLP_ENDPOINT`), then `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as
/// is), then `OTEL_EXPORTER_OTLP_ENDPOINT`; `None` when none is set or
/// `OTEL_SDK_DISABLED=true`. `env` reads a variable (the process environment in `main`).
pub fn resolve(
    flag: Option<&str>,
    default_service: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Option<OtlpTarget> {
    let set = |name: &str| {
        env(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return None;
    }
    let base = |b: &str| format!("{}{TRACES_PATH}", b.trim_end_matches('/'));
    let traces_url = match flag.map(str::trim).filter(|f| !f.is_empty()) {
        Some(f) => base(f),
        None => match set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(t) => t,
            None => base(&set("OTEL_EXPORTER_OTLP_ENDPOINT")?),
        },
    };
    let service_name = set("OTEL_SERVICE_NAME").unwrap_or_else(|| default_service.to_string());
    Some(OtlpTarget {
        traces_url,
        service_name,
    })
}

/// Flushes and stops the exporter when dropped (at the end of `main`).
pub struct TelemetryGuard {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("trace export: flushing at exit failed: {e}");
            }
        }
    }
}

/// The log filter: `RUST_LOG` when set, else `default`. Trace spans stay out of log lines
/// (as prefixes of every event inside them) unless the filter names their target.
fn log_filter(default: &str) -> EnvFilter {
    let spec = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| EnvFilter::try_new(s).is_ok())
        .unwrap_or_else(|| default.to_string());
    let spec = if spec.contains(SPAN_TARGET) {
        spec
    } else {
        format!("{SPAN_TARGET}=off,{spec}")
    };
    EnvFilter::try_new(&spec)
        .or_else(|_| EnvFilter::try_new(format!("{SPAN_TARGET}=off,info")))
        .unwrap_or_else(|_| EnvFilter::new("info"))
}

/// Installs the process's subscriber: logs, plus the OTLP exporter for `otlp`.
pub fn init(
    json: bool,
    default_filter: &str,
    otlp: Option<&OtlpTarget>,
) -> anyhow::Result<TelemetryGuard> {
    let filter = log_filter(default_filter);
    let logs: Box<dyn Layer<Registry> + Send + Sync> = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    #[cfg(feature = "otlp")]
    {
        let Some(target) = otlp else {
            tracing_subscriber::registry().with(logs).init();
            return Ok(TelemetryGuard { provider: None });
        };
        let (layer, provider) = otel::layer(target)?;
        tracing_subscriber::registry().with(logs).with(layer).init();
        strata_api::trace::install(Box::new(otel::Otel::new(&provider)));
        tracing::info!(url = %target.traces_url, service = %target.service_name, "exporting traces over OTLP/HTTP");
        Ok(TelemetryGuard {
            provider: Some(provider),
        })
    }
    #[cfg(not(feature = "otlp"))]
    {
        tracing_subscriber::registry().with(logs).init();
        if let Some(t) = otlp {
            tracing::warn!(url = %t.traces_url, "this build has no OTLP exporter (feature `otlp`); traces are not exported");
        }
        Ok(TelemetryGuard {})
    }
}

#[cfg(feature = "otlp")]
mod otel {
    use std::time::{Instant, SystemTime};

    use anyhow::Context as _;
    use opentelemetry::trace::{
        Span as _, SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
        Tracer as _, TracerProvider as _,
    };
    use opentelemetry::{Context, KeyValue};
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::trace::{SdkTracerProvider, Tracer};
    use opentelemetry_sdk::Resource;
    use strata_api::trace::{ChildSpan, Exporter, TraceParent, SPAN_TARGET};
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::filter::{Filtered, Targets};
    use tracing_subscriber::registry::LookupSpan;
    use tracing_subscriber::Layer;

    use super::OtlpTarget;

    type OtelLayer<S> = Filtered<tracing_opentelemetry::OpenTelemetryLayer<S, Tracer>, Targets, S>;

    /// The exporter's `tracing` layer (trace spans only) and the provider behind it.
    pub(super) fn layer<S>(target: &OtlpTarget) -> anyhow::Result<(OtelLayer<S>, SdkTracerProvider)>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(target.traces_url.clone())
            .build()
            .with_context(|| format!("OTLP exporter for {}", target.traces_url))?;
        // Batches leave from the processor's own thread (`OTEL_BSP_*` tune it), so a
        // request never waits on the collector.
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(
                Resource::builder()
                    .with_service_name(target.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("strata");
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_filter(Targets::new().with_target(SPAN_TARGET, tracing::Level::TRACE));
        Ok((layer, provider))
    }

    /// `strata_api::trace`'s hook over `tracing-opentelemetry`.
    pub(super) struct Otel {
        tracer: Tracer,
    }

    impl Otel {
        pub(super) fn new(provider: &SdkTracerProvider) -> Self {
            Self {
                tracer: provider.tracer("strata"),
            }
        }
    }

    /// Wall-clock time of `t`, measured back from now.
    fn wall(t: Instant) -> SystemTime {
        let (now_i, now_s) = (Instant::now(), SystemTime::now());
        now_s
            .checked_sub(now_i.saturating_duration_since(t))
            .unwrap_or(now_s)
    }

    impl Exporter for Otel {
        fn set_parent(&self, span: &tracing::Span, parent: &TraceParent) {
            let sc = SpanContext::new(
                TraceId::from_bytes(parent.trace_id),
                SpanId::from_bytes(parent.parent_id),
                TraceFlags::new(parent.flags),
                true,
                TraceState::default(),
            );
            span.set_parent(Context::new().with_remote_span_context(sc));
        }

        fn context_of(&self, span: &tracing::Span) -> Option<TraceParent> {
            let cx = span.context();
            let s = cx.span();
            let sc = s.span_context();
            sc.is_valid().then(|| TraceParent {
                trace_id: sc.trace_id().to_bytes(),
                parent_id: sc.span_id().to_bytes(),
                flags: sc.trace_flags().to_u8(),
            })
        }

        fn record_child(&self, parent: &tracing::Span, child: &ChildSpan<'_>) {
            let cx = parent.context();
            if !cx.span().span_context().is_valid() {
                return; // the parent is not recorded: neither is its child
            }
            let attributes: Vec<KeyValue> = child
                .attributes
                .iter()
                .map(|&(k, v)| KeyValue::new(k, v))
                .collect();
            let mut span = self
                .tracer
                .span_builder(child.name)
                .with_start_time(wall(child.start))
                .with_attributes(attributes)
                .start_with_context(&self.tracer, &cx);
            span.end_with_timestamp(wall(child.end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn no_endpoint_means_no_exporter() {
        assert_eq!(resolve(None, "strata-router", env(&[])), None);
        assert_eq!(
            resolve(
                Some("  "),
                "strata-router",
                env(&[("OTEL_SERVICE_NAME", "x")])
            ),
            None
        );
    }

    #[test]
    fn the_flag_wins_then_the_traces_variable_then_the_base_variable() {
        let all = [
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:1/custom"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://b:2/"),
        ];
        let t = resolve(Some("http://f:3"), "strata-engine", env(&all)).unwrap();
        assert_eq!(t.traces_url, "http://f:3/v1/traces");
        assert_eq!(t.service_name, "strata-engine");
        let t = resolve(None, "strata-engine", env(&all)).unwrap();
        assert_eq!(
            t.traces_url, "http://t:1/custom",
            "the signal's own URL is used as is"
        );
        let t = resolve(None, "strata-engine", env(&all[1..])).unwrap();
        assert_eq!(t.traces_url, "http://b:2/v1/traces");
    }

    #[test]
    fn service_name_and_disabling_come_from_the_standard_variables() {
        let t = resolve(
            Some("http://f:3"),
            "strata-gateway",
            env(&[("OTEL_SERVICE_NAME", "edge")]),
        )
        .unwrap();
        assert_eq!(t.service_name, "edge");
        assert_eq!(
            resolve(
                Some("http://f:3"),
                "strata-gateway",
                env(&[("OTEL_SDK_DISABLED", "TRUE")])
            ),
            None
        );
    }
}
