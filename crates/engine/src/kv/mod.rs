//! The paged KV cache: where keys and values live ([`cache`]), who owns which block
//! ([`block_pool`]) and how full blocks are named for prefix caching ([`hashing`]).

pub mod block_pool;
pub mod cache;
pub mod hashing;
