//! Gateway identity: JWT bearer tokens verified against a JWKS (a file, and a URL served on
//! loopback), refused when expired, not yet valid, for another audience or issuer, signed
//! by another key or not signed at all (`alg: none`); claims mapped to tenant, user and
//! role; roles on the admin API (a tenant admin never touches another tenant); audit
//! entries that name the actor; bad identity config refused at start.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use base64::Engine as _;
use common::*;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use parking_lot::Mutex;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::{json, Value};
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::{Config, ConfigHandle, Gateway, GatewayOptions};

const ISSUER: &str = "https://idp.test/realms/acme";
const AUDIENCE: &str = "strata-gateway";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/jwt")
        .join(name)
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// The RSA test key (`tests/fixtures/jwt/rsa_test_key.der`, kid `rsa-test-1`).
fn rsa_key() -> EncodingKey {
    EncodingKey::from_rsa_der(&std::fs::read(fixture("rsa_test_key.der")).unwrap())
}

/// A P-256 key made for the test: its signing key and its public JWK.
struct EcKey {
    signing: EncodingKey,
    jwk: Value,
}

fn ec_key(kid: &str) -> EcKey {
    let rng = SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let pair =
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng).unwrap();
    let public = pair.public_key().as_ref();
    assert_eq!(public[0], 4, "uncompressed point");
    EcKey {
        signing: EncodingKey::from_ec_der(pkcs8.as_ref()),
        jwk: json!({"kty": "EC", "crv": "P-256", "kid": kid, "use": "sig", "alg": "ES256",
                     "x": b64(&public[1..33]), "y": b64(&public[33..65])}),
    }
}

/// Claims for `tenant`/`user` with `roles`, valid for an hour.
fn claims(tenant: &str, user: &str, roles: &[&str]) -> Value {
    json!({"iss": ISSUER, "aud": AUDIENCE, "sub": user, "tenant": tenant,
           "roles": roles, "exp": now() + 3600, "iat": now()})
}

fn sign(alg: Algorithm, kid: &str, claims: &Value, key: &EncodingKey) -> String {
    let mut h = Header::new(alg);
    h.kid = Some(kid.into());
    encode(&h, claims, key).unwrap()
}

fn rs256(claims: &Value) -> String {
    sign(Algorithm::RS256, "rsa-test-1", claims, &rsa_key())
}

