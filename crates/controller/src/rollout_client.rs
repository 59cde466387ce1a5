//! `strata rollout start|status|promote|rollback`: the client of the rollout API that
//! `strata up` serves under `/controller/rollout/` on its front port, and the wire types
//! both sides share.
//!
//! The API (JSON in and out; errors are OpenAI-shaped):
//!
//! - `POST /controller/rollout/start` with [`StartRollout`] → the new rollout's
//!   [`RolloutView`]; `400` for bad input (an unknown baseline, bad steps), `409` while a
//!   rollout is in progress.
//! - `GET /controller/rollout/status` → `{"rollout": RolloutView | null}` (the current or
//!   last rollout).
//! - `POST /controller/rollout/promote`, `POST /controller/rollout/rollback` → the
//!   [`RolloutView`] after the operator's action; `409` when no rollout is in progress.

use std::collections::BTreeMap;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::driver::ReplicaInfo;
use crate::rollout::{Phase, RolloutState};

/// The body of `POST /controller/rollout/start`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartRollout {
    /// The new version (a model name or GGUF path, as `strata up --model` takes).
    pub model: String,
    /// The version serving now; must be the one `strata up` runs.
    pub baseline: String,
    /// Canary shares in percent (default: the stack's `rollout.steps`).
    #[serde(default)]
    pub steps: Option<Vec<u8>>,
    /// Canary replicas (default: the stack's `canary_replicas`).
    #[serde(default)]
    pub replicas: Option<u32>,
    /// Extra `strata engine` flags for the canary replicas only, after the stack's own.
    #[serde(default)]
    pub engine_args: Vec<String>,
}

/// A rollout as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutView {
    /// Counts rollouts since `strata up` started.
    pub id: u64,
    pub canary: String,
    pub baseline: String,
    /// The name clients send; both versions serve it.
    pub served_model: String,
    pub steps: Vec<u8>,
    /// The analysis state (phase, step index, canary weight).
    pub state: RolloutState,
    /// The router's split now (`{version: weight}`).
    pub split: BTreeMap<String, f64>,
    /// Canary replicas running now (none once rolled back).
    pub canary_replicas: Vec<ReplicaSummary>,
    /// Canary replicas that crashed or never became ready during the rollout.
    pub canary_faults: u32,
    /// 5xx answers that named no replica (not counted for either version).
    pub unattributed_errors: u64,
    /// Every decision, oldest first, with its evidence (checks, per-version stats).
    pub decisions: Vec<serde_json::Value>,
}

impl RolloutView {
    pub fn phase(&self) -> Phase {
        self.state.phase
    }
}

/// One replica in a [`RolloutView`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaSummary {
    pub id: String,
    pub url: String,
    /// `starting`, `ready` or `draining`.
    pub phase: String,
}

impl From<&ReplicaInfo> for ReplicaSummary {
    fn from(r: &ReplicaInfo) -> Self {
        ReplicaSummary {
            id: r.id.clone(),
            url: r.url.clone(),
            phase: serde_json::to_value(r.phase)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
        }
    }
}

/// `GET /controller/rollout/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutStatusResponse {
    pub rollout: Option<RolloutView>,
}

/// `strata rollout ...`: talk to a running `strata up`.
#[derive(clap::Args, Debug, Clone)]
pub struct RolloutClientArgs {
    /// The `strata up` front address.
    #[arg(long, default_value = "http://127.0.0.1:8080", global = true)]
    pub url: String,
    /// The CA (PEM) an `https://` front is verified against, on top of the system's roots
    /// (`strata up --tls` prints its file).
    #[arg(long, value_name = "FILE", global = true)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Print the API's JSON instead of a summary.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: RolloutClientCommand,
}

