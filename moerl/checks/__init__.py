"""Check harnesses: whole-stack comparisons run by `tools/check_*.py` and `tests/dist`.

    parity.py      every TP/PP/EP/ETP/DP layout against the single process (check_parallel)
    conversion.py  HF → megatron-core → HF round trips in each layout (check_conversion)
    replay.py      engine rollouts scored by the trainer with routing replay and the
                   sampling mask on and off (check_replay)

They sit above the trainer, the engine and the converters they drive; nothing in the
core imports them.
"""
