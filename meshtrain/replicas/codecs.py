"""Gradient codecs: how the replicas' gradients are compressed on their way to the mean.

A `Codec` reduces one float32 array over the replica axes, inside a region manual over them
(`meshtrain.replicas.manual`). Each replica contributes what its encoder keeps of its own array
(``sent``, decoded); the result is the mean of those contributions, the same on every replica.
What an encoder drops (``x - sent``) is the error-feedback residual.

- ``none``: an exact float32 mean (one all-reduce).
- ``bf16``: each replica's array rounded to bfloat16. Done as a reduce-scatter phase (an
  all-to-all of bfloat16 chunks), a float32 sum of the chunk it owns, the mean rounded to
  bfloat16 again, and an all-gather: half the bytes of float32 on the wire, summed in float32.
- ``int8``: the same two phases with block-wise scaled int8 (one float32 scale per block of
  `Codec.block` values, ``max |x| / 127``, round to nearest): about a quarter of the bytes.
- ``topk:F``: each replica keeps its largest ``ceil(F·n)`` entries by magnitude (per tensor, or
  per shard of a tensor split over model axes, see `reduced_grads`);
  values and int32 indices are all-gathered and scatter-added.
- ``sign``: one bit per entry (packed 8 to a byte) and one float32 scale per tensor, the mean
  magnitude (scaled sign: ``mean|x| · sign(x)``, zero counting as positive); all-gathered.

The payloads cross the wire as integers (bfloat16 bit-cast to uint16), so no backend can widen
them: XLA's CPU backend, for one, turns a bfloat16 all-gather into a float32 one, and aborts on
a bfloat16 all-reduce (jax 0.12).

The all-gather schemes (top-k, sign) receive every replica's payload, so their bytes grow with
the number of replicas R: an all-gather moves (R−1)/R of R payloads, where a ring all-reduce
moves 2(R−1)/R of one float32 array. Sign costs R/64 of float32's bytes; top-k R·F (a value and
an index, 8 bytes, per kept entry).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain import validate
from meshtrain.problem import Problem
from meshtrain.replicas.config import parse_compression_spec


def parse_compression(spec: str) -> Codec:
    """The codec a ``--grad-compression`` value names.

    Args:
        spec: ``none``, ``bf16``, ``int8``, ``topk:FRACTION`` with FRACTION in (0, 1], or
            ``sign``.

    Returns:
        The `Codec`.

    Raises:
        ValueError: one line naming grad_compression, the value and the fix.
    """
    name, fraction = parse_compression_spec(spec)
    return Codec(name=name) if fraction is None else Codec(name=name, fraction=fraction)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec(validate.Checked):
    """One way of compressing the replicas' gradients (see the module docstring).

    Args:
        name: ``none``, ``bf16``, ``int8``, ``topk`` or ``sign``.
        fraction: for ``topk``, the fraction of each tensor's entries every replica sends.
        block: for ``int8``, values per scale (tensors smaller than R·block use blocks of
            ``ceil(n / R)``).
    """

    name: str = "none"
    fraction: float | None = None
    block: int = 256

    def problems(self) -> list[Problem]:
        """What is wrong with this codec; an empty list when nothing."""
        spec = f"topk:{self.fraction}" if self.name == "topk" else self.name
        return validate.check(
            "grad_compression", spec, parse_compression_spec, spec
        ) + validate.positive("block", self.block, example=256)

    @property
    def lossy(self) -> bool:
        """Whether replicas send less than their whole float32 gradient."""
        return self.name != "none"

    @property
    def spec(self) -> str:
        """The ``--grad-compression`` spelling of this codec."""
        return f"topk:{self.fraction:g}" if self.name == "topk" else self.name

    def kept(self, n: int) -> int:
        """Entries top-k keeps of a tensor of `n`: ``ceil(fraction · n)``, at least 1."""
        # The tolerance keeps binary rounding (0.07 · 100 = 7.000000000000001) from adding one.
        return max(1, min(n, math.ceil(self.fraction * n - 1e-9 * n)))

    def int8_block(self, n: int, replicas: int) -> int:
        """Values per int8 scale for a tensor of `n` entries over `replicas`."""
        return max(1, min(self.block, -(-n // replicas)))

    def buffer_bytes(self, n: int, replicas: int) -> int:
        """The bytes of the collective buffers one tensor of `n` entries goes through over
        `replicas`, counted as the inspector counts them (`Collective.buffer_bytes`: each
        all-gather's whole output, each all-to-all's and all-reduce's whole buffer)."""
        r = replicas
        if self.name == "none":
            return 4 * n
        if self.name == "topk":
            return r * self.kept(n) * (4 + 4)
        if self.name == "sign":
            return r * (-(-n // 8) + 4)
        multiple = self.int8_block(n, r) if self.name == "int8" else 1
        m = -(-n // (r * multiple)) * multiple  # each replica's chunk
        if self.name == "bf16":
            return 2 * r * m * 2  # an all-to-all and an all-gather of R chunks of uint16
        return 2 * r * (m + 4 * (m // multiple))  # the same in int8, with a scale per block

    def reduce(self, x: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
        """The mean over the replicas of what each sends of `x`.

        Call it inside a region manual over `axes`.

        Args:
            x: this replica's float32 array (any shape).
            axes: the manual replica axes.

        Returns:
            ``(mean, sent)``: the mean of the replicas' decoded contributions (float32, shaped
            like `x`, the same on every replica) and this replica's own decoded contribution
            (so the error-feedback residual is ``x - sent``).
        """
        axes = tuple(axes)
        x = x.astype(jnp.float32)
        if self.name == "none":
            return lax.pmean(x, axes), x
        if self.name == "topk":
            return _topk(x, axes, self.kept(x.size))
        if self.name == "sign":
            return _sign(x, axes)
        r = _replicas(axes)
        if self.name == "bf16":
            return _two_phase(x, axes, _Bf16(), chunk_multiple=1)
        block = self.int8_block(x.size, r)
        return _two_phase(x, axes, _Int8(block), chunk_multiple=block)


def _replicas(axes: tuple[str, ...]) -> int:
    """R: the number of replicas over the manual `axes`."""
    return math.prod(lax.axis_size(a) for a in axes)


def _gather(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """All replicas' `x` stacked on a new dim 0, typed as the same on every replica."""
    return lax.all_gather(x, axes, tiled=False, to="invarying")


class _Bf16:
    """bfloat16 payloads, carried as their uint16 bits."""

    def encode(self, x_CM):
        """[C, M] float32 -> ([C, M] uint16,)."""
        return (lax.bitcast_convert_type(x_CM.astype(jnp.bfloat16), jnp.uint16),)

    def decode(self, bits_CM):
        """The float32 values of uint16 bfloat16 bits."""
        return lax.bitcast_convert_type(bits_CM, jnp.bfloat16).astype(jnp.float32)


class _Int8:
    """Block-wise scaled int8 payloads: one float32 scale (max |x| / 127) per block."""

    def __init__(self, block: int):
        self.block = block

    def encode(self, x_CM):
        """[C, M] float32 -> ([C, M] int8, [C, M/block] float32 scales), round to nearest."""
        c, m = x_CM.shape
        x_CNB = x_CM.reshape(c, m // self.block, self.block)
        scale_CN = jnp.max(jnp.abs(x_CNB), axis=-1) / 127.0
        safe = jnp.where(scale_CN > 0, scale_CN, 1.0)[..., None]
        q_CNB = jnp.clip(jnp.round(x_CNB / safe), -127, 127).astype(jnp.int8)
        return q_CNB.reshape(c, m), scale_CN

    def decode(self, q_CM, scale_CN):
        """float32 values of int8 payloads and their block scales."""
        c, m = q_CM.shape
        x_CNB = q_CM.reshape(c, m // self.block, self.block).astype(jnp.float32)
        return (x_CNB * scale_CN[..., None]).reshape(c, m)


def _two_phase(x, axes, fmt, *, chunk_multiple: int):
    """Reduce-scatter (all-to-all of encoded chunks, float32 sum) then all-gather, encoded.

    `x` is flattened and zero-padded to R chunks of M values, M a multiple of `chunk_multiple`;
    replica r sums chunk r of every replica, re-encodes the mean and all-gathers it.
    """
    r, n = _replicas(axes), x.size
    m = -(-n // (r * chunk_multiple)) * chunk_multiple
    x_RM = jnp.pad(x.reshape(-1), (0, r * m - n)).reshape(r, m)
    payload = fmt.encode(x_RM)
    sent = fmt.decode(*payload).reshape(-1)[:n].reshape(x.shape)
    # Row j of what arrives is replica j's copy of the chunk this replica owns.
    mine = [lax.all_to_all(p, axes, 0, 0, tiled=True) for p in payload]
    mean_1M = jnp.sum(fmt.decode(*mine), axis=0, keepdims=True) / r
    gathered = [_gather(p[0], axes) for p in fmt.encode(mean_1M)]  # each [R, ...]
    mean = fmt.decode(*gathered).reshape(-1)[:n].reshape(x.shape)
    return mean, sent


def _topk(x, axes, k: int):
    """Each replica's `k` largest-magnitude entries, all-gathered and scatter-added."""
    r, flat = _replicas(axes), x.reshape(-1)
    _, idx_K = lax.top_k(jnp.abs(flat), k)
    idx_K = idx_K.astype(jnp.int32)
    val_K = flat[idx_K]
    sent = jnp.zeros_like(flat).at[idx_K].set(val_K).reshape(x.shape)
    val_RK, idx_RK = _gather(val_K, axes), _gather(idx_K, axes)
    total = jnp.zeros(flat.shape, jnp.float32).at[idx_RK.reshape(-1)].add(val_RK.reshape(-1))
    return (total / r).reshape(x.shape), sent


def _sign(x, axes):
    """Scaled signs: 1 bit per entry packed 8 per byte, a float32 mean |x| per replica."""
    r, flat = _replicas(axes), x.reshape(-1)
    n = flat.size
    scale = jnp.mean(jnp.abs(flat))
    bits_P = jnp.packbits(flat >= 0)  # [ceil(n/8)] uint8
    sent = (scale * _signs(bits_P, n)).reshape(x.shape)
    bits_RP, scale_R = _gather(bits_P, axes), _gather(scale, axes)
    total = jnp.sum(scale_R[:, None] * _signs(bits_RP, n), axis=0)
    return (total / r).reshape(x.shape), sent


def _signs(bits, n: int) -> jax.Array:
    """±1.0 (float32) from packed bits along the last dim, the first `n` of them."""
    unpacked = jnp.unpackbits(bits, axis=-1)[..., :n]
    return 2.0 * unpacked.astype(jnp.float32) - 1.0
