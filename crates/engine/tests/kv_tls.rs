//! KV transfer and the tier over mutual TLS (issue 29), with a certificate chain made here:
//! a decode engine pulls a prompt's blocks from a prefill engine over mTLS and decodes what
//! colocated serving decodes; a caller without a client certificate, with another CA's, or
//! speaking plain TCP is refused at the handshake and is served no block; a client refuses
//! a server of another CA or one whose certificate does not carry the address it dialled;
//! an engine offloads to a tier over mTLS and another engine fetches from it; certificate
//! files that do not load are errors naming them, and `--kv-tls` without its CA is refused.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use serde_json::{json, Value};
use strata_engine::kv::block_pool::HashKey;
use strata_engine::kv::cache::KvDtype;
use strata_engine::kv::peers::KvPeers;
use strata_engine::kv::tier::{Tier, TierConfig, TierStore};
use strata_engine::kv::tls::{server_tls, KvAcceptor, KvConnector, KvTls, KvTlsFiles};
use strata_engine::kv::transfer::{
    self, BlockData, BlockSource, BlockSpec, BoxFuture, Evictions, ServeLimits, TransferClient,
};
use strata_engine::server::{self, EngineOptions, KvRole};

const T: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------
// The chain

/// A CA made for one test.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("CA key");
        let cert = p.self_signed(&key).expect("CA certificate");
        Ca { cert, key }
    }

    /// A leaf for `names` (DNS names or IP addresses) good as a server and as a client:
    /// certificate and key, PEM.
    fn issue(&self, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(names.clone()).expect("leaf params");
        p.distinguished_name
            .push(DnType::CommonName, names[0].clone());
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("leaf key");
        let cert = p
            .signed_by(&key, &self.cert, &self.key)
            .expect("leaf certificate");
        (cert.pem(), key.serialize_pem())
    }
}

/// A scratch folder removed at the end of the test.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "strata-kv-tls-{tag}-{}-{:?}",
            std::process::id(),
            Instant::now()
        ));
        std::fs::create_dir_all(&d).expect("scratch dir");
        Dir(d)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).expect("write");
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An engine's `--kv-tls` files: a leaf of `ca` for `names`, trusting `trust`.
fn kv_files(dir: &Dir, who: &str, ca: &Ca, names: &[&str], trust: &Ca) -> KvTlsFiles {
    let (cert, key) = ca.issue(names);
    KvTlsFiles {
        cert: dir.write(&format!("{who}.pem"), &cert),
        key: dir.write(&format!("{who}.key"), &key),
        ca: dir.write(&format!("{who}-ca.pem"), &trust.cert.pem()),
    }
}

fn kv_tls(dir: &Dir, who: &str, ca: &Ca, trust: &Ca) -> KvTls {
    KvTls::load(&kv_files(dir, who, ca, &["127.0.0.1"], trust)).expect("KV TLS loads")
}

// ---------------------------------------------------------------------------------------
// The block endpoint, without a model

fn spec() -> BlockSpec {
    BlockSpec {
        model: "tls-test".into(),
        block_size: 4,
        n_layer: 2,
        slot_width: 3,
        dtype: KvDtype::F16,
        scales_per_slot: 0,
    }
}

fn block(n: u8) -> BlockData {
    BlockData {
        hash: [n; 32],
        bytes: (0..spec().block_bytes()).map(|i| (i as u8) ^ n).collect(),
    }
}

/// The tier, counting every request that reaches it past the handshake.
struct Counted {
    tier: Tier,
    calls: Arc<AtomicUsize>,
}

impl BlockSource for Counted {
    fn accepts(&self, spec: &BlockSpec) -> bool {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.tier.accepts(spec)
    }
    fn get(
        &self,
        spec: &BlockSpec,
        hashes: Vec<HashKey>,
        release: Option<String>,
    ) -> BoxFuture<Vec<BlockData>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.tier.get(spec, hashes, release)
    }
    fn put(&self, spec: &BlockSpec, blocks: Vec<BlockData>) -> BoxFuture<Result<(), String>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.tier.put(spec, blocks)
    }
    fn evictions_since(&self, spec: &BlockSpec, seq: u64) -> Evictions {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.tier.evictions_since(spec, seq)
    }
    fn release(&self, pin: String) -> BoxFuture<()> {
        self.tier.release(pin)
    }
}

