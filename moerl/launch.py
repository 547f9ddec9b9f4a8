"""The moerl entry point: `python -m moerl.launch [+recipe=NAME] [key=value ...]`.

Composes the config from `pkg://moerl.conf` (and a recipe, if given), validates it once
for this job's world size, then runs the job:

- run plainly, it spawns `launcher.nproc` local trainer ranks (gloo on CPU);
- under torchrun (WORLD_SIZE set), this process is one of the ranks.

Trainer rank 0 prepares the initial HF checkpoint (a local `model.path`, or a random
model built from the config and written into the run directory), starts the embedded
engines (`engine=embedded`) or attaches to SGLang servers (`engine.urls=[...]`), and
every rank runs `moerl.loop.run_training`. Ranks die with the launcher and engines with
rank 0, however either dies (even by SIGKILL); Ctrl-C stops the ranks and the engines.
Everything checkable without a rank (`preflight`: the config, model.path's config.json,
the checkpoint to resume) is checked first, also by `launcher.dry_run=true`. A dry run
composes the config without Hydra's job runner, so it writes nothing (no run directory,
no `.hydra/`, no log file). `--help` lists every key with its description; `--cfg job`
prints the config without running.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from moerl.config.recipe import check_recipe_choices
from moerl.config.schema import MoerlConfig
from moerl.config.store import CONFIG_GROUPS, register_configs
from moerl.config.threads import keep_freed_memory, set_omp_spincount
from moerl.validate import resolve_checkpoint_dir, validate_config

register_configs()


def checkpoint_path(cfg: Any, run_dir: Path) -> Path:
    """Where the HF checkpoint the run starts from is: ``model.path``, else the run
    directory's ``init_hf`` (``prepare_checkpoint`` writes it)."""
    return Path(cfg.model.path) if cfg.model.path else run_dir / "init_hf"


def prepare_checkpoint(cfg: Any, run_dir: Path) -> Path:
    """The HF checkpoint the run starts from: ``model.path``, else a random model from
    the config (seeded by trainer.seed), written once into the run directory."""
    path = checkpoint_path(cfg, run_dir)
    if cfg.model.path:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path={path} has no config.json: point it at a local Hugging Face "
                "checkpoint directory (nothing is downloaded)"
            )
        return path
    from moerl.models.hf_tiny import save_tiny_checkpoint

    if not (path / "config.json").is_file():
        print(f"moerl: writing a random {cfg.model.family} model to {path}", flush=True)
        save_tiny_checkpoint(cfg.model, path, seed=cfg.trainer.seed)
    return path


def model_from_checkpoint(model: Any) -> Any:
    """The architecture of ``model.path`` (its config.json), keeping the configured
    sequence length. Raises ValueError naming the file for a missing, broken or
    incomplete config.json or weight file."""
    from moerl.convert import HFCheckpoint
    from moerl.models.registry import get_family

    path = Path(model.path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(
            f"model.path={path} has no config.json: point it at a local Hugging Face "
            "checkpoint directory (nothing is downloaded)"
        )
    hf = HFCheckpoint(path)  # also checks every weight file's size against its header
    try:
        loaded = get_family(model.family).from_hf(hf.config())
    except KeyError as err:
        raise ValueError(
            f"{config} has no {err.args[0]!r}, which model.family={model.family} reads: "
            "is it the config of another model family?"
        ) from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"model.path={path}: {err}") from None
    loaded.path, loaded.seq_length = model.path, model.seq_length
    return loaded


