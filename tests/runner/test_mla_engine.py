"""MLA (DeepSeek-V2 / V3) and DSA (DeepSeek-V3.2) targets and their MTP head on the Engine, CPU
fp32, against transformers (issue 37).

Random-weight checkpoints written by ``save_pretrained``, with every layer dense
(``first_k_dense_replace`` past the last layer) or with routed experts (``v3-moe``: layer 1 and
the MTP layer; ``v32-dsa-moe``: every layer), scaled so the logits are decisive, plus an MTP
head in DeepSeek-V3's layout
(``model.layers.{num_hidden_layers}.``: ``enorm``, ``hnorm``, ``eh_proj``, ``embed_tokens``,
``shared_head.norm``, ``shared_head.head`` and an MLA layer named like the target's; transformers
saves no MTP layer). Tokens are compared exactly: plain greedy decoding and speculative greedy
decoding (K = 1..3, an oracle draft forcing every accepted length; a mixed batch of three
requests in the bucket of four with different prompt lengths, ``max_tokens`` and a stop token)
must emit transformers' ``generate(do_sample=False)`` tokens. The DSA checkpoint's ``index_topk``
is small enough that the selection changes transformers' own tokens (asserted), so a runner
that ignored the indexer would fail.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.config import config_from_hf
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.mla_config import softmax_scale
from speccal.runner.sampling import SamplingParams
from tests.runner.engine_checks import OracleDraft as _Oracle
from tests.runner.engine_checks import (
    oracle_run,
    scheduled_accepts,
    served_shape_run,
    stop_case,
    target_rows_without_host_read,
)
from tests.runner.engine_checks import run_requests as _run

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("transformers without DeepSeek-V3.2 (needs >= 5)", allow_module_level=True)

V = 96
LAYERS = 2
SHAPES = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=20, qk_rope_head_dim=8,
              qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=128,
              # experts configured but no layer routed (the MTP layer LAYERS included)
              first_k_dense_replace=LAYERS + 1, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, n_group=1, topk_group=1,
              eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.7}
DSA = dict(index_topk=4, index_head_dim=16, index_n_heads=8)
VARIANTS = {  # name -> (config class stem, extra config)
    "v3": ("DeepseekV3", dict(q_lora_rank=24, rope_parameters=YARN)),
    "v3-no-qlora-bias-halfsplit": ("DeepseekV3", dict(q_lora_rank=None, attention_bias=True,
                                                      rope_interleave=False)),
    "v2": ("DeepseekV2", dict(q_lora_rank=None, rope_parameters=YARN)),
    "v32-dsa": ("DeepseekV32", dict(q_lora_rank=24, rope_parameters=YARN, **DSA)),
    # routed experts (speccal.runner.moe: sigmoid scores, score bias, group-limited routing,
    # routed scaling, a shared expert): layer 1 and the MTP layer, or every layer
    "v3-moe": ("DeepseekV3", dict(q_lora_rank=24, rope_parameters=YARN, first_k_dense_replace=1,
                                  n_group=2, topk_group=1, n_shared_experts=1,
                                  routed_scaling_factor=2.5)),
    "v32-dsa-moe": ("DeepseekV32", dict(q_lora_rank=24, rope_parameters=YARN, **DSA,
                                        first_k_dense_replace=0)),
    # GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's attention, GLM-4.5's routed MLP, dense /
    # routed layers by mlp_layer_types (its config class takes no first_k_dense_replace)
    # GLM-5 (glm_moe_dsa): V3.2's DSA, the indexer's rotary interleaved, layer 1 reusing
    # layer 0's top-k (indexer_types), routed from layer 1
    "glm5-dsa": ("GlmMoeDsa", dict(q_lora_rank=24, rope_parameters=YARN, **DSA,
                                   indexer_types=["full", "shared"], first_k_dense_replace=1,
                                   n_group=2, topk_group=1, n_shared_experts=1)),
    "glm4-lite": ("Glm4MoeLite", dict(q_lora_rank=24, rope_parameters=YARN,
                                      mlp_layer_types=["dense", "sparse"], n_group=2,
                                      topk_group=1, n_shared_experts=1,
                                      routed_scaling_factor=2.5)),
}
#: config keys a variant's class does not take (the strict config classes refuse them)
NOT_TAKEN = {"glm4-lite": ("first_k_dense_replace",)}


def _is_routed(variant: str) -> bool:
    extra = VARIANTS[variant][1]
    if "mlp_layer_types" in extra:
        return extra["mlp_layer_types"][-1] == "sparse"
    return extra.get("first_k_dense_replace", LAYERS + 1) < LAYERS


def _config_kwargs(variant: str, **override) -> dict:
    extra = VARIANTS[variant][1]
    kw = {**SHAPES, **extra, **override}
    return {k: v for k, v in kw.items() if k not in NOT_TAKEN.get(variant, ())}
PROMPTS = ([5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14], [7, 1, 62, 30],
           [44, 12, 90, 23, 8, 66, 19, 51, 3, 77, 28, 35, 10])
MAX_TOKENS = (14, 9, 12)
W = 3


def _hf_model(variant: str, **override):
    stem = VARIANTS[variant][0]
    if not hasattr(transformers, stem + "ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {stem}ForCausalLM")
    torch.manual_seed(0)
    cfg = getattr(transformers, stem + "Config")(**_config_kwargs(variant, **override))
    model = getattr(transformers, stem + "ForCausalLM")(cfg).eval()
    with torch.no_grad():  # decisive logits: fp32 op-order noise cannot flip an argmax
        for name, p in model.named_parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
            if name.endswith("bias") or name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    return model


def write_checkpoint(folder, variant: str, *, head_extra: dict | None = None):
    """``save_pretrained`` plus an MTP head at ``model.layers.{LAYERS}.``; returns the model."""
    hf = _hf_model(variant)
    hf.save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(2)
    h = SHAPES["hidden_size"]
    pre = f"model.layers.{LAYERS}."
    head = {pre + "enorm.weight": (h,), pre + "hnorm.weight": (h,),
            pre + "eh_proj.weight": (h, 2 * h), pre + "embed_tokens.weight": (V, h),
            pre + "shared_head.norm.weight": (h,), pre + "shared_head.head.weight": (V, h),
            **(head_extra or {})}
    # the head's layer is named like a target layer: the last (routed) one of a routed model
    src = f"model.layers.{LAYERS - 1 if _is_routed(variant) else 0}."
    for key, t in tensors.items():
        if key.startswith(src):
            head[key.replace(src, pre)] = tuple(t.shape)
        if key.startswith("model.layers.0.self_attn.indexer."):  # the head runs its own
            head[key.replace("model.layers.0.", pre)] = tuple(t.shape)
    tensors.update({k: torch.randn(s, generator=g) * 0.5 for k, s in head.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hf


def _hf_greedy(hf, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    refs = []
    with torch.no_grad():
        for p, n in zip(prompts, max_tokens, strict=True):
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """``(variant, folder, refs)``: refs[i] = transformers' greedy tokens of PROMPTS[i]."""
    folder = tmp_path_factory.mktemp("mla") / request.param
    hf = write_checkpoint(folder, request.param)
    return request.param, folder, _hf_greedy(hf)


