"""A small random bf16 Laguna in upstream layout (dense layer 0 + 4 MoE layers) and calibration tokens."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def small_laguna(tmp_path_factory, small_laguna_config):
    from mixquant.model import toy_layout
    from transformers import LagunaForCausalLM

    config = small_laguna_config()
    torch.manual_seed(0)
    model = LagunaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in (1, 2, 3, 4):
            mlp = model.model.layers[layer].mlp
            for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                p[torch.rand(p.shape, generator=gen) < 3e-3] *= 25.0
            mlp.gate.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
        # sharper logits so KL scores are well above rounding noise
        model.lm_head.weight.mul_(8.0)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    out = tmp_path_factory.mktemp("small-laguna")
    toy_layout.save_upstream_checkpoint(model, out, num_shards=2)
    return out


@pytest.fixture(scope="session")
def small_calibration_ids():
    return torch.randint(4, 128, (6, 24), generator=torch.Generator().manual_seed(2))
