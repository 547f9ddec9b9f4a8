"""Runs one sandboxed program (a script, not imported by moerl; see sandbox.py).

    python -I harness.py LIMITS_JSON MODE

In the working directory: `solution.py` (the program), for MODE=tests also `tests.json`
(a list of Python statements, usually asserts). Before any of that code runs this process
caps its own memory, CPU time, file size and open files (resource.setrlimit) and installs
an audit hook that refuses sockets, new processes, ctypes, signals to other processes and
writes outside the working directory. Audit hooks cannot be removed from Python code.

MODE=tests: the program is executed once (as module `solution`), then each test in the
same namespace; one JSON line per test goes to `results.jsonl`: {"ok": true} or {"ok":
false, "error": "..."}; a program that fails to load writes {"load_error": "..."}.
MODE=run: the program runs as __main__ on this process's stdin and stdout.
"""

from __future__ import annotations

import json
import os
import resource
import sys

_BLOCKED = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "ctypes.",
    "pty.",
)


def limit(limits: dict) -> None:
    mem = int(limits["memory_mb"]) * 1024 * 1024
    cpu = int(limits["cpu_s"])
    out = int(limits["output_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def guard(workdir: str, protected: str) -> None:
    def hook(event: str, args: tuple) -> None:
        if event.startswith(_BLOCKED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writes = (mode and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writes and isinstance(path, (str, bytes)):
                full = os.path.realpath(os.fsdecode(path))
                if full == protected or not full.startswith(workdir + os.sep):
                    raise PermissionError(f"sandbox: writing {full} is not allowed")

    sys.addaudithook(hook)


def run_tests(results: object) -> None:
    with open("solution.py", encoding="utf-8") as f:
        code = f.read()
    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    write = results.write  # type: ignore[attr-defined]
    flush = results.flush  # type: ignore[attr-defined]
    namespace: dict = {"__name__": "solution"}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException as err:  # noqa: B036 (SystemExit and MemoryError included)
        write(json.dumps({"load_error": describe(err)}) + "\n")
        flush()
        return
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}", "exec"), namespace)
            line: dict[str, object] = {"ok": True}
        except BaseException as err:  # noqa: B036
            line = {"ok": False, "error": describe(err)}
        write(json.dumps(line) + "\n")
        flush()


def describe(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return text[:300]


def main() -> None:
    limits, mode = json.loads(sys.argv[1]), sys.argv[2]
    workdir = os.path.realpath(os.getcwd())
    protected = os.path.join(workdir, "results.jsonl")
    results = open(protected, "w", encoding="utf-8")  # noqa: SIM115 (open for the run)
    limit(limits)
    guard(workdir, protected)
    if mode == "tests":
        run_tests(results)
    else:
        import runpy

        runpy.run_path("solution.py", run_name="__main__")


if __name__ == "__main__":
    main()
