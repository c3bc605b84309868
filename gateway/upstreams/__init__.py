"""Upstream kinds behind one `Upstream` contract (`base`): `openai` (any OpenAI-compatible
server), `anthropic`, `local` (the bundled engine), replicated routes (`replicas/`) and
prefill/decode pairs (`pd/`). `build.build_upstream` chooses the kind for a route."""
