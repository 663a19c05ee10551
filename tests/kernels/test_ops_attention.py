"""CPU tests of the attention ops (``kernels/ops_attention.py``): paged attention's
validation and reference dispatch, split-KV plans (decode and verify), the fold / spread merge
rules and switches, the attention -> o projection signal."""

from __future__ import annotations

import pytest
import torch

from speccal.base.errors import InputError
from speccal.kernels import ops
from speccal.kernels import reference as ref
from speccal.kernels.config import (
    AttentionTuning,
    GemvTuning,
    KernelConfig,
)


def _attention(**fields) -> KernelConfig:
    """The default kernel configuration with some ``AttentionTuning`` fields changed."""
    return KernelConfig(attention=AttentionTuning(**fields))


def _attn_inputs(batch=2, rows=3, heads=4, kvh=2, d=16, bs=8, max_blocks=4):
    kc = torch.randn(10, bs, kvh, d)
    vc = torch.randn(10, bs, kvh, d)
    bt = torch.arange(1, 1 + batch * max_blocks, dtype=torch.int32).view(batch, max_blocks) % 10
    seq = torch.tensor([5, 20][:batch], dtype=torch.int32)
    q = torch.randn(batch, rows, heads, d)
    return q, kc, vc, bt, seq


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda a: a.update(q=a["q"].to(torch.float16)), "q.dtype"),
        (lambda a: a.update(q=a["q"][:, :2]), "q.shape"),
        (lambda a: a.update(block_table=a["block_table"].long()), "block_table.dtype"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens.shape"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :4]), "v_cache.shape"),
        (lambda a: a.update(q=torch.randn(2, 3, 3, 16)), "num_heads"),
    ],
)
def test_paged_attention_rejects_bad_input(mutate, field):
    q, kc, vc, bt, seq = _attn_inputs()
    args = dict(q=q, k_cache=kc, v_cache=vc, block_table=bt, seq_lens=seq)
    mutate(args)
    with pytest.raises(InputError) as err:
        ops.paged_attention(num_q_rows=3, scale=0.25, **args)
    assert err.value.field == field


def test_paged_attention_dispatch_matches_reference_and_fills_out():
    q, kc, vc, bt, seq = _attn_inputs()
    out = torch.full_like(q, float("nan"))
    plan = ops.SplitPlan(max_splits=3, block_n=16, min_split_len=16)
    got = ops.paged_attention(q, kc, vc, bt, seq, 3, 0.25, plan=plan, out=out)
    assert got is out
    assert torch.allclose(out, ref.paged_attention_ref(q, kc, vc, bt, seq, 3, 0.25), atol=1e-5)


def test_split_plan_validation_and_planning():
    with pytest.raises(InputError):
        ops.SplitPlan(max_splits=0)
    with pytest.raises(InputError):
        ops.SplitPlan(block_n=48)
    assert ops.plan_splits(1, 8, num_sms=132).max_splits == 64
    assert ops.plan_splits(4, 8, num_sms=132).max_splits == 17
    assert ops.plan_splits(128, 8, num_sms=132).max_splits == 1
    assert ops.plan_splits(1, 8, num_sms=132, max_len=128).max_splits == 2


def test_verify_plans_halve_the_splits():
    """Multi-row (verification) plans take half the 1-row plan's splits (dense-2b on an H200:
    24 -> 12 at B=1, 9 -> 4 at B=8, never below 1), capped by ``AttentionTuning.verify_splits``."""
    assert ops.plan_splits(1, 8, 132, max_len=1536, rows=6).max_splits == 12
    assert ops.plan_splits(8, 8, 132, max_len=1536, rows=6).max_splits == 4
    assert ops.plan_splits(8, 8, 132, max_len=1536, rows=1).max_splits == 9
    assert ops.plan_splits(128, 8, 132, rows=6).max_splits == 1
    capped = _attention(verify_splits=3)
    assert ops.plan_splits(1, 8, 132, max_len=1536, rows=6, tune=capped).max_splits == 3
    assert ops.plan_splits(1, 8, 132, max_len=1536, rows=1, tune=capped).max_splits == 24
    with pytest.raises(InputError, match="kernels.attention.verify_splits"):
        AttentionTuning(verify_splits=0)
    with pytest.raises(InputError, match="rows"):
        ops.plan_splits(1, 8, 132, rows=0)


