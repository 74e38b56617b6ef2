"""The placement refined by measured KL (mixquant.search.refine): the K best ILP placements equal a brute
force enumeration's, the streamed measurement of a whole placement equals a whole-model forward with every
placed layer quantized, and the held-out sequences continue the calibration's draw."""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest
import torch
from mixquant.search.groups import SearchGroup, budget_limit, choice_cost, summed_score
from mixquant.search.ilp import k_best_ilp, solve_ilp
from mixquant.search.refine import candidate_placements, measured_kl
from mixquant.search.score import LayerQuant, kl_sum, load_search_model, quantized_experts

FORMATS = ("nvfp4_w4a16", "fp8", "bf16")


def random_groups(rng: random.Random, n: int) -> list[SearchGroup]:
    return [
        SearchGroup(
            f"model.layers.{i + 1}.mlp.experts",
            1000,
            {"nvfp4_w4a16": rng.random(), "fp8": rng.random() * 0.3, "bf16": 0.0},
            1.0,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("trial", range(12))
def test_k_best_equals_brute_force(trial):
    rng = random.Random(trial)
    groups = random_groups(rng, rng.randint(3, 6))
    target = rng.choice([5.0, 6.0, 7.0, 9.0])
    feasible = []
    for combo in itertools.product(FORMATS, repeat=len(groups)):
        choice = {g.name: f for g, f in zip(groups, combo, strict=True)}
        if choice_cost(groups, choice) <= budget_limit(groups, target):
            feasible.append(summed_score(groups, choice))
    feasible.sort()
    found = k_best_ilp(groups, target, 6)
    assert len(found) == min(6, len(feasible))
    assert [s.objective for s in found] == pytest.approx(feasible[: len(found)], rel=1e-12, abs=1e-15)
    assert len({tuple(s.choice.values()) for s in found}) == len(found)  # distinct
    assert found[0].choice == solve_ilp(groups, target).choice  # the first is the solve's (ties broken alike)
    assert all(s.effective_bits <= target + 1e-12 for s in found)


def test_candidates_are_the_k_best_and_the_solves_own_when_it_differs():
    groups = random_groups(random.Random(5), 5)
    best = solve_ilp(groups, 6.0)
    solved = {int(name.split(".")[2]): fmt for name, fmt in best.choice.items()}
    listed = candidate_placements(groups, 6.0, 4, solved)
    assert [c["source"] for c in listed] == ["ilp"] * 4
    assert listed[0]["placement"] == solved
    assert [c["predicted"] for c in listed] == sorted(c["predicted"] for c in listed)
    other = dict.fromkeys(solved, "nvfp4_w4a16")  # e.g. ModelOpt's threshold search picked uniform NVFP4
    listed = candidate_placements(groups, 6.0, 4, other)
    assert listed[0]["source"] == "solve" and listed[0]["placement"] == other and len(listed) == 4


def test_streamed_measurement_equals_a_whole_model_forward(small_laguna, small_calibration_ids):
    """Every placed layer quantized at once, streamed a layer at a time with the candidates carried
    together, against the whole model with the same layers swapped: the same KL sums per sequence."""
    from mixquant.model.streaming import StreamedModel

    model = load_search_model(small_laguna)
    generator = torch.Generator().manual_seed(3)

    def fake_quant(layer: int, fmt: str) -> LayerQuant:  # a perturbed copy stands in for a format
        experts = model.model.layers[layer].mlp.experts
        scale = 0.05 if fmt == "nvfp4_w4a16" else 0.01
        noisy = [
            (p.float() * (1 + scale * torch.randn(p.shape, generator=generator))).to(p.dtype)
            for p in (experts.gate_up_proj.data, experts.down_proj.data)
        ]
        if fmt == "fp8":  # FP8 W8A8: its inputs fake-quantized at a static amax too
            return LayerQuant(layer, fmt, *noisy, torch.tensor(8.0), torch.tensor(8.0))
        return LayerQuant(layer, fmt, *noisy)

    quants = {(layer, fmt): fake_quant(layer, fmt) for layer in (1, 2, 3, 4) for fmt in FORMATS[:2]}
    candidates = [
        {1: "nvfp4_w4a16", 2: "bf16", 3: "fp8", 4: "nvfp4_w4a16"},
        {1: "bf16", 2: "bf16", 3: "nvfp4_w4a16", 4: "bf16"},
        dict.fromkeys((1, 2, 3, 4), "bf16"),
    ]
    ids = small_calibration_ids.long()
    with StreamedModel(small_laguna) as stream:
        streamed = measured_kl(stream, ids, candidates, lambda layer, fmt: quants[(layer, fmt)], batch_size=3)
    assert streamed[2] == [0.0] * ids.shape[0]  # the BF16 placement is the reference
    with torch.no_grad():
        for candidate, sums in zip(candidates[:2], streamed[:2], strict=True):
            expected = []
            for start in range(0, ids.shape[0], 3):
                batch = ids[start : start + 3]
                log_p = torch.log_softmax(model(input_ids=batch).logits, -1, dtype=torch.float32)
                with contextlib.ExitStack() as stack:
                    for layer, fmt in candidate.items():
                        if fmt != "bf16":
                            stack.enter_context(quantized_experts(model, quants[(layer, fmt)]))
                    logits = model(input_ids=batch).logits
                expected += [float(kl_sum(log_p[s], logits[s], log_p[s].exp())) for s in range(len(batch))]
            assert sums == pytest.approx(expected, rel=1e-4)
            assert all(value > 0 for value in sums)


def test_held_out_sequences_continue_the_calibration_draw(tmp_path, monkeypatch):
    """The refinement's held-out artifact (sample_calibration with held_out_after): exactly the rows a
    draw of calibration + held-out sequences makes after the calibration's, which are the calibration
    artifact's own rows, so no conversation of the scored sequences is in it."""
    import importlib
    from pathlib import Path

    import yaml
    from mixquant.calibration.tokens import load_token_ids
    from mixquant.config import validate_config
    from mixquant.graph import resolve_artifacts
    from mixquant.keys.stages import STAGES

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "data").symlink_to(repo / "data")
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    raw["calibration"].update(num_samples=12, seq_len=64)
    raw["placement"]["search"].update(macro_batch=None, refine={"candidates": 2, "holdout_samples": 6})
    art = resolve_artifacts(validate_config(raw))

    def run(name: str) -> Path:
        module, function = STAGES[art[name].stage].runner.split(":")
        runner = getattr(importlib.import_module(module), function)
        paths = {role: art[upstream].path for role, upstream in art[name].upstream.items()}
        runner(art[name].path, **paths, settings=art[name].settings, preimage=art[name].preimage)
        return art[name].path / "calibration.safetensors"

    run("model")
    scored, held_out = load_token_ids(run("calibration")), load_token_ids(run("holdout"))
    longer = copy_of(raw, num_samples=18)
    both = resolve_artifacts(validate_config(longer))["calibration"]
    art = {**art, "both": both}
    joined = load_token_ids(run("both"))
    assert held_out.shape == (6, 64)
    assert torch.equal(joined[:12], scored) and torch.equal(joined[12:], held_out)
    assert not {tuple(r.tolist()) for r in held_out} & {tuple(r.tolist()) for r in scored}


def copy_of(raw: dict, **calibration) -> dict:
    import copy

    out = copy.deepcopy(raw)
    out["calibration"].update(calibration)
    return out
