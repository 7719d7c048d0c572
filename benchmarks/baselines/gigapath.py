"""Prov-GigaPath's own PyTorch slide encoder on CPU, imported from a checkout given at run time.

Prov-GigaPath (github.com/prov-gigapath/prov-gigapath) is not on PyPI and is not a
dependency of this project: ``python -m benchmarks slide --gigapath-src DIR`` imports
``gigapath.slide_encoder`` from ``DIR`` (a checkout of that repository; nothing of it is
copied here) and builds its ``LongNetViT`` (``gigapath_slide_enc12l768d`` for the public
configuration). Its slide encoder runs Microsoft torchscale's LongNet encoder, which
Prov-GigaPath vendors (``gigapath/torchscale``, imported as the top-level package
``torchscale``), and that encoder's dilated attention requires flash-attn's
``flash_attn_func`` for the log-sum-exp of every dilated segment. flash-attn has no CPU
build, so before importing the checkout this module installs:

* the attention itself: ``flash_attn_func(q, k, v, dropout, bias, softmax_scale,
  is_causal) -> (out [b, l, h, d], lse [b, h, l])`` (torchscale's wrapper signature),
  computed by torch's CPU flash-attention kernel
  ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` on the ``[b, h, l, d]``
  transposes (it returns the natural log-sum-exp, float32). torchscale's
  ``component/flash_attention.py`` imports flash-attn only when CUDA is available, so
  after the import the module-level ``flash_attn_func`` of its ``multihead_attention``
  (the name ``attention_ops`` calls) is set to this function. A stand-in
  ``flash_attn.flash_attn_interface.flash_attn_func`` (flash-attn's own signature, same
  kernel) is also installed when flash-attn is absent, for a machine where CUDA is
  visible;
* stubs of the imports the slide encoder needs but does not use at inference, each only
  when the real package does not import: ``fairscale.nn`` (``checkpoint_wrapper``,
  ``wrap``: identities; used only with activation checkpointing / FSDP), ``timm``
  (``timm.models.registry.register_model``: returns the function;
  ``timm.models.layers.drop_path``: stochastic depth, identity outside training) and
  ``huggingface_hub`` (an empty module; used only to download weights). apex is
  optional there already (torch's LayerNorm is used without it). ``einops`` is needed
  (the project's ``peers`` extra, or ``pip install einops``).

Two more adjustments, neither changing what the model computes:

* the segment lengths reach torchscale as a string, ``str(list(np.int64 array))``, which
  its config ``eval``-s; NumPy 2 writes that list as ``[np.int64(1024), ...]``, which the
  ``eval`` cannot read, so the model is built under ``np.printoptions(legacy="1.25")``
  (the ``[1024, ...]`` that NumPy 1 writes);
* ``make_longnet_from_name`` only knows the encoder sizes listed in torchscale's
  ``LongNetConfig``; a size that is not listed there (the benchmark's ``--quick`` model,
  or ``--layers 2``) is added under the name ``LongNetViT`` looks up, with the fields of
  the listed ``LongNet_12_layers_768_dim`` (flash attention on) and the requested sizes,
  for the construction only.

The model is built in ``eval()`` mode (no dropout, no drop-path). Its constructor
computes the whole ``(grid_size^2 + 1) x D`` position table as Prov-GigaPath does (in
float64 by NumPy, then a float32 buffer: about 12 GB at its peak and 3 GB kept for the
public model), so building it needs that much memory for a moment.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types

NAME = "Prov-GigaPath"
URL = "https://github.com/prov-gigapath/prov-gigapath"

__all__ = ["NAME", "URL", "available", "build", "cpu_flash_attn_func", "install_stubs", "load"]

# the fields of torchscale's LongNet_12_layers_768_dim (Prov-GigaPath's LongNetConfig.py),
# besides the sizes, for encoder sizes that file does not list
_ENCODER_FIELDS = {"flash_attention": True, "block_shift": True, "use_xmoe": False,
                   "moe_top1_expert": False, "moe_freq": 0, "moe_expert_count": 0,
                   "dilated_ratio": "[1, 2, 4, 8, 16]",
                   "segment_length": "[1024, 2048, 4096, 8192, 16384]"}


# ---------------------------------------------------------------- the attention

def cpu_flash_attn_func(q, k, v, dropout=0.0, bias=None, softmax_scale=None, is_causal=False):
    """torchscale's ``flash_attn_func``: ``q, k, v [b, l, h, d] -> (out [b, l, h, d],
    lse [b, h, l])`` by torch's CPU flash-attention kernel (natural log-sum-exp of the
    scaled logits, float32)."""
    import torch
    if bias is not None:
        raise NotImplementedError("the CPU flash-attn stand-in takes no attention bias "
                                  "(torchscale's dilated attention passes none)")
    if dropout:
        raise NotImplementedError(f"the CPU flash-attn stand-in runs without attention "
                                  f"dropout (got {dropout}); build the model in eval mode "
                                  f"with attention_dropout 0")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, bool(is_causal),
        scale=softmax_scale)[:2]
    return out.transpose(1, 2), lse


def _flash_attn_interface_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                               return_attn_probs=False, **_):
    """flash-attn's ``flash_attn_func`` signature on the same kernel."""
    out, lse = cpu_flash_attn_func(q, k, v, dropout_p, None, softmax_scale, causal)
    return (out, lse, None) if return_attn_probs else out


