"""The refusal rows' examples: each ``() → (with_pair, without_pair)``, two dicts of run
attributes, the first refused for the row's pair and the second the same run with one of the
two features removed. A small GPT on byte windows unless a builder says otherwise; configs
are built when the example runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from meshtrain.layout import rules_for
from meshtrain.mesh import AXES
from meshtrain.models.base import DataSpec
from meshtrain.models.gpt_config import GPTConfig
from meshtrain.models.moe_config import MoEConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.precision import Precision
from meshtrain.replicas import SyncConfig

Example = Callable[[], tuple[dict, dict]]

LM = DataSpec("lm", 16, 32, 256)  # the examples' data: 16 windows of 32 bytes


def run(mesh: Mapping[str, int], **kw) -> dict:
    """Run attributes: a small GPT on byte windows, over `mesh`, unless `kw` says otherwise."""
    full = {**dict.fromkeys(AXES, 1), **mesh}
    return {"model": GPTConfig(n_layers=4), "data": LM, "mesh": full, **kw} | {
        "rules": kw.get("rules") or rules_for("dp", full)
    }


def pair(with_mesh: Mapping[str, int], without_mesh: Mapping[str, int], **kw) -> Example:
    """The same settings on a mesh that has the pair and one that has not."""
    return lambda: (run(with_mesh, **_build(kw)), run(without_mesh, **_build(kw)))


def _build(kw: dict) -> dict:
    """Calls the zero-argument builders among `kw`'s values (configs are built late)."""
    return {k: v() if callable(v) else v for k, v in kw.items()}


def sync(refused: dict, accepted: dict, mesh=None, rules=None, model=None, data=None) -> Example:
    """A sync pair: `refused` (SyncConfig fields) against `accepted`, on `mesh` (data=8),
    under `rules` and with `model` and `data` (built late) when given."""

    def build():
        base = mesh or {"data": 8}
        made = {"rules": rules_for(rules, run(base)["mesh"])} if rules else {}
        if model is not None:
            made["model"] = model()
        if data is not None:
            made["data"] = data()
        return (
            run(base, sync=SyncConfig(**refused), **made),
            run(base, sync=SyncConfig(**accepted), **made),
        )

    return build


def fp16(settings: dict) -> Example:
    """A loss-scaling pair: the sync `settings` under fp16, then under bf16."""

    def build():
        config = SyncConfig(**settings)
        return (
            run({"data": 8}, sync=config, precision=Precision(policy="fp16")),
            run({"data": 8}, sync=config, precision=Precision(policy="bf16")),
        )

    return build


def circular_sync(settings: dict) -> Example:
    """The sync `settings` on pipe=2 under the circular schedule, then the same without them."""
    return lambda: (
        run({"pipe": 2, "data": 4}, sync=SyncConfig(**settings), pipeline=circular()),
        run({"pipe": 2, "data": 4}, pipeline=circular()),
    )


def gpt(**kw) -> Callable[[], GPTConfig]:
    """A builder of a `GPTConfig` with `kw` (built when the example runs)."""
    return lambda: GPTConfig(**kw)


def lm(**kw) -> Callable[[], DataSpec]:
    """A builder of the examples' data with `kw` changed."""
    return lambda: LM._replace(**kw)


def biased_moe() -> MoEConfig:
    """A small MoE with DeepSeek-V3's router and auxiliary-loss-free balancing."""
    return MoEConfig(n_layers=4, router_scores="sigmoid", bias_update_rate=1e-3)


def images() -> DataSpec:
    """Image classification data: no sequence to split."""
    return DataSpec("image", 16, None, 10, image_shape=(8, 8, 1))


def no_context_model() -> GPTConfig:
    """A GPT config that declares it cannot split sequences (``context_parallel = False``)."""
    return type("NoContextGPT", (GPTConfig,), {"context_parallel": False})()


def circular() -> PipelineConfig:
    """The circular schedule with two chunks of layers per stage."""
    return PipelineConfig(schedule="circular", repeats=2)
