//! `InferenceObjective`s (`inference.networking.x-k8s.io/v1alpha2`) of this picker's pool:
//! listed every `interval` in the pool's namespace, those whose `spec.poolRef.name` is the
//! pool kept, each name mapped to its `spec.priority` (0 when unset), and handed to the
//! router ([`Router::set_cluster_objectives`]), whose requests name an objective in the
//! `x-gateway-inference-objective` header or through `admission.model_objectives`.
//!
//! A failed list keeps the objectives last read (a flaky API server must not reorder the
//! queue); a cluster without the CRD (404) has none.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::core::GroupVersionKind;

use crate::router::Router;

/// The API group of `InferenceObjective`.
pub const OBJECTIVE_GROUP: &str = "inference.networking.x-k8s.io";
/// Its version.
pub const OBJECTIVE_VERSION: &str = "v1alpha2";

fn objective_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(OBJECTIVE_GROUP, OBJECTIVE_VERSION, "InferenceObjective"),
        "inferenceobjectives",
    )
}

/// The priorities of the objectives that name `pool` (pure: the list as the API server
/// returned it). A priority that is not an integer in `i32`'s range counts as unset (0).
pub fn objectives_for_pool(items: &[DynamicObject], pool: &str) -> BTreeMap<String, i32> {
    items
        .iter()
        .filter(|o| o.data["spec"]["poolRef"]["name"].as_str() == Some(pool))
        .filter_map(|o| {
            let name = o.metadata.name.clone()?;
            let priority = o.data["spec"]["priority"]
                .as_i64()
                .and_then(|p| i32::try_from(p).ok())
                .unwrap_or(0);
            Some((name, priority))
        })
        .collect()
}

/// Lists the objectives of `pool` in `namespace` every `interval`, for the life of the
/// process.
pub fn spawn(
    client: kube::Client,
    namespace: &str,
    pool: String,
    router: Router,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &objective_resource());
    tokio::spawn(async move {
        let mut missing_logged = false;
        loop {
            match tokio::time::timeout(
                interval.max(Duration::from_secs(1)),
                api.list(&ListParams::default()),
            )
            .await
            {
                Ok(Ok(list)) => {
                    let found = objectives_for_pool(&list.items, &pool);
                    tracing::debug!(pool = %pool, objectives = found.len(), "InferenceObjectives read");
                    router.set_cluster_objectives(found);
                }
                Ok(Err(kube::Error::Api(e))) if e.code == 404 => {
                    if !missing_logged {
                        tracing::info!("no InferenceObjective resource in this cluster; objectives come from router.yaml");
                        missing_logged = true;
                    }
                    router.set_cluster_objectives(BTreeMap::new());
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "listing InferenceObjectives failed; keeping the last read")
                }
                Err(_) => {
                    tracing::warn!("listing InferenceObjectives timed out; keeping the last read")
                }
            }
            tokio::time::sleep(interval).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn objective(name: &str, pool: &str, priority: Option<i64>) -> DynamicObject {
        let mut spec = json!({"poolRef": {"name": pool}});
        if let Some(p) = priority {
            spec["priority"] = json!(p);
        }
        serde_json::from_value(json!({
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": "serving"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn only_this_pools_objectives_count_and_an_unset_priority_is_zero() {
        let items = vec![
            objective("chat", "llm", Some(10)),
            objective("batch", "llm", Some(-1)),
            objective("plain", "llm", None),
            objective("other-pool", "elsewhere", Some(99)),
            objective("huge", "llm", Some(1 << 40)),
        ];
        let got = objectives_for_pool(&items, "llm");
        let want: BTreeMap<String, i32> = [
            ("batch".to_string(), -1),
            ("chat".into(), 10),
            ("huge".into(), 0),
            ("plain".into(), 0),
        ]
        .into();
        assert_eq!(got, want);
    }
}
