"""Run MLX's CPU matmul on OpenBLAS by re-executing the process once with it preloaded.

The mlx-cpu wheel bundles netlib's reference BLAS (about 6 GFLOP/s); OpenBLAS
interposed through ``LD_PRELOAD`` runs the same MLX matmul about 30x faster
(results agree to float32 rounding, not bit for bit). The dynamic loader reads ``LD_PRELOAD`` only when a
process starts, so the entry point re-executes itself once with the variable
set. Everything here is decided without importing mlx: the exec would throw
that work away.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

PATH_ENV = "SEMANTIC_OPENBLAS_PATH"
"""Explicit OpenBLAS ``libblas.so.3`` to preload instead of the system one."""
REEXEC_ENV = "SEMANTIC_OPENBLAS_REEXEC"
"""Set to ``1`` in the re-executed process so it never re-executes again."""
PRELOADED_ENV = "SEMANTIC_OPENBLAS_PRELOADED"
"""The library the re-executed process was given, for its log line."""
BACKEND_ENV = "SEMANTIC_BACKEND"
"""Overrides backend detection: ``cpu``, ``cuda`` or ``metal``."""

SYSTEM_LIB_DIR = Path("/usr/lib")
# Debian/Ubuntu's libopenblas0-pthread (or -openmp) installs a drop-in
# libblas.so.3 under /usr/lib/<multiarch>/openblas-<threading>/.
OPENBLAS_VARIANTS = ("openblas-pthread", "openblas-openmp")
MULTIARCH = {
    "x86_64": "x86_64-linux-gnu",
    "amd64": "x86_64-linux-gnu",
    "aarch64": "aarch64-linux-gnu",
    "arm64": "aarch64-linux-gnu",
}
# Backend wheels of `mlx[cuda13]` / `mlx[cuda12]`; with either installed MLX runs on the GPU.
CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12")
INSTALL_HINT = "install libopenblas0-pthread or set SEMANTIC_OPENBLAS_PATH"


class Backend(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    METAL = "metal"


@dataclass(frozen=True, slots=True)
class ReexecDecision:
    """Whether to re-execute, why, and whether the user should hear about a no."""

    reexec: bool
    reason: str
    library: Path | None = None
    warn: bool = False


# -- what is installed and loaded ----------------------------------------------------


def detect_backend() -> Backend:
    """The MLX backend this process will get, judged from installed wheels."""
    override = os.environ.get(BACKEND_ENV, "").strip().lower()
    if override:
        try:
            return Backend(override)
        except ValueError:
            choices = ", ".join(b.value for b in Backend)
            raise ValueError(f"{BACKEND_ENV} must be one of {choices}, got {override!r}") from None
    if sys.platform == "darwin":
        return Backend.METAL
    return Backend.CUDA if any(map(_distribution_installed, CUDA_DISTRIBUTIONS)) else Backend.CPU


def _distribution_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def find_openblas() -> Path | None:
    """The OpenBLAS library to preload: ``$SEMANTIC_OPENBLAS_PATH``, else the system one."""
    explicit = os.environ.get(PATH_ENV, "").strip()
    if explicit:
        # An explicit path that is wrong must not silently fall back elsewhere.
        path = Path(explicit).expanduser()
        return path if path.is_file() else None
    multiarch = MULTIARCH.get(platform.machine().lower())
    if multiarch is None:
        return None
    for variant in OPENBLAS_VARIANTS:
        candidate = SYSTEM_LIB_DIR / multiarch / variant / "libblas.so.3"
        if candidate.is_file():
            return candidate
    return None


def preloaded_openblas() -> Path | None:
    """The OpenBLAS entry of ``LD_PRELOAD``, if any."""
    # ld.so separates LD_PRELOAD entries with colons or spaces.
    entries = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    found = find_openblas()
    for entry in entries:
        if "openblas" in entry.lower() or (found is not None and _same_file(entry, found)):
            return Path(entry)
    return None


def openblas_preloaded() -> bool:
    return preloaded_openblas() is not None


def _same_file(entry: str, library: Path) -> bool:
    try:
        return os.path.samefile(entry, library)
    except OSError:
        return False


def active_openblas() -> Path | None:
    """The OpenBLAS this process really uses: preloaded *and* mapped by the loader.

    Where ``/proc/self/maps`` cannot be read, LD_PRELOAD is taken at its word.
    """
    preloaded = preloaded_openblas()
    if preloaded is None:
        # An OpenBLAS mapped without the preload (numpy's bundled libscipy_openblas) serves numpy, not MLX.
        return None
    mapped = _mapped_files()
    if mapped is None:
        return preloaded
    resolved = os.path.realpath(preloaded)
    # Name the library the way it was asked for; the maps hold resolved paths.
    return preloaded if any(f == resolved or _same_file(f, preloaded) for f in mapped) else None


def _mapped_files() -> list[str] | None:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    # Each line: address perms offset dev inode [pathname]
    fields = (line.split(maxsplit=5) for line in maps.splitlines())
    return [f[5] for f in fields if len(f) == 6 and f[5].startswith("/")]


# -- the decision ----------------------------------------------------------------------


def reexec_decision(enabled: bool) -> ReexecDecision:
    """Whether this process should re-execute itself with OpenBLAS preloaded."""
    if not enabled:
        return ReexecDecision(False, "disabled by settings (preload_openblas)")
    if sys.platform != "linux":
        return ReexecDecision(False, f"not Linux ({sys.platform})")
    if os.environ.get(REEXEC_ENV) == "1":
        return ReexecDecision(False, "already re-executed once")
    backend = detect_backend()
    if backend is not Backend.CPU:
        return ReexecDecision(False, f"MLX runs on the {backend.value} backend")
    if openblas_preloaded():
        return ReexecDecision(False, "OpenBLAS is already in LD_PRELOAD")
    library = find_openblas()
    if library is None:
        return ReexecDecision(False, _missing_library_reason(), warn=True)
    if not sys.executable:
        return ReexecDecision(False, "no interpreter path to re-execute", warn=True)
    return ReexecDecision(True, f"preloading {library}", library)


def should_reexec(enabled: bool) -> bool:
    return reexec_decision(enabled).reexec


def _missing_library_reason() -> str:
    explicit = os.environ.get(PATH_ENV, "").strip()
    if explicit:
        return f"{PATH_ENV}={explicit} is not a file; MLX keeps its bundled reference BLAS"
    return (
        "slow BLAS: OpenBLAS not found; MLX keeps its bundled reference BLAS "
        f"(about 30x slower matmul). Install it: {install_command()}"
    )


def install_command() -> str:
    """The exact command that installs the OpenBLAS ``find_openblas`` looks for, on this machine."""
    sudo = "" if hasattr(os, "geteuid") and os.geteuid() == 0 else "sudo "
    for manager in ("/usr/bin/apt-get", "/bin/apt-get"):
        if os.path.exists(manager):
            return f"{sudo}apt-get install -y libopenblas0-pthread"
    return f"install OpenBLAS and set {PATH_ENV} to its libblas.so.3 (or libopenblas.so)"


def slow_blas() -> bool:
    """MLX's matmul runs on the bundled reference BLAS: Linux, CPU backend, OpenBLAS not loaded."""
    return sys.platform == "linux" and detect_backend() is Backend.CPU and active_openblas() is None


