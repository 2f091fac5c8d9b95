"""A backward pass split in two: the input gradient now, the weight gradient later.

Zero-bubble schedules run a stage's backward as two passes: B, the gradient with respect to
the stage's input (the next stage back waits for it), and W, the gradient with respect to its
weights (which nothing waits for, so it fills a bubble). `split_backward` cuts the backward's
jaxpr along that line without computing anything twice: B evaluates every equation the input
gradient needs and hands over the values the weight gradient still needs (the cotangents of
the matmuls' outputs, mostly), and W evaluates the rest from those and the forward's
residuals. Nested calls (jitted functions, remat, custom derivatives, scans of length one) are
inlined first, so the cut runs between primitive operations; an equation that cannot be
inlined (a loop, a kernel) goes whole to B when B needs it, else to W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
from jax import lax
from jax.extend import core as jex

from meshtrain._compat import varying_axes

# Primitives whose equations carry a sub-jaxpr that runs once, inlined before cutting.
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def _open(jaxpr) -> tuple[jex.Jaxpr, Sequence]:
    """A sub-jaxpr and its constants (a `ClosedJaxpr` or a bare `Jaxpr`)."""
    if hasattr(jaxpr, "consts"):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def _inline(jaxpr: jex.Jaxpr, consts: Sequence, args: Sequence) -> list:
    """Evaluates `jaxpr`, binding each primitive, with every nested call and length-one scan
    evaluated in place; run under `jax.make_jaxpr` it gives a flat jaxpr."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS and _CALLS[name] in eqn.params:
            sub, sub_consts = _open(eqn.params[_CALLS[name]])
            outs = _inline(sub, sub_consts, ins)
        elif name == "scan" and eqn.params["length"] == 1:
            outs = _scan_once(eqn, ins)
        else:
            outs = _bind(eqn, ins)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _scan_once(eqn, ins: list) -> list:
    """A scan of length one, evaluated in place: its body once on the sliced inputs."""
    body, body_consts = _open(eqn.params["jaxpr"])
    # Operands are consts, carry and xs; results carry and ys. Only xs and ys have a leading
    # dimension (of length one) their counterparts in the body lack.
    stacked = lambda outer, inner: len(outer.aval.shape) == len(inner.aval.shape) + 1  # noqa: E731
    n_xs = sum(map(stacked, eqn.invars, body.invars))
    n_ys = sum(map(stacked, eqn.outvars, body.outvars))
    n_carry = len(eqn.outvars) - n_ys
    n_fixed = len(eqn.invars) - n_xs  # consts and carry, as the body takes them
    outs = _inline(body, body_consts, [*ins[:n_fixed], *(x[0] for x in ins[n_fixed:])])
    return outs[:n_carry] + [y[None] for y in outs[n_carry:]]


class SplitBackward(NamedTuple):
    """A backward cut in two (see `split_backward`).

    Attributes:
        input_pass: ``(*args) -> (input_grads, handover)``: the first outputs and the values
            the weight pass needs.
        weight_pass: ``(kept_args, handover) -> weight_grads``: the other outputs.
        handover: shapes of the handed-over values (what lives from B until W).
    """

    input_pass: Callable
    weight_pass: Callable
    handover: list[jax.ShapeDtypeStruct]


