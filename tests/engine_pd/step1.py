"""vLLM's step-1 `kv_transfer_params`, written out here rather than imported from the gateway,
so that the engine's tests check the wire format itself."""

STEP1 = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
