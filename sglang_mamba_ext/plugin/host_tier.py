"""The host tier of ``--enable-hierarchical-cache`` under ``--enable-mamba-radix``
(``docs/design.md``, "Host tier"): building it from SGLang's flags onto the plugin's request
pool — a host pool of SSM states and one of attention KV over SGLang's device KV buffers.
The tier's mechanism is the core's (``mem_cache/state_tiers.py``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def attach_host_tier(pool, kv_allocator) -> str:
    """``--enable-hierarchical-cache``: give the pool a host tier of SSM states
    (:class:`~sglang_mamba_ext.mem_cache.checkpoint_pool.HostStatePool`) and one of attention
    KV (:class:`~sglang_mamba_ext.mem_cache.kv_host_pool.HostKVPool` over the device KV
    pool's buffers; ``docs/design.md``, "Host tier"), sized by SGLang's ``--hicache-ratio``
    (host states per device slot and host KV tokens per device KV token, default 2.0) or
    ``--hicache-size`` (GiB, shared between the two in the proportion of their device
    bytes), page-locked where CUDA is available. Under ``--enable-int8-mamba-checkpoint``
    the host tier copies the int8 checkpoint slots (SGLang's ``MambaCheckpointPool``
    tensors, as they are) and the same host bytes hold more states: the ratio then gives
    the bytes of ``ratio`` full-precision states per device slot, filled with int8 ones
    (about twice as many). Returns ``--hicache-write-policy``.

    Raises:
        ValueError: the sizes give no host slot, or the KV pool has no per-layer buffers."""
    from sglang.srt.runtime_context import get_memory

    from sglang_mamba_ext.mem_cache.checkpoint_pool import HostStatePool
    from sglang_mamba_ext.mem_cache.kv_host_pool import HostKVPool

    mem = get_memory()
    active = pool.core_mamba_pool
    # the tree's states: int8 checkpoint slots under --enable-int8-mamba-checkpoint
    stored = pool.core_ckpt_pool if pool.core_ckpt_pool is not None else active
    full_bytes = HostStatePool(1, active).slot_bytes()
    probe = HostStatePool(1, stored)
    kv_buffers, page_size = _kv_buffers(kv_allocator)
    kv_device_tokens = int(kv_allocator.size)
    token_bytes = sum(b[0].numel() * b.element_size() for b in kv_buffers)
    if mem.hicache_size:
        total = int(mem.hicache_size * (1 << 30))
        state_dev = active.size * full_bytes
        share = state_dev / max(state_dev + kv_device_tokens * token_bytes, 1)
        slots = int(total * share) // probe.slot_bytes()
        kv_tokens = int(total * (1 - share)) // max(token_bytes, 1)
        how = how_kv = f"--hicache-size {mem.hicache_size} GiB"
    else:
        ratio = mem.hicache_ratio if mem.hicache_ratio is not None else 2.0
        # host bytes of `ratio` full-precision states per device slot; int8 states fit more
        slots = int(active.size * ratio) * full_bytes // probe.slot_bytes()
        kv_tokens = int(kv_device_tokens * ratio)
        how = f"--hicache-ratio {ratio} x {active.size} device slots"
        how_kv = f"--hicache-ratio {ratio} x {kv_device_tokens} device KV tokens"
    if slots < 1:
        raise ValueError(f"--enable-hierarchical-cache: {how} holds no SSM state of {probe.slot_bytes()} bytes")
    if not kv_buffers:  # slots only (no KV data): as many host tokens as the ratio gives
        kv_tokens = max(kv_tokens, kv_device_tokens)
    kv_tokens -= kv_tokens % page_size
    if kv_tokens < page_size:
        raise ValueError(
            f"--enable-hierarchical-cache: {how_kv} holds no KV page of {page_size} tokens "
            f"({token_bytes * page_size} bytes); give a larger --hicache-ratio or --hicache-size"
        )
    pin = active.device.type == "cuda" and torch.cuda.is_available()
    host = HostStatePool(slots, stored, pin_memory=pin)
    kv_host = HostKVPool(kv_tokens, page_size, kv_buffers, pin_memory=pin)
    pool.core.mamba_host_pool = host
    pool.core.kv_host_pool = kv_host
    logger.info(
        "sglang-mamba-ext: host tier of %d %sSSM states and %d KV tokens (%s, %.1f + %.1f MiB, write policy %s)",
        slots, "int8 " if stored is not active else "", kv_tokens, how, host.total_bytes() / (1 << 20),
        kv_host.total_bytes() / (1 << 20), mem.hicache_write_policy,
    )
    return mem.hicache_write_policy


def _kv_buffers(kv_allocator):
    """``(buffers, page_size)``: the per-layer device tensors of SGLang's KV pool behind
    ``kv_allocator`` (an MHA pool's ``k_buffer + v_buffer``, an MLA pool's ``kv_buffer``; a
    hybrid pool's full-attention pool), each indexed by KV slot; no buffers for an allocator
    without a KV pool (the offline benchmarks' ``benchmarks/ours.py``: slots only, no data).

    Raises:
        ValueError: the pool has neither."""
    kvcache = kv_allocator.get_kvcache()
    page_size = int(getattr(kv_allocator, "page_size", 1))
    if kvcache is None:
        return [], page_size
    full = getattr(kvcache, "full_kv_pool", None) or kvcache
    k, v = getattr(full, "k_buffer", None), getattr(full, "v_buffer", None)
    if k is not None and v is not None:
        buffers = list(k) + list(v)
    elif getattr(full, "kv_buffer", None) is not None:
        buffers = list(full.kv_buffer)
    else:
        raise ValueError(
            f"--enable-hierarchical-cache: the KV pool {type(full).__name__} has no per-layer "
            "k_buffer / v_buffer or kv_buffer to copy to host memory (drop --enable-hierarchical-cache)"
        )
    return buffers, page_size


def attach_storage_tier(core, backend_name: str, extra_config, model_name, tp_rank: int = 0, tp_size: int = 1,
                        model_path=None):
    """``--hicache-storage-backend file`` or ``mooncake`` (``docs/design.md``, "Storage
    tier"): give the tree (``core``, with its host tier attached) SGLang's own storage
    backend, built by SGLang's ``StorageBackendFactory`` from a ``HiCacheStorageConfig`` as
    its cache controller builds it, keyed by SGLang's ``get_storage_hash_str`` (page hashes
    chained from the sequence start, seeded by ``extra_key`` / ``cache_salt``).
    ``extra_config``: SGLang's ``--hicache-storage-backend-extra-config`` (JSON or
    ``@file``), parsed by SGLang. SGLang's ``MooncakeStore`` is reached through
    :class:`~.storage_mooncake.MooncakeValues` (one object per key, through a registered
    staging buffer). ``model_path``: the served model's directory, whose
    :func:`model_fingerprint` is part of every value's digest. Returns the tier's backend.

    Raises:
        ValueError: a mooncake setting the tier cannot serve (:func:`_check_mooncake_config`)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    extra = extra_config if isinstance(extra_config, dict) else \
        HybridCacheController.parse_storage_backend_extra_config(extra_config)[0]
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model_name, extra_config=extra or None,
    )
    if backend_name == "mooncake":
        _check_mooncake_config(config)
        timeout_s, retry_s = _guard_settings(extra or {})
    backend = StorageBackendFactory.create_backend(backend_name, config, None)
    discard = _file_discard(backend)
    where = getattr(getattr(backend, "_backend", backend), "file_path", "?")
    if backend_name == "mooncake":  # one object per key through a staging buffer
        from sglang_mamba_ext.mem_cache.storage_guard import GuardedStore
        from sglang_mamba_ext.plugin.storage_mooncake import MooncakeValues

        values = MooncakeValues(backend)
        cfg = values.store.config
        # a master that goes away: misses and dropped writes within timeout_s (docs/flags.md)
        backend = GuardedStore(values, timeout_s, retry_s, what=f"mooncake master {cfg.master_server_address}")
        discard = backend.discard
        where = (f"master {cfg.master_server_address}, {cfg.protocol}, {cfg.global_segment_size} bytes mounted "
                 f"here; calls bounded at {timeout_s:g} s, retried every {retry_s:g} s while unreachable")
    page = core.page_size

    def page_keys(tokens, namespace):
        ek, salt = namespace if isinstance(namespace, tuple) else (namespace, None)
        return get_storage_hash_str(RadixKey(list(tokens), ek, cache_salt=salt), None, page_size=page)

    page_keys([0] * page, None)  # SGLang builds its native hasher on first use: at start-up, not at a spill
    core.attach_storage(backend, page_keys, layout_tag=storage_layout_tag(core, model_path),
                        discard=discard, state_suffix=f".{PoolName.MAMBA.value}")
    logger.info(
        "sglang-mamba-ext: storage tier %s (%s) under the host tier: %d-byte states, %d-byte KV pages",
        backend_name, where, core.mamba_host_pool.slot_bytes(), core.kv_host_pool.token_bytes() * page,
    )
    return backend


#: The plugin's own keys in ``--hicache-storage-backend-extra-config`` (SGLang's mooncake
#: config ignores them): the longest one storage call may hold the scheduler, and the
#: seconds between probes of an unreachable store.
GUARD_KEYS = ("storage_call_timeout_s", "storage_retry_interval_s")


#: The largest value either key takes, seconds: a longer bound would let one storage call hold
#: the scheduler for over an hour (and Python's thread waits overflow near 9.2e9 s).
GUARD_MAX_S = 3600.0


def _guard_settings(extra: dict):
    """``(timeout_s, retry_s)`` from the extra config (:data:`GUARD_KEYS`), else the defaults
    (also for an explicit JSON ``null``).

    Raises:
        ValueError: a value that is not a number of seconds in ``(0, GUARD_MAX_S]`` (a JSON
            boolean or string is not a number), or a ``storage_*`` key the plugin does not
            know (a misspelled one would otherwise be ignored; SGLang's mooncake keys have no
            such prefix)."""
    import math

    from sglang_mamba_ext.mem_cache.storage_guard import DEFAULT_RETRY_S, DEFAULT_TIMEOUT_S

    unknown = sorted(k for k in extra if str(k).startswith("storage_") and k not in GUARD_KEYS)
    if unknown:
        raise ValueError(f"--hicache-storage-backend-extra-config: unknown key(s) {', '.join(unknown)} "
                         f"(the plugin's keys are {' and '.join(GUARD_KEYS)})")
    out = []
    for key, default in zip(GUARD_KEYS, (DEFAULT_TIMEOUT_S, DEFAULT_RETRY_S)):
        value = extra.get(key)
        if value is None:
            value = default
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not (ok and 0 < value <= GUARD_MAX_S):
            raise ValueError(f"--hicache-storage-backend-extra-config: {key} must be a number of seconds above 0 "
                             f"and at most {GUARD_MAX_S:g} (got {extra.get(key)!r})")
        out.append(float(value))
    return tuple(out)


def check_guard_settings(extra_config, backend: str = "mooncake") -> None:
    """The launcher's check of ``--hicache-storage-backend-extra-config`` (a JSON string,
    SGLang's ``@file`` form, or a dict) for the storage tier's ``backend``, so a bad value fails
    at start-up rather than in the scheduler after the model load: it must parse (SGLang's
    parser) to a JSON object; for ``mooncake`` its :data:`GUARD_KEYS` are checked; ``file``
    takes no guard key (its calls are not guarded) and its ``file_storage_path`` must be a
    directory that exists or can be made (made here, as SGLang's ``HiCacheFile`` would).

    Raises:
        ValueError: as :func:`_guard_settings`; extra config that is not valid JSON, an
            unreadable ``@file`` or not an object; a guard key with ``file``; a
            ``file_storage_path`` that cannot be made."""
    import os

    if not extra_config:
        return
    if isinstance(extra_config, dict):
        extra = extra_config
    else:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

        try:
            extra = HybridCacheController.parse_storage_backend_extra_config(extra_config)[0] or {}
        except (TypeError, AttributeError):  # SGLang's parser pops keys: a list, a number, ...
            raise ValueError("--hicache-storage-backend-extra-config: expected a JSON object "
                             f"(keys and values), got {extra_config!r}") from None
        except Exception as e:  # SGLang's parser: JSON, an unreadable @file
            raise ValueError(f"--hicache-storage-backend-extra-config: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError(f"--hicache-storage-backend-extra-config: expected a JSON object, got {extra!r}")
    if backend != "file":
        _guard_settings(extra)
        return
    guard = sorted(k for k in extra if str(k).startswith("storage_"))
    if guard:
        raise ValueError(f"--hicache-storage-backend-extra-config: {', '.join(guard)}: the plugin's storage_* "
                         "keys apply to --hicache-storage-backend mooncake only (the file backend's calls are "
                         "not guarded); drop them")
    path = extra.get("file_storage_path")
    if path is not None:
        try:
            os.makedirs(str(path), exist_ok=True)
        except OSError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config: file_storage_path {path!r} cannot be "
                             f"made ({e.strerror}); give a writable directory") from None


def _check_mooncake_config(config) -> None:
    """Refuse, before a mooncake client is set up, the setting the plugin's storage tier
    cannot serve: ``standalone_storage`` (a dummy client whose real client maps SGLang's host
    KV pool, allocated by mooncake's allocator; the plugin's host tier and staging buffer are
    its own).

    Raises:
        ValueError: naming the setting."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeBaseStore

    cfg = MooncakeBaseStore()._load_config(config)  # extra config, config file or MOONCAKE_* env
    if cfg.standalone_storage:
        raise ValueError(
            "--enable-mamba-radix with --hicache-storage-backend mooncake: standalone_storage "
            "(MOONCAKE_STANDALONE_STORAGE) is not served (its dummy client maps SGLang's host KV "
            "pool allocated by mooncake; the plugin's host tier is its own); use a regular client"
        )


def storage_layout_tag(core, model_path=None) -> bytes:
    """What a stored value's bytes mean: the host tiers' tensor shapes and dtypes, the page
    size and the model's :func:`model_fingerprint` (part of every stored value's digest: another
    layout, or other weights at the same path, reads as a miss)."""
    parts = [f"page={core.page_size}"]
    parts += [f"s{tuple(t.shape[1:])}:{t.dtype}" for t in core.mamba_host_pool.host]
    parts += [f"k{tuple(t.shape[1:])}:{t.dtype}" for t in core.kv_host_pool.host_buffers]
    parts.append(f"model={model_fingerprint(model_path)}")
    return ";".join(parts).encode()


#: Weight files :func:`model_fingerprint` reads the size and modification time of.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model_path) -> str:
    """A short hex digest of a local model directory: its ``config.json`` bytes and each
    weight file's name, size and modification time (ns) — not the weights' bytes, which
    would take minutes to read for a large model. Replacing the weights at the same path (a
    new copy, a re-download) changes it, so the storage tier's values written for the old
    weights read as misses, never as states of another model (found by a fresh-user check:
    SGLang's storage keys name the path only). ``""`` for a path that is not a directory (a hub
    name: its files are not known here)."""
    import hashlib
    import os

    if not model_path or not os.path.isdir(str(model_path)):
        return ""
    h = hashlib.sha256()
    root = str(model_path)
    config = os.path.join(root, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(f.read())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(WEIGHT_SUFFIXES):
                st = os.stat(os.path.join(dirpath, name))
                h.update(f"{os.path.relpath(os.path.join(dirpath, name), root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _file_discard(backend):
    """For SGLang's ``HiCacheFile``: remove a key's file (a value that failed its check), so
    that a later write replaces it (``HiCacheFile.set`` skips a key whose file exists)."""
    import os

    inner = getattr(backend, "_backend", backend)
    suffixed = getattr(inner, "_get_suffixed_key", None)
    root = getattr(inner, "file_path", None)
    if suffixed is None or root is None:
        return None

    def discard(key: str) -> None:
        name = suffixed(key)
        if getattr(inner, "metadata_cache", None) is not None:
            inner.metadata_cache.remove(name)
        os.remove(os.path.join(root, f"{name}.bin"))

    return discard
