"""Config schemas, the shipped YAML options and recipes, and the start-up validation."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from configs_for_tests import compose_config
from hydra import initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from moerl.config import MoerlConfig, ParallelConfig
from moerl.config.recipe import package_header
from moerl.config.store import register_configs
from moerl.validate import validate_config

# World size each shipped layout is meant for, with the tiny MoE (4 heads, 4 experts, 2 layers).
LAYOUT_WORLD = {
    "single": 1,
    "tp2": 2,
    "pp2": 2,
    "ep2": 2,
    "tp2ep2": 4,
    "etp2ep2": 4,
    "dp2ep2": 4,
}


def _options(package: str, folder: str | None = None) -> list[str]:
    root = resources.files(package)
    if folder is not None:
        root = root.joinpath(folder)
    return sorted(e.name[: -len(".yaml")] for e in root.iterdir() if e.name.endswith(".yaml"))


PARALLEL_OPTIONS = _options("moerl.conf", "parallel")
RECIPES = _options("moerl.recipes")


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    register_configs()


# --- composition ---------------------------------------------------------------


def test_hydras_repository_copies_share_the_config_store() -> None:
    """Hydra copies its repository for every composition and every group `--help` lists;
    a copy of the ConfigStore singleton is the singleton (moerl.config.store.
    share_config_store), and what a composition reads from it is still its own copy."""
    import copy

    from hydra._internal.config_repository import CachingConfigRepository
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        loader = GlobalHydra.instance().hydra.config_loader  # type: ignore[union-attr]
        copied = CachingConfigRepository(loader.repository)
    store.store(group="model", name="stored_after_the_copy", node={"num_experts": 2})
    try:  # a node stored after the copy is found through it, as a copy of its own
        loaded = copied.load_config("model/stored_after_the_copy")
        assert loaded is not None and loaded.config.num_experts == 2
        loaded.config.num_experts = 3
        assert store.load("model/stored_after_the_copy.yaml").node.num_experts == 2
    finally:
        del store.repo["model"]["stored_after_the_copy.yaml"]


def test_base_config_composes_to_schema() -> None:
    cfg = compose_config()
    assert cfg.model.num_experts == 4
    assert cfg.parallel.tp == 1
    assert cfg.engine.kind == "embedded"
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, MoerlConfig)
    assert isinstance(obj.parallel, ParallelConfig)
    assert validate_config(cfg, world_size=1) == obj


def test_layout_options_are_the_shipped_set() -> None:
    assert PARALLEL_OPTIONS == sorted(LAYOUT_WORLD)


@pytest.mark.parametrize("layout", PARALLEL_OPTIONS)
def test_parallel_option_composes_and_validates(layout: str) -> None:
    cfg = compose_config(f"parallel={layout}")
    parallel = OmegaConf.to_object(cfg.parallel)
    assert isinstance(parallel, ParallelConfig)
    if layout != "dp2ep2":  # same layout as ep2, on twice the ranks
        assert parallel.name() == layout
    validate_config(cfg, world_size=LAYOUT_WORLD[layout])


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe: str, tmp_path, monkeypatch) -> None:
    """Each recipe validates as shipped; one reading a data set finds it where its header
    comment's tool writes it (data/… under the working directory)."""
    monkeypatch.chdir(tmp_path)
    if recipe == "word_problems":
        import subprocess
        import sys

        tool = Path(__file__).resolve().parents[2] / "tools" / "make_word_problems.py"
        subprocess.run(
            [sys.executable, str(tool), "--out", "data/word_problems"], check=True, timeout=120
        )
    cfg = compose_config(f"+recipe={recipe}")
    world = cfg.launcher.nproc or 1
    validate_config(cfg, world_size=world)


