"""The format facts (mixquant.formats.facts) are ModelOpt's, and every reader reads the same ones."""

from __future__ import annotations

import subprocess
import sys
import typing
import warnings
from pathlib import Path

import torch
from mixquant.formats import facts

REPO = Path(__file__).resolve().parents[2]


def test_the_facts_are_modelopts():
    warnings.filterwarnings("ignore", message="transformers .* is not tested")
    import modelopt.torch.quantization as mtq

    entries = mtq.W4A16_NVFP4_CFG["quant_cfg"]
    weight = next(e for e in entries if e.get("quantizer_name") == "*weight_quantizer")
    assert weight["cfg"]["block_sizes"][-1] == facts.NVFP4_GROUP_SIZE
    assert weight["cfg"]["effective_bits"] == facts.ROUTED_FORMAT_BITS[facts.NVFP4]
    assert torch.finfo(torch.float8_e4m3fn).max == facts.FP8_E4M3_MAX
    assert facts.ROUTED_FORMAT_BITS == {facts.NVFP4: 4.5, facts.FP8: 8.0, facts.BF16: 16.0}
    assert list(facts.ROUTED_FORMAT_BITS) == list(facts.FORMATS)  # cheapest first, one order everywhere


def test_the_config_and_the_audit_read_the_same_formats():
    from mixquant.config.base import Format
    from mixquant.export import predict
    from mixquant.quantize import reference

    assert typing.get_args(Format) == facts.FORMATS
    assert predict.FORMATS is reference.FORMATS is facts.FORMATS


def test_the_facts_import_no_torch():
    code = "import sys, mixquant.formats.facts; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(REPO / "workflow")})
