"""cuDNN's fused attention off a GPU: a stand-in that runs the same call with jax's XLA
implementation, and the switches that let a program with the real call export for ``cuda``."""

import jax
import jax.numpy as jnp

from meshtrain.kernels import _common

_XLA_ATTENTION = jax.nn.dot_product_attention  # as jax has it, whatever a test patches in
# The forward and backward custom calls of cuDNN's fused attention.
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


def cudnn_stand_in(monkeypatch) -> list | None:
    """Without a GPU, cuDNN's fused attention is replaced by jax's XLA implementation of the
    same `jax.nn.dot_product_attention` call (the mask and window arguments unchanged), so
    everything meshtrain does around it (per-shard wrapping, key/value heads, autodiff through
    the layouts) runs here; on a GPU the real kernel runs. Returns the calls it served."""
    if jax.default_backend() == "gpu":
        return None
    real, calls = _XLA_ATTENTION, []

    def stand_in(*args, implementation=None, **kw):
        assert implementation == "cudnn"
        dtypes = [a.dtype for a in args[:3]]
        assert all(d in (jnp.bfloat16, jnp.float16) for d in dtypes), f"cuDNN takes no {dtypes}"
        calls.append(implementation)
        return real(*args, implementation="xla", **kw)

    def packed_stand_in(q, k, v, bias, mask, q_lengths, kv_lengths, q_offsets, kv_offsets, **kw):
        calls.append("cudnn-packed")
        return packed_attention(q, k, v, q_lengths, kv_lengths, q_offsets, kv_offsets, **kw)

    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    monkeypatch.setattr(cudnn, "dot_product_attention", packed_stand_in)
    monkeypatch.setattr(_common, "hopper_or_later", lambda: True)
    resolve = _common.resolve_impl  # cuDNN is otherwise refused off a GPU
    monkeypatch.setattr(
        _common, "resolve_impl", lambda impl, **kw: impl if impl == "cudnn" else resolve(impl, **kw)
    )
    return calls


def packed_attention(q, k, v, q_lengths, kv_lengths, q_offsets, kv_offsets, *, scale, mask_type,
                     qkv_layout):  # fmt: skip
    """cuDNN's packed layout as its documentation defines it, in jax's XLA attention: row b's
    document m is tokens ``[offsets[b, m], offsets[b, m] + lengths[b, m])`` (entries of -1
    unused); a query sees the keys of its own document, and with a causal mask type none
    after itself."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    assert qkv_layout == "BTNH" and mask_type in (MaskType.PADDING, MaskType.PADDING_CAUSAL)

    def document_of(lengths, offsets, n):  # [B, n]: 1 + the document of each token, 0: none
        t = jnp.arange(n)
        starts, ends = offsets[:, :-1, None], offsets[:, :-1, None] + lengths[:, :, None]
        inside = (lengths[:, :, None] > 0) & (starts <= t) & (t < ends)  # [B, M, n]
        return jnp.where(inside.any(1), jnp.argmax(inside, axis=1) + 1, 0)

    q_doc = document_of(q_lengths, q_offsets, q.shape[1])
    k_doc = document_of(kv_lengths, kv_offsets, k.shape[1])
    visible = (q_doc[:, :, None] == k_doc[:, None, :]) & (q_doc[:, :, None] > 0)
    if mask_type == MaskType.PADDING_CAUSAL:
        visible &= jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    return _XLA_ATTENTION(q, k, v, mask=visible[:, None], scale=scale, implementation="xla")


def cudnn_for_export(monkeypatch) -> None:
    """Lets the real cuDNN call be traced and lowered for ``cuda`` on this machine: jax asks
    the CUDA plugin for cuDNN's version and the GPU's compute capability while tracing, so
    both are answered (cuDNN 9.10 on a Hopper GPU); meshtrain's kernels take the GPU paths."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(_common, "on_gpu", lambda: True)
    monkeypatch.setattr(_common, "hopper_or_later", lambda: True)
