"""Record request/response examples of the engine protocol into tests/fixtures/protocol/.

    python tools/record_protocol_fixtures.py

Each file holds {"endpoint", "request", "status", "response"} from a real embedded
engine serving the tiny DeepSeek-architecture model (greedy, so values are stable).
They document the wire format (SGLang's native API subset; docs/architecture.md, "The
engine protocol"); a test checks the live engine still answers with the same structure.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "protocol"
GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
EXAMPLES = {
    "generate_routed_masked": ("POST", "/generate", {
        **GEN, "rid": "example-1", "return_logprob": True, "return_routed_experts": True,
        "return_sampling_mask": True,
    }),
    "generate_sampled_support": ("POST", "/generate", {
        "input_ids": [9, 10], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "top_k": 3},
        "rid": "example-2", "return_sampling_mask": True, "sampling_logprobs_mode": "support",
    }),
    "generate_n2": ("POST", "/generate", {**GEN, "rid": "example-3", "sampling_params": {"max_new_tokens": 2, "n": 2, "temperature": 0}}),
    "error_unknown_sampling_param": ("POST", "/generate", {**GEN, "sampling_params": {"max_new_tokens": 2, "foo": 1}}),
    "error_overlong_prompt": ("POST", "/generate", {**GEN, "input_ids": [5] * 200}),
    "pause_generation": ("POST", "/pause_generation", {"mode": "retract"}),
    "continue_generation": ("POST", "/continue_generation", {}),
    "update_weight_version": ("POST", "/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
    "model_info": ("GET", "/model_info", None),
}  # fmt: skip


def record(url: str) -> dict[str, dict]:
    out = {}
    for name, (method, path, body) in EXAMPLES.items():
        r = httpx.request(method, f"{url}{path}", json=body, timeout=60)
        try:
            response = r.json()
        except ValueError:
            response = r.text
        out[name] = {
            "endpoint": f"{method} {path}",
            "request": body,
            "status": r.status_code,
            "response": response,
        }
    info = out["model_info"]["response"]
    info["model_path"] = info["served_model_name"] = info["tokenizer_path"] = "<tiny deepseek_moe>"
    return out


def main() -> None:
    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_checkpoint(tiny_config("deepseek_moe"), Path(tmp) / "hf", seed=0)
        with EngineProcess(model, "--enable-return-routed-experts") as engine:
            examples = record(engine.url)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, example in examples.items():
        (OUT / f"{name}.json").write_text(json.dumps(example, indent=2) + "\n")
    print(f"wrote {len(examples)} examples to {OUT}")


if __name__ == "__main__":
    main()
