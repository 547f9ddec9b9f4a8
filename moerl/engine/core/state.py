"""What one engine process serves from: its model runner, scheduler, tokenizer and the
HTTP layer's settings (moerl/engine/app.py builds the app on it; the route groups read
it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moerl.engine.core.model_runner import ModelRunner
    from moerl.engine.core.scheduler import Scheduler


@dataclass
class EngineState:
    runner: ModelRunner
    scheduler: Scheduler
    model_path: str
    api_key: str | None = None
    tokenizer: Any = None
    groups: dict[str, Any] = field(default_factory=dict)
    weight_session: bool = False  # between /begin_weight_update and /end_weight_update
    started: float = field(default_factory=time.time)
    stream_interval: int = 1  # --stream-interval: tokens per streamed chunk by default
    incremental_stream: bool = False  # --incremental-streaming-output: chunks hold the new part
    tool_call_parser: str | None = None  # --tool-call-parser: /v1/chat/completions' tools
    _grammar: Any = None

    def grammar_backend(self) -> Any:
        """The grammar backend (built on first use from the tokenizer)."""
        if self._grammar is None:
            from moerl.engine.core.grammar import GrammarBackend

            self._grammar = GrammarBackend(self.tokenizer, self.runner.vocab_size)
        return self._grammar
