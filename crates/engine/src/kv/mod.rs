//! The paged KV cache: where keys and values live ([`cache`]) and who owns which block
//! ([`block_pool`]).

pub mod block_pool;
pub mod cache;
