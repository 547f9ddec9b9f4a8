"""Every command README.md, the recipes' header comments and tools/slurm/moerl.sbatch show
runs as written: each `python -m moerl.launch …` (or `torchrun … -m moerl.launch …`) is
extracted from the text and dry-run (`launcher.dry_run=true`, in-process, no server
contacted); the sbatch template is rendered with DRY_RUN=1 and its trainer command
dry-run the same way.

What a dry run cannot have, the test supplies, and nothing else is changed:

- a torchrun command runs with WORLD_SIZE = nnodes × nproc-per-node, as torchrun sets it;
- `model.path=/ckpt/NAME` (and the sbatch's MODEL_PATH) names a checkpoint on the user's
  machine. A dry run reads its config.json (the architecture is checked against the
  layout), so the test points the path at a stand-in: the named `model=` option's
  config.json, written by its family's `to_hf`, and an empty weight index;
- `mylab.*` is the user's own package: the test writes a one-function `mylab` for it;
- a command whose code block first runs a tool (`python tools/make_word_problems.py
  --out data/…`) runs after that tool, in the same (temporary) directory.

The `--help` commands and tools/*.py are run as subprocesses in
tests/integration/test_readme_tools.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import moerl.launch as launch

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "tools" / "slurm" / "moerl.sbatch"


def _commands(text: str) -> list[str]:
    """Shell commands in ``text``: lines joined at a trailing backslash, `# …` comments
    dropped, `&&` chains split."""
    out = []
    for line in re.sub(r"\\\n\s*(#\s*)?", " ", text).splitlines():
        line = re.split(r"\s#\s", line)[0].strip().lstrip("#$ ").strip()
        out += [part.strip() for part in line.split("&&")]
    return [c for c in out if c]


SETUP: dict[str, list[str]] = {}
"""Launch command → the `python tools/…` commands before it in its code block."""


def doc_commands() -> list[tuple[str, str]]:
    """(where, command) for every launch and sbatch command in the docs."""
    found = []
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    spans = re.findall(r"`([^`\n]*(?:\n[^`\n]*)?)`", re.sub(r"```.*?```", "", readme, flags=re.S))
    texts = [("README.md", b) for b in blocks] + [("README.md", " ".join(s.split())) for s in spans]
    for path in sorted((ROOT / "recipes").glob("*.yaml")) + [SBATCH]:
        header = "".join(
            line + "\n" for line in path.read_text().splitlines() if line.startswith("#")
        )
        texts.append((str(path.relative_to(ROOT)), header))
    for where, text in texts:
        tools: list[str] = []
        for cmd in _commands(text):
            if cmd.startswith("python tools/"):
                tools.append(cmd)
                continue
            if "[" in cmd.split("moerl.launch")[-1].split("=")[0]:
                continue  # a usage line: `python -m moerl.launch [+recipe=NAME]`
            if re.search(r"-m moerl\.launch|tools/slurm/moerl\.sbatch", cmd) and (
                cmd.startswith(("python -m", "torchrun", "sbatch")) or re.match(r"\w+=", cmd)
            ):
                found.append((where, cmd))
                if tools:
                    SETUP[cmd] = list(tools)
    # overrides that plug in the user's own code, shown without a command: on the tiny recipe
    for span in spans:
        if re.fullmatch(r"(\S+=\S+ )*\w+\._target_=mylab\.\S+", " ".join(span.split())):
            cmd = "python -m moerl.launch +recipe=deepseek_moe " + " ".join(span.split())
            found.append(("README.md", cmd))
    return list(dict.fromkeys(found))


def _standin_checkpoint(root: Path, model: str) -> Path:
    """A directory with the ``model=`` option's config.json and no weights."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from moerl.config.model import ModelConfig
    from moerl.models.registry import get_family

    with initialize_config_module("moerl.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}"])
    typed = OmegaConf.to_object(cfg.model)
    assert isinstance(typed, ModelConfig)
    out = root / f"ckpt-{model}"
    out.mkdir(parents=True, exist_ok=True)
    family = get_family(typed.family)
    if typed.family == "deepseek_moe" and typed.moe_router_score_function == "softmax":
        # the family writes DeepSeek-V3 configs; a V2 config differs only in its routing
        v3 = replace(typed, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        hf = family.to_hf(v3) | {"model_type": "deepseek_v2", "scoring_func": "softmax"}
        hf |= {"topk_method": "greedy", "norm_topk_prob": not typed.moe_router_pre_softmax}
    else:
        hf = family.to_hf(typed)
    (out / "config.json").write_text(json.dumps(hf))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    return out


def _substitute(args: list[str], root: Path) -> list[str]:
    model = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), None)
    out = []
    for arg in args:
        if arg.startswith("model.path=/ckpt"):
            assert model, f"{arg} without a model= option to stand in for"
            arg = f"model.path={_standin_checkpoint(root, model)}"
        out.append(arg)
    return out


