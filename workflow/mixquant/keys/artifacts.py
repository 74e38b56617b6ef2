"""The artifact graph: every stage output's key and path, computed from config at planning time.

Keys are Merkle-style: a stage's preimage holds the config slice it reads, the keys of its
upstream artifacts, its code identity and package versions (``stage_preimage``). Nothing here
reads a stage's output, so ``snakemake -n`` shows exactly which keyed directories will be built.
Root inputs are identified by what pins them: a hub revision, a file's pinned SHA-256, or the
content hashes of a local directory.

Each artifact also carries ``settings``: what the stage function needs to run (paths included),
a superset of the key slice. Paths never enter a key; content identities do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixquant.config import MixquantConfig, parse_layer_ranges
from mixquant.keys.canonical import canonical_sha256
from mixquant.keys.hashing import require_sha256_hex
from mixquant.keys.manifest import MANIFEST
from mixquant.keys.stages import computes_on_cpu, stage_device, stage_preimage, stage_software
from mixquant.numerics import numerics_key


@dataclass(frozen=True)
class Artifact:
    name: str
    stage: str
    key: str
    path: Path
    preimage: dict[str, Any]
    settings: dict[str, Any]
    upstream: dict[str, str] = field(default_factory=dict)  # role -> artifact name
    # What the artifact is made from: the key without code, packages and environment (only config slices,
    # recursively); equal recipes, equal bytes for the content stages. `mixquant verify` compares a
    # published hash only when the planned artifact's recipe is the one the hash was pinned with.
    recipe: str = ""

    @property
    def done(self) -> bool:
        return (self.path / MANIFEST).is_file()


def compute_device(cfg: MixquantConfig, stage: str) -> str:
    """Where ``stage`` computes: numerics.device for the forward stages and the rebuild (the KLD stages
    only with the hf engine: vLLM places itself), else the CPU (the stage registry's device rule)."""
    return stage_device(stage, cfg.numerics.device, cfg.kld.engine)


def deployment_of(cfg: MixquantConfig, snakemake_deployment: str | None = None) -> str:
    """Where jobs run, "conda" or "venv": ``software.deployment``, or with ``auto`` how Snakemake deploys
    this run (``snakemake_deployment``; None outside Snakemake: venv)."""
    if cfg.software.deployment != "auto":
        return cfg.software.deployment
    return snakemake_deployment or "venv"


def keyed_path(results_dir: str | Path, stage: str, key: str) -> Path:
    """results/<stage>/<key>; the key is validated as hex before it becomes a path."""
    return Path(results_dir) / stage / require_sha256_hex(key, f"{stage} key")


class _Graph:
    def __init__(self, cfg: MixquantConfig, hash_cache_dir: Path | None, deployment: str):
        self.cfg = cfg
        self.hash_cache_dir = hash_cache_dir
        self.deployment = deployment
        self.artifacts: dict[str, Artifact] = {}

    def add(
        self, name: str, stage: str, config_slice: Any, settings: dict, upstream: dict[str, str]
    ) -> Artifact:
        upstream_keys = {role: self.artifacts[target].key for role, target in upstream.items()}
        if computes_on_cpu(stage):
            # the device and its numerics profile decide this stage's numbers: they enter the key, and
            # the job enters the profile before torch is imported (mixquant.numerics)
            numerics = self.cfg.numerics
            device = compute_device(self.cfg, stage)
            config_slice = {
                **config_slice,
                "numerics": numerics_key(device, numerics.cpu, numerics.threads),
            }
            settings = {
                **settings,
                "numerics": {"profile": numerics.cpu, "threads": numerics.threads, "device": device},
            }
        # the software that runs the stage: its versions (and, under conda, its env file) enter the key
        software = stage_software(
            stage,
            deployment=self.deployment,
            kld_engine=self.cfg.kld.engine,
            vllm_python=self.cfg.software.vllm_python,
        )
        settings = {**settings, "software": software.settings}
        preimage = stage_preimage(stage, config_slice, upstream_keys, software.packages, software.env)
        key = canonical_sha256(preimage)
        recipe = canonical_sha256(
            {
                "stage": stage,
                "config": config_slice,
                "upstream": {
                    role: self.artifacts[target].recipe for role, target in sorted(upstream.items())
                },
            }
        )
        artifact = Artifact(
            name,
            stage,
            key,
            keyed_path(self.cfg.results_dir, stage, key),
            preimage,
            settings,
            dict(upstream),
            recipe,
        )
        self.artifacts[name] = artifact
        return artifact


def _dataset_identity(cfg: MixquantConfig) -> tuple[dict, dict]:
    """(key slice, settings) of the chat dataset: pinned hash or hub revisions, never a path."""
    dataset = cfg.dataset
    if dataset.source == "local":
        assert dataset.local is not None
        identity = {"source": "local", "sha256": dataset.local.sha256}
        settings = {"source": "local", "path": dataset.local.path, "sha256": dataset.local.sha256}
    else:
        members = [member.model_dump(mode="json") for member in dataset.hub or []]
        identity = {"source": "hub", "members": members}
        settings = {"source": "hub", "members": members}
    identity["messages_field"] = settings["messages_field"] = dataset.messages_field
    return identity, settings


def dataset_settings(cfg: MixquantConfig) -> dict:
    """What the stages that read the chat dataset need to load it (paths included)."""
    return _dataset_identity(cfg)[1]


def _model_artifact(graph: _Graph) -> None:
    model = graph.cfg.model
    if model.source == "toy":
        identity, dataset_settings = _dataset_identity(graph.cfg)
        toy = model.toy.model_dump(mode="json")
        graph.add(
            "model",
            "build_toy_model",
            {"toy": toy, "corpus": identity},
            {"toy": toy, "corpus": dataset_settings},
            {},
        )
    elif model.source == "hub":
        assert model.hub is not None
        _fetch_artifact(graph, "model", model.hub.model_dump(mode="json"), None, model.trust_remote_code)
    else:
        assert model.local is not None
        _fetch_artifact(graph, "model", None, model.local.path, False, pin=model.local.sha256)
    if model.source != "toy" and (block := source_fp8_block(graph.cfg)) is not None:
        # the checkpoint the publisher ships is block-FP8: the BF16 source is its dequantization
        graph.artifacts["source_model"] = graph.artifacts.pop("model")
        settings = {"block_size": list(block)}
        graph.add("model", "dequantize_source", settings, settings, {"source": "source_model"})


def source_fp8_block(cfg: MixquantConfig) -> tuple[int, int] | None:
    """The FP8 block size of a source published block-FP8 (its config.json's quantization_config, from
    model.geometry or the local directory), None for a BF16 source."""
    from mixquant.checkpoint.fp8_source import block_size, is_block_fp8
    from mixquant.planning import planning_model_config

    config = planning_model_config(cfg, "config")
    if not config or not is_block_fp8(config):
        return None
    return block_size(config)


def _fetch_artifact(
    graph: _Graph, name: str, hub: dict | None, local: str | None, remote_code: bool, pin: str | None = None
) -> None:
    """A checkpoint pinned by hub revision or by the content of a local directory (fetch_model)."""
    if hub is not None:
        pin = {"source": "hub", **hub, "trust_remote_code": remote_code}
        graph.add(name, "fetch_model", pin, pin, {})
        return
    from mixquant.checkpoint.shards import check_links_inside
    from mixquant.model.fetch import identity_sha256, local_dir_identity

    check_links_inside(local)  # no link out of the model directory is hashed, or read by a stage
    files = local_dir_identity(local, cache_dir=graph.hash_cache_dir)
    if pin is not None and identity_sha256(files) != pin:
        raise ValueError(
            f"model.local.sha256: {local} has content {identity_sha256(files)[:12]}..., pinned "
            f"{pin[:12]}... (a file changed, or the pin is stale: `mixquant pin-model {local}` prints it)"
        )
    graph.add(
        name, "fetch_model", {"source": "local", "files": files}, {"source": "local", "path": local}, {}
    )


def _tokenizer_identity(cfg: MixquantConfig) -> tuple[dict, dict]:
    """(slice, settings) naming the tokenizer; 'model' tokenizers are covered by the model key."""
    if cfg.tokenizer.source == "hub":
        assert cfg.tokenizer.hub is not None
        pin = cfg.tokenizer.hub.model_dump(mode="json")
        return {"source": "hub", **pin}, {"source": "hub", **pin}
    return {"source": "model"}, {"source": "model"}


def resolve_artifacts(
    cfg: MixquantConfig,
    hash_cache_dir: Path | None = None,
    placement: dict[int, str] | None = None,
    deployment: str | None = None,
) -> dict[str, Artifact]:
    """{artifact name: Artifact} for every stage the config asks for, in dependency order.

    With ``placement.source: search`` the rebuild and the export depend on ``solve_placement``'s result:
    they are resolved from ``placement`` when given, else from the placement artifact's ``placement.json``
    once it is built; before that the graph ends at the placement. ``deployment``: how Snakemake deploys
    the jobs ("conda" or "venv"; what ``software.deployment: auto`` follows, :func:`deployment_of`).
    """
    graph = _Graph(cfg, hash_cache_dir, deployment_of(cfg, deployment))
    _model_artifact(graph)
    tokenizer_slice, tokenizer_settings = _tokenizer_identity(cfg)
    dataset_slice, dataset_settings = _dataset_identity(cfg)

    calibration = cfg.calibration.model_dump(mode="json")
    graph.add(
        "calibration",
        "sample_calibration",
        {"calibration": calibration, "dataset": dataset_slice, "tokenizer": tokenizer_slice},
        {"calibration": calibration, "dataset": dataset_settings, "tokenizer": tokenizer_settings},
        {"model": "model"},
    )

    prompt = cfg.prompt.model_dump(mode="json")
    prompt_slice: dict[str, Any] = {
        "seq_len": prompt["seq_len"],
        "source": prompt["source"],
        "sha256": prompt["sha256"],
        "tokenizer": tokenizer_slice,
    }
    if prompt["source"] == "chat_sample":
        prompt_slice.update(sample_index=prompt["sample_index"], dataset=dataset_slice)
    else:
        # A token-ID file is identified by the pin when there is one (the run checks the file
        # against it), else by its content at planning time.
        from mixquant.keys.hashing import file_sha256

        token_file = Path(prompt["token_ids_file"])
        content = file_sha256(token_file) if token_file.is_file() else None
        prompt_slice["token_ids_file_sha256"] = None if prompt["sha256"] else content
    graph.add(
        "prompt",
        "pin_prompt",
        prompt_slice,
        {"prompt": prompt, "dataset": dataset_settings, "tokenizer": tokenizer_settings},
        {"model": "model"},
    )
    _activation_artifact(graph)
    if cfg.placement.source == "explicit":
        placement = placement_from_config(cfg)
    else:
        _search_artifacts(graph)
        if placement is None and graph.artifacts["placement"].done:
            from mixquant.export.predict import load_placement

            placement = load_placement(graph.artifacts["placement"].path / PLACEMENT_FILE)
    if placement is not None:
        _rebuild_artifacts(graph, placement)
        _export_artifact(graph, placement)
    _kld_artifacts(graph, placement is not None)
    if placement is not None:
        _verify_artifact(graph)
        _release_artifact(graph, placement)
    return graph.artifacts


def moe_layers(cfg: MixquantConfig) -> list[int]:
    """MoE layer indices: from the toy geometry, or as the config names them for a real model."""
    if cfg.model.source == "toy":
        arch = cfg.model.toy.arch
        return list(range(arch.num_dense_layers, arch.num_hidden_layers))
    assert cfg.model.moe_layers is not None
    return parse_layer_ranges(cfg.model.moe_layers)


def placement_from_config(cfg: MixquantConfig) -> dict[int, str]:
    """MoE layer -> routed-expert format, from the explicit placement (every MoE layer listed)."""
    return _explicit_map(cfg, cfg.placement.explicit)


def _explicit_map(cfg: MixquantConfig, explicit: Any) -> dict[int, str]:
    layers = moe_layers(cfg)
    placement = dict.fromkeys(layers, explicit.default_format)
    for entry in explicit.layers:
        for layer in parse_layer_ranges(entry.layers):
            if layer not in placement:
                raise ValueError(f"placement.explicit names layer {layer}, which is not a MoE layer {layers}")
            placement[layer] = entry.format
    return placement


def quantize_windows(cfg: MixquantConfig) -> list[list[int]]:
    """The fixed windows of MoE layers that quantize_layer jobs cover (``quantize.layers_per_job`` each;
    null: one window of every MoE layer). Fixed by layer index, never by the placement."""
    layers = moe_layers(cfg)
    size = cfg.quantize.layers_per_job or len(layers)
    return [layers[i : i + size] for i in range(0, len(layers), size)]


def quantize_window(cfg: MixquantConfig, layer: int) -> list[int]:
    """The window of MoE layers whose quantize_layer job holds ``layer``."""
    for window in quantize_windows(cfg):
        if layer in window:
            return window
    raise ValueError(f"layer {layer} is not a MoE layer {moe_layers(cfg)}")


def layer_artifact_name(cfg: MixquantConfig, layer: int, fmt: str) -> str:
    """The quantize_layer artifact holding MoE ``layer`` in ``fmt``: its window's job in that format."""
    window = quantize_window(cfg, layer)
    return f"layers/{fmt}/{window[0]}-{window[-1]}"


def _activation_artifact(graph: _Graph) -> None:
    batch = {"batch_size": graph.cfg.quantize.activation_batch_size}
    graph.add(
        "activations",
        "collect_activation_stats",
        batch,
        batch,
        {"model": "model", "calibration": "calibration"},
    )


def rebuild_params(cfg: MixquantConfig, fmt: str) -> dict[str, Any]:
    """The ``quantize`` settings of one format (what quantize_layer ships)."""
    return {
        "nvfp4_w4a16": cfg.quantize.nvfp4_w4a16.model_dump(mode="json"),
        "fp8": cfg.quantize.fp8.model_dump(mode="json"),
        "bf16": {},
    }[fmt]


def _layer_artifact(graph: _Graph, layer: int, fmt: str) -> str:
    """The quantize_layer artifact holding ``layer`` in ``fmt`` (added once, shared by every consumer).

    One job per (format, window of MoE layers): it quantizes every layer of its window in that format,
    needed by this plan or not, so its key -- the format, that format's params, the window's layers, the
    model (and, for FP8 W8A8, the activation statistics) -- is exactly the union of what its layer x
    format results depend on, and never the placement. A new placement or budget therefore reuses every
    window already computed, and an NVFP4 knob moves only NVFP4 windows.
    """
    cfg = graph.cfg
    name = layer_artifact_name(cfg, layer, fmt)
    if name not in graph.artifacts:
        window_slice = {
            "format": fmt,
            "layers": quantize_window(cfg, layer),
            "params": rebuild_params(cfg, fmt),
        }
        upstream = {"model": "model", **({"activations": "activations"} if fmt == "fp8" else {})}
        graph.add(name, "quantize_layer", window_slice, window_slice, upstream)
    return name


def _rebuild_artifacts(graph: _Graph, placement: dict[int, str]) -> None:
    """The quantize_layer windows that hold the placed (MoE layer, format) results.

    Each layer x format result is the ``layer_<L>`` subdirectory of its window's output
    (:func:`mixquant.quantize.run.layer_result_dir`). The source model enters by its key, which covers
    every layer's weights (conservative: a change to one layer's weights reruns all windows).
    """
    for layer, fmt in sorted(placement.items()):
        _layer_artifact(graph, layer, fmt)


PLACEMENT_FILE = "placement.json"
SCORED = ("nvfp4_w4a16", "fp8")  # bf16 is the reference: its score is 0 by definition


def placement_pins(cfg: MixquantConfig) -> dict[int, str]:
    """MoE layer -> pinned format (``placement.search.pins``)."""
    layers = set(moe_layers(cfg))
    pins: dict[int, str] = {}
    for pin in cfg.placement.search.pins:
        for layer in parse_layer_ranges(pin.layers):
            if layer not in layers:
                raise ValueError(f"placement.search.pins names layer {layer}, which is not a MoE layer")
            pins[layer] = pin.format
    return pins


def scored_formats(cfg: MixquantConfig) -> dict[int, list[str]]:
    """MoE layer -> the formats the search scores it in: every scored candidate format, or only its
    pinned one (a layer pinned to bf16 needs no score)."""
    pins = placement_pins(cfg)
    scored = [fmt for fmt in cfg.placement.formats if fmt in SCORED]
    out = {}
    for layer in moe_layers(cfg):
        formats = [fmt for fmt in scored if pins.get(layer, fmt) == fmt]
        if formats:
            out[layer] = formats
    return out


def score_macro_batch(cfg: MixquantConfig) -> int:
    """Calibration sequences per score_sensitivity job: ``placement.search.macro_batch``, or the largest
    that fits the device by the cost model (every sequence when the geometry is not known)."""
    search = cfg.placement.search
    if search.macro_batch is not None:
        return min(search.macro_batch, cfg.calibration.num_samples)
    from mixquant.cluster import planning_geometry
    from mixquant.costs import score_macro_batch as fitted

    geometry = planning_geometry(cfg)
    return fitted(cfg, geometry) if geometry is not None else cfg.calibration.num_samples


def score_jobs(cfg: MixquantConfig) -> list[tuple[int, int]]:
    """``(first, stop)`` calibration sequences of each score_sensitivity job: one streamed pass over the
    weights per macro-batch, scoring every (MoE layer, format) on those sequences."""
    size, total = score_macro_batch(cfg), cfg.calibration.num_samples
    return [(first, min(first + size, total)) for first in range(0, total, size)]


def _search_artifacts(graph: _Graph) -> None:
    """score_sensitivity per macro-batch of calibration sequences, and the solve_placement checkpoint.

    A score key holds its sequences, the scored (layer, format) map, the scoring settings and the keys of
    the model, the calibration tokens and the layer x format results it scores -- not the budget or the
    solver, so a new budget reruns only the solve. Every pass carries every format, so a new candidate
    format reruns the score jobs (and only its own quantize windows).
    """
    cfg = graph.cfg
    search = cfg.placement.search
    scored = scored_formats(cfg)
    roles: dict[str, str] = {}
    for first, stop in score_jobs(cfg):
        upstream = {"model": "model", "calibration": "calibration"}
        for layer, formats in scored.items():
            for fmt in formats:
                if search.calibration == "rebuild":  # the very layer x format results the rebuild ships
                    upstream[f"{fmt}_layer_{layer}"] = _layer_artifact(graph, layer, fmt)
                elif fmt == "fp8":  # ModelOpt's own fake quant of the BF16 weights; FP8 inputs need amax
                    upstream["activations"] = "activations"
        score_slice = {
            "sequences": [first, stop],
            "scored": {str(layer): formats for layer, formats in scored.items()},
            "weights": search.calibration,
            "batch_size": search.batch_size,
            "stack_branches": search.stack_branches,
        }
        settings = {**score_slice, "checkpoint_interval_s": search.checkpoint_interval_s}
        name = f"scores/{first}-{stop - 1}"
        graph.add(name, "score_sensitivity", score_slice, settings, upstream)
        roles[f"scores_{first}"] = name
    solve_slice = {
        "moe_layers": moe_layers(cfg),
        "formats": list(cfg.placement.formats),
        "target_effective_bits": cfg.placement.target_effective_bits,
        "cost_model": cfg.placement.cost_model,
        "method": search.method,
        "pins": {str(layer): fmt for layer, fmt in sorted(placement_pins(cfg).items())},
        "frontier_points": search.frontier_points,
    }
    graph.add("placement", "solve_placement", solve_slice, solve_slice, {"model": "model", **roles})


def _export_artifact(graph: _Graph, placed: dict[int, str], name: str = "checkpoint") -> None:
    """The checkpoint: the source model plus every placed layer x format result (and KV amax).

    The placement enters by content (layer -> format), not by the placement artifact's key: a budget
    change that lands on the same placement finds the same checkpoint.
    """
    from mixquant.producer import default_producer

    cfg = graph.cfg
    placement = {str(layer): fmt for layer, fmt in sorted(placed.items())}
    export = cfg.export.model_dump(mode="json")
    tokenizer_slice, _ = _tokenizer_identity(cfg)
    config_slice = {
        "export": export,
        "placement": placement,
        "producer": default_producer(),
        "tokenizer": tokenizer_slice,
    }
    upstream = {"model": "model"}
    upstream.update(
        {f"layer_{layer}": layer_artifact_name(cfg, int(layer), fmt) for layer, fmt in placement.items()}
    )
    if export["kv_cache_quant"]:
        upstream["activations"] = "activations"
    graph.add(name, "export_checkpoint", config_slice, config_slice, upstream)


def engine_settings(cfg: MixquantConfig) -> dict[str, Any]:
    """The engine settings that decide logits (everything but the KV-cache dtype, which varies)."""
    kld = cfg.kld
    return {
        "engine": kld.engine,
        "tensor_parallel_size": kld.tensor_parallel_size,
        "dtype": kld.dtype,
        "enforce_eager": kld.enforce_eager,
        "seed": kld.seed,
        "enable_prefix_caching": kld.enable_prefix_caching,
        "max_model_len": kld.max_model_len,
    }


def _candidate_artifact(graph: _Graph, candidate: Any, placed: bool) -> str | None:
    """The artifact holding a KLD candidate's checkpoint (None until the placement is known)."""
    cfg = graph.cfg
    name = f"candidate/{candidate.name}"
    if candidate.source == "searched":
        return "checkpoint" if placed else None
    if candidate.source == "bf16":
        return "model"
    if candidate.source in ("uniform", "explicit"):
        if candidate.source == "uniform":
            placement = dict.fromkeys(moe_layers(cfg), candidate.format)
        else:
            placement = _explicit_map(cfg, candidate.explicit)
        _rebuild_artifacts(graph, placement)
        _export_artifact(graph, placement, name)
        return name
    hub = candidate.hub.model_dump(mode="json") if candidate.hub is not None else None
    _fetch_artifact(graph, name, hub, candidate.local.path if candidate.local else None, False)
    return name


def _kld_artifacts(graph: _Graph, placed: bool) -> None:
    """Reference logits; per (candidate, KV dtype) a run_kld job doing all ``kld.runs`` runs and a gate;
    then the report and the verdict once every candidate is known.

    A run_kld key holds the engine settings, the KV dtype, the number of runs and the keys of the
    reference, the prompt and the candidate's checkpoint -- not the candidate's name, so a renamed
    candidate keeps its runs. Each run is a fresh engine (a fresh process with vLLM) and keeps its own
    results under ``runs/<i>/`` (:mod:`mixquant.kld.run`). Gates hold the gate settings and the keys of
    their runs (and the baseline's runs).
    """
    cfg = graph.cfg
    kld = cfg.kld
    engine = engine_settings(cfg)
    graph.add(
        "reference_logits",
        "reference_logits",
        {"engine": engine, "kv_cache_dtype": "bfloat16"},
        {"engine": engine, "kv_cache_dtype": "bfloat16"},
        {"model": "model", "prompt": "prompt"},
    )
    sources = {c.name: _candidate_artifact(graph, c, placed) for c in kld.candidates}
    for candidate in kld.candidates:
        if sources[candidate.name] is None:
            continue
        for kv in kld.kv_cache_dtypes:
            runs_slice = {"engine": engine, "kv_cache_dtype": kv, "runs": kld.runs}
            upstream = {
                "reference": "reference_logits",
                "prompt": "prompt",
                "candidate": sources[candidate.name],
            }
            graph.add(f"kld/{candidate.name}/{kv}", "run_kld", runs_slice, runs_slice, upstream)
    gated = kld.gates.gated or [c.name for c in kld.candidates if c.name != kld.baseline]
    for candidate in kld.candidates:
        baseline = kld.baseline if kld.baseline not in (None, candidate.name) else None
        if sources[candidate.name] is None or (baseline is not None and sources[baseline] is None):
            continue
        for kv in kld.kv_cache_dtypes:
            upstream = {"runs": f"kld/{candidate.name}/{kv}"}
            if baseline is not None:
                upstream["baseline_runs"] = f"kld/{baseline}/{kv}"
            gates = kld.gates.model_dump(mode="json")
            gates.pop("gated")
            gate_slice = {
                "candidate": candidate.name,
                "source": candidate.source,
                "kv_cache_dtype": kv,
                "baseline": baseline,
                # the BF16 self-check has its own gates: exactly 0 with BF16 KV (require_exact_zero); with
                # FP8 KV it measures the KV cache's own effect, which is no improvement over any baseline
                "gated": candidate.name in gated and candidate.source != "bf16",
                "gates": gates,
                # the BF16 self-check must be exactly 0 where the engine is exact (hf, BF16 KV)
                "require_exact_zero": candidate.source == "bf16" and kv == "bfloat16" and kld.engine == "hf",
                # hf is deterministic: its runs must be bit-identical
                "require_identical_runs": kld.engine == "hf",
            }
            graph.add(f"gate/{candidate.name}/{kv}", "gate_kld", gate_slice, gate_slice, upstream)
    if all(source is not None for source in sources.values()):
        gates_up = {
            f"gate_{c.name}_{kv}": f"gate/{c.name}/{kv}" for c in kld.candidates for kv in kld.kv_cache_dtypes
        }
        report_slice = {
            "candidates": [c.name for c in kld.candidates],
            "kv_cache_dtypes": list(kld.kv_cache_dtypes),
            "baseline": kld.baseline,
        }
        graph.add("kld_report", "kld_report", report_slice, report_slice, gates_up)
        graph.add("kld_verdict", "check_kld_gates", report_slice, report_slice, {"report": "kld_report"})


# The config sections whose short hashes `published.made_from.settings` pins: those an artifact's recipe
# can be made from (results_dir, software, published, expected and release never enter one).
SETTINGS_SECTIONS = (
    "model",
    "tokenizer",
    "dataset",
    "calibration",
    "prompt",
    "placement",
    "quantize",
    "export",
    "kld",
    "numerics",
)
# The artifacts the published hashes are read from (mixquant.release.published.HASH_SOURCES).
HASHED_ARTIFACTS = ("prompt", "reference_logits", "checkpoint")


def settings_fingerprint(cfg: MixquantConfig) -> dict[str, str]:
    """{config section: the first 16 hex of its canonical SHA-256} (``published.made_from.settings``)."""
    document = cfg.model_dump(mode="json")
    return {section: canonical_sha256(document[section])[:16] for section in SETTINGS_SECTIONS}


def made_from(artifacts: dict[str, Artifact], cfg: MixquantConfig) -> dict[str, Any]:
    """``published.made_from`` for this config's planned artifacts: the recipe of each artifact the
    hashes are read from and the short hash of each config section (``mixquant verify --made-from``)."""
    pins: dict[str, Any] = {name: artifacts[name].recipe for name in HASHED_ARTIFACTS if name in artifacts}
    pins["settings"] = settings_fingerprint(cfg)
    return pins


def _verify_artifact(graph: _Graph) -> None:
    """verify_hashes: the published values and the keys of the prompt, the reference and the checkpoint.

    ``published`` enters this key only: pinning a hash never moves an upstream stage. The planned recipes
    (``made_from``) are settings, not key: the upstream keys decide them; the section hashes only name
    what differs when a recipe is not the published one.
    """
    planned = made_from(graph.artifacts, graph.cfg)
    published = {"published": graph.cfg.published.model_dump(mode="json")}
    upstream = {"prompt": "prompt", "reference_logits": "reference_logits", "checkpoint": "checkpoint"}
    graph.add("verify", "verify_hashes", published, {**published, "planned": planned}, upstream)


def _release_artifact(graph: _Graph, placement: dict[int, str]) -> None:
    """assemble_release: the checkpoint, its recipe and audits, the KLD aggregates and the model card.

    Its key holds the recipe (the resolved config with the placement written down; the card is made from
    it and the upstream outputs) and the keys of everything the bundle copies or quotes. Planned only once
    every candidate's gate and the verdict are known: a release is never assembled past a failed gate.
    """
    from mixquant.release.recipe import recipe_document

    if "kld_verdict" not in graph.artifacts or "checkpoint" not in graph.artifacts:
        return
    cfg = graph.cfg
    upstream = {
        "model": "model",
        "checkpoint": "checkpoint",
        "prompt": "prompt",
        "reference": "reference_logits",
        "verdict": "kld_verdict",
    }
    if "placement" in graph.artifacts:
        upstream["placement"] = "placement"
    for candidate in cfg.kld.candidates:
        for kv in cfg.kld.kv_cache_dtypes:
            upstream[f"gate_{candidate.name}_{kv}"] = f"gate/{candidate.name}/{kv}"
    release_slice = {"recipe": recipe_document(cfg, placement)}
    graph.add("release", "assemble_release", release_slice, release_slice, upstream)


def layer_artifacts(artifacts: dict[str, Artifact]) -> list[Artifact]:
    return [art for art in artifacts.values() if art.stage == "quantize_layer"]


def artifact_by_key(artifacts: dict[str, Artifact], key: str) -> Artifact:
    for art in artifacts.values():
        if art.key == key:
            return art
    raise KeyError(f"no artifact with key {key} in this plan")


def final_targets(artifacts: dict[str, Artifact]) -> list[str]:
    """Directories `rule all` asks for (checkpoint, verdict, verification, release once placed)."""
    names = ("model", "calibration", "prompt", "placement", "checkpoint", "kld_verdict", "verify", "release")
    targets = [str(artifacts[name].path) for name in names if name in artifacts]
    # gates known before the placement (candidates that do not depend on it) can run early
    return targets + [str(a.path) for a in artifacts.values() if a.stage == "gate_kld"]
