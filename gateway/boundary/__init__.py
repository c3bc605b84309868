"""The trust boundary: admission (request id, tenant, bounded body, parse, route), keys, ownership,
heavy-work offload."""
