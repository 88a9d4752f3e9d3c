"""KV block pool, prefix cache, tiers and transfer transports."""
