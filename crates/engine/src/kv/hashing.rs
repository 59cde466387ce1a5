//! vLLM-compatible prefix-cache block hashes (PROTOCOLS §3). The implementation lives in
//! [`strata_api::block_hash`] (pure, shared with the router's precise prefix index) and is
//! re-exported here.

pub use strata_api::block_hash::*;
