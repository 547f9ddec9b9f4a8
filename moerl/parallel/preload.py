"""What the forkserver that starts local ranks imports once (``moerl.parallel.spawn``).

Every rank imports torch and megatron-core before it runs a line of moerl: 3–6 s of CPU
each, so a 4-rank world on a 2-core laptop spent six to ten seconds of wall time
importing before its first collective. On a CPU-only torch build the ranks
are forked from a server process that imported these modules once; a rank then starts
in milliseconds. Only libraries load here, in the order the CPU layer
(``moerl.compat.activate``) loads them: Triton held back first (megatron-core would map
it, and it cannot run without a GPU), megatron-core's start-up notices silenced. No
torch op runs, so no thread pool exists to be forked, and nothing here reads the
environment that a rank's own (forwarded by ``spawn``) could change, but Triton's
``TRITON_INTERPRET``, which the hold checks at each import, in the rank.
"""

from __future__ import annotations

from moerl.common import triton_hold

triton_hold.hold_back()  # a CPU-only build: no GPU for Triton, as compat.activate decides

from moerl.compat import quiet_megatron  # noqa: E402

quiet_megatron()

import megatron.core  # noqa: E402, F401
import megatron.core.distributed  # noqa: E402, F401
import megatron.core.models.gpt  # noqa: E402, F401
import megatron.core.optimizer  # noqa: E402, F401
import megatron.core.transformer.moe.moe_layer  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