@pytest.fixture
def user_package(tmp_path, monkeypatch) -> None:
    """`mylab.tasks.make` and `mylab.envs.make`, the README's examples of a user's code."""
    pkg = tmp_path / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for module in ("tasks", "envs"):
        (pkg / f"{module}.py").write_text(
            "def make(*args, **options):\n    raise NotImplementedError\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))


def _dry_run(args: list[str], world: int | None, monkeypatch, capsys) -> str:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        launch.dry_run([*args, "launcher.dry_run=true"])
    except SystemExit as err:
        pytest.fail(f"dry run of {args} exited {err.code}: {capsys.readouterr().err}")
    return capsys.readouterr().out


def _launch_args(cmd: str) -> tuple[list[str], int | None]:
    """The moerl.launch overrides of a command and its world size (torchrun's)."""
    words = shlex.split(cmd)
    i = words.index("moerl.launch")
    world = None
    if words[0] == "torchrun":
        flags = " ".join(words[:i])
        nproc = re.search(r"--nproc[-_]per[-_]node[ =](\d+)", flags)
        nnodes = re.search(r"--nnodes[ =](\d+)", flags)
        world = int(nproc.group(1) if nproc else 1) * int(nnodes.group(1) if nnodes else 1)
    return words[i + 1 :], world


def test_the_docs_show_the_commands_this_test_runs() -> None:
    cmds = [c for _, c in doc_commands()]
    assert "python -m moerl.launch +recipe=deepseek_moe" in cmds  # the quickstart
    assert any(c.startswith("torchrun --nproc-per-node 8") for c in cmds)  # the recipes
    assert sum("moerl.sbatch" in c for c in cmds) == 2  # README and the template's header
    assert not [c for c in cmds if "parallel=ep8" in c]
    assert (
        "python -m moerl.launch +recipe=deepseek_moe task=custom task._target_=mylab.tasks.make"
        in cmds
    )


@pytest.mark.parametrize(
    "where,cmd", [p for p in doc_commands() if "moerl.sbatch" not in p[1]], ids=str
)
def test_launch_command_dry_runs(where, cmd, tmp_path, monkeypatch, capsys, user_package):
    args, world = _launch_args(cmd)
    if "--help" in args:
        return  # Hydra's help: tests/integration/test_readme_tools.py
    monkeypatch.chdir(tmp_path)
    for tool in SETUP.get(cmd, []):
        words = shlex.split(tool)
        words[:2] = [sys.executable, str(ROOT / words[1])]
        proc = subprocess.run(words, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (tool, proc.stderr[-2000:])
    out = _dry_run(_substitute(args, tmp_path), world, monkeypatch, capsys)
    assert "dry run, nothing started" in out, (where, cmd)


def _render_sbatch(env: dict[str, str], args: list[str], cwd: Path) -> list[list[str]]:
    full = {**os.environ, "DRY_RUN": "1", "SLURM_JOB_ID": "7", **env}
    proc = subprocess.run(
        ["bash", str(SBATCH), *args], env=full, cwd=cwd, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert list(cwd.iterdir()) == [], "DRY_RUN=1 must create nothing"
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def _bash_words(cmd: str, cwd: Path) -> list[str]:
    """The words bash gives ``cmd`` (brace expansion, globs with failglob as zsh fails on
    an unmatched one), without running it."""
    script = f"shopt -s failglob; words() {{ printf '%s\\0' \"$@\"; }}; words {cmd}"
    out = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, f"bash cannot take it as typed: {out.stderr.strip()}"
    return out.stdout.split("\0")[:-1]


@pytest.mark.parametrize("where,cmd", doc_commands())
def test_doc_commands_mean_in_bash_what_this_test_runs(where, cmd, tmp_path):
    """The dry runs above split each command with shlex; bash (and zsh) also expand
    braces and globs, so ``+eval.sets.a={name:x,seed:7}`` unquoted becomes two words and
    ``k=[1,8]`` may match a file. A command must give bash the same words."""
    assert _bash_words(cmd, tmp_path) == shlex.split(cmd), f"{where}: quote the override"


@pytest.mark.parametrize("where,cmd", [p for p in doc_commands() if "moerl.sbatch" in p[1]])
def test_sbatch_command_renders_and_dry_runs(where, cmd, tmp_path, monkeypatch, capsys):
    """The documented sbatch command, rendered: one SGLang server per engine node and a
    torchrun whose moerl.launch command passes a dry run for TRAIN_NODES × 8 ranks."""
    words = shlex.split(cmd)
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    nodes = next(int(w.split("=")[1]) for w in words if w.startswith("--nodes="))
    args = words[words.index(str(SBATCH.relative_to(ROOT))) + 1 :]
    model = next(a.split("=", 1)[1] for a in args if a.startswith("model="))
    ckpt = _standin_checkpoint(tmp_path / "ckpts", model)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env |= {"MODEL_PATH": str(ckpt), "SLURM_JOB_NODELIST": ",".join(f"n{i}" for i in range(nodes))}
    lines = _render_sbatch(env, [a for a in args if not a.startswith("model.path=")], cwd)
    servers = [w for w in lines if "sglang.launch_server" in w]
    assert len(servers) == nodes - int(env.get("TRAIN_NODES", "1"))
    (trainer,) = [w for w in lines if "moerl.launch" in w]
    launch_args, world = _launch_args(shlex.join(trainer[trainer.index("torchrun") :]))
    assert world == 8 * int(env.get("TRAIN_NODES", "1"))
    out = _dry_run(launch_args, world, monkeypatch, capsys)
    assert "dry run, nothing started" in out
    assert "http://n1:30000" in out


def test_sbatch_passes_lora_to_trainer_and_servers(tmp_path, monkeypatch, capsys) -> None:
    ckpt = _standin_checkpoint(tmp_path / "ckpts", "deepseek_v2_lite")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {"MODEL_PATH": str(ckpt), "SLURM_JOB_NODELIST": "n0,n1", "LORA": "all", "LORA_RANK": "8"}
    lines = _render_sbatch(
        env, ["+recipe=deepseek_moe", "model=deepseek_v2_lite", "parallel.ep=8"], cwd
    )
    (server,) = [w for w in lines if "sglang.launch_server" in w]
    assert server[server.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in server
    (trainer,) = [w for w in lines if "moerl.launch" in w]
    assert "lora=all" in trainer and "lora.rank=8" in trainer
    launch_args, world = _launch_args(shlex.join(trainer[trainer.index("torchrun") :]))
    out = _dry_run(launch_args, world, monkeypatch, capsys)
    assert "rank: 8" in out


def test_sbatch_creates_the_log_directory(tmp_path) -> None:
    """Outside DRY_RUN the template makes the directory its logs go to (runs/ by default)."""
    text = SBATCH.read_text()
    assert 'mkdir -p "$(dirname "$RUN_DIR")"' in text
    assert text.index("mkdir -p") < text.index("run_bg ")


def test_free_layout_sizes_are_checked_against_the_world(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    launch.dry_run(["+recipe=qwen3_moe", "parallel.tp=2", "parallel.ep=4", "launcher.dry_run=true"])
    assert "world size 8" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        launch.dry_run(
            ["+recipe=qwen3_moe", "parallel.tp=2", "parallel.ep=4", "launcher.dry_run=true"]
        )
    err = capsys.readouterr().err
    assert "2 × 4 = 8" in err and "world 4" in err, err
