"""Shared helpers for fastckpt benchmarks: state builder, machine limits, RSS, results.

Nothing here imports jax at module import time: a benchmark must call
:func:`configure_host_devices` *before* the first ``import jax`` (XLA reads ``XLA_FLAGS``
once), then use the jax-dependent helpers. Helpers that need jax import it lazily.

Contents:

* devices and state: :func:`configure_host_devices`, :func:`make_mesh`, :class:`StateSpec`,
  :func:`spec_for_bytes`, :func:`build_state`, :func:`abstract_like`, :func:`make_step_fn`,
  :func:`host_value`, :func:`assert_trees_equal`;
* memory and CPU: :func:`rss_bytes`, :func:`reset_peak_rss`, :func:`peak_rss_bytes`,
  :class:`RssSampler` (a 5 ms sampling thread), :func:`proc_io`, :func:`cpu_seconds`;
* storage: :func:`evict_page_cache`, :func:`dir_bytes`, :func:`is_tmpfs`;
* machine limits: :func:`measure_memcpy`, :func:`measure_file_io`,
  :func:`measure_device_get`, :func:`measure_gcs_raw`;
* plumbing: :func:`run_module_json` (run one cell in a fresh interpreter),
  :func:`emulator_pid`, :func:`markdown_table`, :func:`write_json`, :func:`bar_chart`;
* docs: :func:`publish_docs` (a benchmark rewrites its block of ``docs/benchmarks.md``),
  :func:`run_header` and :func:`write_results` (a results document's start and its files),
  :func:`render_docs` (every block from the committed JSON: ``python -m benchmarks._common
  --render-docs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
GiB = 1 << 30
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# --------------------------------------------------------------------------- devices


def configure_host_devices(n: int = 8) -> None:
    """Ask XLA for ``n`` virtual CPU devices. Must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("configure_host_devices() must be called before importing jax")
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in f
    ]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def make_mesh(shape: tuple[int, int], *, axis_names: tuple[str, str] = ("data", "model")) -> Any:
    """A mesh over the first ``prod(shape)`` devices."""
    import jax

    n = int(np.prod(shape))
    devices = jax.devices()
    if len(devices) < n:
        raise RuntimeError(
            f"need {n} devices, have {len(devices)} (call configure_host_devices first)"
        )
    return jax.sharding.Mesh(np.asarray(devices[:n]).reshape(shape), axis_names)


