"""Files a checkpoint or export writes beside its weights: the tokenizer's chat template
travels with them, and weights get the umask's mode (safetensors alone writes 0600)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from moerl.common.files import readable
from moerl.convert.mcore_ckpt import write_model_files
from moerl.models.tiny import tiny_config


def test_weights_get_the_mode_the_umask_allows(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(2)}, str(path))
    mask = os.umask(0o027)
    try:
        readable(path)
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o640


def test_model_files_carry_the_chat_template(tmp_path):
    hf, out = tmp_path / "hf", tmp_path / "ckpt"
    hf.mkdir()
    out.mkdir()
    (hf / "tokenizer_config.json").write_text("{}")
    (hf / "chat_template.jinja").write_text("{{ messages }}")
    write_model_files(out, tiny_config("deepseek_moe"), hf)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (out / "tokenizer_config.json").is_file() and (out / "config.json").is_file()


def test_offline_eval_reads_the_step_an_export_was_made_at(tmp_path):
    """Issue 31: ``python -m moerl.eval`` on a step-4 export reported step 0, version 0."""
    import json

    import pytest

    from moerl.convert.mcore_ckpt import EXPORT_JSON
    from moerl.eval import exported_from

    assert exported_from(tmp_path) == {}  # a run's init_hf: step 0, version 0
    (tmp_path / EXPORT_JSON).write_text(json.dumps({"source": "x", "step": 4, "version": 4}))
    assert exported_from(tmp_path) == {"step": 4, "version": 4}
    (tmp_path / EXPORT_JSON).write_text("{not json")
    with pytest.raises(ValueError, match="export the checkpoint again"):
        exported_from(tmp_path)


def test_auto_checkpoints_go_into_the_run_and_cannot_be_resumed_from(tmp_path):
    """The launcher's default trainer.checkpoint_dir=auto is the run's own folder; a
    resume needs the earlier run's folder named."""
    import pytest

    from moerl.config.schema import MoerlConfig
    from moerl.validate import resolve_checkpoint_dir, validate_config

    cfg = MoerlConfig()
    cfg.trainer.checkpoint_dir = "auto"
    validate_config(cfg)
    resolve_checkpoint_dir(cfg.trainer, tmp_path)
    assert cfg.trainer.checkpoint_dir == str(tmp_path / "checkpoints")
    cfg.trainer.checkpoint_dir, cfg.trainer.resume = "auto", True
    with pytest.raises(ValueError, match="RUN_DIR/checkpoints"):
        validate_config(cfg)
