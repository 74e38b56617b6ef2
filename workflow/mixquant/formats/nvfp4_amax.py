"""Per-block amax of a static NVFP4 weight quantizer, as ModelOpt 0.47's weight calibrations choose it.

:func:`nvfp4_block_amax` dispatches on the calibration (``quantize.nvfp4_calibration``):

* ``fp8_sweep`` (``{"method": "mse", "fp8_scale_sweep": True}``): :func:`mixquant.formats.nvfp4.
  sweep_nvfp4_block_amax`;
* ``max``: max |w| per block;
* ``mse`` (``{"method": "mse"}``): ModelOpt's multiplier search -- ``MseCalibrator`` started from the
  per-block max amax, 39 multipliers ``linspace(0.25, 4, 39)``, each candidate ``amax * m`` fake quantized
  through the static NVFP4 quantizer with ``global_amax`` fixed, per-block fp32 squared error summed over
  the block, first argmin per block, result kept in fp32 (static block quantizers keep their amax in
  fp32). :func:`nvfp4_mse_block_amax` runs ModelOpt's own ``MseCalibrator`` with the static fake quant of
  :mod:`mixquant.formats.cpu_fake_quant` (= ModelOpt's export numerics), block rows in chunks (blocks are
  independent, so chunking changes nothing).

ModelOpt is imported only where a calibration needs it (``max`` needs none of it).
"""

from __future__ import annotations

from functools import partial

import torch

from mixquant.formats.facts import NVFP4_GROUP_SIZE as BLOCK_SIZE

__all__ = ["NVFP4_CALIBRATIONS", "nvfp4_block_amax", "nvfp4_mse_block_amax"]

NVFP4_CALIBRATIONS = ("fp8_sweep", "max", "mse")
_MSE_CHUNK_BLOCKS = 1 << 16  # NVFP4 multiplier MSE: blocks per ModelOpt calibrator (~4 MiB fp32 input)


@torch.no_grad()
def nvfp4_mse_block_amax(
    weight: torch.Tensor, global_amax: torch.Tensor, *, chunk_blocks: int = _MSE_CHUNK_BLOCKS
) -> torch.Tensor:
    """Per-block amax of ModelOpt's NVFP4 ``mse`` (multiplier search, no ``fp8_scale_sweep``), fp32 [B, 1].

    Exactly ``_make_weight_mse_calibrator`` without the sweep: ModelOpt's own ``MseCalibrator``
    (``axis=(0,)`` over the ``[n_blocks, 16]`` calibration layout, ``MseCalibConfig`` defaults) started
    from the max-calibrated per-block amax, with the static NVFP4 fake quant at fixed ``global_amax`` as
    ``quant_func`` (ModelOpt's export numerics, as :func:`cpu_nvfp4_fake_quant` patches in). Blocks are
    independent (per-block loss and argmin), so processing ``chunk_blocks`` at a time is exact.
    """
    from modelopt.torch.quantization.calib.mse import MseCalibrator
    from modelopt.torch.quantization.config import MseCalibConfig

    from mixquant.formats.cpu_fake_quant import nvfp4_static_qdq  # lazy: imports modelopt

    cfg = MseCalibConfig()
    blocks = weight.detach().reshape(-1, BLOCK_SIZE)
    global_amax = torch.as_tensor(global_amax, dtype=torch.float32, device=weight.device).reshape(())
    quant_func = partial(nvfp4_static_qdq, global_amax=global_amax)
    out = torch.empty(blocks.shape[0], 1, dtype=torch.float32, device=weight.device)
    for b0 in range(0, blocks.shape[0], max(1, int(chunk_blocks))):
        chunk = blocks[b0 : b0 + chunk_blocks]
        # MaxCalibrator's per-block amax (in the weight dtype, then kept in fp32 by the static quantizer)
        initial = chunk.abs().amax(dim=1, keepdim=True).to(torch.float32)
        calibrator = MseCalibrator(
            amax=initial,
            axis=(0,),
            step_size=cfg.step_size,
            start_multiplier=cfg.start_multiplier,
            stop_multiplier=cfg.stop_multiplier,
            quant_func=quant_func,
        )
        calibrator.collect(chunk)  # casts to fp32, as ModelOpt's calibration forward does
        out[b0 : b0 + chunk.shape[0]] = calibrator.compute_amax().to(torch.float32).view(-1, 1)
        calibrator.reset()
    return out


def nvfp4_block_amax(weight: torch.Tensor, global_amax: torch.Tensor, calibration: str) -> torch.Tensor:
    """Per-block fp32 amax ``[n_blocks, 1]`` of a static NVFP4 weight quantizer for ``calibration``."""
    if calibration == "fp8_sweep":
        from mixquant.formats.nvfp4 import sweep_nvfp4_block_amax  # lazy: imports modelopt

        return sweep_nvfp4_block_amax(weight, global_amax)
    if calibration == "max":
        return weight.detach().reshape(-1, BLOCK_SIZE).abs().amax(dim=1, keepdim=True).to(torch.float32)
    if calibration == "mse":
        return nvfp4_mse_block_amax(weight, global_amax)
    raise ValueError(f"unknown NVFP4 calibration {calibration!r}; one of {NVFP4_CALIBRATIONS}")
