"""The data-parallel replicas and how they synchronise: gradient compression with error
feedback (`codecs`, `manual`)."""

from meshtrain.replicas.codecs import Codec, parse_compression
from meshtrain.replicas.manual import reduced_grads, residual_init

__all__ = ["Codec", "parse_compression", "reduced_grads", "residual_init"]
