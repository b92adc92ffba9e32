import pytest
import torch

from megatron_tlt.drafter.model import EagleDrafter, draft_step_masks, index_in_segment
from megatron_tlt.formats.architecture import architecture_from_dict
from tiny_models import TINY_LLAMA, TINY_QWEN2, next_token_fixture
from megatron_tlt.spec.eagle import DrafterMismatch, eagle_drafter_config, expected_drafter_shapes, validate_drafter

LLAMA = architecture_from_dict(TINY_LLAMA)
QWEN2 = architecture_from_dict(TINY_QWEN2)


def _one_sequence(num_tokens: int):
    return torch.arange(num_tokens), torch.zeros(num_tokens, dtype=torch.long)


@pytest.mark.parametrize("arch", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_state_dict_holds_exactly_the_vllm_drafter_tensors(arch):
    drafter = EagleDrafter(arch)
    state = drafter.state_dict()
    expected = expected_drafter_shapes(arch)
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    validate_drafter(arch, state)
    assert not any("embed" in name or "lm_head" in name or "input_layernorm" in name for name in state)
    assert ("layers.0.self_attn.q_proj.bias" in state) == arch.qkv_bias


def test_initial_drafter_copies_the_feature_half_of_fc_and_is_the_same_on_every_rank():
    h = LLAMA.hidden_size
    drafter = EagleDrafter(LLAMA)
    assert torch.equal(drafter.fc.weight[:, h:], torch.eye(h))
    assert drafter.fc.weight[:, :h].abs().max() > 0  # the token half is random, not zero
    other_rank = EagleDrafter(LLAMA)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), other_rank.state_dict().values()))


def test_good_drafter_drafts_the_targets_next_token_and_the_bad_one_does_not():
    fixture = next_token_fixture(LLAMA)
    embed, lm_head = fixture["target"]["model.embed_tokens.weight"], fixture["target"]["lm_head.weight"]
    tokens = torch.randint(0, LLAMA.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    features = torch.randn(60, LLAMA.hidden_size)  # a good drafter must not need them
    positions, segments = _one_sequence(60)
    policy_next = fixture["next_probs"][tokens].argmax(-1)
    for name, expected_agreement in (("good_drafter", 1.0), ("bad_drafter", None)):
        drafter = EagleDrafter.from_tensors(LLAMA, fixture[name])
        with torch.no_grad():
            drafted = (drafter(embed[tokens], features, positions, segments) @ lm_head.T).argmax(-1)
        agreement = (drafted == policy_next).float().mean().item()
        if expected_agreement is None:
            assert agreement < 0.2, "fc = [0, I] ignores the token: if it agrees, the fc input order is swapped"
        else:
            assert agreement == expected_agreement


def test_drafter_layer_matches_transformers_llama_attention_and_mlp():
    """Pins RoPE (theta and Llama-3 scaling), GQA and the residual layout against transformers' own Llama code."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as hf

    torch.manual_seed(0)
    drafter = EagleDrafter(LLAMA, seed=3)
    with torch.no_grad():
        for param in drafter.parameters():
            param.normal_(0.0, 0.3)  # large enough that attention is far from uniform
    config = LlamaConfig.from_dict(eagle_drafter_config(LLAMA))
    config._attn_implementation = "eager"
    attention, mlp = hf.LlamaAttention(config, layer_idx=0), hf.LlamaMLP(config)
    norm = hf.LlamaRMSNorm(LLAMA.hidden_size, eps=LLAMA.rms_norm_eps)
    layer_state = {k.removeprefix("layers.0."): v for k, v in drafter.state_dict().items() if k.startswith("layers.0.")}
    def part(prefix):
        return {k.removeprefix(prefix): v for k, v in layer_state.items() if k.startswith(prefix)}

    attention.load_state_dict(part("self_attn."))
    mlp.load_state_dict(part("mlp."))
    norm.load_state_dict({"weight": layer_state["post_attention_layernorm.weight"]})

    num_tokens = 40
    start = 100  # beyond original_max_position_embeddings (32): Llama-3 scaling matters
    embeds, features = torch.randn(num_tokens, LLAMA.hidden_size), torch.randn(num_tokens, LLAMA.hidden_size)
    positions = torch.arange(start, start + num_tokens)
    with torch.no_grad():
        ours = drafter(embeds, features, positions, torch.zeros(num_tokens, dtype=torch.long))
        x = drafter.fc(torch.cat([embeds, features], -1))[None]
        cos_sin = hf.LlamaRotaryEmbedding(config)(x, positions[None])
        causal = torch.full((num_tokens, num_tokens), float("-inf")).triu(1)[None, None]
        x = x + attention(x, position_embeddings=cos_sin, attention_mask=causal)[0]
        reference = x + mlp(norm(x))
    # Outputs reach ~80 here: float32 rounding alone (ours or transformers' against float64) is ~1e-3.
    torch.testing.assert_close(ours, reference[0], atol=2e-3, rtol=1e-4)


def test_the_first_draft_steps_mask_is_block_causal_and_never_crosses_a_segment():
    (mask,) = draft_step_masks(torch.tensor([0, 0, 1, 1, 1]), 1)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]]).bool()
    assert torch.equal(mask, expected)


def test_draft_step_masks_see_the_verified_prefix_and_the_chain_of_drafts_since():
    segments = torch.tensor([0, 0, 0, 1, 1])
    step1, step2, step3 = draft_step_masks(segments, 3)
    assert torch.equal(step1, draft_step_masks(segments, 1)[0])  # the masks do not depend on how deep one unrolls
    # Row 2 at step 2: step 1's rows 0 and 1 (the prefix), itself.
    assert step2.int()[2].tolist() == [1, 1, 0, 0, 0] + [0, 0, 1, 0, 0]
    step3 = step3.int()
    # Row 2 at step 3: step 1's row 0 (the prefix), step 2's row 1, itself; row 4 (segment 1): only itself
    # and step 2's row 3 (a chain from before its segment began is not there).
    assert step3[2].tolist() == [1, 0, 0, 0, 0] + [0, 1, 0, 0, 0] + [0, 0, 1, 0, 0]
    assert step3[4].tolist() == [0, 0, 0, 0, 0] + [0, 0, 0, 1, 0] + [0, 0, 0, 0, 1]
    assert index_in_segment(segments).tolist() == [0, 1, 2, 0, 1]


def _drafted_chain(drafter, embeds, features, k: int, last_verified: int):
    """What vLLM's drafter computes at draft step k after the target verified rows 0..last_verified of one
    sequence: one causal forward per step over the prefix and the drafts so far, each draft row reading the
    previous step's output as its feature (the reference ``unroll`` must equal)."""
    rows_embeds, rows_features = list(embeds[:last_verified + 1]), list(features[:last_verified + 1])
    for step in range(1, k + 1):
        n = len(rows_embeds)
        out = drafter(torch.stack(rows_embeds), torch.stack(rows_features), torch.arange(n),
                      torch.zeros(n, dtype=torch.long))[-1]
        if step < k:
            rows_embeds.append(embeds[last_verified + step])
            rows_features.append(out)
    return out


def test_unrolled_steps_compute_what_the_engine_drafts_at_each_depth():
    drafter = EagleDrafter(LLAMA, seed=3)
    with torch.no_grad():  # a drafter far from "copy the feature", so that the steps differ
        for param in drafter.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    drafter = drafter.to(torch.float64)  # its outputs grow large: compare the logic, not float32 rounding
    g = torch.Generator().manual_seed(0)
    lengths, h = [7, 5], LLAMA.hidden_size
    embeds = torch.randn(12, h, generator=g, dtype=torch.float64)
    features = torch.randn(12, h, generator=g, dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in lengths])
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    with torch.no_grad():
        predictions, valid = drafter.unroll(embeds, features, positions, segments, steps=3)
        torch.testing.assert_close(predictions[0], drafter(embeds, features, positions, segments))
        assert [v.int().tolist() for v in valid] == [[1] * 12, [0] + [1] * 6 + [0] + [1] * 4,
                                                     [0, 0] + [1] * 5 + [0, 0] + [1] * 3]
        for start, n in ((0, 7), (7, 5)):
            for k in (2, 3):
                for row in range(k - 1, n):
                    expected = _drafted_chain(drafter, embeds[start:start + n], features[start:start + n], k,
                                              row - (k - 1))
                    torch.testing.assert_close(predictions[k - 1][start + row], expected, atol=1e-9, rtol=1e-9)
    assert not torch.allclose(predictions[1][3], predictions[0][3])


