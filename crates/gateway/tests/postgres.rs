//! The Postgres store with a real PostgreSQL server (Debian package `postgresql`), started
//! by each test in a throwaway cluster on a loopback port: the store's contract, two
//! gateways sharing one budget, and a database restart under load.
//! These tests FAIL (never skip) when the PostgreSQL server binaries are not installed.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use strata_gateway::budget::Period;
use strata_gateway::config::RateLimits;
use strata_gateway::role::Role;
use strata_gateway::store::postgres::{PgOptions, PgStore};
use strata_gateway::store::{
    AuditEntry, BudgetHold, HoldOutcome, Holder, KeyRecord, Store, UsageEvent, UsageFilter,
};
use strata_gateway::{Config, ConfigHandle, CreateKey, Gateway, GatewayOptions, RunningGateway};

/// A PostgreSQL cluster in a temporary directory, stopped and removed on drop.
struct Postgres {
    bin: PathBuf,
    root: PathBuf,
    port: u16,
    /// Run the server binaries as the `postgres` user (the server refuses root).
    as_postgres: bool,
}

fn pg_bin_dir() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    found.retain(|p| p.join("postgres").exists() && p.join("initdb").exists());
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!("no PostgreSQL server under /usr/lib/postgresql/*/bin; install the Debian package `postgresql`")
    })
}

impl Postgres {
    fn start() -> Postgres {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let bin = pg_bin_dir();
        let root = std::env::temp_dir().join(format!(
            "strata-pg-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let as_postgres = unsafe_is_root();
        if as_postgres {
            let ok = Command::new("chown")
                .args(["postgres:postgres", root.to_str().unwrap()])
                .status()
                .unwrap()
                .success();
            assert!(ok, "cannot chown {}", root.display());
        }
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let pg = Postgres {
            bin,
            root,
            port,
            as_postgres,
        };
        let data = pg.data();
        pg.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "strata",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        pg.start_server();
        pg
    }

    fn data(&self) -> PathBuf {
        self.root.join("data")
    }

    fn command(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self
            .command(tool)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the server and waits until it accepts connections.
    fn start_server(&self) {
        let opts = format!(
            "-k {} -p {} -h 127.0.0.1 -F -c max_connections=60",
            self.root.display(),
            self.port
        );
        let log = self.root.join("server.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-o",
                &opts,
                "-w",
                "-t",
                "30",
                "start",
            ],
        );
    }

    fn stop_server(&self) {
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-m",
                "fast",
                "-w",
                "stop",
            ],
        );
    }

    fn url(&self) -> String {
        format!(
            "postgres://strata@127.0.0.1:{}/postgres?connect_timeout=2",
            self.port
        )
    }

