"""The strict loader (SPEC section 7, issue 34 item 2): every checkpoint tensor is consumed or
refused by name, every config feature that changes the computation is implemented or refused
naming its key.

Ground truth: transformers' greedy ``generate`` (fp32, CPU) on tiny random checkpoints written
by ``save_pretrained`` (hidden 64, 2 layers, vocab 256; biases and weights randomised so that
every term matters, weights scaled so that fp32 op-order noise cannot flip an argmax). Per
family: the feature on -> speccal's plain greedy tokens equal transformers'; an extra tensor
no module consumes -> refused naming it. MiMo and DeepSeek-style MTP layouts (no transformers
class) use the synthetic checkpoints of ``test_draft_families``; the hybrid families the
``save_pretrained`` checkpoints of ``test_hybrid_engine``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speccal.base.errors import InputError, UnsupportedError
from speccal.live.generate import generate
from speccal.runner.config import ModelConfig, config_from_hf, layer_windows
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.loader import load_model
from speccal.runner.model import TargetModel
from speccal.runner.path import ExecutionPath, bind_path
from speccal.runner.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

from tests.runner.test_draft_families import make_checkpoint  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
             pad_token_id=None, tie_word_embeddings=False)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 101, 7, 250, 18]
NUM_TOKENS = 24
CPU = torch.device("cpu")


def _save(path, cls_name: str, cfg_cls: str, **extra):
    """A random-weight ``save_pretrained`` checkpoint of ``cls_name``; returns the HF model."""
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**SMALL, **extra})
    model = getattr(transformers, cls_name)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # transformers initialises biases to 0: make them count
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _ours(path, **kw) -> list[int]:
    cfg = dict(model=str(path), speculative=False, request_buckets=(1,), block_size=4,
               prefill_chunk=8, max_model_len=128) | kw
    eng = Engine(EngineConfig(**cfg))
    return generate(eng, [PROMPT], SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True), 0)[0]


def _add_tensors(folder, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` into the folder's single safetensors file."""
    path = folder / "model.safetensors"
    saved = load_file(str(path))
    saved.update(tensors)
    save_file(saved, str(path), metadata={"format": "pt"})


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def _load(folder, need_draft: bool = False, max_model_len: int = 128):
    return load_model(str(folder), device=CPU, dtype="float32", max_model_len=max_model_len,
                      max_positions=max_model_len + 8, need_draft=need_draft)


# ------------------------------------------------------------------------ features, implemented

DENSE_FEATURES = {
    # Qwen3 attention_bias: q/k/v *and* o_proj biases (the o bias used to be dropped)
    "qwen3-attention-bias": ("Qwen3ForCausalLM", "Qwen3Config", {"attention_bias": True}),
    # Llama attention_bias (q/k/v/o) and mlp_bias (gate/up/down)
    "llama-attention-mlp-bias": ("LlamaForCausalLM", "LlamaConfig",
                                 {"attention_bias": True, "mlp_bias": True}),
    # Mistral: sliding_window alone (no use_sliding_window key) windows every layer
    "mistral-sliding-window": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 5}),
    # Qwen2: q/k/v bias (no key), use_sliding_window + max_window_layers: layer 1 windowed
    "qwen2-sliding-window": ("Qwen2ForCausalLM", "Qwen2Config",
                             {"use_sliding_window": True, "sliding_window": 6,
                              "max_window_layers": 1}),
    # Qwen3 with a window on both layers (layer_types, transformers 5)
    "qwen3-sliding-window": ("Qwen3ForCausalLM", "Qwen3Config",
                             {"use_sliding_window": True, "sliding_window": 4,
                              "max_window_layers": 0}),
}


@pytest.fixture(scope="module", params=sorted(DENSE_FEATURES))
def dense_feature(request, tmp_path_factory):
    cls_name, cfg_cls, extra = DENSE_FEATURES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = _save(folder, cls_name, cfg_cls, **extra)
    return request.param, folder, model, _hf_greedy(model, PROMPT, NUM_TOKENS)


def test_feature_on_greedy_equals_transformers(dense_feature):
    name, folder, _, ref = dense_feature
    assert len(set(ref)) > 3  # non-degenerate
    assert _ours(folder) == ref