@pytest.mark.parametrize(
    "override, key",
    [
        ("parallel.tpp=2", "tpp"),
        ("model.num_expert=8", "num_expert"),
        ("trainer.lr=fast", "lr"),
        ("parallel=tp3", "tp3"),
    ],
)
def test_typo_override_fails(override: str, key: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(override)
    text = str(info.value) + str(info.value.__cause__)
    assert key in text


@pytest.mark.parametrize("override", ["+foo=1", "+parallel.tpx=2", "+model.moe.x=1"])
def test_added_key_is_rejected(override: str) -> None:
    # `+key=value` gets past the schema at composition; validation catches it.
    key = override[1:].split("=")[0].split(".")
    shown = ".".join(key[:2]) if len(key) > 1 else key[0]
    with pytest.raises(ValueError, match=f"{shown} is not a config key"):
        validate_config(compose_config(override), world_size=1)


def test_unknown_recipe_is_rejected() -> None:
    # With recipes shipped Hydra rejects the name; with none, validation does.
    with pytest.raises((ConfigCompositionException, ValueError), match="no_such_recipe"):
        validate_config(compose_config("+recipe=no_such_recipe"), world_size=1)


def testpackage_header() -> None:
    assert package_header("# @package _global_\ndefaults: []\n") == "_global_"
    assert package_header("# a recipe\n#  @package _global_\n") == "_global_"
    assert package_header("trainer:\n  lr: 1\n# @package _global_\n") is None


# --- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, world, fragments",
    [
        # TP must divide the attention heads.
        (["parallel.tp=3"], 3, ["parallel.tp=3", "model.num_attention_heads=4", "choose tp"]),
        # EP must divide the routed experts.
        (["parallel.ep=3"], 3, ["parallel.ep=3", "model.num_experts=4", "choose ep"]),
        # More pipeline stages than layers.
        (["parallel.pp=4"], 4, ["parallel.pp=4", "model.num_layers=2"]),
        # The world must split into TP × PP model copies.
        (["parallel=tp2"], 3, ["world size 3", "parallel.tp", "2"]),
        # Top-k larger than the expert count.
        (["model.moe_router_topk=5"], 1, ["model.moe_router_topk=5", "model.num_experts=4"]),
        (["trainer.dtype=fp16"], 1, ["trainer.dtype='fp16'", "'bf16'"]),
        (["model.hidden_size=0"], 1, ["model.hidden_size=0", "positive"]),
        (["trainer.global_batch_size=3"], 2, ["trainer.global_batch_size=3", "multiple of 2"]),
        (
            ["parallel=tp2", "parallel.sequence_parallel=false"],
            2,
            ["parallel.sequence_parallel=false", "MoE"],
        ),
        (["engine.kind=sglang"], 1, ["engine.urls"]),
        (["engine.prefix_cache_max_tokens=0"], 1, ["engine.prefix_cache_max_tokens=0"]),
        (["engine.chunked_prefill_size=0"], 1, ["engine.chunked_prefill_size=0", "-1 for no"]),
        (["engine.max_prefill_tokens=0"], 1, ["engine.max_prefill_tokens=0"]),
        (["engine.admission_wait_ms=-1"], 1, ["engine.admission_wait_ms=-1", ">= 0"]),
        (["engine.decode_share=1.0"], 1, ["engine.decode_share=1.0", "[0, 1)"]),
        (["engine.shared_prompt_min_tokens=0"], 1, ["engine.shared_prompt_min_tokens=0", "-1"]),
        (["engine.cuda_graph_max_bs=0"], 1, ["engine.cuda_graph_max_bs=0"]),
        (["trainer.numerics=exact"], 1, ["trainer.numerics='exact'", "batch_invariant"]),
        (
            ["trainer.numerics=batch_invariant", "parallel.tp=4"],
            4,
            ["parallel.tp=4", "must divide 2"],
        ),
        (
            ["trainer.numerics=batch_invariant", "trainer.dtype=bf16"],
            1,
            ["trainer.dtype='bf16' and model.family='gpt'", "ROUTER_DTYPE"],
        ),
        (
            ["model=deepseek_moe_tiny", "trainer.numerics=batch_invariant", "trainer.dtype=bf16"],
            1,
            ["trainer.dtype='bf16' and engine.dtype='float32'", "engine.dtype=bfloat16"],
        ),
        (
            ["trainer.numerics=batch_invariant", "model.normalization=LayerNorm"],
            1,
            ["model.normalization='LayerNorm' with trainer.numerics=batch_invariant"],
        ),
        (
            ["trainer.numerics=batch_invariant", "trainer.packing=packed"],
            1,
            ["trainer.packing='packed' with trainer.numerics=batch_invariant", "padded"],
        ),
        (
            ["trainer.numerics=batch_invariant", "trainer.kernels=triton"],
            1,
            ["trainer.kernels='triton' with trainer.numerics=batch_invariant"],
        ),
        (
            ["model=deepseek_moe_tiny", "lora=all", "trainer.numerics=batch_invariant"],
            1,
            ["trainer.numerics=batch_invariant with lora.enabled"],
        ),
        (
            ["model=deepseek_moe_tiny", "lora=all", "engine.deterministic_inference=true"],
            1,
            ["engine.deterministic_inference=true with lora.enabled", "no LoRA path"],
        ),
        (["launcher.nproc=2"], 4, ["launcher.nproc=2", "world size is 4"]),
        (["launcher.omp_spincount=-1"], 1, ["launcher.omp_spincount=-1", ">= 0"]),
        (["launcher.malloc_keep_mb=-1"], 1, ["launcher.malloc_keep_mb=-1", ">= 0"]),
        (["engine.prefix_cache=maybe"], 1, ["engine.prefix_cache='maybe'", "auto, true or false"]),
        (["trainer.resume=true"], 1, ["trainer.checkpoint_dir"]),
    ],
)
def test_validate_names_key_value_and_fix(
    overrides: list[str], world: int, fragments: list[str]
) -> None:
    cfg = compose_config(*overrides)
    with pytest.raises(ValueError) as info:
        validate_config(cfg, world_size=world)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "overrides, flags",
    [
        ([], ["--prefix-cache-max-tokens", "65536"]),
        (["engine.prefix_cache_max_tokens=512"], ["--prefix-cache-max-tokens", "512"]),
        (["engine.prefix_cache=false"], ["--disable-radix-cache"]),
    ],
)
def test_engine_config_becomes_engine_flags(overrides: list[str], flags: list[str]) -> None:
    from moerl.engine.cli import parse_args
    from moerl.launch import engine_flags

    cfg = compose_config(
        *overrides, "engine.max_prefill_tokens=999", "engine.chunked_prefill_size=-1",
        "engine.admission_wait_ms=2.5", "engine.admission_quiet_ms=0.5",
        "engine.decode_share=0.25", "engine.shared_prompt_min_tokens=-1",
    )  # fmt: skip
    got = engine_flags(cfg.engine)
    assert got[-len(flags) :] == flags
    args = parse_args(["--model-path", "m", *got])  # the embedded engine reads them all
    assert args.disable_radix_cache == (flags == ["--disable-radix-cache"])
    assert args.max_running_requests == cfg.engine.max_running_requests
    assert (args.max_prefill_tokens, args.chunked_prefill_size) == (999, -1)
    assert (args.admission_wait_ms, args.admission_quiet_ms) == (2.5, 0.5)
    assert args.decode_share == 0.25
    assert args.shared_prompt_min_tokens == -1


