//! Router: endpoint discovery, metric scraping, KV-event prefix index, the scheduling framework (filters, scorers, pickers) and the streaming proxy.
