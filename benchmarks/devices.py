"""Simulated CPU devices and sequence meshes for the multi-device ops.

``ring``, ``distributed`` and ``block_sparse`` compile and run programs over P
devices. Without that many accelerators they use JAX's simulated CPU devices,
which must be requested before JAX creates its backends
(:func:`request_cpu_devices`, called by the op before anything touches
``jax.devices()``). The simulated devices share the process's pinned cores: their
compiled per-device memory is what P real devices would need, their wall time is
the total work of all devices, not what P real devices would take.
"""

from __future__ import annotations

import os


def request_cpu_devices(count: int) -> None:
    """Ask JAX for ``count`` CPU devices; must run before JAX creates its backends."""
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except AttributeError:  # JAX without the option: the XLA flag does the same
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def take_devices(count: int) -> list:
    """``count`` devices of the default backend, else of the (simulated) CPU backend."""
    import jax
    devices = jax.devices()
    if len(devices) < count:
        devices = jax.devices("cpu")
    if len(devices) < count:
        raise SystemExit(f"need {count} devices, have {len(devices)} (the op requests "
                         f"simulated CPU devices before JAX starts; something started it "
                         f"earlier)")
    return devices[:count]


def seq_mesh(count: int):
    """A 1-D mesh ``("seq",)`` over :func:`take_devices` ``(count)``."""
    import numpy as np
    from jax.sharding import Mesh
    return Mesh(np.array(take_devices(count)), ("seq",))


def grad_of(f):
    """``(q, k, v, ct) -> (dq, dk, dv)``: the gradient of ``sum(f(q, k, v) * ct)``
    (float32 product), the forward+backward pass every op times."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, ct):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def vjp_of(f):
    """``(q, k, v, ct) -> (out, (dq, dk, dv))``: forward output and its VJP with ``ct``."""
    import jax

    def run(q, k, v, ct):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct.astype(out.dtype))

    return run