def test_verify_plan_tiles_and_stages():
    """Verification plans of at least VERIFY_WIDE_PAIRS (request, KV head) pairs take KV tiles of
    VERIFY_WIDE_TILE (``AttentionTuning.verify_block_n``); every verification plan VERIFY_STAGES
    stages, 1-row plans 2; the split count is planned as before."""
    assert ops.VERIFY_WIDE_PAIRS == 32 and ops.VERIFY_WIDE_TILE == 128
    narrow = ops.plan_splits(2, 8, 132, max_len=1536, rows=6)  # 16 pairs
    wide = ops.plan_splits(4, 8, 132, max_len=1536, rows=6)  # 32 pairs
    decode = ops.plan_splits(4, 8, 132, max_len=1536, rows=1)
    assert (narrow.block_n, narrow.min_split_len, narrow.max_splits) == (64, 64, 12)
    assert (wide.block_n, wide.min_split_len, wide.max_splits) == (128, 128, 8)
    assert (decode.block_n, decode.max_splits, decode.num_stages) == (64, 17, 2)
    assert narrow.num_stages == wide.num_stages == ops.VERIFY_STAGES == 3
    tile = _attention(verify_block_n=64)
    assert ops.plan_splits(4, 8, 132, max_len=1536, rows=6, tune=tile).block_n == 64
    small = _attention(verify_block_n=32)
    assert ops.plan_splits(2, 8, 132, rows=6, tune=small).block_n == 64  # narrow: not read
    assert ops.plan_splits(4, 8, 132, rows=1, tune=small).block_n == 64  # 1-row: not read
    with pytest.raises(InputError, match="kernels.attention.verify_block_n"):
        AttentionTuning(verify_block_n=96)
    with pytest.raises(InputError, match="num_stages"):
        ops.SplitPlan(num_stages=5)


def test_fold_rule_folds_light_merges_only():
    """The dense-2b plans on 132 SMs: B=1 decode (1 row x 2 heads x 24 splits, 192 programs)
    folds; B=1 verify (6 rows -> 16 x 16 partials) and B=8 decode (576 programs) keep the
    reduce."""
    assert ops.fold_wanted(1, 8, 24, 1, 2)
    assert not ops.fold_wanted(1, 8, 24, 6, 2)
    assert not ops.fold_wanted(8, 8, 9, 1, 2) and not ops.fold_wanted(8, 8, 9, 6, 2)
    assert not ops.fold_wanted(1, 8, 1, 1, 2, force=True)  # one split: nothing to merge
    assert ops.fold_wanted(8, 8, 9, 6, 2, force=True)
    assert not ops.fold_wanted(1, 8, 24, 1, 2, force=False)
    # B=4 verification (6 rows x 2 heads x 8 splits = 128, 256 programs) folds; B=2 (12 splits
    # padded to 16: 256) does not
    assert ops.FOLD_MAX_MERGE == 128
    assert ops.fold_wanted(4, 8, 8, 6, 2) and not ops.fold_wanted(2, 8, 12, 6, 2)
    assert not ops.fold_wanted(4, 8, 8, 6, 2, max_merge=64)


def test_spread_rule_needs_a_grid_that_fits():
    """The spread merge's programs wait for each other, so only a grid of at most one program
    per SM gets it: B=1 verification of the dense-2b plan (8 x 12 = 96 programs on 132 SMs)
    does, B=1 decode (192) and B=8 verification (256) do not, whatever the switch says."""
    assert ops.spread_wanted(1, 8, 12, 6, 132)
    assert not ops.spread_wanted(1, 8, 12, 1, 132)  # one row: the fold's case
    assert ops.spread_wanted(1, 8, 12, 1, 132, force=True)
    assert not ops.spread_wanted(1, 8, 12, 6, 132, force=False)
    assert not ops.spread_wanted(1, 8, 24, 1, 132, force=True)  # 192 programs
    assert not ops.spread_wanted(8, 8, 4, 6, 132, force=True)  # 256 programs
    assert ops.spread_wanted(1, 8, 16, 6, 128) and not ops.spread_wanted(1, 8, 17, 6, 128)
    assert not ops.spread_wanted(1, 8, 1, 6, 132, force=True)  # one split: nothing to merge


@pytest.mark.parametrize("name, default", [("fold", "auto"), ("spread", "off")])
def test_merge_switches(name, default):
    """``AttentionTuning.fold`` (default auto: the rule) and ``.spread`` (default off: never)
    force (on), forbid (off) or leave to the rule (auto) their split-KV merge, which is what the
    rules ``fold_wanted`` / ``spread_wanted`` receive as ``force``; a typo is an error naming
    the field."""
    want = {"auto": None, "off": False, "on": True}
    assert getattr(AttentionTuning(), name) == default
    override = f"{name}_override"
    assert getattr(AttentionTuning(), override) is want[default]
    for value, expect in want.items():
        assert getattr(AttentionTuning(**{name: value}), override) is expect
    rule = {"fold": lambda force: ops.fold_wanted(1, 8, 4, 6, 2, force=force),  # light: folds
            "spread": lambda force: ops.spread_wanted(1, 8, 4, 1, force=force)}[name]  # 1 row
    assert [rule(getattr(AttentionTuning(**{name: v}), override)) for v in want] == [
        name == "fold", False, True]
    with pytest.raises(InputError, match=f"kernels.attention.{name}") as err:
        AttentionTuning(**{name: "1"})
    assert "auto, on, off" in str(err.value)


