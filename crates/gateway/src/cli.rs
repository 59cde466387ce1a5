//! Command-line entry points: `strata gateway` ([`GatewayArgs`], [`run`]) and
//! `strata keys create|list|revoke` ([`KeysArgs`], [`run_keys`]).
//!
//! `strata keys` talks to a running gateway's admin API over HTTP (not to the SQLite file)
//! so that the gateway's in-memory view of keys changes at the same moment as the store:
//! a revoked key is refused on the next request.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use serde_json::{json, Value};

use crate::config::{
    Config, ConfigHandle, ModelConfig, StoreBackend, TargetConfig, UpstreamConfig, UpstreamKind,
};
use crate::server;
use crate::state::{CreateKey, Gateway, GatewayOptions};
use crate::store::postgres::{PgOptions, PgStore};
use crate::store::sqlite::SqliteStore;
use crate::store::Store;

/// `strata gateway`: the OpenAI-compatible front with keys, limits, budgets and caching.
#[derive(Debug, Clone, clap::Args)]
pub struct GatewayArgs {
    /// `gateway.yaml`; reloaded on SIGHUP and when it changes.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 4000)]
    pub port: u16,
    /// SQLite database for keys, budgets, usage and audit (`:memory:` for none).
    /// Default: `$STRATA_HOME/gateway.db` (`~/.cache/strata/gateway.db`).
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Key for the `/admin` API; the admin API is off without one.
    #[arg(long, env = "STRATA_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Without a config: forward to this OpenAI-compatible base URL (e.g. a Strata router).
    #[arg(long)]
    pub upstream: Option<String>,
    /// With `--upstream`: the model names to expose (each forwarded under the same name).
    #[arg(long = "model", value_delimiter = ',')]
    pub models: Vec<String>,
    /// Create a key for this tenant at start and print it (used by `strata up`).
    #[arg(long)]
    pub create_key_for: Option<String>,
}

/// The default database path.
pub fn default_db_path() -> PathBuf {
    let home = std::env::var_os("STRATA_HOME")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("strata"))
        })
        .unwrap_or_else(|| PathBuf::from("."));
    home.join("gateway.db")
}

/// A config that forwards `models` unchanged to one upstream.
pub fn passthrough_config(upstream_url: &str, models: &[String]) -> Config {
    Config {
        upstreams: vec![UpstreamConfig {
            name: "default".into(),
            kind: UpstreamKind::Openai,
            base_url: upstream_url.to_string(),
            ..Default::default()
        }],
        models: models
            .iter()
            .map(|m| ModelConfig {
                name: m.clone(),
                targets: vec![TargetConfig {
                    upstream: "default".into(),
                    model: None,
                    weight: 1,
                }],
                cascade: None,
                fallbacks: vec![],
                aliases: vec![],
                try_timeout_ms: 30_000,
                timeout_ms: 60_000,
                retries: 1,
                backoff_ms: 50,
                price: Default::default(),
                context_length: None,
            })
            .collect(),
        ..Config::default()
    }
}

/// Builds the gateway state from arguments (without serving).
pub fn build(args: &GatewayArgs) -> anyhow::Result<Arc<Gateway>> {
    let config = match (&args.config, &args.upstream) {
        (Some(path), _) => {
            ConfigHandle::open(Some(path)).with_context(|| format!("loading {}", path.display()))?
        }
        (None, Some(url)) => {
            anyhow::ensure!(
                !args.models.is_empty(),
                "--upstream needs at least one --model NAME"
            );
            ConfigHandle::fixed(passthrough_config(url, &args.models))?
        }
        (None, None) => ConfigHandle::open(None)?,
    };
    let store_cfg = config.get().config.store.clone();
    let store: Arc<dyn Store> = match store_cfg.backend {
        StoreBackend::Postgres => {
            let url = store_cfg.url.clone().unwrap_or_default();
            Arc::new(
                PgStore::connect(PgOptions {
                    url,
                    timeout: std::time::Duration::from_millis(store_cfg.timeout_ms),
                })
                .context("connecting to the postgres store (store.url)")?,
            )
        }
        StoreBackend::Sqlite => {
            let db = args.db.clone().unwrap_or_else(default_db_path);
            if db.as_os_str() == ":memory:" {
                Arc::new(SqliteStore::in_memory()?)
            } else {
                Arc::new(
                    SqliteStore::open(&db).with_context(|| format!("opening {}", db.display()))?,
                )
            }
        }
    };
    Ok(Gateway::new(
        Arc::new(config),
        store,
        GatewayOptions {
            admin_key: args.admin_key.clone(),
            seed: None,
            ..Default::default()
        },
    )?)
}

/// Runs `strata gateway` until Ctrl-C.
pub async fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let gw = build(&args)?;
    if let Some(tenant) = &args.create_key_for {
        let (key, record) = gw.create_key(CreateKey {
            tenant: tenant.clone(),
            name: Some("generated at start".into()),
            ..Default::default()
        })?;
        println!(
            "gateway API key for tenant `{tenant}` (id {}): {key}",
            record.id
        );
    }
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(&(args.host.as_str(), args.port))
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| anyhow::anyhow!("cannot resolve {}", args.host))
        })?;
    if gw.admin_key.is_none() {
        tracing::warn!(
            "no admin key: the /admin API is disabled (set --admin-key or STRATA_ADMIN_KEY)"
        );
    }
    let running = server::spawn(gw, addr).await?;
    tracing::info!(addr = %running.addr, "gateway listening");
    tokio::signal::ctrl_c().await?;
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}

