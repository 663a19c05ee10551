"""Launches per hybrid decode step, counted on the CPU (no GPU needed): an estimate of
``hybrid_decode_kernels_per_step_b1`` for a launch plan before it reaches the H200.

A random-weight Qwen3.5 checkpoint (``save_pretrained``, tiny widths: the number of launches
does not depend on them) is served with its modules bound to the fused path simulated on CPU
(every Triton op runs its torch reference). One B = 1 plain decode forward of the target is
counted (and, after a verify, the state commit: the scratch strategy's replay): each call of
a ``speccal.kernels.ops`` function counts as one launch (the Triton kernel
it is on CUDA; ops that launch two, a split-K reduction or a split-KV combine, count one here),
every other aten op that is not a view or an allocation counts as one (a torch kernel on
CUDA); the attention rows count as one launch (``ops.paged_attention`` on CUDA; two where it
splits the keys, ``attention.splits``). Two depths (4 and 8 layers, the 3 linear + 1 full pattern) give the launches per group
of four layers and the fixed part; the estimate for the preset's depth is their line.

    python bench/count_hybrid_launches.py [--impl fla,fused] [--layers 24] [--verify 3]

What it cannot see: launches that differ between the reference and the kernel (the counts of
two-launch ops), and anything outside the target's forward (the round's sampling and input
update). ``--dense-layers 28`` counts the dense path's decode the same way as a check: 169 for
``dense-2b``, where the H200's profiler measured 174 launches for the whole step.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHAPES = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
              tie_word_embeddings=False)
_ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_SYNC = {"_local_scalar_dense", "item"}


class Counter(TorchDispatchMode):
    """Counts aten ops that launch a kernel (views and allocations do not), and the ops
    functions called (one launch each, their inner aten ops not counted)."""

    def __init__(self):
        super().__init__()
        self.by_name: collections.Counter[str] = collections.Counter()
        self.syncs = 0
        self.depth = 0  # > 0 inside an ops function
        self.active = False  # inside ``with counter``

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.depth == 0:
            if name in _SYNC:
                self.syncs += 1
            elif not func.is_view and name not in _ALLOC:
                self.by_name[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))

    def op(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*a, **kw):
            if self.active and self.depth == 0:
                self.by_name[f"ops.{name}"] += 1
            self.depth += 1
            try:
                return fn(*a, **kw)
            finally:
                self.depth -= 1
        return counted

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


def write_checkpoint(folder: Path, layers: int) -> None:
    """A ``save_pretrained`` checkpoint plus random ``mtp.*`` tensors in the layout the
    ``qwen3_5_mtp`` head reads (its layer named like the target's last full-attention one)."""
    import transformers
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(
        transformers.Qwen3_5TextConfig(**SHAPES, num_hidden_layers=layers,
                                       mtp_num_hidden_layers=1))
    hf.save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    h, last = SHAPES["hidden_size"], layers - 1
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h) * 0.1, "mtp.norm.weight": torch.zeros(h),
           "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
           "mtp.pre_fc_norm_hidden.weight": torch.zeros(h)}
    for key, t in tensors.items():
        if key.startswith(f"model.layers.{last}."):
            mtp[key.replace(f"model.layers.{last}.", "mtp.layers.0.")] = t.clone()
    tensors.update(mtp)
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_dense_checkpoint(folder: Path, layers: int) -> None:
    """A ``save_pretrained`` Qwen3 checkpoint: the dense path, whose launches per step the
    H200's profiler measured (174 for a ``dense-2b`` B = 1 decode step at b615bfd), to check
    this counter against."""
    import transformers
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=True)).save_pretrained(folder)