# --------------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """A transformer-like training state: params + Adam ``mu``/``nu``.

    Large arrays: embedding (f32, sharded on ``model``, replicated over ``data``), LM head
    (bf16, fully sharded), and four matrices per layer (f32, various shardings). Many small
    arrays: layer-norm scales/biases and biases (replicated or sharded on ``model``), a
    step counter and an RNG key (replicated). ``mu`` has each param's dtype; ``nu`` is f32.
    """

    d_model: int
    vocab: int
    layers: int

    def leaf_shapes(self) -> dict[str, tuple[tuple[int, ...], str, tuple[Any, ...]]]:
        """``name -> (shape, dtype, partition spec)`` of every param."""
        d, v = self.d_model, self.vocab
        out: dict[str, tuple[tuple[int, ...], str, tuple[Any, ...]]] = {
            "embed": ((v, d), "float32", ("model", None)),
            "lm_head": ((d, v), "bfloat16", ("data", "model")),
            "final_ln/scale": ((d,), "float32", ()),
            "final_ln/bias": ((d,), "float32", ()),
        }
        for i in range(self.layers):
            p = f"layer_{i:02d}"
            out[f"{p}/attn/qkv"] = ((d, 3 * d), "float32", ("data", "model"))
            out[f"{p}/attn/qkv_bias"] = ((3 * d,), "float32", ("model",))
            out[f"{p}/attn/out"] = ((d, d), "float32", ("model", "data"))
            out[f"{p}/attn/out_bias"] = ((d,), "float32", ())
            out[f"{p}/mlp/w_in"] = ((d, 4 * d), "float32", (None, "model"))
            out[f"{p}/mlp/w_in_bias"] = ((4 * d,), "float32", ("model",))
            out[f"{p}/mlp/w_out"] = ((4 * d, d), "float32", ("model", "data"))
            out[f"{p}/mlp/w_out_bias"] = ((d,), "float32", ())
            for ln in ("ln1", "ln2"):
                out[f"{p}/{ln}/scale"] = ((d,), "float32", ())
                out[f"{p}/{ln}/bias"] = ((d,), "float32", ())
        return out

    def nbytes(self) -> int:
        """Logical bytes of the whole state (params + mu + nu + step + rng)."""
        total = 4 + 8
        for shape, dtype, _ in self.leaf_shapes().values():
            n = math.prod(shape)
            isz = 2 if dtype == "bfloat16" else 4
            total += n * isz * 2 + n * 4  # param + mu (param dtype) + nu (f32)
        return total

    def num_leaves(self) -> int:
        return 3 * len(self.leaf_shapes()) + 2


def spec_for_bytes(target: int) -> StateSpec:
    """The spec whose size is closest to ``target`` bytes (d_model/vocab scale with it)."""
    if target >= 768 * MiB:
        d, v = 1024, 16384
    elif target >= 192 * MiB:
        d, v = 512, 8192
    else:
        d, v = 256, 4096
    best = StateSpec(d, v, 1)
    for layers in range(1, 256):
        s = StateSpec(d, v, layers)
        if abs(s.nbytes() - target) < abs(best.nbytes() - target):
            best = s
        if s.nbytes() > target:
            break
    return best


def _random_pool(nbytes: int, seed: int) -> np.ndarray:
    """Float32 values shaped like trained weights (|x| in [2^-10, 0.25), random sign and
    mantissa): zstd level 1 compresses them to ~0.93, like real f32 weights."""
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 2**32, size=nbytes // 4, dtype=np.uint32)
    e = (r >> np.uint32(23)) & np.uint32(7)
    r &= np.uint32(0x807FFFFF)
    r |= (e + np.uint32(0x75)) << np.uint32(23)
    return r.view(np.float32)


def _fill(pool: np.ndarray, n: int, offset: int) -> np.ndarray:
    """``n`` values from ``pool`` starting at ``offset`` (wrapping)."""
    out = np.empty(n, np.float32)
    pos, off = 0, offset % pool.size
    while pos < n:
        k = min(n - pos, pool.size - off)
        out[pos : pos + k] = pool[off : off + k]
        pos, off = pos + k, 0
    return out


def build_state(
    spec: StateSpec, mesh: Any, *, seed: int = 0, pool_bytes: int = 32 * MiB
) -> dict[str, Any]:
    """Build the state on ``mesh`` (deterministic in ``seed``).

    Array contents come from one random pool read at a different offset per leaf, so
    building 1 GiB costs one memcpy, not 1 GiB of random numbers. The pool (32 MiB) is far
    larger than any zstd level-1 window, so repetition across it does not aid compression.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    pool = _random_pool(pool_bytes, seed)
    rng = np.random.default_rng(seed + 1)

    def leaf(
        shape: tuple[int, ...], dtype: str, pspec: tuple[Any, ...], *, positive: bool = False
    ) -> Any:
        n = math.prod(shape)
        host = _fill(pool, n, int(rng.integers(0, pool.size)))
        if positive:
            np.abs(host, out=host)
            host *= host  # Adam's nu: small, non-negative
        if dtype == "bfloat16":
            host = host.astype(jnp.bfloat16)
        arr = jax.device_put(host.reshape(shape), NamedSharding(mesh, PartitionSpec(*pspec)))
        del host
        return arr

    params: dict[str, Any] = {}
    mu: dict[str, Any] = {}
    nu: dict[str, Any] = {}
    for name, (shape, dtype, pspec) in spec.leaf_shapes().items():
        params[name] = leaf(shape, dtype, pspec)
        mu[name] = leaf(shape, dtype, pspec)
        nu[name] = leaf(shape, "float32", pspec, positive=True)
    replicated = NamedSharding(mesh, PartitionSpec())
    state = {
        "params": _nest(params),
        "opt_state": {
            "mu": _nest(mu),
            "nu": _nest(nu),
            "count": jax.device_put(np.int32(0), replicated),
        },
        "rng": jax.device_put(np.array([seed, 42], np.uint32), replicated),
    }
    jax.block_until_ready(state)
    return state


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for name, value in flat.items():
        node = root
        *heads, last = name.split("/")
        for h in heads:
            node = node.setdefault(h, {})
        node[last] = value
    return root