def _engine(folder, **kw) -> Engine:
    cfg = dict(model=str(folder), draft_width=W, request_buckets=(1, 2, 4), max_model_len=64,
               block_size=4, prefill_chunk=8, acceptance="greedy")
    return Engine(EngineConfig.flat(**{**cfg, **kw}))


def _stop_case(refs):
    """Mixed batch params and expected tokens: request 0 stops at a stop token."""
    return stop_case(refs, MAX_TOKENS, 6)


def OracleDraft(eng: Engine, refs, k: int) -> _Oracle:  # noqa: N802 (the class's name)
    return _Oracle(eng, refs, k, V)


def test_plain_greedy_equals_transformers(checkpoint):
    variant, folder, refs = checkpoint
    eng = _engine(folder, speculative=False)
    mla = eng.loaded.config.mla
    k_cache, v_cache = eng.kv.layers[0]
    # the paged latent cache: one head of [latent | k_rope]; V holds the indexer's key or nothing
    assert k_cache.shape[2:] == (1, 20 + 8)
    assert v_cache.shape[2:] == (1, DSA["index_head_dim"] if mla.indexer else 0)
    assert len(eng.kv.layers) == LAYERS and eng.loaded.draft is None
    params, want = _stop_case(refs)
    got, _ = _run(eng, PROMPTS, params, 0)
    assert got == want
    assert len({t for r in refs for t in r}) > 8  # non-degenerate


