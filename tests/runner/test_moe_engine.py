"""Routed mixture-of-experts targets (issue 37), CPU fp32, against transformers.

Random-weight checkpoints written by ``save_pretrained`` (3 layers, hidden 40, odd widths):
Qwen3-MoE (softmax top-k, renormalised, a dense first layer by ``mlp_only_layers``), Qwen2-MoE
(q/k/v bias, not renormalised, a shared expert scaled by its sigmoid gate), GLM-4.5
MoE (the DeepSeek-V3 router: sigmoid scores, a random ``e_score_correction_bias`` for the
selection, 2 groups of which 1 is kept, ``routed_scaling_factor`` 2.5, a shared expert,
``first_k_dense_replace``; GQA with q/k norm (``use_qk_norm``), q/k/v bias, half rotary) and
MiMo-V2-Flash in its full-attention form, as transformers writes it (its unused
``sliding_window`` included; ungrouped sigmoid routing, no shared expert, ``mlp_layer_types``,
``attention_value_scale``, per-layer-type RoPE, a third of the head rotated; the sliding layers
and the MTP head: test_mimo_v2_engine). GLM-4.5 gets an MTP layer in the DeepSeek-V3 layout (``model.layers.3.{enorm, hnorm,
eh_proj, shared_head.*, embed_tokens}`` plus a routed decoder layer named like layer 2's);
Qwen3.5-MoE (hybrid engine) an ``mtp.*`` head whose layer is routed like layer 3. Every token
comparison is exact: plain and speculative greedy emit transformers' greedy tokens; the mixed
batch (three requests in the bucket of four, one stopping at a stop token) runs with the oracle
draft of ``test_hybrid_engine`` so every accepted length 0..k happens for k = 1..3.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speccal.base.errors import InputError, UnsupportedError
from speccal.kernels import ops
from speccal.kernels.config import KernelConfig
from speccal.runner.config import ModelConfig, config_from_hf
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.moe import RoutedMoE, route
from speccal.runner.moe_config import MoEConfig
from speccal.runner.path import bind_path
from speccal.runner.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm4MoeForCausalLM"):
    pytest.skip("transformers without GLM-4.5 MoE (needs >= 5)", allow_module_level=True)

from tests.runner.engine_checks import (  # noqa: E402
    assert_no_host_read,
    greedy_refs,
    oracle_run,
    scheduled_accepts,
    served_shape_run,
    stop_case,
    target_rows_without_host_read,
)
from tests.runner.engine_checks import run_requests as _run  # noqa: E402
from tests.runner.test_hybrid_engine import torch_linear_attention  # noqa: E402

V = 96  # the oracle draft's wrong tokens are (t + 1) % 96
BASE = dict(vocab_size=V, hidden_size=40, intermediate_size=44, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=20,
            tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        head_dim=12, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_experts=5, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
        shared_expert_intermediate_size=28)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=1)),
    "mimo_v2_flash": ("MiMoV2FlashForCausalLM", "MiMoV2FlashConfig", dict(
        head_dim=24, v_head_dim=24, n_routed_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False, layer_types=["full_attention"] * 3,
        mlp_layer_types=["dense", "sparse", "sparse"], attention_value_scale=0.6)),
}
PROMPTS = ([5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14], [7, 1, 62, 30],
           [44, 12, 90, 23, 8, 66, 19, 51, 3, 77, 28, 35, 10])
MAX_TOKENS = (12, 8, 10)
W = 3


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights away from their init, large enough that logits and expert choices are decisive
    (fp32 op-order noise cannot flip an argmax or a top-k); norms near 1; the routers' score
    bias random too (a buffer, so set here)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                scale = 1.0 if name.endswith("gate.weight") else 0.35
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def _add_deepseek_mtp(folder, num_layers: int) -> None:
    """The DeepSeek-V3-layout MTP layer at ``model.layers.{num_layers}``: the fusion block, its
    own head / embedding / final norm, and a decoder layer shaped like the last (routed) one."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(3)
    h, last, mtp = BASE["hidden_size"], f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    shapes = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
              "shared_head.norm.weight": (h,), "shared_head.head.weight": (V, h),
              "embed_tokens.weight": (V, h)}
    for key, t in tensors.items():
        if key.startswith(last):
            shapes[key.removeprefix(last)] = tuple(t.shape)
    for stem, shape in shapes.items():
        t = torch.randn(shape, generator=g) * (0.2 if len(shape) == 1 else 0.35)
        tensors[mtp + stem] = t + (1.0 if len(shape) == 1 and "bias" not in stem else 0.0)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _hf_refs(hf) -> list[list[int]]:
    refs = greedy_refs(hf, PROMPTS, MAX_TOKENS)
    assert len({t for r in refs for t in r}) > 6  # not degenerate
    return refs


