"""Package metadata for moerl.

Three top-level source folders are installed inside the `moerl` package, so the
install claims only the name `moerl`:

    kernels/  -> moerl.kernels   (Triton kernels with torch twins)
    conf/     -> moerl.conf      (Hydra config groups, found as pkg://moerl.conf)
    recipes/  -> moerl.recipes   (`+recipe=NAME` files, registered as the Hydra group
                                  `recipe` by moerl.config.store.register_configs)

The mapping holds for a wheel and for an editable install (`pip install -e .`).
"""

import re

from setuptools import find_packages, setup

# one place for the version: moerl/_version.py (read as text: nothing imported at build)
VERSION = re.search(
    r'^__version__ = "([^"]+)"', open("moerl/_version.py", encoding="utf-8").read(), re.M
).group(1)

# Triton 3 runs its kernels on the CPU under TRITON_INTERPRET=1, which is how the tests
# check every kernel against its torch twin without a GPU.
KERNELS = ["triton>=3.0"]
# task=dataset (moerl.tasks.dataset): local parquet / jsonl / arrow files through HF datasets;
# imported lazily, so the core install does without it.
DATA = ["datasets>=2.19", "pyarrow"]
# What `import sglang` needs beyond moerl's own requirements, for SGLang's Python frontend
# in tests/integration/test_sglang_frontend.py. sglang itself cannot be listed: it goes in
# with `pip install --no-deps sglang==0.5.23` (Python >= 3.11), because its requirements
# pin a CUDA torch and GPU kernels; the test skips without it.
SGLANG_FRONTEND = ["requests", "aiohttp", "msgspec", "orjson", "pybase64", "pyzmq", "ipython"]
# The `math` reward (moerl/tasks/verifiers/math_answer.py): LaTeX and numeric equivalence;
# `pip install moerl[verify]`. 0.9 is the release tested.
VERIFY = ["math-verify>=0.9"]  # parse(parsing_timeout=), verify(timeout_seconds=) as tested
# tools/bench/vs_trl.py runs TRL's GRPOTrainer beside moerl; `pip install moerl[bench]`.
# Kept out of `test` and `dev`: CI never installs TRL, and the bench and its test skip
# without it. 1.16 is the release tested.
BENCH = ["trl>=1.16", "psutil"]
TEST = [
    "pytest>=8",
    "pytest-timeout",
    "httpx",
    "hypothesis>=6",
    "openai",
    *KERNELS,
    *SGLANG_FRONTEND,
    *VERIFY,
    *DATA,
]

packages = find_packages(include=["moerl", "moerl.*"])
packages += ["moerl.kernels"] + [f"moerl.kernels.{p}" for p in find_packages("kernels")]
packages += ["moerl.conf", "moerl.recipes"]

setup(
    name="moerl",
    version=VERSION,
    description="Asynchronous RL for Mixture-of-Experts LLMs on megatron-core and SGLang",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir={
        "moerl.kernels": "kernels",
        "moerl.conf": "conf",
        "moerl.recipes": "recipes",
    },
    package_data={
        "moerl.conf": ["*.yaml", "**/*.yaml"],
        "moerl.recipes": ["*.yaml"],
    },
    include_package_data=False,
    zip_safe=False,
    install_requires=[
        # No upper bound on torch: GPU users bring their own CUDA build first.
        "torch>=2.6",
        # 0.16 is the first release with RouterReplay; 0.17+ needs Python >= 3.12.
        "megatron-core>=0.16,<0.19",
        "hydra-core>=1.3,<1.4",
        "numpy",
        # 4.51 is the first release with Qwen3MoE and DeepseekV3 model classes.
        "transformers>=4.51",
        "safetensors",
        # the engine's stop_regex searches take a timeout (re's take none); transformers
        # needs it too
        "regex>=2022.1.18",
        # megatron-core imports einops lazily (rank grids, MLA, attention reshapes).
        "einops",
        # the engine renders /generate as SGLang does (orjson), the client parses it so
        "orjson",
        # megatron-core's checkpoint writer needs psutil but does not declare it; without
        # it the writer's worker dies silently and the save hangs.
        "psutil",
        "tqdm",
        # the embedded engine's HTTP server (SGLang's own stack: it serves on uvloop);
        # uvicorn takes uvloop and the httptools parser when installed, which answer a
        # request in ~0.1 ms less CPU than asyncio and h11 (tools/bench/vs_trl.py's
        # synchronous step: 1.5-3 ms less in 3 of 4 alternating runs)
        "fastapi",
        "uvicorn",
        "uvloop; sys_platform != 'win32'",
        "httptools",
        "rich",
        "matplotlib>=3.6",  # moerl.telemetry.plots, tools/plot_run.py (Figure API, no pyplot)
        # moerl.rollout.client: async HTTP to the engines (SGLang native API): aiohttp on
        # sockets (a sixth of httpx's client CPU per request), httpx for in-process mounts
        "aiohttp",
        "httpx",
        # the embedded engine's constrained decoding (regex, json_schema, ebnf): one of the
        # grammar backends SGLang itself offers, a self-contained wheel (no torch, no triton)
        "llguidance>=1.0",
    ],
    extras_require={
        "sglang": ["sglang"],
        "te": ["transformer-engine[pytorch]"],
        "apex": ["apex"],
        "kernels": KERNELS,
        "verify": VERIFY,
        "data": DATA,
        "bench": BENCH,
        "test": TEST,
        "dev": TEST + ["ruff", "mypy", "import-linter"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
