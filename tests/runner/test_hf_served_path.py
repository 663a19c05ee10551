"""The served path against Hugging Face transformers, end to end (CUDA).

Random-weight Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models are written by ``save_pretrained``,
then given a MiMo-layout MTP head (``model.mtp_layers.0.*`` tensors added to the safetensors
file, ``num_nextn_predict_layers: 1`` to config.json). On the CUDA default path (split graphs +
Triton kernels) in float32 the runner must emit exactly transformers' greedy ``generate``
tokens: plain decoding and speculative rounds at every K = 1..5, one request and a batch of
three of different lengths. (Before ``Precision.fp32_dot = "ieee"`` Triton's fp32 dots ran in
TF32 and the served path diverged at the 8th token.) bf16 is reported, not asserted token for
token: the first divergence from transformers' bf16 greedy and the fp32 logit margin there,
written to ``SPECCAL_REPORT_DIR/hf_served_bf16.json`` when that is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from speccal.live.generate import generate  # noqa: E402
from speccal.runner.engine import Engine, EngineConfig  # noqa: E402
from speccal.runner.path import served_path  # noqa: E402
from speccal.runner.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.cuda

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
FAMILIES = {
    "qwen2-bias": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),
}
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8],
           list(range(40, 71))]
NEW = 24


def _checkpoint(path: Path, family: str, dtype: torch.dtype = torch.float32):
    """Save a random-weight HF model with a MiMo MTP head added; return the HF model."""
    cls_name, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**SMALL, **extra)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # decisive logits: op-order noise in fp32 cannot flip an argmax
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    h = SMALL["hidden_size"]
    prefix = "model.mtp_layers.0."
    for key, t in list(weights.items()):
        if key.startswith("model.layers.0."):  # the MTP block's decoder layer, same shapes
            weights[prefix + key[len("model.layers.0."):]] = torch.randn(t.shape, generator=g) * (
                0.3 if t.dim() > 1 else 0.1) + (1.0 if key.endswith("norm.weight") else 0.0)
    weights |= {
        prefix + "token_layernorm.weight": torch.ones(h),
        prefix + "hidden_layernorm.weight": torch.ones(h),
        prefix + "input_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.3,
        prefix + "final_layernorm.weight": torch.ones(h),
    }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return model.to("cuda", dtype)


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    scores = torch.stack(out.scores, 0)[:, 0].float()  # [n, vocab]
    return out.sequences[0, len(prompt):].tolist(), scores


def _engine(path: Path, dtype: str, speculative: bool, buckets=(1, 4),
            prefill_chunk: int = 512) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cuda", dtype=dtype, draft_width=5,
                               request_buckets=buckets, max_model_len=256, block_size=16,
                               speculative=speculative, path=served_path("cuda"),
                               prefill_chunk=prefill_chunk))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fp32_case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = _checkpoint(path, request.param)
    want = [_hf_greedy(model, p, NEW)[0] for p in PROMPTS]
    assert all(len(set(w)) > 3 for w in want)  # not a degenerate decode
    return path, want


def test_fp32_plain_greedy_equals_transformers(fp32_case):
    path, want = fp32_case
    eng = _engine(path, "float32", speculative=False)
    assert eng.path.graph_mode == "split" and eng.path.attention_backend == "triton"
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    assert generate(eng, PROMPTS[:1], params, 0) == want[:1]
    assert generate(eng, PROMPTS, params, 0) == want


def test_fp32_chunked_prefill_equals_transformers(fp32_case):
    """Prompts prefilled in chunks of 8: every chunk after the first attends to the keys of the
    chunks before it under the lower-right causal mask (``attention.attend_own_keys``)."""
    path, want = fp32_case
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for speculative, k in ((False, 0), (True, 3)):
        eng = _engine(path, "float32", speculative=speculative, prefill_chunk=8)
        assert generate(eng, PROMPTS, params, k) == want


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_fp32_speculative_greedy_equals_transformers(fp32_case, k):
    path, want = fp32_case
    eng = _engine(path, "float32", speculative=True)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    assert generate(eng, PROMPTS[:1], params, k) == want[:1]
    assert generate(eng, PROMPTS, params, k) == want
    assert eng.stats.drafted_at.sum() > 0


def _first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_divergences_reported_with_their_margin(tmp_path, family):
    """bf16 served path vs transformers' bf16 greedy: K = 1 at batch 1 must match plain bf16
    greedy decoding of the runner itself (lossless verification); divergences from
    transformers are reported with transformers' fp32 top-2 logit margin at that step."""
    model = _checkpoint(tmp_path, family)
    ref32 = [_hf_greedy(model, p, NEW) for p in PROMPTS]
    model = model.to(torch.bfloat16)
    ref16 = [_hf_greedy(model, p, NEW)[0] for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    plain = generate(_engine(tmp_path, "bfloat16", False), PROMPTS, params, 0)
    spec = _engine(tmp_path, "bfloat16", True, buckets=(1,))
    assert generate(spec, PROMPTS[:1], params, 1) == plain[:1]
    report = []
    for i, (ours, theirs) in enumerate(zip(plain, ref16, strict=True)):
        at = _first_divergence(ours, theirs)
        margin = None
        if at is not None:  # transformers' fp32 top-2 gap at that step
            top2 = ref32[i][1][at].topk(2).values
            margin = float(top2[0] - top2[1])
        report.append({"prompt": i, "first_divergence": at, "fp32_margin": margin})
    out = os.environ.get("SPECCAL_REPORT_DIR")
    if out:
        Path(out, f"hf_served_bf16_{family}.json").write_text(json.dumps(report, indent=1))
    for row in report:  # every divergence at a near tie: far under the logits' scale
        if row["first_divergence"] is not None:
            assert row["fp32_margin"] < 0.05 * float(ref32[row["prompt"]][1].abs().max())
