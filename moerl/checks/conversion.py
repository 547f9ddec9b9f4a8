"""Conversion check: HF checkpoint → Megatron (any layout) gives transformers' logits,
and the streamed export reproduces the checkpoint bit for bit.

Used by ``tools/check_conversion.py`` and ``tests/dist/test_conversion.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.parallel.layout import parse_layout
from moerl.parallel.spawn import spawn

LOGIT_TOL = 1e-4


@dataclass
class ConversionResult:
    family: str
    layout: str
    max_logit_abs_diff: float
    roundtrip_exact: bool
    exported: int
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.max_logit_abs_diff <= LOGIT_TOL and self.roundtrip_exact

    def line(self) -> str:
        text = (
            f"family={self.family} layout={self.layout} "
            f"max_logit_abs_diff={self.max_logit_abs_diff:.2e} "
            f"roundtrip={'exact' if self.roundtrip_exact else 'DIFF'}"
        )
        return text + ("" if self.ok else f" FAIL ({self.detail})")


def sample_tokens(vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own fp32 forward of the checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def megatron_logits(chunks: list[Any], tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary fp32 logits from the last pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    collected: list[torch.Tensor] = []

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        collected.append(gather_from_tensor_model_parallel_region(output).detach().clone())
        return output.sum() * 0.0, {}

    def forward_step(data: Any, model: Any) -> tuple[Any, Any]:
        next(data)
        return model(tokens, position_ids, None), loss_func

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([0]) for _ in chunks] if len(chunks) > 1 else iter([0]),
            model=chunks,
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return collected[0].float()


def _worker(family: str, layout: str, hf_dir: str, workdir: str) -> None:
    from safetensors import safe_open

    from moerl.convert import HFCheckpoint, export_hf, load_hf
    from moerl.models.gpt import build_model
    from moerl.models.registry import get_family
    from moerl.parallel.state import initialize_for_model

    ckpt = HFCheckpoint(hf_dir)
    model = get_family(family).from_hf(ckpt.config())
    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model)
    chunks = build_model(model, pcfg)
    load_hf(chunks, hf_dir, model)
    tokens = torch.load(Path(workdir) / "tokens.pt")
    logits = megatron_logits(chunks, tokens)

    # Stream the export and compare every tensor with the checkpoint, bit for bit.
    mismatched: list[str] = []
    names: list[str] = []
    files = {n: ckpt.files[n] for n in ckpt.names()}
    handles: dict[Path, Any] = {}
    for name, tensor in export_hf(chunks, model):
        names.append(name)
        path = files.get(name)
        if path is None:
            mismatched.append(f"{name} (not in checkpoint)")
            continue
        handles.setdefault(path, safe_open(str(path), "pt"))
        original = handles[path].get_tensor(name)
        if original.dtype != tensor.dtype or not torch.equal(original, tensor.to(original.dtype)):
            mismatched.append(name)

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (logits, names, mismatched))
    if dist.get_rank() != 0:
        return
    ref = torch.load(Path(workdir) / "hf_logits.pt")
    got = next(item[0] for item in gathered if item[0] is not None)
    all_names = {n for item in gathered for n in item[1]}
    bad = sorted({m for item in gathered for m in item[2]})
    missing = sorted(set(files) - all_names)
    detail = []
    if bad:
        detail.append(f"{len(bad)} exported tensors differ, e.g. {bad[:3]}")
    if missing:
        detail.append(f"{len(missing)} checkpoint tensors not exported, e.g. {missing[:3]}")
    result = ConversionResult(
        family=family,
        layout=layout,
        max_logit_abs_diff=float((got - ref).abs().max()),
        roundtrip_exact=not bad and not missing,
        exported=len(all_names),
        detail="; ".join(detail),
    )
    (Path(workdir) / f"conv_{layout}.json").write_text(json.dumps(asdict(result)))


def prepare(hf_dir: str | Path, workdir: str | Path, vocab: int) -> None:
    """Compute the transformers reference logits once per checkpoint."""
    tokens = sample_tokens(vocab)
    torch.save(tokens, Path(workdir) / "tokens.pt")
    torch.save(hf_logits(hf_dir, tokens), Path(workdir) / "hf_logits.pt")


def check_layout(
    family: str, layout: str, hf_dir: str | Path, workdir: str | Path
) -> ConversionResult:
    _, world = parse_layout(layout)
    spawn(_worker, world, family, layout, str(hf_dir), str(workdir))
    data = json.loads((Path(workdir) / f"conv_{layout}.json").read_text())
    return ConversionResult(**data)
