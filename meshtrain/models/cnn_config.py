"""The CNN family's config (`CNNConfig`): presets, the shape walk, FLOPs and the checks."""

from __future__ import annotations

import dataclasses

from meshtrain import validate
from meshtrain.layout import TENSOR
from meshtrain.models.base import DTYPES, DataSpec
from meshtrain.problem import Problem

# name -> (architecture, stage widths, convolutions or residual blocks per stage)
PRESETS: dict[str, tuple[str, tuple[int, ...], int]] = {
    "lenet": ("vgg", (16, 32), 1),  # LeNet/VGG-style: conv, ReLU, 2×2 max-pool per stage
    "vgg": ("vgg", (32, 64, 128), 2),
    "resnet18": ("resnet", (64, 128, 256, 512), 2),  # CIFAR-style ResNet-18 (3×3 stem)
}
NORMS = ("batch", "group", "none")
ACT_IMPLS = ("xla", "pallas", "auto")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CNNConfig(validate.Checked):
    """Shape of a convolutional classifier on images [B, H, W, C] (fed as flattened rows).

    ``vgg`` stages are ``depth`` 3×3 convolutions then a 2×2 max-pool, followed by a hidden
    dense layer and the class layer; ``resnet`` stages are ``depth`` basic residual blocks
    (two 3×3 convolutions), every stage after the first halving the image with stride 2,
    followed by global average pooling and the class layer.

    Logical names: convolution kernels are [kh, kw, in, out]; a conv whose output feeds a
    channel-split activation names its output channels ``mlp`` (split over ``tensor``) and the
    next conv names them as its input channels, so pairs of convolutions are channel-parallel
    the Megatron way; the other channel dimensions are ``embed`` (split by fsdp). The image's
    own channels are ``features`` (never split).

    Args:
        preset: ``lenet``, ``vgg`` or ``resnet18``: the architecture, and the widths and depth
            unless given.
        widths: output channels of each stage; empty means the preset's.
        depth: convolutions (vgg) or residual blocks (resnet) per stage; 0 means the preset's.
        image_size: H = W of the input images.
        in_channels: C of the input images.
        num_classes: output classes.
        hidden: width of the vgg head's hidden dense layer.
        norm: ``batch`` (statistics over the whole global batch: XLA all-reduces them across
            the batch axes), ``group`` or ``none``.
        groups: groups of the group norm (must divide every width).
        act_impl: the ReLU: ``xla`` (`jax.nn.relu`), ``pallas`` (the hand-written kernels
            `meshtrain.kernels.relu`) or ``auto`` (XLA's until a GPU measures the kernels).
        dtype: compute dtype, ``float32``, ``bfloat16`` or ``float16``; parameters stay
            float32 (the CNN has no fp8 layers).
    """

    preset: str = "lenet"
    widths: tuple[int, ...] = ()
    depth: int = 0
    image_size: int = 8
    in_channels: int = 1
    num_classes: int = 10
    hidden: int = 64
    norm: str = "batch"
    groups: int = 4
    act_impl: str = "xla"
    dtype: str = "float32"

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.one_of("cnn.preset", self.preset, PRESETS, example="resnet18")
        for name in ("image_size", "in_channels", "num_classes", "hidden", "groups"):
            problems += v.positive(
                f"cnn.{name}", getattr(self, name), example=getattr(type(self), name)
            )
        problems += v.non_negative("cnn.depth", self.depth, note="0: the preset's")
        problems += v.require(
            all(v.is_int(w) and w >= 1 for w in self.widths),
            "cnn.widths",
            self.widths,
            "must be positive integers; e.g. --cnn.widths 16 32",
        )
        for name, value, allowed in (
            ("norm", self.norm, NORMS),
            ("act_impl", self.act_impl, ACT_IMPLS),
            ("dtype", self.dtype, tuple(DTYPES)),
        ):
            problems += v.one_of(f"cnn.{name}", value, allowed)
        if problems:  # the shape walk below needs a known preset and whole sizes
            return problems
        if self.norm == "group" and any(w % self.groups for w in self.stage_widths):
            problems.append(
                Problem(
                    "cnn.groups",
                    self.groups,
                    f"must divide every width {self.stage_widths} for norm='group'; pick a "
                    "divisor, or --cnn.norm batch",
                )
            )
        if self.final_size < 1:
            halvings = self.halvings
            problems.append(
                Problem(
                    "cnn.image_size",
                    self.image_size,
                    f"the {self.preset} network halves the image {halvings} times and needs at "
                    f"least {2**halvings}×{2**halvings} pixels; give larger images, or fewer "
                    "widths (--cnn.widths)",
                )
            )
        return problems

    # --- the shape walk --------------------------------------------------------------------

    @property
    def arch(self) -> str:
        """``vgg`` or ``resnet``."""
        return PRESETS[self.preset][0]

    @property
    def stage_widths(self) -> tuple[int, ...]:
        """The widths in use (the preset's unless given)."""
        return tuple(self.widths) or PRESETS[self.preset][1]

    @property
    def stage_depth(self) -> int:
        """The depth in use (the preset's unless given)."""
        return self.depth or PRESETS[self.preset][2]

    @property
    def halvings(self) -> int:
        """How many times the network halves the image."""
        n = len(self.stage_widths)
        return n if self.arch == "vgg" else n - 1

    @property
    def final_size(self) -> int:
        """H = W after the last stage (0 when a vgg network pools the image away)."""
        size = self.image_size
        for _ in range(self.halvings):
            size = size // 2 if self.arch == "vgg" else -(-size // 2)
        return size

    def convs(self) -> list[tuple[int, int, int, int]]:
        """Every convolution as (kernel size, in, out, output H = W), in the module's order."""
        size, c_in, out = self.image_size, self.in_channels, []
        if self.arch == "resnet":
            out.append((3, c_in, self.stage_widths[0], size))  # the stem
            c_in = self.stage_widths[0]
        for s, width in enumerate(self.stage_widths):
            for d in range(self.stage_depth):
                if self.arch == "vgg":
                    out.append((3, c_in, width, size))
                else:
                    strided = d == 0 and s > 0
                    size = -(-size // 2) if strided else size
                    out += [(3, c_in, width, size), (3, width, width, size)]
                    if strided or c_in != width:
                        out.append((1, c_in, width, size))  # the projection shortcut
                c_in = width
            size = size // 2 if self.arch == "vgg" else size
        return out

    def dense(self) -> list[tuple[int, int]]:
        """The dense layers as (in, out)."""
        last = self.stage_widths[-1]
        if self.arch == "resnet":
            return [(last, self.num_classes)]
        flat = self.final_size**2 * last
        return [(flat, self.hidden), (self.hidden, self.num_classes)]

    def flops_per_token(self, seq_len: int = 1) -> float:
        """Training FLOPs per image: 3 × the forward's 2 FLOPs per multiply-add (convs and
        dense layers; norms, activations and pooling left out)."""
        macs = sum(k * k * ci * co * s * s for k, ci, co, s in self.convs())
        macs += sum(i * o for i, o in self.dense())
        return 6.0 * macs

    # --- the model interface (meshtrain.models.base.ModelConfig) ---------------------------

    def build(self, *, rngs):
        """The network, unsharded."""
        from meshtrain.models.cnn import CNN

        return CNN(self, rngs=rngs)

    def check(self, data: DataSpec) -> list[Problem]:
        """Image classification data whose images and classes fit this network."""
        want = (self.image_size, self.image_size, self.in_channels)
        if data.kind != "classify":
            return [
                Problem(
                    "model",
                    "cnn",
                    f"the CNN needs image classification data, but the data is {data.kind!r}; "
                    "use --data.source digits (embedded), images (an .npz) or fake_images",
                )
            ]
        problems = []
        shape = data.image_shape
        if shape is None and data.num_features != want[0] * want[1] * want[2]:
            problems.append(
                Problem(
                    "cnn.image_size",
                    self.image_size,
                    f"the data rows have {data.num_features} features, not {want[0]}×{want[1]}"
                    f"×{want[2]} = {want[0] * want[1] * want[2]} pixels; use an image source "
                    "(--data.source images) or set --cnn.image-size / --cnn.in-channels",
                )
            )
        elif shape is not None and tuple(shape) != want:
            h, w, c = shape
            fix = (
                f"set --cnn.image-size {h} --cnn.in-channels {c}"
                if h == w
                else "give square images (crop or pad them)"
            )
            problems.append(
                Problem(
                    "cnn.image_size",
                    self.image_size,
                    f"the images are {h}×{w}×{c} but the network takes {want[0]}×{want[1]}×"
                    f"{want[2]} (image_size × image_size × in_channels); {fix}",
                )
            )
        if data.vocab_size > self.num_classes:
            problems.append(
                Problem(
                    "cnn.num_classes",
                    self.num_classes,
                    f"the data has {data.vocab_size} classes; set --cnn.num-classes "
                    f"{data.vocab_size} or more",
                )
            )
        return problems

    def check_layout(self, sizes, rules) -> list[Problem]:
        """Channel-parallel convolutions need every width divisible by ``tensor``."""
        tensor = sizes.get(TENSOR, 1)
        bad = [w for w in (*self.stage_widths, self.hidden) if w % tensor]
        if tensor == 1 or not bad:
            return []
        return [
            Problem(
                "cnn.widths",
                self.stage_widths,
                f"tensor={tensor} splits the channels, but {bad} is not divisible by it (widths"
                f" and hidden={self.hidden}); use multiples of {tensor}, e.g. --cnn.widths "
                f"{' '.join(str(-(-w // tensor) * tensor) for w in self.stage_widths)}, "
                "or a smaller tensor axis",
            )
        ]

    def describe(self) -> str:
        """E.g. ``cnn lenet (vgg) · 8×8×1 → 10 classes · widths 16,32 × 1 · batch norm``."""
        widths = ",".join(map(str, self.stage_widths))
        size = f"{self.image_size}×{self.image_size}×{self.in_channels}"
        return (
            f"cnn {self.preset} ({self.arch}) · {size} → {self.num_classes} classes · widths "
            f"{widths} × {self.stage_depth} · {self.norm} norm"
        )
