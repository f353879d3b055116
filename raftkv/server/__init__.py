"""``raftkv serve``: the HTTP API (aiohttp), admin endpoints and Prometheus metrics."""
