"""The refusal table as data: every pair of features that does not run together, one
`Refusal` row each, in the order the run check reports them. The rows point at named checks
(`meshtrain.composition.checks`) and examples (`meshtrain.composition.examples`); the rows
the replicas' ways of stepping on their own share are written once as `Pattern` rows for each
`Scheme` (`meshtrain.composition.patterns`)."""

from __future__ import annotations

from meshtrain.composition import checks as check
from meshtrain.composition import examples as example
from meshtrain.composition.checks import all_of, split
from meshtrain.composition.features import CONTEXT, LOCAL, PIPELINES
from meshtrain.composition.patterns import ForEach, Pattern, Scheme, cells, rows
from meshtrain.composition.refusal import Refusal
from meshtrain.loss import cross_entropy
from meshtrain.mesh import EXPERT, PIPE, SEQ, TENSOR
from meshtrain.models.gpt_config import GPTConfig
from meshtrain.models.moe_config import MoEConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.precision import Precision
from meshtrain.replicas import SyncConfig
from meshtrain.run import TrainConfig

__all__ = ["REFUSALS"]

_CUDNN = example.gpt(attention_impl="cudnn", d_model=256, dtype="bfloat16")
_CUDNN_WINDOW = example.gpt(attention_impl="cudnn", d_model=256, dtype="bfloat16", sliding_window=8)
_OWN_STEP = (
    "the replicas' own step (gradient compression, local SGD, DiLoCo, gossip, federated averaging)"
)

# What a step manual over the replicas cannot hold: context parallelism beside tensor
# parallelism, or on packed documents or experts with rows split over fsdp; several chunks of
# layers per stage; a strategy without replicas. Context parallelism itself runs inside that
# step (its attention's region nests there, differentiated per shard); where fsdp splits the
# rows there the tokens keep their plain order
# (`meshtrain.context_parallel.whole_model_in_region`). The first two rows refuse no cell of
# the matrix outright (each pair alone runs); they touch the scheme's cells with each algorithm.
REGION = (
    Pattern(
        "{name}",
        "context parallelism beside tensor parallelism",
        "{flag} runs the step in a region manual over the replicas, and XLA's SPMD partitioner "
        "aborts there on a gather split over seq and tensor at once (the embedding's lookup: "
        "a failed check in spmd_partitioner_util)",
        all_of(split(SEQ), split(TENSOR)),
        "set tensor=1 or seq=1 in --mesh, or drop {flag}",
        lambda s: example.sync(s, {}, mesh={"data": 2, "seq": 2, "tensor": 2}, rules="dp+tp"),
        field="mesh.seq",
        value=check.mesh_value(SEQ),
        touches=CONTEXT,
    ),
    Pattern(
        "{name}",
        "context parallelism on packed documents or experts, rows split over fsdp (hsdp)",
        "{flag} runs the step in a region manual over the replicas, and XLA's SPMD partitioner "
        "aborts there on a gather along seq (packed documents' ids, an MoE's dispatch) while "
        "fsdp splits the rows (a failed check in spmd_partitioner_util)",
        all_of(split(SEQ), check.gathers_tokens, check.batch_split_with_parameters),
        "use --strategy dp or zero1, set seq=1 in --mesh, or drop {flag} (or train a dense "
        "model on plain windows, --data.no-packing)",
        lambda s: example.sync(
            s, {}, mesh={"data": 2, "fsdp": 2, "seq": 2}, rules="hsdp", data=example.lm(packed=True)
        ),
        field="mesh.seq",
        value=check.mesh_value(SEQ),
        touches=CONTEXT,
    ),
    Pattern(
        "{name}",
        "several chunks per stage (circular, interleaved-1f1b)",
        "{flag} runs the pipeline's loop inside the replicas' region, which hands each stage "
        "only its contiguous slice of the stacked layers, and a schedule with several chunks "
        "per stage reorders the whole stack before its loop (stage s holds chunks s, s+p, ...: "
        "meshtrain.pipeline.layers.stage_order)",
        check.several_chunks,
        "use --schedule gpipe, 1f1b or zb-h1 (or --repeats 1), or drop {flag}",
        example.circular_sync,
        pairs_with=("circular", "interleaved-1f1b"),
    ),
    Pattern(
        "{name}",
        "a strategy without replicas",
        "{flag} works across replicas (batch axes of size > 1 no parameter is split "
        "over), and this layout has none",
        check.no_replicas,
        "use --strategy dp, zero1 or hsdp (hsdp: replicas over data) on a mesh with data ≥ 2",
        lambda s: example.sync(s, {}, mesh={"data": 8}, rules="fsdp"),
        pairs_with=("fsdp",),
    ),
)