    fn store(&self) -> Arc<PgStore> {
        Arc::new(
            PgStore::connect(PgOptions {
                url: self.url(),
                timeout: Duration::from_secs(2),
            })
            .unwrap(),
        )
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .args([
                "-D",
                self.data().to_str().unwrap(),
                "-m",
                "immediate",
                "stop",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Whether this process runs as root (the server binaries then run as `postgres`).
fn unsafe_is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn key_record(id: &str, tenant: &str) -> KeyRecord {
    KeyRecord {
        id: id.into(),
        tenant: tenant.into(),
        name: "test".into(),
        salt_hex: "00".into(),
        hash_hex: "11".into(),
        allowed_models: vec!["m".into()],
        limits: RateLimits {
            rpm: Some(10),
            tpm: None,
        },
        budget_micros: Some(5),
        budget_period: Some(Period::Weekly),
        spend_micros: 0,
        created_at: 1,
        revoked_at: None,
        user: Some("alice".into()),
        role: Role::TenantAdmin,
    }
}

fn event(id: &str, cost: i64) -> UsageEvent {
    UsageEvent {
        id: id.into(),
        ts: 10,
        key_id: "a".into(),
        tenant: "t1".into(),
        user: "alice".into(),
        model: "m".into(),
        upstream: "u".into(),
        input_tokens: 3,
        output_tokens: 4,
        cost_micros: cost,
        cached: false,
        status: 200,
    }
}

#[test]
fn postgres_store_keeps_the_store_contract() {
    let pg = Postgres::start();
    let s = pg.store();
    let known = strata_gateway::store::postgres::MIGRATIONS.len() as i64;
    assert_eq!(s.schema_version().unwrap(), known);
    // A second store on the same database migrates nothing twice.
    assert_eq!(pg.store().schema_version().unwrap(), known);

    s.insert_key(&key_record("a", "t1")).unwrap();
    assert_eq!(s.get_key("a").unwrap().unwrap(), key_record("a", "t1"));
    assert!(s.get_key("missing").unwrap().is_none());
    assert!(s.revoke_key("a", 99).unwrap());
    assert!(!s.revoke_key("a", 100).unwrap(), "second revoke is a no-op");
    assert_eq!(s.get_key("a").unwrap().unwrap().revoked_at, Some(99));
    assert!(s
        .update_key("a", RateLimits::default(), (None, None), &[])
        .unwrap());
    assert!(!s
        .update_key("zz", RateLimits::default(), (None, None), &[])
        .unwrap());
    let k = s.get_key("a").unwrap().unwrap();
    assert!(k.allowed_models.is_empty() && k.budget_micros.is_none());
    assert_eq!(s.list_keys().unwrap().len(), 1);
    s.upsert_tenant(
        "t1",
        RateLimits {
            rpm: Some(3),
            tpm: None,
        },
        (Some(1000), None),
    )
    .unwrap();
    let t = &s.list_tenants().unwrap()[0];
    assert_eq!((t.limits.rpm, t.budget_micros), (Some(3), Some(1000)));

    // Ledger: a row id seen before is not written (or charged) again.
    s.record_usage(&[event("e1", 7), event("e2", 7)]).unwrap();
    s.record_usage(&[event("e2", 7), event("e3", 7)]).unwrap();
    s.record_usage(&[event("", 1), event("", 1)]).unwrap();
    let rows = s.usage(&UsageFilter::default()).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].requests, 5);
    assert_eq!(rows[0].cost_micros, 23);
    assert_eq!(s.get_key("a").unwrap().unwrap().spend_micros, 23);
    assert_eq!(s.list_tenants().unwrap()[0].spend_micros, 23);
    let since = s
        .usage(&UsageFilter {
            since: Some(11),
            ..Default::default()
        })
        .unwrap();
    assert!(since.is_empty());

    s.audit(&AuditEntry {
        ts: 1,
        actor: "admin".into(),
        action: "create_key".into(),
        target: "a".into(),
        detail: "{}".into(),
    })
    .unwrap();
    assert_eq!(s.list_audit(10).unwrap()[0].action, "create_key");

    // Holds: budget 1000, spent 23.
    let hold = |id: &str, amount: i64, now: i64| BudgetHold {
        id: id.into(),
        tenant: "t1".into(),
        key_id: "a".into(),
        amount_micros: amount,
        tenant_budget_micros: Some(1000),
        key_budget_micros: None,
        tenant_period: None,
        key_period: None,
        user: String::new(),
        user_budget_micros: None,
        user_period: None,
        now,
        expires_at: now + 60,
    };
    assert!(s.shares_budgets());
    assert_eq!(
        s.hold_budget(&hold("h1", 900, 10)).unwrap(),
        HoldOutcome::Held
    );
    assert_eq!(
        s.hold_budget(&hold("h2", 50, 10)).unwrap(),
        HoldOutcome::Held
    );
    // 23 spent + 950 held < 1000: one more is admitted; then the budget is taken.
    assert_eq!(
        s.hold_budget(&hold("h3", 50, 10)).unwrap(),
        HoldOutcome::Held
    );
    assert_eq!(
        s.hold_budget(&hold("h4", 1, 10)).unwrap(),
        HoldOutcome::Spent {
            holder: Holder::Tenant,
            spent_micros: 1023,
            budget_micros: 1000
        }
    );
    // A released hold frees its amount; the ledger row of a hold releases it too.
    s.release_hold("h1").unwrap();
    assert_eq!(
        s.hold_budget(&hold("h5", 1, 10)).unwrap(),
        HoldOutcome::Held
    );
    s.record_usage(&[event("h2", 10)]).unwrap();
    // Holds that lapsed (a replica that died) no longer count.
    assert_eq!(
        s.hold_budget(&hold("h6", 1, 100)).unwrap(),
        HoldOutcome::Held
    );
}

/// Budget periods in the shared store: a user's spend, the period windows, and a daily
/// tenant budget that holds refuse today and admit again tomorrow.
#[test]
fn postgres_store_keeps_users_and_period_windows() {
    let pg = Postgres::start();
    let s = pg.store();
    s.insert_key(&key_record("a", "t1")).unwrap();
    let day = 1_796_256_000; // 2026-12-03 00:00 UTC
    let at = |id: &str, ts: i64, cost: i64| UsageEvent {
        ts,
        ..event(id, cost)
    };
    s.record_usage(&[at("p1", day + 5, 600), at("p2", day + 6, 500)])
        .unwrap();
    // The same rows again are not counted twice, in the windows either.
    s.record_usage(&[at("p2", day + 6, 500)]).unwrap();
    let windows = s.list_period_spend().unwrap();
    let daily = |holder: Holder| {
        windows
            .iter()
            .find(|w| w.holder == holder && w.period == Period::Daily)
            .unwrap()
            .window
    };
    assert_eq!(
        (daily(Holder::Tenant).start, daily(Holder::Tenant).micros),
        (day, 1100)
    );
    assert_eq!(daily(Holder::User).micros, 1100);
    assert_eq!(daily(Holder::Key).micros, 1100);
    let users = s.list_users().unwrap();
    assert_eq!(
        (users[0].name.as_str(), users[0].spend_micros),
        ("alice", 1100)
    );
    s.upsert_user("t1", "alice", (Some(7), Some(Period::Monthly)))
        .unwrap();
    assert_eq!(
        s.list_users().unwrap()[0].budget_period,
        Some(Period::Monthly)
    );
    let rows = s
        .usage(&UsageFilter {
            user: Some("alice".into()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(rows[0].cost_micros, 1100);
    let hold = |id: &str, now: i64| BudgetHold {
        id: id.into(),
        tenant: "t1".into(),
        key_id: "a".into(),
        amount_micros: 1,
        tenant_budget_micros: Some(1000),
        key_budget_micros: None,
        tenant_period: Some(Period::Daily),
        key_period: None,
        user: String::new(),
        user_budget_micros: None,
        user_period: None,
        now,
        expires_at: now + 60,
    };
    assert!(matches!(
        s.hold_budget(&hold("today", day + 100)).unwrap(),
        HoldOutcome::Spent {
            holder: Holder::Tenant,
            spent_micros: 1100,
            ..
        }
    ));
    assert_eq!(
        s.hold_budget(&hold("tomorrow", day + 86_400 + 1)).unwrap(),
        HoldOutcome::Held,
        "a new day: the daily budget is whole again"
    );
    // A user's weekly budget of 1200: 1100 spent this week, then holds count until it is
    // reached; one user's holds are not another's.
    let user_hold = |id: &str, user: &str, amount: i64| BudgetHold {
        id: id.into(),
        tenant: "t1".into(),
        key_id: "a".into(),
        amount_micros: amount,
        tenant_budget_micros: None,
        key_budget_micros: None,
        tenant_period: None,
        key_period: None,
        user: user.into(),
        user_budget_micros: Some(1200),
        user_period: Some(Period::Weekly),
        now: day + 200,
        expires_at: day + 900,
    };
    assert_eq!(
        s.hold_budget(&user_hold("u1", "alice", 150)).unwrap(),
        HoldOutcome::Held
    );
    assert_eq!(
        s.hold_budget(&user_hold("u2", "alice", 1)).unwrap(),
        HoldOutcome::Spent {
            holder: Holder::User,
            spent_micros: 1250,
            budget_micros: 1200
        }
    );
    assert_eq!(
        s.hold_budget(&user_hold("u3", "bob", 1)).unwrap(),
        HoldOutcome::Held,
        "bob has spent nothing"
    );
}

/// A database at schema version 1 (before users and periods) opens, migrates and keeps
/// its rows.
#[test]
fn postgres_store_opens_a_version_1_database() {
    let pg = Postgres::start();
    let v1 = strata_gateway::store::postgres::MIGRATIONS[0];
    let port = pg.port.to_string();
    let sql = format!(
        "{v1}; CREATE TABLE strata_schema (version BIGINT NOT NULL); \
         INSERT INTO strata_schema VALUES (1); \
         INSERT INTO api_keys (id, tenant, name, salt, hash, budget_micros, spend_micros, created_at) \
         VALUES ('old', 't', 'n', '00', '11', 7, 3, 1);"
    );
    pg.run(
        "psql",
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "strata",
            "-d",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            &sql,
        ],
    );
    let s = pg.store();
    assert_eq!(
        s.schema_version().unwrap(),
        strata_gateway::store::postgres::MIGRATIONS.len() as i64
    );
    let k = s.get_key("old").unwrap().unwrap();
    assert_eq!((k.budget_micros, k.spend_micros), (Some(7), 3));
    assert_eq!(
        (k.budget_period, k.role, k.user),
        (None, Role::Member, None)
    );
}

fn shared_yaml(upstream: &str, budget_usd: u64, on_error: &str, url: &str) -> String {
    yaml_one(
        upstream,
        "m",
        "    price: {input_per_1m: 0, output_per_1m: 1000000}",
        &format!(
            "tenants: [{{name: t, budget_usd: {budget_usd}}}]\nstore: {{backend: postgres, url: \"{url}\", on_error: {on_error}, timeout_ms: 1000}}"
        ),
    )
}

async fn replica(yaml: &str, store: Arc<PgStore>) -> RunningGateway {
    let gw = Gateway::new(
        Arc::new(ConfigHandle::fixed(Config::from_yaml(yaml).unwrap()).unwrap()),
        store,
        GatewayOptions {
            admin_key: Some(ADMIN.into()),
            seed: Some(7),
            ..Default::default()
        },
    )
    .unwrap();
    strata_gateway::spawn(gw, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_postgres_never_overspend_a_budget() {
    let pg = Postgres::start();
    let m = mock("m").await;
    let yaml = shared_yaml(&m.url(), 100, "closed", &pg.url());
    let a = replica(&yaml, pg.store()).await;
    let b = replica(&yaml, pg.store()).await;
    let (key, record) = a
        .gateway
        .create_key(CreateKey {
            tenant: "t".into(),
            ..Default::default()
        })
        .unwrap();
    b.gateway.refresh_from_store().unwrap();

    // Each request costs $8 (8 output tokens at $1 each) and is estimated at $8
    // (`max_tokens: 8`); the tenant's budget is $100. Eight clients per replica send as
    // fast as they can until refused.
    let ok = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for gw in [a.url(), b.url()] {
        for _ in 0..8 {
            let (url, key) = (format!("{gw}/v1/chat/completions"), key.clone());
            let (ok, refused) = (ok.clone(), refused.clone());
            tasks.spawn(async move {
                for _ in 0..20 {
                    let (status, _, body) = post(&url, Some(&key), &chat_body("m")).await;
                    match status {
                        200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        429 => {
                            assert_eq!(body["error"]["code"], "budget_exceeded", "{body}");
                            refused.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        other => panic!("unexpected {other}: {body}"),
                    }
                }
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    a.gateway.flush_usage();
    b.gateway.flush_usage();
    let store = pg.store();
    let tenant = store
        .list_tenants()
        .unwrap()
        .into_iter()
        .find(|t| t.name == "t")
        .unwrap();
    let budget = 100_000_000;
    let one_estimate = 8_000_000;
    let served = ok.load(Ordering::Relaxed);
    assert_eq!(tenant.spend_micros, served as i64 * one_estimate);
    assert!(
        tenant.spend_micros <= budget + one_estimate,
        "overspent: ${} of $100 over {served} answers",
        tenant.spend_micros as f64 / 1e6
    );
    // The budget was used, not refused early: at least $92 of it.
    assert!(tenant.spend_micros > budget - one_estimate, "{served}");
    assert_eq!(refused.load(Ordering::Relaxed), 16);
    let rows = store
        .usage(&UsageFilter {
            key_id: Some(record.id.clone()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(rows.iter().map(|r| r.requests).sum::<u64>(), served);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_mid_load_loses_no_ledger_row_and_follows_the_failure_mode() {
    let pg = Postgres::start();
    let m = mock("m").await;
    // `open` keeps answering while the store is down; `closed` refuses with 503.
    let open = replica(
        &shared_yaml(&m.url(), 1_000_000, "open", &pg.url()),
        pg.store(),
    )
    .await;
    let closed = replica(
        &shared_yaml(&m.url(), 1_000_000, "closed", &pg.url()),
        pg.store(),
    )
    .await;
    let (key, record) = open
        .gateway
        .create_key(CreateKey {
            tenant: "t".into(),
            budget_usd: Some(1_000_000.0),
            ..Default::default()
        })
        .unwrap();
    closed.gateway.refresh_from_store().unwrap();

    let answered = Arc::new(AtomicU64::new(0));
    let stop_at = Instant::now() + Duration::from_millis(2500);
    let mut load = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (url, key, answered) = (
            format!("{}/v1/chat/completions", open.url()),
            key.clone(),
            answered.clone(),
        );
        load.spawn(async move {
            while Instant::now() < stop_at {
                let (status, _, body) = post(&url, Some(&key), &chat_body("m")).await;
                assert_eq!(status, 200, "{body}");
                answered.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pg = tokio::task::spawn_blocking(move || {
        pg.stop_server();
        pg
    })
    .await
    .unwrap();
    let at_stop = answered.load(Ordering::Relaxed);
    // While the store is down the closed replica refuses budgeted requests.
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", closed.url()),
        Some(&key),
        &chat_body("m"),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let at_start = answered.load(Ordering::Relaxed);
    let pg = tokio::task::spawn_blocking(move || {
        pg.start_server();
        pg
    })
    .await
    .unwrap();
    while let Some(r) = load.join_next().await {
        r.unwrap();
    }
    let total = answered.load(Ordering::Relaxed);
    assert!(
        at_start > at_stop,
        "the open replica stopped answering while the store was down"
    );
    assert!(total > at_start, "no answers after the restart");
    // After the restart the closed replica answers again.
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", closed.url()),
        Some(&key),
        &chat_body("m"),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    let gw = open.gateway.clone();
    tokio::task::spawn_blocking(move || gw.flush_usage())
        .await
        .unwrap();
    let gw = closed.gateway.clone();
    tokio::task::spawn_blocking(move || gw.flush_usage())
        .await
        .unwrap();
    let rows = pg
        .store()
        .usage(&UsageFilter {
            key_id: Some(record.id.clone()),
            ..Default::default()
        })
        .unwrap();
    let stored: u64 = rows.iter().map(|r| r.requests).sum();
    assert_eq!(stored, total + 1, "ledger rows lost across the restart");
    assert_eq!(
        pg.store()
            .get_key(&record.id)
            .unwrap()
            .unwrap()
            .spend_micros,
        (total as i64 + 1) * 8_000_000
    );
    open.shutdown().await;
    closed.shutdown().await;
}

/// A loopback TCP relay in front of the server that can be told to stall: while stalled,
/// bytes stop flowing both ways and connections stay open, like a server that hangs.
struct StallRelay {
    port: u16,
    stalled: Arc<std::sync::atomic::AtomicBool>,
}

impl StallRelay {
    fn start(target_port: u16) -> StallRelay {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stalled.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", target_port)) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let flag = flag.clone();
                    std::thread::spawn(move || pump(from, to, &flag));
                }
            }
        });
        StallRelay { port, stalled }
    }

    fn stall(&self, on: bool) {
        self.stalled.store(on, Ordering::SeqCst);
    }
}

/// Copies `from` to `to`, holding each chunk while `stalled`.
fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    stalled: &std::sync::atomic::AtomicBool,
) {
    use std::io::{Read, Write};
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while stalled.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10));
        }
        if to.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

#[test]
fn a_stalled_postgres_costs_its_timeout_once_per_back_off_not_per_call() {
    let pg = Postgres::start();
    let relay = StallRelay::start(pg.port);
    let timeout = Duration::from_millis(800);
    let s = PgStore::connect(PgOptions {
        url: format!(
            "postgres://strata@127.0.0.1:{}/postgres?connect_timeout=2",
            relay.port
        ),
        timeout,
    })
    .unwrap();
    assert!(s.get_key("a").unwrap().is_none());

    relay.stall(true);
    let t = Instant::now();
    assert!(s.get_key("a").is_err(), "a stalled server fails the call");
    assert!(t.elapsed() >= timeout);
    // Within the back-off, calls fail at once instead of waiting the timeout each.
    let t = Instant::now();
    for _ in 0..5 {
        assert!(s.get_key("a").is_err());
    }
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?} for 5 calls while backing off",
        t.elapsed()
    );

    relay.stall(false);
    std::thread::sleep(strata_gateway::store::postgres::RETRY_AFTER + Duration::from_millis(50));
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.get_key("a").is_err() {
        assert!(Instant::now() < deadline, "the store never came back");
        std::thread::sleep(Duration::from_millis(100));
    }
}
