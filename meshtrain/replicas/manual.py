"""The gradient step manual over the replica axes, where the gradient reduction is ours.

Under automatic sharding XLA reduces the gradient inside the backward pass, so no
per-replica gradient ever exists to compress. Here the loss and gradient run in a region
manual over the replica axes (the batch axes no parameter is split over); each replica sees
its own rows of the batch and the parameters whole over those axes, while the model axes
(``tensor``, ``fsdp`` under hsdp) stay with the compiler. The parameters are marked varying
over the replica axes before the gradient is taken, so the gradient stays per replica until
a `Codec` reduces it, leaf by leaf.

For a mixture of experts the region is manual over ``expert`` too, and each leaf is reduced
over the axes it is not split over (`meshtrain.replicas.sets`); under pipelines it is manual
over ``pipe`` as well, and the pipeline's loop runs inside it, so the reduction follows the
loop.

With error feedback each replica adds what it failed to send last time (its residual) to
its gradient before encoding, and keeps what it fails to send now.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.context_parallel import whole_model_in_region
from meshtrain.layout import axes_of, manual_region, varying
from meshtrain.replicas.codecs import Codec
from meshtrain.replicas.sets import ReplicaSets
from meshtrain.replicas.stack import replica_mean, settled

# compute(params, rest, batch) -> ((loss, (rest, extra)), grads)
Compute = Callable[[dict, dict, Mapping[str, jax.Array]], tuple]


def residual_init(params, n):
    """Zero error-feedback residuals: each leaf of `params` as float32 zeros ``(R, *shape)``.

    Args:
        params: the parameters (arrays or shape structs).
        n: R, the number of replicas: one int for every leaf, or a tree like `params` of each
            leaf's own (`meshtrain.replicas.ReplicaSets.count`).

    Returns:
        A tree like `params`.
    """
    counts = jax.tree.map(lambda _: n, params) if isinstance(n, int) else n
    return jax.tree.map(lambda p, r: jnp.zeros((r, *p.shape), jnp.float32), params, counts)


def reduced_grads(
    compute: Compute,
    params: dict,
    rest: dict,
    batch: Mapping[str, jax.Array],
    residual,
    *,
    sets: ReplicaSets,
    codec: Codec,
    error_feedback: bool,
    param_specs=None,
):
    """The loss and mean gradient over the replicas, each replica's gradient sent by `codec`.

    Call it inside `jax.jit` (under `meshtrain.layout.activation_rules` for models that
    constrain their activations).

    Args:
        compute: ``(params, rest, batch) -> ((loss, (rest, extra)), grads)``, one device's
            loss (a mean over its rows) and gradient.
        params: the parameters (replicated over ``sets.axes``, except over ``sets.split``).
        rest: the model's other variables (replicated over ``sets.axes``).
        batch: the global batch; dim 0 is split over ``sets.axes``, each device taking its
            rows.
        residual: error-feedback residuals, leaves ``(R, *p.shape)`` float32 split on dim 0
            over the leaf's replica axes (`residual_init`); None without error feedback.
        sets: the layout of the step (`meshtrain.replicas.replica_sets` with ``mesh=``):
            ``sets.mesh``, the device mesh; ``sets.axes``, the sync axes, at least one (the
            replica axes, and ``expert`` for a mixture of experts); ``sets.split``, those of
            them that split some parameters (``expert``: a leaf split over one enters the
            region as its own block and is reduced over the other axes only);
            ``sets.stages``, ``("pipe",)`` under pipelines (the region is manual over the
            stages too, and `compute` runs the pipeline's loop inside it; no leaf is reduced
            over them).
        codec: how each replica's gradient is sent.
        error_feedback: add the residual before encoding and keep what was dropped (used only
            when the codec is lossy; otherwise `residual` passes through unchanged).
        param_specs: the parameters' `PartitionSpec`s (a tree like `params`; required when
            ``sets.split`` is not empty). A gradient split over model axes (``tensor``,
            ``fsdp`` under hsdp) is then encoded shard by shard, in a region manual over those
            axes too: no shard gathers the others first (top-k and sign then work per shard,
            int8's blocks lie within a shard). Without them every leaf is encoded whole, and
            XLA gathers split leaves over their axes.

    Returns:
        ``((loss, (rest, extra)), grads, residual)``: the loss and float `extra` metrics
        averaged over the devices, `rest` averaged over them (float leaves), the mean
        gradient (replicated over each leaf's replica axes, each leaf in its parameter's
        dtype), and the new residual (None when `residual` is None).
    """
    mesh, specs, feedback = _checked(sets, codec, error_feedback, residual, params, param_specs)
    body = _replica_body(compute, sets, specs, _leaf_reducer(sets, codec, feedback, mesh))
    blocks = jax.tree.map(sets.block_spec, specs, is_leaf=_is_spec)
    res_spec = (
        None if residual is None else jax.tree.map(sets.stacked_spec, specs, is_leaf=_is_spec)
    )
    run = manual_region(
        body,
        mesh=mesh,
        axes=sets.manual,
        in_specs=(blocks, P(), P(sets.axes), res_spec),
        out_specs=((P(), (P(), P())), blocks, res_spec),
    )
    return run(params, rest, batch, residual)


def _checked(sets: ReplicaSets, codec: Codec, error_feedback: bool, residual, params, specs):
    """The mesh, the parameters' specs and whether error feedback runs; refused where there is
    nothing to reduce or error feedback lacks its residual."""
    if not sets.axes:
        raise ValueError(
            "reduced_grads: no replica axis (R = 1), nothing to reduce; use the plain step"
        )
    mesh = sets.mesh_for("reduced_grads")
    specs = sets.specs(params, specs)
    feedback = error_feedback and codec.lossy
    if feedback and residual is None:
        r = math.prod(mesh.shape[a] for a in sets.axes)
        raise ValueError(
            f"reduced_grads: error feedback with grad_compression={codec.spec!r} needs the "
            f"residual; pass residual_init(params, {r}) (or error_feedback=False)"
        )
    return mesh, specs, feedback


def _replica_body(compute: Compute, sets: ReplicaSets, specs, one: Callable):
    """The region's per-device code: this replica's loss and gradient, each leaf reduced by
    `one` (`_leaf_reducer`), the loss, metrics and other variables averaged."""
    axes, stages = sets.axes, sets.stages

    def body(params, rest, batch, residual):
        params, rest = varying((params, rest), axes)
        with whole_model_in_region():
            (loss, (rest, extra)), grads = compute(params, rest, batch)
        loss, rest, extra = settled((loss, rest, extra), stages)
        grads = settled(grads, stages, specs)
        mean, new = _reduced(grads, residual, specs, one)
        return (
            (replica_mean(loss, axes), (replica_mean(rest, axes), replica_mean(extra, axes))),
            mean,
            new,
        )

    return body


def _leaf_reducer(sets: ReplicaSets, codec: Codec, feedback: bool, mesh: Mesh) -> Callable:
    """``one(g, res, spec) -> (mean, res)``: one leaf's gradient sent by `codec` over its
    replica axes; with `feedback` its residual is added first and what was not sent kept."""

    def one(g, res, spec):
        over = sets.leaf_axes(spec)
        # A leaf split over a sync axis holds the gradient of every row its shard served
        # across that axis: R/N of it is this replica's share of the mean.
        scale = sets.count(spec) / sets.devices
        x = g.astype(jnp.float32) * scale if scale != 1 else g.astype(jnp.float32)

        def step(x, r):
            mean, sent = codec.reduce(x + r, over)
            return mean, x + r - sent

        if not feedback:
            fn = _per_shard(lambda x: codec.reduce(x, over)[0], spec, mesh, sets.manual, 1)
            return fn(x).astype(g.dtype), res
        mean, kept = _per_shard(step, spec, mesh, sets.manual, 2)(x, res[0])
        return mean.astype(g.dtype), kept[None]

    return one


def _reduced(grads, residual, specs, one: Callable):
    """``(mean, new residual)``: `one` over every leaf (no residual: None)."""
    if residual is None:
        return jax.tree.map(lambda g, s: one(g, None, s)[0], grads, specs), None
    pairs = jax.tree.map(one, grads, residual, specs)
    outer = jax.tree.structure(grads)
    return jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)


def _is_spec(x) -> bool:
    """A leaf of a tree of specs (None: replicated)."""
    return x is None or isinstance(x, P)


def _per_shard(fn, spec, mesh: Mesh, replica_axes: tuple[str, ...], n: int):
    """`fn` (`n` arrays shaped like one parameter in, as many out) run shard by shard over the
    model axes `spec` splits the parameter over; `fn` itself where it names none, or where one
    comes before a manual axis in the mesh (XLA nests manual regions in mesh order only: an
    MoE under hsdp, fsdp between data and expert), whose leaves XLA gathers to encode whole."""
    entries = [tuple(a for a in axes_of(e) if a not in replica_axes) for e in (spec or ())]
    model = tuple(a for e in entries for a in e)
    order = list(mesh.axis_names)
    if not model or min(order.index(a) for a in model) < max(map(order.index, replica_axes)):
        return fn
    local = P(*(e or None for e in entries))
    out = local if n == 1 else (local,) * n
    return manual_region(fn, mesh=mesh, axes=model, in_specs=(local,) * n, out_specs=out)
