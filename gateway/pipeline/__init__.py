"""The chat path: prepare the upstream body once, proxy with retries and fallbacks, relay the
stream, record the request."""
