//! `strata bench`: an async, streaming load generator for any OpenAI-compatible server.
//!
//! A run flows one way: [`args`] checks flags into a [`LoadConfig`]; [`workload`] yields
//! sessions of seeded prompt [`prompt::Segment`]s; [`load`] offers them (closed-loop
//! users, open-loop arrivals, or a trace's timestamps) and [`client`] streams each
//! request, timing every chunk into a [`record::RequestRecord`]; [`report`] turns the
//! records into percentiles, rates, goodput and error counts ([`stats`] holds the
//! percentile definition); [`plot`] draws SVG charts; [`compare`] sets saved reports side
//! by side. Failed requests are data, never errors: a refused connection, an HTTP status,
//! a cut stream or a timeout is counted by kind in the report.
//!
//! Library use, e.g. from another crate's benchmark:
//!
//! ```no_run
//! # async fn demo() -> Result<(), strata_bench::BenchError> {
//! use std::time::Duration;
//! use strata_bench::*;
//! let config = LoadConfig {
//!     client: ClientConfig {
//!         url: "http://127.0.0.1:8000".into(),
//!         model: "m".into(),
//!         endpoint: Endpoint::Completions,
//!         prompt_mode: PromptMode::Text,
//!         ignore_eos: true,
//!         keepalive: true,
//!         timeout: Duration::from_secs(60),
//!         api_key: None,
//!     },
//!     workload: Workload::Random(RandomSpec { input_len: 128, output_len: 32, range_ratio: 0.0 }),
//!     load: LoadShape::Concurrency { users: 4 },
//!     stop: StopCondition { max_requests: Some(50), duration: None },
//!     seed: 1,
//!     slo: Slo::default(),
//!     label: "demo".into(),
//! };
//! let report = run_load(&config).await?;
//! println!("{}", report.render_text());
//! # Ok(()) }
//! ```

// Library code never unwraps or expects on what a client, file or network controls (the
// workspace-wide rule; tests may).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]
pub mod args;
mod cli;
pub mod client;
pub mod compare;
pub mod error;
pub mod load;
pub mod plot;
pub mod prompt;
pub mod record;
pub mod report;
pub mod stats;
pub mod workload;

pub use args::{BenchArgs, BenchCommand, CompareArgs, RunArgs};
pub use cli::run;
pub use client::{ClientConfig, Endpoint, PromptMode};
pub use error::BenchError;
pub use load::{
    run_load, run_load_with, Arrival, LoadConfig, LoadShape, StopCondition, StopHandle,
};
pub use record::{FailureKind, RequestRecord};
pub use report::{Report, Slo};
pub use workload::{MultiTurnSpec, RandomSpec, SharedPrefixSpec, TraceEntry, TraceSpec, Workload};
