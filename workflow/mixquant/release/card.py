"""The release's model card (README.md): Hugging Face YAML front matter and the sections of a quantized
release -- precision placement, KLD table, provenance and hashes, vLLM serving, status and limitations.

Every number comes from an input: the checkpoint audit's inspection (counts, effective bits, tensors,
bytes), the placement audit (per-layer scores, budget), the gate aggregates (KLD and the reduction vs the
baseline), the re-derived hashes and the recipe (settings). Nothing is typed in by hand, so the card of
a rerun is byte-identical.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from mixquant.export.files import QUANT_CONFIG_FILE
from mixquant.export.predict import routed_effective_bits
from mixquant.formats.facts import BF16, FP8, NVFP4
from mixquant.formats.facts import ROUTED_FORMAT_BITS as FORMAT_BITS
from mixquant.kld.report import comparison_table, table_markdown
from mixquant.kld.run import LOGITS_FILE
from mixquant.kld.suite_tables import comparison_rows
from mixquant.model.families import DEFAULT_MODEL_TYPE
from mixquant.model.layout import INDEX_FILE
from mixquant.numerics import fingerprint_differences
from mixquant.release.card_kld import (
    intro_text,
    limitation_line,
    suite_gates,
    suite_lines,
    verdict_words,
)
from mixquant.release.card_method import numerics_line, refine_lines
from mixquant.release.hashes import (
    HASH_KINDS,
    HASH_NAMES,
    NUMERICS_JSON,
    PROMPT_FILE,
    RELEASE_REFERENCE_DIR,
    numerics_text,
)
from mixquant.release.serving import serving_section

FORMAT_LABELS = {NVFP4: "NVFP4 W4A16", FP8: "FP8 W8A8", BF16: "BF16"}
# The Hub library of ModelOpt checkpoints, as NVIDIA's own declare it (e.g. nvidia/Llama-3.1-8B-Instruct-FP4:
# `library_name: Model Optimizer`). Not transformers: its AutoModelForCausalLM refuses a ModelOpt
# MIXED_PRECISION checkpoint ("Unknown quantization type, got modelopt"); vLLM serves it.
LIBRARY_NAME = "Model Optimizer"
# Where the release ships the file each published hash is computed from (paths inside repo/).
SHIPPED_HASH_FILES = {
    "prompt_token_ids": f"{RELEASE_REFERENCE_DIR}/{PROMPT_FILE}",
    "reference_logits": f"{RELEASE_REFERENCE_DIR}/{LOGITS_FILE}",
    "quant_config": QUANT_CONFIG_FILE,
    "safetensors_index": INDEX_FILE,
}
FILE_NOTES = {
    SHIPPED_HASH_FILES["prompt_token_ids"]: "the pinned prompt's token IDs (`input_ids`, int32), which the "
    "reference logits belong to",
    SHIPPED_HASH_FILES["reference_logits"]: "the BF16 model's logits at each prompt position (float32)",
}
HASH_LABELS = {
    "prompt_token_ids": "prompt token IDs",
    "reference_logits": "BF16 reference logits",
    "quant_config": "quant config (hf_quant_config.json)",
    "safetensors_index": "safetensors index (model.safetensors.index.json)",
}


@dataclass(frozen=True)
class CardInputs:
    """What the card is made from (all plain data read from the upstream outputs)."""

    recipe: Mapping[str, Any]  # mixquant.release.recipe.recipe_document
    inspection: Mapping[str, Any]  # checkpoint_audit.json "inspection"
    hf_quant_config: Mapping[str, Any]
    gates: Sequence[Mapping[str, Any]]  # gate_kld aggregate.json documents
    hashes: Mapping[str, Mapping[str, Any]]  # release_hashes(...)[name].to_json()
    keys: Mapping[str, str]  # artifact role -> key (model, checkpoint, placement, release inputs)
    producer: Mapping[str, Any]  # export producer: mixquant and ModelOpt versions
    verdict: Mapping[str, Any]  # check_kld_gates verdict.json
    placement_audit: Mapping[str, Any] | None = None  # solve_placement's audit (search only)
    refine_audit: Mapping[str, Any] | None = None  # refine_placement's audit (a refined search only)
    model_type: str | None = None  # config.json model_type
    files: Sequence[str] = ()  # the bundle's files (besides README.md)
    numerics: Mapping[str, Any] | None = None  # the reference logits' decisive numerics fingerprint
    weight_bytes: int | None = None  # the checkpoint's *.safetensors files, in bytes on disk
    report: Mapping[str, Any] | None = None  # kld_report's report.json: suite facts, decomposition, domains


# ------------------------------------------------------------------------------------------ naming


def source_model(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """{"kind", "repo", "revision", "text"} of the BF16 source model the recipe names."""
    model = recipe["model"]
    if model["source"] == "hub":
        hub = model["hub"]
        return {
            "kind": "hub",
            "repo": hub["repo"],
            "revision": hub["revision"],
            "text": f"`{hub['repo']}` at revision `{hub['revision']}`",
        }
    if model["source"] == "local" and (model.get("local") or {}).get("toy"):
        return {
            "kind": "toy",
            "repo": None,
            "revision": None,
            "text": "mixquant's embedded toy Laguna (a tiny model that ships with mixquant, identified by "
            "the content hashes of its files)",
        }
    if model["source"] == "local":
        return {
            "kind": "local",
            "repo": None,
            "revision": None,
            "text": "a local model directory identified by the content hashes of its files",
        }
    return {
        "kind": "toy",
        "repo": None,
        "revision": None,
        "text": "mixquant's embedded toy Laguna, built and trained by the workflow",
    }


def release_name(recipe: Mapping[str, Any], counts: Mapping[str, int], model_type: str | None = None) -> str:
    """``release.name``, the name part of ``release.repo_id``, or '<source>-MixQuant-<n>xNVFP4-<n>xFP8'
    (the source: the hub repo's name, else '<kind>-<model_type>', e.g. 'toy-laguna')."""
    if recipe["release"].get("name"):
        return str(recipe["release"]["name"])
    if recipe["release"].get("repo_id"):
        return str(recipe["release"]["repo_id"]).split("/")[-1]
    source = source_model(recipe)
    base = (
        source["repo"].split("/")[-1]
        if source["repo"]
        else f"{source['kind']}-{model_type or DEFAULT_MODEL_TYPE}"
    )
    mix = "-".join(f"{counts[fmt]}x{FORMAT_LABELS[fmt].split()[0]}" for fmt in FORMAT_BITS if counts.get(fmt))
    return f"{base}-MixQuant-{mix}"


# ------------------------------------------------------------------------------------- front matter


def front_matter(inputs: CardInputs, name: str) -> dict[str, Any]:
    """Hugging Face model card metadata (base_model, license, tags, library_name) plus quantization facts."""
    recipe, inspection = inputs.recipe, inputs.inspection
    source = source_model(recipe)
    counts = {fmt: int(n) for fmt, n in inspection["placement_counts"].items()}
    quantization = inputs.hf_quant_config.get("quantization", {})
    meta: dict[str, Any] = {}
    if source["repo"]:
        meta["base_model"] = source["repo"]
        meta["base_model_relation"] = "quantized"
    release = recipe["release"]
    meta["license"] = release["license"]
    if release.get("license_name"):
        meta["license_name"] = release["license_name"]
    if release.get("license_link"):
        meta["license_link"] = release["license_link"]
    meta["library_name"] = LIBRARY_NAME
    tags = ["mixquant", "modelopt", "quantized", "mixed-precision", "moe"]
    tags += [tag for fmt, tag in (("nvfp4_w4a16", "nvfp4"), ("fp8", "fp8")) if counts.get(fmt)]
    if inputs.model_type:
        tags.append(str(inputs.model_type))
    meta["tags"] = tags
    meta["pipeline_tag"] = "text-generation"
    meta["quantization"] = {
        "tool": "mixquant",
        "format": "modelopt",
        "quant_algo": quantization.get("quant_algo"),
        "kv_cache_quant_algo": quantization.get("kv_cache_quant_algo"),
        "routed_expert_layers": {fmt: counts.get(fmt, 0) for fmt in FORMAT_BITS},
        "routed_effective_bits": _round(inspection["routed_effective_bits"], 4),
        "non_routed_precision": "bf16",
        "modelopt_version": _modelopt_version(inputs.producer),
        "mixquant_version": inputs.producer.get("version"),
    }
    meta["model_name"] = name
    return meta


def _modelopt_version(producer: Mapping[str, Any]) -> str | None:
    return (producer.get("numerics") or {}).get("version")


def _round(value: Any, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


# ----------------------------------------------------------------------------------------- sections


def _placement_section(inputs: CardInputs) -> list[str]:
    inspection = inputs.inspection
    counts = {fmt: int(n) for fmt, n in inspection["placement_counts"].items()}
    moe_layers = sum(counts.values())
    bits = inspection["routed_effective_bits"]
    lines = ["## Precision placement", ""]
    lines.append(
        f"Routed experts of the {moe_layers} MoE layers, one format per layer; everything else (attention, "
        "shared experts, routers, embeddings, dense layers, norms, lm_head) stays BF16 — "
        f"`hf_quant_config.json` lists {len(_quantized_layers(inputs))} quantized modules, all of them "
        "routed experts."
    )
    lines += ["", "| format | bits / weight | MoE layers | routed tensors |", "|:---|---:|---:|---:|"]
    routed_tensors = inspection["tensors"]["routed"]
    for fmt in FORMAT_BITS:
        lines.append(
            f"| {FORMAT_LABELS[fmt]} | {FORMAT_BITS[fmt]:g} | {counts.get(fmt, 0)} | "
            f"{int(routed_tensors.get(fmt, 0)):,} |"
        )
    terms = " + ".join(f"{counts.get(f, 0)}×{FORMAT_BITS[f]:g}" for f in FORMAT_BITS)
    lines += [
        "",
        f"**Routed-expert effective bits: {bits:.4f}** (numel-weighted; NVFP4 counts 4.5 bits: 4 + one E4M3 "
        f"scale per 16 weights; with equal layers: ({terms}) / {moe_layers}).",
        f"Tensors: {int(inspection['tensors']['total']):,}; tensor payload: "
        f"{int(inspection['payload_bytes']):,} bytes in {len(inspection['shards'])} safetensors shard(s).",
    ]
    audit = inputs.placement_audit
    if audit is not None:
        budget = audit["budget"]
        lines += [
            "",
            f"Chosen by mixquant's KL-sensitivity search (`{audit['method']}`, cost model "
            f"`{budget['cost_model']}`): target {budget['target_effective_bits']:g} effective bits, reached "
            f"{budget['effective_bits']:.4f}; predicted summed KL per token {audit['objective']:.6g}. "
            "Scores are KL(BF16 ‖ only that layer's routed experts quantized) per calibration token.",
        ]
        lines += refine_lines(inputs.refine_audit)
    else:
        lines += ["", "The placement was given explicitly in the config (`placement.source: explicit`)."]
    lines += ["", *_layer_table(inputs)]
    return lines


def _quantized_layers(inputs: CardInputs) -> dict[str, Any]:
    return dict((inputs.hf_quant_config.get("quantization") or {}).get("quantized_layers") or {})


def _layer_table(inputs: CardInputs) -> list[str]:
    layer_formats = {int(layer): fmt for layer, fmt in inputs.inspection["layer_formats"].items()}
    scores: dict[int, Mapping[str, float]] = {}
    if inputs.placement_audit is not None:
        scores = {int(g["layer"]): g["scores"] for g in inputs.placement_audit["groups"]}
    scored = [fmt for fmt in ("nvfp4_w4a16", "fp8") if any(fmt in s for s in scores.values())]
    header = "| layer | format |" + "".join(f" KL/token if {FORMAT_LABELS[f]} |" for f in scored)
    lines = [header, "|---:|:---|" + "---:|" * len(scored)]
    for layer in sorted(layer_formats):
        cells = [str(layer), FORMAT_LABELS.get(layer_formats[layer], layer_formats[layer])]
        for fmt in scored:
            value = scores.get(layer, {}).get(fmt)
            cells.append("—" if value is None else f"{float(value):.4g}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def released_candidates(recipe: Mapping[str, Any]) -> list[str]:
    """KLD candidates that are this checkpoint (source ``searched``: the placement the recipe pins)."""
    return [c["name"] for c in recipe["kld"]["candidates"] if c["source"] == "searched"]


def candidate_bits(inputs: CardInputs, gate: Mapping[str, Any]) -> float | None:
    """Routed-expert effective bits of a gate's candidate: this checkpoint's (searched), the format's
    (uniform, bf16), else from the layer formats of the checkpoint the KLD engine loaded, each MoE layer
    weighted by its expert count (None when the engine recorded none: an external checkpoint)."""
    spec = next((c for c in inputs.recipe["kld"]["candidates"] if c["name"] == gate["candidate"]), None)
    source = spec["source"] if spec else gate.get("source")
    if source == "searched":
        return float(inputs.inspection["routed_effective_bits"])
    if source == "bf16":
        return float(FORMAT_BITS[BF16])
    if source == "uniform" and spec is not None:
        return float(FORMAT_BITS[spec["format"]])
    formats = ((gate.get("engine") or {}).get("checkpoint") or {}).get("layer_formats") or {}
    if not formats or any(fmt not in FORMAT_BITS for fmt in formats.values()):
        return None
    experts = inputs.inspection.get("experts_per_layer") or {}
    return routed_effective_bits(
        {int(layer): int(experts.get(str(layer), 1)) for layer in formats},
        {int(layer): fmt for layer, fmt in formats.items()},
    )


def _bits_text(bits: float | None) -> str:
    return "—" if bits is None else f"{bits:.4f}".rstrip("0").rstrip(".")


def _with_bits_column(table: str, bits: Sequence[str]) -> list[str]:
    """The KLD comparison table with a ``bits`` column after its candidate and KV-cache columns."""
    header, rule, *rows = table.rstrip("\n").splitlines()
    if not header.startswith("| candidate | KV cache |") or len(rows) != len(bits):
        raise ValueError("KLD table: not the comparison table of mixquant.kld.report")
    rule_cells = rule.split("|")
    lines = [
        header.replace("| KV cache |", "| KV cache | bits |", 1),
        "|".join([*rule_cells[:3], "---:", *rule_cells[3:]]),
    ]
    for row, value in zip(rows, bits, strict=True):
        first, second, rest = row.split(" | ", 2)
        lines.append(f"{first} | {second} | {value} | {rest}")
    return lines


def _kld_section(inputs: CardInputs) -> list[str]:
    kld = inputs.recipe["kld"]
    bits = [_bits_text(candidate_bits(inputs, g)) for g in inputs.gates]
    suite = bool(suite_gates(inputs.gates))
    row_bits = [
        b for g, b in zip(inputs.gates, bits, strict=True) for _ in range(1 + (g.get("suite") is not None))
    ]
    prompt = (
        f"KL(BF16 ‖ candidate) over the full vocabulary at each of the pinned prompt's "
        f"{inputs.recipe['prompt']['seq_len'] - 1:,} positions"
    )
    reduction = ""
    if kld["baseline"]:
        where = " (over windows on the suite, over positions on the prompt)" if suite else ""
        reduction = (
            f" Reduction: mean KLD relative to the baseline `{kld['baseline']}`, with a paired bootstrap "
            f"{kld['gates']['confidence']:.0%} interval{where}."
        )
    lines = ["## KL divergence vs BF16", ""]
    if suite:
        lines += [intro_text(inputs.recipe, inputs.gates), ""]
    lines.append(
        ("Both protocols:" if suite else f"{prompt};")
        + f" {kld['runs']} fresh-engine runs per candidate and KV-cache dtype on the `{kld['engine']}` "
        f"engine (tensor parallel {kld['tensor_parallel_size']}, {kld['dtype']}, eager, seed {kld['seed']}, "
        f"no prefix cache).{reduction} bits: the candidate's routed-expert effective bits (numel-weighted; "
        "BF16 counts 16); compare KLD at equal bits."
    )
    highlights = _highlights(inputs, bits, suite)
    if highlights:
        lines += ["", *highlights]
    lines += [
        "",
        *_with_bits_column(table_markdown(comparison_table(comparison_rows(inputs.gates))), row_bits),
    ]
    if suite:
        lines += suite_lines(inputs.recipe, inputs.gates, inputs.report, inputs.files)
        lines += [
            "",
            "### The published-hash protocol: the pinned prompt",
            "",
            f"{prompt} (the `prompt` rows above), with a paired bootstrap over its positions: reported, not "
            "gated. Its token IDs and BF16 reference logits are the published hashes that `mixquant verify` "
            "reproduces (Provenance below).",
        ]
    return lines


def _highlights(inputs: CardInputs, bits: Sequence[str], suite: bool) -> list[str]:
    """This checkpoint's mean KLD and reduction vs the baseline per KV dtype: on the suite (with the verdict
    word) when it gated, else on the prompt."""
    lines = []
    released = released_candidates(inputs.recipe)
    for g, text in zip(inputs.gates, bits, strict=True):
        measured = g.get("suite") if suite else None
        imp = measured["improvement"] if measured else g["improvement"]
        if g["candidate"] not in released or not imp:
            continue
        mean = measured["mean"]["mean"] if measured else g["aggregate"]["mean_kld"]
        word = f": {g['verdict']['word']}" if measured and g["verdict"].get("word") else ""
        lines.append(
            f"- **{g['candidate']}** (this checkpoint, {text} bits), {g['kv_cache_dtype']} KV cache: mean "
            f"KLD {mean:.6g}{' on the suite' if measured else ''}, {_pct(imp['reduction'])} below "
            f"`{inputs.recipe['kld']['baseline']}` [{_pct(imp['ci_low'])}, {_pct(imp['ci_high'])}]{word}"
        )
    return lines


def _pct(value: float) -> str:
    return "—" if value is None or math.isnan(float(value)) else f"{100.0 * float(value):.2f}%"


def _provenance_section(inputs: CardInputs) -> list[str]:
    recipe = inputs.recipe
    source = source_model(recipe)
    producer = inputs.producer
    lines = ["## Provenance", ""]
    lines.append(f"- Source model: {source['text']}; mixquant key `{inputs.keys['model']}`.")
    tokenizer = recipe["tokenizer"]
    if tokenizer["source"] == "hub":
        lines.append(
            f"- Tokenizer: `{tokenizer['hub']['repo']}` at revision `{tokenizer['hub']['revision']}`."
        )
    calibration = recipe["calibration"]
    lines.append(
        f"- Calibration: {calibration['num_samples']} samples × {calibration['seq_len']} tokens "
        f"(seed {calibration['seed']}) from {_dataset_text(recipe['dataset'])}."
    )
    lines.append(numerics_line(recipe["quantize"]))
    lines.append(
        f"- Produced by mixquant {producer.get('version')} with ModelOpt (nvidia-modelopt) "
        f"{_modelopt_version(producer)} numerics; checkpoint key `{inputs.keys['checkpoint']}` (a hash of "
        "every setting, upstream key, code identity and package version it was built from)."
    )
    if recipe["placement"].get("recipe"):
        lines.append(f"- Placement settings mirror the ModelOpt recipe `{recipe['placement']['recipe']}`.")
    lines.append(
        "- `quantization_recipe.yaml` reproduces this checkpoint: "
        "`snakemake --configfile quantization_recipe.yaml` plans the same keys and rebuilds the same files."
    )
    if inputs.numerics is not None:
        lines.append(
            f"- Numerics fingerprint of the BF16 reference logits (`{NUMERICS_JSON}`, shipped with them in "
            f"`reference/`): {numerics_text(inputs.numerics)}."
        )
    lines += [
        "",
        "SHA-256 of the files shipped here, each in its encoding (re-derived from the workflow's outputs, as "
        "`mixquant verify` does):",
        "",
    ]
    lines += ["| what | kind | SHA-256 | file | encoding |", "|:---|:---|:---|:---|:---|"]
    published = recipe.get("published") or {}
    for name, record in inputs.hashes.items():
        pinned = published.get(name)
        note = (
            "" if pinned is None else (" (= published)" if pinned == record["sha256"] else " (≠ published)")
        )
        kind = record.get("kind") or HASH_KINDS.get(name, "—")
        shipped = SHIPPED_HASH_FILES.get(name, record["artifact"]["file"])
        lines.append(
            f"| {HASH_LABELS.get(name, name)} | {kind} | `{record['sha256']}`{note} | `{shipped}` | "
            f"{record['encoding']} |"
        )
    lines += [
        "",
        "Content hashes (token IDs, file bytes) reproduce on any machine. The numerical one, of the "
        "reference logits, reproduces bit for bit only under an equal numerics fingerprint; elsewhere "
        "`mixquant verify --against` this release names the fields that differ and how close the logits "
        "are (max |Δ|, mean KL, top-1 agreement).",
    ]
    return lines


def _dataset_text(dataset: Mapping[str, Any]) -> str:
    if dataset["source"] == "local":
        return f"a local dataset file (SHA-256 `{dataset['local']['sha256']}`)"
    members = [
        f"`{m['repo']}`" + (f"@`{m['revision'][:12]}`" if m.get("revision") else " (unpinned)")
        for m in dataset["hub"]
    ]
    return ", ".join(members)


def _status_section(inputs: CardInputs) -> list[str]:
    recipe = inputs.recipe
    verdict = inputs.verdict
    checked = len(verdict.get("verdicts", []))
    lines = ["## Status and limitations", ""]
    lines.append(
        f"- KLD gates: {'all passed' if verdict.get('passed') else 'FAILED'} ({checked} candidate × KV "
        f"checks{verdict_words(inputs.gates)}, `check_kld_gates`)."
    )
    if recipe["kld"]["engine"] == "hf":
        lines.append(
            "- KLD was measured with the `hf` engine (transformers, dequantizing loader; FP8 KV emulated by "
            "dynamic per-tensor FP8 of K and V), not vLLM: served numerics can differ."
        )
    if recipe["export"]["kv_cache_quant"] is None:
        lines.append("- The checkpoint carries no KV-cache scales (`kv_cache_quant_algo` null).")
    if source_model(recipe)["kind"] == "toy":
        lines.append(
            "- This is the embedded toy model: a tiny Laguna trained for minutes to exercise the workflow. "
            "It is not a useful language model."
        )
    published = {k: v for k, v in (recipe.get("published") or {}).items() if v and k in HASH_NAMES}
    if not published:
        lines.append("- No published hashes are pinned in the recipe (`published`): nothing to compare with.")
    else:
        matching = [
            name for name, sha in published.items() if inputs.hashes.get(name, {}).get("sha256") == sha
        ]
        lines.append(
            f"- Published hashes: {len(matching)} of {len(published)} pinned in the recipe match this release"
            + (
                "."
                if len(matching) == len(published)
                else f" (differing: {', '.join(sorted(set(published) - set(matching)))})."
            )
        )
    lines += _published_numerics_lines(inputs)
    lines.append(limitation_line(inputs.recipe, inputs.gates))
    return lines


def _published_numerics_lines(inputs: CardInputs) -> list[str]:
    pinned = (inputs.recipe.get("published") or {}).get("numerics")
    if pinned is None or inputs.numerics is None:
        return []
    differences = fingerprint_differences({"decisive": dict(inputs.numerics)}, {"decisive": pinned})
    if not differences:
        return ["- Published numerics fingerprint (`published.numerics`): equal to this release's."]
    fields = ", ".join(_fingerprint_field(difference.split(":", 1)[0]) for difference in differences)
    return [
        f"- Published numerics fingerprint (`published.numerics`): differs in {fields}; this release's "
        "reference logits were made under other numerics than the published ones, so they are not "
        "reproducible bit for bit."
    ]


def _fingerprint_field(field: str) -> str:
    """A fingerprint field as the card names it: a library's version by the library's name."""
    library = field.removeprefix("libraries.")
    return f"`{field}`" if library == field else f"the `{library}` version"


def _files_section(inputs: CardInputs) -> list[str]:
    lines = ["## Files", ""]
    lines += [
        f"- `{name}`" + (f": {FILE_NOTES[name]}" if name in FILE_NOTES else "") for name in inputs.files
    ]
    return lines


def model_card(inputs: CardInputs) -> str:
    """README.md text: ``---`` YAML front matter ``---`` and the Markdown sections."""
    counts = {fmt: int(n) for fmt, n in inputs.inspection["placement_counts"].items()}
    name = release_name(inputs.recipe, counts, inputs.model_type)
    meta = front_matter(inputs, name)
    source = source_model(inputs.recipe)
    mix = ", ".join(f"{counts.get(f, 0)} {FORMAT_LABELS[f]}" for f in FORMAT_BITS)
    intro = (
        f"Mixed-precision ModelOpt checkpoint of {source['text']}: routed experts per MoE layer "
        f"{mix} ({inputs.inspection['routed_effective_bits']:.4f} effective bits), everything else BF16. "
        "Made by mixquant's Snakemake workflow, KL-gated against the BF16 model."
    )
    sections = [
        [f"# {name}", "", intro],
        _placement_section(inputs),
        _kld_section(inputs),
        serving_section(inputs.recipe, inputs.inspection, inputs.gates, inputs.weight_bytes, name),
        _provenance_section(inputs),
        _status_section(inputs),
        _files_section(inputs),
    ]
    body = "\n\n".join("\n".join(section) for section in sections)
    head = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=100)
    return f"---\n{head}---\n\n{body}\n"


def parse_front_matter(text: str) -> dict[str, Any]:
    """The YAML front matter of a model card (between the opening and closing ``---`` lines)."""
    if not text.startswith("---\n"):
        raise ValueError("model card: no YAML front matter (must open with '---')")
    end = text.find("\n---\n", 4)
    if end < 0:
        raise ValueError("model card: front matter is not closed by '---'")
    meta = yaml.safe_load(text[4 : end + 1])
    if not isinstance(meta, dict):
        raise ValueError("model card: front matter is not a mapping")
    return meta
