"""The one home for what several test folders share.

- free loopback ports: `bench.harness.free_port` (the benches and the tests use the same one)
- the mock OpenAI/Anthropic upstream: `bench.mock_openai`
- the gateway on a loopback port, and a route to a mock upstream: `tests.support.gateway`
- the OpenAI SDK pointed at a server: `tests.support.clients`
- Redis: the shared server's test database, and throwaway servers: `tests.support.redis_servers`
- the tiny random checkpoint the engine tests run on: `tests.support.tiny_model`

The fixtures built on these (`mock_upstream`, `make_gateway`, `redis_url`, `key_prefix`,
`private_redis`) live in `tests/conftest.py`, so that every folder sees them.
"""
