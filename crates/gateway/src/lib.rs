//! Gateway: API keys and tenants, token rate limits, budgets and cost, model aliases and fallbacks, response caches, guardrails.