# ------------------------------------------------------------------------ stubs

def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _module(name: str, doc: str, package: bool = False, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name, f"stand-in ({doc}; benchmarks/baselines/gigapath.py)")
    if package:
        mod.__path__ = []  # so that `import name.sub` resolves to the stubs
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """Stochastic depth per sample (timm's ``drop_path``): identity outside training."""
    if not drop_prob or not training:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    if keep > 0.0 and scale_by_keep:
        mask.div_(keep)
    return x * mask


def install_stubs() -> list[str]:
    """Put stand-ins for flash-attn, fairscale, timm and huggingface_hub in
    ``sys.modules``, each only where the real package does not import; returns the names
    of the packages stubbed."""
    stubbed = []
    if not _importable("flash_attn.flash_attn_interface"):
        iface = _module("flash_attn.flash_attn_interface", "flash-attn on torch's CPU kernel",
                        flash_attn_func=_flash_attn_interface_func)
        sys.modules["flash_attn"] = _module("flash_attn", "flash-attn", True,
                                            flash_attn_interface=iface)
        sys.modules["flash_attn.flash_attn_interface"] = iface
        stubbed.append("flash_attn")
    if not _importable("fairscale.nn"):
        nn = _module("fairscale.nn", "fairscale: identities",
                     checkpoint_wrapper=lambda module, *a, **k: module,
                     wrap=lambda module, *a, **k: module)
        sys.modules["fairscale"] = _module("fairscale", "fairscale", True, nn=nn)
        sys.modules["fairscale.nn"] = nn
        stubbed.append("fairscale")
    if not (_importable("timm.models.registry") and _importable("timm.models.layers")):
        registry = _module("timm.models.registry", "timm", register_model=lambda fn: fn)
        layers = _module("timm.models.layers", "timm", drop_path=_drop_path)
        models = _module("timm.models", "timm", True, registry=registry, layers=layers,
                         register_model=registry.register_model)

        def create_model(*args, **kwargs):
            raise NotImplementedError("timm stand-in: build the model directly")

        sys.modules["timm"] = _module("timm", "timm", True, models=models,
                                      create_model=create_model)
        sys.modules.update({"timm.models": models, "timm.models.registry": registry,
                            "timm.models.layers": layers})
        stubbed.append("timm")
    if not _importable("huggingface_hub"):
        sys.modules["huggingface_hub"] = _module("huggingface_hub", "huggingface_hub: unused")
        stubbed.append("huggingface_hub")
    return stubbed


# ----------------------------------------------------------------------- import

def _check_src(src: str | os.PathLike) -> str:
    src = os.path.abspath(os.fspath(src))
    for part in ("gigapath/slide_encoder.py", "gigapath/torchscale/component/dilated_attention.py"):
        if not os.path.isfile(os.path.join(src, part)):
            raise ImportError(f"{src!r} is not a checkout of {URL} (no {part})")
    return src


def load(src: str | os.PathLike):
    """``gigapath.slide_encoder`` imported from the checkout ``src`` (stubs installed, the
    attention replaced; see the module docstring)."""
    src = _check_src(src)
    if "gigapath.slide_encoder" in sys.modules:
        module = sys.modules["gigapath.slide_encoder"]
        if not os.path.abspath(module.__file__).startswith(src + os.sep):
            raise ImportError(f"gigapath was already imported from {module.__file__}, not "
                              f"from {src}")
        _patch_attention()
        return module
    have = sys.modules.get("torchscale")
    vendored = os.path.join(src, "gigapath")
    if have is not None and not os.path.abspath(getattr(have, "__file__", "") or "").startswith(
            vendored + os.sep):
        raise ImportError(f"a torchscale package is already imported from {have.__file__}; "
                          f"Prov-GigaPath needs its vendored copy in {vendored}/torchscale")
    import numpy  # noqa: F401  (before the checkout's folder goes on the path)
    import torch  # noqa: F401
    install_stubs()
    # Prov-GigaPath imports its vendored torchscale as the top-level `torchscale` (its
    # LongNet.py appends gigapath/ to sys.path); put it first, so that an installed
    # torchscale release (without dilated attention) cannot be picked up instead
    added = [p for p in (src, vendored) if p not in sys.path]
    sys.path[:0] = added
    try:
        module = importlib.import_module("gigapath.slide_encoder")
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)
    _patch_attention()
    return module