def write_family(folder, name: str):
    cls, cfg_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**BASE, **extra)).eval()
    _randomise(hf, 1)
    hf.save_pretrained(folder)
    if name == "glm4_moe":
        _add_deepseek_mtp(folder, BASE["num_hidden_layers"])
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe") / request.param
    hf = write_family(folder, request.param)
    return request.param, folder, _hf_refs(hf)


def _engine(folder, **kw) -> Engine:
    cfg = dict(model=str(folder), draft_width=W, request_buckets=(1, 2, 4), max_model_len=64,
               block_size=4, prefill_chunk=8, acceptance="greedy")
    return Engine(EngineConfig.flat(**{**cfg, **kw}))


def _stop_case(refs):
    return stop_case(refs, MAX_TOKENS, 5)



def _moe_layers(module) -> list[RoutedMoE]:
    return [m for m in module.modules() if isinstance(m, RoutedMoE)]


def _check_oracle_rounds(eng, refs, params, want, k):
    got, results, oracle = oracle_run(eng, PROMPTS, refs, params, k, V)
    assert got == want, (k, "mixed batch")
    ms = scheduled_accepts(results, oracle, k)
    assert set(ms) == set(range(k + 1)), (k, ms)


def test_plain_greedy_equals_transformers(family):
    """Plain greedy, the mixed batch with a stop token; the engine reports the distinct experts
    each MoE layer activated (between top_k and every expert)."""
    name, folder, refs = family
    eng = _engine(folder, speculative=False)
    moe = _moe_layers(eng.loaded.target)
    assert len(moe) == 2 and eng.loaded.draft is None  # layer 0 is dense in every family
    params, want = _stop_case(refs)
    got, _ = _run(eng, PROMPTS, params, 0)
    assert got == want, name
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.prefill_pending()
    eng.take_activated_experts()  # drop the prefill's
    eng.step(RoundPlan(0))
    counts = eng.take_activated_experts()["target"]
    top_k = moe[0].moe.top_k
    assert len(counts) == 2 and all(c == top_k for c in counts)  # one row: its top_k experts
    assert eng.take_activated_experts()["target"] == [0, 0]  # reset by the read


def test_speculative_greedy_equals_transformers_every_accepted_length(family):
    """GLM-4.5 MoE with its DeepSeek-layout MTP layer (itself routed): K = 1..3, batch 1 with
    the head's drafts, then the oracle's mixed batch. The Qwen MoE families and this
    MiMo-V2-Flash checkpoint publish no head (MiMo-V2-Flash's sliding layers and its
    ``model.mtp.layers.N`` head: test_mimo_v2_engine)."""
    name, folder, refs = family
    if name in ("qwen3_moe", "qwen2_moe", "mimo_v2_flash"):
        with pytest.raises(UnsupportedError, match="no MTP head"):
            _engine(folder)
        return
    eng = _engine(folder)
    assert eng.loaded.family.name == "deepseek_mtp"
    assert len(_moe_layers(eng.loaded.draft)) == 1  # the head's layer is routed
    assert eng.loaded.draft.layer.mlp.moe.has_score_bias
    params, want = _stop_case(refs)
    for k in range(1, W + 1):
        got, _ = _run(eng, PROMPTS[:1], [SamplingParams(max_tokens=MAX_TOKENS[0],
                                                        ignore_eos=True)], k)
        assert got == [refs[0]], (k, "batch 1")
        _check_oracle_rounds(eng, refs, params, want, k)


@pytest.mark.parametrize("family", ["glm4_moe"], indirect=True)  # the family with a head
def test_served_round_shape_equals_transformers(family):
    """The served path's round shape on the CPU: the pipelined loop (queue depth 1) with the
    device-side verify input update (packed rows, the reference kernels) and routed layers in
    the target and the head: the head's own drafts at batch 1 and on the mixed batch with a
    stop, tokens equal transformers' (``engine_checks.served_shape_run``)."""
    _, folder, refs = family
    eng = _engine(folder, input_update="in_graph", pipeline=True)
    served_shape_run(eng, PROMPTS, refs, MAX_TOKENS, *_stop_case(refs), W)