/// An unsigned token (`alg: none`).
fn unsigned(claims: &Value) -> String {
    let header = b64(br#"{"alg":"none","typ":"JWT"}"#);
    format!("{header}.{}.", b64(claims.to_string().as_bytes()))
}

fn jwt_yaml(mock_url: &str, source: &str) -> String {
    yaml_one(
        mock_url,
        "m",
        "",
        &format!(
            "auth:\n  jwt:\n    issuer: {ISSUER}\n    audience: [{AUDIENCE}]\n    leeway_secs: 5\n{source}"
        ),
    )
}

async fn get(url: &str, token: &str) -> (u16, Value) {
    let resp = client().get(url).bearer_auth(token).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn send(
    method: reqwest::Method,
    url: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut rb = client().request(method, url).bearer_auth(token);
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let resp = rb.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// A 401 in OpenAI's shape whose message says `why`.
fn assert_refused(status: u16, body: &Value, why: &str) {
    assert_eq!(status, 401, "{body}");
    let e = assert_openai_error(body);
    assert_eq!(e["code"], "invalid_token", "{body}");
    assert_eq!(e["type"], "authentication_error", "{body}");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(why), "{why}: {msg}");
}

#[tokio::test]
async fn jwt_from_a_jwks_file_maps_claims_and_refuses_every_bad_token() {
    let m = mock("m").await;
    let source = format!(
        "    jwks_file: {}\n    algorithms: [RS256]\n",
        fixture("rsa_test_jwks.json").display()
    );
    let gw = gateway(&jwt_yaml(&m.url(), &source)).await;
    let chat = format!("{}/v1/chat/completions", gw.url());

    // A good token: tenant and user from its claims, charged to them.
    let good = rs256(&claims("team-a", "alice", &[]));
    let (s, _, body) = post(&chat, Some(&good), &chat_body("m")).await;
    assert_eq!(s, 200, "{body}");
    let (s, models) = get(&format!("{}/v1/models", gw.url()), &good).await;
    assert_eq!((s, models["data"][0]["id"].as_str()), (200, Some("m")));
    // API keys keep working beside tokens.
    let k = key(&gw, "team-b");
    let (s, _, _) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(s, 200);
    let (_, usage) = admin_get(&gw, "/admin/usage?tenant=team-a").await;
    let row = &usage["data"][0];
    assert_eq!(
        (
            row["tenant"].as_str(),
            row["user"].as_str(),
            row["key_id"].as_str()
        ),
        (Some("team-a"), Some("alice"), Some("jwt:team-a:alice")),
        "{usage}"
    );
    let served = m.requests();

    let mut expired = claims("team-a", "alice", &[]);
    expired["exp"] = json!(now() - 600);
    let mut early = claims("team-a", "alice", &[]);
    early["nbf"] = json!(now() + 600);
    let mut wrong_aud = claims("team-a", "alice", &[]);
    wrong_aud["aud"] = json!("someone-else");
    let mut wrong_iss = claims("team-a", "alice", &[]);
    wrong_iss["iss"] = json!("https://evil.test");
    let mut no_tenant = claims("team-a", "alice", &[]);
    no_tenant.as_object_mut().unwrap().remove("tenant");
    let mut no_exp = claims("team-a", "alice", &[]);
    no_exp.as_object_mut().unwrap().remove("exp");
    // The same header and signature over other claims: the signature no longer verifies.
    let forged = {
        let parts: Vec<&str> = good.split('.').collect();
        let other = b64(claims("team-root", "alice", &[]).to_string().as_bytes());
        format!("{}.{other}.{}", parts[0], parts[2])
    };
    // A key the gateway does not hold, under the gateway key's id.
    let stranger = ec_key("rsa-test-1");
    let wrong_key = sign(
        Algorithm::ES256,
        "rsa-test-1",
        &claims("team-a", "alice", &[]),
        &stranger.signing,
    );
    let unknown_kid = sign(
        Algorithm::RS256,
        "rsa-test-9",
        &claims("team-a", "alice", &[]),
        &rsa_key(),
    );
    let hs = sign(
        Algorithm::HS256,
        "rsa-test-1",
        &claims("team-a", "alice", &[]),
        &EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef"),
    );
    let cases = [
        (rs256(&expired), "expired"),
        (rs256(&early), "not valid yet"),
        (rs256(&wrong_aud), "audience"),
        (rs256(&wrong_iss), "issuer"),
        (rs256(&no_tenant), "no `tenant` claim"),
        (rs256(&no_exp), "no `exp` claim"),
        (forged, "signature does not verify"),
        (wrong_key, "not accepted"),
        (unknown_kid, "no key `rsa-test-9`"),
        (hs, "not accepted"),
        (
            unsigned(&claims("team-a", "alice", &[])),
            "header does not parse",
        ),
        ("e30.e30.".to_string(), "header does not parse"),
    ];
    for (token, why) in cases {
        let (s, _, body) = post(&chat, Some(&token), &chat_body("m")).await;
        assert_refused(s, &body, why);
        let (s, body) = get(&format!("{}/v1/models", gw.url()), &token).await;
        assert_refused(s, &body, why);
    }
    assert_eq!(m.requests(), served, "no refused token reached the model");
    let text = metrics_text(&gw).await;
    assert!(
        text.contains("strata_gateway_rejected_total{reason=\"auth\"} 24"),
        "{text}"
    );
    gw.shutdown().await;
}

/// A JWKS served on loopback that counts its fetches; its keys can be replaced.
struct JwksServer {
    url: String,
    keys: Arc<Mutex<Value>>,
    fetches: Arc<AtomicUsize>,
    _task: tokio::task::JoinHandle<()>,
}

async fn jwks_server(keys: Value) -> JwksServer {
    let keys = Arc::new(Mutex::new(keys));
    let fetches = Arc::new(AtomicUsize::new(0));
    let (k, f) = (keys.clone(), fetches.clone());
    let app = axum::Router::new().route(
        "/jwks",
        axum::routing::get(move || {
            let (k, f) = (k.clone(), f.clone());
            async move {
                f.fetch_add(1, Ordering::SeqCst);
                axum::Json(k.lock().clone())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jwks", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    JwksServer {
        url,
        keys,
        fetches,
        _task: task,
    }
}

/// A listener that only counts connections (nothing must ever connect to it).
async fn connection_counter() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jwks", listener.local_addr().unwrap());
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = n.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            n2.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (url, n)
}

#[tokio::test]
async fn jwt_from_a_jwks_url_on_loopback_follows_key_rotation_and_never_a_token_url() {
    let m = mock("m").await;
    let a = ec_key("ec-a");
    let b = ec_key("ec-b");
    let server = jwks_server(json!({"keys": [a.jwk]})).await;
    let source = format!(
        "    jwks_url: {}\n    algorithms: [ES256]\n    jwks_min_refetch_secs: 0\n",
        server.url
    );
    let gw = gateway(&jwt_yaml(&m.url(), &source)).await;
    let chat = format!("{}/v1/chat/completions", gw.url());
    let user = claims("team-a", "bob", &[]);

    let (s, _, body) = post(
        &chat,
        Some(&sign(Algorithm::ES256, "ec-a", &user, &a.signing)),
        &chat_body("m"),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert!(server.fetches.load(Ordering::SeqCst) >= 1);
    // B's signature under A's id: refused.
    let (s, _, body) = post(
        &chat,
        Some(&sign(Algorithm::ES256, "ec-a", &user, &b.signing)),
        &chat_body("m"),
    )
    .await;
    assert_refused(s, &body, "signature does not verify");
    // B before the IdP publishes it: an unknown kid, refused after a refetch.
    let token_b = sign(Algorithm::ES256, "ec-b", &user, &b.signing);
    let (s, _, body) = post(&chat, Some(&token_b), &chat_body("m")).await;
    assert_refused(s, &body, "no key `ec-b`");
    // The IdP rotates to B: the next token naming B makes the gateway fetch again.
    *server.keys.lock() = json!({"keys": [b.jwk]});
    let before = server.fetches.load(Ordering::SeqCst);
    let (s, _, body) = post(&chat, Some(&token_b), &chat_body("m")).await;
    assert_eq!(s, 200, "{body}");
    assert!(server.fetches.load(Ordering::SeqCst) > before);

    // A token naming a key URL (`jku`, `x5u`) makes the gateway contact nothing.
    let (evil, connections) = connection_counter().await;
    let mut h = Header::new(Algorithm::ES256);
    h.kid = Some("ec-c".into());
    h.jku = Some(evil.clone());
    h.x5u = Some(evil);
    let c = ec_key("ec-c");
    let token = encode(&h, &user, &c.signing).unwrap();
    let (s, _, body) = post(&chat, Some(&token), &chat_body("m")).await;
    assert_refused(s, &body, "no key `ec-c`");
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(
        connections.load(Ordering::SeqCst),
        0,
        "no connection to a token's URL"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn roles_tenant_admin_manages_only_its_own_tenant_and_the_audit_names_actors() {
    let m = mock("m").await;
    let source = format!(
        "    jwks_file: {}\n    algorithms: [RS256]\n",
        fixture("rsa_test_jwks.json").display()
    );
    let gw = gateway(&jwt_yaml(&m.url(), &source)).await;
    let url = gw.url();
    let admin_a = rs256(&claims("team-a", "ann", &["tenant_admin"]));
    let member_a = rs256(&claims("team-a", "mel", &["reader"]));
    let platform = rs256(&claims("ops", "pat", &["platform_admin"]));
    let key_b = key(&gw, "team-b");
    let id_b = key_b.split('-').nth(2).unwrap().to_string();

    // A member: no admin API at all.
    let (s, body) = get(&format!("{url}/admin/keys"), &member_a).await;
    assert_eq!(s, 403, "{body}");
    assert_openai_error(&body);

    // The tenant admin creates keys in its own tenant (members or tenant admins) ...
    let (s, created) = send(
        reqwest::Method::POST,
        &format!("{url}/admin/keys"),
        &admin_a,
        Some(json!({"tenant": "team-a", "user": "carol", "role": "tenant_admin"})),
    )
    .await;
    assert_eq!(s, 201, "{created}");
    let key_a = created["key"].as_str().unwrap().to_string();
    let id_a = created["id"].as_str().unwrap().to_string();
    // ... never a platform admin key, and nothing in another tenant.
    let (s, body) = send(
        reqwest::Method::POST,
        &format!("{url}/admin/keys"),
        &admin_a,
        Some(json!({"tenant": "team-a", "role": "platform_admin"})),
    )
    .await;
    assert_eq!((s, body["error"]["param"].as_str()), (400, Some("role")));
    let forbidden: Vec<(reqwest::Method, String, Option<Value>)> = vec![
        (
            reqwest::Method::POST,
            format!("{url}/admin/keys"),
            Some(json!({"tenant": "team-b"})),
        ),
        (
            reqwest::Method::DELETE,
            format!("{url}/admin/keys/{id_b}"),
            None,
        ),
        (
            reqwest::Method::PUT,
            format!("{url}/admin/keys/{id_b}"),
            Some(json!({"rpm": 1})),
        ),
        (
            reqwest::Method::GET,
            format!("{url}/admin/usage?tenant=team-b"),
            None,
        ),
        (
            reqwest::Method::GET,
            format!("{url}/admin/tenants/team-b/users"),
            None,
        ),
        (
            reqwest::Method::PUT,
            format!("{url}/admin/tenants/team-b/users/x"),
            Some(json!({"budget_usd": 1})),
        ),
        // Platform-only calls, even for its own tenant.
        (
            reqwest::Method::PUT,
            format!("{url}/admin/tenants/team-a"),
            Some(json!({"budget_usd": 1000})),
        ),
        (reqwest::Method::GET, format!("{url}/admin/audit"), None),
        (reqwest::Method::POST, format!("{url}/admin/reload"), None),
    ];
    // The same refusals for a tenant-admin token and a tenant-admin API key.
    for caller in [&admin_a, &key_a] {
        for (method, path, body) in &forbidden {
            let (s, resp) = send(method.clone(), path, caller, body.clone()).await;
            assert_eq!(s, 403, "{method} {path}: {resp}");
            assert_eq!(assert_openai_error(&resp)["code"], "forbidden");
        }
    }
    // Nothing of team-b's changed.
    let (_, keys) = admin_get(&gw, "/admin/keys").await;
    let b = keys["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["id"] == id_b.as_str())
        .unwrap()
        .clone();
    assert!(
        b["revoked_at"].is_null() && b["limits"]["rpm"].is_null(),
        "{b}"
    );

    // What it may do: list its own keys only, change them, set its users' budgets, read its usage.
    let (s, list) = get(&format!("{url}/admin/keys"), &admin_a).await;
    assert_eq!(s, 200);
    let tenants: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(tenants, ["team-a"], "{list}");
    let (s, _) = send(
        reqwest::Method::PUT,
        &format!("{url}/admin/keys/{id_a}"),
        &admin_a,
        Some(json!({"rpm": 50})),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = send(
        reqwest::Method::PUT,
        &format!("{url}/admin/tenants/team-a/users/dave"),
        &key_a,
        Some(json!({"budget_usd": 2, "budget_period": "monthly"})),
    )
    .await;
    assert_eq!(s, 200);
    let (s, users) = get(&format!("{url}/admin/tenants/team-a/users"), &admin_a).await;
    assert_eq!(
        (s, users["data"][0]["budget_period"].as_str()),
        (200, Some("monthly")),
        "{users}"
    );
    let (s, _, _) = post(
        &format!("{url}/v1/chat/completions"),
        Some(&key_b),
        &chat_body("m"),
    )
    .await;
    assert_eq!(s, 200);
    let (s, usage) = get(&format!("{url}/admin/usage"), &admin_a).await;
    assert_eq!(s, 200);
    assert!(
        usage["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["tenant"] == "team-a"),
        "{usage}"
    );
    let (s, tenants) = get(&format!("{url}/admin/tenants"), &admin_a).await;
    assert_eq!(s, 200);
    assert!(
        tenants["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["name"] == "team-a"),
        "{tenants}"
    );

    // A platform-admin token may do all of it.
    let (s, _) = send(
        reqwest::Method::PUT,
        &format!("{url}/admin/keys/{id_b}"),
        &platform,
        Some(json!({"rpm": 7})),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = send(
        reqwest::Method::DELETE,
        &format!("{url}/admin/keys/{id_b}"),
        &platform,
        None,
    )
    .await;
    assert_eq!(s, 200);

    // The audit log names each actor and role.
    let (_, audit) = admin_get(&gw, "/admin/audit").await;
    let actors: Vec<(String, String)> = audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap().to_string(),
                e["actor"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let has = |action: &str, actor: &str| actors.iter().any(|(a, b)| a == action && b == actor);
    assert!(has("create_key", "jwt:ann (tenant_admin)"), "{actors:?}");
    assert!(has("update_key", "jwt:ann (tenant_admin)"), "{actors:?}");
    assert!(
        has("put_user", &format!("key:{id_a} (tenant_admin)")),
        "{actors:?}"
    );
    assert!(has("update_key", "jwt:pat (platform_admin)"), "{actors:?}");
    assert!(has("revoke_key", "jwt:pat (platform_admin)"), "{actors:?}");
    assert!(has("create_key", "system"), "{actors:?}");
    let (s, _) = send(
        reqwest::Method::POST,
        &format!("{url}/admin/reload"),
        ADMIN,
        None,
    )
    .await;
    assert_eq!(s, 200);
    let (_, audit) = admin_get(&gw, "/admin/audit?limit=1").await;
    assert_eq!(audit["data"][0]["actor"], "admin-key (platform_admin)");
    gw.shutdown().await;
}

fn build(yaml: &str) -> Result<Arc<Gateway>, String> {
    let config = Config::from_yaml(yaml).map_err(|e| e.to_string())?;
    Gateway::new(
        Arc::new(ConfigHandle::fixed(config).map_err(|e| e.to_string())?),
        Arc::new(SqliteStore::in_memory().unwrap()),
        GatewayOptions::default(),
    )
    .map_err(|e| e.to_string())
}

#[test]
fn bad_identity_config_is_refused_at_start_with_a_clear_message() {
    let dir = std::env::temp_dir().join(format!("strata-gw-jwks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, "not a jwks").unwrap();
    let empty = dir.join("empty.json");
    std::fs::write(&empty, r#"{"keys": []}"#).unwrap();
    let yaml =
        |jwt: &str| format!("auth:\n  jwt: {{issuer: {ISSUER}, audience: [{AUDIENCE}], {jwt}}}");
    let cases = [
        (
            yaml(&format!("jwks_file: {}", garbage.display())),
            "not a JWKS document",
        ),
        (
            yaml(&format!("jwks_file: {}", empty.display())),
            "no signing key",
        ),
        (
            yaml("jwks_file: /nonexistent/jwks.json"),
            "cannot read /nonexistent/jwks.json",
        ),
        (
            yaml(&format!(
                "jwks_file: {}, algorithms: [RS512]",
                garbage.display()
            )),
            "unknown or refused algorithm `RS512`",
        ),
        (
            yaml(&format!(
                "jwks_file: {}, algorithms: [none]",
                garbage.display()
            )),
            "unknown or refused algorithm `none`",
        ),
        (
            yaml("algorithms: [HS256], hs256_secret_env: STRATA_TEST_UNSET_SECRET"),
            "`STRATA_TEST_UNSET_SECRET` is not set",
        ),
        (yaml("algorithms: [HS256]"), "hs256_secret_env is unset"),
        (
            yaml("jwks_url: \"ftp://idp.test/jwks\""),
            "not an http:// or https:// URL",
        ),
        (yaml(""), "need jwks_file or jwks_url"),
        (
            format!("auth:\n  jwt: {{issuer: {ISSUER}, jwks_file: x}}"),
            "audience",
        ),
    ];
    for (text, want) in cases {
        let err = build(&text)
            .err()
            .unwrap_or_else(|| panic!("accepted: {text}"));
        assert!(err.contains(want), "{text}\nwanted `{want}` in: {err}");
    }
    // The good fixture loads.
    let ok = yaml(&format!(
        "jwks_file: {}",
        fixture("rsa_test_jwks.json").display()
    ));
    assert!(build(&ok).is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}
