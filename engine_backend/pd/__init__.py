"""Prefill/decode separation for the bundled engine, speaking vLLM's protocol.

A prefill server answers a request that carries `kv_transfer_params.do_remote_decode`,
keeps the prompt's KV blocks pinned, and serves them on a loopback TCP side channel; a
decode server given the returned `kv_transfer_params` (`do_remote_prefill`) pulls those
blocks, checks them against its own tokenization of the prompt, puts them into its pool and
prefix cache, and decodes. Modules: holds (pinned blocks and timeouts), kv_blocks (copying
blocks out of and into the cache), fingerprint (which model a KV belongs to), wire (the side
channel's framing), side_channel (its server and client), params (the request field),
node (one engine's PD role).
"""
