"""Host-platform adjustments made before MLX is imported (OpenBLAS preload on Linux CPU)."""

from engine.platform.openblas import (
    Backend,
    ReexecDecision,
    blas_report,
    detect_backend,
    find_openblas,
    install_command,
    maybe_reexec_with_openblas,
    openblas_preloaded,
    reexec_decision,
    reexec_notice,
    should_reexec,
    slow_blas,
)

__all__ = [
    "Backend",
    "ReexecDecision",
    "blas_report",
    "detect_backend",
    "find_openblas",
    "install_command",
    "maybe_reexec_with_openblas",
    "openblas_preloaded",
    "reexec_decision",
    "reexec_notice",
    "should_reexec",
    "slow_blas",
]
