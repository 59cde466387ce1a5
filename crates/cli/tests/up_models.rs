//! `strata up` with `models:`, one pool per model, as real processes on loopback: mock
//! engine pools that answer their own models and only theirs, an unknown model's 404, a
//! pool scaled to zero woken by a request, a pool that cannot start answering 503 with
//! `Retry-After`, bad `models:` configs refused at startup, and the real chat model (with
//! two LoRA adapters) beside the MiniLM embedding model, driven by the OpenAI Python SDK
//! through the front and the gateway.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{children, free_port, strata, workspace_root};
use serde_json::{json, Value};

/// `strata up` as a child, stopped with SIGINT (then SIGKILL) when dropped.
struct Up {
    child: std::process::Child,
    addr: SocketAddr,
    dir: PathBuf,
    banner: Vec<String>,
}

impl Drop for Up {
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            let _ = Command::new("kill")
                .args(["-INT", &self.child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

impl Up {
    /// Starts `strata up --config` with `yaml` and waits (up to `timeout`) for the banner
    /// line containing `marker`.
    fn start(dir: PathBuf, yaml: &str, marker: &str, timeout: Duration) -> Up {
        let file = dir.join("strata.yaml");
        std::fs::write(&file, yaml).expect("write strata.yaml");
        let port = free_port();
        let mut child = strata()
            .args(["up", "--port", &port.to_string()])
            .arg("--config")
            .arg(&file)
            .arg("--log-dir")
            .arg(dir.join("logs"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strata up");
        let banner = common::read_until(&mut child, marker, timeout);
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let mut up = Up {
            child,
            addr,
            dir,
            banner: Vec::new(),
        };
        up.banner = banner.unwrap_or_else(|e| panic!("strata up did not come up: {e}"));
        up
    }

    fn get(&self, path: &str) -> Value {
        let r = request(self.addr, "GET", path, "");
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        serde_json::from_str(&r.body).expect("JSON")
    }

    fn pool(&self, name: &str) -> Value {
        self.get("/controller/pools")
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == name).cloned())
            .unwrap_or(Value::Null)
    }

    /// Ctrl-C; the process must exit cleanly and leave no replica behind.
    fn stop(mut self) {
        common::interrupt_and_reap(&mut self.child);
    }
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// One HTTP/1.1 exchange (`Connection: close`), with the answer's headers.
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn completion(addr: SocketAddr, model: &str) -> Reply {
    let body = json!({"model": model, "prompt": "Hello there", "max_tokens": 4});
    request(addr, "POST", "/v1/completions", &body.to_string())
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Replica processes of `strata up` loading `model`.
fn engines_of(up: &Up, model: &str) -> usize {
    let needle = format!("--model {model} ");
    children(up.child.id())
        .into_iter()
        .filter(|(_, cmd)| cmd.contains(&needle))
        .count()
}

#[test]
fn pools_serve_their_own_models_scale_to_zero_wake_and_list_every_model() {
    let yaml = "engine_args: [--mock]\n\
        gateway: false\n\
        controller_interval_secs: 0.3\n\
        hold_timeout_secs: 8\n\
        models:\n\
        - model: mock-chat\n  replicas: 1\n\
        - model: mock-small\n  name: small\n  replicas: 2\n\
        - model: mock-rare\n  autoscale: {minReplicas: 0, maxReplicas: 1, stableWindowSecs: 2, \
            panicWindowSecs: 1, scaleInCooldownSecs: 1, scaleToZeroAfterSecs: 1}\n\
        - model: mock-broken\n  engine_args: [--no-such-engine-flag]\n  \
            autoscale: {minReplicas: 0, maxReplicas: 1, scaleToZeroAfterSecs: 1}\n";
    let up = Up::start(
        temp_dir("up-models"),
        yaml,
        "controller:",
        Duration::from_secs(40),
    );
    let text = up.banner.join("\n");
    assert!(text.contains("Strata is up: 4 models"), "{text}");
    assert!(text.contains("model small: 2 replica(s)"), "{text}");
    assert!(
        text.contains("model mock-rare: 0 replica(s), autoscaling 0..1"),
        "{text}"
    );
    assert_eq!(engines_of(&up, "mock-chat"), 1);
    assert_eq!(engines_of(&up, "mock-small"), 2);

    // Each pool answers its own model, and only its replicas serve it.
    let state = up.get("/ui/api/state");
    let urls_of = |pool: &str| -> BTreeSet<String> {
        state["replicas"]
            .as_array()
            .expect("replicas")
            .iter()
            .filter(|r| r["pool"] == pool)
            .filter_map(|r| r["url"].as_str())
            .map(|u| u.trim_start_matches("http://").to_string())
            .collect()
    };
    let (chat_urls, small_urls) = (urls_of("mock-chat"), urls_of("small"));
    assert_eq!((chat_urls.len(), small_urls.len()), (1, 2), "{state}");
    for (model, urls) in [("mock-chat", &chat_urls), ("small", &small_urls)] {
        let mut served = BTreeSet::new();
        for _ in 0..8 {
            let r = completion(up.addr, model);
            assert_eq!(r.status, 200, "{model}: {}", r.body);
            assert_eq!(r.json()["model"], model);
            let by = r
                .header("x-gateway-destination-endpoint-served")
                .expect("served-by header")
                .to_string();
            assert!(
                urls.contains(&by),
                "{model} served by {by}, not one of {urls:?}"
            );
            served.insert(by);
        }
        assert!(!served.is_empty());
    }

    // A model no pool serves: 404, OpenAI-shaped.
    let r = completion(up.addr, "no-such-model");
    assert_eq!(r.status, 404, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["code"], "model_not_found", "{e}");
    assert_eq!(e["error"]["type"], "not_found_error", "{e}");
    assert_eq!(e["error"]["param"], "model", "{e}");

    // No `model` with several pools: 400 naming the parameter; a body that is not JSON: the
    // router's 400.
    let r = request(up.addr, "POST", "/v1/completions", r#"{"prompt": "x"}"#);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "model", "{}", r.body);
    let r = request(up.addr, "POST", "/v1/completions", "{not json");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["message"].is_string(), "{}", r.body);

    // /v1/models lists every pool, the ones at zero replicas too.
    let ids: BTreeSet<String> = up.get("/v1/models")["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect();
    let want: BTreeSet<String> = ["mock-chat", "small", "mock-rare", "mock-broken"]
        .map(String::from)
        .into();
    assert_eq!(ids, want);

    // The scaled-to-zero pool: no replica once idle (a pool at `minReplicas: 0` keeps one
    // until its first quiet spell), until a request wakes one and waits for it.
    wait_for("mock-rare at zero", Duration::from_secs(30), || {
        up.pool("mock-rare")["desired"] == 0 && engines_of(&up, "mock-rare") == 0
    });
    assert_eq!(up.pool("mock-rare")["ready"], 0);
    let r = completion(up.addr, "mock-rare");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "mock-rare");
    assert_eq!(up.pool("mock-rare")["desired"], 1);
    // The other pools kept their counts.
    assert_eq!(up.pool("small")["desired"], 2);
    assert_eq!(up.pool("mock-chat")["desired"], 1);
    // The dashboard shows each pool.
    let pools = up.get("/ui/api/state")["pools"].clone();
    let small = pools
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "small"))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(small["replicas"], 2, "{pools}");
    assert_eq!(small["model"], "mock-small", "{pools}");
    assert_eq!(pools.as_array().map(Vec::len), Some(4), "{pools}");
    // Idle again: back to zero.
    wait_for("mock-rare back to zero", Duration::from_secs(30), || {
        up.pool("mock-rare")["desired"] == 0 && engines_of(&up, "mock-rare") == 0
    });

    // A pool whose replicas never start: the request waits the hold, then a 503 that says
    // when to retry; the rest of the stack keeps serving.
    let started = Instant::now();
    let r = completion(up.addr, "mock-broken");
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        started.elapsed() >= Duration::from_secs(7),
        "{:?}",
        started.elapsed()
    );
    assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("mock-broken")));
    assert_eq!(completion(up.addr, "small").status, 200);
    up.stop();
}