# What the replicas' own step cannot run beside, scheme by scheme.
OWN_STEP = (
    Pattern(
        "{name}",
        "gradient compression",
        "{exchange}",
        check.compresses,
        "drop one of --grad-compression and {flag}",
        lambda s: example.sync({**s, "grad_compression": "int8"}, s),
        pairs_with=("compression",),
        field="grad_compression",
        value=check.setting("sync.grad_compression"),
    ),
    Pattern(
        "bounded staleness",
        "{name}",
        "staleness models a parameter server with synchronous replicas",
        check.stale,
        "drop one of --staleness and {flag}",
        lambda s: example.sync({**s, "staleness": 2}, {"staleness": 2}),
        pairs_with=("staleness",),
        ids_first=False,
        field="staleness",
        value=check.setting("sync.staleness"),
    ),
    Pattern(
        "fp16 loss scaling",
        "{name}",
        "the loss scale is one value for the run, and {name}'s replicas step apart, "
        "each with gradients that overflow on their own",
        check.loss_scaling,
        "use --precision bf16 (no loss scaling), or drop {flag}",
        example.fp16,
        pairs_with=("fp16",),
        field="precision",
        value=check.setting("precision.policy"),
    ),
    *REGION,
)

# The replicas stepping on their own, each way.
SCHEMES = (
    Scheme(
        name="local SGD",
        ids=("local-sgd", "diloco"),
        on=check.plain_local,
        field="sync_every",
        value=check.setting("sync.sync_every"),
        flag="--sync-every",
        settings={"sync_every": 4},
        exchange="local SGD exchanges parameters, not gradients",
    ),
    Scheme(
        name="gossip",
        ids=("gossip",),
        on=check.gossips,
        field="gossip",
        value=check.setting("sync.gossip"),
        flag="--gossip",
        settings={"gossip": "ring", "sync_every": 4},
        exchange="gossip mixes parameters, and compressing them needs CHOCO-SGD's correction "
        "(each replica's running estimate of its neighbours' values), which meshtrain does not "
        "build",
    ),
    Scheme(
        name="federated averaging",
        ids=("federated",),
        on=check.federates,
        field="client_fraction",
        value=check.setting("sync.client_fraction"),
        flag="--client-fraction",
        settings={"client_fraction": 0.5, "sync_every": 4},
        exchange="federated averaging exchanges each round's parameter change, not gradients",
    ),
)

COMPRESSION = Scheme(
    name="gradient compression",
    ids=("compression",),
    on=check.compresses,
    field="grad_compression",
    value=check.setting("sync.grad_compression"),
    flag="--grad-compression",
    settings={"grad_compression": "int8"},
)

