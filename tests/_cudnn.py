"""cuDNN's fused attention off a GPU: a stand-in that runs the same call with jax's XLA
implementation, and the switches that let a program with the real call export for ``cuda``."""

import jax
import jax.numpy as jnp

from meshtrain.kernels import _common

# The forward and backward custom calls of cuDNN's fused attention.
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


def cudnn_stand_in(monkeypatch) -> list | None:
    """Without a GPU, cuDNN's fused attention is replaced by jax's XLA implementation of the
    same `jax.nn.dot_product_attention` call (the mask and window arguments unchanged), so
    everything meshtrain does around it (per-shard wrapping, key/value heads, autodiff through
    the layouts) runs here; on a GPU the real kernel runs. Returns the calls it served."""
    if jax.default_backend() == "gpu":
        return None
    real, calls = jax.nn.dot_product_attention, []

    def stand_in(*args, implementation=None, **kw):
        assert implementation == "cudnn"
        dtypes = [a.dtype for a in args[:3]]
        assert all(d in (jnp.bfloat16, jnp.float16) for d in dtypes), f"cuDNN takes no {dtypes}"
        calls.append(implementation)
        return real(*args, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    resolve = _common.resolve_impl  # cuDNN is otherwise refused off a GPU
    monkeypatch.setattr(
        _common, "resolve_impl", lambda impl, **kw: impl if impl == "cudnn" else resolve(impl, **kw)
    )
    return calls


def cudnn_for_export(monkeypatch) -> None:
    """Lets the real cuDNN call be traced and lowered for ``cuda`` on this machine: jax asks
    the CUDA plugin for cuDNN's version and the GPU's compute capability while tracing, so
    both are answered (cuDNN 9.10 on a Hopper GPU); meshtrain's kernels take the GPU paths."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(_common, "on_gpu", lambda: True)
