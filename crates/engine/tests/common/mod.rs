//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The default model: `$STRATA_TEST_MODEL`, else the cache entry that `strata model pull`
/// writes. A missing model fails the test with what to run; it is never skipped.
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let cache = strata_engine::model_cache::ModelCache::from_env();
    let path = cache.path_of(strata_engine::model_cache::DEFAULT_MODEL);
    assert!(
        path.is_file(),
        "the default model is missing at {}; run `cargo run -p strata-cli -- model pull` \
         (scripts/test.sh does this first)",
        path.display()
    );
    path
}
