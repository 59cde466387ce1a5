//! `strata model keygen|sign|verify`, and `strata engine --verify-key` refusing a model whose
//! files do not match its signed manifest (before anything is loaded).

mod common;

use common::strata;

#[test]
fn a_tampered_model_fails_verification_and_the_engine_refuses_it() {
    let dir = std::env::temp_dir().join(format!("strata-sign-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    // Not a loadable model: verification comes first, loading second.
    std::fs::write(&model, b"GGUF but not really a model").unwrap();
    let key = dir.join("key");
    let run = |args: &[&std::ffi::OsStr]| strata().args(args).output().expect("run strata");
    let os = |s: &str| std::ffi::OsString::from(s);

    let out = run(&[&os("model"), &os("keygen"), &os("--out"), key.as_os_str()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let public = dir.join("key.pub");
    assert!(public.is_file());
    let out = run(&[
        &os("model"),
        &os("sign"),
        model.as_os_str(),
        &os("--key"),
        key.as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&[
        &os("model"),
        &os("verify"),
        model.as_os_str(),
        &os("--key"),
        public.as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Signed and intact: the engine gets past verification and fails on the bogus GGUF.
    let engine = |port: &str| {
        run(&[
            &os("engine"),
            &os("--model"),
            model.as_os_str(),
            &os("--port"),
            &os(port),
            &os("--verify-key"),
            public.as_os_str(),
        ])
    };
    let out = engine("0");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("refusing to load"), "{err}");

    // One byte changed: verify says what differs, the engine refuses to load.
    std::fs::write(&model, b"GGUF but not really a modeL").unwrap();
    let out = run(&[
        &os("model"),
        &os("verify"),
        model.as_os_str(),
        &os("--key"),
        public.as_os_str(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tiny.gguf"), "{err}");
    let out = engine("0");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("refusing to load"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
