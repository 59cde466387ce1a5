//! Helpers shared by the CLI's process tests: spawn `strata`, talk HTTP/1.1 on loopback.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

/// A `strata engine` child, killed on drop if still running.
pub struct Engine {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A supervising child (`strata up`, a gateway): if the test ends part-way, dropping this
/// stops it with SIGINT (so that it stops its engines too), then SIGKILL if it has not
/// exited within 20 s.
pub struct Supervised(pub Child);

impl Drop for Supervised {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.0.try_wait() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-INT", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    http_with_headers(addr, method, path, body, &[])
}

/// One HTTP/1.1 exchange with extra request headers (`Connection: close`).
pub fn http_with_headers(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    Some((status, body))
}

/// Starts `strata engine` on a free port with `extra` flags and waits until it is ready.
pub fn start_engine_with(extra: &[&str]) -> Engine {
    let port = free_port();
    let child = strata()
        .args(["engine", "--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn strata engine");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let mut engine = Engine { child, addr };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some((200, _)) = http(addr, "GET", "/health", "") {
            return engine;
        }
        if let Ok(Some(status)) = engine.child.try_wait() {
            panic!("strata engine exited early with {status}");
        }
        assert!(Instant::now() < deadline, "engine not ready in 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A default-model engine with a 256 MiB KV cache.
pub fn start_engine() -> Engine {
    start_engine_with(&["--kv-cache-memory", "268435456"])
}

/// Child processes of `pid` with their command lines.
pub fn children(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let ppid = fields.next().and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) && state != Some("Z") {
            let cmd = std::fs::read(format!("/proc/{child}/cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .unwrap_or_default();
            out.push((child, cmd));
        }
    }
    out
}

pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Reads `child`'s stdout, line by line, until a line contains `marker` (`strata up` prints
/// its banner once it serves). Returns the lines read, or, after `timeout` or at the end of
/// the output, an error holding them. Later output keeps being drained so the child never
/// blocks on a full pipe.
pub fn read_until(
    child: &mut Child,
    marker: &str,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    use std::io::BufRead;
    let stdout = child.stdout.take().ok_or("stdout is not piped")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + timeout;
    let mut lines = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains(marker);
                lines.push(line);
                if done {
                    return Ok(lines);
                }
            }
            Err(e) => return Err(format!("no line with {marker:?} ({e}); output: {lines:?}")),
        }
    }
}

/// Ctrl-C to a `strata up` (or any supervisor): it must exit cleanly within 40 s and leave
/// none of its children alive.
pub fn interrupt_and_reap(child: &mut std::process::Child) {
    let engines = children(child.id());
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill -INT")
        .success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(40);
    let exit = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "strata up did not exit after Ctrl-C"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(exit.success(), "strata up exited with {exit}");
    for (pid, _) in engines {
        assert!(!alive(pid), "engine {pid} outlived strata up");
    }
}