def _patch_attention() -> None:
    """Point every imported torchscale ``multihead_attention`` / ``flash_attention``
    module's ``flash_attn_func`` at :func:`cpu_flash_attn_func`."""
    patched = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or "torchscale" not in name:
            continue
        if name.endswith(("component.multihead_attention", "component.flash_attention")):
            mod.flash_attn_func = cpu_flash_attn_func
            patched += name.endswith("multihead_attention")
    if not patched:
        raise ImportError("torchscale's multihead_attention module was not imported: "
                          "cannot install the CPU flash-attention stand-in")


def available(src: str | os.PathLike | None) -> str | None:
    """None if Prov-GigaPath's slide encoder can be loaded from ``src``, else why not."""
    if src is None:
        return (f"{NAME}'s PyTorch slide encoder is not a dependency: pass --gigapath-src DIR, "
                f"a checkout of {URL}")
    try:  # the directory first: a wrong path is the likelier mistake
        _check_src(src)
    except ImportError as err:
        return str(err)
    try:
        import torch  # noqa: F401
    except ImportError:
        return f"{NAME}'s slide encoder needs torch (pip install torch)"
    try:
        import einops  # noqa: F401
    except ImportError:
        return f"{NAME}'s slide encoder needs einops (pip install einops)"
    try:
        load(src)
    except ImportError as err:
        return f"{NAME} could not be imported from {src}: {err}"
    return None


@contextlib.contextmanager
def _encoder_size(longnet_config, name: str, fields: dict):
    """``longnet_config.<name> = fields`` for the duration (restored afterwards)."""
    missing = object()
    old = getattr(longnet_config, name, missing)
    setattr(longnet_config, name, dict(fields))
    try:
        yield
    finally:
        if old is missing:
            delattr(longnet_config, name)
        else:
            setattr(longnet_config, name, old)


def build(src: str | os.PathLike, *, in_features: int = 1536, embed_dim: int = 768,
          num_layers: int = 12, num_heads: int = 16, max_wsi_size: int = 262144,
          tile_size: int = 256, grid_size: int = 1000):
    """Prov-GigaPath's ``LongNetViT`` (``gigapath_slide_enc12l768d`` for the public sizes;
    the FFN is 4x the width, as there), float32, in ``eval()`` mode, on the CPU."""
    import functools

    import numpy as np
    import torch

    slide_encoder = load(src)
    longnet_config = sys.modules["torchscale.model.LongNetConfig"]
    name = f"LongNet_{num_layers}_layers_{embed_dim}_dim"  # what LongNetViT looks up
    fields = {**_ENCODER_FIELDS, "encoder_layers": num_layers, "encoder_embed_dim": embed_dim,
              "encoder_ffn_embed_dim": 4 * embed_dim, "encoder_attention_heads": num_heads}
    listed = getattr(longnet_config, name, None)
    sizes = ("encoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim",
             "encoder_attention_heads", "flash_attention")
    same = listed is not None and all(listed.get(k) == fields[k] for k in sizes)
    public = (same and (num_layers, embed_dim, num_heads) == (12, 768, 16))
    kwargs = dict(in_chans=in_features, slide_ngrids=grid_size, tile_size=tile_size,
                  max_wsi_size=max_wsi_size)
    size = contextlib.nullcontext() if same else _encoder_size(longnet_config, name, fields)
    legacy = (np.printoptions(legacy="1.25") if int(np.__version__.split(".")[0]) >= 2
              else contextlib.nullcontext())
    quiet = contextlib.redirect_stdout(sys.stderr)  # its constructor prints its settings
    with size, legacy, quiet:
        if public:
            model = slide_encoder.gigapath_slide_enc12l768d(**kwargs)
        else:
            model = slide_encoder.LongNetViT(
                embed_dim=embed_dim, depth=num_layers, mlp_ratio=4,
                norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6), **kwargs)
    return model.float().eval()