@pytest.mark.parametrize("checkpoint", ["v3", "v32-dsa", "v3-moe", "glm4-lite", "glm5-dsa"],
                         indirect=True)
def test_speculative_greedy_equals_transformers_every_accepted_length(checkpoint):
    """K = 1..3: batch 1 with the head's own drafts, then the mixed batch under the oracle
    draft; tokens equal transformers' and every accepted length 0..k occurs."""
    variant, folder, refs = checkpoint
    eng = _engine(folder)
    assert eng.loaded.family.name == "deepseek_mtp" and len(eng.kv.layers) == LAYERS + 1
    assert type(eng.loaded.draft.layer.self_attn).__name__ == "MLAttention"
    assert type(eng.loaded.draft.layer.mlp).__name__ == ("RoutedMoE" if _is_routed(variant)
                                                         else "MLP")
    params, want = _stop_case(refs)
    for k in range(1, W + 1):
        got, _ = _run(eng, PROMPTS[:1], [SamplingParams(max_tokens=MAX_TOKENS[0],
                                                        ignore_eos=True)], k)
        assert got == [refs[0]], (k, "batch 1")
        got, results, oracle = oracle_run(eng, PROMPTS, refs, params, k, V)
        assert got == want, (k, "mixed batch")
        assert all(r.bcap == 4 or len(r.request_ids) < 3 for r in results if r.round_index >= 0)
        ms = scheduled_accepts(results, oracle, k)
        assert set(ms) == set(range(k + 1)), (k, ms)


@pytest.mark.parametrize("checkpoint", ["glm5-dsa"], indirect=True)
def test_shared_top_k_layers_reuse_the_full_layers_selection(checkpoint):
    """GLM-5's ``indexer_types``: layer 1 has no indexer and no indexer-key cache and attends
    with the very visibility layer 0's indexer chose in the same forward (top-k 4 of up to 20
    keys: the selection decides the tokens, which equal transformers')."""
    _, folder, refs = checkpoint
    eng = _engine(folder, speculative=False)
    full, shared = (layer.self_attn for layer in eng.loaded.target.model.layers)
    assert full.indexer is not None and shared.indexer is None and shared.shares_index
    assert eng.kv.layers[0][1].shape[-1] == DSA["index_head_dim"] and eng.kv.layers[1][1].shape[-1] == 0
    params, want = _stop_case(refs)
    got, _ = _run(eng, PROMPTS, params, 0)
    assert got == want
    assert shared.last_visible is full.last_visible
    vis = full.last_visible  # the last forward's: at most top-k keys per row
    assert int(vis.sum(-1).max()) <= DSA["index_topk"]


@pytest.mark.parametrize("checkpoint", ["v32-dsa", "glm5-dsa"], indirect=True)
def test_packed_verify_rows_equal_transformers(checkpoint):
    """The device-side verify input update (packed rows, ``cu_q_lens``; the reference kernels
    on CPU): the MLA attention maps packed rows onto its grid; oracle drafts, k = 2."""
    variant, folder, refs = checkpoint
    eng = _engine(folder, input_update="in_graph")
    assert eng.input_update == "in_graph"
    params, want = _stop_case(refs)
    oracle = OracleDraft(eng, {tuple(p): r for p, r in zip(PROMPTS, refs, strict=True)}, 2)
    eng.runner.draft_part = oracle
    got, results = _run(eng, PROMPTS, params, 2)
    assert got == want
    ms = [a for r in results for a in r.accepted.tolist()]
    assert 0 in ms and 1 in ms and 2 in ms, ms


@pytest.mark.parametrize("checkpoint", ["v3-moe", "v32-dsa"], indirect=True)
def test_served_round_shape_equals_transformers(checkpoint):
    """The served path's round shape on the CPU: the pipelined loop with the device-side verify
    input update, MLA (DSA) attention and routed layers: the head's drafts at batch 1 and on
    the mixed batch with a stop, k = 3, tokens equal transformers' (``served_shape_run``)."""
    _, folder, refs = checkpoint
    eng = _engine(folder, input_update="in_graph", pipeline=True)
    served_shape_run(eng, PROMPTS, refs, MAX_TOKENS, *_stop_case(refs), W)