def test_feature_matters(dense_feature):
    """The checkpoint with the feature switched off in its config decodes differently in
    transformers: the equality above is not vacuous."""
    name, folder, model, ref = dense_feature
    cfg = model.config.to_dict()
    cfg.update(attention_bias=False, mlp_bias=False, sliding_window=None,
               use_sliding_window=False, layer_types=None)
    plain = getattr(transformers, type(model.config).__name__)(**{
        k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                  "transformers_version")})
    other = type(model)(plain).eval()
    other.load_state_dict(model.state_dict(), strict=False)
    assert _hf_greedy(other, PROMPT, NUM_TOKENS) != ref


def test_chunked_prefill_and_decode_rows_keep_the_window(dense_feature):
    """Prefill in chunks of 3 (keys read by slot across chunks) and of the whole prompt."""
    name, folder, _, ref = dense_feature
    if "sliding" not in name:
        pytest.skip("windows only")
    assert _ours(folder, prefill_chunk=3) == ref
    assert _ours(folder, prefill_chunk=64) == ref


def test_window_larger_than_the_context_is_a_no_op(tmp_path):
    model = _save(tmp_path, "MistralForCausalLM", "MistralConfig", sliding_window=4096)
    loaded = _load(tmp_path)
    assert all(layer.self_attn.window == 0 for layer in loaded.target.model.layers)
    loaded.target.fuse_weights()  # the Triton path's step: accepted (no window left)
    assert _ours(tmp_path) == _hf_greedy(model, PROMPT, NUM_TOKENS)


def test_window_is_refused_on_the_triton_path(tmp_path):
    _save(tmp_path, "MistralForCausalLM", "MistralConfig", sliding_window=5)
    loaded = _load(tmp_path)
    assert [layer.self_attn.window for layer in loaded.target.model.layers] == [5, 5]
    with pytest.raises(UnsupportedError, match=r"config\.json:sliding_window=5.*Triton"):
        loaded.target.fuse_weights()


def test_speculative_rows_keep_the_window_and_stay_lossless(tmp_path):
    """A MiMo-layout checkpoint with a window of 5: verify rows (host and in-graph update)
    attend within the window: speculative greedy equals plain greedy, which the window
    changes."""
    make_checkpoint(tmp_path, "mimo", bias=True, qk_norm=False)
    prompt = [t % 96 for t in PROMPT[:9]]

    def run(k: int, **kw) -> list[int]:
        eng = Engine(EngineConfig(model=str(tmp_path), draft_width=3, request_buckets=(1,),
                                  block_size=4, prefill_chunk=4, max_model_len=128,
                                  speculative=k > 0, **kw))
        return generate(eng, [prompt], SamplingParams(max_tokens=20, ignore_eos=True), k)[0]

    full = run(0)
    _edit_config(tmp_path, sliding_window=5)
    windowed = run(0)
    assert windowed != full
    for k in (1, 3):
        assert run(k) == windowed
        assert run(k, path=ExecutionPath(input_update="in_graph")) == windowed


def test_o_and_mlp_biases_on_the_fused_path(tmp_path, fused_on_cpu):
    """The Triton path's layer code (every op on its reference here) adds the o and MLP biases:
    the per-op path, since the fused layer's epilogues have none."""
    model = _save(tmp_path, "LlamaForCausalLM", "LlamaConfig", attention_bias=True,
                  mlp_bias=True)
    loaded = _load(tmp_path)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = model(ids[None]).logits[0]
        loaded.target.fuse_weights()
    assert all(layer.mlp.gate_up_bias is not None for layer in loaded.target.model.layers)
    bind_path(loaded.target, fused_on_cpu())
    rows = torch.zeros(4)  # a decode / verify step's row count
    assert not any(layer.can_fuse(rows, loaded.target.rotary)
                   for layer in loaded.target.model.layers)
    torch.testing.assert_close(_logits_of(loaded, ids), want, atol=2e-3, rtol=1e-4)