/// A tier served through `acceptor` on a loopback port; its address and request counter.
async fn serve_tier(acceptor: KvAcceptor) -> (SocketAddr, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let tier = Tier::new(TierStore::new(TierConfig::memory(1 << 20)).expect("tier store"));
    let source = Arc::new(Counted {
        tier,
        calls: calls.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let limits = ServeLimits {
        io: Duration::from_secs(2),
        ..ServeLimits::default()
    };
    tokio::spawn(transfer::serve_on(
        listener,
        acceptor,
        source,
        std::future::pending(),
        limits,
    ));
    (addr, calls)
}

async fn connect(c: &KvConnector, addr: SocketAddr) -> Result<TransferClient, String> {
    TransferClient::connect_with(c, addr, "127.0.0.1", &spec(), T)
        .await
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn the_tier_endpoint_serves_only_callers_its_ca_signed() {
    let dir = Dir::new("endpoint");
    let ca = Ca::new("cluster CA");
    let other = Ca::new("another CA");
    let (cert, key) = ca.issue(&["127.0.0.1"]);
    let client_ca = dir.write("client-ca.pem", &ca.cert.pem());
    let acceptor = server_tls(
        &dir.write("tier.pem", &cert),
        &dir.write("tier.key", &key),
        Some(&client_ca),
    )
    .expect("tier TLS loads");
    let (addr, calls) = serve_tier(acceptor).await;

    // A caller the CA signed puts and gets blocks, byte for byte.
    let good = kv_tls(&dir, "engine", &ca, &ca).connector;
    let mut c = connect(&good, addr)
        .await
        .expect("a signed caller is served");
    c.put(vec![block(1), block(2)]).await.expect("put");
    let got = c.get(&[[1; 32], [2; 32]], None).await.expect("get");
    assert_eq!(got, vec![block(1), block(2)]);
    drop(c);
    let served = calls.load(Ordering::SeqCst);
    assert!(served >= 3, "{served}");

    // No client certificate: verifies the tier, presents nothing.
    let ca_pem = dir.write("ca-only.pem", &ca.cert.pem());
    let anonymous = KvConnector::tls(
        strata_api::tls::client_config(Some(&ca_pem), None, &[strata_engine::kv::tls::ALPN])
            .expect("client config"),
    );
    // A certificate of another CA (which also trusts the tier's CA).
    let stranger = kv_tls(&dir, "stranger", &other, &ca).connector;
    for (who, c) in [("no certificate", &anonymous), ("another CA", &stranger)] {
        let e = connect(c, addr)
            .await
            .err()
            .unwrap_or_else(|| panic!("{who}: served"));
        assert!(!e.is_empty(), "{who}");
    }
    // Plain TCP to a TLS endpoint: the handshake bytes are not a TLS hello.
    let e = connect(&KvConnector::plain(), addr).await.err();
    assert!(e.is_some(), "plain TCP was served");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        served,
        "a refused caller reached the block source"
    );

    // The signed caller is still served after the refusals.
    let mut c = connect(&good, addr).await.expect("served again");
    assert_eq!(c.get(&[[2; 32]], None).await.expect("get"), vec![block(2)]);
}

#[tokio::test]
async fn a_client_refuses_a_server_of_another_ca_or_another_name() {
    let dir = Dir::new("server-check");
    let ca = Ca::new("cluster CA");
    let other = Ca::new("another CA");
    let client = kv_tls(&dir, "engine", &ca, &ca).connector;
    let client_ca = dir.write("client-ca.pem", &ca.cert.pem());
    // (a) signed by another CA; (b) the right CA, but only for `tier.internal`.
    let (foreign_cert, foreign_key) = other.issue(&["127.0.0.1"]);
    let (named_cert, named_key) = ca.issue(&["tier.internal"]);
    for (who, cert, key) in [
        ("another CA", foreign_cert, foreign_key),
        ("another name", named_cert, named_key),
    ] {
        let acceptor = server_tls(
            &dir.write(&format!("{who}.pem"), &cert),
            &dir.write(&format!("{who}.key"), &key),
            Some(&client_ca),
        )
        .expect("server TLS loads");
        let (addr, calls) = serve_tier(acceptor).await;
        assert!(connect(&client, addr).await.is_err(), "{who}: accepted");
        assert_eq!(calls.load(Ordering::SeqCst), 0, "{who}");
    }
}

#[tokio::test]
async fn a_stalled_tls_handshake_is_bounded_by_the_connect_timeout() {
    let dir = Dir::new("stall");
    let ca = Ca::new("cluster CA");
    let client = kv_tls(&dir, "engine", &ca, &ca).connector;
    // A listener that accepts and never answers the client hello.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            kept.push(s);
        }
    });
    let started = Instant::now();
    let r = TransferClient::connect_with(
        &client,
        addr,
        "127.0.0.1",
        &spec(),
        Duration::from_millis(300),
    )
    .await;
    assert!(matches!(r, Err(transfer::TransferError::Timeout)), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    held.abort();
}