def tree_nbytes(tree: Any) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


def abstract_like(tree: Any, mesh: Any | None = None) -> Any:
    """``ShapeDtypeStruct`` s with each leaf's sharding (moved onto ``mesh`` if given)."""
    import jax
    from jax.sharding import NamedSharding

    def one(x: Any) -> Any:
        sharding = x.sharding
        if mesh is not None:
            sharding = NamedSharding(mesh, sharding.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, tree)


def make_step_fn(*, donate: bool = True) -> Callable[[Any], Any]:
    """A jitted "training step" returning fresh arrays with the same statistics (floats
    negated, integers incremented). Fresh arrays matter: jax caches the host copy of an
    array, so saving the same arrays twice would time a cache hit.

    With ``donate`` (default) the step updates the buffers in place (the input is deleted),
    like a real train step with donated state: it allocates nothing, so RSS measured
    across steps reflects the checkpoint library, not the step's allocations."""
    import jax
    import jax.numpy as jnp

    def step(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x: -x if jnp.issubdtype(x.dtype, jnp.floating) else x + jnp.ones((), x.dtype),
            tree,
        )

    return jax.jit(step, donate_argnums=0 if donate else ())


def host_value(x: Any) -> np.ndarray:
    """The global value of a jax array on host, assembled from its shards (no host-copy
    cache is populated, unlike ``np.asarray``/``jax.device_get``)."""
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def assert_trees_equal(a: Any, b: Any) -> None:
    """Bitwise equality of two pytrees of jax arrays, leaf by leaf (bounded host memory)."""
    import jax

    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        raise AssertionError(f"tree structures differ: {ta} vs {tb}")
    for i, (x, y) in enumerate(zip(la, lb)):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(f"leaf {i}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}")
        if not np.array_equal(
            host_value(x).reshape(-1).view(np.uint8), host_value(y).reshape(-1).view(np.uint8)
        ):
            raise AssertionError(f"leaf {i} differs")


# --------------------------------------------------------------------------- memory

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size now (from ``/proc/<pid>/statm``)."""
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``); False if the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS (``VmHWM``) since the process started or :func:`reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Samples RSS on a daemon thread every ``interval_s`` (default 5 ms).

    ``with sampler.window() as w:`` measures one phase: afterwards ``w.peak`` is the highest
    RSS seen (sampled, and the kernel's ``VmHWM`` after a reset, whichever is higher) and
    ``w.before``/``w.after`` the RSS at its edges.
    """

    @dataclasses.dataclass
    class Window:
        before: int = 0
        after: int = 0
        peak: int = 0
        sampled_peak: int = 0
        hwm_peak: int = 0
        samples: int = 0

        @property
        def delta(self) -> int:
            return self.peak - self.before

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._peak = 0
        self._n = 0
        self._stop = threading.Event()
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _read(self) -> int:
        return int(os.pread(self._fd, 256, 0).split()[1]) * _PAGE

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            v = self._read()
            with self._lock:
                self._n += 1
                if v > self._peak:
                    self._peak = v

    @contextlib.contextmanager
    def window(self) -> Iterator[RssSampler.Window]:
        w = RssSampler.Window()
        hwm_ok = reset_peak_rss()
        w.before = self._read()
        with self._lock:
            self._peak, self._n = w.before, 0
        try:
            yield w
        finally:
            w.after = self._read()
            with self._lock:
                w.sampled_peak, w.samples = max(self._peak, w.after), self._n
            w.hwm_peak = peak_rss_bytes() if hwm_ok else 0
            w.peak = max(w.sampled_peak, w.hwm_peak)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/io`` counters (rchar: bytes returned by read syscalls, page cache
    included; read_bytes: bytes fetched from block devices)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    return out


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds consumed so far by process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14, 15)


