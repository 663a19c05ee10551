"""Routed mixture-of-experts configuration, read from a Hugging Face ``config.json`` (no torch).

This module owns :class:`MoEConfig` (what a routed-expert MLP computes: the router's scoring,
group limit, score-correction bias, scaling and renormalisation, the shared expert, and which
layers are sparse) and its parsing, :func:`moe_config_from_hf`, shared by the dense decoder
(``speccal.runner.config``) and the hybrid targets (``speccal.runner.hybrid``). The module
itself is ``speccal.runner.moe``.

The families and the keys that describe them (transformers 5 is the reference):

- Qwen lineage (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): ``num_experts`` (Qwen3-MoE
  writes ``num_local_experts``), softmax over all experts, top-k, ``norm_topk_prob``; a shared
  expert of ``shared_expert_intermediate_size`` under ``mlp.shared_expert``, scaled by
  ``sigmoid(mlp.shared_expert_gate(x))`` where the checkpoint has that gate; dense layers by
  ``mlp_only_layers`` and ``decoder_sparse_step``.
- DeepSeek-V3 lineage (DeepSeek-V3, GLM-4.5 MoE, MiMo-V2-Flash): ``n_routed_experts``, sigmoid
  scores, ``e_score_correction_bias`` added for the *selection* only, group-limited selection
  (``n_group`` groups scored by the sum of their two best biased scores, the ``topk_group``
  best kept), the weights the unbiased scores of the chosen experts, renormalised
  (``norm_topk_prob``, + 1e-20) and multiplied by ``routed_scaling_factor``; ``n_shared_experts``
  ungated shared experts of ``n_shared_experts * moe_intermediate_size`` under
  ``mlp.shared_experts``; dense layers by ``first_k_dense_replace`` (or MiMo-V2-Flash's
  ``mlp_layer_types``). Hub configs also name the method: ``scoring_func`` (``sigmoid``) and
  ``topk_method`` (``noaux_tc``); transformers' classes hard-code them, so they are checked,
  and any other value refused.

Which scoring a config means is read from its keys, never from a model name: ``scoring_func``
when present, else ``topk_method`` (``noaux_tc``: sigmoid; ``greedy``: softmax), else a
score-correction bias among the checkpoint's tensors (sigmoid), else the expert-count key's
lineage (``n_routed_experts``: sigmoid, as every transformers class with that key that this
runner can build computes; ``num_experts`` / ``num_local_experts``: softmax). A routing feature
outside these is refused naming its key (:class:`~speccal.base.errors.UnsupportedError`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from speccal.base.errors import InputError, UnsupportedError

SCORINGS = ("softmax", "sigmoid")
#: ``topk_method`` values -> the scoring they mean (DeepSeek configs name the method)
TOPK_METHODS = {"noaux_tc": "sigmoid", "greedy": "softmax"}
#: config keys that give the number of routed experts, in the order they are looked up
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
SHARED_FORMS = ("shared_expert", "shared_experts")  # Qwen (one, gated) / DeepSeek (n, ungated)

_LAYER_STEM = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class MoEConfig:
    """A routed-expert MLP (SwiGLU experts) and the layers that have one.

    Attributes
    ----------
    num_experts, top_k, expert_intermediate_size : int
    scoring : ``softmax`` (over all experts) or ``sigmoid`` (per expert).
    num_groups, topk_groups : int
        Group-limited selection: experts in ``num_groups`` equal groups, only the
        ``topk_groups`` best groups (sum of each group's two best selection scores) eligible.
        ``1, 1``: no limit.
    has_score_bias : bool
        A per-expert ``gate.e_score_correction_bias`` is added to the scores to select experts
        (not to weight them).
    routed_scaling_factor : float
        Multiplies the routed experts' weights.
    is_topk_normalised : bool
        The chosen experts' weights are divided by their sum.
    shared_intermediate_size : int
        Width of the shared expert (0: none).
    shared_form : str
        Module and checkpoint stem of the shared expert, a :data:`SHARED_FORMS` entry.
    is_shared_gated : bool
        The shared expert's output is scaled by ``sigmoid(shared_expert_gate(x))``.
    sparse_layers : tuple of int
        The layers whose MLP is routed (the others have the dense SwiGLU).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    has_score_bias: bool = False
    routed_scaling_factor: float = 1.0
    is_topk_normalised: bool = False
    shared_intermediate_size: int = 0
    shared_form: str = "shared_expert"
    is_shared_gated: bool = False
    sparse_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_intermediate_size", "num_groups",
                     "topk_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"config.json:{_KEY_OF.get(name, name)}", value,
                                 "an integer >= 1")
        if self.top_k > self.num_experts:
            raise InputError("config.json:num_experts_per_tok", self.top_k,
                             f"at most the number of routed experts ({self.num_experts})")
        if self.scoring not in SCORINGS:
            raise UnsupportedError(f"config.json:scoring_func={self.scoring!r}: routed-expert "
                                   f"scoring is implemented for {list(SCORINGS)}")
        if self.shared_form not in SHARED_FORMS:
            raise InputError("MoEConfig.shared_form", self.shared_form, f"one of {SHARED_FORMS}")
        if self.num_experts % self.num_groups:
            raise InputError("config.json:n_group", self.num_groups,
                             f"a divisor of the number of routed experts ({self.num_experts})")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1:
            if self.scoring != "sigmoid":
                raise UnsupportedError(
                    f"config.json:n_group={self.num_groups} with softmax scoring: group-limited "
                    "softmax routing (DeepSeek-V2's topk_method 'group_limited_greedy') is not "
                    "implemented, expected n_group 1 or sigmoid (noaux_tc) routing")
            if per_group < 2:
                raise InputError("config.json:n_group", self.num_groups,
                                 "groups of at least 2 experts (a group scores its best two)")
        if self.topk_groups > self.num_groups:
            raise InputError("config.json:topk_group", self.topk_groups,
                             f"at most n_group={self.num_groups}")
        if self.top_k > self.topk_groups * per_group:
            raise InputError("config.json:num_experts_per_tok", self.top_k,
                             f"at most the experts of the topk_group={self.topk_groups} groups "
                             f"kept ({self.topk_groups * per_group})")
        if self.has_score_bias and self.scoring != "sigmoid":
            raise UnsupportedError(
                "checkpoint tensor mlp.gate.e_score_correction_bias with softmax scoring: a "
                "score-correction bias is implemented for sigmoid (noaux_tc) routing only")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the routed one."""
        return layer in self.sparse_layers


_KEY_OF = {"num_experts": "num_experts", "top_k": "num_experts_per_tok",
           "expert_intermediate_size": "moe_intermediate_size", "num_groups": "n_group",
           "topk_groups": "topk_group"}


def _need_int(cfg: Mapping[str, Any], key: str, what: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise InputError(f"config.json:{key}", None, f"a value ({what})")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"config.json:{key}", value, "an integer")
    return value


def _opt_int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    return default if cfg.get(key) is None else _need_int(cfg, key, "")


def _stems(names: Iterable[str]) -> set[str]:
    """The per-layer stems (``mlp.gate.weight``) of ``names``' layer tensors."""
    out = set()
    for key in names:
        m = _LAYER_STEM.match(key)
        if m is not None:
            out.add(m.group(2))
    return out


