"""SGLang frontend programs for test_sglang_frontend.py, run in a worker process of their own:
``import sglang`` patches transformers' classes for its whole process
(sglang/srt/utils/hf_transformers_patches.py), which the rest of the test session must not
see. Each function connects ``sgl.RuntimeEndpoint`` to ``url``, runs one program and
returns plain data; an engine error comes back as the frontend raised it."""

from __future__ import annotations

import socket
from typing import Any

# SGLang's frontend sets no timeout on its HTTP calls; this bounds each one.
HTTP_TIMEOUT_S = 60.0


def _sgl() -> Any:
    socket.setdefaulttimeout(HTTP_TIMEOUT_S)
    import sglang

    return sglang


def _finished(state: Any) -> Any:
    error = state.error()
    if error is not None:
        raise error
    return state


def version() -> str:
    return str(_sgl().__version__)


def server_info(url: str) -> dict[str, Any]:
    """/server_info through the frontend, decoded by SGLang's typed contract."""
    sgl = _sgl()
    from sglang.api.v1.api_types import GetServerInfoResponse

    raw = sgl.RuntimeEndpoint(url).get_server_info()
    return dict(GetServerInfoResponse.from_json_value(raw).to_json_value())


def _gen_program(sgl: Any) -> Any:
    @sgl.function
    def complete(s, prompt, gen_kwargs):  # type: ignore[no-untyped-def]
        s += prompt
        s += sgl.gen("out", **gen_kwargs)

    return complete


def gen(url: str, prompt: str, **gen_kwargs: Any) -> tuple[str, dict[str, Any]]:
    """``prompt + sgl.gen("out", **gen_kwargs)``: (the generated text, its meta_info)."""
    sgl = _sgl()
    state = _finished(_gen_program(sgl).run(prompt, gen_kwargs, backend=sgl.RuntimeEndpoint(url)))
    return state["out"], state.get_meta_info("out")


def gen_stream(url: str, prompt: str, **gen_kwargs: Any) -> tuple[list[str], str]:
    """The same, streamed: (the text chunks as they arrived, the final text)."""
    sgl = _sgl()
    state = _gen_program(sgl).run(prompt, gen_kwargs, backend=sgl.RuntimeEndpoint(url), stream=True)
    chunks = list(state.text_iter("out"))
    return chunks, _finished(state)["out"]


def gen_batch(url: str, prompts: list[str], **defaults: Any) -> list[str]:
    """``run_batch`` over prompts (sampling defaults as run_batch takes them)."""
    sgl = _sgl()
    states = _gen_program(sgl).run_batch(
        [{"prompt": p, "gen_kwargs": {}} for p in prompts],
        backend=sgl.RuntimeEndpoint(url),
        **defaults,
    )
    return [_finished(s)["out"] for s in states]


def gen_int(url: str, prompt: str, max_tokens: int) -> str:
    sgl = _sgl()

    @sgl.function
    def number(s):  # type: ignore[no-untyped-def]
        s += prompt
        s += sgl.gen_int("n", max_tokens=max_tokens)

    return str(_finished(number.run(backend=sgl.RuntimeEndpoint(url)))["n"])


def fork(url: str, prefix: str, suffixes: list[str], max_tokens: int) -> tuple[list[str], str]:
    """Fork after ``prefix``; branch i appends suffixes[i] and greedy-generates. Returns
    (each branch's output, the parent's text after appending them joined by '|')."""
    sgl = _sgl()

    @sgl.function
    def branches(s):  # type: ignore[no-untyped-def]
        s += prefix
        forks = s.fork(len(suffixes))
        for f, suffix in zip(forks, suffixes):
            f += suffix
            f += sgl.gen("out", max_tokens=max_tokens, temperature=0)
        outs = [f["out"] for f in forks]
        s += "|".join(outs)
        return outs

    state = _finished(branches.run(backend=sgl.RuntimeEndpoint(url)))
    return list(state.ret_value), state.text()


def select(url: str, prefix: str, choices: list[str]) -> tuple[str, list[float]]:
    """``prefix + sgl.select(choices)``: (the choice, its normalized_prompt_logprobs)."""
    sgl = _sgl()

    @sgl.function
    def pick(s):  # type: ignore[no-untyped-def]
        s += prefix
        s += sgl.select("answer", choices=choices)

    state = _finished(pick.run(backend=sgl.RuntimeEndpoint(url)))
    return state["answer"], list(state.get_meta_info("answer")["normalized_prompt_logprobs"])
