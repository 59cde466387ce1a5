//! Simulator: virtual clock, engine performance model, workloads and trace replay, driving the real router and controller policies.