def test_target_forward_makes_no_host_read(checkpoint):
    """MLA attention over the latent cache (the DSA indexer's top-k selection included) and the
    routed layers, on packed verify rows, make no host read (``engine_checks``): the
    forward could be captured."""
    _, folder, _ = checkpoint
    eng = _engine(folder, speculative=False)
    target_rows_without_host_read(eng.loaded.target, eng.loaded.config)


def test_dsa_selection_changes_transformers_tokens():
    """The DSA fixture is sensitive to the indexer: with every key selected (``index_topk``
    past the longest sequence) transformers' own tokens differ from the sparse ones."""
    sparse = _hf_greedy(_hf_model("v32-dsa"))
    dense = _hf_greedy(_hf_model("v32-dsa", index_topk=64))
    assert sparse != dense


def test_softmax_scale_matches_transformers():
    from transformers.modeling_rope_utils import yarn_apply_mscale

    for rope in (YARN, {"rope_type": "default", "rope_theta": 1e4},
                 {**YARN, "mscale_all_dim": 0}, {**YARN, "factor": 40.0, "mscale_all_dim": 1.0}):
        want = yarn_apply_mscale(rope, 20**-0.5)
        assert softmax_scale(20, rope["rope_type"], rope) == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------- refusals


def _hf_dict(variant: str, **override) -> dict:
    stem = VARIANTS[variant][0]
    cfg = getattr(transformers, stem + "Config")(**_config_kwargs(variant, **override)).to_dict()
    cfg["architectures"] = [stem + "ForCausalLM"]
    return cfg


def test_routed_layers_are_the_ones_transformers_routes():
    for variant, routed in (("v3", ()), ("v3-moe", (1,)), ("v32-dsa-moe", (0, 1)),
                            ("glm4-lite", (1,))):
        cfg = config_from_hf(_hf_dict(variant))
        assert tuple(i for i in range(LAYERS) if cfg.is_sparse(i)) == routed, variant
        hf = _hf_model(variant)
        assert tuple(i for i, layer in enumerate(hf.model.layers)
                     if hasattr(layer.mlp, "gate")) == routed, variant


def test_mla_config_errors_name_the_field():
    with pytest.raises(UnsupportedError, match=r"kv_lora_rank=20.*model_type is 'mystery'"):
        config_from_hf({**_hf_dict("v3"), "model_type": "mystery"})
    with pytest.raises(UnsupportedError, match=r"rope_interleave=False.*deepseek_v32"):
        config_from_hf({**_hf_dict("v32-dsa"), "rope_interleave": False})
    with pytest.raises(UnsupportedError, match=r"index_topk=4.*deepseek_v3.*no DSA indexer"):
        config_from_hf({**_hf_dict("v3"), **DSA})
    with pytest.raises(InputError, match=r"q_lora_rank.*DSA indexer"):
        config_from_hf({**_hf_dict("v32-dsa"), "q_lora_rank": None})
    with pytest.raises(InputError, match=r"indexer_types.*'full' / 'shared', the first"):
        config_from_hf({**_hf_dict("glm5-dsa"), "indexer_types": ["shared", "full"]})
    with pytest.raises(InputError, match=r"indexer_types"):
        config_from_hf({**_hf_dict("glm5-dsa"), "indexer_types": ["full"]})
    with pytest.raises(UnsupportedError, match=r"indexer_types.*deepseek_v32.*every"):
        config_from_hf({**_hf_dict("v32-dsa"), "indexer_types": ["full", "shared"]})
    with pytest.raises(InputError, match=r"qk_rope_head_dim.*even"):
        config_from_hf({**_hf_dict("v3"), "qk_rope_head_dim": 7})
    with pytest.raises(InputError, match=r"v_head_dim"):
        config_from_hf({**_hf_dict("v3"), "v_head_dim": None})


def test_mla_under_tensor_parallelism_is_refused():
    from speccal.runner.distributed.load import local_config

    cfg = config_from_hf(_hf_dict("v3"))
    assert local_config(cfg, 1).mla == cfg.mla
    with pytest.raises(UnsupportedError, match=r"tp=2.*kv_lora_rank=20"):
        local_config(cfg, 2)


