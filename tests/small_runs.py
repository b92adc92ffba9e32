"""The small `tlt train` variant the trainer tests run (tests/dist, tests/gpu): a 30-step warm-up, 4 prompts x 4
samples per step, the 4-layer shape of the tiny default before issue 18 (no checks) and TLT off, fast and well measured;
each test turns on what it tests. Importable as ``small_runs``: pytest puts tests/ on the path for its
conftest."""

TLT_OFF = ["drafter.depth=0", "drafter.spot_training=false"]  # the default has TLT on
SMALL = [
    "model.tiny.num_layers=4", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
    "model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=2", "model.tiny.max_position_embeddings=512",
    "data.max_solution_steps=20", "warmup.check_share=0",
    "trainer.micro_batch_size=4", *TLT_OFF,
    "drafter.cold_start.enabled=false", "drafter.lr=1e-3", "drafter.cold_start.lr=1e-3", "drafter.cold_start.eval_depth=2",
    "speculation.adaptive=false",
    "speculation.policy=bandit",  # a test that turns adaptive depth on tests TLT's BEG-MAB unless it says otherwise
    "warmup.steps=30", "warmup.corpus_size=1024", "data.synthetic_prompts=256", "data.held_out_prompts=16",
    "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=48",
    "trainer.eval_every=0",
]