#[test]
fn certificate_files_that_do_not_load_are_named() {
    let dir = Dir::new("bad-files");
    let ca = Ca::new("cluster CA");
    let good = kv_files(&dir, "engine", &ca, &["127.0.0.1"], &ca);
    let missing = dir.0.join("missing.pem");
    let garbage = dir.write("garbage.pem", "not a certificate\n");
    for (field, files) in [
        (
            &missing,
            KvTlsFiles {
                cert: missing.clone(),
                ..good.clone()
            },
        ),
        (
            &garbage,
            KvTlsFiles {
                ca: garbage.clone(),
                ..good.clone()
            },
        ),
        (
            &garbage,
            KvTlsFiles {
                key: garbage.clone(),
                ..good.clone()
            },
        ),
    ] {
        let e = KvTls::load(&files).expect_err("bad files load").to_string();
        assert!(e.contains(&field.display().to_string()), "{e}");
    }
    let e = server_tls(&good.cert, &missing, None)
        .expect_err("a missing key loads")
        .to_string();
    assert!(e.contains("missing.pem"), "{e}");
}

#[test]
fn kv_tls_flags_need_their_certificate_and_ca() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: strata_engine::cli::EngineArgs,
    }
    let base = ["engine", "--model", "m.gguf"];
    let parse = |extra: &[&str]| {
        let argv: Vec<&str> = base.iter().chain(extra).copied().collect();
        Cli::try_parse_from(argv).map(|c| (c.args.kv_tls, c.args.kv_tls_ca))
    };
    assert!(parse(&["--kv-tls"]).is_err(), "--kv-tls without files");
    assert!(
        parse(&["--kv-tls", "--kv-tls-ca", "ca.pem"]).is_err(),
        "no --tls-cert"
    );
    assert!(
        parse(&["--kv-tls", "--tls-cert", "c", "--tls-key", "k"]).is_err(),
        "no CA"
    );
    assert!(
        parse(&["--kv-tls-ca", "ca.pem"]).is_err(),
        "a CA without --kv-tls"
    );
    let ok = parse(&[
        "--kv-tls",
        "--kv-tls-ca",
        "ca.pem",
        "--tls-cert",
        "c.pem",
        "--tls-key",
        "k.pem",
    ])
    .expect("complete flags parse");
    assert_eq!(ok, (true, Some(PathBuf::from("ca.pem"))));
    assert_eq!(parse(&[]).expect("plain"), (false, None));

    // `strata kv-tier`: a key without a certificate, or a client CA without either, is
    // refused; the three together parse.
    #[derive(clap::Parser)]
    struct Tier {
        #[command(flatten)]
        args: strata_engine::cli::KvTierArgs,
    }
    let tier = |extra: &[&str]| {
        let argv: Vec<&str> = ["kv-tier"].iter().chain(extra).copied().collect();
        Tier::try_parse_from(argv).map(|t| t.args.tls_client_ca)
    };
    assert!(tier(&["--tls-key", "k.pem"]).is_err());
    assert!(tier(&["--tls-client-ca", "ca.pem"]).is_err());
    let full = [
        "--tls-cert",
        "c.pem",
        "--tls-key",
        "k.pem",
        "--tls-client-ca",
        "ca.pem",
    ];
    assert_eq!(
        tier(&full).expect("tier TLS flags"),
        Some(PathBuf::from("ca.pem"))
    );
}

// ---------------------------------------------------------------------------------------
// Engines

use common::kv_engine::{start, Engine, MODEL};

