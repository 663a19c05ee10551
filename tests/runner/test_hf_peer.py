"""Hugging Face transformers as a peer: random-weight Qwen3 / Qwen2 models saved with
``save_pretrained`` (safetensors) load as targets, and speccal's plain greedy tokens equal
``generate(do_sample=False)`` on CPU in float32. RoPE scaling matches transformers' own
``ROPE_INIT_FUNCTIONS``. (The installed transformers has no MiMo-7B class, only the MoE
``mimo_v2_flash``, so MiMo is covered by the synthetic checkpoints of test_draft_families.)
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from speccal.live.generate import generate  # noqa: E402
from speccal.runner.config import config_from_hf  # noqa: E402
from speccal.runner.engine import Engine, EngineConfig  # noqa: E402
from speccal.runner.rope import inv_freq_and_scale  # noqa: E402
from speccal.runner.sampling import SamplingParams  # noqa: E402

SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def _save(tmp_path, cls_name, cfg_cls, **extra):
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**SMALL, **extra)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # make logits decisive so float32 op-order noise cannot flip argmax
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "cls_name,cfg_cls,extra",
    [
        ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16, "tie_word_embeddings": False}),
        (
            "Qwen3ForCausalLM",
            "Qwen3Config",
            {
                "head_dim": 8,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": False}),
    ],
    ids=["qwen3", "qwen3-yarn-tied", "qwen2-bias"],
)
def test_plain_greedy_equals_transformers(tmp_path, cls_name, cfg_cls, extra):
    model = _save(tmp_path, cls_name, cfg_cls, **extra)
    eng = Engine(
        EngineConfig(
            model=str(tmp_path),
            speculative=False,
            request_buckets=(1, 2),
            block_size=4,
            prefill_chunk=8,
            max_model_len=128,
        )
    )
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8]]
    ours = generate(eng, prompts, SamplingParams(max_tokens=24, ignore_eos=True), 0)
    ref = [_hf_greedy(model, p, 24) for p in prompts]
    assert ours == ref
    assert len(set(ref[0] + ref[1])) > 3  # non-degenerate output


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "beta_slow": 2,
        },
        {"rope_type": "dynamic", "factor": 2.0},
    ],
    ids=lambda r: r["rope_type"] + ("-mscale" if "mscale" in r else ""),
)
def test_rope_scaling_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.Qwen3Config(
        **SMALL, head_dim=16, rope_parameters={"rope_theta": 50000.0, **rope}
    )
    ours_cfg = config_from_hf(hf_cfg.to_dict())
    seq_len = 1024  # dynamic: the static table is built for max_model_len = 1024 > 256
    ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](
        hf_cfg, torch.device("cpu"), seq_len=seq_len
    )
    ours, scale = inv_freq_and_scale(ours_cfg, max_model_len=seq_len)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-5, atol=1e-9)
    assert scale == pytest.approx(ref_scale)
