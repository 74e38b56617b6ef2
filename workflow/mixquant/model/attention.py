"""See (and replace) the K and V tensors a transformers model hands its attention function.

K arrives after ``k_proj``, ``k_norm`` and RoPE, V after ``v_proj`` (``[B, kv_heads, T, head_dim]``, before
``repeat_kv``): what a KV cache stores, and where ModelOpt's KV quantizers read. Used by the activation
statistics (K/V amax) and by the hf engine's FP8 KV-cache emulation.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch

KvHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@contextlib.contextmanager
def attention_kv_hook(model: torch.nn.Module, hook: KvHook) -> Iterator[None]:
    """While active, every attention call passes ``hook(layer_idx, key, value) -> (key, value)`` first.

    Wraps the function the model's attention modules call: ``eager_attention_forward`` of their modeling
    module for the eager implementation, else ``ALL_ATTENTION_FUNCTIONS[impl]`` -- restored exactly on
    exit (a registry override is removed again, a previous one put back).
    """
    attn_modules = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not attn_modules:
        raise RuntimeError("no attention modules found")
    modeling = inspect.getmodule(type(attn_modules[0]))
    impl = model.config._attn_implementation

    def wrap(orig):
        def attention(module, query, key, value, *args, **kwargs):
            key, value = hook(int(module.layer_idx), key, value)
            return orig(module, query, key, value, *args, **kwargs)

        return attention

    if impl in (None, "eager"):
        orig = modeling.eager_attention_forward
        modeling.eager_attention_forward = wrap(orig)
        try:
            yield
        finally:
            modeling.eager_attention_forward = orig
        return
    registry = modeling.ALL_ATTENTION_FUNCTIONS
    local = registry._local_mapping
    had_local, previous = impl in local, local.get(impl)
    registry[impl] = wrap(registry[impl])
    try:
        yield
    finally:
        if had_local:
            local[impl] = previous
        else:
            local.pop(impl, None)
