"""Models built on the library's layers: :class:`LongNetLM` (decoder-only LongNet) and
the position encodings of queries and keys (:class:`Rotary`, :class:`XPos`)."""

from jax_dilated.models.config import LongNetConfig
from jax_dilated.models.longnet import LongNetLM, cross_entropy
from jax_dilated.models.positions import Rotary, XPos, rotate

__all__ = ["LongNetConfig", "LongNetLM", "cross_entropy", "Rotary", "XPos", "rotate"]