/// `strata keys`: manage API keys through a running gateway's admin API.
#[derive(Debug, Clone, clap::Args)]
pub struct KeysArgs {
    /// The gateway's base URL.
    #[arg(long, default_value = "http://127.0.0.1:4000", global = true)]
    pub url: String,
    /// The gateway's admin key.
    #[arg(long, env = "STRATA_ADMIN_KEY", hide_env_values = true, global = true)]
    pub admin_key: Option<String>,
    #[command(subcommand)]
    pub command: KeysCommand,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum KeysCommand {
    /// Create a key; prints it once.
    Create {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        name: Option<String>,
        /// Public model names this key may use (default: all).
        #[arg(long = "model", value_delimiter = ',')]
        models: Vec<String>,
        #[arg(long)]
        rpm: Option<u64>,
        #[arg(long)]
        tpm: Option<u64>,
        #[arg(long)]
        budget_usd: Option<f64>,
        /// How often the budget resets: daily, weekly or monthly (UTC); default: never.
        #[arg(long, value_parser = parse_period)]
        budget_period: Option<crate::budget::Period>,
        /// The user the key belongs to (whose user budget it also spends).
        #[arg(long)]
        user: Option<String>,
        /// `member` (default) or `tenant_admin` (manages its own tenant's keys).
        #[arg(long, value_parser = parse_role)]
        role: Option<crate::role::Role>,
    },
    /// List keys (ids, tenants, limits, spend; never secrets).
    List,
    /// Revoke a key by id; effective on the next request.
    Revoke { id: String },
    /// Usage per tenant, key and model.
    Usage {
        #[arg(long)]
        tenant: Option<String>,
    },
}

fn parse_period(s: &str) -> Result<crate::budget::Period, String> {
    crate::budget::Period::parse(s).ok_or_else(|| format!("`{s}`: daily, weekly or monthly"))
}

fn parse_role(s: &str) -> Result<crate::role::Role, String> {
    match crate::role::Role::parse(s) {
        Some(r @ (crate::role::Role::Member | crate::role::Role::TenantAdmin)) => Ok(r),
        _ => Err(format!("`{s}`: member or tenant_admin")),
    }
}

/// Runs `strata keys ...`, printing JSON.
pub async fn run_keys(args: KeysArgs) -> anyhow::Result<()> {
    let out = keys_request(&args).await?;
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Performs one `strata keys` command and returns the gateway's JSON answer.
pub async fn keys_request(args: &KeysArgs) -> anyhow::Result<Value> {
    let admin = args
        .admin_key
        .clone()
        .context("an admin key is needed: --admin-key or STRATA_ADMIN_KEY")?;
    let client = reqwest::Client::builder().no_proxy().build()?;
    let base = args.url.trim_end_matches('/');
    let req = match &args.command {
        KeysCommand::Create {
            tenant,
            name,
            models,
            rpm,
            tpm,
            budget_usd,
            budget_period,
            user,
            role,
        } => client.post(format!("{base}/admin/keys")).json(&json!({
            "tenant": tenant, "name": name, "allowed_models": models,
            "rpm": rpm, "tpm": tpm, "budget_usd": budget_usd,
            "budget_period": budget_period, "user": user, "role": role,
        })),
        KeysCommand::List => client.get(format!("{base}/admin/keys")),
        KeysCommand::Revoke { id } => client.delete(format!("{base}/admin/keys/{id}")),
        KeysCommand::Usage { tenant } => {
            let mut r = client.get(format!("{base}/admin/usage"));
            if let Some(t) = tenant {
                r = r.query(&[("tenant", t)]);
            }
            r
        }
    };
    let resp = req
        .bearer_auth(admin)
        .send()
        .await
        .with_context(|| format!("contacting {base}"))?;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    anyhow::ensure!(status.is_success(), "gateway answered {status}: {body}");
    Ok(body)
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
        Gateway(GatewayArgs),
        Keys(KeysArgs),
    }

    #[test]
    fn args_parse_as_the_cli_will_wire_them() {
        let top = Top::try_parse_from([
            "strata",
            "gateway",
            "--upstream",
            "http://127.0.0.1:8000",
            "--model",
            "a,b",
            "--create-key-for",
            "default",
        ])
        .unwrap();
        let Cmd::Gateway(g) = top.cmd else { panic!() };
        assert_eq!(g.port, 4000);
        assert_eq!(g.models, ["a", "b"]);
        let top = Top::try_parse_from([
            "strata",
            "keys",
            "create",
            "--tenant",
            "t",
            "--rpm",
            "5",
            "--budget-period",
            "weekly",
            "--role",
            "tenant_admin",
            "--url",
            "http://x:1",
        ])
        .unwrap();
        let Cmd::Keys(k) = top.cmd else { panic!() };
        assert_eq!(k.url, "http://x:1");
        assert!(matches!(
            k.command,
            KeysCommand::Create {
                rpm: Some(5),
                budget_period: Some(crate::budget::Period::Weekly),
                role: Some(crate::role::Role::TenantAdmin),
                ..
            }
        ));
        for bad in [["--budget-period", "hourly"], ["--role", "platform_admin"]] {
            let args = ["strata", "keys", "create", "--tenant", "t", bad[0], bad[1]];
            assert!(Top::try_parse_from(args).is_err(), "{bad:?}");
        }
        let top = Top::try_parse_from(["strata", "keys", "revoke", "abc"]).unwrap();
        let Cmd::Keys(k) = top.cmd else { panic!() };
        assert!(matches!(k.command, KeysCommand::Revoke { ref id } if id == "abc"));
    }

    #[test]
    fn passthrough_config_is_valid() {
        let c = passthrough_config("http://127.0.0.1:8000", &["m".into()]);
        c.validate().unwrap();
        assert!(crate::config::Resolved::new(c)
            .unwrap()
            .model("m")
            .is_some());
    }
}
