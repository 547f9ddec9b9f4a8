"""LoRA weight sync: only the adapters move to the engines.

Every trainer rank calls ``push(version)`` together: the adapters are gathered across
TP/EP/PP (``moerl.lora.gather_adapters``) and rank 0 loads them into every engine as a
new, versioned adapter (``/load_lora_adapter_from_tensors``, safetensors bytes, no
pickle) named ``{prefix}-v{version}``. New requests use the newest adapter; requests
in flight finish on the adapter they began with, and an older adapter is unloaded once
no request uses it (the engine refuses while one does; we retry at the next push).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

RunCoro = Callable[[Coroutine[Any, Any, Any]], "concurrent.futures.Future[Any]"]


class AdapterSync:
    def __init__(
        self,
        gather: Callable[[], dict[str, Any]],
        config: dict[str, Any],
        *,
        client: Any = None,
        run_coro: RunCoro | None = None,
        on_loaded: Callable[[str, int], None] | None = None,
        prefix: str = "policy",
        timeout_s: float = 600.0,
    ) -> None:
        """gather: the collective that returns the full PEFT-named adapters on rank 0;
        config: their adapter_config.json; client / run_coro (rank 0): the engines and
        the event loop their client lives on; on_loaded(name, version): told once every
        engine has the adapter (the orchestrator switches new requests to it)."""
        self.gather, self.config, self.client, self._run = gather, config, client, run_coro
        self.on_loaded, self.prefix, self.timeout_s = on_loaded, prefix, timeout_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.loaded: list[str] = []  # oldest first; the last one is current
        self._tensors: dict[str, Any] = {}

    def name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    def push(self, version: int) -> dict[str, float]:
        """Collective: gather and load adapter ``version``; returns {"bytes", "seconds",
        "tensors"} on rank 0 (bytes = the adapter tensors' bytes sent)."""
        start = time.perf_counter()
        tensors = self.gather()
        if self.rank != 0:
            return {}
        assert self.client is not None and self._run is not None
        name = self.name(version)
        self._run(self.client.load_lora_adapter_from_tensors(name, tensors, self.config)).result(
            self.timeout_s
        )
        self._tensors = tensors
        self.loaded.append(name)
        if self.on_loaded is not None:
            self.on_loaded(name, version)
        self._unload_unused()
        return {
            "bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
            "tensors": float(len(tensors)),
            "seconds": time.perf_counter() - start,
        }

    def _unload_unused(self) -> None:
        still = []
        for name in self.loaded[:-1]:
            try:
                self._run(self.client.unload_lora_adapter(name)).result(60)  # type: ignore[union-attr, misc]
            except Exception as err:  # in use by requests in flight: try again next push
                log.debug("adapter %s not unloaded yet: %s", name, err)
                still.append(name)
        self.loaded = [*still, self.loaded[-1]]

    async def restore(self, url: str) -> None:
        """Load the current adapter into one (restarted) engine under its current name."""
        if self.loaded:
            await self.client.load_lora_adapter_from_tensors(
                self.loaded[-1], self._tensors, self.config, urls=[url]
            )

    def close(self) -> None:
        pass
