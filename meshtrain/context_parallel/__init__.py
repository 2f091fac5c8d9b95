"""Context parallelism: attention over a sequence split over the ``seq`` mesh axis.

- `blocks`: one block's attention at global positions, with its log-sum-exp, and the merge;
- `ring`: ring attention (``ppermute`` of keys/values) with a custom VJP;
- `gather`: all-gather of keys/values, and Ulysses (all-to-all to a head split);
- `zigzag`: head-tail load balancing of causal work;
- `attention`: `context_attention` on global arrays, and the active context of a step;
- `checks`: the run check's questions (sequence length, heads, pipelines).

Ring, all-gather and Ulysses are the *algorithms* (`ALGORITHMS`, chosen by
`Rules.context_parallel` or ``--context-parallel``); "strategy" names a sharding preset only.
"""

from meshtrain.context_parallel.attention import (
    ALGORITHMS,
    DEFAULT,
    Context,
    active_context,
    algorithm_problems,
    attend_active,
    balanced_order,
    context_attention,
    whole_model_in_region,
)
from meshtrain.context_parallel.checks import context_problems, heads_problems
from meshtrain.context_parallel.zigzag import causal_chunk_pairs, inverse, naive_counts, order

__all__ = [
    "ALGORITHMS",
    "DEFAULT",
    "Context",
    "active_context",
    "algorithm_problems",
    "attend_active",
    "balanced_order",
    "causal_chunk_pairs",
    "context_attention",
    "context_problems",
    "heads_problems",
    "inverse",
    "naive_counts",
    "order",
    "whole_model_in_region",
]