fn post(addr: SocketAddr, body: &Value, request_id: &str) -> (u16, Value) {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(common::READ_TIMEOUT))
        .expect("timeout");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nx-request-id: {request_id}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body.as_bytes()).expect("write body");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let (status, text) = common::parse_response(&raw);
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn metric(addr: SocketAddr, name: &str, label: &str) -> f64 {
    let (status, text) = common::request(addr, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn path_count(addr: SocketAddr, path: &str) -> f64 {
    let label = format!("path=\"{path}\"");
    metric(addr, "strata:kv_transfer_requests_total", &label)
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

fn cached_of(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn prompt_text(topic: &str) -> String {
    format!(
        "{} What did he write on the last night?",
        format!("The {topic} keeper wrote in his log every night. ").repeat(8)
    )
}

/// Prefills `prompt` on `a` for a remote decoder; the answer's `kv_transfer_params`.
fn prefill(a: &Engine, prompt: &str, request_id: &str) -> Value {
    let mut body = completion(prompt, 1);
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
    let (status, answer) = post(a.http, &body, request_id);
    assert_eq!(status, 200, "{answer}");
    answer["kv_transfer_params"].clone()
}

fn decode_opts(tls: KvTls, prefiller: SocketAddr) -> EngineOptions {
    EngineOptions {
        kv_role: KvRole::Decode,
        num_blocks: Some(64),
        max_model_len: Some(512),
        kv_peers: KvPeers::parse(&[prefiller.to_string()]).expect("peers"),
        kv_tls: Some(tls),
        ..EngineOptions::default()
    }
}

#[test]
fn a_decode_engine_pulls_over_mutual_tls_and_a_stranger_gets_no_block() {
    let dir = Dir::new("engines");
    let ca = Ca::new("cluster CA");
    let other = Ca::new("another CA");
    let a = start(
        EngineOptions {
            kv_role: KvRole::Prefill,
            kv_transfer_port: 1, // any non-zero: `start` binds the endpoint itself
            num_blocks: Some(64),
            max_model_len: Some(512),
            kv_tls: Some(kv_tls(&dir, "prefill", &ca, &ca)),
            ..EngineOptions::default()
        },
        true,
    );
    let a_transfer = a.transfer.expect("A serves blocks");
    let b = start(
        decode_opts(kv_tls(&dir, "decode", &ca, &ca), a_transfer),
        false,
    );
    let prompt = prompt_text("lighthouse");

    // Colocated on B first, then B forgets the prompt.
    let (status, colocated) = post(b.http, &completion(&prompt, 8), "colocated");
    assert_eq!(status, 200, "{colocated}");
    let want = text_of(&colocated);
    let (status, _) = common::request(b.http, "POST", "/reset_prefix_cache", b"");
    assert_eq!(status, 200);

    // B pulls A's blocks over mTLS and decodes the same tokens.
    let params = prefill(&a, &prompt, "req-tls");
    let blocks = params["remote_block_ids"].as_array().expect("ids").len() as f64;
    assert!(blocks >= 4.0, "{params}");
    let mut body = completion(&prompt, 8);
    body["kv_transfer_params"] = params;
    let (status, decoded) = post(b.http, &body, "req-tls");
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(
        text_of(&decoded),
        want,
        "the pull over TLS changed the output"
    );
    assert!(cached_of(&decoded) >= 16, "{decoded}");
    assert_eq!(path_count(b.http, "remote_prefill"), 1.0);
    assert_eq!(path_count(b.http, "fallback"), 0.0);
    let sent = "direction=\"sent\"";
    assert_eq!(
        metric(a.http, "strata:kv_transfer_blocks_total", sent),
        blocks
    );

    // An engine whose certificate another CA signed (trusting A's CA, allowed to name A)
    // is refused at A's handshake: it recomputes, and A sends nothing more.
    let c = start(
        decode_opts(kv_tls(&dir, "stranger", &other, &ca), a_transfer),
        false,
    );
    let params = prefill(&a, &prompt, "req-stranger");
    let mut body = completion(&prompt, 8);
    body["kv_transfer_params"] = params;
    let (status, decoded) = post(c.http, &body, "req-stranger");
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(text_of(&decoded), want, "the fallback changed the output");
    assert_eq!(cached_of(&decoded), 0, "{decoded}");
    assert_eq!(path_count(c.http, "fallback"), 1.0);
    assert_eq!(
        metric(a.http, "strata:kv_transfer_blocks_total", sent),
        blocks
    );
    assert!(c.state.kv.tls.is_some());
}

/// A tier served like `strata kv-tier --tls-cert --tls-key --tls-client-ca`, on its own
/// runtime thread.
fn start_tier(acceptor: KvAcceptor, block_bytes: usize, blocks: usize) -> (SocketAddr, Tier) {
    let tier = Tier::new(
        TierStore::new(TierConfig::memory((block_bytes * blocks) as u64)).expect("tier store"),
    );
    let source: Arc<dyn BlockSource> = Arc::new(tier.clone());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind tier");
    let addr = listener.local_addr().expect("tier addr");
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).expect("tier listener");
            let limits = ServeLimits::default();
            transfer::serve_on(l, acceptor, source, std::future::pending(), limits)
                .await
                .expect("tier serves");
        });
    });
    (addr, tier)
}