# --------------------------------------------------------------------------- storage


def evict_page_cache(root: str | os.PathLike[str]) -> int:
    """Drop ``root``'s files (only these) from the page cache: fsync, then
    ``POSIX_FADV_DONTNEED``. Returns the bytes covered. Makes the next read cold."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                with contextlib.suppress(OSError):
                    os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def dir_bytes(root: str | os.PathLike[str]) -> int:
    """Total size of the regular files under ``root``."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def is_tmpfs(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lives on a tmpfs/ramfs mount (longest mount-point match)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt, typ = parts[1], parts[2]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, typ
    return fstype in ("tmpfs", "ramfs")


# --------------------------------------------------------------------------- limits


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _measure_memcpy_touched(src: np.ndarray, reps: int) -> dict[str, float]:
    """Copy bandwidth into touched memory on 1 and 2 threads (the destination is freed on
    return, before the fresh-memory measurement)."""
    from concurrent.futures import ThreadPoolExecutor

    nbytes = src.size
    dst = np.ones(nbytes, np.uint8)
    out: dict[str, float] = {}
    best = min(_timeit(lambda: np.copyto(dst, src)) for _ in range(reps))
    out["memcpy_1t_gbps"] = _gbps(nbytes, best)
    half = nbytes // 2
    with ThreadPoolExecutor(2) as pool:

        def two() -> None:
            a = pool.submit(np.copyto, dst[:half], src[:half])
            b = pool.submit(np.copyto, dst[half:], src[half:])
            a.result(), b.result()

        best = min(_timeit(two) for _ in range(reps))
    out["memcpy_2t_gbps"] = _gbps(nbytes, best)
    return out


def measure_memcpy(nbytes: int, *, reps: int = 3) -> dict[str, float]:
    """numpy copy bandwidth (GB/s, best of ``reps``): into touched memory on 1 and 2
    threads, and into freshly allocated memory (page faults included)."""
    src = np.ones(nbytes, np.uint8)
    out = _measure_memcpy_touched(src, reps)

    def fresh() -> None:
        d = np.empty(nbytes, np.uint8)
        np.copyto(d, src)

    best = min(_timeit(fresh) for _ in range(reps))
    out["memcpy_fresh_gbps"] = _gbps(nbytes, best)
    return out


def measure_crc32c(nbytes: int, *, reps: int = 3) -> dict[str, float]:
    """crc32c throughput (GB/s, best of ``reps``) over ``nbytes`` in cache-sized pieces on 2
    threads: what verifying every restored byte costs at the least (own-RAM restores are
    zero copy, so this, not memcpy, is their floor)."""
    from concurrent.futures import ThreadPoolExecutor

    from fastckpt._checksum import crc32c

    src = np.ones(nbytes, np.uint8)
    half, piece = nbytes // 2, 4 << 20

    def run(view: np.ndarray) -> None:
        for off in range(0, view.nbytes, piece):
            crc32c(view[off : off + piece])

    with ThreadPoolExecutor(2) as pool:

        def two() -> None:
            a, b = pool.submit(run, src[:half]), pool.submit(run, src[half:])
            a.result(), b.result()

        best = min(_timeit(two) for _ in range(reps))
    return {"crc32c_2t_gbps": _gbps(nbytes, best)}