def _logits_of(loaded, ids: torch.Tensor) -> torch.Tensor:
    """One forward of ``ids`` (one request, positions 0 ..) through the loaded target."""
    from speccal.runner.attention import AttnMeta
    from speccal.runner.kv_cache import KVCache

    cfg = loaded.config
    n = ids.shape[0]
    kv = KVCache(cfg.num_hidden_layers, 1 + -(-n // 4), 4, cfg.num_key_value_heads,
                 cfg.head_dim, torch.float32, CPU)
    blocks = torch.arange(1, 1 + -(-n // 4))
    pos = torch.arange(n)
    slots = blocks[pos // 4] * 4 + pos % 4
    meta = AttnMeta(slots, torch.arange(n), blocks[None].int(), torch.tensor([n]).int(), n)
    with torch.no_grad():
        return loaded.target.logits(loaded.target(ids, pos, meta, kv.layers))


# -------------------------------------------------------------- every tensor consumed or refused

UNKNOWN = "model.layers.0.self_attn.sinks"  # attention sinks: a feature the runner lacks


@pytest.mark.parametrize("cls_name,cfg_cls", [
    ("Qwen3ForCausalLM", "Qwen3Config"), ("LlamaForCausalLM", "LlamaConfig"),
    ("MistralForCausalLM", "MistralConfig"), ("Qwen2ForCausalLM", "Qwen2Config"),
], ids=["qwen3", "llama", "mistral", "qwen2"])
def test_unknown_tensor_is_refused_by_name(tmp_path, cls_name, cfg_cls):
    _save(tmp_path, cls_name, cfg_cls)
    _load(tmp_path)  # loads as written
    _add_tensors(tmp_path, {UNKNOWN: torch.zeros(4), "model.extra.weight": torch.zeros(2)})
    with pytest.raises(InputError, match=r"2 that no module consumes \(model\.extra\.weight, "
                                         r"model\.layers\.0\.self_attn\.sinks\)"):
        _load(tmp_path)


def test_refusal_lists_the_first_names_and_the_count(tmp_path):
    _save(tmp_path, "Qwen3ForCausalLM", "Qwen3Config")
    _add_tensors(tmp_path, {f"extra.{i:02d}": torch.zeros(1) for i in range(9)})
    with pytest.raises(InputError, match=r"9 that no module consumes \(extra\.00, .*extra\.05 "
                                         r"and 3 more\)"):
        _load(tmp_path)


def test_rotary_inv_freq_buffers_are_ignored_on_purpose(tmp_path):
    model = _save(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    _add_tensors(tmp_path, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                            for i in range(2)})
    assert _ours(tmp_path) == _hf_greedy(model, PROMPT, NUM_TOKENS)


def test_tied_head_tensor_is_ignored_on_purpose(tmp_path):
    _save(tmp_path, "Qwen3ForCausalLM", "Qwen3Config", tie_word_embeddings=True)
    saved = load_file(str(tmp_path / "model.safetensors"))
    _add_tensors(tmp_path, {"lm_head.weight": saved["model.embed_tokens.weight"]})
    assert _load(tmp_path).config.tie_word_embeddings


def test_bias_tensors_the_config_switches_off_are_refused(tmp_path):
    """``attention_bias: false`` with o biases present: transformers builds no bias and drops
    them; the loader refuses rather than choose."""
    _save(tmp_path, "Qwen3ForCausalLM", "Qwen3Config", attention_bias=True)
    _edit_config(tmp_path, attention_bias=False)
    with pytest.raises(InputError, match=r"config\.json:attention_bias: got False.*"
                                         r"self_attn\.o_proj\.bias"):
        _load(tmp_path)


def test_config_bias_without_bias_tensors_is_refused(tmp_path):
    _save(tmp_path, "LlamaForCausalLM", "LlamaConfig")
    _edit_config(tmp_path, mlp_bias=True)
    with pytest.raises(InputError, match=r"config\.json:mlp_bias: got True.*gate_proj\.bias"):
        _load(tmp_path)


@pytest.mark.parametrize("layout,unknown", [
    ("mimo", "model.mtp_layers.0.self_attn.sinks"),
    ("deepseek", "model.layers.2.shared_head.extra.weight"),
])
def test_mtp_layouts_refuse_unknown_tensors(tmp_path, layout, unknown):
    """MiMo / DeepSeek-style heads: an unknown tensor in the target or the head is refused; a
    head's tensors are dropped on purpose (by its descriptor) when no head is built."""
    make_checkpoint(tmp_path, layout)
    _load(tmp_path, need_draft=True)
    _add_tensors(tmp_path, {unknown: torch.zeros(3)})
    with pytest.raises(InputError, match=rf"1 that no module consumes \({unknown}\)"):
        _load(tmp_path, need_draft=True)
    assert _load(tmp_path, need_draft=False).draft is None  # the head's keys: dropped
    _add_tensors(tmp_path, {UNKNOWN: torch.zeros(3)})
    with pytest.raises(InputError, match=rf"\({UNKNOWN}\)"):
        _load(tmp_path, need_draft=False)


def test_mtp_head_biases_are_read_from_the_head_keys(tmp_path):
    """A MiMo head whose layer has an o bias (the target's has none): consumed, and used."""
    make_checkpoint(tmp_path, "mimo")
    _add_tensors(tmp_path, {"model.mtp_layers.0.self_attn.o_proj.bias": torch.ones(32)})
    loaded = _load(tmp_path, need_draft=True)
    assert loaded.draft.layer.self_attn.o_proj.bias is not None
    assert loaded.target.model.layers[0].self_attn.o_proj.bias is None


# ------------------------------------------------------------------------------ hybrid families

def _hybrid(tmp_path, kind: str):
    from tests.runner.test_hybrid_engine import write_checkpoint

    folder = tmp_path / kind
    folder.mkdir()
    return write_checkpoint(folder, kind), folder


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_unknown_tensor_is_refused(tmp_path, kind):
    _, folder = _hybrid(tmp_path, kind)
    _load(folder, need_draft=True)
    _add_tensors(folder, {"model.layers.3.self_attn.sinks": torch.zeros(4)})
    with pytest.raises(InputError, match=r"\(model\.layers\.3\.self_attn\.sinks\)"):
        _load(folder, need_draft=True)
    with pytest.raises(InputError, match=r"\(model\.layers\.3\.self_attn\.sinks\)"):
        _load(folder, need_draft=False)


def test_hybrid_unknown_head_tensor_is_refused(tmp_path):
    _, folder = _hybrid(tmp_path, "qwen3_5")
    _add_tensors(folder, {"mtp.layers.0.self_attn.sinks": torch.zeros(4)})
    with pytest.raises(InputError, match=r"\(mtp\.layers\.0\.self_attn\.sinks\)"):
        _load(folder, need_draft=True)
    _load(folder, need_draft=False)  # no head built: its family's keys dropped on purpose


def test_hybrid_attention_bias_equals_transformers(tmp_path):
    """Qwen3.5 ``attention_bias``: q/k/v and o biases of the gated attention layers."""
    from tests.runner.test_hybrid_engine import SHAPES, _randomise, torch_linear_attention

    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        **SHAPES, attention_bias=True))
    _randomise(hf, 1)
    hf.eval()
    hf.save_pretrained(tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.3.self_attn.o_proj.bias" in keys
    with torch_linear_attention("qwen3_5"):
        ref = _hf_greedy(hf, PROMPT[:11], 12)
    prompt = [t % SHAPES["vocab_size"] for t in PROMPT[:11]]
    assert prompt == PROMPT[:11]
    eng = Engine(EngineConfig(model=str(tmp_path), speculative=False, request_buckets=(1,),
                              block_size=4, prefill_chunk=8, max_model_len=64))
    got = generate(eng, [prompt], SamplingParams(max_tokens=12, ignore_eos=True), 0)[0]
    assert got == ref


QWEN35_MOE = dict(vocab_size=96, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=32, tie_word_embeddings=False)


def test_qwen3_5_moe_without_intermediate_size_equals_transformers(tmp_path):
    """``qwen3_5_moe_text``: transformers writes no ``intermediate_size`` (every MLP is routed);
    the checkpoint loads as written and decodes transformers' tokens."""
    from tests.runner.test_hybrid_engine import _randomise, torch_linear_attention

    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**QWEN35_MOE))
    _randomise(hf, 1)
    hf.eval()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in cfg
    with torch_linear_attention("qwen3_5_moe"):
        ref = _hf_greedy(hf, PROMPT[:11], 12)
    eng = Engine(EngineConfig(model=str(tmp_path), speculative=False, request_buckets=(1,),
                              block_size=4, prefill_chunk=8, max_model_len=64))
    got = generate(eng, [PROMPT[:11]], SamplingParams(max_tokens=12, ignore_eos=True), 0)[0]
    assert got == ref
    _add_tensors(tmp_path, {"model.layers.0.mlp.experts.9.up_proj.weight": torch.zeros(2)})
    with pytest.raises(InputError, match=r"\(model\.layers\.0\.mlp\.experts\.9\.up_proj"):
        _load(tmp_path, max_model_len=64)


def test_moe_config_missing_a_field_is_not_called_a_dense_decoder():
    cfg = {k: v for k, v in QWEN35_MOE.items() if k != "hidden_size"}
    cfg |= {"model_type": "qwen3_5_moe_text",
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    from speccal.runner.hybrid import hybrid_config_from_hf

    with pytest.raises(InputError, match="config.json:hidden_size") as err:
        hybrid_config_from_hf(cfg)
    assert "dense" not in str(err.value)
    assert "hybrid" in str(err.value)


def test_hybrid_dense_mlp_layers_still_need_intermediate_size():
    cfg = dict(QWEN35_MOE, layer_types=["linear_attention"] * 3 + ["full_attention"],
               mlp_only_layers=[1])
    from speccal.runner.hybrid import hybrid_config_from_hf

    with pytest.raises(InputError, match=r"config\.json:intermediate_size.*layers \[1\]"):
        hybrid_config_from_hf(cfg)


# ------------------------------------------------------------------------- config keys refused

BASE = dict(SMALL, hidden_act="silu", architectures=["TestForCausalLM"], model_type="test")


@pytest.mark.parametrize("key,value", [
    ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
    ("query_pre_attn_scalar", 144), ("kv_lora_rank", 512), ("attention_multiplier", 0.5),
    ("logits_scaling", 8.0), ("no_rope_layers", [1, 0]), ("hidden_activation", "gelu"),
    ("hidden_act", "gelu_pytorch_tanh"), ("rope_interleave", True),
])
def test_unimplemented_config_feature_is_refused_naming_the_key(key, value):
    with pytest.raises(UnsupportedError, match=rf"config\.json:{key}="):
        config_from_hf(BASE | {key: value})


@pytest.mark.parametrize("key,value", [
    ("attn_logit_softcapping", None), ("attention_multiplier", 1.0), ("no_rope_layers", [1, 1]),
    ("rope_interleave", False),
])
def test_neutral_values_of_those_keys_are_accepted(key, value):
    config_from_hf(BASE | {key: value})


def test_per_layer_type_rope_parameters_are_refused():
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedError, match="config.json:rope_parameters"):
        config_from_hf(BASE | {"rope_parameters": rope})


def test_ambiguous_window_is_refused():
    """``layer_types`` without a sliding layer, a window and no ``use_sliding_window``:
    Mistral's code would window every layer, the layer-typed families none."""
    with pytest.raises(UnsupportedError, match=r"config\.json:sliding_window=8"):
        config_from_hf(BASE | {"sliding_window": 8,
                               "layer_types": ["full_attention", "full_attention"]})


@pytest.mark.parametrize("cfg,want", [
    ({"sliding_window": 8}, (8, 8)),  # Mistral
    ({"sliding_window": 8, "use_sliding_window": False}, ()),  # Qwen2 / Qwen3, off
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, (0, 8)),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, (8, 0)),
    ({"sliding_window": None}, ()),
])
def test_layer_windows_follow_transformers(cfg, want):
    assert layer_windows(cfg, 2) == want
    assert config_from_hf(BASE | cfg).sliding_windows == want


