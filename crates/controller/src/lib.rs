//! Controller: autoscaling and rollout policies, the model registry, replica drivers (local processes, Kubernetes) and the KEDA external scaler.