def test_stacked_expert_layout_loads_the_same_model(family, tmp_path):
    """The same weights with each layer's experts stacked as transformers holds them
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) decode the same
    tokens; a stacked tensor of another shape is not read as experts (they are refused as
    missing, by name)."""
    name, folder, refs = family
    tensors = load_file(str(folder / "model.safetensors"))
    stacked, experts = {}, {}
    for key, t in tensors.items():
        if ".mlp.experts." in key:
            pre, rest = key.split(".mlp.experts.")
            e, stem = rest.split(".", 1)
            experts.setdefault(pre, {}).setdefault(int(e), {})[stem] = t
        else:
            stacked[key] = t
    assert experts
    for pre, by_e in experts.items():
        order = sorted(by_e)
        stacked[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_e[e]["gate_proj.weight"], by_e[e]["up_proj.weight"]]) for e in order])
        stacked[f"{pre}.mlp.experts.down_proj"] = torch.stack(
            [by_e[e]["down_proj.weight"] for e in order])
    save_file(stacked, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    eng = _engine(tmp_path, speculative=False)
    got, _ = _run(eng, PROMPTS[:2], [SamplingParams(max_tokens=n, ignore_eos=True)
                                     for n in MAX_TOKENS[:2]], 0)
    assert got == refs[:2]
    stacked["model.layers.1.mlp.experts.down_proj"] = torch.zeros(3, 5)  # not [E, H, I]
    save_file(stacked, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"model\.layers\.1\.mlp\.experts\.0\.down_proj\."
                                         r"weight: got 'missing'"):
        _engine(tmp_path, speculative=False)


# ------------------------------------------------------------------ Qwen3.5-MoE (hybrid engine)

QWEN35_MOE = dict(vocab_size=V, hidden_size=40, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
                  moe_intermediate_size=20, shared_expert_intermediate_size=28,
                  tie_word_embeddings=False, mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory):
    """A ``qwen3_5_moe_text`` checkpoint (no ``intermediate_size``: every MLP routed) plus an
    ``mtp.*`` head whose layer is routed like the target's full-attention layer 3."""
    folder = tmp_path_factory.mktemp("qwen35moe")
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**QWEN35_MOE))
    hf.eval()
    _randomise(hf, 1)
    hf.save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(2)
    h = QWEN35_MOE["hidden_size"]
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * 0.35}
    for stem in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        mtp[f"mtp.{stem}.weight"] = torch.randn(h, generator=g) * 0.2
    for key, t in tensors.items():
        if key.startswith("model.layers.3."):
            mtp[key.replace("model.layers.3.", "mtp.layers.0.")] = (
                torch.randn(t.shape, generator=g) * (0.2 if t.dim() == 1 else 0.35))
    tensors.update(mtp)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with torch_linear_attention("qwen3_5_moe"):
        refs = _hf_refs(hf)
    return folder, refs


def test_qwen3_5_moe_plain_and_speculative_equal_transformers(qwen35_moe):
    folder, refs = qwen35_moe
    cfg = json.loads((folder / "config.json").read_text())
    assert "intermediate_size" not in cfg and cfg["model_type"] == "qwen3_5_moe_text"
    params, want = _stop_case(refs)
    plain = _engine(folder, speculative=False)
    got, _ = _run(plain, PROMPTS, params, 0)
    assert got == want
    eng = _engine(folder)
    assert eng.loaded.family.name == "qwen3_5_mtp"
    head_moe = _moe_layers(eng.loaded.draft)
    assert len(head_moe) == 1 and head_moe[0].moe.is_shared_gated
    for k in (1, 3):
        got, _ = _run(eng, PROMPTS[:1], [SamplingParams(max_tokens=MAX_TOKENS[0],
                                                        ignore_eos=True)], k)
        assert got == [refs[0]], (k, "batch 1")
        _check_oracle_rounds(eng, refs, params, want, k)


# ------------------------------------------------------------------------------- the router


