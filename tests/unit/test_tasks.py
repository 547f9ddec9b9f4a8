"""Tasks: deterministic prompt streams, hand-checked rewards, registry, jsonl, config errors,
and the random-policy reward signal of the learnable task."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.config.task import (
    ArithmeticTaskConfig,
    CopyDigitsTaskConfig,
    CustomTaskConfig,
    JsonlTaskConfig,
    TaskConfig,
)
from moerl.models.tokenizer import build_tiny_tokenizer
from moerl.tasks import (
    TASKS,
    CopyDigitsTask,
    Prompt,
    Task,
    build_task,
    check_task_config,
    decode_response,
    warm_start_examples,
)
from moerl.tasks.synthetic import evaluate

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id


def take(task: Task, n: int, start: int = 0) -> list[Prompt]:
    return list(itertools.islice(task.prompts(start), n))


def ids(text: str, eos: bool = True) -> list[int]:
    out = TOK(text, add_special_tokens=False)["input_ids"]
    return [*out, EOS] if eos else out


def traj(prompt: Prompt, response: list[int], finish: str | None = None) -> Trajectory:
    if finish is None:
        finish = "stop" if response and response[-1] == EOS else "length"
    n = len(response)
    return Trajectory(
        prompt_ids=prompt.input_ids,
        response_ids=np.asarray(response, dtype=np.int32),
        response_logprobs=np.zeros(n, np.float32),
        versions=np.zeros(n, np.int32),
        finish_reason=finish,
    )


def fixed_prompt(answer: str) -> Prompt:
    return Prompt(0, np.asarray([1, 2], np.int32), answer=answer, text="")


# ---- determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["arithmetic", "copy_digits"])
def test_same_seed_same_prompts_and_start_is_the_tail(name: str) -> None:
    a, b = build_task(name, TOK), build_task(name, TOK)
    first = take(a, 40)
    assert [p.text for p in first] == [p.text for p in take(b, 40)]
    tail = take(b, 15, start=25)
    assert [p.prompt_id for p in tail] == list(range(25, 40))
    for p, q in zip(first[25:], tail):
        assert (p.text, p.answer) == (q.text, q.answer)
        np.testing.assert_array_equal(p.input_ids, q.input_ids)
    other = build_task({"name": name, "seed": 1}, TOK)
    assert [p.text for p in take(other, 40)] != [p.text for p in first]


def test_prompt_tokens_start_with_bos_and_stay_in_the_tiny_vocab() -> None:
    for name in ("arithmetic", "copy_digits"):
        for p in take(build_task(name, TOK), 50):
            assert p.input_ids.dtype == np.int32 and p.input_ids[0] == TOK.bos_token_id
            assert TOK.unk_token_id not in p.input_ids.tolist()
            assert TOK.decode(p.input_ids, skip_special_tokens=True) == p.text


def test_fixed_set_repeats_in_reshuffled_epochs() -> None:
    task = build_task(CopyDigitsTaskConfig(num_prompts=5, seed=3), TOK)
    items = [p.meta["item"] for p in take(task, 15)]
    epochs = [items[0:5], items[5:10], items[10:15]]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled
    assert [p.meta["item"] for p in take(task, 5, start=7)] == items[7:12]
    plain = build_task(CopyDigitsTaskConfig(num_prompts=3, shuffle=False), TOK)
    assert [p.meta["item"] for p in take(plain, 7)] == [0, 1, 2, 0, 1, 2, 0]


def test_arithmetic_answers_are_right() -> None:
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4], ["*", "-"]) == 2
    assert evaluate([10, 18], ["-"]) == -8
    cfg = ArithmeticTaskConfig(ops="+-*", num_operands=3, max_operand=9)
    for p in take(build_task(cfg, TOK), 100):
        body = p.text.rstrip("=")
        nums = [int(x) for x in body.replace("+", " ").replace("-", " ").replace("*", " ").split()]
        ops = [c for c in body if c in "+-*"]
        assert p.answer == str(evaluate(nums, ops))
        assert all(0 <= v <= 9 for v in nums) and len(nums) == 3


# ---- rewards on constructed trajectories ------------------------------------------------


def test_exact_reward() -> None:
    task = build_task("arithmetic", TOK)
    p = fixed_prompt("19")
    assert task.reward(p, traj(p, ids("19"))) == 1.0
    assert task.reward(p, traj(p, ids(" 19 "))) == 1.0  # stripped
    assert task.reward(p, traj(p, ids("18"))) == 0.0
    assert task.reward(p, traj(p, ids("190"))) == 0.0
    assert task.reward(p, traj(p, ids("19", eos=False))) == 0.0  # truncated, no EOS
    lenient = build_task({"name": "arithmetic", "reward_options": {"require_stop": False}}, TOK)
    assert lenient.reward(p, traj(p, ids("19", eos=False))) == 1.0


def test_partial_credit_rewards() -> None:
    prefix = build_task({"name": "arithmetic", "reward": "prefix"}, TOK)
    p = fixed_prompt("19")
    assert prefix.reward(p, traj(p, ids("18"))) == 0.5
    assert prefix.reward(p, traj(p, ids("1"))) == 0.5
    assert prefix.reward(p, traj(p, ids("1999"))) == 0.5  # 2 of max(2, 4) positions
    assert prefix.reward(p, traj(p, ids("18", eos=False))) == 0.0
    numeric = build_task({"name": "arithmetic", "reward": "numeric"}, TOK)
    q = fixed_prompt("-8")
    assert numeric.reward(q, traj(q, ids("it is -8."))) == 1.0
    assert numeric.reward(q, traj(q, ids("8"))) == 0.0
    assert numeric.reward(q, traj(q, ids("none"))) == 0.0


def test_shaped_reward_by_hand() -> None:
    task = build_task("copy_digits", TOK)
    p = fixed_prompt("372")
    r = lambda response: task.reward(p, traj(p, response))
    assert r(ids("372")) == 1.0
    # format 2/3, match 2/3, stop 2/3 -> 2/3
    assert r(ids("37")) == pytest.approx(2 / 3)
    # "3x9", truncated: format 2/3, match 1/3, stop 0 -> 0.25*2/3 + 0.5*1/3
    assert r(ids("3x9", eos=False)) == pytest.approx(1 / 3)
    # "3721": D = 4; format 3/4, match 3/4, stop 3/4
    assert r(ids("3721")) == pytest.approx(0.75)
    # wrong digits, right length: format 1 and stop 1 only
    assert r(ids("000")) == pytest.approx(0.5)
    assert r([EOS]) == 0.0
    # an id the tokenizer lacks (tiny models have 128) and a <pad> each hold a position
    # "\ufffd72": format 2/3, match 2/3 ("7", "2" in place), stop 1
    assert r([100, *ids("72")]) == pytest.approx(0.25 * 2 / 3 + 0.5 * 2 / 3 + 0.25 * 1)
    assert r([TOK.pad_token_id, *ids("37", eos=False)]) == pytest.approx(0.25 * 2 / 3)


def test_decode_cuts_at_first_eos_and_trusts_finish_reason() -> None:
    p = fixed_prompt("1")
    assert decode_response(TOK, traj(p, [*ids("12"), *ids("3")])) == ("12", True)
    assert decode_response(TOK, traj(p, ids("12", eos=False), "stop")) == ("12", True)
    assert decode_response(TOK, traj(p, ids("12", eos=False), "abort")) == ("12", False)
    assert decode_response(TOK, traj(p, [5, 120, 6], "length")) == ("1\ufffd2", False)


def test_reward_by_import_path_and_async() -> None:
    task = build_task({"name": "copy_digits", "reward": f"{__name__}.length_reward"}, TOK)
    p = fixed_prompt("12")
    assert task.reward(p, traj(p, ids("abc"))) == 3.0
    scaled = build_task(
        {"name": "copy_digits", "reward": f"{__name__}.async_reward", "reward_options": {"k": 2}},
        TOK,
    )
    out = scaled.reward(p, traj(p, ids("12")))
    assert asyncio.run(out) == 2.0


def length_reward(inp) -> float:
    return float(len(inp.text))


async def async_reward(inp, k: float = 1.0) -> float:
    return k * float(inp.text == inp.answer)


# ---- registry and escape hatch ----------------------------------------------------------


class EchoTask:
    """A user task: one prompt repeated, reward 1 for any stopped completion."""

    def __init__(self, tokenizer, word: str = "hi") -> None:
        self.word = word

    def prompts(self, start: int = 0):
        for i in itertools.count(start):
            yield Prompt(i, np.asarray([1], np.int32), answer=self.word)

    def reward(self, prompt: Prompt, traj: Trajectory) -> float:
        return float(traj.finish_reason == "stop")


def not_a_task(tokenizer) -> object:
    return object()


def test_registry_names_and_escape_hatch() -> None:
    assert {"arithmetic", "copy_digits", "jsonl"} <= set(TASKS.names())
    assert isinstance(build_task(TaskConfig(name="arithmetic"), TOK), Task)
    bare = build_task(TaskConfig(), TOK)  # the slot's default: copy_digits, its own reward
    assert isinstance(bare, CopyDigitsTask) and bare.reward_name == "shaped"
    user = build_task(
        CustomTaskConfig(_target_=f"{__name__}.EchoTask", options={"word": "yo"}), TOK
    )
    assert isinstance(user, EchoTask) and take(user, 1)[0].answer == "yo"
    via_map = build_task({"_target_": f"{__name__}.EchoTask"}, TOK)
    assert take(via_map, 2, start=5)[1].prompt_id == 6
    with pytest.raises(TypeError, match="is not a Task"):
        build_task({"_target_": f"{__name__}.not_a_task"}, TOK)
    with pytest.raises(ValueError, match="could not be imported"):
        build_task({"_target_": "nowhere.Task"}, TOK)


def test_bad_config_errors_name_the_key() -> None:
    cases = [
        ("nonsense", "unknown task 'nonsense'; known: arithmetic, copy_digits"),
        (ArithmeticTaskConfig(ops="+/"), r"task.ops='\+/'.*'/' is not one"),
        (ArithmeticTaskConfig(min_operand=5, max_operand=2), "task.max_operand=2 must be >= 5"),
        (ArithmeticTaskConfig(num_operands=1), "task.num_operands=1 must be >= 2"),
        (CopyDigitsTaskConfig(min_digits=0), "task.min_digits=0 must be >= 1"),
        (CopyDigitsTaskConfig(num_prompts=-1), "task.num_prompts=-1 must be >= 0"),
        (JsonlTaskConfig(), "task.path is empty"),
        (ArithmeticTaskConfig(reward="nope"), "unknown reward function 'nope'; known: .*exact"),
        ({"name": "copy_digits", "reward_options": {"wieght": 1}}, "not an option"),
        ({"name": "copy_digits", "reward_options": {"stop_weight": -1}}, "weights must be"),
        ({"name": "arithmetic", "max_digits": 3}, "task.max_digits is not an option"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            build_task(spec, TOK)
        with pytest.raises(ValueError, match=message):
            check_task_config(spec)  # the same words at start-up, without a tokenizer
    for good in (
        "copy_digits",
        {"name": "arithmetic", "reward": "prefix"},
        CustomTaskConfig(_target_=f"{__name__}.EchoTask"),
    ):
        check_task_config(good)
    with pytest.raises(ValueError, match="cannot be negative"):
        next(build_task("copy_digits", TOK).prompts(-1))


# ---- jsonl ------------------------------------------------------------------------------


def test_jsonl_task(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"q": f"what is {i}+1?", "a": str(i + 1), "id": i} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    cfg = JsonlTaskConfig(path=str(path), prompt_key="q", answer_key="a", shuffle=False)
    task = build_task(cfg, TOK)
    got = take(task, 6)
    assert [p.text for p in got] == [r["q"] for r in rows] + [rows[0]["q"], rows[1]["q"]]
    assert got[2].meta["record"]["id"] == 2
    assert task.reward(got[2], traj(got[2], ids("3"))) == 1.0
    assert task.reward(got[2], traj(got[2], ids("4"))) == 0.0
    capped = build_task(
        JsonlTaskConfig(path=str(path), prompt_key="q", answer_key="a", num_prompts=2), TOK
    )
    assert {p.meta["item"] for p in take(capped, 8)} == {0, 1}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a", "answer": 1}\n{"prompt": \n', r"data.jsonl:2: not valid JSON"),
        ('{"prompt": "a"}\n', r"data.jsonl:1: no field 'answer' \(fields: prompt\)"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"prompt": 3, "answer": 1}\n', "'prompt' must be a string"),
        ("\n\n", "holds no records"),
    ],
)
def test_jsonl_errors(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        build_task(JsonlTaskConfig(path=str(path)), TOK)


def test_jsonl_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a file"):
        build_task(JsonlTaskConfig(path=str(tmp_path / "none.jsonl")), TOK)


# ---- warm start -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["arithmetic", "copy_digits"])
def test_warm_start_targets_earn_full_reward(name: str) -> None:
    task = build_task(name, TOK)
    examples = warm_start_examples(task, 20, start=3)
    assert len(examples) == 20
    for p, (prompt_ids, target_ids) in zip(take(task, 20, start=3), examples):
        np.testing.assert_array_equal(prompt_ids, p.input_ids)
        assert target_ids.dtype == np.int32 and target_ids[-1] == EOS
        assert task.reward(p, traj(p, target_ids.tolist())) == 1.0
    with pytest.raises(TypeError, match="cannot give warm-start examples"):
        warm_start_examples(EchoTask(TOK), 1)


# ---- the learnable task's signal under a random policy ----------------------------------


@pytest.mark.parametrize("vocab", [len(TOK), 128])  # the tokenizer's and the tiny models'
def test_random_policy_gets_a_grpo_signal_on_copy_digits(vocab: int) -> None:
    """Uniform random responses of <= 8 tokens, groups of 16: the mean reward is > 0 and
    nearly every group has reward variance, so GRPO learns from step 0."""
    task = build_task("copy_digits", TOK)
    rng = np.random.default_rng(0)
    means, stds = [], []
    for p in take(task, 100):
        rewards = []
        for _ in range(16):
            resp = rng.integers(0, vocab, 8)
            hit = np.flatnonzero(resp == EOS)
            resp = resp[: hit[0] + 1] if hit.size else resp
            rewards.append(task.reward(p, traj(p, resp.tolist())))
        means.append(np.mean(rewards))
        stds.append(np.std(rewards))
    stds = np.asarray(stds)
    assert np.mean(means) > 0.005
    assert stds.mean() > 0.01
    assert (stds > 0).mean() > 0.8
    # the exact answer is (almost) never hit: that is why the reward is shaped
    assert np.max(means) < 0.5