def test_deterministic_inference_reaches_the_policy_engines() -> None:
    from moerl.engine.cli import parse_args
    from moerl.launch import policy_engine_flags

    assert "--enable-deterministic-inference" not in policy_engine_flags(compose_config())
    flags = policy_engine_flags(compose_config("engine.deterministic_inference=true"))
    assert parse_args(["--model-path", "m", *flags]).enable_deterministic_inference


@pytest.mark.parametrize(
    "overrides, enabled, max_bs",
    [
        ([], False, None),
        (["engine.cuda_graph=true"], True, None),
        (["engine.cuda_graph=true", "engine.cuda_graph_max_bs=16"], True, 16),
        (["engine.cuda_graph_max_bs=16"], False, None),  # no graphs: nothing to bound
    ],
)
def test_engine_cuda_graph_becomes_engine_flags(
    overrides: list[str], enabled: bool, max_bs: int | None
) -> None:
    from moerl.engine.cli import parse_args
    from moerl.launch import engine_flags

    cfg = compose_config(*overrides)
    validate_config(cfg, world_size=1)
    args = parse_args(["--model-path", "m", *engine_flags(cfg.engine)])
    assert (args.enable_cuda_graph, args.cuda_graph_max_bs) == (enabled, max_bs)


def test_validate_accepts_dataclass() -> None:
    cfg = MoerlConfig()
    cfg.model.num_experts = 8
    cfg.parallel.ep = 4
    assert validate_config(cfg, world_size=4) is cfg


