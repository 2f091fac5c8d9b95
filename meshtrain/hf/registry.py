"""The adapter registry: Hugging Face architecture name → `Adapter`, and the export choice.

The built-in architectures are registered in `meshtrain.hf` (one line each); code of your own
can `register` more. Registration order matters for export only: `adapter_for` picks the first
registered architecture that can hold a config, so a plain Llama config stays a Llama.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.hf.adapter import Adapter
from meshtrain.models.gpt import GPTConfig

ADAPTERS: dict[str, Adapter] = {}  # model_type → adapter, in registration order
ARCHITECTURES: dict[str, str] = {}  # class name (e.g. "LlamaForCausalLM") → model_type


def register(adapter: Adapter) -> Adapter:
    """Adds `adapter` to the registry under its ``model_type`` and class names; returns it."""
    taken = [a for a in adapter.architectures if a in ARCHITECTURES]
    if adapter.model_type in ADAPTERS or taken:
        raise ValueError(
            f"hf adapter {adapter.model_type!r}: model_type or architectures {taken} already "
            "registered; each name maps to one adapter"
        )
    ADAPTERS[adapter.model_type] = adapter
    ARCHITECTURES.update(dict.fromkeys(adapter.architectures, adapter.model_type))
    return adapter


def adapter_for_hf(hf: Mapping) -> Adapter:
    """The adapter of a parsed ``config.json``: by ``architectures``, else by ``model_type``.

    Raises:
        ValueError: the architecture is not registered (the message lists those that are).
    """
    archs = hf.get("architectures") or []
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if known:
        return ADAPTERS[known[0]]
    if not archs and hf.get("model_type") in ADAPTERS:
        return ADAPTERS[hf["model_type"]]
    got = archs or hf.get("model_type")
    raise ValueError(
        f"architecture {got!r} is not supported; meshtrain reads {', '.join(ARCHITECTURES)}. "
        "Convert the model to one of them, or load it with transformers instead"
    )


def adapter_for(cfg: GPTConfig, architecture: str | None = None) -> Adapter:
    """The architecture a config is exported as.

    Args:
        cfg: the model config.
        architecture: a class name (``"MistralForCausalLM"``) or ``model_type`` to insist on;
            None picks the first registered architecture that can hold `cfg`.

    Raises:
        ValueError: no registered architecture (or not the one asked for) can hold `cfg`; the
            message gives each candidate's reason.
    """
    if architecture is not None:
        adapter = ADAPTERS.get(ARCHITECTURES.get(architecture, architecture))
        if adapter is None:
            raise ValueError(
                f"architecture={architecture!r} is not registered; choose from "
                f"{', '.join(ARCHITECTURES)}"
            )
        candidates = [adapter]
    else:
        candidates = list(ADAPTERS.values())
    reasons = []
    for adapter in candidates:
        if adapter.layout.style != cfg.style:
            problems = [f"holds style={adapter.layout.style!r} models, not {cfg.style!r}"]
        else:
            problems = [str(p).removeprefix("gpt.") for p in adapter.export_problems(cfg)]
        if not problems:
            return adapter
        if architecture is not None or adapter.layout.style == cfg.style:
            reasons.append(f"{adapter.name}: {problems[0]}")
    raise ValueError(
        f"no Hugging Face architecture holds this {cfg.style} config: {'; '.join(reasons)}"
    )