def test_router_selects_and_weights_as_transformers():
    """:func:`route` against transformers' own routers on the same weights and rows: the
    DeepSeek-V3 / GLM router (groups, score bias, scaling, renormalised) and the Qwen3-MoE
    router; same experts per row, weights within fp32 noise."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 40, generator=g)
    glm = transformers.Glm4MoeConfig(hidden_size=40, n_routed_experts=12, num_experts_per_tok=3,
                                     n_group=4, topk_group=2, routed_scaling_factor=2.5)
    qwen = transformers.Qwen3MoeConfig(hidden_size=40, num_experts=7, num_experts_per_tok=2,
                                       norm_topk_prob=True)
    for hf_cls, hf_cfg, moe in (
        (Glm4MoeTopkRouter, glm, MoEConfig(num_experts=12, top_k=3, expert_intermediate_size=4,
                                           scoring="sigmoid", num_groups=4, topk_groups=2,
                                           has_score_bias=True, routed_scaling_factor=2.5,
                                           is_topk_normalised=True)),
        (Qwen3MoeTopKRouter, qwen, MoEConfig(num_experts=7, top_k=2, expert_intermediate_size=4,
                                             is_topk_normalised=True)),
    ):
        ref = hf_cls(hf_cfg)
        ref.weight.data = torch.randn(ref.weight.shape, generator=g)
        ours = RoutedMoE(40, moe).gate
        ours.weight.data = ref.weight.data.clone()
        if moe.has_score_bias:
            ref.e_score_correction_bias.copy_(torch.randn(12, generator=g) * 0.3)
            ours.e_score_correction_bias.data = ref.e_score_correction_bias.clone()
        _, want_w, want_ids = ref(x)
        got_w, got_ids = route(x, ours, moe)
        want_sorted, order = want_ids.sort(dim=-1)
        got_sorted, got_order = got_ids.sort(dim=-1)
        assert torch.equal(got_sorted, want_sorted)
        torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, order),
                                   rtol=1e-6, atol=1e-6)
    # the bias changes which experts are chosen, never their weights' source (unbiased scores)
    moe = dataclasses.replace(glm_moe := MoEConfig(num_experts=12, top_k=3,
                                                   expert_intermediate_size=4, scoring="sigmoid",
                                                   has_score_bias=True), is_topk_normalised=False)
    router = RoutedMoE(40, glm_moe).gate
    router.weight.data = torch.randn(12, 40, generator=g)
    router.e_score_correction_bias.data = torch.zeros(12)
    router.e_score_correction_bias.data[5] = 10.0  # expert 5 always selected
    w, ids = route(x, router, moe)
    assert (ids == 5).any(dim=-1).all()
    scores = torch.sigmoid(x @ router.weight.T)
    torch.testing.assert_close(w, scores.gather(1, ids))


def test_routed_forward_makes_no_host_read():
    """The routed layer (router, expert layout, experts, slot sum, activated-expert masks) under
    the fake-tensor mode (``engine_checks.assert_no_host_read``): no host read and no
    value-dependent shape, so it can be captured; the per-expert loop it replaced (a
    ``bincount`` and one read of its counts) raised there. Its output is the experts' sum."""
    moe = MoEConfig(num_experts=8, top_k=3, expert_intermediate_size=12, scoring="sigmoid",
                    has_score_bias=True, num_groups=2, topk_groups=1, is_topk_normalised=True,
                    routed_scaling_factor=2.5, shared_intermediate_size=8,
                    shared_form="shared_experts")
    torch.manual_seed(3)
    layer = RoutedMoE(20, moe)
    # the capture-safe ops (on a CPU, backend "auto" reads the expert counts on the host)
    bind_path(layer, layer.path.with_(kernels=KernelConfig(backend="reference")))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        x = torch.randn(5, 20)
        got = assert_no_host_read(layer, x)
        weights, ids = route(x, layer.gate, moe)
        want = layer.shared_experts(x) + sum(
            weights[:, j, None] * torch.stack([layer.experts[int(e)](x[n:n + 1])[0]
                                               for n, e in enumerate(ids[:, j])])
            for j in range(3))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert layer.take_activated().sum() == len(set(ids.reshape(-1).tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_expert_loop_equals_the_capture_safe_reference(dtype):
    """On a CPU, ``backend="auto"`` gathers each active expert's rows after one host read; its
    counts equal the static-layout reference's and its output too, within fp32 rounding (the
    same sums in the same order, but matrix products of other shapes: the CPU's BLAS may pick
    kernels that round the last bit differently, as it does on AVX-512 hosts)."""
    g = torch.Generator().manual_seed(5)
    n, hidden, inter, experts, k = 13, 24, 10, 9, 3
    x = torch.randn(n, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.3).to(dtype)
    got, counts = ops.fused_moe(x, weights, ids, gate_up, down)
    want, want_counts = ops.fused_moe(x, weights, ids, gate_up, down, backend="reference")
    assert torch.equal(counts, want_counts)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_masked_rows_route_to_no_expert_on_the_cpu(backend):
    """``ops.fused_moe(row_mask=...)`` on the CPU paths (the expert loop and the static
    layout): masked rows give zero rows and no counts, the others an unmasked call's values."""
    g = torch.Generator().manual_seed(9)
    n, hidden, inter, experts, k = 11, 24, 10, 7, 2
    x = torch.randn(n, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(experts, hidden, inter, generator=g) * 0.3
    mask = torch.rand(n, generator=g) > 0.4
    got, counts = ops.fused_moe(x, weights, ids, gate_up, down, row_mask=mask, backend=backend)
    want, _ = ops.fused_moe(x[mask], weights[mask], ids[mask], gate_up, down, backend=backend)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    torch.testing.assert_close(got[mask], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, torch.bincount(ids[mask].reshape(-1), minlength=experts))


def test_target_forward_makes_no_host_read(family):
    """Each family's whole target forward on packed verify rows (GQA, the MiMo sliding layers
    with sinks, routed layers) makes no host read (``engine_checks``)."""
    _, folder, _ = family
    eng = _engine(folder, speculative=False)
    target_rows_without_host_read(eng.loaded.target, eng.loaded.config)


def test_routed_layers_run_the_per_op_path_when_the_fused_path_is_on(fused_on_cpu):
    """Under the Triton path (simulated on CPU: every op its reference) a routed layer is not
    fused (``can_fuse`` False: the fused layer has no expert kernel) and the model runs the
    per-op path, computing what the torch path does; a dense layer of the same model fuses."""
    from speccal.runner.model import TargetModel
    from speccal.runner.path import bind_path
    from tests.runner.test_fused_layer import _packed_meta

    moe = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=24, scoring="sigmoid",
                    has_score_bias=True, shared_intermediate_size=24,
                    shared_form="shared_experts", is_topk_normalised=True, sparse_layers=(1,))
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe=moe)
    torch.manual_seed(8)
    model = TargetModel(cfg, 512, 512)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    meta, pos, nb = _packed_meta(ctx=[5, 11], rows=[3, 1])
    gen = torch.Generator().manual_seed(2)
    shape = (nb, 4, 2, 16)
    kv0 = [[torch.randn(shape, generator=gen) for _ in range(2)] for _ in range(2)]
    ids = torch.randint(0, 64, pos.shape, generator=gen)
    with torch.no_grad():
        want = model(ids, pos, meta, [tuple(t.clone() for t in kv) for kv in kv0])
        model.fuse_weights()
        bind_path(model, fused_on_cpu())
        dense, routed = model.model.layers
        assert dense.can_fuse(ids, model.rotary) and not routed.can_fuse(ids, model.rotary)
        got = model(ids, pos, meta, [tuple(t.clone() for t in kv) for kv in kv0])
    real = slice(0, int(meta.cu_q_lens[-1]))
    torch.testing.assert_close(got[real], want[real], rtol=2e-4, atol=2e-4)


# ---------------------------------------------------------------------------------- refusals

GLM_CFG = dict(BASE, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
               n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               norm_topk_prob=True, first_k_dense_replace=1, hidden_act="silu")


@pytest.mark.parametrize("change,error,match", [
    ({"topk_method": "group_limited_greedy"}, UnsupportedError,
     r"config\.json:topk_method='group_limited_greedy'.*implemented for \['greedy', 'noaux_tc'\]"),
    ({"scoring_func": "tanh"}, UnsupportedError, r"config\.json:scoring_func='tanh'"),
    ({"scoring_func": "softmax"}, UnsupportedError, r"config\.json:n_group=2 with softmax"),
    ({"topk_method": "noaux_tc", "scoring_func": "softmax"}, UnsupportedError,
     r"topk_method='noaux_tc' with scoring_func='softmax'"),
    ({"moe_layer_freq": 2}, UnsupportedError, r"config\.json:moe_layer_freq=2"),
    ({"n_group": 3}, InputError, r"config\.json:n_group.*a divisor"),
    ({"topk_group": 3}, InputError, r"config\.json:topk_group.*at most n_group=2"),
    ({"norm_topk_prob": None}, InputError, r"config\.json:norm_topk_prob.*not guessed"),
    ({"shared_expert_intermediate_size": 8, "n_shared_experts": 1}, UnsupportedError,
     r"two shared-expert forms"),
    ({"mlp_only_layers": [1], "decoder_sparse_step": 1}, UnsupportedError,
     r"dense-layer keys.*first_k_dense_replace"),
    ({"first_k_dense_replace": 1, "intermediate_size": None}, InputError,
     r"config\.json:intermediate_size.*layers \[0\]"),
    ({"v_head_dim": 8, "head_dim": 10}, UnsupportedError, r"config\.json:v_head_dim=8"),
    ({"use_qk_norm": True}, UnsupportedError, r"config\.json:use_qk_norm=True.*L2"),
])
def test_routing_features_not_implemented_are_refused_by_name(change, error, match):
    cfg = {k: v for k, v in {**GLM_CFG, **change}.items() if v is not None}
    with pytest.raises(error, match=match):
        config_from_hf(cfg)


def test_routing_keys_read_into_the_config():
    moe = config_from_hf({**GLM_CFG, "routed_scaling_factor": 2.5, "n_shared_experts": 2,
                          "scoring_func": "sigmoid", "topk_method": "noaux_tc"}).moe
    assert (moe.scoring, moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) == (
        "sigmoid", 2, 1, 2.5)
    assert moe.has_score_bias and moe.sparse_layers == (1, 2)
    assert (moe.shared_form, moe.shared_intermediate_size, moe.is_shared_gated) == (
        "shared_experts", 40, False)
    qwen = config_from_hf({**BASE, "num_local_experts": 4, "num_experts_per_tok": 2,
                           "norm_topk_prob": False, "decoder_sparse_step": 2,
                           "shared_expert_intermediate_size": 8}).moe
    assert (qwen.scoring, qwen.has_score_bias, qwen.sparse_layers) == ("softmax", False, (1,))
    assert qwen.is_shared_gated and qwen.shared_form == "shared_expert"


def test_attention_sinks_outside_a_sliding_family_are_refused_by_tensor_name(family):
    """Sink logits are served where the model_type's class places them (MiMo-V2-Flash's sliding
    layers: test_mimo_v2_engine); in another model_type's checkpoint they are refused naming
    the tensor, not computed without."""
    name, folder, _ = family
    if name == "mimo_v2_flash":
        return
    tmp = folder.parent / f"{name}_sinks"
    tmp.mkdir(exist_ok=True)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.1.self_attn.attention_sink_bias"] = torch.zeros(
        BASE["num_attention_heads"])
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(UnsupportedError, match=r"self_attn\.attention_sink_bias: attention sinks"):
        _engine(tmp, speculative=False)


def test_tensor_parallel_routed_experts_are_refused():
    from speccal.runner.distributed.load import local_config

    cfg = config_from_hf(GLM_CFG)
    assert local_config(cfg, 1).moe == cfg.moe
    with pytest.raises(UnsupportedError, match="tp=2 with routed experts"):
        local_config(cfg, 2)


def test_sigmoid_router_keeps_float32_weights_in_a_bf16_model(family):
    """As transformers keeps them: a bf16 score bias would move the expert selection."""
    name, folder, _ = family
    eng = _engine(folder, speculative=False, dtype="bfloat16")
    moe = _moe_layers(eng.loaded.target)
    want = torch.float32 if moe[0].moe.scoring == "sigmoid" else torch.bfloat16
    for m in moe:
        assert m.gate.weight.dtype == want, name
        assert m.experts[0].gate_proj.weight.dtype == torch.bfloat16
        if m.gate.e_score_correction_bias is not None:
            assert m.gate.e_score_correction_bias.dtype == torch.float32
    got, _ = _run(eng, PROMPTS[:1], [SamplingParams(max_tokens=4, ignore_eos=True)], 0)
    assert len(got[0]) == 4
