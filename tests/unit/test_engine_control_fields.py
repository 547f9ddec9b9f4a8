"""Every field the embedded engine's control routes accept is a field of SGLang 0.5.23's
own request struct for that route (sglang/srt/managers/io_struct.py, read with ast: the
module's imports need sglang's whole dependency tree), so a client written against one
engine drives the other. Skips without sglang (pip install --no-deps sglang==0.5.23)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from moerl.engine.validate import CONTROL

SGLANG_STRUCTS = {
    "/pause_generation": "PauseGenerationReqInput",
    "/abort_request": "AbortReq",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}


def _struct_fields() -> dict[str, set[str]]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/managers/io_struct.py"
    tree = ast.parse(path.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        node = classes[name]
        own = {
            stmt.target.id
            for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        }
        for base in node.bases:  # BaseReq's rid and the like
            if isinstance(base, ast.Name) and base.id in classes:
                own |= fields(base.id)
        return own

    return {route: fields(name) for route, name in SGLANG_STRUCTS.items()}


# moerl's documented additions (docs/architecture.md): accepted beside SGLang's fields
EXTENSIONS = {
    # the adapter's bytes in the body, for an engine on another host (SGLang's
    # serialized_named_tensors carries same-host handles)
    "/load_lora_adapter_from_tensors": {"safetensors_b64"},
}


def test_every_control_field_is_sglangs():
    sglang = _struct_fields()
    assert set(SGLANG_STRUCTS) <= set(CONTROL), set(SGLANG_STRUCTS) - set(CONTROL)
    for route, ours in CONTROL.items():
        if route not in sglang:
            continue
        extra = set(ours) - sglang[route] - EXTENSIONS.get(route, set())
        assert not extra, f"{route}: {sorted(extra)} are not SGLang's ({sorted(sglang[route])})"