def test_attention_switches():
    """``AttentionTuning``'s prefetch (default none), split release (``start`` / ``loop`` /
    ``early``), prewait (``rows``: multi-row plans only; ``on``; ``off``), warps and stages
    (default: the launch's own) and ``block_n`` (a plan's KV tile) take their documented
    values; bad values name the field."""
    att = AttentionTuning()
    assert att.prefetch_tiles == 0 and att.release == "start" and att.release_level == 0
    assert [AttentionTuning(release=r).release_level for r in ("start", "loop", "early")] == [
        0, 1, 2]
    assert AttentionTuning(prefetch_tiles=2).prefetch_tiles == 2
    assert att.prewait_rows(6) is True and att.prewait_rows(1) is False  # default: rows
    assert AttentionTuning(prewait="off").prewait_rows(6) is False
    assert AttentionTuning(prewait="on").prewait_rows(1) is True
    assert att.warps is None and AttentionTuning(warps=8).warps == 8
    assert att.stages is None and AttentionTuning(stages=4).stages == 4
    assert att.block_n is None and ops.plan_splits(1, 8).block_n == 64
    plan = ops.plan_splits(1, 8, max_len=1024, tune=_attention(block_n=32))
    assert plan.block_n == plan.min_split_len == 32 and plan.max_splits == 32
    for name, bad in (("prefetch_tiles", "x"), ("prefetch_tiles", -1), ("release", "late"),
                      ("prewait", "yes"), ("prewait", "1"), ("warps", 16), ("stages", 0),
                      ("stages", 8), ("block_n", 8), ("block_n", 512), ("block_n", 48)):
        with pytest.raises(InputError, match=f"kernels.attention.{name}"):
            AttentionTuning(**{name: bad})


def test_decode_split_cap():
    """``AttentionTuning.decode_splits`` caps 1-row plans only; ``verify_halve`` off keeps the
    1-row count for verification plans (under ``verify_splits``)."""
    cap = _attention(decode_splits=8)
    assert ops.plan_splits(1, 8, max_len=1536, tune=cap).max_splits == 8
    assert ops.plan_splits(1, 8, max_len=1536, rows=6, tune=cap).max_splits == 12
    assert ops.plan_splits(1, 8, max_len=1536).max_splits == 24
    whole = _attention(verify_halve=False, verify_splits=16)
    assert ops.plan_splits(1, 8, max_len=1536, rows=6, tune=whole).max_splits == 16
    assert ops.plan_splits(8, 8, max_len=1536, rows=6, tune=whole).max_splits == 9
    with pytest.raises(InputError, match="kernels.attention.verify_halve"):
        AttentionTuning(verify_halve=2)
    with pytest.raises(InputError, match="kernels.attention.decode_splits"):
        AttentionTuning(decode_splits=0)


def test_tile_and_poll_switches():
    """The M-tile, panel and poll switches: defaults, accepted values, and errors that name the
    field (a power of two <= 16; true / false)."""
    gemv, att = GemvTuning(), AttentionTuning()
    assert gemv.min_block_m == 16 and gemv.panel_min_block_m == 8 and att.min_block_m == 2
    assert gemv.panel_preconvert is False and att.poll is False
    assert GemvTuning(min_block_m=4).min_block_m == 4
    assert GemvTuning(panel_preconvert=True).panel_preconvert is True
    assert AttentionTuning(min_block_m=16).min_block_m == 16
    for bad in (3, 32, 0, "8"):
        with pytest.raises(InputError, match="kernels.gemv.panel_min_block_m"):
            GemvTuning(panel_min_block_m=bad)
        with pytest.raises(InputError, match="kernels.attention.min_block_m"):
            AttentionTuning(min_block_m=bad)
    assert AttentionTuning(poll=True).poll is True
    for bad in ("yes", 1):
        with pytest.raises(InputError, match="kernels.attention.poll"):
            AttentionTuning(poll=bad)
        with pytest.raises(InputError, match="kernels.gemv.panel_preconvert"):
            GemvTuning(panel_preconvert=bad)


def test_attention_signal_off_triton_and_bad_arguments():
    """No signal where the o projection would not poll (polling off; CPU tensors: no Triton
    with PDL), and a wrong ``signal`` / ``after`` argument is an InputError naming it."""
    poll = _attention(poll=True)
    h = torch.zeros(6, 32)
    assert ops.attention_signal(h, torch.zeros(32, 32), poll) is None
    assert ops.attention_signal(h, torch.zeros(32, 32)) is None
    x, w = torch.randn(6, 32), torch.randn(32, 32)
    with pytest.raises(InputError, match="after"):
        ops.linear_deferred_norm(x, w, torch.zeros(6, 32), torch.ones(32), 1e-6, after="flag",
                                 tune=poll)
    q = torch.randn(1, 1, 2, 8)
    kc = torch.randn(4, 4, 2, 8)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    seq = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(InputError, match="signal"):
        ops.paged_attention(q, kc, kc.clone(), bt, seq, 1, 0.3, signal=object(), tune=poll)
    sig = ops.AttnSignal(torch.zeros(2, dtype=torch.int32), target=5)
    ops.paged_attention(q, kc, kc.clone(), bt, seq, 1, 0.3, signal=sig, tune=poll)
    assert sig.target == 0  # off Triton the launch leaves it unarmed
