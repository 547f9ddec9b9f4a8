"""LoRA weight sync: only the adapters move to the engines.

Every trainer rank calls ``push(version)`` together: the adapters are gathered across
TP/EP/PP (``moerl.lora.gather_adapters``) and rank 0 loads them into every engine as a
new, versioned adapter named ``{prefix}-v{version}``, by one of two transports:

- ``tensors``: ``/load_lora_adapter_from_tensors``, the safetensors bytes in the request
  (no pickle, no shared storage; base64 in JSON costs encoding time);
- ``directory``: rank 0 writes a PEFT directory ``{directory}/{name}`` (atomically:
  written aside, then renamed) and the engines load it with ``/load_lora_adapter``;
  needs storage every engine can read (a shared filesystem on a cluster, or local
  disk / ``/dev/shm`` on one node). A version's directory is deleted when it is unloaded.

New requests use the newest adapter; requests in flight finish on the adapter they
began with, and an older adapter is unloaded once no request uses it (the engine
refuses while one does; we retry at the next push).
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moerl.common.checks import one_of

log = logging.getLogger(__name__)

TRANSPORTS = ("tensors", "directory")
RunCoro = Callable[[Coroutine[Any, Any, Any]], "concurrent.futures.Future[Any]"]


class AdapterSync:
    def __init__(
        self,
        gather: Callable[[], dict[str, Any]],
        config: dict[str, Any],
        *,
        client: Any = None,
        run_coro: RunCoro | None = None,
        prefix: str = "policy",
        timeout_s: float = 600.0,
        transport: str = "tensors",
        directory: str | Path | None = None,
    ) -> None:
        """gather: the collective that returns the full PEFT-named adapters on rank 0;
        config: their adapter_config.json; client / run_coro (rank 0): the engines and
        the event loop their client lives on; transport: 'tensors' or 'directory' (then ``directory`` is where versions go)."""
        one_of("adapter transport", transport, TRANSPORTS)
        if transport == "directory" and directory is None:
            raise ValueError("adapter transport 'directory' needs a directory the engines can read")
        self.gather, self.config, self.client, self._run = gather, config, client, run_coro
        self.prefix, self.timeout_s = prefix, timeout_s
        # where versions are written: only with the directory transport
        self.directory = (
            Path(directory) if transport == "directory" and directory is not None else None
        )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.loaded: list[str] = []  # oldest first; the last one is current
        self._tensors: dict[str, Any] = {}

    def name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    def push(self, version: int) -> dict[str, float]:
        """Collective: gather and load adapter ``version``; returns on rank 0 {"bytes"
        (the adapter tensors' bytes sent), "tensors", "seconds", and the phases
        "gather_s", "load_s" (encode or write, transfer, the engines' load), "unload_s"}."""
        start = time.perf_counter()
        tensors = self.gather()
        if self.rank != 0:
            return {}
        assert self.client is not None and self._run is not None
        gathered = time.perf_counter()
        name = self.name(version)
        if self.directory is not None:  # written here, off the engines' event loop
            self._write(name, tensors)
        self._run(self._load(name, tensors)).result(self.timeout_s)
        self._tensors = tensors
        self.loaded.append(name)
        loaded = time.perf_counter()
        self._unload_unused()
        end = time.perf_counter()
        return {
            "bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
            "tensors": float(len(tensors)),
            "seconds": end - start,
            "gather_s": gathered - start,
            "load_s": loaded - gathered,
            "unload_s": end - loaded,
        }

    def _write(self, name: str, tensors: dict[str, Any]) -> Path:
        """The PEFT directory of adapter ``name``, written aside and renamed into place."""
        from moerl.lora import save_peft

        assert self.directory is not None
        final = self.directory / name
        aside = self.directory / f".{name}.partial"
        shutil.rmtree(aside, ignore_errors=True)
        save_peft(aside, tensors, self.config)
        shutil.rmtree(final, ignore_errors=True)
        aside.rename(final)
        return final

    async def _load(self, name: str, tensors: dict[str, Any], urls: list[str] | None = None) -> Any:
        """Load adapter ``name`` into the engines (``urls``: only these): from its written
        directory, or from ``tensors`` in the request."""
        assert self.client is not None
        if self.directory is not None:
            path = str(self.directory / name)
            return await self.client.load_lora_adapter(name, path, urls=urls)
        return await self.client.load_lora_adapter_from_tensors(
            name, tensors, self.config, urls=urls
        )

    def _unload_unused(self) -> None:
        still = []
        for name in self.loaded[:-1]:
            try:
                self._run(self.client.unload_lora_adapter(name)).result(60)  # type: ignore[union-attr, misc]
            except Exception as err:  # in use by requests in flight: try again next push
                log.debug("adapter %s not unloaded yet: %s", name, err)
                still.append(name)
                continue
            if self.directory is not None:
                shutil.rmtree(self.directory / name, ignore_errors=True)
        self.loaded = [*still, self.loaded[-1]]

    async def restore(self, url: str) -> None:
        """Load the current adapter into one (restarted) engine under its current name."""
        if self.loaded:
            await self._load(self.loaded[-1], self._tensors, urls=[url])

    def close(self) -> None:
        pass