def _timeit(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_file_io(
    directory: str | os.PathLike[str], nbytes: int, *, reps: int = 2, piece: int = 64 * MiB
) -> dict[str, float]:
    """Raw file bandwidth in ``directory`` (GB/s, best of ``reps``): ``os.write`` in 64 MiB
    pieces + fsync, then a read into touched memory after evicting the file (cold; on
    tmpfs eviction is a no-op, so that read is from RAM)."""
    src = np.ones(nbytes, np.uint8)
    src[::4096] = 7
    dst = np.ones(nbytes, np.uint8)
    path = os.path.join(directory, f".fastckpt-bench-raw-{os.getpid()}")
    writes, reads = [], []
    try:
        for _ in range(reps):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(src)
                for off in range(0, nbytes, piece):
                    chunk = view[off : off + piece]
                    while chunk.nbytes:
                        chunk = chunk[os.write(fd, chunk) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            writes.append(time.perf_counter() - t0)
            evict_page_cache_file(path)
            t0 = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            try:
                view = memoryview(dst)
                done = 0
                while done < nbytes:
                    got = os.preadv(fd, [view[done : done + piece]], done)
                    if got == 0:
                        raise OSError("short read")
                    done += got
            finally:
                os.close(fd)
            reads.append(time.perf_counter() - t0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {"write_fsync_gbps": _gbps(nbytes, min(writes)), "read_gbps": _gbps(nbytes, min(reads))}


def evict_page_cache_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_device_get(state: Any, *, reps: int = 4) -> dict[str, float]:
    """``jax.device_get`` of the whole state: the first call in this process (the caller
    must not have run any jax computation or transfer to host before), then ``reps`` calls
    on fresh arrays (a jitted step between calls; its time is excluded). Seconds."""
    import jax

    t0 = time.perf_counter()
    host = jax.device_get(state)
    first = time.perf_counter() - t0
    del host
    step = make_step_fn()
    times = []
    for _ in range(reps):
        state = jax.block_until_ready(step(state))
        t0 = time.perf_counter()
        host = jax.device_get(state)
        times.append(time.perf_counter() - t0)
        del host
    return {
        "device_get_first_s": first,
        "device_get_s": statistics.median(times),
        "device_get_min_s": min(times),
        "device_get_all_s": times,
    }  # type: ignore[dict-item]


def measure_gcs_raw(
    endpoint: str, bucket: str, nbytes: int, *, objects: int = 4, reps: int = 2
) -> dict[str, float]:
    """Emulator throughput with google-cloud-storage (GB/s, best of ``reps``): ``objects``
    objects of ``nbytes / objects`` uploaded/downloaded concurrently (one thread each), and
    one object of the same size on a single stream."""
    from concurrent.futures import ThreadPoolExecutor

    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project="bench",
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=endpoint),
    )
    bkt = client.bucket(bucket)
    size = nbytes // objects
    payload = np.random.default_rng(0).integers(0, 255, size=size, dtype=np.uint8).tobytes()
    out: dict[str, float] = {}

    def put(name: str) -> None:
        bkt.blob(name).upload_from_string(payload, content_type="application/octet-stream")

    def get(name: str) -> None:
        data = bkt.blob(name).download_as_bytes(checksum=None)
        if len(data) != size:
            raise RuntimeError("short download")

    names = [f"raw/{os.getpid()}/{i}" for i in range(objects)]
    with ThreadPoolExecutor(objects) as pool:
        puts = [_timeit(lambda: list(pool.map(put, names))) for _ in range(reps)]
        gets = [_timeit(lambda: list(pool.map(get, names))) for _ in range(reps)]
    out[f"put_{objects}x_gbps"] = _gbps(size * objects, min(puts))
    out[f"get_{objects}x_gbps"] = _gbps(size * objects, min(gets))
    out["put_1x_gbps"] = _gbps(size, min(_timeit(lambda: put(names[0])) for _ in range(reps)))
    out["get_1x_gbps"] = _gbps(size, min(_timeit(lambda: get(names[0])) for _ in range(reps)))
    out["object_bytes"] = size
    for name in names:
        with contextlib.suppress(Exception):
            bkt.blob(name).delete()
    return out


# --------------------------------------------------------------------------- plumbing


def run_module_json(
    module: str,
    args: Sequence[str],
    *,
    out_path: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 1200.0,
) -> dict[str, Any]:
    """Run ``python -m module args... --out out_path`` in a fresh interpreter (repo root as
    cwd) and return the JSON it wrote. Raises with the child's stderr tail on failure."""
    cmd = [sys.executable, "-m", module, *args, "--out", str(out_path)]
    child_env = dict(os.environ if env is None else env)
    proc = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env=child_env,
        capture_output=True,
        timeout=timeout_s,
        text=True,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-4000:]).strip()
        raise RuntimeError(f"{' '.join(cmd[2:])} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out_path.read_text())


def emulator_pid(emulator: Any) -> int:
    """PID of a running :class:`~fastckpt.testing.gcs_emulator.GcsEmulator` (found among
    this process's children by its port, without touching private attributes)."""
    import psutil

    needle = str(emulator.port)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            if cmd and "fake-gcs-server" in cmd[0] and needle in cmd:
                return child.pid
    raise RuntimeError("emulator process not found")


def write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (cells formatted with ``str``)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width plain-text table for the terminal."""
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}x"


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def bar_chart(path: Path, *, panels: Sequence[dict[str, Any]], title: str, ncols: int = 3) -> None:
    """Grouped bar chart, one panel per metric.

    Each panel: ``{"title", "ylabel", "groups": [str], "series": {name: [values]},
    "lines": {label: value}}`` (horizontal reference lines, e.g. a machine limit).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for ax, panel in zip(axes.flat, panels):
        groups = panel["groups"]
        series = panel["series"]
        width = 0.8 / max(1, len(series))
        x = np.arange(len(groups))
        for k, (name, values) in enumerate(series.items()):
            vals = [np.nan if v is None else v for v in values]
            bars = ax.bar(
                x + (k - (len(series) - 1) / 2) * width,
                vals,
                width,
                label=name,
                color=colors[k % 4],
            )
            for b, v in zip(bars, vals):
                if not np.isnan(v):
                    ax.annotate(
                        f"{v:.2f}",
                        (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        for j, (label, value) in enumerate(panel.get("lines", {}).items()):
            if value is not None and not np.isnan(value):
                ax.axhline(
                    value,
                    color="gray",
                    linestyle=["--", ":", "-."][j % 3],
                    linewidth=1,
                    label=label,
                )
        ax.set_xticks(x, groups)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- docs blocks

DOCS_PATH = REPO_ROOT / "docs" / "benchmarks.md"
# Every benchmark whose current results docs/benchmarks.md shows: block name -> the module
# that writes ``<name>.json`` and exposes ``render(doc) -> str`` (its markdown report).
DOCS_BLOCKS = {
    "save_restore": "benchmarks.save_restore",
    "restore_latency": "benchmarks.restore_latency",
    "accelerator": "benchmarks.accelerator",
    "planning_scale": "benchmarks.planning_scale",
    "leaf_scaling": "benchmarks.leaf_scaling",
    "elastic_recovery": "benchmarks.elastic_recovery",
    "wire_mac": "benchmarks.wire_mac",
    "hosts": "benchmarks.hosts",
    "ram_redundancy": "benchmarks.ram_redundancy",
    "reliability": "benchmarks.reliability",
}


class DocsBlockError(RuntimeError):
    """docs/benchmarks.md lacks a benchmark's result markers (or has them twice / out of order)."""


def _markers(name: str) -> tuple[str, str]:
    module = DOCS_BLOCKS[name]
    return (
        f"<!-- results: {name} (generated by python -m {module}; do not edit) -->",
        f"<!-- /results: {name} -->",
    )


def _provenance(doc: dict[str, Any]) -> str:
    """When, where and at which commit a results JSON was made, from whatever keys it has."""
    meta = {**doc, **(doc.get("meta") or {})}
    runs = (
        doc.get("runs")
        if isinstance(doc.get("runs"), list) and doc["runs"] and isinstance(doc["runs"][-1], dict)
        else [{}]
    )
    when = meta.get("time") or meta.get("date") or meta.get("when") or meta.get("finished")
    unix = meta.get("unix_time") or meta.get("updated_unix")
    if not when and unix:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(unix))
    git = meta.get("git") or meta.get("git_commit") or runs[-1].get("git_commit")
    machine = {**(doc.get("env") or {}), **(doc.get("machine") or {})}
    cpus = meta.get("cpus") or machine.get("cpus")
    where = ", ".join(
        x for x in (machine.get("device_kind"), f"{cpus} CPUs" if cpus else None) if x
    )
    command = meta.get("command") or runs[-1].get("command")
    parts = [
        when or "date not recorded",
        f"git `{git}`" if git else "commit not recorded",
        where or None,
        f"`{command}`" if command else None,
    ]
    return "Run: " + "; ".join(p for p in parts if p) + "."


def _demote(markdown: str) -> str:
    """The report without its title, its ``##`` sections as ``####`` (under the docs' ``###``)."""
    out, fenced, titled = [], False, False
    for line in markdown.strip("\n").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            if level == 1 and not titled:
                titled = True
                continue
            line = "#" * min(6, level + 2) + line[level:]
        out.append(line)
    return "\n".join(out).strip("\n")


def render_block(
    name: str, doc: dict[str, Any], render: Callable[[dict[str, Any]], str] | None = None
) -> str:
    """The docs block of benchmark ``name`` for results ``doc``, markers included: the run's
    provenance, the benchmark's own markdown report (``render(doc)``, by default its module's
    ``render``; importing a benchmark module needs a process that has not imported jax yet)
    and the plot, if committed."""
    import importlib

    begin, end = _markers(name)
    body = _demote((render or importlib.import_module(DOCS_BLOCKS[name]).render)(doc))
    files = ", ".join(
        f"[{name}{ext}](../benchmarks/results/{name}{ext})"
        for ext in (".json", ".md", ".png")
        if (RESULTS_DIR / f"{name}{ext}").exists()
    )
    parts = [begin, f"{_provenance(doc)} Files: {files}.", body]
    if (RESULTS_DIR / f"{name}.png").exists():
        parts.append(f"![{name} results](../benchmarks/results/{name}.png)")
    return "\n\n".join(parts) + "\n\n" + end


def replace_block(text: str, name: str, block: str) -> str:
    """``text`` with benchmark ``name``'s block replaced by ``block``; :class:`DocsBlockError`
    if its two markers are not there exactly once each, in order."""
    begin_prefix, end = f"<!-- results: {name} ", f"<!-- /results: {name} -->"
    b, e = text.count(begin_prefix), text.count(end)
    if b != 1 or e != 1 or text.index(begin_prefix) > text.index(end):
        raise DocsBlockError(
            f"docs/benchmarks.md must hold one '{_markers(name)[0]}' line and one '{end}' line "
            "after it "
            f"(found {b} and {e}): add them to the {name} section, then run `python -m "
            "benchmarks._common --render-docs`"
        )
    start, stop = text.index(begin_prefix), text.index(end) + len(end)
    return text[:start] + block + text[stop:]


def update_docs(
    name: str,
    doc: dict[str, Any],
    docs: Path = DOCS_PATH,
    *,
    render: Callable[[dict[str, Any]], str] | None = None,
) -> None:
    """Rewrite benchmark ``name``'s block in ``docs`` from results ``doc``."""
    text = docs.read_text()
    new = replace_block(text, name, render_block(name, doc, render))
    if new != text:
        docs.write_text(new)


def publish_docs(
    name: str,
    doc: dict[str, Any],
    *,
    render: Callable[[dict[str, Any]], str],
    results_path: Path,
    quick: bool = False,
    force: bool = False,
) -> bool:
    """After a benchmark wrote ``results_path``: rewrite its docs block when these are the
    committed results (``benchmarks/results/<name>.json`` of a full run), or when ``force``
    (a script's ``--update-docs``). Returns whether it did; raises :class:`DocsBlockError`
    (after the results files are written) when the markers are missing."""
    committed = (
        Path(results_path).resolve() == (RESULTS_DIR / f"{name}.json").resolve() and not quick
    )
    if not (committed or force):
        return False
    update_docs(name, doc, render=render)
    print(f"updated the {name} block of {DOCS_PATH.relative_to(REPO_ROOT)}", file=sys.stderr)
    return True


def run_header(module: str, argv: Sequence[str] | None, config: Any) -> dict[str, Any]:
    """The start of a results document: the command line (``python -m module args``), when,
    the git commit, ``config`` (a dataclass) and the machine (CPUs, load, kernel, Python,
    memory, which fastckpt)."""
    import datetime
    import platform

    import fastckpt

    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    ).stdout.strip()
    return {
        "command": " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)]),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git,
        "config": dataclasses.asdict(config),
        "machine": {
            "cpus": os.cpu_count(),
            "load_start": os.getloadavg(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
            "fastckpt": fastckpt.__file__,
        },
    }


def write_results(
    name: str,
    doc: dict[str, Any],
    out_dir: Path,
    *,
    report: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None],
    quick: bool,
    update_docs: bool,
) -> int:
    """Write ``<name>.{json,md,png}`` (``<name>_quick.*`` when ``quick``) to ``out_dir``,
    rewrite the docs block for the committed full run (:func:`publish_docs`), print the report;
    the exit status: 1 if a row of ``doc["checks"]`` failed, else 0."""
    stem = f"{name}_quick" if quick else name
    md = report(doc)
    write_json(out_dir / f"{stem}.json", doc)
    (out_dir / f"{stem}.md").write_text(md)
    plot(doc, out_dir / f"{stem}.png")
    publish_docs(
        name,
        doc,
        render=report,
        results_path=out_dir / f"{stem}.json",
        quick=quick,
        force=update_docs,
    )
    print(md)
    return 0 if all(c["pass"] for c in doc["checks"]) else 1


def render_docs(*, check: bool = False, docs: Path = DOCS_PATH) -> list[str]:
    """Regenerate every block of ``docs`` from the committed ``benchmarks/results/<name>.json``
    (no benchmark runs). With ``check``, write nothing. Returns the names whose block changed
    (or would change); a benchmark without committed JSON keeps its block."""
    text = docs.read_text()
    changed = []
    for name in DOCS_BLOCKS:
        path = RESULTS_DIR / f"{name}.json"
        if not path.exists():
            replace_block(text, name, "")  # the markers must still be there
            continue
        new = replace_block(text, name, render_block(name, json.loads(path.read_text())))
        if new != text:
            changed.append(name)
            text = new
    if changed and not check:
        docs.write_text(text)
    return changed


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m benchmarks._common", description="benchmark helpers"
    )
    p.add_argument(
        "--render-docs",
        action="store_true",
        help="rewrite every results block of docs/benchmarks.md from benchmarks/results/*.json",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="with --render-docs: write nothing, exit 1 if a block is stale",
    )
    args = p.parse_args(argv)
    if not args.render_docs:
        p.error("nothing to do (--render-docs)")
    changed = render_docs(check=args.check)
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(changed)}" if changed else "every block is current")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(_main())