#[test]
fn engines_offload_to_and_fetch_from_a_tier_over_mutual_tls() {
    let dir = Dir::new("tier");
    let ca = Ca::new("cluster CA");
    let (cert, key) = ca.issue(&["127.0.0.1"]);
    let acceptor = server_tls(
        &dir.write("tier.pem", &cert),
        &dir.write("tier.key", &key),
        Some(&dir.write("tier-ca.pem", &ca.cert.pem())),
    )
    .expect("tier TLS loads");
    // The block size is the model's: read it from an engine's spec first.
    let probe = server::load(&EngineOptions {
        model_path: common::model_path(),
        model_name: MODEL.into(),
        ..EngineOptions::default()
    })
    .expect("load the model");
    let block_bytes = probe.state.engine.block_spec().block_bytes();
    drop(probe);
    let (tier_addr, tier) = start_tier(acceptor, block_bytes, 256);
    let small = |who: &str, num_blocks| EngineOptions {
        num_blocks: Some(num_blocks),
        max_model_len: Some(256),
        kv_tier: Some(tier_addr),
        kv_tls: Some(kv_tls(&dir, who, &ca, &ca)),
        ..EngineOptions::default()
    };
    // A's cache is small: each new prompt evicts the previous ones to the tier.
    let a = start(small("a", 16), false);
    let prompt = prompt_text("lighthouse");
    let (status, first) = post(a.http, &completion(&prompt, 6), "first");
    assert_eq!(status, 200, "{first}");
    let want = text_of(&first);
    let prompt_blocks = first["usage"]["prompt_tokens"].as_u64().expect("usage") as usize / 16;
    for (i, topic) in ["harbour", "mill", "toll", "bridge", "tower", "gate"]
        .iter()
        .enumerate()
    {
        let (status, answer) = post(a.http, &completion(&prompt_text(topic), 2), &i.to_string());
        assert_eq!(status, 200, "{answer}");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while tier.stats().memory_blocks < prompt_blocks * 2 {
        assert!(
            Instant::now() < deadline,
            "nothing reached the tier over TLS: {:?}",
            tier.stats()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // B has never seen the prompt: it fetches the blocks from the tier over mTLS.
    let b = start(small("b", 64), false);
    let (status, fetched) = post(b.http, &completion(&prompt, 6), "fetched");
    assert_eq!(status, 200, "{fetched}");
    assert_eq!(
        text_of(&fetched),
        want,
        "blocks from the tier changed the output"
    );
    assert!(cached_of(&fetched) >= 16, "{fetched}");
    assert_eq!(path_count(b.http, "tier"), 1.0);

    // An engine without --kv-tls cannot use the tier: it recomputes.
    let plain = start(
        EngineOptions {
            kv_tls: None,
            ..small("plain", 64)
        },
        false,
    );
    let (status, answer) = post(plain.http, &completion(&prompt, 6), "plain");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(text_of(&answer), want);
    assert_eq!(cached_of(&answer), 0, "{answer}");
    assert_eq!(path_count(plain.http, "tier"), 0.0);
}

// ---------------------------------------------------------------------------------------
// Phase 1 (`x-prefiller-host-port`) over TLS

/// `prefill`'s HTTP port served as `strata engine --tls-cert --tls-key --tls-client-ca`
/// serves it (callers must present a certificate `files.ca` signed): each request that
/// gets through the handshake is counted and handed to `prefill` as sent.
fn tls_front(prefill: SocketAddr, files: &KvTlsFiles) -> (SocketAddr, Arc<AtomicUsize>) {
    use axum::extract::State;
    use axum::http::HeaderMap;
    let tls = strata_api::tls::TlsFiles {
        cert: files.cert.clone(),
        key: files.key.clone(),
        client_ca: Some(files.ca.clone()),
    };
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    let forward = move |State(n): State<Arc<AtomicUsize>>, headers: HeaderMap, body: String| async move {
        n.fetch_add(1, Ordering::SeqCst);
        let id = headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        let (status, answer) = tokio::task::spawn_blocking(move || post(prefill, &body, &id))
            .await
            .expect("forward");
        (
            axum::http::StatusCode::from_u16(status).expect("status"),
            answer.to_string(),
        )
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(l.local_addr().expect("addr")).expect("send");
            let app = axum::Router::new()
                .route("/v1/completions", axum::routing::post(forward))
                .with_state(count);
            let limits = strata_api::edge::EdgeLimits {
                tls: Some(tls),
                ..strata_api::edge::EdgeLimits::default()
            };
            let _ = strata_api::edge::serve(l, app, limits, std::future::pending::<()>()).await;
        });
    });
    (rx.recv_timeout(T).expect("front address"), served)
}

