//! Request priorities by `InferenceObjective` name: the ones Kubernetes holds for this
//! router's pool (read by `k8s::objectives`), over the ones in router.yaml
//! (`admission.objectives`). A name neither knows may be an integer priority itself.

use std::collections::BTreeMap;

use std::sync::RwLock;

/// The objectives read from the cluster; empty without Kubernetes.
#[derive(Debug, Default)]
pub struct ClusterObjectives {
    by_name: RwLock<BTreeMap<String, i32>>,
}

impl ClusterObjectives {
    /// Replaces what the cluster holds for this pool (objectives deleted there go).
    pub fn replace(&self, objectives: BTreeMap<String, i32>) {
        match self.by_name.write() {
            Ok(mut m) => *m = objectives,
            Err(poisoned) => *poisoned.into_inner() = objectives,
        }
    }

    /// The priority of `name`: the cluster's, else `configured`'s, else `name` as an
    /// integer.
    pub fn priority(&self, name: &str, configured: &BTreeMap<String, i32>) -> Option<i32> {
        let cluster = self.by_name.read().unwrap_or_else(|p| p.into_inner());
        cluster
            .get(name)
            .or_else(|| configured.get(name))
            .copied()
            .or_else(|| name.parse().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cluster_wins_over_the_file_and_integers_stand_for_themselves() {
        let file: BTreeMap<String, i32> = [("chat".to_string(), 10), ("batch".into(), -1)].into();
        let c = ClusterObjectives::default();
        assert_eq!(c.priority("chat", &file), Some(10));
        assert_eq!(c.priority("7", &file), Some(7));
        assert_eq!(c.priority("unknown", &file), None);
        c.replace([("chat".to_string(), 20), ("agents".into(), 5)].into());
        assert_eq!(c.priority("chat", &file), Some(20));
        assert_eq!(c.priority("agents", &file), Some(5));
        assert_eq!(c.priority("batch", &file), Some(-1));
        // An objective deleted in the cluster falls back to the file.
        c.replace(BTreeMap::new());
        assert_eq!(c.priority("chat", &file), Some(10));
    }
}