@pytest.mark.parametrize("checkpoint", ["v3-moe", "glm4-lite"], indirect=True)
def test_the_fused_path_folds_the_o_projection_into_the_residual_norm(checkpoint, monkeypatch,
                                                                      fused_on_cpu):
    """On the fused path (here its references on the CPU) an MLA layer's decode and verify rows
    run the o projection as one GEMV adding into the residual stream and norming it (the
    post-attention norm, ``ops.linear(residual=..., norm=...)``), not a GEMV, its reduce and a
    norm launch; prefill chunks keep the plain projection. Plain and K = 1, 3 tokens equal
    transformers' (fp32)."""
    from speccal.kernels import ops
    from speccal.runner.path import SKINNY_ROWS, bind_path

    _, folder, refs = checkpoint
    folded = []
    real = ops.linear

    def counted(x, weight, **kw):
        if kw.get("norm") is not None:
            folded.append(x.shape[0])
        return real(x, weight, **kw)

    monkeypatch.setattr(ops, "linear", counted)
    params, want = _stop_case(refs)
    for speculative, ks in ((False, (0,)), (True, (1, 3))):
        eng = _engine(folder, speculative=speculative)
        bind_path(eng.loaded.target, fused_on_cpu())
        for k in ks:
            got, _ = _run(eng, PROMPTS, params, k)
            assert got == want, k
    layers = eng.loaded.config.num_hidden_layers
    assert folded and max(folded) <= SKINNY_ROWS and len(folded) % layers == 0


# ---------------------------------------------------------------- CUDA (run on the GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["v3", "v32-dsa", "glm5-dsa", "glm4-lite"], indirect=True)
def test_triton_path_serves_mla_layers_per_op_on_cuda(checkpoint):
    """On the Triton backend MLA layers do not fuse (the fused layer is GQA's): they run per op,
    decode and verify rows attending through the Triton MLA kernel (DSA layers: the torch
    attention); plain and speculative tokens equal transformers' (fp32)."""
    variant, folder, refs = checkpoint
    params, want = _stop_case(refs)
    kw = dict(device="cuda", dtype="float32", attention_backend="triton")
    plain = _engine(folder, speculative=False, **kw)
    assert not any(layer.can_fuse(torch.zeros(4, device="cuda", dtype=torch.long),
                                  plain.loaded.target.rotary)
                   for layer in plain.loaded.target.model.layers)
    got, _ = _run(plain, PROMPTS, params, 0)
    assert got == want
    spec = _engine(folder, **kw)
    for k in (1, 3):
        got, _ = _run(spec, PROMPTS, params, k)
        assert got == want, k


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", ["v3", "v3-moe", "glm5-dsa"], indirect=True)
def test_rope_cache_kernel_serves_every_mla_forward(checkpoint, monkeypatch):
    """``ops.mla_rope_cache`` (one Triton launch a layer: both rotaries, the latent-cache write
    and the absorbed query) in every MLA forward, prefill chunks, decode and verify rows, DSA
    layers too: plain and K = 1, 3 tokens equal transformers' (fp32). On the GPU, or on the
    CPU under Triton's interpreter (SPECCAL_KERNEL_TEST_DEVICE=cpu TRITON_INTERPRET=1), where
    the attention and routed-expert kernels run their references (the interpreter does not
    run them) and this kernel runs itself."""
    import os

    from speccal.kernels import ops
    from speccal.kernels._backend import interpreting

    pytest.importorskip("triton")
    dev = os.environ.get("SPECCAL_KERNEL_TEST_DEVICE", "cuda")
    _, folder, refs = checkpoint
    calls = []
    real = ops.mla_rope_cache

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])  # rows
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "mla_rope_cache", counted)
    if dev == "cpu":
        assert interpreting(), "SPECCAL_KERNEL_TEST_DEVICE=cpu needs TRITON_INTERPRET=1"
        for name in ("mla_latent_attention", "fused_moe", "moe_route"):
            f = getattr(ops, name)
            monkeypatch.setattr(ops, name, lambda *a, _f=f, **k: _f(*a, **{**k,
                                                                          "backend": "reference"}))
    params, want = _stop_case(refs)
    kw = dict(device=dev, dtype="float32")
    got, _ = _run(_engine(folder, speculative=False, **kw), PROMPTS, params, 0)
    assert got == want
    spec = _engine(folder, **kw)
    for k in (1, 3):
        got, _ = _run(spec, PROMPTS, params, k)
        assert got == want, k
    assert min(calls) == 1 and max(calls) > 1  # decode rows and prefill chunks / verify rows