def split_backward(
    fn: Callable, args: Sequence, n_input_outputs: int, n_kept: int
) -> SplitBackward:
    """Cuts `fn(*args)` (a backward: flat outputs, the first `n_input_outputs` of them the
    input gradients, the rest the weight gradients) into an input pass and a weight pass.

    Args:
        fn: the backward, taking and returning flat lists of arrays.
        args: example arguments (arrays or tracers: the cut is traced on their types).
        n_input_outputs: how many of `fn`'s leading outputs the input pass computes.
        n_kept: how many of the leading `args` the weight pass is given again (the weights and
            the forward's residuals); any later argument it needs (the cotangent) is handed
            over.

    Returns:
        A `SplitBackward`: the two passes compute exactly `fn`'s outputs between them, each
        equation once.
    """
    closed = jax.make_jaxpr(lambda *a: _inline(*_traced(fn, a), a))(*args)
    jaxpr, consts = closed.jaxpr, closed.consts
    outs = jaxpr.outvars
    b_ids = _needed(jaxpr.eqns, outs[:n_input_outputs])
    w_ids = _needed(jaxpr.eqns, outs[n_input_outputs:]) - b_ids
    # Values made from constants alone (masks, iotas) are remade in W rather than handed over:
    # they are the same on every stage, and what a ring buffer carries varies over pipe.
    const = set(jaxpr.constvars)
    for e in jaxpr.eqns:
        if not e.effects and all(v in const for v in e.invars if isinstance(v, jex.Var)):
            const.update(e.outvars)
    w_uses = [v for e in jaxpr.eqns if id(e) in w_ids for v in e.invars]
    w_uses += list(outs[n_input_outputs:])
    w_ids |= _needed(jaxpr.eqns, [v for v in w_uses if isinstance(v, jex.Var) and v in const])
    b_list = [e for e in jaxpr.eqns if id(e) in b_ids]
    w_list = [e for e in jaxpr.eqns if id(e) in w_ids]
    # What W needs that only B has: values B computes, and the arguments W is not given.
    made_by_b = {v for e in b_list for v in e.outvars} | set(jaxpr.invars[n_kept:])
    made_by_b -= const
    handover: list = []
    for v in [v for e in w_list for v in e.invars] + list(outs[n_input_outputs:]):
        if isinstance(v, jex.Var) and v in made_by_b and v not in handover:
            handover.append(v)

    def input_pass(*a):
        env = _run(b_list, jaxpr, consts, jaxpr.invars, a, {})
        return [_read(env, v) for v in outs[:n_input_outputs]], [env[v] for v in handover]

    def weight_pass(kept, values):
        env = dict(zip(handover, values, strict=True))
        env = _run(w_list, jaxpr, consts, jaxpr.invars[:n_kept], kept, env)
        return [_read(env, v) for v in outs[n_input_outputs:]]

    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in handover]
    return SplitBackward(input_pass, weight_pass, shapes)


def _traced(fn: Callable, args: Sequence) -> tuple[jex.Jaxpr, Sequence]:
    """`fn`'s jaxpr on `args`' types, and its constants."""
    closed = jax.make_jaxpr(fn)(*args)
    return closed.jaxpr, closed.consts


def _needed(eqns: list, targets: Sequence) -> set[int]:
    """The ids of the equations `targets` depend on."""
    want = {v for v in targets if isinstance(v, jex.Var)}
    needed: set[int] = set()
    for eqn in reversed(eqns):
        if any(v in want for v in eqn.outvars):
            needed.add(id(eqn))
            want.update(v for v in eqn.invars if isinstance(v, jex.Var))
    return needed


def _read(env: dict, v):
    """A variable's value, or a literal's."""
    return v.val if isinstance(v, jex.Literal) else env[v]


def _run(eqns: list, jaxpr: jex.Jaxpr, consts: Sequence, invars, args, env: dict) -> dict:
    """Evaluates `eqns` of `jaxpr` on its constants and `args` (the values of `invars`),
    starting from `env`."""
    env = dict(env)
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(invars, args, strict=True):
        env[v] = x
    for eqn in eqns:
        outs = _bind(eqn, [_read(env, v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return env


def _bind(eqn, ins: list) -> list:
    """Applies an equation's primitive to `ins`; its results as a list.

    A value handed over from B to W comes back varying over ``pipe`` (the ring buffer that
    carries it through the slots does), even where it was traced as the same on every stage
    (a nested region's output): marking it varying again (`pvary`) is then a no-op.
    """
    if eqn.primitive.name == "pvary":
        return [_vary(x, eqn.params["axes"]) for x in ins]
    if len(ins) > 1 and not _has_body(eqn):
        # The same for an operation whose operands must vary alike: an operand traced as the
        # same on every stage meets one that came back varying.
        union = tuple(sorted(frozenset().union(*(varying_axes(x) for x in ins))))
        ins = [_vary(x, union) for x in ins]
    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return outs if eqn.primitive.multiple_results else [outs]


def _has_body(eqn) -> bool:
    """Whether the equation carries a sub-jaxpr (a region, a loop), whose operands are typed
    by it."""
    return any(isinstance(p, (jex.ClosedJaxpr, jex.Jaxpr)) for p in eqn.params.values())


def _vary(x, axes: tuple[str, ...]):
    """`x` marked varying over those of `axes` it does not already vary over."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x
