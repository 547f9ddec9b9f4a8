"""A trainer checkpoint is exportable from its directory alone: `tools/convert_checkpoint.py
mcore2hf --mcore-dir CHECKPOINT_DIR` writes an HF checkpoint (config, tokenizer, weights)
that transformers loads, and its logits are the ones of the model the trainer started
from (no step taken, so the trainer's weights are those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moerl.parallel import spawn

ROOT = Path(__file__).resolve().parents[2]


def _save_trainer_checkpoint(hf_dir: str, root: str) -> None:
    from moerl.config import MoerlConfig
    from moerl.models.tiny import tiny_config
    from moerl.trainer.trainer import Trainer

    cfg = MoerlConfig()
    cfg.model = tiny_config("deepseek_moe")
    cfg.trainer.checkpoint_dir = root
    trainer = Trainer(cfg.model, cfg.parallel, cfg.trainer, cfg.algo, cfg.correction, hf_dir=hf_dir)
    trainer.version = 1
    trainer.save(cursor=0)


@pytest.mark.slow  # ~110 s of spawned ranks (the default suite stays under 20 minutes)
def test_trainer_checkpoint_exports_to_hf(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    hf = save_tiny_checkpoint(tiny_config("deepseek_moe"), tmp_path / "hf", seed=3)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (hf / "chat_template.jinja").write_text(template)  # kept by checkpoint and export
    root = tmp_path / "ckpt"
    spawn(_save_trainer_checkpoint, 1, str(hf), str(root))
    step = root / (root / "latest").read_text().strip()
    assert (step / "moerl_model.json").is_file() and (step / "config.json").is_file()
    assert (step / "tokenizer_config.json").is_file()

    out = tmp_path / "exported"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/convert_checkpoint.py"), "mcore2hf",
         "--mcore-dir", str(root), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(step 1)" in proc.stdout  # which checkpoint the export took, said and kept
    made = json.loads((out / "moerl_export.json").read_text())
    assert made["step"] == 1 and made["version"] == 1 and made["source"] == str(step)
    assert (out / "chat_template.jinja").read_text() == template
    mask = os.umask(0)
    os.umask(mask)
    for weights in out.glob("*.safetensors"):  # safetensors alone writes 0600
        assert weights.stat().st_mode & 0o777 == 0o666 & ~mask

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    exported = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("372=")])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    generated = exported.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]