/// A completion sent to `addr` with the picker's `x-prefiller-host-port: prefiller`.
fn post_via_prefiller(
    addr: SocketAddr,
    body: &Value,
    prefiller: SocketAddr,
    id: &str,
) -> (u16, Value) {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(common::READ_TIMEOUT))
        .expect("timeout");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nx-request-id: {id}\r\nx-prefiller-host-port: {prefiller}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body.as_bytes()).expect("write body");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let (status, text) = common::parse_response(&raw);
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[test]
fn the_prefiller_header_runs_phase_one_over_mutual_tls() {
    let dir = Dir::new("phase1");
    let ca = Ca::new("cluster CA");
    let other = Ca::new("another CA");
    let a = start(
        EngineOptions {
            kv_role: KvRole::Prefill,
            kv_transfer_port: 1,
            num_blocks: Some(64),
            max_model_len: Some(512),
            kv_tls: Some(kv_tls(&dir, "prefill", &ca, &ca)),
            ..EngineOptions::default()
        },
        true,
    );
    let a_transfer = a.transfer.expect("A serves blocks");
    let (front, served) = tls_front(a.http, &kv_files(&dir, "front", &ca, &["127.0.0.1"], &ca));
    let decoder = |who: &str, leaf_ca: &Ca| {
        let peers = [front.to_string(), a_transfer.to_string()];
        start(
            EngineOptions {
                kv_peers: KvPeers::parse(&peers).expect("peers"),
                ..decode_opts(kv_tls(&dir, who, leaf_ca, &ca), a_transfer)
            },
            false,
        )
    };
    let b = decoder("decode", &ca);
    let prompt = prompt_text("lighthouse");
    let (status, colocated) = post(b.http, &completion(&prompt, 8), "colocated");
    assert_eq!(status, 200, "{colocated}");
    let want = text_of(&colocated);
    let (status, _) = common::request(b.http, "POST", "/reset_prefix_cache", b"");
    assert_eq!(status, 200);

    // B's phase 1 reaches A through its TLS port, presenting B's certificate; the pull
    // follows over mTLS.
    let (status, decoded) = post_via_prefiller(b.http, &completion(&prompt, 8), front, "p1");
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(
        text_of(&decoded),
        want,
        "phase 1 over TLS changed the output"
    );
    assert_eq!(served.load(Ordering::SeqCst), 1);
    assert_eq!(path_count(b.http, "remote_prefill"), 1.0);
    assert!(cached_of(&decoded) >= 16, "{decoded}");

    // An engine whose certificate another CA signed is refused at the handshake: it
    // recomputes, and A's port serves nothing more.
    let c = decoder("stranger", &other);
    let (status, decoded) = post_via_prefiller(c.http, &completion(&prompt, 8), front, "p1-x");
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(text_of(&decoded), want);
    assert_eq!(served.load(Ordering::SeqCst), 1);
    assert_eq!(path_count(c.http, "fallback"), 1.0);
}
