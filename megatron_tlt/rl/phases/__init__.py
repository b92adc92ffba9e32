"""The RL step's five phases, one module each, called in order by ``rl/trainer.py``:

  rollout.py      this rank's share of the prompts answered by its engine; the long tail's idle time
  reward.py       the responses scored, shared over the model-parallel group, advantages per group
  policy_pass.py  the log-prob pass (off-policy or with a reference), the optimizer steps, the engine's agreement
                  with the trainer; the drafter fed by ``drafter_feed.py``
  sync.py         the drafter's gate, then the new weights (and drafter) streamed into the engine
  report.py       every rank's report gathered into the step's summary record on rank 0

Each phase owns its timeline span and returns a small dataclass the next phases read. The drafter takes part
through the hooks of ``drafter/step_hooks.py``.
"""