#[test]
fn bad_models_configs_are_refused_at_startup() {
    let dir = temp_dir("up-models-bad");
    let cases: [(&str, &[&str], &str); 6] = [
        (
            "models:\n- model: a\n- model: b\n  name: a\n",
            &[],
            "models[1].name: the name `a` is already used by models[0].name",
        ),
        (
            "models:\n- model: a\n  adapters: [{name: b, path: /x}]\n- model: b\n",
            &[],
            "models[1].name: the name `b` is already used by models[0].adapters[0]",
        ),
        ("models:\n- name: a\n", &[], "missing field `model`"),
        (
            "models:\n- model: a\n  autoscale: {minReplicas: 3, maxReplicas: 1}\n",
            &[],
            "minReplicas",
        ),
        ("models:\n- model: a\n", &["--model", "b"], "--model"),
        ("model: x\nmodels:\n- model: a\n", &[], "per entry"),
    ];
    for (yaml, extra, want) in cases {
        let file = dir.join("strata.yaml");
        std::fs::write(&file, yaml).expect("write");
        let started = Instant::now();
        let out = strata()
            .args(["up", "--port", &free_port().to_string(), "--no-gateway"])
            .arg("--config")
            .arg(&file)
            .args(extra)
            .output()
            .expect("run strata up");
        assert!(!out.status.success(), "{yaml} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{yaml}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(20));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn python(script: &Path, args: &[String]) {
    let out = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("all checks passed"),
        "{} failed:\n{stdout}\n{stderr}",
        script.display()
    );
}

/// The real models: SmolLM2 with two LoRA adapters (one real, one with B = 0) and the
/// MiniLM encoder, each its own pool of one replica; the OpenAI SDK drives chat through
/// both adapters and `embeddings.create` through the front, and both kinds through the
/// gateway with its generated key.
#[test]
fn chat_model_with_two_adapters_and_the_embedding_model_answer_through_one_front() {
    let root = workspace_root();
    let dir = temp_dir("up-models-real");
    for (name, extra) in [("real", &[][..]), ("zero", &["--zero-b"][..])] {
        let st = Command::new("python3")
            .arg(root.join("tools/make_lora_adapter.py"))
            .arg(dir.join(name))
            .args(["--rank", "8", "--seed", "16"])
            .args(extra)
            .status()
            .expect("run make_lora_adapter.py");
        assert!(st.success(), "make_lora_adapter.py {name}");
    }
    let yaml = format!(
        "gateway_port: 0\ngateway_db: ':memory:'\nkv_cache_memory: 33554432\n\
         models:\n\
         - model: smollm2-135m-instruct\n  replicas: 1\n  adapters:\n\
         \x20   - {{name: sql-real, path: {real}}}\n\
         \x20   - {{name: sql-zero, path: {zero}}}\n\
         - model: all-minilm-l6-v2\n  replicas: 1\n",
        real = dir.join("real").display(),
        zero = dir.join("zero").display(),
    );
    let up = Up::start(dir, &yaml, "gateway:", Duration::from_secs(240));
    let text = up.banner.join("\n");
    assert!(
        text.contains("model smollm2-135m-instruct: 1 replica(s) (adapters: sql-real, sql-zero)"),
        "{text}"
    );
    let base = format!("http://{}/v1", up.addr);
    python(
        &root.join("tests/openai_lora.py"),
        &[
            base.clone(),
            "smollm2-135m-instruct".into(),
            "sql-real".into(),
            "sql-zero".into(),
        ],
    );
    python(
        &root.join("tests/openai_embeddings.py"),
        &[
            base,
            "all-minilm-l6-v2".into(),
            root.join("tests/fixtures/minilm/reference.json")
                .display()
                .to_string(),
        ],
    );

    // Through the gateway, with the key it printed.
    let line = up
        .banner
        .iter()
        .find(|l| l.contains("gateway:"))
        .expect("gateway line");
    let gw = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("gateway URL")
        .to_string();
    let key = line
        .rsplit("API key: ")
        .next()
        .map(|k| k.trim_end_matches(')').to_string())
        .expect("key");
    let check = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=120)
ids = {m.id for m in c.models.list().data}
want = {"smollm2-135m-instruct", "sql-real", "sql-zero", "all-minilm-l6-v2"}
assert want <= ids, ids
for model in ("smollm2-135m-instruct", "sql-real"):
    r = c.chat.completions.create(model=model, max_tokens=4,
                                  messages=[{"role": "user", "content": "Hi"}])
    assert r.usage.completion_tokens > 0, r
e = c.embeddings.create(model="all-minilm-l6-v2", input=["one", "two"])
assert len(e.data) == 2 and len(e.data[0].embedding) == 384, e
print("all checks passed")
"#;
    let out = Command::new("python3")
        .args(["-c", check, &gw, &key])
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "through the gateway:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    up.stop();
}