def preflight(cfg: DictConfig, overrides: Sequence[str] = ()) -> MoerlConfig:
    """Everything that can be checked before a rank starts, also in a dry run: the
    command line ``overrides`` against the recipe they name (a group chosen there must not
    get the recipe's keys), the config, the architecture in ``model.path``'s config.json
    against the layout, and the checkpoint ``trainer.resume`` would load. Raises
    ValueError in user words."""
    check_recipe_choices(overrides, CONFIG_GROUPS)
    typed = validate_config(cfg)
    world = typed.launcher.world_size()
    if not typed.model.path:
        from moerl.models.registry import PLAIN, family_names

        if typed.model.family == PLAIN:  # the engines serve a Hugging Face model
            raise ValueError(
                f"model.family={typed.model.family} has no Hugging Face format, so there is "
                "no initial checkpoint for the engines; pick a family's model (e.g. "
                f"+recipe=deepseek_moe, model=deepseek_moe_tiny; families: {family_names()}) "
                "or set model.path"
            )
    else:
        typed.model = model_from_checkpoint(typed.model)
        try:
            validate_config(typed, world)
        except ValueError as err:
            raise ValueError(
                f"{err} (model.* as read from {typed.model.path}/config.json)"
            ) from None
    if typed.trainer.resume:
        check_resume(typed, world)
    return typed


def check_resume(cfg: MoerlConfig, world: int) -> None:
    """The checkpoint a resume loads exists, is whole (older ones stand in for corrupt
    ones, with a warning) and holds optimizer state for this layout."""
    from moerl.trainer.checkpoint_files import newest_loadable, read_progress

    assert cfg.trainer.checkpoint_dir  # validate_config checked it
    path = newest_loadable(cfg.trainer.checkpoint_dir)
    progress = read_progress(path)
    saved = progress.get("layout")
    p = cfg.parallel
    layout = {"world": world, "tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.expert_tp}
    if progress.get("optimizer_state") and saved != layout:
        raise ValueError(
            f"trainer.resume=true: {path} holds optimizer state for layout {saved}, this run "
            f"is {layout}; resume with the saved parallel.* and launcher.nproc"
        )
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"moerl: resuming from {path}", flush=True)


def prefix_cache_on(cfg: Any) -> bool:
    """``engine.prefix_cache`` with 'auto' resolved by the rule its docstring states: on
    where the rollouts are multi-turn episodes (an ``env``), off for single-turn ones."""
    value = cfg.engine.prefix_cache
    if isinstance(value, bool):
        return value
    from moerl.envs.registry import env_config

    return bool(env_config(cfg.env).enabled)


def engine_flags(engine: Any, prefix_cache: bool | None = None) -> list[str]:
    """An embedded engine's batching and prefix-cache flags for ``engine.max_running_requests``,
    ``engine.max_prefill_tokens``, ``engine.chunked_prefill_size``, ``engine.decode_share``,
    ``engine.admission_*``, ``engine.shared_prompt_min_tokens``, ``engine.cuda_graph*`` and
    ``engine.prefix_cache*`` (``prefix_cache``: the run's resolved choice, ``prefix_cache_on``;
    None reads ``engine.prefix_cache``, 'auto' as on)."""
    flags = ["--max-running-requests", str(engine.max_running_requests)]
    flags += ["--device", engine.device]
    flags += ["--max-prefill-tokens", str(engine.max_prefill_tokens)]
    flags += ["--chunked-prefill-size", str(engine.chunked_prefill_size)]
    flags += ["--decode-share", str(engine.decode_share)]
    flags += ["--admission-wait-ms", str(engine.admission_wait_ms)]
    flags += ["--admission-quiet-ms", str(engine.admission_quiet_ms)]
    flags += ["--shared-prompt-min-tokens", str(engine.shared_prompt_min_tokens)]
    if engine.cuda_graph:
        flags.append("--enable-cuda-graph")
        if engine.cuda_graph_max_bs is not None:
            flags += ["--cuda-graph-max-bs", str(engine.cuda_graph_max_bs)]
    on = engine.prefix_cache is not False if prefix_cache is None else prefix_cache
    if not on:
        return [*flags, "--disable-radix-cache"]
    return [*flags, "--prefix-cache-max-tokens", str(engine.prefix_cache_max_tokens)]


