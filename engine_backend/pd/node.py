"""One engine's prefill/decode role: its config, its side channel, and its pulls.

Roles: `prefill` honours step 1 (hold KV for a decode server), `decode` honours step 3 (pull
KV, then decode), `both` honours either. Every role serves ordinary requests. A decode-side
pull that fails for any reason (refused connection, timeout, another model, tokens that are
not the prompt's, malformed bytes) is logged and counted, and the request is computed here
as an ordinary one: PD never fails a request that would have succeeded without it.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_backend.pd import params, wire
from engine_backend.pd.fingerprint import model_fingerprint
from engine_backend.pd.kv_blocks import KVBlocks
from engine_backend.pd.side_channel import KVSideChannelServer, PullError, PullRefused, pull_kv
from engine_backend.request_fields import EngineRequestError

if TYPE_CHECKING:
    from engine_backend.engine_thread import EngineThread
    from engine_backend.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class PDConfig:
    """How an engine takes part in prefill/decode separation."""

    role: str = "both"
    kv_host: str = "127.0.0.1"  # the side channel's address, announced as remote_host
    kv_port: int = 0  # 0: any free port
    hold_s: float = 30.0  # a hold nobody pulls is freed after this long
    max_held_blocks: int | None = None  # None: half the pool
    pull_hosts: tuple[str, ...] = LOOPBACK_HOSTS  # the only hosts a decode server pulls from
    pull_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if not 0 <= self.kv_port < 65536:
            raise ValueError("kv_port must be between 0 and 65535")
        if self.hold_s <= 0 or self.pull_timeout_s <= 0:
            raise ValueError("hold_s and pull_timeout_s must be positive")
        if self.max_held_blocks is not None and self.max_held_blocks < 1:
            raise ValueError("max_held_blocks must be >= 1")

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")


@dataclass
class PullCounts:
    ok: int = 0
    failed: int = 0  # the prefill server could not deliver (gone, slow, no such transfer)
    refused: int = 0  # delivered, but not usable here (another model, other tokens, bad host)
    tokens: int = 0  # prompt tokens whose KV was pulled and used


class PDNode:
    """The PD side of one LocalEngine."""

    def __init__(self, config: PDConfig, thread: EngineThread) -> None:
        self.config = config
        self.thread = thread
        llm = thread.llm
        llm.kv_holds.hold_s = config.hold_s
        if config.max_held_blocks is not None:
            llm.kv_holds.max_blocks = config.max_held_blocks
        self.engine_id = f"firsttoken-{uuid.uuid4().hex}"
        kv_cache = llm.model_runner.kv_cache
        self.geometry = wire.KVGeometry(
            fingerprint=model_fingerprint(llm.model_dir),
            block_size=llm.config.block_size,
            num_layers=int(kv_cache.shape[1]),
            num_kv_heads=int(kv_cache.shape[3]),
            head_dim=int(kv_cache.shape[4]),
        )
        self.pulls = PullCounts()
        self.server: KVSideChannelServer | None = None

    @property
    def kv_port(self) -> int:
        return self.server.port if self.server is not None else 0

    async def start(self) -> None:
        """Open the side channel (prefill and both roles)."""
        if not self.config.serves_prefill or self.server is not None:
            return
        header = {"engine_id": self.engine_id, **vars(self.geometry)}
        self.server = KVSideChannelServer(self._export, header)
        port = await self.server.start(self.config.kv_host, self.config.kv_port)
        logger.info(
            "KV side channel on %s:%d (role %s)", self.config.kv_host, port, self.config.role
        )

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None

    async def _export(self, transfer_id: str) -> tuple[list[int], KVBlocks] | None:
        def export(llm: LLMEngine) -> tuple[list[int], KVBlocks] | None:
            return llm.export_kv(transfer_id)

        return await self.thread.call(export)

    def check_role(self, step: params.RemoteDecode | params.RemotePrefill) -> None:
        """A 400 for a PD step this role does not take (a router misconfiguration)."""
        if isinstance(step, params.RemoteDecode) and not self.config.serves_prefill:
            raise EngineRequestError(
                f"{params.FIELD}: this engine's role is {self.config.role!r}; it does not "
                "prefill for remote decode",
                params.FIELD,
            )
        if isinstance(step, params.RemotePrefill) and not self.config.serves_decode:
            raise EngineRequestError(
                f"{params.FIELD}: this engine's role is {self.config.role!r}; it does not "
                "decode from a remote prefill",
                params.FIELD,
            )

    @staticmethod
    def new_transfer_id() -> str:
        """Unguessable: knowing it is what lets a decode server pull the KV."""
        return f"xfer-{secrets.token_hex(16)}"

    def answer(self, transfer_id: str, held_block_ids: list[int] | None) -> dict:
        """The prefill response's `kv_transfer_params` (no blocks: nothing worth pulling)."""
        blocks = held_block_ids or []
        return params.prefill_answer(
            self.engine_id, blocks, self.config.kv_host, self.kv_port, transfer_id
        )

    async def pull(self, step: params.RemotePrefill, prompt_ids: list[int]) -> KVBlocks | None:
        """The prompt's leading blocks from the prefill server, checked, or None (then the
        request is computed here)."""
        size = self.geometry.block_size
        count = len(step.block_ids)
        if count == 0:
            return None  # a prompt shorter than a block: nothing was held
        if step.host not in self.config.pull_hosts:
            logger.warning("not pulling KV from %s: not an allowed host", step.host)
            self.pulls.refused += 1
            return None
        if count * size > len(prompt_ids):
            self.pulls.refused += 1
            return None
        try:
            kv = await pull_kv(
                step.host,
                step.port,
                step.transfer_id,
                geometry=self.geometry,
                expected_block_ids=step.block_ids,
                timeout_s=self.config.pull_timeout_s,
            )
        except PullError as e:
            logger.warning("KV pull %s failed: %s; computing the prompt here", step.transfer_id, e)
            if isinstance(e, PullRefused):
                self.pulls.refused += 1
            else:
                self.pulls.failed += 1
            return None
        if kv.token_ids != prompt_ids[: count * size]:
            logger.warning("KV pull %s refused: its tokens are not the prompt's", step.transfer_id)
            self.pulls.refused += 1
            return None
        self.pulls.ok += 1
        return kv

    def status(self, llm: LLMEngine) -> dict:
        """Counters for /pd/status (call on the engine thread, for a consistent pool view)."""
        bm = llm.block_manager
        holds = llm.kv_holds
        return {
            "role": self.config.role,
            "engine_id": self.engine_id,
            "kv_host": self.config.kv_host,
            "kv_port": self.kv_port,
            "fingerprint": self.geometry.fingerprint,
            "held_transfers": len(holds.holds),
            "held_blocks": holds.num_held_blocks,
            "reserved_blocks": holds.num_reserved_blocks,
            "max_held_blocks": holds.max_blocks,
            "expired_holds": holds.num_expired,
            "served_transfers": self.server.num_served if self.server else 0,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_total_blocks,
            "running": len(llm.scheduler.running),
            "waiting": len(llm.scheduler.waiting),
            "pulls": {
                "ok": self.pulls.ok,
                "failed": self.pulls.failed,
                "refused": self.pulls.refused,
                "tokens": self.pulls.tokens,
            },
        }
