"""moerl/engine/validate.py ``nonfinite_tensor`` on tensors larger than its check's chunk:
a NaN or ±inf anywhere (first chunk, a middle one, the ragged last one) is found, in
every float dtype, against torch's own ``isfinite`` as the reference. And request bodies:
a field of the wrong type is named as such before any NaN or inf in it is."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.engine.validate import (
    _CHUNK,
    RequestError,
    check_control,
    check_generate,
    nonfinite_tensor,
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_a_bad_value_anywhere_in_a_large_tensor_is_found(dtype):
    numel = 3 * _CHUNK + 123  # three whole chunks and a ragged one
    gen = torch.Generator().manual_seed(0)
    fine = torch.randn(numel, generator=gen).to(dtype).reshape(-1, 1)
    assert bool(torch.isfinite(fine).all()) and nonfinite_tensor([("w", fine)]) is None
    for where in (0, _CHUNK + 7, 2 * _CHUNK - 1, numel - 1):
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = fine.clone()
            t.view(-1)[where] = bad
            assert not bool(torch.isfinite(t).all())
            assert nonfinite_tensor([("ok", fine), ("bad", t)]) == "bad", (where, bad)


def test_a_strided_tensor_is_checked_too():
    t = torch.randn(4 * _CHUNK // 256, 256)
    view = t.t()  # not contiguous: the torch path
    assert nonfinite_tensor([("t", view)]) is None
    t[3, 5] = float("nan")
    assert nonfinite_tensor([("t", view)]) == "t"


@pytest.mark.parametrize(
    "body, words",
    [  # a value of the wrong type is named as that, even when it is -Infinity
        ({"input_ids": [1], "return_routed_experts": -math.inf}, "return_routed_experts: must be true or false"),
        ({"input_ids": [1], "rid": {"x": math.nan}}, "rid: must be a string"),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": math.inf}}, "sampling_params.ignore_eos: must be true or false"),
        # a number that is not finite is named as not finite
        ({"input_ids": [1], "sampling_params": {"temperature": math.nan}}, "sampling_params.temperature: must be a finite number"),
        ({"input_ids": [1], "sampling_params": {"custom_params": {"a": [math.inf]}}}, r"sampling_params.custom_params.a\[0\]: must be a finite number"),
    ],
)  # fmt: skip
def test_a_refused_body_names_the_type_before_the_number(body, words):
    with pytest.raises(RequestError, match=words):
        check_generate(body)


def test_a_control_body_names_the_type_before_the_number():
    with pytest.raises(RequestError, match="abort_all: must be true or false"):
        check_control("/abort_request", {"abort_all": -math.inf})
    with pytest.raises(RequestError, match="master_port: must be an integer"):
        check_control("/init_weights_update_group", {"master_port": math.nan})
    with pytest.raises(RequestError, match="config_dict.lora_alpha: must be a finite number"):
        body = {"lora_name": "a", "config_dict": {"r": 4, "lora_alpha": math.nan}}
        check_control("/load_lora_adapter_from_tensors", body)


def test_a_large_body_is_checked_and_a_bad_number_deep_in_it_named():
    """A weight push's body names every tensor: the walk looks at every value, and a
    refusal names where the bad number is, however deep."""
    body = {
        "names": [f"model.layers.{i}.w" for i in range(200)],
        "dtypes": ["float32"] * 200,
        "shapes": [[64, 32]] * 200,
        "group_name": "g",
        "extra": [{"a": [0.5, 1.0]}] * 50,
    }
    check_control("/update_weights_from_distributed", body)  # finite: nothing raised
    for bad in (math.nan, math.inf, -math.inf):
        body["extra"] = [{"a": [0.5, 1.0]}] * 40 + [{"a": [0.5, {"b": [2.0, bad]}]}]
        with pytest.raises(RequestError, match=r"extra\[40\].a\[1\].b\[1\]: must be a finite"):
            check_control("/update_weights_from_distributed", body)


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
     torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn],
)  # fmt: skip
@pytest.mark.parametrize("shape", [[], [0], [7], [3, 5], [2, 3, 4]])
def test_a_buckets_byte_count_is_torchs(dtype, shape):
    from moerl.engine.weights.bucket import dtype_of, nbytes

    want = torch.empty(shape, dtype=dtype).numel() * torch.empty(0, dtype=dtype).element_size()
    assert nbytes(dtype, shape) == want
    assert dtype_of(str(dtype)) is dtype and dtype_of(str(dtype).removeprefix("torch.")) is dtype