/// The rollout subcommands.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum RolloutClientCommand {
    /// Start canary replicas of MODEL and move BASELINE's traffic to them step by step.
    Start {
        /// The new version (a model name or GGUF path).
        #[arg(long)]
        model: String,
        /// The version serving now.
        #[arg(long)]
        baseline: String,
        /// Canary shares in percent, rising, ending at 100 [default: the stack's].
        #[arg(long, value_parser = crate::rollout::parse_steps)]
        steps: Option<std::vec::Vec<u8>>,
        /// Canary replicas [default: the stack's `canary_replicas`].
        #[arg(long)]
        replicas: Option<u32>,
        /// An extra `strata engine` flag for the canary replicas only (repeatable).
        #[arg(long = "engine-arg", allow_hyphen_values = true)]
        engine_args: Vec<String>,
    },
    /// Show the rollout's step, split and decisions with their evidence.
    Status,
    /// Send all traffic to the new version now and stop the baseline's replicas.
    Promote,
    /// Send all traffic back to the baseline now and stop the canary replicas.
    Rollback,
}

/// A failed API call: the server's OpenAI-shaped message, or why it could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{url}: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{message} (HTTP {status})")]
    Api { status: u16, message: String },
    #[error("{url}: unexpected answer: {detail}")]
    Bad { url: String, detail: String },
}

/// A client of one `strata up`.
#[derive(Debug, Clone)]
pub struct RolloutClient {
    base: String,
    http: reqwest::Client,
}

impl RolloutClient {
    pub fn new(url: &str) -> RolloutClient {
        Self::with_client(url, reqwest::Client::new())
    }

    /// A client over `http` (one trusting the front's CA: [`crate::tls_client::http_client`]).
    pub fn with_client(url: &str, http: reqwest::Client) -> RolloutClient {
        RolloutClient {
            base: format!("{}/controller/rollout", url.trim_end_matches('/')),
            http,
        }
    }

    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        op: &str,
        body: Option<&StartRollout>,
    ) -> Result<T, ClientError> {
        let url = format!("{}/{op}", self.base);
        let mut req = self.http.request(method, &url);
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req
            .send()
            .await
            .map_err(|source| ClientError::Unreachable {
                url: url.clone(),
                source,
            })?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|source| ClientError::Unreachable {
                url: url.clone(),
                source,
            })?;
        if !status.is_success() {
            let message = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                .unwrap_or(text);
            return Err(ClientError::Api {
                status: status.as_u16(),
                message,
            });
        }
        serde_json::from_str(&text).map_err(|e| ClientError::Bad {
            url,
            detail: e.to_string(),
        })
    }

    pub async fn start(&self, req: &StartRollout) -> Result<RolloutView, ClientError> {
        self.call(reqwest::Method::POST, "start", Some(req)).await
    }

    pub async fn status(&self) -> Result<RolloutStatusResponse, ClientError> {
        self.call(reqwest::Method::GET, "status", None).await
    }

    pub async fn promote(&self) -> Result<RolloutView, ClientError> {
        self.call(reqwest::Method::POST, "promote", None).await
    }

    pub async fn rollback(&self) -> Result<RolloutView, ClientError> {
        self.call(reqwest::Method::POST, "rollback", None).await
    }
}

/// A few lines for people: phase, step, split, the last decision.
pub fn summary(v: &RolloutView) -> String {
    let phase = serde_json::to_value(v.state.phase)
        .ok()
        .and_then(|p| p.as_str().map(str::to_string))
        .unwrap_or_default();
    let split: Vec<String> = v.split.iter().map(|(g, w)| format!("{g} {w}%")).collect();
    let mut out = format!(
        "rollout {}: {} -> {} ({phase}), step {}/{} at {}% canary\n  split: {}\n  canary replicas: {} running, {} faults\n",
        v.id,
        v.baseline,
        v.canary,
        (v.state.step + 1).min(v.steps.len()),
        v.steps.len(),
        v.state.weight,
        if split.is_empty() { "none".to_string() } else { split.join(", ") },
        v.canary_replicas.len(),
        v.canary_faults,
    );
    if let Some(d) = v.decisions.last() {
        let action = d["action"]["action"].as_str().unwrap_or("?");
        let reason = d["reason"].as_str().unwrap_or("");
        out.push_str(&format!("  last decision: {action}: {reason}\n"));
        if let Some(checks) = d["checks"].as_array() {
            for c in checks {
                out.push_str(&format!(
                    "    {} canary {} baseline {} limit {} {}\n",
                    c["metric"].as_str().unwrap_or("?"),
                    c["canary"],
                    c["baseline"],
                    c["limit"],
                    if c["passed"] == true { "ok" } else { "FAIL" }
                ));
            }
        }
    }
    out
}

