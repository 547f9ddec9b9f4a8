"""The RL objective's swappable pieces: small pure torch functions on flat token tensors,
registered by name and selected from config, with `_target_` for user code
(docs/architecture.md, "The off-policy objective" and "Extension points").

    advantages.py         ADVANTAGES: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline
    losses.py             POLICY_LOSSES: ppo_clip (clip-higher, dual clip, decoupled), gspo,
                          cispo, reinforce, sapo, gmpo
    correction.py         CORRECTIONS: none, tis, mis, icepop, topr, version_gap, opsm
    kl.py                 k1/k2/k3 KL estimators and the optional KL term
    reduce.py             per-sequence reductions and the loss aggregation modes
    replay.py             REPLAY_POLICIES: all, recent, none (routing replay)
    config.py             options of advantages, losses, KL; AlgoConfig (group `algo`)
    correction_config.py  options of the corrections (group `correction`)
    check.py              check_algo_config: build every slot once at start-up

The Registry itself (how a config becomes a callable) is moerl.common.registry.

Importing this package imports nothing heavy: `moerl.config` reads the torch-free config
modules; import the torch modules themselves where they run.
"""
