//! The paged KV cache: where keys and values live ([`cache`]; 8-bit entries in
//! [`quant8`]), who owns which block
//! ([`block_pool`], its prefix-cache table in `prefix_table`) and how full blocks are
//! named for prefix caching ([`hashing`]); how
//! blocks move between engines and the shared tier ([`transfer`]) and what the tier
//! keeps ([`tier`]) and how an engine offloads to it ([`offload`]); which peers an engine may
//! connect to ([`peers`]); the block protocol over TLS ([`tls`]).

pub mod block_pool;
pub mod cache;
pub mod hashing;
pub mod offload;
pub mod peers;
mod prefix_table;
pub mod quant8;
pub mod tier;
pub mod tls;
pub mod transfer;
