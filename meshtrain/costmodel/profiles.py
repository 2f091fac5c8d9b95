"""Device and link profiles: the numbers the cost model runs on, each with its source.

Bandwidths are per device and per direction. Latencies (α) are not on any datasheet: they are
stated assumptions of the order NCCL's own tuning model uses, marked as such.

Sources:
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (2023): 989 TFLOP/s dense BF16 (1,979 with
  sparsity), 3.35 TB/s HBM3, 80 GB, NVLink 4 at 900 GB/s total (450 GB/s each way).
- H200 SXM: NVIDIA H200 datasheet (2024): the H100's compute (989 TFLOP/s dense BF16), 4.8 TB/s
  HBM3e, 141 GB, NVLink 4 at 900 GB/s.
- A100 SXM4 80 GB: NVIDIA A100 datasheet (2021): 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e,
  NVLink 3 at 600 GB/s total (300 GB/s each way).
- Across nodes: DGX H100 / H200 user guide: eight ConnectX-7 InfiniBand NDR ports of 400 Gb/s,
  one per GPU (50 GB/s each way); DGX A100: eight HDR ports of 200 Gb/s (25 GB/s).
- GH200: NVIDIA GH200 Grace Hopper Superchip datasheet (2023): the H100's compute, 96 GB HBM3
  at 4 TB/s, NVLink-C2C to the Grace CPU at 900 GB/s total (450 GB/s each way), 480 GB LPDDR5X.
  Nodes of four superchips (as in CSCS Alps' quad-GH200 nodes, one 200 Gb/s Slingshot port per
  superchip, 25 GB/s each way); within the node each GPU pair has 6 NVLink 4 links (150 GB/s
  each way, assumed to be what one collective gets).
- TPU v5e: Google Cloud TPU v5e documentation: 197 TFLOP/s BF16, 819 GB/s HBM, 16 GB, ICI.
- Host links (what offload moves data over), per device and direction: PCIe 5.0 x16 for the
  H100 and H200 (their datasheets: 128 GB/s, 64 GB/s each way), PCIe 4.0 x16 for the A100
  (64 GB/s, 32 each way), NVLink-C2C for the GH200. Host memory per device: DGX H100 / H200
  2 TB for 8 GPUs, DGX A100 1 TB for 8, the GH200's own 480 GB. Where GPUs share a PCIe switch
  and all offload at once they share its uplink; that is not modelled, so offload times are
  lower bounds like the rest. The TPU v5e profile has no host-link figure: offload is not
  planned on it.
- cpu-sim: the simulated CPU devices of the tests. Nominal figures, not measured: simulated
  devices share one host's cores and memory, so no speed can be read off them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: latency α (seconds) and bandwidth per device per direction (bytes/s)."""

    alpha: float
    bandwidth: float

    @property
    def beta(self) -> float:
        """Seconds per byte, 1 / bandwidth."""
        return 1.0 / self.bandwidth


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """An accelerator and its links.

    Attributes:
        name: the profile's name.
        peak_flops: dense bf16 FLOP/s.
        hbm_bandwidth: device memory bandwidth, bytes/s.
        memory: device memory, bytes.
        devices_per_node: devices joined by the fast link.
        intra: the link within a node.
        inter: the link between nodes.
        source: where the numbers come from.
        platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``: what runs there (the MoE dispatch
            exchanges exactly the routed rows on GPUs and a padded buffer elsewhere).
        host: the link between the device and its host's memory (None: no figure, so offload
            is not planned).
        host_memory: host memory per device, bytes (what offload can fill).
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory: float
    devices_per_node: int
    intra: Link
    inter: Link
    source: str
    platform: str = "gpu"
    host: Link | None = None
    host_memory: float = 0.0

    @property
    def is_gpu(self) -> bool:
        """Whether the profile is a GPU's."""
        return self.platform == "gpu"


_NVLINK_ALPHA = 3e-6  # assumed: a few µs per NCCL step within a node
_IB_ALPHA = 8e-6  # assumed: a few more µs per step across nodes
_HOST_ALPHA = 10e-6  # assumed: a copy engine's start and the host's page-locked buffer

_H100 = DeviceProfile(
    "h100",
    989e12,
    3.35e12,
    80e9,
    8,
    Link(_NVLINK_ALPHA, 450e9),
    Link(_IB_ALPHA, 50e9),
    "NVIDIA H100 SXM5 datasheet; DGX H100 (8 × ConnectX-7 NDR 400 Gb/s)",
    host=Link(_HOST_ALPHA, 64e9),
    host_memory=2e12 / 8,
)

PROFILES: dict[str, DeviceProfile] = {
    "h100": _H100,
    # The H100's compute, links and host in a DGX H200; only the memory differs.
    "h200": dataclasses.replace(
        _H100,
        name="h200",
        hbm_bandwidth=4.8e12,
        memory=141e9,
        source="NVIDIA H200 SXM datasheet; DGX H200 (8 × ConnectX-7 NDR 400 Gb/s)",
    ),
    "gh200": DeviceProfile(
        "gh200",
        989e12,
        4.0e12,
        96e9,
        4,
        Link(_NVLINK_ALPHA, 150e9),
        Link(_IB_ALPHA, 25e9),
        "NVIDIA GH200 Grace Hopper Superchip datasheet; quad-GH200 nodes (CSCS Alps)",
        host=Link(_HOST_ALPHA, 450e9),
        host_memory=480e9,
    ),
    "a100": DeviceProfile(
        "a100",
        312e12,
        2.039e12,
        80e9,
        8,
        Link(_NVLINK_ALPHA, 300e9),
        Link(_IB_ALPHA, 25e9),
        "NVIDIA A100 SXM4 80GB datasheet; DGX A100 (8 × HDR 200 Gb/s)",
        host=Link(_HOST_ALPHA, 32e9),
        host_memory=1e12 / 8,
    ),
    "tpu-v5e": DeviceProfile(
        "tpu-v5e",
        197e12,
        819e9,
        16e9,
        256,
        Link(2e-6, 100e9),  # ICI: 1,600 Gb/s per chip over 4 links; 100 GB/s each way assumed
        Link(10e-6, 25e9),  # across slices (data-centre network): assumed
        "Google Cloud TPU v5e documentation (ICI per-link split assumed)",
        platform="tpu",
    ),
    "cpu-sim": DeviceProfile(
        "cpu-sim",
        1e11,
        1e10,
        8e9,
        8,
        Link(1e-5, 5e9),
        Link(1e-5, 5e9),
        "nominal: simulated CPU devices share one host; not measured",
        platform="cpu",
        host=Link(1e-5, 5e9),
        host_memory=16e9,
    ),
}


def profile(name: str) -> DeviceProfile:
    """The profile called `name`; a ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(
            f"device={name!r}: unknown device profile; choose from {', '.join(PROFILES)}"
        ) from None
