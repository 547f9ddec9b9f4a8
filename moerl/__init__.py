"""moerl: asynchronous RL for Mixture-of-Experts LLMs on megatron-core and SGLang."""

from moerl._version import __version__
from moerl.common import deferred_compile

# megatron-core's fused functions compile on first use, not torch's compiler at import
# (1.7 s of every process that imports megatron-core; moerl/common/deferred_compile.py)
deferred_compile.install()

__all__ = ["__version__"]