def expert_count(cfg: Mapping[str, Any]) -> tuple[str, int] | None:
    """The key giving the number of routed experts and its value, or None (no routed MLP)."""
    for key in EXPERT_COUNT_KEYS:
        if cfg.get(key):
            return key, cfg[key]
    return None


def _scoring(cfg: Mapping[str, Any], count_key: str, has_bias: bool | None) -> str:
    func, method = cfg.get("scoring_func"), cfg.get("topk_method")
    if method is not None and method not in TOPK_METHODS:
        raise UnsupportedError(
            f"config.json:topk_method={method!r}: routed-expert selection is implemented for "
            f"{sorted(TOPK_METHODS)} (noaux_tc: sigmoid scores, score-correction bias, group "
            "limit; greedy: softmax top-k)")
    if func is not None:
        if func not in SCORINGS:
            raise UnsupportedError(f"config.json:scoring_func={func!r}: routed-expert scoring "
                                   f"is implemented for {list(SCORINGS)}")
        if method is not None and TOPK_METHODS[method] != func:
            raise UnsupportedError(
                f"config.json:topk_method={method!r} with scoring_func={func!r}: the method "
                f"is implemented with {TOPK_METHODS[method]!r} scores only")
        return func
    if method is not None:
        return TOPK_METHODS[method]
    if has_bias:
        return "sigmoid"
    return "sigmoid" if count_key == "n_routed_experts" else "softmax"