TABLE = (
    Refusal(
        "expert parallelism",
        "a model without experts",
        "only a mixture-of-experts model has experts to split over expert > 1",
        all_of(split(EXPERT), check.no_experts),
        "mesh.expert",
        "set expert=1 in --mesh, or use --model moe",
        check.mesh_value(EXPERT),
        lambda: (
            example.run({"expert": 2, "data": 4}),
            example.run({"expert": 2, "data": 4}, model=MoEConfig()),
        ),
    ),
    Refusal(
        "context parallelism",
        "a model that cannot split its sequences",
        "the model declares context_parallel = False",
        all_of(split(SEQ), check.no_context),
        "mesh.seq",
        "set seq=1 in --mesh",
        check.mesh_value(SEQ),
        lambda: (
            example.run({"seq": 2, "data": 4}, model=example.no_context_model()),
            example.run({"data": 8}, model=example.no_context_model()),
        ),
    ),
    Refusal(
        "context parallelism",
        "a hand-scheduled schedule beside tensor or fsdp",
        "in a 1f1b, interleaved-1f1b or zb-h1 slot, a context-parallel stage with another axis "
        "left to the compiler (tensor, or fsdp without --gather-once) makes XLA's SPMD "
        "partitioner abort (a failed check in spmd_partitioner_util)",
        all_of(split(SEQ), check.hand_scheduled, check.compiler_axes_in_stage),
        "mesh.seq",
        "use --schedule gpipe or circular, --gather-once (fsdp), or set tensor=1 or seq=1",
        check.mesh_value(SEQ),
        example.pair(
            {"seq": 2, "pipe": 2, "tensor": 2},
            {"seq": 2, "pipe": 2, "data": 2},
            pipeline=PipelineConfig(schedule="1f1b"),
        ),
        touches=cells(CONTEXT, ("1f1b", "interleaved-1f1b", "zb-h1")),
    ),
    Refusal(
        "context parallelism",
        "data without sequences",
        "only token sequences (lm data) can be split over seq",
        all_of(split(SEQ), check.without_sequences),
        "mesh.seq",
        "set seq=1 in --mesh",
        check.mesh_value(SEQ),
        lambda: (
            example.run({"seq": 2, "data": 4}, model=None, data=example.images()),
            example.run({"data": 8}, model=None, data=example.images()),
        ),
    ),
    Refusal(
        "cuDNN attention",
        "packed batches with a sliding window",
        "cuDNN's packed layout takes no sliding window",
        all_of(check.packed, check.cudnn, check.sliding_window),
        "{model}.attention_impl",
        "use pallas, auto or xla, or train on plain windows (--data.no-packing)",
        check.cudnn_name,
        lambda: (
            example.run({"data": 8}, model=_CUDNN_WINDOW(), data=example.lm(packed=True)()),
            example.run({"data": 8}, model=_CUDNN_WINDOW()),
        ),
        touches=(("packed", "cudnn"),),
    ),
    Refusal(
        "cuDNN attention",
        "float32 compute",
        "cuDNN's fused attention has kernels for bfloat16 and float16 inputs only",
        all_of(check.cudnn, check.float32_compute),
        "{model}.attention_impl",
        "use --precision bf16 (or fp8), or --{model}.attention-impl pallas, auto or xla",
        check.cudnn_name,
        lambda: (
            example.run({"data": 8}, model=_CUDNN(), precision=Precision(policy="fp32")),
            example.run({"data": 8}, model=_CUDNN(), precision=Precision(policy="bf16")),
        ),
    ),
    Refusal(
        "cuDNN attention",
        "ring or all-gather context parallelism",
        "a context-parallel block is masked by global positions, which cuDNN's attention takes "
        "no mask for, and merging blocks differentiates their log-sum-exp, whose gradient "
        "jax's cuDNN backward drops (return_residual)",
        all_of(split(SEQ), check.cudnn, check.context_algorithm("ring", "allgather")),
        "{model}.attention_impl",
        "use --{model}.attention-impl pallas, auto or xla, --context-parallel ulysses, or set "
        "seq=1",
        check.cudnn_name,
        example.pair({"seq": 2, "data": 4}, {"data": 8}, model=_CUDNN),
        cells=cells(("cudnn",), ("ring", "allgather")),
    ),
    Refusal(
        _OWN_STEP,
        "hsdp with tensor parallelism",
        "XLA's SPMD partitioner aborts compiling that step when fsdp and tensor both split the "
        "parameters inside it (a failed check in spmd_partitioner_util)",
        all_of(check.own_step, check.fsdp_and_tensor),
        "strategy",
        "use dp+tp or zero1+tp (or hsdp without tensor) with --grad-compression or --sync-every",
        check.strategy,
        example.sync(
            {"grad_compression": "int8"},
            {},
            mesh={"data": 2, "fsdp": 2, "tensor": 2},
            rules="hsdp+tp",
        ),
        touches=cells(("compression", *LOCAL), ("hsdp", "tp")),
    ),
    Refusal(
        "local SGD (and DiLoCo, gossip, federated averaging)",
        "pipelines with global-norm clipping",
        "the replicas' own optimizer runs inside the replicas' region, where each stage holds "
        "only its own layers, so the gradient's global norm would be one stage's",
        all_of(check.local, split(PIPE), check.clips),
        "optim.clip_norm",
        "set --clip-norm 0 beside --sync-every on pipe > 1, or set pipe=1",
        check.setting("optim.clip_norm"),
        example.sync({"sync_every": 4}, {}, mesh={"pipe": 2, "data": 4}),
        touches=cells(PIPELINES, LOCAL),
        by_default=True,  # --clip-norm 1.0
    ),
    ForEach(OWN_STEP, SCHEMES),
    Refusal(
        "fp16",
        "the Pallas or cuDNN kernels",
        "meshtrain's attention and norm kernels take float32 and bfloat16 only",
        check.fp16_kernels,
        "precision",
        "use --precision bf16, or --{model}.attention-impl xla and --{model}.norm-impl xla",
        check.setting("precision.policy"),
        lambda: (
            example.run(
                {"data": 8}, model=GPTConfig(norm_impl="pallas"), precision=Precision(policy="fp16")
            ),
            example.run(
                {"data": 8}, model=GPTConfig(norm_impl="pallas"), precision=Precision(policy="bf16")
            ),
        ),
        cells=(("pallas", "fp16"), ("cudnn", "fp16")),
    ),
    Refusal(
        "fp16 loss scaling",
        "bounded staleness",
        "a gradient applied s steps later was scaled by the scale of its own step, which may "
        "have changed since",
        all_of(check.loss_scaling, check.stale),
        "precision",
        "use --precision bf16 (no loss scaling), or drop --staleness",
        check.setting("precision.policy"),
        lambda: (
            example.run(
                {"data": 8}, sync=SyncConfig(staleness=1), precision=Precision(policy="fp16")
            ),
            example.run({"data": 8}, sync=SyncConfig(staleness=1)),
        ),
        cells=(("staleness", "fp16"),),
    ),
    Refusal(
        "an outer optimizer",
        "synchronous training",
        "the outer optimizer runs at local SGD's synchronisations",
        all_of(check.synchronous, check.outer_optimizer),
        "outer_optimizer",
        "add --sync-every H, or drop --outer-optimizer",
        check.setting("sync.outer_optimizer"),
        example.sync(
            {"outer_optimizer": "nesterov"}, {"outer_optimizer": "nesterov", "sync_every": 4}
        ),
    ),
    Refusal(
        "gossip",
        "federated averaging",
        "they are two ways for the same replicas to synchronise",
        all_of(check.gossips, check.federates),
        "gossip",
        "drop one of --gossip and --client-fraction",
        check.setting("sync.gossip"),
        example.sync(
            {"gossip": "ring", "client_fraction": 0.5, "sync_every": 4},
            {"gossip": "ring", "sync_every": 4},
        ),
    ),
    Refusal(
        "gossip",
        "no --sync-every",
        "gossip forms the model you evaluate and save, the replicas' mean, every H steps",
        all_of(check.gossips, check.no_sync_every),
        "sync_every",
        "add --sync-every H (e.g. 50)",
        check.setting("sync.sync_every"),
        example.sync({"gossip": "ring"}, {"gossip": "ring", "sync_every": 50}),
    ),
    Refusal(
        "federated averaging",
        "no --sync-every",
        "a federated round is H local steps",
        all_of(check.federates, check.no_sync_every),
        "sync_every",
        "add --sync-every H (e.g. 8)",
        check.setting("sync.sync_every"),
        example.sync({"client_fraction": 0.5}, {"client_fraction": 0.5, "sync_every": 8}),
    ),
    Refusal(
        "an outer optimizer",
        "gossip",
        "gossip's model is the replicas' mean, with no outer step to apply it through",
        all_of(check.gossips, check.outer_optimizer),
        "outer_optimizer",
        "use --outer-optimizer average (the default), or drop --gossip",
        check.setting("sync.outer_optimizer"),
        example.sync(
            {"gossip": "ring", "sync_every": 4, "outer_optimizer": "nesterov"},
            {"gossip": "ring", "sync_every": 4},
        ),
    ),
    ForEach(REGION, (COMPRESSION,)),
    Refusal(
        "auxiliary-loss-free balancing",
        "pipelines",
        "a pipeline carries only parameters through its stages, and the routers' bias and "
        "load count are model state that every forward adds to and the step updates",
        all_of(check.router_bias, split(PIPE)),
        "moe.bias_update_rate",
        "set --moe.bias-update-rate 0 (balance with --moe.aux-loss-coef instead), or set "
        "pipe=1 in --mesh",
        check.model_value("bias_update_rate"),
        example.pair({"pipe": 2, "data": 4}, {"data": 8}, model=example.biased_moe),
    ),
    Refusal(
        "auxiliary-loss-free balancing",
        _OWN_STEP,
        "the bias moves by the expert load of the whole global batch, and the replicas' own "
        "step keeps each replica's model state, and so its load count, apart",
        all_of(check.router_bias, check.own_step),
        "moe.bias_update_rate",
        "set --moe.bias-update-rate 0 (balance with --moe.aux-loss-coef instead), or train "
        "synchronously without gradient compression",
        check.model_value("bias_update_rate"),
        example.sync({"grad_compression": "int8"}, {}, model=example.biased_moe),
    ),
    Refusal(
        "a custom loss_fn",
        "a loss kernel",
        "the kernel applies only to the built-in losses",
        all_of(check.custom_loss, check.loss_kernel),
        "train.loss_impl",
        "set --loss-impl xla, or drop loss_fn",
        check.setting("train.loss_impl"),
        lambda: (
            example.run({"data": 8}, loss_fn=cross_entropy, train=TrainConfig(loss_impl="pallas")),
            example.run({"data": 8}, train=TrainConfig(loss_impl="pallas")),
        ),
    ),
    Refusal(
        "a custom loss_fn",
        "a built-in loss",
        "train.loss picks a built-in loss, loss_fn replaces it",
        all_of(check.custom_loss, check.builtin_loss),
        "train.loss",
        "drop --loss, or drop loss_fn",
        check.setting("train.loss"),
        lambda: (
            example.run({"data": 8}, loss_fn=cross_entropy, train=TrainConfig(loss="mse")),
            example.run({"data": 8}, loss_fn=cross_entropy),
        ),
    ),
)

REFUSALS: tuple[Refusal, ...] = rows(TABLE)