def start_engines(
    cfg: Any, hf_dir: Path, run_dir: Path, wait: bool = True, warm: Sequence[Any] = ()
) -> tuple[list[str], list[Any]]:
    """Engine URLs and the processes moerl owns (embedded engines only; a colocated
    engine is built by trainer rank 0, ``start_colocated``); engine i starts in
    ``warm[i]`` where there is one (``warm_engines``)."""
    if cfg.engine.kind == "sglang" or cfg.launcher.placement == "colocated":
        return list(cfg.engine.urls), []
    import secrets

    from moerl.engine import API_KEY_ENV
    from moerl.engine.process import EngineProcess
    from moerl.telemetry.logs import log_dir

    # A key per run, unless the user set one: rank 0's clients read it from the environment.
    os.environ.setdefault(API_KEY_ENV, secrets.token_urlsafe(32))
    flags = policy_engine_flags(cfg)
    procs = []
    for i in range(cfg.engine.count()):
        print(f"moerl: starting embedded engine {i} on {hf_dir}", flush=True)
        procs.append(
            EngineProcess(
                hf_dir,
                *flags,
                api_key=os.environ[API_KEY_ENV],
                threads=cfg.engine.threads,
                log_path=log_dir(run_dir) / f"engine{i}.log",
                startup_timeout_s=cfg.engine.startup_timeout_s,
                wait=wait,
                warm=warm[i] if i < len(warm) else None,
            )  # fmt: skip
        )
    return [p.url for p in procs], procs


def policy_engine_flags(cfg: Any) -> list[str]:
    """The policy engines' flags beyond the model path: routes, dtype, batching, LoRA."""
    flags = ["--enable-return-routed-experts", "--dtype", cfg.engine.dtype]
    flags += engine_flags(cfg.engine, prefix_cache_on(cfg))
    if cfg.engine.deterministic_inference:
        flags.append("--enable-deterministic-inference")
    if cfg.lora.enabled:  # the engines apply the trainer's adapters (hot-swapped per version)
        from moerl.lora import resolve_targets

        flags += ["--enable-lora", "--max-lora-rank", str(cfg.lora.rank)]
        flags += ["--lora-target-modules", *resolve_targets(cfg.lora, cfg.model)]
    return flags


def start_colocated(cfg: Any, hf_dir: Path, run_dir: Path) -> tuple[list[str], list[Any]]:
    """``launcher.placement=colocated``: the policy engine built inside this process (rank
    0) in the background; ``run_training`` waits for it once the trainer is built."""
    from moerl.engine.inprocess import InProcessEngine
    from moerl.telemetry.logs import rank_log_path

    print(f"moerl: building the colocated engine in rank 0 on {hf_dir}", flush=True)
    # --num-threads: the scheduler thread's own (moerl/config/threads.py); the trainer's
    # threads stay the process's
    threads = [] if cfg.engine.threads is None else ["--num-threads", str(cfg.engine.threads)]
    engine = InProcessEngine(
        hf_dir, *policy_engine_flags(cfg), *threads,
        startup_timeout_s=cfg.engine.startup_timeout_s, log_path=rank_log_path(run_dir, 0),
        wait=False,
    )  # fmt: skip
    return [engine.url], [engine]


Prepared = tuple[Path, list[str], list[Any]]
"""The initial HF checkpoint, the policy engines' URLs and the embedded ones' processes."""


def prepare(cfg: Any, run_dir: Path, warm: Sequence[Any] = ()) -> Prepared:
    """The initial checkpoint, and the policy's engines started on it without waiting
    (in the ``warm`` processes where given): they load while the trainer ranks start and
    build their models (run_training waits for them before the first request)."""
    hf_dir = prepare_checkpoint(cfg, run_dir)
    urls, engines = start_engines(cfg, hf_dir, run_dir, wait=False, warm=warm)
    return hf_dir, urls, engines


