"""Hybrid linear-attention targets (runner/hybrid.py, runner/linear_attention.py) against
transformers' Qwen3_5ForCausalLM / Qwen3NextForCausalLM on CPU, fp32, random weights.

Tolerances: logits within 1e-4 absolute of transformers' (measured 5e-6 .. 2e-5 with logits up
to ~5; transformers' own cached steps and its one-shot forward differ by ~2.7e-5 on the same
weights); greedy tokens exactly equal. One module-scoped checkpoint per family (4 layers, 3
linear + 1 full attention, sharded, 15 ``mtp.*`` tensors added).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from speccal.base.errors import UnsupportedError
from speccal.runner.attention import AttnMeta
from speccal.runner.config import config_from_hf
from speccal.runner.draft_families import recognise
from speccal.runner.hybrid import HybridModel, hybrid_config_from_hf, is_hybrid_config
from speccal.runner.kv_cache import KVCache
from speccal.runner.linear_attention import (
    StateMeta,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from speccal.runner.loader import load_hybrid

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers without Qwen3.5 (needs >= 5)", allow_module_level=True)

ATOL = 1e-4
BLOCK = 4
BLOCKS_PER_REQ = 16
SHAPES = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
              tie_word_embeddings=False)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights: norms and gates away from their init so every term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g).mul(2).add(-1))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            if name.endswith("linear_attn.norm.weight"):
                p.add_(1.0)


def _mtp_tensors(h: int, ff: int, nh: int, nkv: int, d: int) -> dict[str, torch.Tensor]:
    """The 15 ``mtp.*`` tensors of a Qwen3.5 head (fusion + one gated-attention layer)."""
    p = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
        "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (2 * nh * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
        p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
        p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
        p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
        p + "mlp.down_proj.weight": (h, ff),
    }
    return {k: torch.randn(s) for k, s in shapes.items()}


def _checkpoint(tmp_path, kind: str):
    """A random-weight checkpoint written by ``save_pretrained`` (sharded), plus ``mtp.*``."""
    torch.manual_seed(0)
    if kind == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**SHAPES, mtp_num_hidden_layers=1)
        hf = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3NextConfig(**SHAPES, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=24,
                                           shared_expert_intermediate_size=32)
        hf = transformers.Qwen3NextForCausalLM(cfg)
    _randomise(hf, 1)
    hf.eval()
    folder = tmp_path / kind
    hf.save_pretrained(folder, max_shard_size="100KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    s = SHAPES
    mtp = _mtp_tensors(s["hidden_size"], s["intermediate_size"], s["num_attention_heads"],
                       s["num_key_value_heads"], s["head_dim"])
    save_file(mtp, str(folder / "mtp.safetensors"))
    index["weight_map"].update({k: "mtp.safetensors" for k in mtp})
    index_path.write_text(json.dumps(index))
    return hf, folder


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def pair(request, tmp_path_factory):
    hf, folder = _checkpoint(tmp_path_factory.mktemp("hybrid"), request.param)
    ours, cfg = load_hybrid(folder, device=torch.device("cpu"), dtype="float32",
                            max_model_len=256, max_positions=256)
    return request.param, hf, ours, folder


class Session:
    """A minimal driver: per-slot KV blocks and state rows, ``B`` requests x ``R`` rows."""

    def __init__(self, model: HybridModel, num_slots: int):
        cfg = model.config.base
        self.model = model
        self.kv = KVCache(model.num_kv_layers, 1 + num_slots * BLOCKS_PER_REQ, BLOCK,
                          cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                          torch.device("cpu"))
        self.state = model.new_state(num_slots, torch.float32, torch.device("cpu"))
        self.lengths = [0] * num_slots

    def step(self, slots: list[int], rows: list[list[int]], *, write_slots=None,
             is_chunked=False, snapshots=None, commit=True) -> torch.Tensor:
        """Run ``rows[b]`` (equal lengths) of the requests in ``slots``; logits [B, R, V]."""
        num_b, num_r = len(slots), len(rows[0])
        ids, pos, slot_map = [], [], []
        for s, toks in zip(slots, rows, strict=True):
            start = self.lengths[s]
            for i, t in enumerate(toks):
                p = start + i
                ids.append(t)
                pos.append(p)
                slot_map.append((1 + s * BLOCKS_PER_REQ + p // BLOCK) * BLOCK + p % BLOCK)
        table = torch.tensor([[1 + s * BLOCKS_PER_REQ + j for j in range(BLOCKS_PER_REQ)]
                              for s in slots], dtype=torch.int32)
        seq = torch.tensor([self.lengths[s] + num_r for s in slots], dtype=torch.int32)
        attn = AttnMeta(torch.tensor(slot_map), torch.arange(num_b * num_r), table, seq, num_r)
        read = torch.tensor(slots)
        write = torch.tensor(write_slots) if write_slots is not None else read
        smeta = StateMeta(read, write, num_r, is_chunked=is_chunked, snapshots=snapshots)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), attn, self.kv.layers,
                                smeta, self.state)
            logits = self.model.logits(hidden).view(num_b, num_r, -1)
        if commit:
            for s in slots:
                self.lengths[s] += num_r
        return logits


PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]


def test_config_is_recognised_by_layer_types_and_refused_by_the_dense_parser(pair):
    kind, hf, ours, folder = pair
    cfg = json.loads((folder / "config.json").read_text())
    assert is_hybrid_config(cfg)
    with pytest.raises(UnsupportedError, match="linear_attention|mixture-of-experts"):
        config_from_hf(cfg)
    hcfg = ours.config
    assert hcfg.layer_types == tuple(cfg["layer_types"])
    assert hcfg.layers_of("full_attention") == [3]
    assert hcfg.linear.is_grouped_projection == (kind == "qwen3_next")
    assert (hcfg.moe is not None) == (kind == "qwen3_next")
    assert ours.num_state_layers == 3 and ours.num_kv_layers == 1


def test_prefill_logits_equal_transformers(pair):
    _, hf, ours, _ = pair
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    for chunked in (False, True):
        sess = Session(ours, 1)
        got = sess.step([0], [PROMPT], is_chunked=chunked)[0]
        diff = (got - ref).abs().max().item()
        assert diff < ATOL, (chunked, diff)
    assert ref.abs().max() > 0.5  # the comparison is not between near-zero vectors


def test_chunked_prefill_in_pieces_then_decode_equals_generate(pair):
    _, hf, ours, _ = pair
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10,
                          eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    sess = Session(ours, 1)
    sess.step([0], [PROMPT[:4]], is_chunked=True)
    logits = sess.step([0], [PROMPT[4:]], is_chunked=True)
    out = [int(logits[0, -1].argmax())]
    while len(out) < 10:  # one row per step, state carried between steps
        out.append(int(sess.step([0], [[out[-1]]])[0, -1].argmax()))
    assert out == ref
    # multi-row steps fed transformers' greedy tokens (a verify step whose drafts are all
    # right): every row's argmax is the next greedy token
    sess = Session(ours, 1)
    first = int(sess.step([0], [PROMPT], is_chunked=True)[0, -1].argmax())
    assert first == ref[0]
    at = 0
    for r in (3, 1, 3, 2):
        logits = sess.step([0], [ref[at:at + r]])[0]
        assert logits.argmax(-1).tolist() == ref[at + 1:at + r + 1]
        at += r
    assert at == 9


def test_multi_row_verify_steps_equal_transformers_cached_steps(pair):
    """Rows 1..w+1 per step, as a verify step feeds them, state and KV carried between steps:
    each row's logits equal transformers' for the same steps through its cache (the same
    decomposition; transformers' own steps and its one-shot forward differ by up to ~3e-4 on
    these random weights, fp32 rounding amplified by the recurrence)."""
    _, hf, ours, _ = pair
    seq = PROMPT + [7, 19, 23, 4, 50, 61, 12, 8, 30, 1]
    steps = (1, 3, 2, 4, 1, 4)
    with torch.no_grad():
        out = hf(torch.tensor([seq[:6]]), use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        ref, at = [out.logits[0]], 6
        for r in steps:
            ref.append(hf(torch.tensor([seq[at:at + r]]), cache=cache, use_cache=True).logits[0])
            at += r
    sess = Session(ours, 1)
    got, at = [sess.step([0], [seq[:6]], is_chunked=True)[0]], 6
    for r in steps:
        got.append(sess.step([0], [seq[at:at + r]])[0])
        at += r
    assert at == len(seq)
    assert (torch.cat(got) - torch.cat(ref)).abs().max().item() < ATOL


def test_batched_decode_equals_per_request(pair):
    _, _, ours, _ = pair
    a, b = PROMPT, PROMPT[::-1]
    solo = []
    for p in (a, b):
        s = Session(ours, 1)
        s.step([0], [p], is_chunked=True)
        solo.append(s.step([0], [[3, 4, 5]])[0])
    batch = Session(ours, 3)
    batch.step([2], [a], is_chunked=True)
    batch.step([0], [b], is_chunked=True)
    got = batch.step([2, 0], [[3, 4, 5], [3, 4, 5]])
    assert (got[0] - solo[0]).abs().max() < ATOL
    assert (got[1] - solo[1]).abs().max() < ATOL


def test_scratch_row_verify_keeps_committed_state(pair):
    """Verify reads the committed row and writes a scratch row: after a (rejected) verify the
    committed row continues exactly as if the verify never ran; committing the scratch row
    (a row copy, or an index swap) continues exactly as if it was accepted."""
    _, _, ours, _ = pair
    rejected = Session(ours, 1)
    rejected.step([0], [PROMPT], is_chunked=True)
    ref_after_reject = rejected.step([0], [[9]])[0]
    accepted = Session(ours, 1)
    accepted.step([0], [PROMPT], is_chunked=True)
    accepted.step([0], [[40, 41, 42]])
    ref_after_accept = accepted.step([0], [[9]])[0]

    sess = Session(ours, 3)  # slot 0 committed, slot 1 scratch, slot 2 a probe's scratch
    sess.step([0], [PROMPT], is_chunked=True)
    committed = sess.state.snapshot(torch.tensor([0]))
    sess.step([0], [[40, 41, 42]], write_slots=[1], commit=False)  # verify -> scratch
    for (c0, s0), (c1, s1) in zip(committed, sess.state.snapshot(torch.tensor([0])),
                                  strict=True):
        assert torch.equal(c0, c1) and torch.equal(s0, s1)
    probe = sess.step([0], [[9]], write_slots=[2], commit=False)[0]  # as if all rejected
    assert (probe - ref_after_reject).abs().max() < ATOL
    assert (probe - ref_after_accept).abs().max() > 1e-2  # the two continuations differ
    # the probe overwrote position L's KV; the acceptance half runs on a fresh session
    sess = Session(ours, 2)
    sess.step([0], [PROMPT], is_chunked=True)
    sess.step([0], [[40, 41, 42]], write_slots=[1], commit=False)
    sess.state.copy_rows(torch.tensor([1]), torch.tensor([0]))  # full acceptance: commit
    sess.lengths[0] += 3
    assert (sess.step([0], [[9]])[0] - ref_after_accept).abs().max() < ATOL


def test_per_position_snapshots_restore_a_partial_acceptance(pair):
    """A 4-row verify stores the state after each row; restoring the snapshot after row j
    continues exactly as a run that only ever saw rows 0..j (partial acceptance of j drafts)."""
    _, _, ours, _ = pair
    drafts = [40, 41, 42, 43]
    for accepted in (0, 2, 3):
        ref = Session(ours, 1)
        ref.step([0], [PROMPT], is_chunked=True)
        ref.step([0], [drafts[:accepted + 1]])
        want = ref.step([0], [[9, 10]])[0]

        sess = Session(ours, 1)
        sess.step([0], [PROMPT], is_chunked=True)
        per_layer = sess.state.snapshot_buffers(1, len(drafts))
        sess.step([0], [drafts], snapshots=per_layer, commit=False)
        restore = [(c[:, accepted], s[:, accepted]) for c, s in per_layer]
        sess.state.restore(torch.tensor([0]), restore)
        sess.lengths[0] += accepted + 1  # the KV of the rejected rows is overwritten later
        got = sess.step([0], [[9, 10]])[0]
        assert (got - want).abs().max() < ATOL, accepted


def test_chunked_and_recurrent_delta_rule_agree_with_padding_rows_inert():
    g = torch.Generator().manual_seed(3)
    b, r, hk, hv, dk, dv = 2, 70, 2, 4, 8, 6  # more than one chunk of 64
    q, k = torch.randn(b, r, hk, dk, generator=g), torch.randn(b, r, hk, dk, generator=g)
    v = torch.randn(b, r, hv, dv, generator=g)
    gate = -torch.rand(b, r, hv, generator=g)
    beta = torch.rand(b, r, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g)
    o1, s1 = recurrent_gated_delta_rule(q, k, v, gate, beta, s0)
    o2, s2 = chunk_gated_delta_rule(q, k, v, gate, beta, s0)
    assert (o1 - o2).abs().max() < 1e-4 and (s1 - s2).abs().max() < 1e-4
    gate[:, 60:] = 0  # padding rows: no decay, no write
    beta[:, 60:] = 0
    _, s3 = recurrent_gated_delta_rule(q, k, v, gate, beta, s0)
    _, s4 = recurrent_gated_delta_rule(q[:, :60], k[:, :60], v[:, :60], gate[:, :60],
                                       beta[:, :60], s0)
    assert torch.allclose(s3, s4, atol=1e-5)


def test_mtp_keys_are_dropped_from_the_target_and_recognised_for_hybrid_targets_only(pair):
    _, _, ours, folder = pair
    from speccal.runner.checkpoint import SafetensorsFolder

    src = SafetensorsFolder(folder)
    keys = src.keys()
    assert sum(k.startswith("mtp.") for k in keys) == 15
    assert not any(n.startswith("mtp.") for n, _ in ours.named_parameters())
    layers = ours.config.base.num_hidden_layers
    fam, depths = recognise(src.config, keys, layers, target_structure="hybrid")
    assert fam.name == "qwen3_5_mtp" and depths == 1
    with pytest.raises(UnsupportedError, match="qwen3_5_mtp.*refused.*dense attention decoder"):
        recognise(src.config, keys, layers)  # the same head on a dense target


def test_qwen3_5_mtp_descriptor_names_exactly_the_published_head_keys(pair):
    """The descriptor's key layout (head-level ``mtp.fc`` / ``mtp.pre_fc_norm_*`` /
    ``mtp.norm``, the layer under ``mtp.layers.0.``) maps every head parameter to one of the
    15 published tensors and covers all of them."""
    _, _, ours, folder = pair
    from speccal.runner.checkpoint import SafetensorsFolder
    from speccal.runner.draft_families import REGISTRY
    from speccal.runner.hybrid import HybridMTPHead
    from speccal.runner.loader import hybrid_head_config

    keys = set(SafetensorsFolder(folder).keys())
    fam = REGISTRY["qwen3_5_mtp"]
    layers = ours.config.base.num_hidden_layers
    dcfg = hybrid_head_config(ours.config, fam, keys)
    assert dcfg.moe is None  # these heads carry a dense MLP (no router key), even on Next
    with torch.device("meta"):
        head = HybridMTPHead(dcfg, fam)
    mapped = set(head.param_key_map(layers).values())
    assert mapped == {k for k in keys if k.startswith("mtp.")}
    assert fam.key_for("fc.weight", layers) == "mtp.fc.weight"
    assert fam.key_for("norm.weight", layers) == "mtp.norm.weight"
    assert fam.key_for("input_layernorm.weight", layers) == "mtp.layers.0.input_layernorm.weight"
    assert fam.concat_order == ("embed", "hidden") and fam.is_feedback_normed


def test_missing_tensor_is_refused_by_name(tmp_path):
    hf, folder = _checkpoint(tmp_path, "qwen3_5")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.0.linear_attn.A_log"]
    index_path.write_text(json.dumps(index))
    from speccal.base.errors import InputError

    with pytest.raises(InputError, match="layers.0.linear_attn.A_log"):
        load_hybrid(folder, device=torch.device("cpu"), dtype="float32", max_model_len=64,
                    max_positions=64)


def test_hybrid_config_needs_linear_fields():
    cfg = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "layer_types": ["linear_attention", "full_attention"]}
    from speccal.base.errors import InputError

    with pytest.raises(InputError, match="linear_num_key_heads"):
        hybrid_config_from_hf(cfg)


def test_cuda_kernels_refuse_clearly_without_flash_linear_attention():
    import importlib.util

    from speccal.runner.linear_attention import cuda_kernels

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed")
    with pytest.raises(UnsupportedError, match=r"flash-linear-attention.*speccal\[hybrid\]"):
        cuda_kernels()


def test_padding_rows_leave_the_state_of_their_request_untouched(pair):
    """A mixed batch padded to R rows (``num_valid``): each request's new conv and ssm state and
    its real rows' outputs equal a run over its real rows only."""
    _, _, ours, _ = pair
    layer = next(m for m in ours.modules() if m.__class__.__name__ == "GatedDeltaNet")
    lin = ours.config.linear
    h = ours.config.base.hidden_size
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * 3, h, generator=g)

    def fresh():
        conv = torch.randn(2, lin.conv_dim, lin.conv_kernel - 1, generator=torch.Generator()
                           .manual_seed(6))
        ssm = torch.randn(2, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim,
                          generator=torch.Generator().manual_seed(7))
        return conv, ssm

    padded = fresh()
    meta = StateMeta(torch.tensor([0, 1]), torch.tensor([0, 1]), 3,
                     num_valid=torch.tensor([3, 1]))
    with torch.no_grad():
        out = layer(x, meta, padded).view(2, 3, h)
    solo = fresh()
    with torch.no_grad():
        out0 = layer(x[:3], StateMeta(torch.tensor([0]), torch.tensor([0]), 3), solo)
        out1 = layer(x[3:4], StateMeta(torch.tensor([1]), torch.tensor([1]), 1), solo)
    assert (out[0] - out0).abs().max() < 1e-5 and (out[1, :1] - out1).abs().max() < 1e-5
    for a, b in zip(padded, solo, strict=True):
        assert (a - b).abs().max() < 1e-5
    unmasked = fresh()
    with torch.no_grad():
        layer(x, StateMeta(torch.tensor([0, 1]), torch.tensor([0, 1]), 3), unmasked)
    assert (unmasked[1][1] - solo[1][1]).abs().max() > 1e-3  # the mask is what keeps it


