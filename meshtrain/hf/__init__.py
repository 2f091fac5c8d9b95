"""Hugging Face interchange: ``config.json`` + ``model.safetensors`` ↔ meshtrain's GPT.

Reads and writes the layouts ``transformers`` saves, with the `safetensors` numpy API (no
torch). meshtrain keeps the blocks stacked along a leading ``layers`` dimension and splits
attention weights per head; the HF files keep one tensor per layer and flat head dimensions.

Modules, one idea each::

    adapter     the Adapter and Layout types one architecture implements
    registry    architecture name → Adapter; adapter_for(cfg) picks the export architecture
    config      config.json ↔ GPTConfig through the adapters; same_architecture
    convert     whole-model conversion: layers stacked, the untied lm_head
    files       safetensors reading (one file or a sharded index) and writing
    pretrained  load_pretrained, load_model, save_pretrained
    tokenizer   the tokenizer.json kept beside a checkpoint: read on import, written on export
    finetune    the fine-tune workflow's ends: a run's model and weights from a checkpoint
                (``meshtrain train --init-from hf:PATH``), the export (``--export-hf DIR``)
    gpt2, llama, ...  one file per architecture (see the register lines below); deepseek_v3
                reads the dense DeepSeek-V3 (latent attention, no experts)
    mixtral     MixtralForCausalLM ↔ meshtrain's MoE (load_mixtral, save_mixtral), beside
                the registry, whose adapters hold GPTConfig architectures
    qwen3_moe   Qwen3MoeForCausalLM ↔ meshtrain's MoE (load_qwen3_moe, save_qwen3_moe), as
                mixtral

Adding an architecture is one file that builds an `Adapter` (reusing a `Layout` when the
weights are stored like an existing one) and one `register` line below.
"""

from meshtrain.hf import deepseek_v3, gpt2, llama, mistral, qwen2, qwen3
from meshtrain.hf.adapter import Adapter, Layout
from meshtrain.hf.config import config_from_hf, config_to_hf, same_architecture
from meshtrain.hf.convert import hf_shapes
from meshtrain.hf.pretrained import SAVE_DTYPES, load_model, load_pretrained, save_pretrained
from meshtrain.hf.registry import (
    ADAPTERS,
    ARCHITECTURES,
    adapter_for,
    adapter_for_hf,
    register,
)
from meshtrain.hf.tokenizer import (
    TOKENIZER_FILE,
    load_checkpoint_tokenizer,
    save_checkpoint_tokenizer,
)

# The built-in architectures, one line each. Order matters on export only: a config is written
# as the first of these that can hold it.
register(gpt2.ADAPTER)
register(llama.ADAPTER)
register(mistral.ADAPTER)
register(qwen2.ADAPTER)
register(qwen3.ADAPTER)  # query/key norms make a config Qwen3
register(deepseek_v3.ADAPTER)

__all__ = [
    "ADAPTERS",
    "ARCHITECTURES",
    "SAVE_DTYPES",
    "TOKENIZER_FILE",
    "Adapter",
    "Layout",
    "adapter_for",
    "adapter_for_hf",
    "config_from_hf",
    "config_to_hf",
    "hf_shapes",
    "load_checkpoint_tokenizer",
    "load_model",
    "load_pretrained",
    "register",
    "same_architecture",
    "save_checkpoint_tokenizer",
    "save_pretrained",
]
