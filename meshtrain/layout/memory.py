"""Memory kinds: the accelerator's own memory and host memory, as jax names them."""

ACCELERATOR = "device"  # jax's name for the accelerator's own memory
HOST = "pinned_host"  # page-locked host memory: transfers run at the link's rate
HOST_KINDS = (HOST, "unpinned_host")