def start_reward_engines(cfg: Any, run_dir: Path) -> tuple[list[str], list[Any]]:
    """The reward model's URLs and the embedded RM engines moerl owns: ``reward_model.urls``
    when given, else ``num_engines`` engines on ``reward_model.path`` or on a random tiny
    model built from ``model`` (seeded by trainer.seed + 1, so it differs from the policy)
    and written into the run directory. RM engines never receive weight updates."""
    rm = cfg.reward_model
    if not rm.enabled:
        return [], []
    if rm.urls:
        return list(rm.urls), []
    from moerl.engine import API_KEY_ENV
    from moerl.engine.process import EngineProcess
    from moerl.telemetry.logs import log_dir

    if rm.path:
        path = Path(rm.path)
    else:
        from moerl.models.hf_tiny import save_tiny_checkpoint

        path = run_dir / "reward_hf"
        if not (path / "config.json").is_file():
            print(f"moerl: writing a random {cfg.model.family} reward model to {path}", flush=True)
            save_tiny_checkpoint(cfg.model, path, seed=cfg.trainer.seed + 1)
    procs = []
    for i in range(rm.num_engines):
        print(f"moerl: starting reward-model engine {i} on {path}", flush=True)
        procs.append(
            EngineProcess(
                path,
                "--dtype",
                cfg.engine.dtype,
                "--device",
                cfg.engine.device,
                api_key=os.environ.get(API_KEY_ENV),
                threads=rm.threads,
                log_path=log_dir(run_dir) / f"reward_engine{i}.log",
                startup_timeout_s=cfg.engine.startup_timeout_s,
            )  # fmt: skip
        )
    return [p.url for p in procs], procs


def run_rank(cfg: Any, run_dir: str, prepared: Prepared | None = None) -> None:
    """One trainer rank (its process group is up): rank 0 prepares the checkpoint and
    engines (or takes over those the launcher started, ``prepared``) and tells the others
    where they are."""
    import torch.distributed as dist

    from moerl.telemetry.logs import setup_rank_logging

    root = Path(run_dir)
    # every rank's full log in the run dir (before megatron's imports log), the console
    # keeps warnings and moerl's lines
    setup_rank_logging(root, dist.get_rank(), cfg.telemetry.console_level)
    from moerl.loop import RunContext, run_training

    procs: list[Any] = []  # every engine process this rank owns (closed at the end)
    engines: list[Any] = []  # the policy's (the supervisor restarts them)
    try:
        info: list[Any] = [None]
        if dist.get_rank() == 0:
            if prepared is None:  # torchrun: this rank starts them
                prepared = prepare(cfg, root)
            hf_dir, urls, engines = prepared
            if cfg.launcher.placement == "colocated":  # the engine lives in this process
                urls, engines = start_colocated(cfg, hf_dir, root)
            procs += engines
            reward_urls, reward_procs = start_reward_engines(cfg, root)
            procs += reward_procs
            info = [(str(hf_dir), urls, reward_urls)]
        dist.broadcast_object_list(info, src=0)
        hf, urls, reward_urls = info[0]
        ctx = RunContext(
            run_dir=root, hf_dir=Path(hf), engine_urls=urls, engines=engines,
            reward_urls=reward_urls,
        )  # fmt: skip
        last = run_training(cfg, ctx)
        if dist.get_rank() == 0 and last:
            print(
                f"moerl: done, step {int(last.get('version', 0))}, reward_mean "
                f"{last.get('reward_mean', float('nan')):.3f}; run dir {root}",
                flush=True,
            )
    finally:
        for proc in procs:
            proc.close()