# -- the re-exec -------------------------------------------------------------------------


def maybe_reexec_with_openblas(
    argv: list[str], enabled: bool, log: Callable[[str], None], warn: Callable[[str], None] | None = None
) -> None:
    """Replace this process with itself plus OpenBLAS preloaded, when worth it.

    Call it first thing in the entry point, with ``sys.argv`` (``argv[1:]`` are
    passed on). In the re-executed process it logs the notice and returns; it
    also logs when Linux CPU users run without OpenBLAS. Otherwise it returns
    silently, or never returns because the process was replaced. An invalid
    ``SEMANTIC_BACKEND`` raises ValueError. ``warn`` (default ``log``) hears
    what the user must act on: a slow BLAS, with the command that fixes it.
    """
    notice = reexec_notice()
    if notice is not None:
        log(notice)
        return
    decision = reexec_decision(enabled)
    if decision.warn:
        (warn or log)(decision.reason)
    if not decision.reexec or decision.library is None:
        return
    # exec discards Python's unflushed buffers: anything printed so far would vanish.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, reexec_argv(argv), reexec_environ(decision.library, os.environ))


def reexec_argv(argv: list[str]) -> list[str]:
    """The command line that starts this same program again with ``argv[1:]``.

    ``sys.orig_argv`` keeps how the interpreter was launched (a console
    script's path, ``-m package.module``, ``-X`` options); its program
    arguments are the tail that ``sys.argv`` also holds, so the launch part is
    everything before that tail.
    """
    program_args = len(sys.argv) - 1
    launch = sys.orig_argv[: len(sys.orig_argv) - program_args]
    return [sys.executable, *launch[1:], *argv[1:]]


def reexec_environ(library: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``library`` first in LD_PRELOAD and the loop guard set."""
    env = dict(environ)
    existing = env.get("LD_PRELOAD", "").strip()
    env["LD_PRELOAD"] = f"{library}:{existing}" if existing else str(library)
    env[REEXEC_ENV] = "1"
    env[PRELOADED_ENV] = str(library)
    from engine.distributed.local_ranks import blas_threads

    threads = blas_threads(env)  # ranks of one mlx.launch run sharing this host split its cores
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env.setdefault("NUMBA_NUM_THREADS", str(threads))  # numba's team, sized once at its first parallel call
    return env


def reexec_notice() -> str | None:
    """The log line of a process that was re-executed with OpenBLAS; None otherwise."""
    library = os.environ.get(PRELOADED_ENV)
    if os.environ.get(REEXEC_ENV) != "1" or not library:
        return None
    if active_openblas() is None:
        # ld.so only warns on stderr when a preload fails; say it plainly.
        return f"OpenBLAS preload of {library} did not load (re-exec); MLX uses its bundled BLAS"
    threads = os.environ.get("OPENBLAS_NUM_THREADS")
    return f"OpenBLAS preloaded from {library} (re-exec{f', {threads} BLAS threads' if threads else ''})"


# -- reporting ---------------------------------------------------------------------------


def blas_report() -> dict[str, str | None]:
    """Which BLAS MLX's matmul uses in this process, for the stats endpoint."""
    backend = detect_backend()
    if backend is Backend.METAL:
        return _report(backend, "Accelerate", None, "system")
    if backend is Backend.CUDA:
        return _report(backend, "cuBLAS", None, "mlx-cuda")
    active = active_openblas()
    if active is None:
        return _report(backend, "bundled reference BLAS", None, "mlx-cpu wheel")
    source = "re-exec" if os.environ.get(REEXEC_ENV) == "1" else "LD_PRELOAD"
    return _report(backend, "OpenBLAS", str(active), source)


def _report(
    backend: Backend, blas: str, library: str | None, source: str
) -> dict[str, str | None]:
    return {"backend": backend.value, "blas": blas, "library": library, "source": source}
