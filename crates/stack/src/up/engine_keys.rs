//! The keys `strata up` gives its engines (issue 29): an API key the router sends on every
//! request to them (`engine_api_key`) and an admin key for their admin routes, fresh at each
//! start. They reach the engines through the environment (`STRATA_API_KEY`,
//! `STRATA_ADMIN_KEY`), never the command line, where any local user's `ps` would show them.
//!
//! An engine that requires its API key lets only key holders name KV-transfer peers, so the
//! router's prefill/decode hand-off works without a `--kv-peers` list (the prefill engines'
//! ports are only known once they start).
//!
//! A key the operator chose wins: the router config's `engine_api_key`, else an
//! `--engine-arg=--api-key=KEY` (the engine's command line overrides its environment); an
//! `--engine-arg=--admin-key=KEY` likewise overrides the generated admin key on the engines.

use std::collections::BTreeMap;

/// The engines' keys for one run of the stack.
pub(super) struct EngineKeys {
    api: String,
    admin: String,
}

impl std::fmt::Debug for EngineKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineKeys(..)")
    }
}

impl EngineKeys {
    /// The API key the router's config names, else the one the engine arguments give, else
    /// a fresh one; a fresh admin key.
    pub fn for_stack(engine_args: &[String], router_key: Option<&str>) -> Self {
        let api = router_key
            .map(str::to_string)
            .or_else(|| first_api_key(engine_args))
            .unwrap_or_else(random_key);
        Self {
            api,
            admin: random_key(),
        }
    }

    /// The key the router sends engines.
    pub fn api(&self) -> &str {
        &self.api
    }

    /// The environment every replica starts with.
    pub fn env(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("STRATA_API_KEY".to_string(), self.api.clone()),
            ("STRATA_ADMIN_KEY".to_string(), self.admin.clone()),
        ])
    }
}

/// 256 random bits (the thread's CSPRNG), as hex.
fn random_key() -> String {
    let (a, b): (u128, u128) = (rand::random(), rand::random());
    format!("{a:032x}{b:032x}")
}

/// The first key of an `--api-key KEY` or `--api-key=KEY` among `args` (its value may list
/// several, comma-separated).
fn first_api_key(args: &[String]) -> Option<String> {
    let value = args.iter().enumerate().find_map(|(i, a)| {
        if a == "--api-key" {
            args.get(i + 1).cloned()
        } else {
            a.strip_prefix("--api-key=").map(str::to_string)
        }
    })?;
    value
        .split(',')
        .map(str::trim)
        .find(|k| !k.is_empty())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn fresh_keys_each_run_unless_the_operator_chose_one() {
        let a = EngineKeys::for_stack(&[], None);
        let b = EngineKeys::for_stack(&[], None);
        assert_eq!(a.api().len(), 64);
        assert!(a.api().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a.api(), b.api());
        assert_ne!(a.api, a.admin);
        let env = a.env();
        assert_eq!(env["STRATA_API_KEY"], a.api);
        assert_eq!(env["STRATA_ADMIN_KEY"], a.admin);
        assert!(!format!("{a:?}").contains(&a.api));

        let own = EngineKeys::for_stack(&args(&["--mock", "--api-key", "k1,k2"]), None);
        assert_eq!(own.api(), "k1");
        let own = EngineKeys::for_stack(&args(&["--api-key=k3"]), None);
        assert_eq!(own.api(), "k3");
        let own = EngineKeys::for_stack(&args(&["--api-key=k3"]), Some("from-router"));
        assert_eq!(own.api(), "from-router");
    }
}