def count(folder: Path, impl: str, k: int = 0, strategy: str = "scratch_swap",
          dense: bool = False) -> Counter:
    """Launches of the target's first B = 1 forward over ``k + 1`` rows: a plain decode
    (``k = 0``) or a verify of ``k`` drafts (forced full acceptance). ``dense``: a Qwen3
    checkpoint (decode only; ``impl`` unused), its layers fused as the CUDA build fuses them."""
    from speccal.kernels import ops
    from speccal.kernels.config import KernelConfig, LinearAttentionTuning
    from speccal.runner import hybrid, layers
    from speccal.runner.engine import Engine, EngineConfig, RoundPlan
    from speccal.runner.hybrid import HybridModel, freeze_constants
    from speccal.runner.hybrid_state import StateStrategy
    from speccal.runner.model import TargetModel
    from speccal.runner.path import ExecutionPath, bind_path
    from speccal.runner.sampling import SamplingParams

    class FusedOnCpu(ExecutionPath):
        def fused(self, x):
            return True

    eng = Engine(EngineConfig.flat(model=str(folder), speculative=k > 0, request_buckets=(1,),
                                   max_model_len=64, block_size=4, prefill_chunk=16,
                                   draft_width=max(k, 1), state_strategy=strategy,
                                   acceptance="forced" if k else "greedy"))
    target = eng.loaded.target
    bind_path(target, FusedOnCpu(kernels=KernelConfig(
        linear_attention=LinearAttentionTuning(impl=impl))))
    if dense:
        target.fuse_weights()  # as the CUDA build does on the Triton path
    else:
        freeze_constants(target)  # as the CUDA build does, under the bound path's plan
    model_cls, attend_mod = (TargetModel, layers) if dense else (HybridModel, hybrid)
    counter = Counter()
    names = [n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n))
             and not isinstance(getattr(ops, n), type)]
    saved = {n: getattr(ops, n) for n in names}
    real_forward = model_cls.forward
    real_commit = StateStrategy.commit
    seen: list[str] = []

    def forward(self, input_ids, *a, **kw):
        if input_ids.shape[0] != k + 1 or seen:  # the first B = 1 decode / verify only
            return real_forward(self, input_ids, *a, **kw)
        seen.append("forward")
        with counter:
            return real_forward(self, input_ids, *a, **kw)

    def commit(self, *a, **kw):  # the state commit after that verify (a replay, a swap)
        if seen != ["forward"]:
            return real_commit(self, *a, **kw)
        seen.append("commit")
        with counter:
            return real_commit(self, *a, **kw)

    # the attention rows: the CPU's grid + sdpa, one ops.paged_attention on CUDA
    real_attend = attend_mod.attend_rows
    try:
        attend_mod.attend_rows = counter.op("paged_attention (CPU: attend_rows)", real_attend)
        for n in names:
            setattr(ops, n, counter.op(n, saved[n]))
        model_cls.forward = forward
        StateStrategy.commit = commit
        eng.add_request([5, 17, 3, 88, 41, 9], SamplingParams(max_tokens=3 + 2 * k,
                                                               ignore_eos=True))
        while eng.has_unfinished():
            eng.step(RoundPlan(k))
    finally:
        attend_mod.attend_rows = real_attend
        model_cls.forward = real_forward
        StateStrategy.commit = real_commit
        for n, fn in saved.items():
            setattr(ops, n, fn)
    if not seen:
        raise SystemExit("no B = 1 decode forward ran")
    return counter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="fla,fused", help="linear_attention impls, comma-separated")
    ap.add_argument("--layers", type=int, default=24, help="the preset's depth (qwen3.5-2b: 24)")
    ap.add_argument("--top", type=int, default=25, help="ops listed per impl (per 4 layers)")
    ap.add_argument("--verify", type=int, default=3,
                    help="k of the verify forwards counted (0: decode only)")
    ap.add_argument("--dense-layers", type=int, default=28,
                    help="also count the dense path's decode at this depth (dense-2b: 28; 0: "
                         "skip), the counter's check against the profiler's figure")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.layers % 4:
        ap.error(f"--layers: got {args.layers}, expected a multiple of 4 (3 linear + 1 full)")
    modes = [("decode", 0, "scratch_swap")]
    if args.verify:
        modes += [(f"verify k={args.verify} {st}", args.verify, st)
                  for st in ("scratch_swap", "snapshots")]
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for depth in (4, 8):
            folders[depth] = Path(tmp) / f"l{depth}"
            write_checkpoint(folders[depth], depth)
        if args.dense_layers:  # the dense path, per layer from 2 and 4 layers
            for depth in (2, 4):
                write_dense_checkpoint(Path(tmp) / f"d{depth}", depth)
            c2, c4 = (count(Path(tmp) / f"d{d}", "fla", dense=True) for d in (2, 4))
            per_layer = (c4.total - c2.total) // 2
            group = collections.Counter(c4.by_name)
            group.subtract(c2.by_name)
            out["dense (Qwen3) decode"] = {
                "per_4_layers": 4 * per_layer, "fixed": c2.total - 2 * per_layer,
                "host_reads": c2.syncs,
                "estimate": c2.total + per_layer * (args.dense_layers - 2),
                "layers": args.dense_layers,
                "per_4_layers_by_op": {op: 2 * n for op, n in group.most_common(args.top)}}
        for impl in args.impl.split(","):
            for mode, k, strategy in modes:
                c4, c8 = (count(folders[d], impl, k, strategy) for d in (4, 8))
                per_group = c8.total - c4.total
                fixed = c4.total - per_group
                group = collections.Counter(c8.by_name)
                group.subtract(c4.by_name)
                out[f"{impl} {mode}"] = {
                    "per_4_layers": per_group, "fixed": fixed, "host_reads": c4.syncs,
                    "estimate": fixed + per_group * args.layers // 4, "layers": args.layers,
                    "per_4_layers_by_op": dict(group.most_common(args.top))}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for name, row in out.items():
        print(f"{name}: {row['estimate']} launches at B = 1, {row['layers']} layers "
              f"({row['per_4_layers']} per 4 layers + {row['fixed']} fixed; host reads "
              f"{row['host_reads']})")
        for op, n in row["per_4_layers_by_op"].items():
            if n:
                print(f"    {n:4d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