def test_export_gives_detached_cpu_copies_that_round_trip():
    drafter = EagleDrafter(QWEN2, seed=1)
    exported = drafter.export_tensors()
    assert set(exported) == set(expected_drafter_shapes(QWEN2))
    assert all(t.device.type == "cpu" and not t.requires_grad for t in exported.values())
    exported["fc.weight"].zero_()  # a copy: the module does not change
    assert drafter.fc.weight.abs().max() > 0
    exported = drafter.export_tensors()
    reloaded = EagleDrafter.from_tensors(QWEN2, {**exported, "embed_tokens.weight": torch.zeros(250, 64)})
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), drafter.state_dict().values()))
    assert all(t.dtype == torch.bfloat16 for t in drafter.export_tensors(torch.bfloat16).values())


def test_loading_a_drafter_made_for_another_policy_is_refused():
    with pytest.raises(DrafterMismatch, match="missing tensors"):
        EagleDrafter(QWEN2).load_tensors(EagleDrafter(LLAMA).export_tensors())  # no q/k/v bias


def test_bfloat16_drafter_runs_and_keeps_float32_rope_frequencies():
    reference = EagleDrafter(LLAMA)
    drafter = EagleDrafter(LLAMA, dtype=torch.bfloat16)
    cast = EagleDrafter(LLAMA).to(torch.bfloat16)
    assert drafter.rope_inv_freq.dtype == cast.rope_inv_freq.dtype == torch.float32
    assert torch.equal(cast.rope_inv_freq, reference.rope_inv_freq)
    embeds, features = torch.randn(16, LLAMA.hidden_size), torch.randn(16, LLAMA.hidden_size)
    positions, segments = _one_sequence(16)
    out = drafter(embeds, features, positions, segments)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(embeds, features, positions, segments), atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        EagleDrafter(LLAMA, dtype=torch.float16)