@torch.no_grad()
def test_mtp_head_equals_a_transformers_layer_built_from_its_tensors(pair):
    """The ``qwen3_5_mtp`` head over a prompt (prefill layout: hidden ``h_i`` with token
    ``t_{i+1}`` at position ``i``) against a reference assembled from transformers' own
    modules and the ``mtp.*`` tensors: zero-centred ``Qwen3_5RMSNorm`` fusion norms,
    ``mtp.fc`` on ``[embed, hidden]``, a ``Qwen3_5DecoderLayer`` (full attention) loaded with
    ``mtp.layers.0.*``, ``mtp.norm``, the target's LM head. A swapped concat order or a
    plain RMSNorm misses it by far more than the tolerance (checked)."""
    kind, hf, _, folder = pair
    if kind != "qwen3_5":
        pytest.skip("transformers' Qwen3-Next layer holds fused experts; the head here is dense")
    from safetensors import safe_open
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hfm

    from speccal.runner.loader import load_model

    loaded = load_model(str(folder), device=torch.device("cpu"), dtype="float32",
                        max_model_len=64, max_positions=64)
    head, target = loaded.draft, loaded.target
    with safe_open(str(folder / "mtp.safetensors"), "pt") as f:
        mtp = {k: f.get_tensor(k) for k in f.keys()}
    seq = PROMPT
    n = len(seq) - 1
    ids = torch.tensor([seq])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state[0, :-1]  # after the final norm
        layer = hfm.Qwen3_5DecoderLayer(hf.config, layer_idx=3).eval()
        layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in mtp.items()
                               if k.startswith("mtp.layers.0.")})

        def norm(name, x):
            m = hfm.Qwen3_5RMSNorm(x.shape[-1], eps=hf.config.rms_norm_eps)
            m.weight.copy_(mtp[f"mtp.{name}.weight"])
            return m(x)

        def reference(order):
            e = norm("pre_fc_norm_embedding", hf.model.embed_tokens(ids[0, 1:]))
            h = norm("pre_fc_norm_hidden", hidden)
            parts = {"embed": e, "hidden": h}
            x = torch.cat([parts[o] for o in order], -1) @ mtp["mtp.fc.weight"].T
            pos = torch.arange(n)[None]
            cos_sin = hf.model.rotary_emb(x[None], pos[None].expand(3, 1, -1))
            out = layer(x[None], position_embeddings=cos_sin, attention_mask=None,
                        position_ids=pos)
            return hf.lm_head(norm("norm", out[0]))

        want = reference(("embed", "hidden"))
        kv = KVCache(1, 1 + BLOCKS_PER_REQ, BLOCK, target.config.base.num_key_value_heads,
                     target.config.base.head_dim, torch.float32, torch.device("cpu"))
        table = torch.arange(1, 1 + BLOCKS_PER_REQ, dtype=torch.int32)[None]
        slots = (table[0, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK)
        meta = AttnMeta(slots, torch.arange(n), table, torch.tensor([n], dtype=torch.int32), n)
        fb, normed = head(target, hidden, ids[0, 1:], torch.arange(n), meta, kv.layers[0])
        got = head.logits(target, normed)
    assert torch.equal(fb, normed)  # the feedback is the normed output (descriptor)
    assert (got - want).abs().max().item() < ATOL
    assert (reference(("hidden", "embed")) - want).abs().max().item() > 100 * ATOL


def _decode_rows(model: HybridModel, smeta_kw: dict, fuse: bool):
    """Prefill two requests, then one plain decode row each under ``StateMeta(**smeta_kw)``:
    the decode's hidden rows and the state rows after it (bit for bit comparable)."""
    m = copy.deepcopy(model)
    cfg = m.config.base
    if fuse:
        m.fuse_weights()
    s = Session(m, 2)
    s.step([0], [PROMPT], is_chunked=True)
    s.step([1], [PROMPT[::-1]], is_chunked=True)
    table = torch.tensor([[1 + b * BLOCKS_PER_REQ + j for j in range(BLOCKS_PER_REQ)]
                          for b in (0, 1)], dtype=torch.int32)
    n = len(PROMPT)
    slot_map = torch.tensor([(1 + b * BLOCKS_PER_REQ + n // BLOCK) * BLOCK + n % BLOCK
                             for b in (0, 1)])
    attn = AttnMeta(slot_map, torch.arange(2), table, torch.tensor([n + 1, n + 1],
                                                                   dtype=torch.int32), 1)
    rows = torch.tensor([0, 1])
    with torch.no_grad():
        h = m(torch.tensor([3, 4]), torch.tensor([n, n]), attn, s.kv.layers,
              StateMeta(rows, rows, 1, **smeta_kw), s.state)
    assert cfg.hidden_size == h.shape[-1]
    return h, [t.clone() for layer in s.state.layers for t in layer]


def test_frozen_constants_and_the_plain_decode_shortcut_change_no_bit(pair):
    """Serving constants frozen once (``fuse_weights``: ``1 + w`` of every zero-centred norm,
    ``-exp(A_log)``) and a plain-decode ``StateMeta`` without grid or masks (what the state
    strategy passes when every request has exactly one row) give the same bits as the
    per-call forms with the identity grid and all-ones masks."""
    _, _, ours, _ = pair
    full = dict(num_valid=torch.tensor([1, 1]), row_index=torch.arange(2))
    h_ref, st_ref = _decode_rows(ours, full, fuse=False)
    for kw, fuse in ((full, True), ({}, False), ({}, True)):
        h, st = _decode_rows(ours, kw, fuse)
        assert torch.equal(h, h_ref)
        assert all(torch.equal(a, b) for a, b in zip(st, st_ref, strict=True))
    norms = [m for m in ours.modules() if type(m).__name__ == "OffsetRMSNorm"]
    assert norms and all(m.scale is None for m in norms)  # the fixture's model stays unfrozen