/// Runs one subcommand; an API error is returned (the CLI exits non-zero with it).
pub async fn run(args: RolloutClientArgs) -> anyhow::Result<()> {
    let http = crate::tls_client::http_client(args.ca_file.as_deref()).context("--ca-file")?;
    let client = RolloutClient::with_client(&args.url, http);
    let view = match args.command {
        RolloutClientCommand::Start {
            model,
            baseline,
            steps,
            replicas,
            engine_args,
        } => client
            .start(&StartRollout {
                model,
                baseline,
                steps,
                replicas,
                engine_args,
            })
            .await
            .context("rollout start")?,
        RolloutClientCommand::Status => {
            let s = client.status().await.context("rollout status")?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&s)?);
                return Ok(());
            }
            match s.rollout {
                Some(v) => v,
                None => {
                    println!("no rollout has been started");
                    return Ok(());
                }
            }
        }
        RolloutClientCommand::Promote => client.promote().await.context("rollout promote")?,
        RolloutClientCommand::Rollback => client.rollback().await.context("rollout rollback")?,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&view)?);
    } else {
        print!("{}", summary(&view));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Top {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(clap::Subcommand)]
    enum Cmd {
        Rollout(RolloutClientArgs),
    }

    #[test]
    fn args_parse_and_steps_are_checked() {
        let t = Top::try_parse_from([
            "s",
            "rollout",
            "start",
            "--model",
            "b",
            "--baseline",
            "a",
            "--steps",
            "10,100",
            "--engine-arg=--mock-ttft-ms",
            "--engine-arg=5",
        ])
        .unwrap();
        let Cmd::Rollout(a) = t.cmd;
        assert_eq!(a.url, "http://127.0.0.1:8080");
        let RolloutClientCommand::Start {
            steps, engine_args, ..
        } = a.command
        else {
            panic!()
        };
        assert_eq!(steps, Some(vec![10, 100]));
        assert_eq!(engine_args, ["--mock-ttft-ms", "5"]);
        assert!(Top::try_parse_from([
            "s",
            "rollout",
            "start",
            "--model",
            "b",
            "--baseline",
            "a",
            "--steps",
            "50,10"
        ])
        .is_err());
        let t = Top::try_parse_from(["s", "rollout", "--url", "http://h:1", "status"]).unwrap();
        let Cmd::Rollout(a) = t.cmd;
        assert_eq!(a.url, "http://h:1");
    }

    #[tokio::test]
    async fn errors_carry_the_servers_message() {
        use axum::routing::post;
        let app = axum::Router::new().route(
            "/controller/rollout/promote",
            post(|| async {
                (
                    axum::http::StatusCode::CONFLICT,
                    r#"{"error":{"message":"No rollout is in progress.","type":"invalid_request_error","param":null,"code":"no_rollout"}}"#,
                )
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        let c = RolloutClient::new(&format!("http://{addr}/"));
        let e = c.promote().await.unwrap_err();
        assert!(matches!(e, ClientError::Api { status: 409, .. }), "{e}");
        assert!(e.to_string().contains("No rollout is in progress."), "{e}");
        // Nothing listening.
        let dead = RolloutClient::new("http://127.0.0.1:9");
        assert!(matches!(
            dead.status().await.unwrap_err(),
            ClientError::Unreachable { .. }
        ));
    }
}
