"""The process that runs math-verify for the `math` reward (run as a script, not imported
by moerl).

math-verify bounds parsing and comparison with signal.alarm, which only works in a
process's main thread; rewards run in the orchestrator's worker threads. So each check is
sent here, where the loop runs in the main thread and math-verify's own timeouts work. A
check stuck in C code (sympy multiplying a huge integer) ignores the alarm; the caller
then kills this process (moerl/tasks/verifiers/math_answer.py).

Protocol, one JSON object per line: stdin {"gold": str, "pred": str, "timeout": int};
stdout {"ok": bool, "reason": str} (reason empty when ok). The first line written is
{"ready": true}, once math-verify is imported.
"""

from __future__ import annotations

import json
import logging
import sys


def check(gold: str, pred: str, timeout: int) -> tuple[bool, str]:
    """(equivalent, why not) of a reference answer and an extracted prediction."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = parse(gold, parsing_timeout=timeout, raise_on_error=True)
        if not gold_parsed:
            return False, f"the answer {gold[:80]!r} does not parse"
        pred_parsed = parse(pred, parsing_timeout=timeout, raise_on_error=True)
        if not pred_parsed:
            return False, "no answer found in the completion"
        # raise_on_error=False: one incomparable pair of candidates must not hide a match
        ok = verify(gold_parsed, pred_parsed, timeout_seconds=timeout)
    except TimeoutException:
        return False, f"math-verify timed out ({timeout}s)"
    except Exception as err:  # a verifier error scores 0, it does not stop the worker
        return False, f"math-verify failed: {type(err).__name__}: {err}"[:200]
    return bool(ok), "" if ok else "not equivalent"


def main() -> None:
    logging.disable(logging.WARNING)  # math-verify logs every parse failure
    import math_verify  # noqa: F401  (import cost paid before the first check)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ok, reason = check(req["gold"], req["pred"], int(req["timeout"]))
        print(json.dumps({"ok": ok, "reason": reason}), flush=True)


if __name__ == "__main__":
    main()
