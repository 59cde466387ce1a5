//! Bench: load generation against any OpenAI-compatible URL, workloads, percentiles, reports and plots.