def test_windows_of_transformers_configs_match_its_layer_types():
    for cls, extra in [("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 1}),
                       ("Qwen3Config", {"use_sliding_window": True, "max_window_layers": 0}),
                       ("Qwen3Config", {})]:
        hf = getattr(transformers, cls)(**SMALL, sliding_window=8, **extra)
        want = tuple(8 if t == "sliding_attention" else 0 for t in hf.layer_types)
        assert config_from_hf(hf.to_dict()).sliding_windows == (want if any(want) else ())


# ------------------------------------------------------------------------- unreadable inputs

@pytest.mark.parametrize("key,value,expected", [
    ("num_hidden_layers", "two", "an integer"),
    ("hidden_size", 64.5, "an integer"),
    ("vocab_size", True, "an integer"),
    ("rms_norm_eps", "small", "a number"),
    ("tie_word_embeddings", "yes", "true or false"),
    ("sliding_window", "big", "an integer >= 1 or null"),
])
def test_wrong_config_types_are_one_line_domain_errors(tmp_path, key, value, expected):
    _save(tmp_path, "Qwen3ForCausalLM", "Qwen3Config")
    _edit_config(tmp_path, **{key: value, "use_sliding_window": True} if key == "sliding_window"
                 else {key: value})
    with pytest.raises(InputError) as err:
        _load(tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"config.json:{key}: got {value!r}") and expected in msg
    assert "\n" not in msg


def test_wrong_config_type_exits_2_from_the_cli(tmp_path):
    from typer.testing import CliRunner

    from speccal.cli import app

    _save(tmp_path, "Qwen3ForCausalLM", "Qwen3Config")
    _edit_config(tmp_path, num_hidden_layers="two")
    res = CliRunner().invoke(app, ["generate", "--model", str(tmp_path), "--plain",
                                   "--device", "cpu", "--prompt-ids", "1,2,3"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert "num_hidden_layers" in res.output


def test_truncated_safetensors_is_a_domain_error_naming_the_file(tmp_path):
    _save(tmp_path, "Qwen3ForCausalLM", "Qwen3Config")
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"checkpoint file .*model\.safetensors: got an "
                                         r"unreadable file") as err:
        _load(tmp_path)
    assert "\n" not in str(err.value)


def test_corrupt_safetensors_header_is_a_domain_error(tmp_path):
    _save(tmp_path, "Qwen3ForCausalLM", "Qwen3Config")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(InputError, match=r"checkpoint file .*model\.safetensors"):
        _load(tmp_path)


def test_model_config_window_count_is_checked():
    with pytest.raises(InputError, match="sliding_windows"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                    sliding_windows=(4,))


def test_target_model_layers_take_their_window():
    cfg = config_from_hf(BASE | {"sliding_window": 8, "use_sliding_window": True,
                                 "max_window_layers": 1})
    model = TargetModel(cfg, 8, 8)
    assert [layer.self_attn.window for layer in model.model.layers] == [0, 8]


def test_tensor_parallel_shards_of_mlp_biases_sum_to_the_full_layer(tmp_path):
    """TP=2 shards of a Llama ``mlp_bias`` layer: gate / up biases split with their rows, the
    down bias replicated (each rank adds it once after the reduction: with no group bound
    here, each shard's output carries it, so the shards sum to the layer plus one extra)."""
    from speccal.runner.distributed.load import load_shard

    _save(tmp_path, "LlamaForCausalLM", "LlamaConfig", mlp_bias=True, attention_bias=True)
    full = _load(tmp_path).target.model.layers[1].mlp
    shards = [load_shard(str(tmp_path), rank=r, tp=2, device=CPU, dtype="float32",
                         max_model_len=64, max_positions=72, need_draft=False)[0]
              for r in range(2)]
    x = torch.randn(5, SMALL["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        parts = [s.target.model.layers[1].mlp(x) for s in shards]
        torch.testing.assert_close(sum(parts) - full.down_proj.bias, full(x))


@pytest.mark.parametrize("window", [1, 3, 6])
def test_every_torch_attention_path_masks_the_same_window(window):
    """One request of 9 keys, its last 4 rows as queries: the grid attention, the kernels'
    reference (dense and packed layouts) and the by-slot prefill attention agree, and equal
    a direct softmax over keys ``p - W + 1 .. p``."""
    from speccal.kernels import ops
    from speccal.runner.attention import attend_own_keys, paged_attention_torch

    g = torch.Generator().manual_seed(0)
    t, n, h, hk, d, bs = 9, 4, 4, 2, 8, 4
    k_cache = torch.randn(4, bs, hk, d, generator=g)
    v_cache = torch.randn(4, bs, hk, d, generator=g)
    table = torch.tensor([[1, 3, 2]], dtype=torch.int32)
    q = torch.randn(1, n, h, d, generator=g)
    seq = torch.tensor([t], dtype=torch.int32)
    slots = (table[0].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:t]
    keys = k_cache.view(-1, hk, d)[slots].repeat_interleave(h // hk, dim=1)  # [T, H, D]
    values = v_cache.view(-1, hk, d)[slots].repeat_interleave(h // hk, dim=1)
    want = torch.empty(n, h, d)
    for i in range(n):
        p = t - n + i
        lo = max(0, p - window + 1)
        att = torch.softmax(torch.einsum("hd,khd->hk", q[0, i], keys[lo:p + 1]) * d**-0.5, -1)
        want[i] = torch.einsum("hk,khd->hd", att, values[lo:p + 1])
    got = {
        "grid": paged_attention_torch(q, k_cache, v_cache, table, seq, n, d**-0.5, window)[0],
        "dense": ops.paged_attention(q, k_cache, v_cache, table, seq, n, d**-0.5,
                                     sliding_window=window)[0],
        "packed": ops.paged_attention(q[0].contiguous(), k_cache, v_cache, table, seq, n,
                                      d**-0.5, cu_q_lens=torch.tensor([0, n]).int(),
                                      sliding_window=window),
        "by_slot": attend_own_keys(q[0], k_cache, v_cache, slots, d**-0.5, window),
    }
    for name, out in got.items():
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=name)
