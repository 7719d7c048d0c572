"""Models built on the library's layers: :class:`LongNetLM` (decoder-only LongNet),
torchscale's LongNet encoder (:class:`LongNetEncoder`) and Prov-GigaPath's slide
encoder (:class:`SlideEncoder`), loadable from their PyTorch weights, and the position
encodings of queries and keys (:class:`Rotary`, :class:`XPos`)."""

from jax_dilated.models.config import LongNetConfig
from jax_dilated.models.encoder import LongNetEncoder, LongNetEncoderConfig
from jax_dilated.models.longnet import LongNetLM, cross_entropy
from jax_dilated.models.positions import Rotary, XPos, rotate
from jax_dilated.models.slide import SlideEncoder, SlideEncoderConfig, convert_checkpoint

__all__ = ["LongNetConfig", "LongNetLM", "cross_entropy", "Rotary", "XPos", "rotate",
           "LongNetEncoderConfig", "LongNetEncoder", "SlideEncoderConfig", "SlideEncoder",
           "convert_checkpoint"]