# --- the entry point -----------------------------------------------------------


MODEL_OPTIONS = _options("moerl.conf", "model")


@pytest.mark.parametrize("name", MODEL_OPTIONS)
def test_every_model_option_composes_and_validates(name: str) -> None:
    cfg = compose_config(f"model={name}")
    typed = validate_config(cfg, world_size=1)
    assert typed.model.num_layers >= 2


def test_unknown_family_is_rejected() -> None:
    with pytest.raises(ValueError, match="model.family='llama'"):
        validate_config(compose_config("model.family=llama"), world_size=1)


def test_trainer_replay_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="trainer.replay: unknown replay policy 'sometimes'"):
        validate_config(compose_config("trainer.replay=sometimes"), world_size=1)
    # a policy of one's own by _target_ (here any importable function) is accepted
    validate_config(compose_config("trainer.replay={_target_:torch.clone}"), world_size=1)


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.lr_warmup_steps=-1", ["trainer.lr_warmup_steps=-1", ">= 0"]),
        ("trainer.min_lr=1.0", ["trainer.min_lr=1.0", "must be <= trainer.lr=1e-06"]),
        ("trainer.lr_schedule=step", ["trainer.lr_schedule='step'", "'cosine'"]),
        ("trainer.lr=nan", ["trainer.lr=nan", "finite"]),
        ("trainer.lr=0", ["trainer.lr=0.0", "> 0.0"]),
        ("trainer.clip_grad=-1", ["trainer.clip_grad=-1.0", ">= 0.0"]),
        ("trainer.weight_decay=inf", ["trainer.weight_decay=inf", "finite"]),
        ("trainer.adam_beta2=1.0", ["trainer.adam_beta2=1.0", "[0, 1)"]),
        ("trainer.minibatches=0", ["trainer.minibatches=0", "positive integer"]),
        # warmup must end before the schedule does (megatron asserts it without a key)
        ("trainer.lr_warmup_steps=100", ["trainer.lr_warmup_steps=100", "100 × 1 = 100"]),
    ],
)
def test_optimizer_keys_are_checked(override: str, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        validate_config(compose_config(override), world_size=1)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_warmup_is_checked_against_decay_steps() -> None:
    cfg = compose_config("trainer.lr_warmup_steps=10", "trainer.lr_decay_steps=10")
    with pytest.raises(ValueError, match="trainer.lr_decay_steps=10"):
        validate_config(cfg, world_size=1)
    # 6 batches × 2 minibatches = 12 optimizer steps: a 10-step warmup fits
    overrides = ["trainer.lr_warmup_steps=10", "trainer.train_iters=6", "trainer.minibatches=2"]
    typed = validate_config(compose_config(*overrides), world_size=1)
    assert typed.trainer.minibatches == 2


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["algo.old_policy=rollout"], ["algo.old_policy=rollout", "algo.old_policy=recompute"]),
        (["algo.old_policy=rollout", "correction=icepop"], ["correction.reweight=false"]),
        (["algo.loss.decoupled=true"], ["algo.loss.decoupled=true", "correction=none"]),
        (["trainer.minibatches=3"], ["trainer.minibatches × parallel.micro_batch_size", "3"]),
    ],
)
def test_off_policy_composition_is_checked_at_start_up(overrides, fragments) -> None:
    """The shipped recipe (ppo_clip + tis) under bypass double-counts the IS weight; the
    batch must split into whole minibatches."""
    with pytest.raises(ValueError) as info:
        validate_config(compose_config("+recipe=deepseek_moe", *overrides), world_size=1)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["parallel.micro_batch_size=2"],
         ["parallel.micro_batch_size=2", "trainer.max_tokens_per_microbatch=0"]),
        (["trainer.max_tokens_per_microbatch=-1"], ["trainer.max_tokens_per_microbatch=-1"]),
        (["trainer.old_policy_pass=twice"], ["trainer.old_policy_pass", "separate"]),
    ],
)  # fmt: skip
def test_micro_batching_is_checked_at_start_up(overrides, fragments) -> None:
    """A sequence count per micro-batch next to the token budget would do nothing: refused
    with both fixes; a negative budget and an unknown old-policy pass are named."""
    with pytest.raises(ValueError) as info:
        validate_config(compose_config("+recipe=deepseek_moe", *overrides), world_size=1)
    for fragment in fragments:
        assert fragment in str(info.value)
    cfg = compose_config("+recipe=deepseek_moe", "parallel.micro_batch_size=2",
                   "trainer.max_tokens_per_microbatch=0")  # fmt: skip
    assert validate_config(cfg, world_size=1).parallel.micro_batch_size == 2