def checked(cfg: DictConfig, overrides: Sequence[str]) -> MoerlConfig:
    """``preflight``, or one readable line on stderr and exit status 2 for a user error."""
    try:
        return preflight(cfg, overrides)
    except ValueError as err:  # CheckpointError too
        print(f"moerl: invalid config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except ImportError as err:  # an optional extra the config needs (task=dataset, ...)
        print(f"moerl: missing package: {err}", file=sys.stderr)
        raise SystemExit(2) from None


TRUE_WORDS = ("true", "yes", "on", "1")


def is_dry_run(args: list[str]) -> bool:
    """Whether the command line asks for a dry run (and no Hydra flag such as --cfg or
    --help, which Hydra's own runner handles)."""
    if any(arg.startswith("-") for arg in args):
        return False
    values = [a.partition("=")[2] for a in args if a.partition("=")[0] == "launcher.dry_run"]
    return bool(values) and values[-1].strip().lower() in TRUE_WORDS


def dry_run(overrides: list[str]) -> None:
    """Compose, check and print the config; write nothing. Hydra's job runner would create
    the run directory, its `.hydra/` snapshot and a log file before the job starts, so a
    dry run composes through Hydra's compose API instead."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    try:
        with initialize_config_module("moerl.conf", version_base="1.3"):
            try:
                cfg = compose("config", overrides=overrides)
            except HydraException as err:  # a bad override: its reason, no traceback
                print(f"moerl: {override_error(err, overrides, compose)}", file=sys.stderr)
                raise SystemExit(2) from None
    except HydraException as err:  # the config module itself
        print(f"moerl: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    report_dry_run(cfg, checked(cfg, overrides))


def override_error(err: BaseException, overrides: list[str], compose: Any) -> str:
    """Hydra's message with the reason it chains (``Error merging override trainer.lr=abc``
    alone hid "could not be converted to Float"), and for a key the config lacks, the
    closest keys of the config the other overrides compose."""
    import difflib

    lines, cause = [str(err).strip()], err.__cause__ or err.__context__
    while cause is not None and len(lines) < 4:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        if first and "$" not in first and all(first not in line for line in lines):
            lines.append(first)
        cause = cause.__cause__ or cause.__context__
    text = "\n".join(lines)
    missing = re.search(r"Could not override '([^']+)'", text)
    if missing is None:
        return text
    key = missing.group(1)
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        known = _keys(OmegaConf.to_container(compose("config", overrides=rest)))
    except Exception:  # another override is bad too: Hydra's message alone
        return text
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    return text + (f"\ndid you mean: {', '.join(close)}?" if close else "")


def _keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return []
    out = []
    for name, value in node.items():  # the settable leaves
        key = f"{prefix}{name}"
        out += _keys(value, key + ".") if isinstance(value, dict) else [key]
    return out


def split_threads(cfg: MoerlConfig, world: int) -> None:
    """Fill ``launcher.threads`` and ``engine.threads`` (where unset) by the core split of
    moerl/config/threads.py, and say what was chosen."""
    from moerl import device
    from moerl.config.threads import resolve_threads

    split = resolve_threads(cfg, world, device.has_cuda())
    cfg.launcher.threads, cfg.engine.threads = split.trainer, split.engine
    if split.omp_cap is not None:
        print(f"moerl: OMP_NUM_THREADS={split.omp_cap} caps each process's CPU threads")
    if split.rule == "colocated":
        print(
            f"moerl: CPU threads: {split.trainer} per trainer rank, {split.engine} for the "
            "colocated engine's scheduler in rank 0 (launcher.threads / engine.threads "
            "override)"
        )
    if split.rule in ("alternating", "overlapped"):  # the rules for embedded engines
        print(
            f"moerl: CPU threads: {split.trainer} per trainer rank, {split.engine} per engine "
            f"({split.rule}: generation and training "
            f"{'take turns' if split.rule == 'alternating' else 'overlap'}; "
            "launcher.threads / engine.threads override)"
        )


def report_dry_run(cfg: DictConfig, typed: MoerlConfig) -> None:
    print(OmegaConf.to_yaml(cfg, resolve=True), end="")
    world = typed.launcher.world_size()
    print(f"moerl: config is valid for world size {world}; dry run, nothing started.")


@hydra.main(config_path="pkg://moerl.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from moerl._version import shadowing

    # before the preflight imports torch: libgomp reads it once, as it loads
    set_omp_spincount(OmegaConf.select(cfg, "launcher.omp_spincount", default=None))
    # before the large allocations (this process), and for every process started after
    keep_freed_memory(OmegaConf.select(cfg, "launcher.malloc_keep_mb", default=None))
    if OmegaConf.select(cfg, "launcher.gc_freeze", default=False) is True:
        # no collections while the imports, the model and the optimizer come in (four
        # full ones scanned them, 0.6 s of the start): the first step's freeze collects
        # once, freezes what lives and turns the collector back on (moerl/loop.py)
        gc.disable()
    if (shadow := shadowing()) is not None:
        print(f"moerl: warning: {shadow}", file=sys.stderr, flush=True)
    hydra_cfg = HydraConfig.get()
    warm = warm_engines(cfg, Path(hydra_cfg.runtime.output_dir))
    try:
        run_checked(cfg, hydra_cfg, warm)
    finally:
        for engine in warm:  # those that did not become engines
            engine.close()


def warm_engines(cfg: DictConfig, run_dir: Path) -> list[Any]:
    """The policy's embedded engines, started with the flags the config asks for and
    ``--await-start``, so that their imports overlap the launcher's checks (which import
    torch): once the config passes, ``start_engines`` tells each to go on, or closes it
    and starts a fresh one where the checked config asks for other flags. None for a
    dry run, torchrun, a colocated or external engine, LoRA (its flags need the model's
    modules), a GPU build of torch (the engines' threads depend on CUDA, and torch is
    not imported yet to ask) or a config that does not convert (the checks say why)."""
    from moerl.common.torch_build import cpu_only_build
    from moerl.config.threads import resolve_threads

    if OmegaConf.select(cfg, "launcher.dry_run", default=False) is True:
        return []
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return []
    try:
        typed: Any = OmegaConf.to_object(cfg)
        engine = typed.engine
        if engine.kind != "embedded" or typed.launcher.placement == "colocated":
            return []
        if typed.lora.enabled:
            return []
        threads = resolve_threads(typed, typed.launcher.world_size(), has_cuda=False).engine
        count, flags = engine.count(), policy_engine_flags(typed)
        hf_dir = checkpoint_path(typed, run_dir)
    except Exception:  # the preflight reports what is wrong with the config
        return []
    if not cpu_only_build():
        return []
    from moerl.engine.process import WarmEngine

    return [WarmEngine(hf_dir, *flags, threads=threads) for _ in range(count)]


def run_checked(cfg: DictConfig, hydra_cfg: Any, warm: list[Any]) -> None:
    """``main`` once Hydra composed ``cfg``: check it, then run (or report a dry run)."""
    from moerl.telemetry.logs import hold_console

    typed = checked(cfg, list(hydra_cfg.overrides.task))
    hold_console(typed.telemetry.console_level)
    run_dir = hydra_cfg.runtime.output_dir
    resolve_checkpoint_dir(typed.trainer, run_dir)
    world = typed.launcher.world_size()
    if typed.launcher.dry_run:  # set by a recipe rather than on the command line
        report_dry_run(cfg, typed)
        return
    print(f"moerl: run dir {run_dir}, {world} trainer rank(s), engine={typed.engine.kind}")
    split_threads(typed, world)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun: we are a rank
        from moerl.parallel.spawn import die_with_parent
        from moerl.parallel.state import destroy, init_process_group

        die_with_parent(os.getppid())  # and die with torchrun's agent
        init_process_group(typed.launcher.backend)
        try:
            run_rank(typed, run_dir)
        finally:
            destroy()
        return
    from moerl.parallel.spawn import run_here, spawn

    # Started here, before the ranks: an engine's start overlaps theirs (rank 0 takes the
    # handles over, restarting and stopping them; these die with this process anyway).
    prepared = prepare(typed, Path(run_dir), warm)
    try:
        if world == 1:
            # the launcher is the only rank (no second process importing torch and
            # megatron-core); colocated, the rank also hosts the engine: one process in all
            run_here(
                run_rank, typed, run_dir, prepared, threads=typed.launcher.threads,
                backend=typed.launcher.backend,
            )  # fmt: skip
        else:
            spawn(run_rank, world, typed, run_dir, prepared, threads=typed.launcher.threads)
    except KeyboardInterrupt:
        print("moerl: interrupted; ranks and engines stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        for engine in prepared[2]:
            engine.close()


def cli() -> None:
    """`python -m moerl.launch`: a dry run writes nothing; anything else is Hydra's job."""
    args = sys.argv[1:]
    if is_dry_run(args):
        dry_run(args)
    else:
        main()


if __name__ == "__main__":
    cli()
