"""The commands layer: what ``tlt`` runs, on top of the components.

``start.py`` is the parent process of every command that launches ranks (config, run directory, cached
artifacts, launch; no Megatron or vLLM imports); ``train.py``, ``warmup_drafter.py`` and
``bench_rollout.py`` are what each rank then runs. Layers, top to bottom: ``cli`` -> ``commands`` ->
``rl`` -> ``drafter`` -> ``spec`` -> the shared modules of ``megatron_tlt/``; a module imports only
from its own layer or the ones below (``tests/unit/test_layering.py``).
"""