def test_dr_grpo_takes_the_rollout_length_as_its_normaliser() -> None:
    cfg = validate_config(
        compose_config("+recipe=deepseek_moe", "algo=dr_grpo", "rollout.max_new_tokens=12"), 1
    )
    assert (cfg.algo.loss.agg, cfg.algo.loss.norm_length) == ("seq_mean_token_sum_norm", 12)
    assert cfg.algo.old_policy == "recompute"


# engine.device: validated at start-up, and passed to every embedded engine (the run's,
# the evaluator's through engine_flags, the reward model's) as --device.


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_engine_device_reaches_the_engine_flags(device: str) -> None:
    from moerl.engine.cli import parse_args
    from moerl.launch import engine_flags

    cfg = validate_config(compose_config(f"engine.device={device}"), world_size=1)
    flags = engine_flags(cfg.engine)
    assert flags[flags.index("--device") + 1] == device
    if device in ("auto", "cpu"):  # parse_args checks the device exists on this machine
        assert parse_args(["--model-path", "m", *flags]).device == device


def test_engine_device_defaults_to_auto() -> None:
    assert compose_config().engine.device == "auto"


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0"])
def test_a_bad_engine_device_names_the_key_and_the_choices(device: str) -> None:
    with pytest.raises(ValueError, match=rf"engine.device='{device}' .*'auto', 'cpu', 'cuda'"):
        validate_config(compose_config(f"engine.device={device}"), world_size=1)


@pytest.mark.parametrize(
    "changes, truncates",
    [
        ({}, False),  # temperature 1, top_k -1, top_p 1, min_p 0: every token kept
        ({"temperature": 0.0}, True),  # greedy: the argmax alone
        ({"top_k": 20}, True),
        ({"top_p": 0.9}, True),
        ({"min_p": 0.05}, True),
        ({"temperature": 0.7}, False),  # a temperature reshapes, keeps every token
    ],
)
def test_the_sampling_mask_is_asked_for_only_where_sampling_truncates(
    changes: dict[str, float], truncates: bool
) -> None:
    from moerl.config.rollout import RolloutConfig

    cfg = RolloutConfig(**changes)  # type: ignore[arg-type]
    assert cfg.sampling_truncates() == truncates
    assert cfg.records_sampling_mask() == truncates
    off = RolloutConfig(return_sampling_mask=False, **changes)  # type: ignore[arg-type]
    assert not off.records_sampling_mask()


@pytest.mark.parametrize(
    "overrides, on",
    [
        ([], False),  # auto, single-turn: every push flushes the cache before any reuse
        (["env=calculator"], True),  # auto, episodes: a turn extends the last one's KV
        (["engine.prefix_cache=true"], True),
        (["env=calculator", "engine.prefix_cache=false"], False),
        (["+recipe=deepseek_moe"], False),
        (["+recipe=guess_number"], True),
    ],
)
def test_the_policy_engines_prefix_cache_follows_the_rollouts(
    overrides: list[str], on: bool
) -> None:
    """engine.prefix_cache=auto (the default) is off for single-turn rollouts and on for
    multi-turn episodes; true and false are kept; the policy engines' flags follow."""
    from moerl.engine.cli import parse_args
    from moerl.launch import policy_engine_flags, prefix_cache_on

    cfg = compose_config(*overrides)
    validate_config(cfg, world_size=1)
    assert prefix_cache_on(cfg) is on
    flags = policy_engine_flags(cfg)
    assert ("--disable-radix-cache" in flags) is not on
    assert parse_args(["--model-path", "m", *flags]).disable_radix_cache is not on
