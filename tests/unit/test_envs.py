"""The built-in environments (moerl.envs): calculator, guess_number and two_agent played
with hand-written actions, their rewards per role, and that every observation they can
produce tokenises on the tiny models' character tokenizer."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

from moerl.config.env import CalculatorEnvConfig, GuessNumberEnvConfig, TwoAgentEnvConfig
from moerl.envs import (
    POLICY_ROLE,
    Action,
    CalculatorEnv,
    Env,
    GuessNumberEnv,
    Observation,
    Step,
    TwoAgentEnv,
    secret_of,
)
from moerl.envs.scoring import answer_reward, first_int
from moerl.envs.tools import MAX_VALUE
from moerl.models.tokenizer import build_tiny_tokenizer
from moerl.tasks import Prompt, build_task

TOK = build_tiny_tokenizer()


def _prompt(text: str = "12+7*3=", answer: Any = "33", prompt_id: int = 0) -> Prompt:
    return Prompt(prompt_id=prompt_id, input_ids=np.zeros(1, np.int32), answer=answer, text=text)


def _act(text: str, role: str = POLICY_ROLE, turn: int = 0, finish: str = "stop") -> Action:
    return Action(role=role, text=text, token_ids=[], finish_reason=finish, turn=turn)


def _play(env: Env, *actions: Action) -> tuple[Observation, list[Step]]:
    """reset, then each action in order; every step before the last must not end it."""

    async def go() -> tuple[Observation, list[Step]]:
        first = await env.reset()
        steps = [await env.step(a) for a in actions]
        return first, steps

    first, steps = asyncio.run(go())
    for step in steps[:-1]:
        assert not step.done and step.observation is not None
    return first, steps


def _tokenises(obs: Observation | None) -> None:
    if obs is None:
        return
    for text in [obs.text, *obs.others.values()]:
        ids = TOK(text, add_special_tokens=False)["input_ids"]
        assert TOK.unk_token_id not in ids, f"{text!r} has characters the tiny tokenizer lacks"
        assert TOK.decode(ids) == text


# --- calculator -----------------------------------------------------------------


def test_calculator_tool_call_then_right_answer() -> None:
    cfg = CalculatorEnvConfig()
    first, steps = _play(
        CalculatorEnv(_prompt(), cfg),
        _act("call:calc(7*3)"),
        _act("call:calc(12+21)"),
        _act("answer: 33"),
    )
    assert first.text == "12+7*3=" and first.role == POLICY_ROLE
    assert [s.observation.text for s in steps[:2] if s.observation] == [
        "result: 21 ",
        "result: 33 ",
    ]
    assert [s.reward for s in steps[:2]] == [cfg.tool_credit, cfg.tool_credit]
    assert steps[0].info == {"tool_call": True}
    assert steps[-1].done and steps[-1].observation is None
    assert steps[-1].reward == 1.0 and steps[-1].info["correct"] is True


@pytest.mark.parametrize("text", ["33", " 33 ", "answer: 33", "answer:33"])
def test_calculator_answer_forms(text: str) -> None:
    _, [step] = _play(CalculatorEnv(_prompt(), CalculatorEnvConfig()), _act(text))
    assert step.done and step.reward == 1.0


def test_calculator_wrong_answer_earns_only_partial_credit() -> None:
    exact = CalculatorEnvConfig(partial_credit=0.0)
    _, [step] = _play(CalculatorEnv(_prompt(), exact), _act("answer: 34"))
    assert step.done and step.reward == 0.0 and step.info["correct"] is False
    shaped = CalculatorEnvConfig(partial_credit=0.5)
    _, [near] = _play(CalculatorEnv(_prompt(), shaped), _act("34"))
    _, [far] = _play(CalculatorEnv(_prompt(), shaped), _act("zz"))
    _, [cut] = _play(CalculatorEnv(_prompt(), shaped), _act("34", finish="length"))
    # shaped("34" vs "33"): format 2/2 * .25 + match 1/2 * .5 + stop 1 * .25 = .75, halved
    assert near.reward == pytest.approx(0.375)
    assert far.reward == pytest.approx(0.5 * 0.25)  # only stopping at the right length
    assert cut.reward == pytest.approx(0.5 * 0.5)  # no stop credit when truncated
    assert isinstance(near.reward, float) and near.reward < 1.0


@pytest.mark.parametrize(
    "text, reason",
    [
        ("call:calc(1+", "unbalanced parentheses"),
        ("call:", "no tool name after call:"),
        ("call:calc(1/2)", "unexpected operator / (division is not supported)"),
        ("call:calc(" + "9" * 30 + ")", "number too big"),
        ("call:search(cats)", "unknown tool search, use calc"),
        ("call:calc(\ufffd\u00e9)", "unexpected character"),  # never echoed back
    ],
)
def test_calculator_malformed_calls_are_observations(text: str, reason: str) -> None:
    _, [step] = _play(CalculatorEnv(_prompt(), CalculatorEnvConfig()), _act(text))
    assert not step.done and step.reward == 0.0
    assert step.observation is not None and step.observation.text == f"error: {reason} "
    assert step.info == {"tool_call": True, "tool_error": True}
    _tokenises(step.observation)


def test_calculator_calls_past_the_limit_are_errors() -> None:
    cfg = CalculatorEnvConfig(max_tool_calls=1, max_turns=4)
    _, steps = _play(
        CalculatorEnv(_prompt(), cfg), _act("call:calc(1)"), _act("call:calc(2)"), _act("33")
    )
    assert steps[0].info == {"tool_call": True}
    assert steps[1].observation is not None and "no tool calls left" in steps[1].observation.text
    assert steps[1].info["tool_error"] is True and steps[1].reward == 0.0
    assert steps[2].reward == 1.0


def test_calculator_computes_a_missing_answer() -> None:
    _, [step] = _play(
        CalculatorEnv(_prompt("2+3*4=", answer=None), CalculatorEnvConfig()), _act("14")
    )
    assert step.reward == 1.0
    with pytest.raises(ValueError, match="env=calculator: prompt 'hello' has no answer"):
        CalculatorEnv(_prompt("hello", answer=None), CalculatorEnvConfig())


def test_calculator_on_the_arithmetic_task() -> None:
    task = build_task({"name": "arithmetic", "ops": "+-*", "num_operands": 3}, TOK)
    for prompt in itertools.islice(task.prompts(0), 20):
        env = CalculatorEnv(prompt, CalculatorEnvConfig(preamble="use call:calc(...) "))
        expr = prompt.text.rstrip("=")
        first, steps = _play(env, _act(f"call:calc({expr})"))
        result = steps[0].observation
        assert result is not None and result.text == f"result: {prompt.answer} "
        assert first.text == "use call:calc(...) " + prompt.text
        _tokenises(first)
        _tokenises(result)


# --- guess_number ---------------------------------------------------------------


def test_guess_number_secret_is_deterministic_and_in_range() -> None:
    cfg = GuessNumberEnvConfig(lo=3, hi=9)
    secrets = [secret_of(i, cfg) for i in range(200)]
    assert secrets == [secret_of(i, cfg) for i in range(200)]
    assert set(secrets) == set(range(3, 10))  # every value reachable, none outside
    other_seed = [secret_of(i, GuessNumberEnvConfig(lo=3, hi=9, seed=1)) for i in range(200)]
    assert other_seed != secrets
    assert GuessNumberEnv(_prompt(prompt_id=7), cfg).secret == secret_of(7, cfg)


def _guess_env(cfg: GuessNumberEnvConfig, secret: int) -> GuessNumberEnv:
    pid = next(i for i in range(10_000) if secret_of(i, cfg) == secret)
    return GuessNumberEnv(_prompt(prompt_id=pid), cfg)


def test_guess_number_feedback_and_per_turn_rewards() -> None:
    cfg = GuessNumberEnvConfig(lo=1, hi=20, discount=0.9, closer_reward=0.1, max_turns=8)
    first, steps = _play(
        _guess_env(cfg, 13),
        _act("10"),  # closer than nothing: 0.1
        _act("i say 17"),  # further (4 > 3): 0
        _act("14 or 15"),  # closer (1): 0.1, first integer counts
        _act("99"),  # out of range: 0
        _act("guess 13"),  # right at turn 4: 0.9**4
    )
    assert first.text == "guess a number from 1 to 20: "
    feedback = [s.observation.text for s in steps[:-1] if s.observation]
    assert feedback == ["higher ", "lower ", "lower ", "lower "]
    assert [s.reward for s in steps[:-1]] == [0.1, 0.0, 0.1, 0.0]
    assert steps[-1].done and steps[-1].reward == pytest.approx(0.9**4)
    assert steps[-1].info["correct"] is True


def test_guess_number_without_a_number_is_a_tool_error() -> None:
    cfg = GuessNumberEnvConfig(max_turns=3)
    _, steps = _play(_guess_env(cfg, 5), _act("no idea"), _act("-3"))
    assert steps[0].observation is not None and steps[0].observation.text == "error: no number "
    assert steps[0].info["tool_error"] is True and steps[0].reward == 0.0
    assert steps[1].observation is not None and steps[1].observation.text == "higher "
    assert steps[1].reward == 0.0  # -3 is out of range: no closer credit


def test_guess_number_ends_unwon_after_max_turns() -> None:
    cfg = GuessNumberEnvConfig(max_turns=2)
    _, steps = _play(_guess_env(cfg, 5), _act("1"), _act("2"))
    assert steps[-1].done and steps[-1].observation is None
    assert steps[-1].info["correct"] is False and steps[-1].info["secret"] == 5
    assert steps[-1].reward == cfg.closer_reward  # the last guess was still closer


def test_first_int_caps_huge_numbers() -> None:
    assert first_int("a -12 b 3") == -12
    assert first_int("x") is None
    assert first_int("9" * 5000) == MAX_VALUE + 1  # int() would refuse 5000 digits
    assert first_int("-" + "9" * 5000) == -(MAX_VALUE + 1)


# --- two_agent ------------------------------------------------------------------


def test_two_agent_round_rewards_both_roles() -> None:
    cfg = TwoAgentEnvConfig(valid_reward=0.5, partial_credit=0.0)
    first, steps = _play(
        TwoAgentEnv(_prompt("12+7="), cfg),
        _act("31+4", role="proposer"),
        _act("35", role="solver", turn=1),
    )
    assert first.role == "proposer" and first.text == "propose a problem like 12+7: "
    to_solver = steps[0].observation
    assert to_solver is not None and to_solver.role == "solver" and to_solver.text == "solve: 31+4="
    assert steps[0].reward == {"proposer": 0.5} and steps[0].info["valid_proposal"] is True
    assert steps[1].done and steps[1].reward == {"proposer": 0.5, "solver": 1.0}


def test_two_agent_wrong_answer() -> None:
    cfg = TwoAgentEnvConfig(ops="+*", valid_reward=0.3, partial_credit=0.0)
    _, steps = _play(
        TwoAgentEnv(_prompt(), cfg), _act("6*7", role="proposer"), _act("41", role="solver")
    )
    assert steps[1].reward == {"proposer": 0.0, "solver": 0.0}
    assert steps[1].info["correct"] is False


@pytest.mark.parametrize("text", ["hello", "100+1", "3-2", "5+" + "9" * 5000, ""])
def test_two_agent_invalid_proposal_earns_zero_and_the_solver_gets_the_fallback(text: str) -> None:
    """Every role acts in every episode: the solver solves the fallback problem (1+1
    here, the prompt has no `+` example), the proposer gets neither reward."""
    cfg = TwoAgentEnvConfig(ops="+", max_operand=99)
    _, [step, answered] = _play(
        TwoAgentEnv(_prompt("5-9="), cfg), _act(text, role="proposer"), _act("2", role="solver")
    )
    assert not step.done and step.observation is not None
    assert step.observation.role == "solver" and step.observation.text == "solve: 1+1="
    assert step.reward == {"proposer": 0.0} and step.info["valid_proposal"] is False
    assert answered.done and answered.reward == {"proposer": 0.0, "solver": 1.0}


def test_two_agent_rounds_tell_both_streams() -> None:
    cfg = TwoAgentEnvConfig(rounds=2, max_turns=4, ops="+-", partial_credit=0.0)
    first, steps = _play(
        TwoAgentEnv(_prompt("5-9="), cfg),
        _act("2+2", role="proposer"),
        _act("answer: 5", role="solver"),
        _act("9-5", role="proposer"),
        _act("4", role="solver"),
    )
    assert first.text == "propose a problem like 5-9: "
    again = steps[1].observation
    assert again is not None and again.role == "proposer"
    assert again.text == "failed, propose a problem like 5-9: "
    assert again.others == {"solver": "wrong "}
    assert steps[1].reward == {"proposer": 0.0, "solver": 0.0}
    assert steps[3].done and steps[3].reward == {"proposer": 0.5, "solver": 1.0}
    for obs in [first, *(s.observation for s in steps)]:
        _tokenises(obs)


def test_two_agent_without_an_example() -> None:
    first, _ = _play(TwoAgentEnv(_prompt("372="), TwoAgentEnvConfig()))
    assert first.text == "propose a problem: "


def test_answer_reward_is_one_only_for_the_exact_answer() -> None:
    assert answer_reward("answer: 19", "19", True, 0.5) == 1.0
    assert answer_reward("19 ", "19", False, 0.5) == 1.0
    assert 0.0 < answer_reward("18", "19", True, 1.0) < 1.0
    assert answer_reward("18", "19", True, 0.0) == 0.0


# --- every observation tokenises ------------------------------------------------


def test_every_observation_tokenises_on_the_tiny_tokenizer() -> None:
    rng = np.random.default_rng(0)
    alphabet = list('0123456789+-*/=()., :?abcdefghijklmnopqrstuvwxyz{}[]"_') + ["\ufffd", "é"]
    fixed = ["call:calc(", "call:calc(1+2)", "call:x(", "call:calc(1/0)", "call:", "5+5", "7"]
    actions = fixed + ["".join(rng.choice(alphabet, int(rng.integers(0, 12)))) for _ in range(300)]
    envs: list[tuple[Any, str]] = [
        (
            lambda: CalculatorEnv(_prompt(), CalculatorEnvConfig(max_turns=50, max_tool_calls=2)),
            "policy",
        ),
        (lambda: GuessNumberEnv(_prompt(), GuessNumberEnvConfig(max_turns=1000)), "policy"),
    ]
    seen: set[str] = set()
    for make, role in envs:
        env = make()
        first, _ = _play(env)
        _tokenises(first)
        for text in actions:
            step = asyncio.run(env.step(_act(text, role=role)))
            if step.done:
                env = make()
                continue
            _tokenises(step.observation)
            assert step.observation is not None
            seen.add(step.observation.text.split(" ")[0])
    assert {"result:", "error:", "higher", "lower"} <= seen


# --- a random-init tiny model gets a signal --------------------------------------


def _random_actions(n: int, seed: int, role: str = POLICY_ROLE) -> list[Action]:
    """What a uniform sampler over the tiny models' 128 ids produces: up to 6 tokens, cut
    at the first EOS (then finish 'stop'), unshowable ids as U+FFFD (decode_marked)."""
    from moerl.tasks.rewards import decode_marked

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, 128, 6)
        eos = np.flatnonzero(ids == TOK.eos_token_id)
        body = ids[: eos[0]] if eos.size else ids
        finish = "stop" if eos.size else "length"
        out.append(_act(decode_marked(TOK, body), role=role, finish=finish))
    return out


def test_uniform_random_actions_earn_varied_rewards() -> None:
    # GRPO learns nothing from a group whose rewards are all equal: with the default
    # options the first turn of random-init sampling already scores > 0 and varies.
    make_envs: dict[str, Any] = {
        "calculator": lambda p: CalculatorEnv(p, CalculatorEnvConfig()),
        "guess_number": lambda p: GuessNumberEnv(p, GuessNumberEnvConfig()),
    }
    task = build_task({"name": "arithmetic"}, TOK)
    prompts = list(itertools.islice(task.prompts(0), 8))
    for name, make in make_envs.items():
        varied = 0
        for i, prompt in enumerate(prompts):
            rewards = []
            for action in _random_actions(16, seed=i):
                env = make(prompt)
                asyncio.run(env.reset())
                rewards.append(asyncio.run(env.step(action)).reward)
            varied += len(set(rewards)) > 1
            assert min(rewards) >= 0.0
        assert varied >= len(prompts) // 2, name
    solver_rewards = []
    for action in _random_actions(64, seed=99, role="solver"):
        env = TwoAgentEnv(_prompt(), TwoAgentEnvConfig())
        asyncio.run(env.reset())
        asyncio.run(env.step(_act("3+4", role="proposer")))
        reward = asyncio.run(env.step(action)).reward
        assert isinstance(reward, dict)
        solver_rewards.append(reward["solver"])
    assert len(set(solver_rewards)) > 1 and sum(solver_rewards) > 0