def _sparse_layers(cfg: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The routed layers by whichever of the families' dense-layer keys the config has; two
    forms that disagree are refused (each family's class reads only its own)."""
    forms: dict[str, set[int]] = {}
    everything = set(range(num_layers))
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or any(
                t not in ("dense", "sparse") for t in types):
            raise InputError("config.json:mlp_layer_types", types,
                             f"a list of {num_layers} entries 'dense' or 'sparse'")
        forms["mlp_layer_types"] = {i for i, t in enumerate(types) if t == "sparse"}
    if cfg.get("first_k_dense_replace") is not None:
        first = _need_int(cfg, "first_k_dense_replace", "")
        forms["first_k_dense_replace"] = set(range(first, num_layers))
    freq = cfg.get("moe_layer_freq")
    if freq is not None and freq != 1:
        raise UnsupportedError(f"config.json:moe_layer_freq={freq!r}: a routed MLP on every "
                               "layer past the dense ones is implemented, expected 1")
    if cfg.get("decoder_sparse_step") is not None or cfg.get("mlp_only_layers"):
        step = _opt_int(cfg, "decoder_sparse_step", 1)
        if step < 1:
            raise InputError("config.json:decoder_sparse_step", step, "an integer >= 1")
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                             for i in only):
            raise InputError("config.json:mlp_only_layers", only, "a list of layer indices")
        forms["decoder_sparse_step / mlp_only_layers"] = {
            i for i in range(num_layers) if i not in only and (i + 1) % step == 0}
    distinct = {frozenset(s) for s in forms.values()}
    if len(distinct) > 1:
        raise UnsupportedError(
            f"config.json: the dense-layer keys {sorted(forms)} name different routed layers "
            f"({ {k: sorted(v) for k, v in forms.items()} }); expected one form, or forms that "
            "agree")
    return tuple(sorted(distinct.pop())) if distinct else tuple(sorted(everything))


def moe_config_from_hf(cfg: Mapping[str, Any], key_names: Iterable[str] | None,
                       num_layers: int, *, default_norm: bool | None = None) -> MoEConfig | None:
    """The routed-expert MLP a ``config.json`` describes, or None when it has none.

    ``key_names``: the checkpoint's tensor names; when given, the score-correction bias and
    the shared expert's gate are read from them (else the config's lineage decides).
    ``default_norm``: what an absent ``norm_topk_prob`` means (the hybrid families' classes
    always renormalise and write no key: True); None refuses its absence, because the dense
    families' classes default it differently (Qwen2-MoE / Qwen3-MoE false, the DeepSeek-V3
    lineage true) and ``save_pretrained`` always writes it.

    Raises
    ------
    InputError
        A missing or invalid routing field, naming it.
    UnsupportedError
        A routing feature that is not implemented (scoring, selection method, group-limited
        softmax, two shared-expert forms, ``moe_layer_freq``), naming the key and its value.
    """
    found = expert_count(cfg)
    if found is None:
        return None
    count_key, num_experts = found
    stems = _stems(key_names) if key_names is not None else None
    has_bias = None if stems is None else "mlp.gate.e_score_correction_bias" in stems
    scoring = _scoring(cfg, count_key, has_bias)
    if has_bias is None:
        has_bias = scoring == "sigmoid" and count_key == "n_routed_experts"
    shared_q = _opt_int(cfg, "shared_expert_intermediate_size", 0)
    num_shared = _opt_int(cfg, "n_shared_experts", 0)
    expert_inter = _need_int(cfg, "moe_intermediate_size", "the routed experts' width")
    if shared_q and num_shared:
        raise UnsupportedError(
            f"config.json:n_shared_experts={num_shared} with shared_expert_intermediate_size="
            f"{shared_q}: two shared-expert forms, expected one of them")
    if num_shared:
        shared_form, shared_inter, gated = "shared_experts", num_shared * expert_inter, False
    else:
        shared_form, shared_inter = "shared_expert", shared_q
        gated = bool(shared_q) and (stems is None or "mlp.shared_expert_gate.weight" in stems)
    scale = cfg.get("routed_scaling_factor")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise InputError("config.json:routed_scaling_factor", scale, "a number or null")
    norm = cfg.get("norm_topk_prob", default_norm)
    if not isinstance(norm, bool):
        raise InputError("config.json:norm_topk_prob", cfg.get("norm_topk_prob"),
                         "true or false (whether the chosen experts' weights are renormalised; "
                         "families default it differently, so it is not guessed)")
    return MoEConfig(
        num_experts=_need_int(cfg, count_key, "the number of routed experts"),
        top_k=_need_int(cfg, "num_experts_per_tok", "the experts each token is routed to"),
        expert_intermediate_size=expert_inter,
        scoring=scoring,
        num_groups=_opt_int(cfg, "n_group", 1),
        topk_groups=_opt_int(cfg, "topk_group", 1),
        has_score_bias=bool(has_bias),
        routed_scaling_factor=1.0 if scale is None else float(scale),
        is_topk_normalised=bool(norm),
        shared_intermediate_size=shared_inter,
        shared_form=shared_form,
        is_shared_gated=gated,
        sparse_layers=_sparse_layers(cfg, num_layers),
    )
